"""`rollingkv bench tail` / `plot` / `show`: bad input (one clear line, no traceback), the grid on the demo model
(dry run), a fake llama-bench, and a real run of the command on the CPU build at a tiny depth. The arithmetic:
test_arithmetic.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollingkv_cli.bench import arithmetic as bm
from rollingkv_cli.cli import rollingkv
from test_cli import run_main

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
    from rollingkv_cli.bench import gguf as bench_gguf

    info = bench_gguf.read_model(demo_model)
    budget = bm.window_budget(info.weights, 512, info.kv.row_bytes("f16", "f16"), 0)["total_bytes"]
    kv_layer = [r * 768 for r in info.kv.layer_row_bytes("f16", "f16")]
    assert bm.choose_ngl(info.weights, kv_layer, budget)[0] == 30
    assert info.n_layer == 30 and info.n_head_kv == [3] * 30 and info.head_dim_k == 64 and info.tied_output


def test_default_report_is_a_new_folder_per_run_in_docs_perf(monkeypatch, tmp_path):
    """docs/perf keeps one folder per record: the default report goes into a new one (-2 when it exists), not flat
    into docs/perf; nothing is created before the report is written."""
    import time

    from rollingkv_cli.lib import paths
    from rollingkv_cli.bench.tail_setup import default_report_path

    (tmp_path / "docs" / "perf").mkdir(parents=True)
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path)
    monkeypatch.chdir(tmp_path / "docs")  # inside the checkout
    day = time.strftime("%Y-%m-%d")
    p = default_report_path(Path("/m/synth 28L.gguf"))
    assert p == tmp_path / "docs" / "perf" / f"{day}-bench-tail-synth-28L" / "bench-tail.json" and not p.parent.exists()
    p.parent.mkdir()
    assert default_report_path(Path("/m/synth 28L.gguf")).parent.name == f"{day}-bench-tail-synth-28L-2"
    assert list((tmp_path / "docs" / "perf").iterdir()) == [p.parent]


def test_outside_the_checkout_the_default_report_goes_into_the_current_directory(monkeypatch, tmp_path):
    """Issue 39's second sweep: run from elsewhere, bench tail (and bench load) wrote into the checkout's docs/perf, or
    created ./docs/perf outside a checkout; now the current directory, a folder per run, as gate matrix does."""
    import time

    from rollingkv_cli.lib import paths
    from rollingkv_cli.bench.tail_setup import default_report_path

    (tmp_path / "repo" / "docs" / "perf").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path / "repo")
    monkeypatch.chdir(tmp_path / "elsewhere")
    day = time.strftime("%Y-%m-%d")
    assert default_report_path(Path("/m/x.gguf")) == tmp_path / "elsewhere" / f"{day}-bench-tail-x" / "bench-tail.json"
    assert not (tmp_path / "elsewhere" / "docs").exists() and list((tmp_path / "repo" / "docs" / "perf").iterdir()) == []


def test_vanilla_build_without_llama_bench(capsys, isolated_cache, fake_gguf, tmp_path, monkeypatch):
    from rollingkv_cli.lib import builder
    from rollingkv_cli.bench import arithmetic as bench_math
    from rollingkv_cli.bench import gguf as bench_gguf

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
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), "PYTHONPATH": f"{shadow.parent}{os.pathsep}{Path(__file__).resolve().parents[2]}"}
    code = ("from pathlib import Path; import sys; from rollingkv_cli.bench import gguf; "
            f"m = gguf.read_model(Path({str(demo_model)!r})); print(m.n_layer, sys.modules['gguf'].__file__)")
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
head = mode == "head" and int(get("--kv-device-heads", "0")) > 0
ts = 40.0 if head else 50.0 if split else 100.0
print(json.dumps([{{"n_prompt": 0, "n_gen": n, "n_depth": d, "avg_ts": ts, "stddev_ts": 0.5, "samples_ts": [ts], "kv_mode": mode,
                   "kv_mode_chosen": "head" if head else "window" if split else "resident", "window_cells": w if split else 0,
                   "tail_cells": kv if head else kv - w if split else 0, "type_k_tail": get("-ctkt", "f16"), "type_v_tail": get("-ctvt", "f16"),
                   "backends": "FAKE", "n_gpu_layers": int(get("-ngl", "99"))}}]))
"""


@pytest.fixture
def fake_build(tmp_path, monkeypatch, isolated_cache):
    """Active build = a directory whose llama-bench is FAKE_BENCH: 100 tok/s resident, 50 tok/s split, -nkvo fails."""
    from rollingkv_cli.lib import builder

    bdir = tmp_path / "fakebuild"
    (bdir / "build" / "bin").mkdir(parents=True)
    exe = bdir / "build" / "bin" / "llama-bench"
    exe.write_text(FAKE_BENCH.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setattr(builder, "active_build", lambda required=True: builder.Build(bdir, {"options": {"cuda": False}, "series_hash": "fake"}))
    return bdir


@pytest.fixture
def tiny_model(tmp_path) -> Path:
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
    from rollingkv_cli.bench import tail as bench_tail

    with pytest.raises(ValueError, match="no JSON"):
        bench_tail.parse_bench_json("llama-bench: error\n", 4)
    with pytest.raises(ValueError, match="no generation test of 4"):
        bench_tail.parse_bench_json(json.dumps([{"n_prompt": 512, "n_gen": 0}]), 4)
    assert bench_tail.parse_bench_json(json.dumps([{"n_prompt": 512, "n_gen": 0}, {"n_prompt": 0, "n_gen": 4, "avg_ts": 3}]), 4)["avg_ts"] == 3


def test_cell_runner_stops_a_slow_process():
    from rollingkv_cli.bench import tail as bench_tail

    rc, out, tail, wall, timed_out = bench_tail.CellRunner().run([sys.executable, "-c", "import time; print('x', flush=True); time.sleep(30)"], 1.0)
    assert timed_out and wall < 15 and rc is not None and rc != 0


# ------------------------------------------------------------------------------------- real runs


def _bench(cpu_build, *args, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), "COLUMNS": "250"}
    env.pop("ROLLINGKV_PCIE_BW_GBPS", None)
    return subprocess.run([sys.executable, "-m", "rollingkv_cli", "bench", *args], capture_output=True, text=True, env=env, timeout=timeout)


def _has_gpu() -> bool:
    from rollingkv_cli.hw import pcie

    try:
        pcie.discover()
    except pcie.NoGpuError:
        return False
    return True


@pytest.mark.build
def test_tail_run_on_cpu_writes_every_cell(cpu_build, demo_model, tmp_path):
    from rollingkv_cli.bench import gguf as bench_gguf
    from rollingkv_cli.bench import plot as bench_plot

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


@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_read_model_counts_only_a_hybrid_models_attention_layers(tmp_path, arch):
    """The tail bytes of a hybrid model are its attention layers' only: lfm2 marks its convolution layers with 0 KV heads,
    qwen35 gives every layer the attention's KV heads and says which attend by full_attention_interval."""
    from rollingkv_cli import models

    path = models.write_synthetic(tmp_path / f"{arch}.gguf", models.SynthSpec(layers=8, embd=256, heads=4, kv_heads=2, ff=512,
                                                                              vocab=300, ctx=1024, arch=arch, attn_interval=4))
    from rollingkv_cli.bench import gguf as bench_gguf

    info = bench_gguf.read_model(path)
    assert info.n_head_kv == [0, 0, 0, 2, 0, 0, 0, 2]
    assert info.kv.row_bytes("f16", "f16") == 2 * 2 * (2 * 64 * 2)  # two layers, K and V
    assert any("6 layers have no KV cache" in n for n in info.notes)


def test_head_cells_with_a_fake_bench(capsys, fake_build, tmp_path, monkeypatch):
    """--head-fractions: per tail type and fraction f, N = round((1 - f) x n_head_kv) device KV heads per layer; the cell's
    tail bytes are the host heads of every attended cell, against the same floors as the window cells."""
    from rollingkv_cli import models
    from rollingkv_cli.serve import launch

    monkeypatch.setattr(launch, "build_has_head_split", lambda lib: True)
    model = models.write_synthetic(tmp_path / "gqa.gguf", models.SynthSpec(layers=2, embd=256, heads=4, kv_heads=4, ff=256, vocab=300, ctx=4096))
    out = tmp_path / "heads.json"
    code, _, err = run_main(["bench", "tail", str(model), "-d", "1020", "-n", "4", "-r", "1", "--fractions", "0.5", "--tail-types", "f16,q8_0",
                             "--mixed-fractions", "0.5", "--head-fractions", "0.25,0.5,0.75,1", "--skip", "ngl", "--skip", "nkvo",
                             "--skip", "auto", "--pcie-bw-gbps", "1", "--json", str(out), "--no-plot"], capsys)
    assert code == 0, err
    doc = json.loads(out.read_text())
    heads = [c for c in doc["cells"] if c["kind"] == "head"]
    # 4 KV heads: 0.25 -> 3, 0.5 -> 2, 0.75 -> 1, 1 -> 1 (at least one on the device: one cell)
    assert [c["id"] for c in heads] == [f"d1020/head/{t}/h{n}" for t in ("f16", "q8_0") for n in (3, 2, 1)]
    row = {"f16": 2 * 64 * 2, "q8_0": 2 * 64 // 32 * 34}  # one KV head's K + V
    for c in heads:
        n, t = c["device_heads"], c["tail_type"]
        assert f"--kv-residency-mode head --kv-device-heads {n} -ctkt {t} -ctvt {t}" in c["command"]
        assert c["tail_fraction"] == (4 - n) / 4 and c["fractions"] == ([0.75, 1.0] if n == 1 else [1 - n / 4])
        assert c["tail_bytes_per_token"] == 1024 * 2 * (4 - n) * row[t]  # n_kv 1024 on every decoded token, 2 layers
        assert c["floor_ms"] == pytest.approx((0.01 + c["tail_bytes_per_token"] / 1e9) * 1e3)
        assert c["ratio_floor"] == pytest.approx(0.025 / (0.01 + c["tail_bytes_per_token"] / 1e9))
    assert any("head cells" in n for n in doc["notes"]) and doc["config"]["head_fractions"] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.build
def test_head_cells_on_cpu(cpu_build, demo_model, tmp_path):
    out = tmp_path / "heads.json"
    proc = _bench(cpu_build, "tail", str(demo_model), "-d", "508", "-n", "4", "-r", "1", "-t", "1", "--fractions", "0.5",
                  "--tail-types", "f16", "--head-fractions", "0.5", "--skip", "auto", "--skip", "ngl", "--skip", "nkvo",
                  "--slot-ring-mib", "0", "--pcie-bw-gbps", "2", "--json", str(out), "--no-plot")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert [c["kind"] for c in doc["cells"]] == ["resident", "window", "head"]
    h = doc["cells"][2]
    # 3 KV heads: 0.5 -> 2 on the device, one streamed per layer; 512 cells attended per decoded token
    assert h["id"] == "d508/head/f16/h2" and h["plan"]["kv_mode_chosen"] == "head" and "note" not in h
    assert (h["plan"]["heads_device"], h["plan"]["heads_host"]) == (60, 30)
    assert h["tail_bytes_per_token"] == 512 * 30 * 64 * 2 * 2 and h["tokens_per_s"] > 0 and h["ratio_floor"] > 0
    assert "head f16 33% tail (2 of 3 KV heads on the device)" in proc.stdout


@pytest.mark.build
def test_auto_tail_type_cell_on_cpu(cpu_build, demo_model, tmp_path):
    """--tail-types auto: the cell asks llama-bench for -ctkt/-ctvt auto with the run's link figure; the report takes the
    type the plan chose (llama-bench's type_k_tail_chosen) for its tail bytes and floors. A 0.05 GB/s link makes the 256-cell
    q8_0 tail's link time (~61 ms a token) exceed the resident time (the demo model's ~100 MB from host memory): q4_0."""
    out = tmp_path / "auto.json"
    proc = _bench(cpu_build, "tail", str(demo_model), "-d", "508", "-n", "4", "-r", "1", "-t", "1", "--fractions", "0.5",
                  "--tail-types", "f16,auto", "--skip", "auto", "--skip", "ngl", "--skip", "nkvo", "--slot-ring-mib", "0",
                  "--pcie-bw-gbps", "0.05", "--json", str(out), "--no-plot")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert [(c["kind"], c["tail_type"]) for c in doc["cells"]] == [("resident", None), ("window", "f16"), ("window", "auto")]
    c = doc["cells"][2]
    assert "-ctkt auto -ctvt auto" in c["command"] and "--pcie-bw-gbps 0.05" in c["command"]
    assert c["plan"]["type_k_tail"] == "auto" and c["plan"]["type_k_tail_chosen"] == c["plan"]["type_v_tail_chosen"] == "q4_0"
    assert c["tail_type_chosen"] == "q4_0/q4_0" and c["tail_bytes_per_token"] == (512 - 256) * 30 * 2 * 3 * 64 // 32 * 18
    assert c["ratio_floor"] > 0 and "window auto 50% tail (→q4_0/q4_0)" in proc.stdout
