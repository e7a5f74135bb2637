"""`rollingkv probe pcie` and rollingkv_cli.hw.pcie without a GPU: NVML and sysfs are faked, and there is no build to
measure the link with (the measurement itself: test_link_bw.py)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from rollingkv_cli.hw import link_bw, pcie, profile
from rollingkv_cli.console import RollingKVError
from test_cli import run_main

BUS = "00000000:3B:00.0"
SYSFS_ADDR = "0000:3b:00.0"


class FakeNVMLError(Exception):
    pass


def fake_nvml(gpus: list[dict] | None = None, init_error: str | None = None, driver: str = "580.159.04") -> types.ModuleType:
    """A stand-in for pynvml: each GPU a dict; a link field left out raises like NVML's NotSupported."""
    gpus = gpus or []
    m = types.ModuleType("pynvml")

    def init():
        if init_error:
            raise FakeNVMLError(init_error)

    def field(key):
        def get(h):
            if gpus[h].get(key) is None:
                raise FakeNVMLError("Not Supported")
            return gpus[h][key]
        return get

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlSystemGetDriverVersion = lambda: driver
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: gpus[h].get("name", "NVIDIA Fake")
    m.nvmlDeviceGetUUID = lambda h: gpus[h].get("uuid", f"GPU-fake-{h}")
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=gpus[h].get("bus", BUS).encode())
    m.nvmlDeviceGetCurrPcieLinkGeneration = field("cur_gen")
    m.nvmlDeviceGetCurrPcieLinkWidth = field("cur_width")
    m.nvmlDeviceGetMaxPcieLinkGeneration = field("max_gen")
    m.nvmlDeviceGetMaxPcieLinkWidth = field("max_width")
    m.nvmlDeviceGetGpuMaxPcieLinkGeneration = field("gpu_max_gen")
    return m


def link(cur_gen, cur_width, max_gen=None, max_width=None, **kw) -> dict:
    return {"cur_gen": cur_gen, "cur_width": cur_width, "max_gen": max_gen or cur_gen, "max_width": max_width or cur_width, **kw}


@pytest.fixture
def env(monkeypatch, isolated_cache, tmp_path):
    """An isolated cache (so no active build: nothing measures the link), an empty fake sysfs, no explicit bandwidth."""
    sysfs = tmp_path / "sys-bus-pci-devices"
    sysfs.mkdir()
    monkeypatch.setattr(pcie, "SYSFS_PCI_DEVICES", sysfs)
    monkeypatch.delenv("ROLLINGKV_PCIE_BW_GBPS", raising=False)

    def install(gpus=None, init_error=None):
        monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(gpus, init_error))

    install.sysfs = sysfs
    install.cache = isolated_cache
    return install


def write_sysfs(root, addr, **files):
    d = root / addr
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text + "\n")


def fake_entry(gpu: pcie.GpuInfo, h2d256=50.0, **kw) -> dict:
    e = {
        "uuid": gpu.uuid, "driver_version": gpu.driver_version, "name": gpu.name, "pci_bus_id": gpu.pci_bus_id,
        "measured_at": "2026-01-01T00:00:00Z", "measured_at_unix": 1767225600, "lib": "/fake/libllama.so",
        "build_info": "rollingkv api=9", "backend_device": "CUDA0", "backend_description": "fake", "h2d": {"1": 30.0, "16": 45.0, "256": h2d256}, "d2h": {"1": 31.0, "16": 46.0, "256": h2d256 - 1},
        "link_idle": {"gen": gpu.cur_gen, "width": gpu.cur_width}, "link_under_load": {"gen": None, "width": None},
    }
    e.update(kw)
    return e


# ------------------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize("text,gen", [
    ("2.5 GT/s PCIe", 1), ("5.0 GT/s PCIe", 2), ("8.0 GT/s PCIe", 3), ("16.0 GT/s PCIe", 4),
    ("32.0 GT/s PCIe", 5), ("64.0 GT/s PCIe", 6), ("8 GT/s", 3), ("2.5 GT/s", 1),
    ("Unknown", None), ("", None), (None, None), ("12.0 GT/s PCIe", None),
])
def test_gen_from_speed(text, gen):
    assert pcie.gen_from_speed(text) == gen


@pytest.mark.parametrize("gen,width,gbps", [
    (1, 16, 4.0), (2, 16, 8.0), (3, 8, 7.877), (3, 16, 15.754), (4, 16, 31.508), (5, 16, 63.015), (5, 8, 31.508),
    (None, 16, None), (5, None, None), (9, 16, None),
])
def test_theoretical(gen, width, gbps):
    got = pcie.theoretical_gbps(gen, width)
    assert (got is None) if gbps is None else got == pytest.approx(gbps, abs=1e-3)


def test_sysfs_address():
    assert pcie.sysfs_address("00000000:3B:00.0") == "0000:3b:00.0"
    assert pcie.sysfs_address("00000001:C1:00.1") == "0001:c1:00.1"
    assert pcie.sysfs_address("3B:00.0") == "0000:3b:00.0"


# ------------------------------------------------------------------------------------------ no GPU


@pytest.mark.parametrize("how", ["init fails", "no pynvml", "zero devices"])
def test_no_gpu_exit_3(env, capsys, monkeypatch, how):
    if how == "init fails":
        env(init_error="Driver Not Loaded")
    elif how == "no pynvml":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    else:
        env([])
    code, out, err = run_main(["probe", "pcie"], capsys)
    assert code == 3 and "no NVIDIA GPU found" in err
    code, out, err = run_main(["probe", "pcie", "--json"], capsys)
    assert code == 3
    assert json.loads(out) == {"gpus": [], "error": "no NVIDIA GPU found"}


def test_probe_pcie_json_real(capsys, isolated_cache, monkeypatch):
    """Not mocked: on a machine without an NVIDIA GPU this is the exit-3 document; with one, a real profile."""
    monkeypatch.delenv("ROLLINGKV_PCIE_BW_GBPS", raising=False)
    code, out, err = run_main(["probe", "pcie", "--json", "--no-measure"], capsys)
    doc = json.loads(out)
    if code == 3:
        assert doc == {"gpus": [], "error": "no NVIDIA GPU found"}
        assert "no NVIDIA GPU found" in err
    else:
        assert code == 0 and doc["gpus"] and doc["gpus"][0]["resolved"]["gbps"] > 0


def test_probe_pcie_json_cli_without_gpu(tmp_path):
    """The real entry point in its own process, on a machine without a GPU: an NVML whose init fails (as it does
    without the driver) is first on the path, so the result does not depend on the machine running the test."""
    import os
    import subprocess

    fake = tmp_path / "fake-nvml"
    fake.mkdir()
    (fake / "pynvml.py").write_text(
        "class NVMLError(Exception):\n    pass\n\n"
        "def nvmlInit():\n    raise NVMLError('NVML Shared Library Not Found')\n\n"
        "def nvmlShutdown():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]),
           "ROLLINGKV_CACHE_DIR": str(tmp_path / "cache"), "ROLLINGKV_OFFLINE": "1"}
    env.pop("ROLLINGKV_PCIE_BW_GBPS", None)
    proc = subprocess.run([sys.executable, "-m", "rollingkv_cli", "probe", "pcie", "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == pcie.EXIT_NO_GPU == 3
    assert json.loads(proc.stdout) == {"gpus": [], "error": "no NVIDIA GPU found"}
    assert "no NVIDIA GPU found" in proc.stderr and "Traceback" not in proc.stderr
    assert "Shared Library Not Found" in proc.stderr  # the reason NVML gave, passed on
    assert not (tmp_path / "cache" / "pcie" / "profile.json").exists()  # nothing measured, nothing cached


# ------------------------------------------------------------------------------------ link shapes


def test_gen3_x8(env, capsys):
    env([link(3, 8, name="NVIDIA A2")])
    (g,) = pcie.discover()
    assert (g.cur_gen, g.cur_width, g.max_gen, g.max_width) == (3, 8, 3, 8)
    assert not g.downtrained
    assert g.theoretical_current == pytest.approx(7.877, abs=1e-3)
    res = pcie.resolve_bandwidth(0)
    assert res.tier == "theoretical" and res.gbps == pytest.approx(7.877 * 0.85, abs=1e-3)
    code, out, _ = run_main(["probe", "pcie", "--json"], capsys)  # measuring is attempted: no build here
    assert code == 0
    d = json.loads(out)["gpus"][0]
    assert d["name"] == "NVIDIA A2" and d["link"]["current"] == {"gen": 3, "width": 8}
    assert d["theoretical_gbps"]["current"] == pytest.approx(7.877, abs=1e-3)
    assert d["measured"] is None and "no rollingkv build" in d["measure_error"]
    assert d["resolved"]["tier"] == "theoretical"


def test_gen5_x16(env, capsys):
    env([link(5, 16, gpu_max_gen=5, name="NVIDIA H200", uuid="GPU-h200")])
    (g,) = pcie.discover()
    assert g.source == {k: "nvml" for k in ("cur_gen", "cur_width", "max_gen", "max_width", "gpu_max_gen")}
    assert not g.downtrained and g.theoretical_max == pytest.approx(63.015, abs=1e-3)
    gbps, tier, detail = pcie.resolve_bandwidth(0)
    assert tier == "theoretical" and gbps == pytest.approx(53.563, abs=1e-3) and "Gen5 x16" in detail
    code, out, err = run_main(["probe", "pcie", "--no-measure"], capsys)
    assert code == 0
    assert "NVIDIA H200" in out and "now Gen5 x16" in out and "max Gen5 x16" in out
    assert "63.0" in out and "53.6" in out and "theoretical" in out
    assert "downtrained" not in out + err


@pytest.mark.parametrize("cur_gen,cur_width", [(4, 16), (5, 8), (1, 4)])
def test_downtrained(env, capsys, cur_gen, cur_width):
    env([link(cur_gen, cur_width, max_gen=5, max_width=16)])
    (g,) = pcie.discover()
    assert g.downtrained
    code, out, err = run_main(["probe", "pcie", "--no-measure", "--json"], capsys)
    assert code == 0 and json.loads(out)["gpus"][0]["link"]["downtrained"] is True
    code, out, err = run_main(["probe", "pcie", "--no-measure"], capsys)
    assert code == 0 and "downtrained" in out and f"Gen{cur_gen} x{cur_width}" in err


def test_under_load_reading_wins_over_idle(env):
    """An idle GPU reading Gen1 is not downtrained when the measurement saw Gen5 x16 under load."""
    env([link(1, 16, max_gen=5, max_width=16)])
    (g,) = pcie.discover()
    assert g.downtrained
    entry = fake_entry(g, link_under_load={"gen": 5, "width": 16})
    assert not pcie.is_downtrained(g, entry)
    assert pcie.effective_link(g, entry) == (5, 16, True)
    entry["link_under_load"] = {"gen": 4, "width": 16}
    assert pcie.is_downtrained(g, entry)


@pytest.mark.parametrize("cur_gen,cur_width,max_gen,max_width", [(4, 16, 5, 16), (5, 4, 5, 16), (3, 16, 4, 16)])
def test_downtrained_plans_with_the_current_link(env, cur_gen, cur_width, max_gen, max_width):
    """current < max: the link runs below what GPU and slot allow, and the planner's bandwidth is the current link's."""
    env([link(cur_gen, cur_width, max_gen=max_gen, max_width=max_width)])
    (g,) = pcie.discover()
    assert g.downtrained and pcie.is_downtrained(g)
    res = pcie.resolve_bandwidth(0)
    assert res.tier == "theoretical"
    assert res.gbps == pytest.approx(pcie.theoretical_gbps(cur_gen, cur_width) * pcie.EFFICIENCY, abs=1e-3)
    assert res.gbps < pcie.theoretical_gbps(max_gen, max_width) * pcie.EFFICIENCY


# ----------------------------------------------------------------------------------------- sysfs


def test_sysfs_fallback(env):
    env([{"bus": BUS}])  # NVML gives no link field at all
    write_sysfs(env.sysfs, SYSFS_ADDR, current_link_speed="16.0 GT/s PCIe", current_link_width="8",
                max_link_speed="32.0 GT/s PCIe", max_link_width="16")
    (g,) = pcie.discover()
    assert (g.cur_gen, g.cur_width, g.max_gen, g.max_width) == (4, 8, 5, 16)
    assert set(g.source.values()) == {"sysfs"} and g.downtrained
    res = pcie.resolve_bandwidth(0)
    assert res.tier == "theoretical" and res.gbps == pytest.approx(15.754 * 0.85, abs=1e-3)


_SYSFS_SPEED = {3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe", 5: "32.0 GT/s PCIe"}


@pytest.mark.parametrize("shape,cur,mx", [
    ("gen3 x8", (3, 8), (3, 8)),
    ("gen5 x16", (5, 16), (5, 16)),
    ("downtrained", (4, 8), (5, 16)),
])
def test_link_shapes_from_sysfs_only(env, capsys, shape, cur, mx):
    """NVML names the GPU but supports none of the link queries: every link field comes from the (mocked) sysfs."""
    env([{"bus": BUS, "name": f"NVIDIA {shape}"}])
    write_sysfs(env.sysfs, SYSFS_ADDR, current_link_speed=_SYSFS_SPEED[cur[0]], current_link_width=str(cur[1]),
                max_link_speed=_SYSFS_SPEED[mx[0]], max_link_width=str(mx[1]))
    (g,) = pcie.discover()
    assert (g.cur_gen, g.cur_width, g.max_gen, g.max_width) == (*cur, *mx)
    assert g.source == {k: "sysfs" for k in ("cur_gen", "cur_width", "max_gen", "max_width")}
    assert g.downtrained == (cur != mx)
    code, out, _ = run_main(["probe", "pcie", "--no-measure", "--json"], capsys)
    assert code == 0
    d = json.loads(out)["gpus"][0]
    assert d["link"]["current"] == {"gen": cur[0], "width": cur[1]} and d["link"]["max"] == {"gen": mx[0], "width": mx[1]}
    assert d["link"]["downtrained"] is (cur != mx)
    assert d["theoretical_gbps"]["current"] == pytest.approx(pcie.theoretical_gbps(*cur), abs=1e-2)
    assert d["resolved"]["tier"] == "theoretical"
    assert d["resolved"]["gbps"] == pytest.approx(pcie.theoretical_gbps(*cur) * pcie.EFFICIENCY, abs=1e-3)


def test_sysfs_fills_only_missing_fields(env):
    env([{"bus": BUS, "cur_gen": 5, "max_gen": 5}])  # widths unsupported by NVML
    write_sysfs(env.sysfs, SYSFS_ADDR, current_link_speed="2.5 GT/s PCIe", current_link_width="16",
                max_link_speed="2.5 GT/s PCIe", max_link_width="16")
    (g,) = pcie.discover()
    assert (g.cur_gen, g.cur_width, g.max_gen, g.max_width) == (5, 16, 5, 16)
    assert g.source == {"cur_gen": "nvml", "max_gen": "nvml", "cur_width": "sysfs", "max_width": "sysfs"}


def test_sysfs_unknown_values(env):
    write_sysfs(env.sysfs, SYSFS_ADDR, current_link_speed="Unknown", current_link_width="0",
                max_link_speed="garbage", max_link_width="x")
    assert pcie.read_sysfs_link(BUS) == {"cur_gen": None, "cur_width": None, "max_gen": None, "max_width": None}
    assert pcie.read_sysfs_link("00000000:99:00.0") == {"cur_gen": None, "cur_width": None, "max_gen": None, "max_width": None}


# ------------------------------------------------------------------------------------ resolution


def test_resolution_order(env, monkeypatch, capsys):
    env([link(4, 16, uuid="GPU-a")])
    (g,) = pcie.discover()
    # 3: theoretical
    res = pcie.resolve_bandwidth(0)
    assert res.tier == "theoretical" and res.gbps == pytest.approx(31.508 * 0.85, abs=1e-3)
    # 2: the measured cache beats it
    profile.save_measurement(g, fake_entry(g, h2d256=24.25))
    gbps, tier, _ = pcie.resolve_bandwidth(0)
    assert (gbps, tier) == (24.25, "measured")
    # a cache made under another driver does not count
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([link(4, 16, uuid="GPU-a")], driver="590.1"))
    assert pcie.resolve_bandwidth(0).tier == "theoretical"
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([link(4, 16, uuid="GPU-a")]))
    # 1: explicit, from the environment, beats the cache
    monkeypatch.setenv("ROLLINGKV_PCIE_BW_GBPS", "12.5")
    assert pcie.resolve_bandwidth(0)[:2] == (12.5, "explicit")
    # ... and the explicit argument beats the environment
    assert pcie.resolve_bandwidth(0, explicit="40")[:2] == (40.0, "explicit")
    assert pcie.resolve_bandwidth(0, explicit=33.0)[:2] == (33.0, "explicit")
    capsys.readouterr()
    # 4: nothing known -> 6.5 GB/s with a warning
    monkeypatch.delenv("ROLLINGKV_PCIE_BW_GBPS")
    env(init_error="Driver Not Loaded")
    res = pcie.resolve_bandwidth(0)
    assert (res.gbps, res.tier) == (6.5, "default") and "3.0 x8" in res.detail
    assert "warning:" in capsys.readouterr().err


def test_default_when_link_unknown(env, capsys):
    env([{"bus": BUS}])  # a GPU, but neither NVML nor sysfs knows its link
    res = pcie.resolve_bandwidth(0)
    assert (res.gbps, res.tier) == (6.5, "default")
    assert "6.5" in capsys.readouterr().err


def test_default_for_missing_gpu_index(env, capsys):
    env([link(5, 16)])
    res = pcie.resolve_bandwidth(3)
    assert res.tier == "default" and "no GPU 3" in res.detail
    assert "warning:" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["abc", "0", "-5", "nan", "inf", "", "12 GB/s"])
def test_bad_explicit_refused(env, bad):
    with pytest.raises(RollingKVError) as exc:
        pcie.resolve_bandwidth(0, explicit=bad)
    assert "GB/s" in exc.value.message and repr(bad) in exc.value.message


@pytest.mark.parametrize("bad", ["fast", "0", "-1"])
def test_bad_env_refused_by_cli(env, capsys, monkeypatch, bad):
    env([link(5, 16)])
    monkeypatch.setenv("ROLLINGKV_PCIE_BW_GBPS", bad)
    code, out, err = run_main(["probe", "pcie", "--no-measure"], capsys)
    assert code == 1 and "ROLLINGKV_PCIE_BW_GBPS" in err and "GB/s" in err
    with pytest.raises(RollingKVError):
        pcie.resolve_bandwidth(0)


# ----------------------------------------------------------------------------------------- cache


@pytest.mark.parametrize("content", ["{not json", json.dumps([1, 2]), json.dumps({"entries": {"k": {"h2d": "fast"}}}), "\xff\xfe"])
def test_corrupt_cache_moved_aside(env, capsys, content):
    env([link(5, 16)])
    p = profile.profile_path()
    p.parent.mkdir(parents=True)
    p.write_text(content)
    assert profile.load_profile() == {}
    assert not p.exists()
    aside = list(p.parent.glob("profile.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == content  # kept, not lost
    err = capsys.readouterr().err
    assert "warning:" in err and "moved it to" in err
    assert pcie.resolve_bandwidth(0).tier == "theoretical"


def test_corrupt_cache_cli_remeasures(env, capsys, monkeypatch):
    env([link(5, 16)])
    calls = []
    monkeypatch.setattr(link_bw, "measure", lambda lib, g: calls.append(g.index) or fake_entry(g, h2d256=55.25))
    p = profile.profile_path()
    p.parent.mkdir(parents=True)
    p.write_text('{"entries": ')
    code, out, err = run_main(["probe", "pcie", "--json"], capsys)
    assert code == 0 and calls == [0] and "warning:" in err
    d = json.loads(out)["gpus"][0]
    assert d["resolved"] == {"gbps": 55.25, "tier": "measured", "detail": d["resolved"]["detail"]}
    assert len(list(p.parent.glob("profile.json.corrupt-*"))) == 1
    assert json.loads(p.read_text())["entries"]  # a fresh, valid profile


def test_cache_reused_and_refresh(env, capsys, monkeypatch):
    env([link(5, 16, uuid="GPU-a"), link(4, 16, uuid="GPU-b", bus="00000000:5E:00.0")])
    calls = []
    monkeypatch.setattr(link_bw, "measure", lambda lib, g: calls.append(g.index) or fake_entry(g, h2d256=50.0 + g.index))
    code, out, _ = run_main(["probe", "pcie", "--json"], capsys)
    assert code == 0 and calls == [0, 1]
    assert [d["resolved"]["gbps"] for d in json.loads(out)["gpus"]] == [50.0, 51.0]
    data = json.loads(profile.profile_path().read_text())
    assert set(data["entries"]) == {"GPU-a|580.159.04", "GPU-b|580.159.04"}
    assert all(e["measured_at"] for e in data["entries"].values())
    run_main(["probe", "pcie", "--json"], capsys)
    assert calls == [0, 1]  # cached: not measured again
    run_main(["probe", "pcie", "--json", "--refresh", "--gpu", "1"], capsys)
    assert calls == [0, 1, 1]
    code, out, _ = run_main(["probe", "pcie", "--gpu", "1"], capsys)
    assert code == 0 and "H2D  30.0  45.0  51.0" in out and "D2H  31.0  46.0  50.0" in out and "measured" in out
    assert "GPU 0" not in out and "resolved 51.00 GB/s" in out
    code, _, err = run_main(["probe", "pcie", "--gpu", "7"], capsys)
    assert code == 1 and "--gpu 7" in err
    code, _, err = run_main(["probe", "pcie", "--refresh", "--no-measure"], capsys)
    assert code == 2


def test_slot_change_invalidates_cache(env):
    env([link(5, 16, uuid="GPU-a")])
    (g,) = pcie.discover()
    profile.save_measurement(g, fake_entry(g, pci_bus_id="00000000:AF:00.0"))
    assert profile.cached_measurement(g) is None


def test_no_build_warns_once_and_shows_theoretical(env, capsys):
    env([link(5, 16), link(4, 16, uuid="GPU-b", bus="00000000:5E:00.0")])
    code, out, err = run_main(["probe", "pcie"], capsys)
    err = " ".join((out + err).split())
    assert code == 0 and "theoretical" in out
    assert err.count("no rollingkv build: the link is measured by its libllama: not measuring") == 1
    assert "rollingkv build --cuda" in err
    assert not profile.profile_path().exists()


def test_an_entry_of_the_cuda_runtime_probe_still_plans(env, capsys):
    """A profile written before the measurement moved into libllama (its entries name the CUDA runtime): still the
    measured tier, and the note names what measured it."""
    env([link(5, 16)])
    (g,) = pcie.discover()
    e = fake_entry(g, h2d256=54.5)
    for k in ("lib", "build_info", "backend_device", "backend_description"):
        del e[k]
    e.update(cudart="libcudart.so.13", cudart_version="13.0", cuda_device=0)
    profile.save_measurement(g, e)
    assert pcie.resolve_bandwidth(0)[:2] == (54.5, "measured")
    code, out, err = run_main(["probe", "pcie", "--no-measure"], capsys)
    assert code == 0 and "by libcudart.so.13 (CUDA 13.0)" in " ".join((out + err).split())
