"""The arithmetic of `bench tail` (rollingkv_cli/bench/arithmetic.py): windows, tail bytes, floors, the -ngl
choice and the issue 4 targets, with fake sizes."""

from __future__ import annotations

import pytest

from rollingkv_cli.bench import arithmetic as bm


def test_row_bytes_match_ggml_block_sizes():
    import gguf  # a dependency of rollingkv (pyproject.toml)

    for name, (blk, size) in bm.TYPE_BLOCK.items():
        qt = getattr(gguf.GGMLQuantizationType, name.upper())
        assert gguf.GGML_QUANT_SIZES[qt] == (blk, size), name
    assert bm.row_bytes("f16", 1024) == 2048
    assert bm.row_bytes("q8_0", 1024) == 32 * 34
    assert bm.row_bytes("q4_0", 1024) == 32 * 18
    with pytest.raises(ValueError, match="whole number"):
        bm.row_bytes("q4_0", 100)
    with pytest.raises(ValueError, match="unknown"):
        bm.row_bytes("q3_k", 1024)


def test_windows_from_fractions():
    # the anchors' depth: 16384 + 32 tokens in use, kv_size 16640
    assert bm.kv_size(16384, 32) == 16640
    assert bm.window_for_fraction(0.0, 16384, 32) == 16640  # whole cache: resident
    assert bm.window_for_fraction(0.25, 16384, 32) == 12288
    assert bm.window_for_fraction(0.5, 16384, 32) == 8192
    assert bm.window_for_fraction(0.75, 16384, 32) == 4096
    assert bm.window_for_fraction(1.0, 16384, 32) == bm.MIN_WINDOW == 256
    for f in (0.1, 0.3, 0.6, 0.9):
        assert bm.window_for_fraction(f, 16384, 32) % 256 == 0
    assert bm.tail_fraction(8192, 16384, 32) == pytest.approx((16416 - 8192) / 16416)
    assert bm.tail_fraction(16640, 16384, 32) == 0.0
    for bad in (-0.1, 1.01):
        with pytest.raises(ValueError):
            bm.window_for_fraction(bad, 1024, 4)


def test_tail_cells_follow_n_kv():
    # decoding positions 16384..16415: n_kv = 16640 each time
    assert bm.tail_cells_per_token(16384, 32, 8192) == 16640 - 8192
    assert bm.tail_cells_per_token(16384, 32, 16640) == 0.0
    assert bm.tail_cells_per_token(16384, 32, None) == 0.0
    # across a 256 step: positions 250..255 attend 256 cells, 256..259 attend 512
    assert bm.n_kv_at(255, 512) == 256 and bm.n_kv_at(256, 512) == 512
    assert bm.tail_cells_per_token(250, 10, 256) == pytest.approx(4 * 256 / 10)
    # the anchors' model: 28 layers x 8 KV heads x 128, f16 K+V = 112 KiB per token; q4_0 ~0.28x
    shape = bm.KVShape((1024,) * 28, (1024,) * 28)
    assert shape.row_bytes("f16", "f16") == 112 * 1024
    f16 = bm.tail_bytes_per_token(shape, 16384, 32, 8192, "f16", "f16")
    q4 = bm.tail_bytes_per_token(shape, 16384, 32, 8192, "q4_0", "q4_0")
    assert f16 == 8448 * 112 * 1024 and q4 / f16 == pytest.approx(18 / 64)


def test_floors_reproduce_the_anchors():
    serial, stretch = bm.floors(3.47e-3, 0.94e9, 55e9)  # half the KV on host at depth 16384
    assert serial == pytest.approx(20.56e-3, rel=1e-3) and stretch == pytest.approx(17.09e-3, rel=1e-3)
    serial, stretch = bm.floors(10e-3, 1e6, 1e9)  # link time below compute: the overlapped floor is t_res
    assert serial == pytest.approx(11e-3) and stretch == pytest.approx(10e-3)
    with pytest.raises(ValueError):
        bm.floors(1e-3, 1.0, 0.0)


def test_choose_ngl_with_fake_sizes():
    w = bm.WeightSplit(block_bytes=(10, 10, 10, 10), output_bytes=5, input_bytes=7)
    kv = [2, 2, 2, 2]
    assert w.device_bytes_all == 45
    assert bm.choose_ngl(w, kv, 0) == (0, 0)
    assert bm.choose_ngl(w, kv, 11) == (0, 0)
    assert bm.choose_ngl(w, kv, 12) == (1, 12)
    assert bm.choose_ngl(w, kv, 35) == (2, 24)
    assert bm.choose_ngl(w, kv, 48) == (4, 48)  # every block, the output layer still on the CPU
    assert bm.choose_ngl(w, kv, 52) == (4, 48)
    assert bm.choose_ngl(w, kv, 53) == (5, 53)  # -ngl n_layer + 1 offloads the output layer too
    assert bm.choose_ngl(w, kv, 10**9) == (5, 53)
    # llama.cpp offloads the LAST n layers: a heavy last layer blocks every -ngl even when the first ones would fit
    lopsided = bm.WeightSplit(block_bytes=(1, 1, 1, 50), output_bytes=0, input_bytes=0)
    assert bm.choose_ngl(lopsided, [0, 0, 0, 0], 10) == (0, 0)
    assert bm.vanilla_device_bytes(2, lopsided, [3, 3, 3, 3]) == 1 + 50 + 3 + 3
    with pytest.raises(ValueError):
        bm.vanilla_device_bytes(1, w, [1, 2])


def test_window_budget_counts_weights_window_and_ring():
    w = bm.WeightSplit(block_bytes=(100, 100), output_bytes=20, input_bytes=50)
    b = bm.window_budget(w, window_cells=255, window_row_bytes=4, ring_bytes=1000)
    assert b == {"weights_bytes": 220, "window_kv_bytes": 256 * 4, "slot_ring_bytes": 1000, "total_bytes": 220 + 1024 + 1000}


def _cell(kind, tps, depth=16384, tail_type=None, fractions=(), tail_bytes=0.0, **kw):
    return {"kind": kind, "depth": depth, "tokens_per_s": tps, "status": "ok", "tail_type": tail_type, "fractions": list(fractions),
            "tail_bytes_per_token": tail_bytes, "label": f"{kind} {tail_type} {fractions}", **kw}


def _targets(cells, bw=55.0, depths=(16384,)):
    return {t["target"]: t for t in bm.evaluate_targets(cells, list(depths), "f16", bw)}


def test_targets_met_and_not_met():
    cells = [
        _cell("resident", 288.0),
        _cell("window", 55.0, tail_type="f16", fractions=[0.5], tail_bytes=0.97e9, ratio_floor=1.05, ratio_stretch=1.12),
        _cell("window", 28.0, tail_type="f16", fractions=[1.0], tail_bytes=1.9e9, ratio_floor=1.08, ratio_stretch=1.14),
        _cell("window", 150.0, tail_type="q4_0", fractions=[0.5], tail_bytes=0.27e9, ratio_floor=1.01, ratio_stretch=1.0),
        _cell("auto", 285.0),
        _cell("vanilla_ngl", 17.7, n_gpu_layers=20),
        _cell("vanilla_nkvo", 4.33),
    ]
    t = _targets(cells)
    hybrid = {k for k in t if k.startswith("hybrid_")}
    assert hybrid == {"hybrid_full_vs_floor", "hybrid_vs_ngl", "hybrid_vs_ngl_65536", "hybrid_q8_0_gains", "hybrid_q4_0_gains"}
    assert {t[k]["status"] for k in hybrid} == {"n/a"} and all("no hybrid cell" in t[k]["note"] for k in hybrid)
    t = {k: v for k, v in t.items() if k not in hybrid}
    assert {k: v["status"] for k, v in t.items()} == {
        "floor": "met", "stretch": "met", "vs_ngl": "met", "vs_nkvo": "met", "auto_vs_vanilla": "met", "q4_0_bytes": "met", "q4_0_faster": "met"}
    assert t["vs_ngl"]["value"] == pytest.approx(55 / 17.7, abs=1e-4) and t["floor"]["value"] == 1.08
    # make each one fail
    cells[2]["ratio_floor"] = 1.3
    cells[1]["ratio_stretch"] = 1.2
    cells[5]["tokens_per_s"] = 30.0
    cells[6]["tokens_per_s"] = 6.0
    cells[4]["tokens_per_s"] = 270.0
    cells[3]["tail_bytes_per_token"] = 0.5e9
    cells[3]["tokens_per_s"] = 50.0
    t = {k: v for k, v in _targets(cells).items() if not k.startswith("hybrid_")}
    assert all(v["status"] == "not met" for v in t.values()), t
    assert "worst" in t["floor"]["detail"] and t["floor"]["value"] == 1.3


def test_targets_without_bandwidth_or_cells_are_na():
    cells = [_cell("resident", 100.0, depth=512), _cell("window", 50.0, depth=512, tail_type="f16", fractions=[0.5], tail_bytes=1e6)]
    t = _targets(cells, bw=None, depths=(512,))
    assert t["floor"]["status"] == "n/a" and "floors skipped" in t["floor"]["note"]
    assert t["vs_ngl"]["status"] == "n/a" and t["q4_0_faster"]["status"] == "n/a"
    # vs_nkvo is the target at 16384 only: elsewhere reported, not judged
    cells += [_cell("window", 10.0, depth=512, tail_type="f16", fractions=[1.0]), _cell("vanilla_nkvo", 1.0, depth=512)]
    t = _targets(cells, bw=None, depths=(512,))
    assert t["vs_nkvo"]["status"] == "info" and t["vs_nkvo"]["value"] == 10.0
    # a failed cell is never used
    cells[0]["status"] = "failed"
    cells.append(_cell("auto", 100.0, depth=512))
    assert _targets(cells, bw=None, depths=(512,))["auto_vs_vanilla"]["status"] == "n/a"


def test_hybrid_targets_met_and_not_met():
    """Issue 16's: the hybrid auto cell at the 100% tail <= 0.55x the link-only serial floor (judged at 16384 and 65536),
    at 50% >= 3x vanilla's -ngl at 16384 (>= 5x at 65536), and q8_0/q4_0 hybrid cells faster than the same tail GPU-only."""
    def cells(depth, full_ratio, half_tps, q8_tps, q4_tps):
        h = dict(cpu_frac="auto")
        return [
            _cell("resident", 288.0, depth=depth),
            _cell("window", 55.0, depth=depth, tail_type="f16", fractions=[0.5], tail_bytes=0.97e9, ratio_floor=1.0),
            _cell("window", 20.0, depth=depth, tail_type="q8_0", fractions=[0.5], tail_bytes=0.5e9, ratio_floor=1.0),
            _cell("window", 30.0, depth=depth, tail_type="q4_0", fractions=[0.5], tail_bytes=0.27e9, ratio_floor=1.0),
            _cell("hybrid", 100.0, depth=depth, tail_type="f16", fractions=[1.0], tail_bytes=1.9e9, ratio_floor=full_ratio,
                  ms_per_token=10.0, floor_ms=25.0, **h),
            _cell("hybrid", half_tps, depth=depth, tail_type="f16", fractions=[0.5], tail_bytes=0.97e9, **h),
            _cell("hybrid", 40.0, depth=depth, tail_type="f16", fractions=[0.5], tail_bytes=0.97e9, cpu_frac=0.25),
            _cell("hybrid", q8_tps, depth=depth, tail_type="q8_0", fractions=[0.5], tail_bytes=0.5e9, **h),
            _cell("hybrid", q4_tps, depth=depth, tail_type="q4_0", fractions=[0.5], tail_bytes=0.27e9, **h),
            _cell("vanilla_ngl", 10.0, depth=depth, n_gpu_layers=20),
        ]

    both = cells(16384, 0.4, 35.0, 25.0, 35.0) + cells(65536, 0.5, 55.0, 25.0, 35.0)
    out = bm.evaluate_targets(both, [16384, 65536], "f16", 55.0)
    t = {(x["target"], x["depth"]): x for x in out}
    assert t[("hybrid_full_vs_floor", 16384)]["status"] == "met" and t[("hybrid_full_vs_floor", 16384)]["value"] == 0.4
    assert t[("hybrid_full_vs_floor", 65536)]["status"] == "met"
    assert t[("hybrid_vs_ngl", 16384)]["value"] == 3.5 and t[("hybrid_vs_ngl", 16384)]["status"] == "met"  # the auto cell, not 25%
    assert t[("hybrid_vs_ngl", 65536)]["status"] == "info"  # 3x is the 16384 target
    assert t[("hybrid_vs_ngl_65536", 65536)]["value"] == 5.5 and t[("hybrid_vs_ngl_65536", 65536)]["status"] == "met"
    assert t[("hybrid_vs_ngl_65536", 16384)]["status"] == "info"
    assert t[("hybrid_q8_0_gains", 16384)]["value"] == 1.25 and t[("hybrid_q4_0_gains", 16384)]["status"] == "met"
    both = cells(16384, 0.6, 25.0, 15.0, 30.0) + cells(65536, 0.7, 45.0, 20.0, 29.0)
    t = {(x["target"], x["depth"]): x for x in bm.evaluate_targets(both, [16384, 65536], "f16", 55.0)}
    for key in (("hybrid_full_vs_floor", 16384), ("hybrid_full_vs_floor", 65536), ("hybrid_vs_ngl", 16384),
                ("hybrid_vs_ngl_65536", 65536), ("hybrid_q8_0_gains", 16384), ("hybrid_q4_0_gains", 65536)):
        assert t[key]["status"] == "not met", key
    # the 100% target elsewhere: reported, not judged; without a link: n/a
    t = {x["target"]: x for x in bm.evaluate_targets(cells(1024, 0.4, 35.0, 25.0, 35.0), [1024], "f16", 55.0)}
    assert t["hybrid_full_vs_floor"]["status"] == "info" and "16384 and 65536" in t["hybrid_full_vs_floor"]["note"]
    t = {x["target"]: x for x in bm.evaluate_targets(cells(16384, 0.4, 35.0, 25.0, 35.0), [16384], "f16", None)}
    assert t["hybrid_full_vs_floor"]["status"] == "n/a" and "floors skipped" in t["hybrid_full_vs_floor"]["note"]


def test_the_hybrid_floor_after_the_query():
    """A single sequence's CPU part waits for its layer's query: the floor is min over f of max(t_res + f tail/cpu,
    (1 - f) tail/link), between the overlapped floor and the serial one; the H100 figures of docs/perf 2026-12-06."""
    t_res, tail, link, cpu = 3.96e-3, 943e6, 55.5e9, 63.6e9
    dep, f = bm.hybrid_dependent_floor(t_res, tail, link, cpu)
    grid = min((i / 100000 for i in range(100001)), key=lambda x: max(t_res + x * tail / cpu, (1 - x) * tail / link))
    assert f == pytest.approx(grid, abs=1e-4) and dep == pytest.approx(max(t_res + grid * tail / cpu, (1 - grid) * tail / link), rel=1e-4)
    serial, over = bm.hybrid_floors(t_res, tail, link, cpu)
    assert over < dep < serial and dep == pytest.approx(10.03e-3, rel=5e-3)
    assert bm.hybrid_dependent_floor(0.05, tail, link, cpu) == (0.05, 0.0)  # the link alone keeps up: no CPU part
    with pytest.raises(ValueError):
        bm.hybrid_dependent_floor(t_res, tail, 0, cpu)
