"""The CPU attention part of the per-machine profile, without a real build: the calibration child (cpu_attn.py) on a
stand-in libllama compiled here, its failures as one line, the cache next to the link figures (profile.py), and
`rollingkv probe pcie` measuring, caching, re-measuring with --refresh and showing it (NVML faked as in
test_pcie.py). The real library's calibration: tests/test_hybrid_tail.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from rollingkv_cli.hw import cpu_attn, pcie, profile
from test_cli import run_main
from hw.test_pcie import env, link  # noqa: F401  (the fixture: an isolated cache, a fake NVML, no CUDA runtime)

STANDIN = r"""
const char * llama_rolling_kv_build_info(void) { return "rollingkv api=API pin=stand-in series=0"; }
int llama_rolling_kv_api_version(void) { return API; }
#if API >= 4
/* 10 GB/s per thread for f16 (ggml type 1), 5 for q8_0 (8), unsupported (-1) for anything else */
double llama_rolling_kv_measure_cpu_attn_gbps(int n_threads, int type) {
    return type == 1 ? 10.0 * n_threads : type == 8 ? 5.0 * n_threads : -1.0;
}
#endif
"""


def _standin_lib(tmp_path: Path, api: int) -> Path:
    d = tmp_path / f"lib-api{api}"
    d.mkdir()
    src = d / "standin.c"
    src.write_text(STANDIN.replace("API", str(api)))
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler builds the stand-in library (the CI image has one: it builds llama.cpp)"
    subprocess.run([cc, "-shared", "-fPIC", "-O0", "-o", str(d / "libllama.so"), str(src)], check=True, capture_output=True)
    return d


def test_the_child_measures_every_type_through_the_library(tmp_path):
    lib = _standin_lib(tmp_path, 4)
    r = cpu_attn.measure(lib, 3)
    assert r["gbps"] == {"f16": 30.0, "q8_0": 15.0, "q4_0": None}
    assert "q4_0" in r["errors"] and "returned -1" in r["errors"]["q4_0"] and set(r["errors"]) == {"q4_0"}
    assert r["n_threads"] == 3 and r["api_version"] == 4 and "stand-in" in r["build_info"]
    r = cpu_attn.measure(lib, 2, ("q8_0",))
    assert r["gbps"] == {"q8_0": 10.0} and r["errors"] == {}


def test_a_build_before_the_hybrid_tail_says_so(tmp_path):
    with pytest.raises(cpu_attn.Unavailable) as e:
        cpu_attn.measure(_standin_lib(tmp_path, 3), 2)
    assert e.value.kind == "no_function" and "predates the hybrid tail" in e.value.message and "API 3" in e.value.message


def test_no_library_and_bad_arguments(tmp_path):
    with pytest.raises(cpu_attn.Unavailable) as e:
        cpu_attn.measure(tmp_path, 2)
    assert e.value.kind == "load" and "no libllama.so" in e.value.message
    with pytest.raises(ValueError, match="q5_0"):
        cpu_attn.measure(tmp_path, 2, ("f16", "q5_0"))


def test_a_child_that_dies_is_one_line():
    def desc(rc):
        return f"killed ({rc})"

    with pytest.raises(cpu_attn.Unavailable, match=r"failed \(killed \(-11\)\): Segmentation fault"):
        cpu_attn.parse_child_output(-11, "", "loading...\nSegmentation fault\n", desc)
    with pytest.raises(cpu_attn.Unavailable, match="calibration failed"):
        cpu_attn.parse_child_output(0, "not json\n", "", desc)
    with pytest.raises(cpu_attn.Unavailable) as e:
        cpu_attn.parse_child_output(0, json.dumps({"error": "x", "kind": "no_function"}) + "\n", "", desc)
    assert e.value.kind == "no_function"
    assert cpu_attn.parse_child_output(0, "noise\n" + json.dumps({"gbps": {"f16": 1.0}}) + "\n", "", desc)["gbps"] == {"f16": 1.0}


def test_the_part_threads_are_every_usable_cpu_but_one_not_dash_t(monkeypatch):
    """libllama's default (ggml_rkv_get_cpu_threads): the process's CPUs but one, whatever -t says; the variable sets it."""
    monkeypatch.delenv("ROLLINGKV_CPU_PART_THREADS", raising=False)
    monkeypatch.setattr(cpu_attn.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert cpu_attn.part_threads() == 15
    monkeypatch.setattr(cpu_attn.os, "sched_getaffinity", lambda pid: {3})
    assert cpu_attn.part_threads() == 1
    for raw, want in (("6", 1), ("0", 1)):  # 0: the default; either way at most the process's CPUs (here 1)
        monkeypatch.setenv("ROLLINGKV_CPU_PART_THREADS", raw)
        assert cpu_attn.part_threads() == want
    monkeypatch.setattr(cpu_attn.os, "sched_getaffinity", lambda pid: set(range(2048)))
    for raw, want in (("6", 6), ("0", 2047), ("1024", 1024)):  # 1024: libllama's most (more is refused)
        monkeypatch.setenv("ROLLINGKV_CPU_PART_THREADS", raw)
        assert cpu_attn.part_threads() == want


@pytest.mark.parametrize("raw", ["x", "-2", "1.5", "100000"])  # 100000: libllama would clamp it to 1024 (issue 27: 13)
def test_a_bad_part_threads_variable_is_one_line(monkeypatch, raw):
    """A bad value stops the CLI with one line naming the variable (libllama warns in one line and takes the default)."""
    from rollingkv_cli.console import RollingKVError

    monkeypatch.setenv("ROLLINGKV_CPU_PART_THREADS", raw)
    with pytest.raises(RollingKVError) as e:
        cpu_attn.part_threads()
    assert "ROLLINGKV_CPU_PART_THREADS" in e.value.args[0] and "\n" not in e.value.args[0]


# ------------------------------------------------------------------------------------------ the cache


RESULT = {"gbps": {"f16": 64.9, "q8_0": 36.8, "q4_0": 16.4}, "errors": {}, "build_info": "rollingkv api=4", "lib": "/x/libllama.so"}


def test_cache_per_threads_and_build_beside_the_link(env):  # noqa: F811
    env([link(5, 16)])
    (g,) = pcie.discover()
    from hw.test_pcie import fake_entry

    profile.save_measurement(g, fake_entry(g, h2d256=53.5))
    e = profile.save_cpu_attn(15, "buildA", RESULT)
    assert e["n_threads"] == 15 and e["build"] == "buildA" and e["gbps"]["f16"] == 64.9 and e["measured_at"]
    assert profile.cached_cpu_attn(15, "buildA") == e
    assert profile.cached_cpu_attn(8, "buildA") is None and profile.cached_cpu_attn(15, "buildB") is None
    # both parts survive each other's writes
    profile.save_measurement(g, fake_entry(g, h2d256=54.0))
    assert profile.cached_cpu_attn(15, "buildA") == e
    assert profile.cached_measurement(g)["h2d"]["256"] == 54.0
    data = json.loads(profile.profile_path().read_text())
    assert set(data) == {"version", "entries", "cpu_attn"} and len(data["cpu_attn"]) == 1
    assert profile.cpu_attn_gbps_for("q8_0", 15, "buildA") == (36.8, pytest.approx(profile.cpu_attn_gbps_for("q8_0", 15, "buildA")[1]))
    assert profile.cpu_attn_gbps_for(None, 15, "buildA")[0] == 64.9  # llama.cpp's default K type: f16
    gbps, why = profile.cpu_attn_gbps_for("f16", 4, "buildA")
    assert gbps is None and "4 threads" in why and "probe pcie" in why


def test_an_unsupported_type_is_not_a_figure(env):  # noqa: F811
    env([link(5, 16)])
    profile.save_cpu_attn(4, "b", {"gbps": {"f16": 20.0, "q4_0": None}, "errors": {"q4_0": "no q4_0"}})
    gbps, why = profile.cpu_attn_gbps_for("q4_0", 4, "b")
    assert gbps is None and "no q4_0" in why
    with pytest.raises(ValueError, match="no usable"):
        profile.save_cpu_attn(4, "b", {"gbps": {"f16": None}, "errors": {}})


@pytest.mark.parametrize("bad", [{"gbps": {"f16": "fast"}, "n_threads": 4, "measured_at": "t"},
                                 {"gbps": {"f16": 10.0}, "n_threads": 0, "measured_at": "t"},
                                 {"gbps": {"f16": None}, "n_threads": 4, "measured_at": "t"}, "x"])
def test_a_malformed_cpu_entry_is_dropped_not_the_link(env, capsys, bad):  # noqa: F811
    env([link(5, 16)])
    (g,) = pcie.discover()
    from hw.test_pcie import fake_entry

    p = profile.profile_path()
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"version": 1, "entries": {g.cache_key(): fake_entry(g)}, "cpu_attn": {"k": bad}}))
    assert profile.cached_measurement(g) is not None  # the link figures are kept
    assert profile.load_profile() and not list(p.parent.glob("profile.json.corrupt-*"))
    assert "malformed CPU attention entries (k)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ probe pcie


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    from rollingkv_cli.lib import builder

    b = builder.Build(tmp_path / "b1234", {"pin": "x", "series_hash": "y", "options": {"cuda": True}})
    monkeypatch.setattr(builder, "active_build", lambda required=True: b)
    return b


def _measuring(monkeypatch, result=RESULT):
    calls = []

    def fake(lib_dir, n_threads, types=cpu_attn.CPU_ATTN_TYPES, timeout=0):
        calls.append(n_threads)
        if isinstance(result, Exception):
            raise result
        return dict(result, n_threads=n_threads)

    monkeypatch.setattr(cpu_attn, "measure", fake)
    return calls


def test_probe_measures_caches_and_refreshes(env, capsys, monkeypatch, fake_build):  # noqa: F811
    env([link(5, 16)])
    monkeypatch.setattr(cpu_attn, "part_threads", lambda: 15)
    calls = _measuring(monkeypatch)
    code, out, err = run_main(["probe", "pcie", "--json"], capsys)
    assert code == 0, err
    c = json.loads(out)["cpu_attn"]
    assert calls == [15] and c["gbps"] == RESULT["gbps"] and c["source"] == "measured now" and c["n_threads"] == 15
    assert c["build"] == "b1234" and c["error"] is None and "CPU part" in c["threads_source"]
    code, out, _ = run_main(["probe", "pcie", "--json"], capsys)
    assert calls == [15] and json.loads(out)["cpu_attn"]["source"] == "cached"
    run_main(["probe", "pcie", "--json", "--refresh"], capsys)
    assert calls == [15, 15]
    code, out, _ = run_main(["probe", "pcie", "--json", "-t", "4"], capsys)  # another thread count: its own entry
    assert calls == [15, 15, 4] and json.loads(out)["cpu_attn"]["n_threads"] == 4
    code, out, _ = run_main(["probe", "pcie", "--json", "--no-measure", "-t", "7"], capsys)
    c = json.loads(out)["cpu_attn"]
    assert code == 0 and calls == [15, 15, 4] and c["gbps"] is None and "--no-measure" in c["error"]
    code, out, err = run_main(["probe", "pcie"], capsys)  # the table: the figures and where they come from
    assert code == 0 and "CPU decode attention" in out and "f16 64.9" in out and "q4_0 16.4" in out and "15 threads" in out
    assert "CPU attention: cached" in out and "b1234" in out
    code, _, err = run_main(["probe", "pcie", "-t", "0"], capsys)
    assert code == 2


def test_probe_without_a_build_or_with_an_old_one(env, capsys, monkeypatch):  # noqa: F811
    from rollingkv_cli.lib import builder

    env([link(5, 16)])
    calls = _measuring(monkeypatch)
    code, out, err = run_main(["probe", "pcie", "--json"], capsys)  # no build: the link part works, the CPU part says why
    c = json.loads(out)["cpu_attn"]
    assert code == 0 and calls == [] and c["gbps"] is None and "no rollingkv build" in c["error"]
    monkeypatch.setattr(builder, "active_build", lambda required=True: builder.Build(Path("/x/old"), {}))
    _measuring(monkeypatch, cpu_attn.Unavailable("this build predates the hybrid tail (rolling-KV API 3)", "no_function"))
    code, out, err = run_main(["probe", "pcie", "--json"], capsys)
    c = json.loads(out)["cpu_attn"]
    assert code == 0 and "predates the hybrid tail" in c["error"] and "rebuild with `rollingkv build`" in err
    assert not (profile.profile_path().exists() and json.loads(profile.profile_path().read_text()).get("cpu_attn"))


def test_probe_without_a_gpu_measures_nothing(env, capsys, monkeypatch, fake_build):  # noqa: F811
    """No NVIDIA GPU: exit 3 as before, and no CPU attention either (no host tail of a GPU to split)."""
    env([])
    calls = _measuring(monkeypatch)
    code, out, _ = run_main(["probe", "pcie", "--json"], capsys)
    assert code == 3 and json.loads(out) == {"gpus": [], "error": "no NVIDIA GPU found"} and calls == []
