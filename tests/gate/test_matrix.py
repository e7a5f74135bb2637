"""`rollingkv gate matrix` (scripts/gate-matrix.sh): option checks, the markdown table from a report, and the
whole matrix on the CPU build with the demo model at CI sizes (every cell must pass), plus a perturbed run that
must fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli import run_main

REPO = Path(__file__).resolve().parents[2]


def test_windows_and_types():
    from rollingkv_cli.gate import matrix as gm

    assert [gm.window_for(s, 384) for s in (0.25, 0.5, 0.75)] == [96, 192, 288]
    assert gm.window_for(0.001, 100) == 1 and gm.window_for(0.999, 100) == 99
    assert [gm.is_quantized(t) for t in ("f16", "f32", "q8_0", "q4_0", "bf16")] == [False, False, True, True, True]
    assert gm.needle_window(640) == 128 and gm.needle_window(1536) == 384 and gm.needle_window(100) == 64
    name = gm.default_name("cpu")
    assert name.endswith("-cpu") and name[:4].isdigit() and "/" not in name


@pytest.mark.parametrize("args,match", [
    (["--splits", "0.5,1.5"], "strictly between 0 and 1"),
    (["--splits", ","], "at least one"),
    (["--tail-types", "q8_0,q9"], "q9: not a cache type"),
    (["--exact-split", "1"], "strictly between 0 and 1"),
    (["--name", "a/b"], "plain file name"),
    (["--build", "/x", "--lib-dir", "/y"], "not both"),
])
def test_usage_errors(capsys, isolated_cache, args, match):
    code, _, err = run_main(["gate", "matrix", *args], capsys)
    assert code == 2 and match in err


def test_bad_lib_dir(capsys, isolated_cache, tmp_path, fake_gguf):
    code, _, err = run_main(["gate", "matrix", "--model", str(fake_gguf), "--lib-dir", str(tmp_path)], capsys)
    assert code == 1 and "no libllama.so" in err and "Traceback" not in err


def _report(**over) -> dict:
    th_same = {"max_mean_tv": 1e-4, "min_top1_agreement": 0.999, "max_real_frac": 0.0, "real_margin_nats": 0.5, "require_bitwise": True}
    th_q = {"max_mean_tv": 0.25, "max_real_frac": None, "baseline_factor": 2.5, "real_margin_nats": 0.5, "positions": "tail"}
    m0 = {"n": 384, "mean_tv": 0.0, "max_tv": 0.0, "mean_kl": 0.0, "top1_agreement": 1.0, "real_frac": 0.0, "bitwise_equal_rows": 384,
          "tail_positions": 192}
    mq = {"n": 384, "mean_tv": 0.15, "max_tv": 0.5, "mean_kl": 0.04, "top1_agreement": 0.9, "real_frac": 0.02, "bitwise_equal_rows": 192,
          "tail_positions": 192, "tail": {"n": 192, "mean_tv": 0.3}}
    how = {"max_mean_tv": {"absolute": 0.02, "baseline": 0.1, "factor": 2.5, "bound": 0.25},
           "max_real_frac": {"absolute": 0.01, "baseline": 0.01, "bound": None, "dropped": "bias"}}
    cells = [{"kind": "split", "tail": "f16", "split": 0.5, "window_cells": 192, "thresholds": th_same, "metrics": m0, "passed": True,
              "profile": "same_type", "relative_to_baseline": None, "command": "rollingkv gate equiv A"},
             {"kind": "split", "tail": "q4_0", "split": 0.5, "window_cells": 192, "thresholds": th_q, "metrics": mq, "passed": False,
              "profile": "quantized", "relative_to_baseline": how, "command": "rollingkv gate equiv B"}]
    r = {"verdict": "fail", "finished_at": "2026-11-30T10:00:00+0000", "host": {"name": "ci", "cpu": "Some CPU", "machine": "x86_64"},
         "backend": "cpu", "build": {"series_hash": "abcdef0123456789", "dir": "/b"}, "model": "/m/demo.gguf", "tokens": {"n": 384},
         "n_ctx": 768, "n_batch": 512, "threads": 2, "n_gpu_layers": None, "wall_s": 12.0, "argv": ["--tokens", "384"],
         "splits": [0.5], "tail_types": ["f16", "q4_0"], "cells": cells,
         "baselines": {"q4_0": {"metrics": mq}}, "exact": [], "needle": None}
    r.update(over)
    return r


def test_markdown_table():
    from rollingkv_cli.gate.matrix import markdown

    md = markdown(_report())
    assert md.startswith("# Gate matrix: FAIL")
    assert "| tail | window 0.5 (192 cells) | bounds |" in md
    f16_row = next(line for line in md.splitlines() if line.startswith("| `f16`"))
    q4_row = next(line for line in md.splitlines() if line.startswith("| `q4_0`"))
    assert "✓ TV 0," in f16_row and "bitwise 384/384" in f16_row and "top-1 ≥ 0.999, bit-identical |" in f16_row
    assert "tail read by 192" in f16_row
    assert "✗ TV 0.15 (tail 0.3)," in q4_row and "TV ≤ 0.25 (2.5× baseline over the tail positions)" in q4_row
    assert "real flips not bounded" in q4_row
    assert "`rollingkv gate matrix --tokens 384`" in md and "`rollingkv gate equiv B`" in md
    assert "## Needle" not in md


def test_markdown_order_floor():
    """A GPU matrix: the floor table, and each bound says whether the order floor set it."""
    from rollingkv_cli.gate.matrix import markdown

    r = _report(backend="cuda")
    f16 = r["cells"][0]
    f16["thresholds"] = dict(f16["thresholds"], max_mean_tv=0.02, min_top1_agreement=0.96, require_bitwise=False)
    f16["relative_to_order_floor"] = {"max_mean_tv": {"absolute": 1e-4, "floor": 0.01, "factor": 2.0, "bound": 0.02},
                                      "min_top1_agreement": {"absolute": 0.999, "floor": 0.98, "factor": 2.0, "bound": 0.96},
                                      "max_real_frac": {"absolute": 0.0, "floor": 0.0, "factor": 2.0, "bound": 0.0}}
    r["order_floors"] = {"f16": {"n_batch": 256, "metrics": {"n": 384, "mean_tv": 0.01, "max_tv": 0.2, "top1_agreement": 0.98,
                                                              "real_frac": 0.0, "bitwise_equal_rows": 0}}}
    f16["thresholds"].update(order_floor=True, max_frac_over_floor=0.05)
    f16["metrics"]["over_floor"] = {"n": 192, "quantile": 0.99, "floor_tv": 0.02, "factor": 2.0, "bound_tv": 0.04, "n_over": 3,
                                    "frac_over": 3 / 192}
    md = markdown(r)
    f16_row = next(line for line in md.splitlines() if line.startswith("| `f16`"))
    assert "TV ≤ 0.02 (2× order floor)" in f16_row and "top-1 ≥ 0.96 (2× order floor)" in f16_row and "real ≤ 0 (absolute)" in f16_row
    assert "tail read by 192, over floor 3/192 (TV > 0.04)" in f16_row
    assert "≤ 0.05 of the tail positions over 2× the floor's p99" in f16_row
    assert "## Order floors" in md and "| `f16` | 256 | 0.01 | 0.2 | 0.98 | 0 | 0/384 |" in md
    assert "## Order floors" not in markdown(_report()) and "over floor" not in markdown(_report())


def test_matrix_order_floor_per_position_bound(monkeypatch, tmp_path):
    """gate matrix with the order floor (a GPU matrix), its runs faked: each floor run writes its rows; the f16 cells and
    the exactness cells count their tail positions over 2 x the p99 of their own type's floor (f16's 0.002, q8_0's
    0.003) and fail on it; the quantized cells are bounded by their baseline and carry no count. Fails when a cell
    reads another type's floor, a quantized cell is held to the f16 floor, or the count is not in the report."""
    import numpy as np

    from rollingkv_cli.gate import common
    from rollingkv_cli.gate import equiv as gate_equiv
    from rollingkv_cli.gate import matrix as gm
    from rollingkv_cli.gate import metrics
    from rich.console import Console

    n = 256
    tv_of = {"order-floor-f16": (0.002, 0.002), "order-floor-q8_0": (0.003, 0.003), "baseline-q8_0": (0.01, 0.01),
             "cell-f16-50": (0.001, 0.005), "cell-q8_0-50": (0.0, 0.012), "exact-q8_0": (0.001, 0.005)}
    cmds = {}

    def run_child(role, cmd, log_path, result_path, progress=None, label="", total=0):
        cmds[role] = cmd
        if role == "tokenize":
            return {"n_tokens": n, "n_vocab": 100, "has_residency": True, "source": {"kind": "synthetic"}}
        split = json.loads(cmd[cmd.index("--residency") + 1])["mode"] != "off"
        w = json.loads(cmd[cmd.index("--residency") + 1]).get("window_cells", 0) if split else n
        tw, tt = tv_of.get(role, (0.0, 0.0))
        pos = np.arange(n)
        tv = np.where(pos >= w, tt, tw)
        ids = np.zeros(n, dtype=np.int64)
        rows = dict(pos=pos, tv=tv, kl=tv, top1_ref=ids, top1_cand=ids, margin=np.ones(n), topk_agree=np.ones(n, dtype=bool),
                    nonfinite=np.zeros(n, dtype=bool), bitwise=tv == 0)
        if "--positions-out" in cmd:
            np.savez(cmd[cmd.index("--positions-out") + 1], **rows)
        acc = metrics.GateAccumulator(_parts=[metrics.RowMetrics(*(rows[f] for f in ("tv", "kl", "top1_ref", "top1_cand", "margin",
                                                                                      "topk_agree", "nonfinite")))], _positions=[pos])
        summary = dict(acc.summary(), bitwise_equal_rows=int(rows["bitwise"].sum()), max_abs_logit_diff=0.0)
        plan = {"split": True, "window_cells": w, "mode_chosen": "window"} if split else None
        return {"lib": "x", "timings": {"decode_s": 1.0, "tokens_per_s": 256.0, "compare_s": 0.1}, "summary": summary, "plan": plan}

    monkeypatch.setattr(gate_equiv, "run_child", run_child)
    (tmp_path / "lib").mkdir()
    build = common.GateBuild(tmp_path / "lib", None, True)
    cfg = gm.MatrixConfig(model=tmp_path / "m.gguf", model_spec="m", build=build, tokens=n, splits=(0.5,), tail_types=("f16", "q8_0"),
                          needle=False, order_floor=True, threads=1, n_gpu_layers=99)
    r = gm.run(cfg, Console(file=open(os.devnull, "w")), tmp_path, tmp_path)
    assert all("--positions-out" in cmds[f"order-floor-{t}"] for t in ("f16", "q8_0"))
    f16, q8 = r["cells"]
    ex = r["exact"][0]
    assert f16["metrics"]["over_floor"]["bound_tv"] == pytest.approx(0.004) and f16["metrics"]["over_floor"]["n_over"] == 128
    assert ex["metrics"]["over_floor"]["bound_tv"] == pytest.approx(0.006) and ex["metrics"]["over_floor"]["n_over"] == 0
    assert f16["failed_checks"] == ["max_frac_over_floor"] and ex["passed"]
    assert "over_floor" not in q8["metrics"] and q8["thresholds"]["max_frac_over_floor"] is None and q8["passed"]
    assert r["failed_cells"] == ["f16@0.5"]
    md = gm.markdown(r)
    assert "over floor 128/128 (TV > 0.004)" in md and "over floor 0/128 (TV > 0.006)" in md


# ---------------------------------------------------------------- the real matrix (CI sizes)

CI_SIZES = ["--tokens", "384", "--needle-filler-tokens", "640", "--threads", "2"]


def _matrix(cpu_build, args, env_extra=None, timeout=900):
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), "PYTHON": sys.executable, **(env_extra or {})}
    env.pop("LLAMA_CPP_LIB_PATH", None)
    return subprocess.run(["bash", str(REPO / "scripts" / "gate-matrix.sh"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.mark.build
@pytest.mark.slow
def test_matrix_ci_sizes_every_cell_passes(cpu_build, demo_model, tmp_path):
    out = tmp_path / "gates"
    proc = _matrix(cpu_build, ["--model", str(demo_model), *CI_SIZES, "--out", str(out), "--name", "ci"])
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads((out / "ci.json").read_text())
    md = (out / "ci.md").read_text()
    assert r["verdict"] == "pass" and r["failed_cells"] == [] and r["backend"] == "cpu"
    assert r["order_floors"] == {} and "--order-floor" not in r["cells"][0]["command"]  # the CPU split is bit-identical: no floor
    assert r["build"]["dir"] == str(cpu_build.dir)
    assert [(c["tail"], c["window_cells"]) for c in r["cells"]] == [(t, w) for t in ("f16", "q8_0", "q4_0", "auto") for w in (96, 192, 288)]
    assert all(c["passed"] for c in r["cells"] + r["exact"])
    for c in r["cells"]:
        assert c["plan"]["split"] and c["plan"]["window_cells"] == c["window_cells"]
        if c["tail"] == "auto":  # the planner's type (a short tail of the demo model on the CPU: the q8_0 floor), the auto bounds
            assert c["tail_types_chosen"]["k"] == c["tail_types_chosen"]["v"] == "q8_0" and c["profile"] == "auto"
            assert c["thresholds"]["positions"] == "tail" and c["thresholds"]["max_mean_tv"] == 0.04
            assert 0 < c["metrics"]["tail"]["mean_tv"] <= 0.04 and c["metrics"]["tail"]["p99_tv"] <= 0.11
            assert "--no-needle" in c["command"] and "-ctkt auto" in c["command"]
        elif c["tail"] == "f16":  # the split of a same-type cache is exact
            assert c["metrics"]["mean_tv"] == 0.0 and c["metrics"]["bitwise_equal_rows"] == 384
        else:  # a quantized tail loses something, within factor x its own type's resident loss at the same positions
            assert c["metrics"]["mean_tv"] > 0 and c["profile"] == "quantized" and c["thresholds"]["positions"] == "tail"
            base = c["relative_to_baseline"]["baseline_tail"]
            assert base["n"] == c["metrics"]["tail_positions"] == 384 - c["window_cells"]
            assert c["thresholds"]["max_mean_tv"] == pytest.approx(c["thresholds"]["baseline_factor"] * base["mean_tv"])
            assert c["metrics"]["tail"]["mean_tv"] <= c["thresholds"]["max_mean_tv"]
    assert {e["type"] for e in r["exact"]} == {"q8_0", "q4_0"}
    assert all(e["metrics"]["bitwise_equal_rows"] == 384 for e in r["exact"])  # quantized parts: bit-identical
    nd = r["needle"]
    assert nd["verdict"] == "pass" and nd["plan"]["window_cells"] == 128
    assert all(p["needle_in_tail"] and p["identical"] and p["reference_retrieved"] for p in nd["placements"])
    assert md.startswith("# Gate matrix: PASS") and "| `q4_0` |" in md and "## Needle: PASS" in md
    assert "| `auto` | ✓ → `q8_0`/`q8_0`: tail TV" in md and "top-1 ≥ 0.9 (auto)" in md


@pytest.mark.build
def test_matrix_fails_on_a_perturbed_merge(cpu_build, demo_model, tmp_path):
    """One f16 cell with the op's test hook on: the matrix reports it and exits 1."""
    out = tmp_path / "gates"
    proc = _matrix(cpu_build, ["--model", str(demo_model), "--tokens", "256", "--splits", "0.5", "--tail-types", "f16", "--no-needle",
                               "--threads", "2", "--out", str(out), "--name", "bad"],
                   env_extra={"ROLLINGKV_DEBUG_PERTURB_TAIL": "0.02"})
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads((out / "bad.json").read_text())
    assert r["verdict"] == "fail" and r["failed_cells"] == ["f16@0.5"] and "max_mean_tv" in r["cells"][0]["failed_checks"]
    assert (out / "bad.md").read_text().startswith("# Gate matrix: FAIL")


@pytest.fixture
def faked_matrix(monkeypatch, isolated_cache, tmp_path):
    """An active build (an empty libllama.so) and a matrix run that returns the CPU record in docs/gates: what happens
    around the run (where the report goes) without decoding anything."""
    from rollingkv_cli.gate import matrix as gm
    from rollingkv_cli.lib import builder

    bdir = tmp_path / "build"
    (bdir / "build" / "bin").mkdir(parents=True)
    (bdir / "build" / "bin" / "libllama.so").write_bytes(b"")
    monkeypatch.setattr(builder, "active_build", lambda required=True: builder.Build(bdir, {"pin": "x", "series_hash": "y", "options": {}}))
    record = json.loads((REPO / "docs" / "gates" / "2026-11-30-vm-cpu.json").read_text())
    monkeypatch.setattr(gm, "run", lambda cfg, console, logs, work: record)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def test_outside_the_repository_the_report_lands_here_and_is_never_overwritten(faked_matrix, fake_gguf, capsys):
    """issue 39: gate matrix wrote ./docs/gates/ into whatever directory it ran in and replaced that day's report. Seen
    failing before the fix: the first run made elsewhere/docs/gates/<date>-<host>-cpu.json, the second overwrote it."""
    from rollingkv_cli.gate import matrix as gm

    base = f"gate-matrix-{gm.default_name('cpu')}"
    args = ["gate", "matrix", "--model", str(fake_gguf), "--no-needle"]
    for expect in (base, f"{base}-2"):
        code, _, err = run_main(args, capsys)
        assert code == 0, err
        assert (faked_matrix / f"{expect}.json").is_file() and (faked_matrix / f"{expect}.md").is_file()
    assert not (faked_matrix / "docs").exists()
    code, _, err = run_main([*args, "--name", base], capsys)  # an explicit name that is taken: refused before the run
    assert code == 1 and "gate matrix does not overwrite a report" in err and "--force" in err
    code, _, err = run_main([*args, "--name", base, "--force"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in faked_matrix.iterdir()) == sorted(f"{n}.{s}" for n in (base, f"{base}-2") for s in ("json", "md"))


def test_inside_the_repository_the_report_goes_to_docs_gates(monkeypatch):
    """The records' place stays the default where they belong (the checkout; scripts/gate-matrix.sh runs there)."""
    from rollingkv_cli.gate import matrix as gm

    monkeypatch.chdir(REPO / "rollingkv_cli")
    out, name = gm.report_place(None, None, "cpu")
    assert out == REPO / "docs" / "gates" and name.startswith(gm.default_name("cpu"))
