"""The link measurement (hw/link_bw.py): the child that runs libllama's llama_rolling_kv_measure_link, on stand-in
libraries compiled here (the sizes and copies it passes, the figures it files, the link read under load through NVML,
each status as one line) and on the real CPU build (no GPU: its status, and `probe pcie` warning once and planning
with the theoretical figure). On a GPU: tests/test_gpu.py::test_probe_pcie_measures_the_link."""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rollingkv_cli.hw import link_bw, pcie, profile
from rollingkv_cli.lib import llama_ext
from test_cli import run_main
from hw.test_pcie import BUS, env, link  # noqa: F401  (the fixture: an isolated cache and a fake NVML)

REPO = Path(__file__).resolve().parents[2]
HEADER = REPO / "native" / "include" / "llama-rolling-kv.h"

# A libllama that answers llama_rolling_kv_measure_link as the real one does (its struct, statuses and callback), with
# figures that encode what it was asked: MiB + copies per run / 100 host-to-device, half that back.
STANDIN = r"""
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
struct figures { char device[64]; char description[128]; char device_id[64]; double h2d[8]; double d2h[8]; };
static const char * last = "";
const char * llama_rolling_kv_build_info(void) { return "rollingkv api=API pin=stand-in series=0"; }
int llama_rolling_kv_api_version(void) { return API; }
const char * llama_rolling_kv_last_error(void) { return last; }
#if API >= 9
int llama_rolling_kv_measure_link(const char * device, const size_t * sizes, const int32_t * reps, int32_t n,
                                  void (*under_load)(void *), void * user, struct figures * out) {
    memset(out, 0, sizeof *out);
    if (MODE == 1) { last = "this library sees no GPU (stand-in)"; return 1; }
    if (MODE == 2) { abort(); }
    if (device && *device && strcasecmp(device, "0000:3b:00.0") != 0) {
        last = "no GPU there among CUDA0 (0000:3b:00.0)";
        return 2;
    }
    for (int i = 0; i < n; ++i) {
        out->h2d[i] = (double) (sizes[i] >> 20) + reps[i] / 100.0;
        out->d2h[i] = out->h2d[i] / 2;
    }
    if (under_load) under_load(user);
    strcpy(out->device, "CUDA0");
    strcpy(out->description, "Stand-in GPU");
    strcpy(out->device_id, "0000:3b:00.0");
    return 0;
}
#endif
"""

# NVML for the child (its own process): GPU 2 reads Gen5 x16; any other index is not supported
FAKE_NVML = """
class NVMLError(Exception):
    pass
def nvmlInit():
    pass
def nvmlShutdown():
    pass
def nvmlDeviceGetHandleByIndex(i):
    return i
def _get(v):
    def get(h):
        if h != 2:
            raise NVMLError("Not Supported")
        return v
    return get
nvmlDeviceGetCurrPcieLinkGeneration = _get(5)
nvmlDeviceGetCurrPcieLinkWidth = _get(16)
"""


def standin(tmp_path: Path, api: int = 9, mode: int = 0) -> Path:
    d = tmp_path / f"lib-api{api}-mode{mode}"
    d.mkdir()
    src = d / "standin.c"
    src.write_text(STANDIN.replace("API", str(api)).replace("MODE", str(mode)))
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler builds the stand-in library (the CI image has one: it builds llama.cpp)"
    subprocess.run([cc, "-shared", "-fPIC", "-O0", "-o", str(d / "libllama.so"), str(src)], check=True, capture_output=True)
    return d


@pytest.fixture
def child_nvml(tmp_path, monkeypatch):
    """The fake NVML above first on the child's path."""
    d = tmp_path / "fake-nvml"
    d.mkdir()
    (d / "pynvml.py").write_text(FAKE_NVML)
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(d), str(REPO), os.environ.get("PYTHONPATH", "")]))


def gpu(index: int = 2, bus: str = BUS) -> pcie.GpuInfo:
    return pcie.GpuInfo(index, "NVIDIA Stand-in", f"GPU-{index}", "580.1", bus, cur_gen=1, cur_width=16, max_gen=5,
                        max_width=16)


def test_the_child_files_the_library_figures_and_the_link_under_load(tmp_path, child_nvml):
    lib = standin(tmp_path)
    e = link_bw.measure(lib, gpu())
    # the sizes and copies per run arrive as 1/16/256 MiB and 20/10/5 copies, in that order
    assert e["h2d"] == {"1": 1.2, "16": 16.1, "256": 256.05} and e["d2h"] == {"1": 0.6, "16": 8.05, "256": 128.025}
    assert e["link_under_load"] == {"gen": 5, "width": 16}  # NVML read for this GPU's index, during the callback
    assert e["link_idle"] == {"gen": 1, "width": 16}
    assert e["lib"] == str(lib / "libllama.so") and e["backend_device"] == "CUDA0" and "stand-in" in e["build_info"]
    assert e["uuid"] == "GPU-2" and e["pci_bus_id"] == BUS and e["measured_at"]
    assert link_bw.measured_with(e) == f"{lib / 'libllama.so'} (CUDA0)"
    # what the planner reads of it: the 256 MiB host-to-device figure
    assert profile._valid_entry(e)


def test_the_link_is_read_only_for_the_gpu_measured(tmp_path, child_nvml):
    e = link_bw.measure(standin(tmp_path), gpu(index=0))  # NVML supports no link query for GPU 0
    assert e["link_under_load"] == {"gen": None, "width": None}


def test_the_gpu_is_found_by_its_bus_id(tmp_path, child_nvml):
    with pytest.raises(link_bw.Unavailable) as e:
        link_bw.measure(standin(tmp_path), gpu(bus="00000000:5E:00.0"))
    assert e.value.kind == "not_found" and not e.value.per_build and "0000:3b:00.0" in e.value.message


@pytest.mark.parametrize("api,mode,kind,words", [
    (9, 1, "no_gpu", "sees no GPU"),
    (8, 0, "no_function", "predates the link measurement (rolling-KV API 8"),
])
def test_a_build_that_cannot_measure_says_why(tmp_path, child_nvml, api, mode, kind, words):
    with pytest.raises(link_bw.Unavailable) as e:
        link_bw.measure(standin(tmp_path, api, mode), gpu())
    assert e.value.kind == kind and e.value.per_build and words in e.value.message and "\n" not in e.value.message


def test_no_build_no_library_and_a_dying_child_are_one_line(tmp_path, child_nvml):
    with pytest.raises(link_bw.Unavailable) as e:
        link_bw.measure(None, gpu())
    assert e.value.kind == "no_build" and e.value.per_build
    with pytest.raises(link_bw.Unavailable) as e:
        link_bw.measure(tmp_path, gpu())
    assert e.value.kind == "load" and "no libllama.so" in e.value.message
    with pytest.raises(link_bw.Unavailable) as e:
        link_bw.measure(standin(tmp_path, 9, 2), gpu())  # the library aborts
    assert e.value.kind == "failed" and "link measurement failed" in e.value.message and "\n" not in e.value.message


def test_figures_that_cannot_be_filed_are_refused():
    good = {"h2d": {"1": 1.0, "16": 2.0, "256": 3.0}, "d2h": {"1": 1.0, "16": 2.0, "256": 3.0}}
    assert link_bw.parse_child_output(0, "noise\n" + json.dumps(good) + "\n", "")["h2d"]["256"] == 3.0
    for bad in ({**good, "h2d": {"1": 1.0, "16": 0.0, "256": 3.0}}, {**good, "d2h": {"256": 3.0}}):
        with pytest.raises(link_bw.Unavailable, match="no usable"):
            link_bw.parse_child_output(0, json.dumps(bad) + "\n", "")
    with pytest.raises(link_bw.Unavailable, match=r"failed \(exit status -11\): Segmentation fault"):
        link_bw.parse_child_output(-11, "", "loading...\nSegmentation fault\n")


def test_the_ctypes_mirror_follows_the_header():
    """LinkFigures lists the header's fields, sizes and order; the statuses and the most sizes are the header's."""
    text = HEADER.read_text()
    body = re.sub(r"//[^\n]*", "", re.search(r"struct llama_rolling_kv_link_figures\s*\{(.*?)\};", text, re.S).group(1))
    fields = re.findall(r"(char|double)\s+(\w+)\[(\w+)\]\s*;", body)
    assert [f[1] for f in fields] == [f[0] for f in llama_ext.LinkFigures._fields_]
    n = int(re.search(r"#define\s+LLAMA_ROLLING_KV_LINK_MAX_SIZES\s+(\d+)", text).group(1))
    assert n == llama_ext.LINK_MAX_SIZES
    for (ctype, name, count), (_, pytype) in zip(fields, llama_ext.LinkFigures._fields_):
        want = {"char": ctypes.c_char, "double": ctypes.c_double}[ctype]
        assert pytype._type_ is want and pytype._length_ == (n if count == "LLAMA_ROLLING_KV_LINK_MAX_SIZES" else int(count))
    statuses = dict((m.group(1), int(m.group(2))) for m in re.finditer(r"LLAMA_ROLLING_KV_LINK_(\w+)\s*=\s*(\d+)", text))
    assert statuses == {"OK": llama_ext.LINK_OK, "NO_GPU": llama_ext.LINK_NO_GPU, "NOT_FOUND": llama_ext.LINK_NOT_FOUND,
                        "FAILED": llama_ext.LINK_FAILED}
    decl = re.search(r"int32_t\s+llama_rolling_kv_measure_link\s*\(([^;]*)\)\s*;", text, re.S).group(1)
    assert len(decl.split(",")) == len(llama_ext.LINK_ARGTYPES) == 7


# ------------------------------------------------------------------------------------- the real CPU build


@pytest.mark.build
def test_the_cpu_build_sees_no_gpu(cpu_build, child_nvml):
    """The real library without a GPU backend: its status, as one line the probe can pass on."""
    with pytest.raises(link_bw.Unavailable) as e:
        link_bw.measure(cpu_build.lib_dir, gpu())
    assert e.value.kind == "no_gpu" and e.value.per_build
    assert "sees no GPU" in e.value.message and "\n" not in e.value.message


@pytest.mark.build
def test_probe_pcie_with_a_cpu_build_warns_once_and_plans_with_the_line_rate(cpu_build, env, capsys, monkeypatch):  # noqa: F811
    """NVML (faked) sees two GPUs but the active build has no GPU backend: one warning, no link cached, exit 0."""
    env([link(5, 16), link(4, 16, uuid="GPU-b", bus="00000000:5E:00.0")])
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    code, out, err = run_main(["probe", "pcie", "--json"], capsys)
    assert code == 0, err
    gpus = json.loads(out)["gpus"]
    assert [g["measured"] for g in gpus] == [None, None]
    assert all("sees no GPU" in g["measure_error"] for g in gpus)
    assert [g["resolved"]["tier"] for g in gpus] == ["theoretical", "theoretical"]
    assert " ".join(err.split()).count("not measuring, theoretical figures only") == 1 and "build --cuda" in err
    assert profile.load_profile() == {}  # no link entry (the CPU attention part is measured: the build has one)
