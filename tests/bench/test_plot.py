"""The PNG of a `bench tail` report (rollingkv_cli/bench/plot.py): the figure holds the report's numbers. matplotlib is
in the test extra, so this runs in CI."""

from __future__ import annotations

import pytest

from rollingkv_cli.bench import arithmetic as bm


def _doc(gbps=2.0):
    def cell(kind, tps, tail_type=None, tail=0.0, **kw):
        return {"kind": kind, "depth": 1024, "status": "ok", "tokens_per_s": tps, "tail_type": tail_type,
                "tail_bytes_per_token": tail, **kw}

    cells = [cell("resident", 100.0), cell("window", 80.0, "f16", 2e6), cell("window", 60.0, "f16", 4e6),
             cell("window", 90.0, "q4_0", 1.1e6), cell("auto", 99.0), cell("vanilla_ngl", 20.0, host_kv_bytes_per_token=3e6, n_gpu_layers=12),
             cell("vanilla_nkvo", 5.0, host_kv_bytes_per_token=6e6), {"kind": "window", "depth": 1024, "status": "failed", "tail_type": "f16"}]
    return {"config": {"depths": [1024], "tail_types": ["f16", "q4_0"]}, "bandwidth": {"gbps": gbps}, "cells": cells,
            "build": {"backend": "CPU"}, "model": {"path": "/m/demo.gguf"}}


@pytest.fixture
def drawn(monkeypatch, tmp_path):
    """render()'s figure, kept when pyplot closes it."""
    import matplotlib.pyplot as plt

    from rollingkv_cli.bench import plot

    figs = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figs.append(fig), close(fig)))

    def draw(doc):
        out = plot.render(doc, tmp_path / "sub" / "r.png")
        return out, figs[-1]
    return draw


def test_the_figure_holds_the_reports_numbers(drawn):
    """Series per tail type (MB, tokens/s) in tail-bytes order, the vanilla points, both floors from t_res = 1/100 s
    and 2 GB/s, a failed cell left out. Fails when a cell is drawn at the wrong place or a floor is missing."""
    out, fig = drawn(_doc())
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (ax,) = fig.axes
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert lines["tail f16"].get_xdata().tolist() == [2.0, 4.0] and lines["tail f16"].get_ydata().tolist() == [80.0, 60.0]
    assert lines["tail q4_0"].get_xdata().tolist() == [1.1] and lines["tail q4_0"].get_ydata().tolist() == [90.0]
    serial, stretch = lines["floor t_res + bytes/2 GB/s"], lines["stretch max(t_res, bytes/bw)"]
    x_mb = serial.get_xdata()[-1]
    assert x_mb == pytest.approx(6.0)  # the largest host bytes of any cell
    assert serial.get_ydata()[-1] == pytest.approx(1 / bm.floors(0.01, 6e6, 2e9)[0])
    assert stretch.get_ydata()[-1] == pytest.approx(1 / bm.floors(0.01, 6e6, 2e9)[1])
    points = {c.get_label(): c.get_offsets().tolist() for c in ax.collections}
    assert points["resident (off)"] == [[0.0, 100.0]] and points["auto"] == [[0.0, 99.0]]
    assert points["vanilla -ngl 12 (same VRAM)"] == [[3.0, 20.0]] and points["vanilla -nkvo 1"] == [[6.0, 5.0]]
    assert ax.get_yscale() == "log" and "depth 1024" in ax.get_title() and "demo.gguf" in ax.get_title()


def test_without_a_bandwidth_no_floor_is_drawn(drawn):
    _, fig = drawn(_doc(gbps=None))
    (ax,) = fig.axes
    assert not [ln for ln in ax.get_lines() if "floor" in ln.get_label()]
    assert any("floors not drawn" in t.get_text() for t in ax.texts)


def _hybrid_doc():
    doc = _doc()

    def cell(tps, tail_type, tail, frac):
        return {"kind": "hybrid", "depth": 1024, "status": "ok", "tokens_per_s": tps, "tail_type": tail_type, "tail_bytes_per_token": tail,
                "cpu_frac": frac}

    doc["cells"] += [cell(95.0, "f16", 2e6, "auto"), cell(85.0, "f16", 4e6, "auto"), cell(70.0, "f16", 4e6, 0.25),
                     cell(92.0, "q4_0", 1.1e6, "auto"), {"kind": "hybrid", "depth": 1024, "status": "timeout", "tail_type": "f16",
                                                          "cpu_frac": 0.25}]
    doc["cpu_attn"] = {"gbps": {"f16": 3.0, "q4_0": None}}
    return doc


def test_the_hybrid_cells_and_their_floor(drawn):
    """One series per tail type and CPU fraction (a failed cell left out), and the third floor from t_res = 1/100 s,
    2 GB/s of link and the f16 CPU attention's 3 GB/s: max(t_res, bytes/5 GB/s) and t_res + bytes/5 GB/s; none for
    q4_0, whose CPU figure is null. Fails when a hybrid point is misplaced or the floor uses another bandwidth."""
    _, fig = drawn(_hybrid_doc())
    (ax,) = fig.axes
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    auto, fixed = lines["hybrid f16, CPU auto"], lines["hybrid f16, CPU 25%"]
    assert auto.get_xdata().tolist() == [2.0, 4.0] and auto.get_ydata().tolist() == [95.0, 85.0]
    assert fixed.get_xdata().tolist() == [4.0] and fixed.get_ydata().tolist() == [70.0]
    assert lines["hybrid q4_0, CPU auto"].get_ydata().tolist() == [92.0]
    assert lines["tail f16"].get_ydata().tolist() == [80.0, 60.0]  # the GPU-only series is unchanged
    over = lines["hybrid floor f16: max(t_res, bytes/(bw + 3 GB/s CPU))"]
    serial = lines["hybrid serial f16: t_res + bytes/(bw + cpu)"]
    assert over.get_xdata()[-1] == pytest.approx(6.0)
    assert over.get_ydata()[-1] == pytest.approx(1 / max(0.01, 6e6 / 5e9)) == pytest.approx(1 / bm.hybrid_floors(0.01, 6e6, 2e9, 3e9)[1])
    assert serial.get_ydata()[-1] == pytest.approx(1 / (0.01 + 6e6 / 5e9))
    assert serial.get_ydata()[-1] > lines["floor t_res + bytes/2 GB/s"].get_ydata()[-1]  # above the link-only one
    assert not [k for k in lines if k.startswith("hybrid floor q4_0") or k.startswith("hybrid serial q4_0")]


def test_no_hybrid_floor_without_a_cpu_figure(drawn):
    doc = _hybrid_doc()
    doc["cpu_attn"] = {"gbps": None, "error": "not measured"}
    _, fig = drawn(doc)
    (ax,) = fig.axes
    labels = [ln.get_label() for ln in ax.get_lines()]
    assert "hybrid f16, CPU auto" in labels and not [x for x in labels if x.startswith("hybrid floor") or x.startswith("hybrid serial")]


def test_head_cells_are_a_series_of_their_own(drawn):
    """The head split's cells (kind head) per tail type, in tail-bytes order, apart from the window series; a failed one
    left out."""
    doc = _doc()

    def cell(tps, tail, status="ok"):
        return {"kind": "head", "depth": 1024, "status": status, "tokens_per_s": tps, "tail_type": "f16", "tail_bytes_per_token": tail,
                "device_heads": 4}

    doc["cells"] += [cell(55.0, 4.2e6), cell(81.0, 1.9e6), cell(70.0, 3e6, "timeout")]
    _, fig = drawn(doc)
    (ax,) = fig.axes
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert lines["head split f16"].get_xdata().tolist() == [1.9, 4.2] and lines["head split f16"].get_ydata().tolist() == [81.0, 55.0]
    assert lines["tail f16"].get_ydata().tolist() == [80.0, 60.0] and "head split q4_0" not in lines
