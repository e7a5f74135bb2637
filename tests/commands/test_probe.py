"""`rollingkv probe pcie`'s work as functions (hw/probe.py), called without click: the report it prints as JSON and
the table printed from that same report.

Seen failing: with print_pcie_report reading the idle link instead of the one under load, the downtrained test (it said
Gen1 x16); with measure_links measuring a cached GPU, the cached test (it counted a measurement).
"""

from __future__ import annotations

import pytest

from rollingkv_cli.hw import link_bw, pcie, probe, profile

NO_CPU = {"n_threads": 2, "gbps": None, "error": "no rollingkv build"}


def gpu(index=0, cur=(4, 16), mx=(4, 16)) -> pcie.GpuInfo:
    return pcie.GpuInfo(index, f"GPU{index}", f"GPU-{index}", "580.1", f"00000000:0{index}:00.0",
                        cur_gen=cur[0], cur_width=cur[1], max_gen=mx[0], max_width=mx[1], gpu_max_gen=mx[0])


def entry(g, h2d=25.0, under_load=None) -> dict:
    return {"uuid": g.uuid, "driver_version": g.driver_version, "pci_bus_id": g.pci_bus_id, "measured_at": "2026-12-06T00:00:00Z",
            "lib": "/fake/libllama.so", "backend_device": "CUDA0", "h2d": {"1": 10.0, "16": 20.0, "256": h2d},
            "d2h": {"1": 10.0, "16": 20.0, "256": h2d}, "link_idle": {"gen": g.cur_gen, "width": g.cur_width},
            "link_under_load": under_load or {"gen": None, "width": None}}


@pytest.fixture
def clean(monkeypatch, isolated_cache):
    monkeypatch.delenv("ROLLINGKV_PCIE_BW_GBPS", raising=False)


def test_report_of_a_measured_gpu(clean):
    g = gpu()
    profile.save_measurement(g, entry(g, h2d=25.0))
    doc = probe.pcie_report([g], [g], profile.load_profile(), {}, NO_CPU)
    (d,) = doc["gpus"]
    assert d["resolved"]["tier"] == "measured" and d["resolved"]["gbps"] == pytest.approx(25.0)
    assert d["link"]["under_load"] is None and not d["link"]["downtrained"]
    assert doc["cpu_attn"] is NO_CPU and doc["profile"].endswith("profile.json")


def test_downtrained_under_load_is_said_so(clean, capsys):
    """A link that measured Gen3 x16 under load, in a Gen4 x16 slot: downtrained, and the table says why."""
    g = gpu(cur=(1, 16), mx=(4, 16))  # idle: the generation drops to save power
    profile.save_measurement(g, entry(g, under_load={"gen": 3, "width": 16}))
    doc = probe.pcie_report([g], [g], profile.load_profile(), {}, NO_CPU)
    assert doc["gpus"][0]["link"]["under_load"] == {"gen": 3, "width": 16} and doc["gpus"][0]["link"]["downtrained"]
    probe.print_pcie_report(doc)
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert "link runs at Gen3 x16 of Gen4 x16 (under load)" in text
    assert "GPU 0: resolved 25.00 GB/s (measured" in text


def test_measure_links_keeps_a_cached_measurement(clean, monkeypatch):
    g, other = gpu(0), gpu(1)
    profile.save_measurement(g, entry(g))
    measured = []
    monkeypatch.setattr(link_bw, "measure", lambda lib, x: measured.append(x.index) or entry(x, h2d=12.0))
    entries, errors = probe.measure_links([g, other], profile.load_profile(), refresh=False)
    assert measured == [1] and errors == {}
    assert profile.cached_measurement(other, entries)["h2d"]["256"] == 12.0
    probe.measure_links([g], entries, refresh=True)
    assert measured == [1, 0]


@pytest.mark.parametrize("kind,hint", [("no_build", "makes one"), ("no_gpu", "CUDA_VISIBLE_DEVICES"),
                                       ("no_function", "rebuild"), ("load", "rebuild")])
def test_a_build_that_cannot_measure_warns_once_and_records_why(clean, monkeypatch, capsys, kind, hint):
    calls = []

    def unavailable(lib, g):
        calls.append(g.index)
        raise link_bw.Unavailable(f"cannot ({kind})", kind)

    monkeypatch.setattr(link_bw, "measure", unavailable)
    _, errors = probe.measure_links([gpu(0), gpu(1)], {}, refresh=False)
    assert calls == [0] and errors == {0: f"cannot ({kind})", 1: f"cannot ({kind})"}
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("not measuring") == 1 and hint in err


def test_a_gpu_that_fails_warns_and_the_next_is_measured(clean, monkeypatch, capsys):
    def measure(lib, g):
        if g.index == 0:
            raise link_bw.Unavailable("no GPU 0000:00:00.0 among CUDA0 (0000:01:00.0)", "not_found")
        return entry(g, h2d=30.0)

    monkeypatch.setattr(link_bw, "measure", measure)
    entries, errors = probe.measure_links([gpu(0), gpu(1)], {}, refresh=False)
    assert set(errors) == {0} and profile.cached_measurement(gpu(1), entries)["h2d"]["256"] == 30.0
    assert "GPU 0: measuring failed: no GPU" in " ".join(capsys.readouterr().err.split())


def test_the_note_names_the_library_that_measured(clean, capsys):
    g = gpu()
    profile.save_measurement(g, entry(g))
    probe.print_pcie_report(probe.pcie_report([g], [g], profile.load_profile(), {}, NO_CPU))
    out = capsys.readouterr()
    assert "measured 2026-12-06T00:00:00Z by /fake/libllama.so (CUDA0)" in " ".join((out.out + out.err).split())
