"""`rollingkv bench tail` / `plot` / `show`: the arithmetic (windows, tail bytes, floors, the -ngl choice,
the issue 4 targets) with fake sizes, bad input (one clear line, no traceback), the grid on the demo model
(dry run), and a real run of the command on the CPU build at a tiny depth."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollingkv_cli import bench_math as bm
from rollingkv_cli.cli import rollingkv
from test_cli import run_main

# ------------------------------------------------------------------------------------- bench_math


def test_row_bytes_match_ggml_block_sizes():
    gguf = pytest.importorskip("gguf")
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
    t = _targets(cells)
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


# ------------------------------------------------------------------------------------- the command


@pytest.mark.parametrize("cmd", [["bench"], ["bench", "tail"], ["bench", "plot"], ["bench", "show"]], ids=" ".join)
def test_help(runner, cmd):
    result = runner.invoke(rollingkv, [*cmd, "--help"], catch_exceptions=False)
    assert result.exit_code == 0 and "Usage:" in result.output
    if cmd == ["bench", "tail"]:
        for opt in ("--depth", "--tail-types", "--fractions", "--vanilla-build", "--json", "--resume", "--time-budget", "--reps"):
            assert opt in result.output


@pytest.mark.parametrize("args,match", [
    (["--tail-types", "f16,q3_k"], "unknown tail type 'q3_k'"),
    (["--fractions", "0.5,1.5"], "outside [0, 1]"),
    (["--fractions", "half"], "not a fraction"),
    (["--mixed-fractions", "-10%"], "outside [0, 1]"),
    (["--window-type", "q2_k"], "q2_k"),
    (["-d", "0"], "at least 1"),
    (["-d", "100"], "nothing could go to the tail"),
    (["--skip", "resident"], "resident"),
    (["--pcie-bw-gbps", "0"], "positive"),
])
def test_usage_errors_exit_2(capsys, isolated_cache, fake_gguf, args, match):
    code, _, err = run_main(["bench", "tail", str(fake_gguf), *args], capsys)
    assert code == 2 and match in err, err


def _one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_missing_model_is_one_line(capsys, isolated_cache, tmp_path):
    code, _, err = run_main(["bench", "tail", str(tmp_path / "nope.gguf"), "--dry-run"], capsys)
    assert code == 1 and "not found" in _one_error(err) and "hint:" in err


def test_not_a_gguf_and_no_build(capsys, isolated_cache, tmp_path, fake_gguf):
    bad = tmp_path / "x.gguf"
    bad.write_text("hello")
    code, _, err = run_main(["bench", "tail", str(bad), "--dry-run"], capsys)
    assert code == 1 and "not a GGUF" in _one_error(err)
    code, _, err = run_main(["bench", "tail", str(fake_gguf), "--dry-run"], capsys)
    assert code == 1 and "no rollingkv build" in _one_error(err)


def test_plot_and_show_refuse_other_files(capsys, tmp_path):
    for sub in ("plot", "show"):
        code, _, err = run_main(["bench", sub, str(tmp_path / "missing.json")], capsys)
        assert code == 1 and "cannot read" in _one_error(err)
        other = tmp_path / "other.json"
        other.write_text(json.dumps({"schema": "something"}))
        code, _, err = run_main(["bench", sub, str(other)], capsys)
        assert code == 1 and "not a `rollingkv bench tail` report" in _one_error(err)


@pytest.mark.build
def test_dry_run_grid_on_the_demo_model(capsys, cpu_build, demo_model, monkeypatch, tmp_path):
    from rollingkv_cli import console as console_mod

    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setattr(console_mod.console, "_width", 400)  # one table row per line
    out = tmp_path / "r.json"
    code, stdout, err = run_main(["bench", "tail", str(demo_model), "-d", "764", "-n", "4", "--fractions", "0,25%,0.5,1",
                                  "--tail-types", "f16,q8_0", "--slot-ring-mib", "0", "--json", str(out), "--dry-run"], capsys)
    assert code == 0, err
    assert not out.exists()  # a dry run writes nothing
    rows = [line for line in stdout.splitlines() if "llama-bench -m" in line]
    labels = [line.split("│")[2].strip() for line in stdout.splitlines() if line.startswith("│") and line.split("│")[1].strip().isdigit()]
    # 0.25 and 0.5 of 768 cells in use both round to a window of 512: one cell for both
    assert labels == ["resident (off, -ngl 99)", "window f16 25%/50% tail", "window f16 100% tail", "window q8_0 50% tail",
                      "auto (0% tail when it fits)", "window f16 0% tail (= resident)", "vanilla -ngl 30 (off)", "vanilla -nkvo 1 (off)"]
    assert len(rows) == len(labels)
    assert "--kv-window-cells 512 -ctkt q8_0 -ctvt q8_0" in stdout and "-nkvo 1 --kv-residency-mode off" in stdout
    assert "vanilla -ngl 30" in stdout and "0 MiB ring" in stdout
    # the -ngl choice from the GGUF: 30 blocks + their KV at 768 cells vs weights + window KV
    from rollingkv_cli import bench_gguf

    info = bench_gguf.read_model(demo_model)
    budget = bm.window_budget(info.weights, 512, info.kv.row_bytes("f16", "f16"), 0)["total_bytes"]
    kv_layer = [r * 768 for r in info.kv.layer_row_bytes("f16", "f16")]
    assert bm.choose_ngl(info.weights, kv_layer, budget)[0] == 30
    assert info.n_layer == 30 and info.n_head_kv == [3] * 30 and info.head_dim_k == 64 and info.tied_output


def test_vanilla_build_without_llama_bench(capsys, isolated_cache, fake_gguf, tmp_path, monkeypatch):
    from rollingkv_cli import bench_gguf, bench_math, builder

    monkeypatch.setattr(builder, "active_build", lambda required=True: builder.Build(tmp_path, {"pin": "x"}))
    (tmp_path / "build" / "bin").mkdir(parents=True)
    (tmp_path / "build" / "bin" / "llama-bench").write_text("")
    shape = bench_gguf.ModelInfo(path=fake_gguf, arch="llama", name="m", n_layer=2, n_head=4, n_head_kv=[2, 2], head_dim_k=64,
                                 head_dim_v=64, weights=bench_math.WeightSplit((10, 10), 1, 1), file_bytes=64, tied_output=False)
    monkeypatch.setattr(bench_gguf, "read_model", lambda p: shape)
    empty = tmp_path / "vanilla"
    empty.mkdir()
    code, _, err = run_main(["bench", "tail", str(fake_gguf), "-d", "1024", "--vanilla-build", str(empty), "--dry-run"], capsys)
    assert code == 1 and "no llama-bench executable" in _one_error(err)
    # a tail type whose blocks do not divide the rows
    shape.head_dim_k = shape.head_dim_v = 40
    code, _, err = run_main(["bench", "tail", str(fake_gguf), "-d", "1024", "--tail-types", "f16,q4_0", "--dry-run"], capsys)
    assert code == 1 and "q4_0 does not fit this model" in _one_error(err)


@pytest.mark.build
def test_gguf_py_from_the_build_tree_when_no_package(cpu_build, demo_model, tmp_path):
    """The GPU machine has no gguf package: the reader falls back to the build tree's gguf-py."""
    shadow = tmp_path / "shadow" / "gguf"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no gguf package here')\n")
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), "PYTHONPATH": f"{shadow.parent}{os.pathsep}{Path(__file__).parent.parent}"}
    code = ("from pathlib import Path; import sys; from rollingkv_cli import bench_gguf; "
            f"m = bench_gguf.read_model(Path({str(demo_model)!r})); print(m.n_layer, sys.modules['gguf'].__file__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    n, where = proc.stdout.split()
    assert n == "30" and "gguf-py" in where and str(shadow) not in where


# ------------------------------------------------------------------------------------- a fake llama-bench

FAKE_BENCH = r"""#!{python}
import json, sys
a = sys.argv[1:]
def get(flag, default=None):
    return a[a.index(flag) + 1] if flag in a else default
if "-nkvo" in a:
    print("llama-bench: fake: out of memory", file=sys.stderr)
    sys.exit(3)
n, d, w = int(get("-n")), int(get("-d")), int(get("--kv-window-cells", "0"))
mode = get("--kv-residency-mode", "auto")
kv = -(-(d + n) // 256) * 256
split = mode == "window" and 0 < w < kv
ts = 50.0 if split else 100.0
print(json.dumps([{{"n_prompt": 0, "n_gen": n, "n_depth": d, "avg_ts": ts, "stddev_ts": 0.5, "samples_ts": [ts], "kv_mode": mode,
                   "kv_mode_chosen": "window" if split else "resident", "window_cells": w if split else 0,
                   "tail_cells": kv - w if split else 0, "type_k_tail": get("-ctkt", "f16"), "type_v_tail": get("-ctvt", "f16"),
                   "backends": "FAKE", "n_gpu_layers": int(get("-ngl", "99"))}}]))
"""


@pytest.fixture
def fake_build(tmp_path, monkeypatch, isolated_cache):
    """Active build = a directory whose llama-bench is FAKE_BENCH: 100 tok/s resident, 50 tok/s split, -nkvo fails."""
    from rollingkv_cli import builder

    bdir = tmp_path / "fakebuild"
    (bdir / "build" / "bin").mkdir(parents=True)
    exe = bdir / "build" / "bin" / "llama-bench"
    exe.write_text(FAKE_BENCH.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setattr(builder, "active_build", lambda required=True: builder.Build(bdir, {"options": {"cuda": False}, "series_hash": "fake"}))
    return bdir


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    pytest.importorskip("gguf")
    from rollingkv_cli import models

    return models.write_synthetic(tmp_path / "tiny.gguf", models.SynthSpec(layers=2, embd=128, heads=2, kv_heads=1, ff=256, vocab=300, ctx=4096))


def test_failed_cell_and_floors_with_a_fake_bench(capsys, fake_build, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    out = tmp_path / "fake.json"
    code, stdout, err = run_main(["bench", "tail", str(tiny_model), "-d", "1020", "-n", "4", "-r", "1", "--fractions", "0.5,1",
                                  "--tail-types", "f16,q8_0", "--pcie-bw-gbps", "1", "--json", str(out), "--no-plot"], capsys)
    assert code == 1, err  # the -nkvo cell failed: the run says so, the report is complete up to it
    doc = json.loads(out.read_text())
    by = {c["kind"] + "/" + str(c.get("tail_type")) + "/" + str(c.get("window_cells")): c for c in doc["cells"]}
    nkvo = by["vanilla_nkvo/None/None"]
    assert nkvo["status"] == "failed" and "exit status 3" in nkvo["error"] and "out of memory" in nkvo["stderr_tail"][-1]
    assert all(c["status"] == "ok" for c in doc["cells"] if c is not nkvo) and not doc["complete"]
    row = 2 * 64 * 2 * 2  # 2 layers x (K + V) x 64 elements (1 KV head of 64) x f16
    for key, window, tail_row in (("window/f16/512", 512, row), ("window/f16/256", 256, row), ("window/q8_0/512", 512, 2 * 2 * 2 * 34)):
        c = by[key]
        tail = (1024 - window) * tail_row
        assert c["tail_bytes_per_token"] == tail
        assert c["floor_ms"] == pytest.approx((0.01 + tail / 1e9) * 1e3)
        assert c["ratio_floor"] == pytest.approx(0.02 / (0.01 + tail / 1e9))
        assert c["ratio_stretch"] == pytest.approx(0.02 / max(0.01, tail / 1e9))
    t = {x["target"]: x for x in doc["targets"]}
    # worst = the smallest tail (q8_0 at 50%): 20 ms measured against a floor of 10 ms + 139 kB / 1 GB/s
    assert t["floor"]["status"] == "not met" and t["floor"]["value"] == pytest.approx(0.02 / (0.01 + 512 * 2 * 2 * 2 * 34 / 1e9), abs=1e-4)
    assert "window q8_0 50% tail" in t["floor"]["detail"] and "0 of 3 cells within" in t["floor"]["detail"]
    assert t["auto_vs_vanilla"]["status"] == "met" and t["auto_vs_vanilla"]["value"] == 1.0
    assert t["vs_ngl"]["value"] == 0.5 and t["vs_ngl"]["status"] == "not met"
    assert t["vs_nkvo"]["status"] == "n/a"
    assert "failed" in stdout and "x floor" in stdout
    # the -ngl the fake got is the one chosen from the model's sizes
    ngl = by["vanilla_ngl/None/None"]
    assert f"-ngl {doc['depths']['1020']['ngl']['n_gpu_layers']} " in ngl["command"] + " "
    assert ngl["bench"]["n_gpu_layers"] == doc["depths"]["1020"]["ngl"]["n_gpu_layers"]


def test_parse_bench_json_errors():
    from rollingkv_cli import bench_tail

    with pytest.raises(ValueError, match="no JSON"):
        bench_tail.parse_bench_json("llama-bench: error\n", 4)
    with pytest.raises(ValueError, match="no generation test of 4"):
        bench_tail.parse_bench_json(json.dumps([{"n_prompt": 512, "n_gen": 0}]), 4)
    assert bench_tail.parse_bench_json(json.dumps([{"n_prompt": 512, "n_gen": 0}, {"n_prompt": 0, "n_gen": 4, "avg_ts": 3}]), 4)["avg_ts"] == 3


def test_cell_runner_stops_a_slow_process():
    from rollingkv_cli import bench_tail

    rc, out, tail, wall, timed_out = bench_tail.CellRunner().run([sys.executable, "-c", "import time; print('x', flush=True); time.sleep(30)"], 1.0)
    assert timed_out and wall < 15 and rc is not None and rc != 0


# ------------------------------------------------------------------------------------- real runs


def _bench(cpu_build, *args, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), "COLUMNS": "250"}
    env.pop("ROLLINGKV_PCIE_BW_GBPS", None)
    return subprocess.run([sys.executable, "-m", "rollingkv_cli", "bench", *args], capture_output=True, text=True, env=env, timeout=timeout)


def _has_gpu() -> bool:
    from rollingkv_cli import pcie

    try:
        pcie.discover()
    except pcie.NoGpuError:
        return False
    return True


@pytest.mark.build
def test_tail_run_on_cpu_writes_every_cell(cpu_build, demo_model, tmp_path):
    from rollingkv_cli import bench_gguf, bench_plot

    out = tmp_path / "run.json"
    proc = _bench(cpu_build, "tail", str(demo_model), "-d", "508", "-n", "4", "-r", "1", "-t", "1", "--fractions", "0.5,1",
                  "--tail-types", "f16,q4_0", "--slot-ring-mib", "0", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    cells = doc["cells"]
    assert [c["kind"] for c in cells] == ["resident", "window", "window", "auto", "vanilla_ngl", "vanilla_nkvo"]
    assert doc["complete"] and all(c["status"] == "ok" and c["tokens_per_s"] > 0 for c in cells)
    assert doc["vanilla"]["source"].startswith("our build with --kv-residency-mode off")
    info = bench_gguf.read_model(demo_model)
    per_cell_row = {"f16": 30 * 2 * 3 * 64 * 2, "q4_0": 30 * 2 * 3 * 64 // 32 * 18}  # 30 layers, K+V, 3 KV heads x 64
    for c in cells:
        assert c["command"].split()[0].endswith("llama-bench") and "-d 508" in c["command"] and "-n 4" in c["command"]
        assert c["args"][0] == str(cpu_build.artifact("llama-bench")) and c["wall_s"] > 0
        if c["kind"] == "window":
            # the plan the bench reports is the window we asked for; tail = (512 - W) cells per token
            assert c["plan"]["kv_mode_chosen"] == "window" and c["plan"]["window_cells"] == c["window_cells"]
            assert c["tail_bytes_per_token"] == (512 - c["window_cells"]) * per_cell_row[c["tail_type"]]
    windows = {(c["tail_type"], tuple(c["fractions"])): c["window_cells"] for c in cells if c["kind"] == "window"}
    # 508 + 4 tokens: 50% and 100% both give the smallest window, one cell measures both
    assert windows == {("f16", (0.5, 1.0)): 256, ("q4_0", (0.5,)): 256}
    ngl = cells[4]
    assert ngl["n_gpu_layers"] == doc["depths"]["508"]["ngl"]["n_gpu_layers"] == bm.choose_ngl(
        info.weights, [r * 512 for r in info.kv.layer_row_bytes("f16", "f16")],
        bm.window_budget(info.weights, 256, info.kv.row_bytes("f16", "f16"), 0)["total_bytes"])[0]
    assert f"-ngl {ngl['n_gpu_layers']} --kv-residency-mode off" in ngl["command"]
    assert "-ngl 99 -nkvo 1 --kv-residency-mode off" in cells[5]["command"]

    targets = {t["target"]: t for t in doc["targets"]}
    by = {c["id"]: c for c in cells}
    half, q4 = by["d508/window/f16/w256"], by["d508/window/q4_0/w256"]
    assert targets["q4_0_bytes"]["value"] == pytest.approx(q4["tail_bytes_per_token"] / half["tail_bytes_per_token"], abs=1e-4)
    assert targets["q4_0_bytes"]["status"] == "met"  # 18/64 bytes: arithmetic, not speed
    assert targets["vs_ngl"]["value"] == pytest.approx(half["tokens_per_s"] / ngl["tokens_per_s"], abs=1e-4)
    assert targets["vs_ngl"]["status"] == bm.judge(targets["vs_ngl"]["value"], ">=", 2.5)
    assert targets["vs_nkvo"]["status"] == "info"  # not at depth 16384
    if not _has_gpu():
        # no link: bandwidth null, floors skipped and said so
        assert doc["bandwidth"]["gbps"] is None and "floors skipped" in doc["bandwidth"]["note"]
        assert all("floor_ms" not in c for c in cells)
        assert targets["floor"]["status"] == "n/a" and targets["stretch"]["status"] == "n/a"
        assert "floors skipped" in proc.stdout
    assert "issue 4 targets" in proc.stdout and "window f16 50%/100% tail" in proc.stdout
    png = out.with_suffix(".png")
    if bench_plot.have_matplotlib():
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and doc["png"] == str(png)
    else:
        assert not png.exists() and "bench plot" in proc.stdout

    # --resume with a bandwidth: nothing runs again, the floors appear
    proc = _bench(cpu_build, "tail", str(demo_model), "-d", "508", "-n", "4", "-r", "1", "-t", "1", "--fractions", "0.5,1",
                  "--tail-types", "f16,q4_0", "--slot-ring-mib", "0", "--json", str(out), "--resume", "--pcie-bw-gbps", "2", "--no-plot",
                  timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 cells to run (6 already measured)" in proc.stdout
    doc2 = json.loads(out.read_text())
    assert doc2["bandwidth"] == {"gbps": 2.0, "source": "explicit", "note": "given with --pcie-bw-gbps, not measured"}
    res = doc2["cells"][0]
    for c in doc2["cells"]:
        assert c["resumed"] and c["tokens_per_s"] == next(o for o in cells if o["id"] == c["id"])["tokens_per_s"]
        if c["kind"] == "window":
            t_res = 1 / res["tokens_per_s"]
            serial = t_res + c["tail_bytes_per_token"] / 2e9
            assert c["floor_ms"] == pytest.approx(serial * 1e3)
            assert c["ratio_floor"] == pytest.approx((1 / c["tokens_per_s"]) / serial)
            assert c["ratio_stretch"] == pytest.approx((1 / c["tokens_per_s"]) / max(t_res, c["tail_bytes_per_token"] / 2e9))
    t2 = {t["target"]: t for t in doc2["targets"]}
    worst = max(c["ratio_floor"] for c in doc2["cells"] if c["kind"] == "window")
    assert t2["floor"]["value"] == pytest.approx(worst, abs=1e-4) and t2["floor"]["status"] == bm.judge(worst, "<=", 1.10)

    # --resume refuses another configuration; show prints the report again
    proc = _bench(cpu_build, "tail", str(demo_model), "-d", "508", "-n", "8", "--json", str(out), "--resume", timeout=60)
    assert proc.returncode == 1 and "another configuration" in proc.stderr and "n_gen" in proc.stderr
    proc = _bench(cpu_build, "show", str(out), timeout=60)
    assert proc.returncode == 0 and "window q4_0 50% tail" in proc.stdout and "q4_0_bytes" in proc.stdout
    proc = _bench(cpu_build, "plot", str(out), "-o", str(tmp_path / "p.png"), timeout=120)
    if bench_plot.have_matplotlib():
        assert proc.returncode == 0 and (tmp_path / "p.png").is_file()
    else:
        assert proc.returncode == 1 and "matplotlib is not installed" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.build
def test_time_budget_leaves_a_partial_report(cpu_build, demo_model, tmp_path):
    """A cell cut by --time-budget is stopped and recorded; later cells are skipped; the JSON is whole; exit 1."""
    out = tmp_path / "cut.json"
    proc = _bench(cpu_build, "tail", str(demo_model), "-d", "4092", "-n", "4", "-r", "1", "-t", "1", "--fractions", "1",
                  "--tail-types", "f16", "--skip", "auto", "--skip", "ngl", "--skip", "nkvo", "--time-budget", "2",
                  "--json", str(out), "--no-plot", timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [c["status"] for c in doc["cells"]] == ["timeout", "skipped"] and not doc["complete"]
    assert doc["cells"][0]["wall_s"] < 30 and "time-budget" in doc["cells"][0]["error"] and "time-budget" in doc["cells"][1]["error"]
    assert {t["status"] for t in doc["targets"]} == {"n/a"}
