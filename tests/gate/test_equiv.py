"""`rollingkv gate equiv`: help, bad input (one clear line, no traceback), the verdict's exit status and report
(with the child runs faked), and real runs on the CPU build with the demo model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollingkv_cli.cli import rollingkv
from conftest import assert_reference_resident
from test_cli import run_main


HELP_OPTIONS = {
    "equiv": ("--synthetic-tokens", "--kv-window-cells", "-ctkt", "--reference", "--thresholds", "--tail-baseline", "--order-floor", "--n-seq", "-ngl", "--json"),
    "needle": ("--depth", "--filler-tokens", "--seed", "--format", "--kv-window-cells", "--vram-target", "-ctkt", "-ngl", "--json", "inconclusive"),
    "vram": ("--vram-target", "--allowance", "--n-predict", "--interval-ms", "--gpu", "--json", "no NVIDIA GPU found"),
    "matrix": ("--tail-types", "--splits", "--needle-filler-tokens", "--build", "--lib-dir", "-ngl", "--out"),
}


@pytest.mark.parametrize("cmd", [["gate"], *(["gate", c] for c in HELP_OPTIONS)], ids=" ".join)
def test_help(runner, cmd):
    result = runner.invoke(rollingkv, [*cmd, "--help"], catch_exceptions=False)
    assert result.exit_code == 0 and "Usage:" in result.output
    for opt in HELP_OPTIONS.get(cmd[-1], ()):
        assert opt in result.output, opt


@pytest.mark.parametrize("args,match", [
    (["--prompt-file", "{gguf}", "--synthetic-tokens", "8"], "not both"),
    (["--kv-window-cells", "8", "--vram-target", "100"], "not both"),
    (["-ctk", "q9"], "q9"),
    (["-ctvt", "f8"], "f8"),
    (["--kv-residency-mode", "window", "--kv-device-heads", "1"], "does not make: use head"),
    (["--kv-residency-mode", "head", "--kv-window-cells", "256"], "use --kv-device-heads N"),
    (["--kv-device-heads", "1", "--vram-target", "100"], "one of them"),
    (["--kv-device-heads", "0"], "at least 1"),
    (["--reference", "vanilla"], "neither"),
    (["--synthetic-tokens", "0"], "at least 1"),
])
def test_usage_errors_exit_2(capsys, isolated_cache, fake_gguf, args, match):
    args = [a.replace("{gguf}", str(fake_gguf)) for a in args]
    code, _, err = run_main(["gate", "equiv", "--model", str(fake_gguf), *args], capsys)
    assert code == 2 and match in err


def _one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("args,match,exit_code", [
    # flags that contradict each other are usage errors (2), as click's own checks of one flag
    (["--ctx", "1024", "--kv-window-cells", "1024"], "must be smaller than --ctx 1024", 2),
    (["--ctx", "512", "--synthetic-tokens", "600"], "do not fit --ctx 512", 2),
    (["--reference", "lib:/nonexistent/dir"], "does not exist", 1),
    (["--reference", "lib:{tmp}"], "no libllama.so", 1),
    (["--thresholds", "{tmp}/missing.yaml"], "cannot read", 1),
])
def test_bad_input_one_line(capsys, isolated_cache, fake_gguf, tmp_path, args, match, exit_code):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, _, err = run_main(["gate", "equiv", "--model", str(fake_gguf), *args], capsys)
    assert code == exit_code and match in _one_error(err)


def test_missing_model(capsys, isolated_cache):
    code, _, err = run_main(["gate", "equiv", "--model", "/nonexistent/model.gguf"], capsys)
    assert code == 1 and "not found" in _one_error(err)


def test_without_a_build(capsys, isolated_cache, fake_gguf):
    code, _, err = run_main(["gate", "equiv", "--model", str(fake_gguf)], capsys)
    assert code == 1 and "no rollingkv build" in _one_error(err)


def test_bad_thresholds_file(capsys, isolated_cache, fake_gguf, tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("max_mean_tv: lots\n")
    code, _, err = run_main(["gate", "equiv", "--model", str(fake_gguf), "--thresholds", str(f)], capsys)
    assert code == 1 and "max_mean_tv" in _one_error(err) and "hint:" in err


# ---------------------------------------------------------------- the command with its child runs faked

GOOD = {"n": 512, "mean_tv": 0.0, "max_tv": 0.0, "mean_kl": 0.0, "max_kl": 0.0, "top1_agreement": 1.0, "real_frac": 0.0,
        "frac_full_agree": 1.0, "nonfinite": 0, "n_top1_disagree": 0, "n_real": 0, "real_margin_nats": 0.5, "topk": 5,
        "worst": [], "max_abs_logit_diff": 0.0, "bitwise_equal_rows": 512, "bitwise_identical": True}


@pytest.fixture
def fake_runs(monkeypatch, isolated_cache, tmp_path):
    """Active build = a directory with an empty libllama.so (a CUDA build when state["options"]["cuda"]); gate_equiv.run_child
    answers from `state`: the summary, and per-position rows (--positions-out) whose TV is state["tv"][role] = (rows in
    the window, rows past it), bit-identical where the TV is 0; the candidate's plan has a window of state["window"] cells."""
    import numpy as np

    from rollingkv_cli.lib import builder
    from rollingkv_cli.gate import equiv as gate_equiv

    bdir = tmp_path / "build"
    (bdir / "build" / "bin").mkdir(parents=True)
    (bdir / "build" / "bin" / "libllama.so").write_bytes(b"")
    state = {"has_residency": True, "n_tokens": 512, "summary": dict(GOOD), "calls": [], "cmds": {}, "window": 256, "tv": {},
             "options": {"cuda": False}}
    monkeypatch.setattr(builder, "active_build",
                        lambda required=True: builder.Build(bdir, {"pin": "x", "series_hash": "y", "options": state["options"]}))

    def rows(role, n, window):
        tv_win, tv_tail = state["tv"].get(role, (0.0, 0.0))
        pos = np.arange(n)
        tv = np.where(pos >= window, tv_tail, tv_win)
        ids = np.zeros(n, dtype=np.int64)
        return dict(pos=pos, tv=tv, kl=tv, top1_ref=ids, top1_cand=ids, margin=np.ones(n), topk_agree=np.ones(n, dtype=bool),
                    nonfinite=np.zeros(n, dtype=bool), bitwise=tv == 0)

    def run_child(role, cmd, log_path, result_path, progress=None, label="", total=0):
        state["calls"].append(role)
        state["cmds"][role] = cmd
        timings = {"load_s": 0.1, "decode_s": 1.0, "tokens_per_s": 512.0, "compare_s": 0.5, "total_s": 1.6}
        if role == "tokenize":
            return {"n_tokens": state["n_tokens"], "n_vocab": 100, "has_residency": state["has_residency"],
                    "source": {"kind": "synthetic"}}
        if role == "reference":
            return {"lib": "ref/libllama.so", "timings": timings, "plan": None}
        split = "--residency" in cmd and json.loads(cmd[cmd.index("--residency") + 1])["mode"] != "off"
        plan = ({"mode_requested": "window", "mode": "window", "split": True, "window_cells": state["window"], **state.get("plan_extra", {})}
                if split else None)
        r = rows(role, state["n_tokens"], state["window"] if split else 10**9)
        if "--positions-out" in cmd:
            np.savez(cmd[cmd.index("--positions-out") + 1], **r)
        summary = state["summary"]
        if role in state["tv"]:  # the summary of these rows
            summary = dict(GOOD, mean_tv=float(r["tv"].mean()), max_tv=float(r["tv"].max()), mean_kl=float(r["tv"].mean()),
                           bitwise_equal_rows=int(r["bitwise"].sum()), bitwise_identical=bool(r["bitwise"].all()))
        return {"lib": "cand/libllama.so", "timings": timings, "summary": summary, "plan": plan}

    monkeypatch.setattr(gate_equiv, "run_child", run_child)
    return state


def test_too_few_tokens_say_what_to_do(capsys, fake_runs, fake_gguf, tmp_path):
    """The second sweep (issue 39): "the text holds fewer than 4 tokens" and "P holds no tokens" had no hint."""
    fake_runs["n_tokens"] = 3
    code, _, err = run_main(["gate", "equiv", "--model", str(fake_gguf), "--synthetic-tokens", "3", "--n-seq", "4"], capsys)
    assert code == 1 and "fewer than 4 tokens" in _one_error(err) and "hint: lower --n-seq, or give more text" in err, err
    fake_runs["n_tokens"] = 0
    prompt = tmp_path / "p.txt"
    prompt.write_text(" ")
    code, _, err = run_main(["gate", "equiv", "--model", str(fake_gguf), "--prompt-file", str(prompt)], capsys)
    assert code == 1 and "holds no tokens" in _one_error(err) and "hint: give a file with text in it" in err, err


def test_pass_exits_0_and_writes_the_report(capsys, fake_runs, fake_gguf, tmp_path):
    out = tmp_path / "r.json"
    code, stdout, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "--json", str(out)], capsys)
    assert code == 0 and "PASS" in stdout
    assert fake_runs["calls"] == ["tokenize", "reference", "candidate"]
    r = json.loads(out.read_text())
    assert r["verdict"] == "pass" and r["passed"] and r["failed_checks"] == []
    assert r["profile"] == "same_type" and r["thresholds"]["max_mean_tv"] == 1e-4
    assert r["n_ctx"] == 768  # 512 tokens rounded up to 256, plus 256
    assert r["candidate"]["residency"]["window_cells"] == 256 and r["candidate"]["plan"]["mode"] == "window"
    assert r["reference"]["residency"] == {"mode": "off"}
    assert set(r["commands"]) == {"tokenize", "reference", "candidate"}
    cand = fake_runs["cmds"]["candidate"]
    assert json.loads(cand[cand.index("--residency") + 1])["mode"] == "window"
    assert "--save-logits" in fake_runs["cmds"]["reference"] and "--reference-logits" in cand


def test_fail_exits_1_and_names_the_bound(capsys, fake_runs, fake_gguf, tmp_path):
    fake_runs["summary"] = dict(GOOD, mean_tv=3e-4, real_frac=1 / 512, n_real=1)
    out = tmp_path / "r.json"
    code, stdout, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "--json", str(out)], capsys)
    assert code == 1 and "FAIL" in stdout and "mean_tv" in stdout
    r = json.loads(out.read_text())
    assert r["verdict"] == "fail" and set(r["failed_checks"]) == {"max_mean_tv", "max_real_frac"}


def test_quantized_tail_gets_the_quantized_bounds(capsys, fake_runs, fake_gguf, tmp_path):
    fake_runs["summary"] = dict(GOOD, mean_tv=0.01, top1_agreement=0.97, real_frac=0.004)
    out = tmp_path / "r.json"
    code, _, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "-ctvt", "q8_0", "--json", str(out)], capsys)
    r = json.loads(out.read_text())
    assert code == 0 and r["profile"] == "quantized" and r["cache_types"]["v_tail"] == "q8_0"
    # and a thresholds file can tighten them again
    th = tmp_path / "t.yaml"
    th.write_text("quantized:\n  max_mean_tv: 0.001\n")
    code, _, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "-ctvt", "q8_0", "--thresholds", str(th)], capsys)
    assert code == 1


def test_cpu_same_type_split_must_be_bit_identical(capsys, fake_runs, fake_gguf, tmp_path):
    """One row off by a bit (mean TV 1e-6, far inside the old 1e-4 bound) fails on the CPU; --tolerance gives a mean-TV
    bound instead. Fails when the same-type profile accepts a bound by default again."""
    fake_runs["summary"] = dict(GOOD, mean_tv=1e-6, max_tv=5e-4, bitwise_equal_rows=511, bitwise_identical=False)
    out = tmp_path / "r.json"
    code, stdout, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "--json", str(out)], capsys)
    r = json.loads(out.read_text())
    assert code == 1 and r["failed_checks"] == ["bitwise"] and "bit-identical" in stdout
    code, _, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "--tolerance", "1e-5",
                           "--json", str(out)], capsys)
    r = json.loads(out.read_text())
    assert code == 0 and not r["thresholds"]["require_bitwise"] and r["thresholds"]["max_mean_tv"] == 1e-5
    code, _, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "--tolerance", "1e-7"], capsys)
    assert code == 1
    # an f32 tail under an f16 window holds other bits: same-type bounds, no bit-identity
    code, _, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "-ctkt", "f32", "-ctvt", "f32",
                           "--json", str(out)], capsys)
    r = json.loads(out.read_text())
    assert code == 0 and r["profile"] == "same_type" and not r["thresholds"]["require_bitwise"]


def test_a_tail_no_position_read_fails(capsys, fake_runs, fake_gguf, tmp_path):
    """A window holding every token proves nothing: exit 1, said so, and the report counts the positions that read the
    tail (0 here, 512 - 256 with a window of 256). Fails when the gate passes a split that never reached its tail."""
    fake_runs["window"] = 1024
    out = tmp_path / "r.json"
    code, stdout, err = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "1024", "--ctx", "2048",
                                  "--json", str(out)], capsys)
    r = json.loads(out.read_text())
    assert code == 1 and "the tail was never used: lower --kv-window-cells or use more tokens" in stdout
    assert r["tail_positions"] == 0 and r["failed_checks"] == ["min_tail_positions"]
    fake_runs["window"] = 256
    code, _, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "--json", str(out)], capsys)
    assert code == 0 and json.loads(out.read_text())["tail_positions"] == 256


@pytest.mark.parametrize("tail_tv,control_tv,code,failed", [
    (0.014, 0.0, 0, []),                                  # 1.4 x the baseline at the same positions: within q8_0's 1.5 x
    (0.016, 0.0, 1, ["max_mean_tv"]),                     # over it
    (0.01, 1e-6, 1, ["control.bitwise"]),                 # the merge of quantized parts is not exact
])
def test_tail_baseline_compares_the_positions_that_read_the_tail(capsys, fake_runs, fake_gguf, tmp_path, tail_tv, control_tv, code, failed):
    """--tail-baseline: the candidate's mean TV over the positions past the window against baseline_factor x the
    baseline's over the same positions (not diluted by the 256 exact window positions: over all 512 a TV of 0.016 would
    be 0.008, inside 1.5 x 0.01), and the control (q8_0 window + q8_0 tail vs the baseline) must be bit-identical.
    Fails when the bound is taken over every position (the second case passes) or the control is left out (the third)."""
    fake_runs["tv"] = {"baseline": (0.01, 0.01), "candidate": (0.0, tail_tv), "control": (0.0, control_tv)}
    out = tmp_path / "r.json"
    rc, stdout, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "-ctkt", "q8_0", "-ctvt", "q8_0",
                              "--tail-baseline", "--json", str(out)], capsys)
    r = json.loads(out.read_text())
    assert fake_runs["calls"] == ["tokenize", "reference", "baseline", "candidate", "control"]
    assert rc == code and r["failed_checks"] == failed, stdout
    assert r["thresholds"]["max_mean_tv"] == pytest.approx(0.015) and r["thresholds"]["positions"] == "tail"
    assert r["baseline"]["tail_metrics"]["n"] == 256 and r["tail_metrics"]["mean_tv"] == pytest.approx(tail_tv)
    ctl = fake_runs["cmds"]["control"]
    res = json.loads(ctl[ctl.index("--residency") + 1])
    assert ctl[ctl.index("-ctk") + 1] == "q8_0" and res["window_cells"] == 256 and res["type_k_tail"] is None
    assert ctl[ctl.index("--reference-logits") + 1].endswith("baseline.npy")


@pytest.mark.parametrize("cand_tv,code,n_over", [
    ((0.002, 0.003), 0, 0),           # a correct split: within 2 x the floor at every tail position
    ((0.001, 0.005), 1, 256),         # every tail position over 2 x the floor's p99 (0.004); the mean (0.003) is not
])
def test_gpu_order_floor_counts_the_tail_positions_over_the_per_position_bound(capsys, fake_runs, fake_gguf, tmp_path, cand_tv, code, n_over):
    """A CUDA build: the order floor is on by default, its run writes per-position rows, and the report (table, JSON)
    counts the positions that read the tail whose TV exceeds 2 x the floor run's 99th-percentile TV over them. The
    second case passes every mean bound (2 x the floor's mean TV 0.002) and fails only the per-position check. Fails
    when the floor's rows are not read, the window positions are counted, or the check is not applied."""
    fake_runs["options"]["cuda"] = True
    fake_runs["tv"] = {"order_floor": (0.002, 0.002), "candidate": cand_tv}
    out = tmp_path / "r.json"
    rc, stdout, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "--json", str(out)], capsys)
    r = json.loads(out.read_text())
    assert fake_runs["calls"] == ["tokenize", "reference", "order_floor", "candidate"]
    assert "--positions-out" in fake_runs["cmds"]["order_floor"]
    assert rc == code and r["failed_checks"] == ([] if code == 0 else ["max_frac_over_floor"]), stdout
    of = r["over_floor"]
    assert of["n"] == 256 == r["tail_positions"] and of["floor_tv"] == pytest.approx(0.002) and of["bound_tv"] == pytest.approx(0.004)
    assert of["n_over"] == n_over and of["frac_over"] == n_over / 256 and "over_floor" not in r["metrics"]
    assert r["thresholds"]["max_frac_over_floor"] == 0.05 and r["thresholds"]["order_floor"]
    assert r["metrics"]["mean_tv"] <= r["thresholds"]["max_mean_tv"] == pytest.approx(0.004)
    check = next(c for c in r["checks"] if c["name"] == "max_frac_over_floor")
    assert check["value"] == n_over / 256 and check["bound"] == 0.05 and check["over"] == "tail"
    assert "tail TV > 2× floor p99 = 0.004000" in stdout and f"{n_over}/256" in stdout
    if code:
        assert "256 of 256 positions that read the tail exceed 2 x the order floor's 99th-percentile TV (0.004)" in stdout
    # a thresholds file sets the fraction (1: any count passes) or disables the check (null)
    for text in ("max_frac_over_floor: 1\n", "max_frac_over_floor: null\n"):
        th = tmp_path / "t.yaml"
        th.write_text(text)
        assert run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "--thresholds", str(th)], capsys)[0] == 0


def test_gpu_order_floor_per_position_bound_skips_a_quantized_tail_and_checks_the_control(capsys, fake_runs, fake_gguf, tmp_path):
    """--tail-baseline on a CUDA build: the quantized candidate's loss exceeds the f16 floor at every tail position and
    is bounded by its baseline (no per-position floor check); the control (same type, against the baseline) gets
    the per-position bound. Fails when the quantized candidate is held to the f16 floor, or the control is not."""
    fake_runs["options"]["cuda"] = True
    fake_runs["tv"] = {"order_floor": (0.002, 0.002), "baseline": (0.01, 0.01), "candidate": (0.0, 0.014), "control": (0.001, 0.006)}
    out = tmp_path / "r.json"
    rc, stdout, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "-ctkt", "q8_0", "-ctvt", "q8_0",
                              "--tail-baseline", "--json", str(out)], capsys)
    r = json.loads(out.read_text())
    assert r["over_floor"] is None and r["thresholds"]["max_frac_over_floor"] is None
    assert r["control"]["over_floor"]["n_over"] == 256 and r["control"]["over_floor"]["bound_tv"] == pytest.approx(0.004)
    assert rc == 1 and r["failed_checks"] == ["control.max_frac_over_floor"], stdout


AUTO_PLAN = {"tail_types": {"requested_k": "auto", "requested_v": "auto", "auto": True, "k": "q8_0", "v": "q8_0",
                             "reason": "auto: K q8_0, V q8_0 (the floor): ..."}}


@pytest.mark.parametrize("chosen,tail_tv,code,bound", [
    ("q8_0", 0.035, 0, 0.04),   # a tail of 8 bits: the 8-bit bounds
    ("q8_0", 0.045, 1, 0.04),
    ("q4_0", 0.06, 0, 0.16),    # auto chose q4_0: the 4-bit bounds
    ("q4_0", 0.17, 1, 0.16),
])
def test_auto_tail_types_get_the_bounds_of_the_chosen_type(capsys, fake_runs, fake_gguf, tmp_path, chosen, tail_tv, code, bound):
    """-ctkt/-ctvt auto: the loss over the positions that read the tail against the resident cache, bounded for the type the
    plan chose (the window's positions, exact here, would dilute it); the report says what was chosen and the loss."""
    fake_runs["plan_extra"] = {"tail_types": dict(AUTO_PLAN["tail_types"], k=chosen, v=chosen)}
    fake_runs["tv"]["candidate"] = (0.0, tail_tv)
    out = tmp_path / "r.json"
    code_, stdout, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "-ctkt", "auto", "-ctvt", "auto",
                                 "--no-needle", "--json", str(out)], capsys)
    assert code_ == code, stdout
    r = json.loads(out.read_text())
    assert r["profile"] == "auto" and r["thresholds"]["positions"] == "tail" and r["thresholds"]["max_mean_tv"] == bound
    a = r["auto_tail"]
    assert a["requested"] == {"k": "auto", "v": "auto"} and a["chosen"] == {"k": chosen, "v": chosen} and a["needle"] is None
    assert a["loss"]["positions"] == 256 and a["loss"]["mean_tv"] == pytest.approx(tail_tv) and a["loss"]["p99_tv"] == pytest.approx(tail_tv)
    assert a["bounds"]["max_mean_tv"] == bound and a["loss_passed"] == (code == 0)
    assert f"auto tail types: K {chosen}, V {chosen}" in stdout and "99th-percentile total variation" in stdout
    cand = fake_runs["cmds"]["candidate"]
    assert json.loads(cand[cand.index("--residency") + 1])["type_k_tail"] == "auto"
    if code:
        assert "max_mean_tv" in r["failed_checks"]


def test_auto_tail_types_run_the_needle_and_fail_with_it(capsys, fake_runs, fake_gguf, tmp_path, monkeypatch):
    """With auto the needle runs by default (with the candidate's residency and plan); its failure fails the gate."""
    from rollingkv_cli.gate import common as gate_common
    from rollingkv_cli.gate import equiv as gate_equiv

    fake_runs["plan_extra"] = AUTO_PLAN
    fake_runs["tv"]["candidate"] = (0.0, 0.01)
    seen = {}

    def needle(model, build, plan, **kw):
        seen.update(kw, plan=plan)
        return {"verdict": seen.get("verdict", "fail"), "placements": [], "tail_types": {"k": "q8_0", "v": "q8_0"}}

    monkeypatch.setattr(gate_equiv, "auto_needle", needle)
    monkeypatch.setattr(gate_common.GateBuild, "require_server", lambda self: Path("/bin/true"))
    out = tmp_path / "r.json"
    code, stdout, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "-ctkt", "auto", "--json", str(out)],
                               capsys)
    assert code == 1 and "the needle" in stdout
    r = json.loads(out.read_text())
    assert r["failed_checks"] == ["needle"] and r["auto_tail"]["loss_passed"] and r["auto_tail"]["needle"]["verdict"] == "fail"
    assert seen["plan"]["window_cells"] == 256 and seen["window_cells"] == 256 and seen["ctkt"] == "auto" and seen["ctvt"] is None


@pytest.mark.parametrize("plan,filler,depths", [
    ({"split": True, "mode_chosen": "window", "window_cells": 256}, 1000, (0.504, 0.752)),
    ({"split": True, "mode_chosen": "window", "window_cells": 950}, 1000, None),   # 50 filler tokens in the tail: no room
    ({"split": True, "mode_chosen": "head", "window_cells": 0}, 1000, (0.5, 0.85)),
    ({"split": False, "mode_chosen": "resident"}, 1000, None),
])
def test_the_needle_lies_in_the_tail(plan, filler, depths):
    from rollingkv_cli.gate import equiv as gate_equiv

    assert gate_equiv.needle_depths(plan, filler) == depths


@pytest.mark.parametrize("args,match", [
    (["--kv-residency-mode", "off", "-ctkt", "auto"], "-ctkt auto chooses the type of a split's tail, and --kv-residency-mode off never splits"),
    (["-ctvt", "auto", "--tail-baseline"], "auto chooses only when it plans"),
    (["--needle"], "--needle goes with auto tail types"),
    (["-ctkt", "automatic"], "automatic"),
])
def test_auto_usage_errors_exit_2(capsys, isolated_cache, fake_gguf, args, match):
    code, _, err = run_main(["gate", "equiv", "--model", str(fake_gguf), *args], capsys)
    assert code == 2 and match in err and "Traceback" not in err


def test_auto_with_a_head_split_whose_heads_cannot_take_the_type_exits_2(capsys, isolated_cache, tmp_path):
    """Heads of 40 elements: q8_0/q4_0 blocks of 32 do not divide them, so a requested head split with auto is refused before any
    run (a window split of the same model is fine: its rows of 4 x 40 are whole blocks)."""
    from rollingkv_cli import models

    model = models.write_synthetic(tmp_path / "h40.gguf", models.SynthSpec(layers=2, embd=160, heads=4, kv_heads=4, ff=256, vocab=300,
                                                                           ctx=512))
    code, _, err = run_main(["gate", "equiv", "--model", str(model), "--kv-residency-mode", "head", "-ctkt", "auto"], capsys)
    assert code == 2 and "K head size 40" in _one_error(err) and "cannot take the q8_0/q4_0 tail" in err


def test_no_residency_api_is_refused_before_decoding(capsys, fake_runs, fake_gguf):
    fake_runs["has_residency"] = False
    code, _, err = run_main(["gate", "equiv", "--model", str(fake_gguf)], capsys)
    assert code == 1 and "this build has no KV residency API; rebuild" in _one_error(err)
    assert fake_runs["calls"] == ["tokenize"]
    # mode off needs no residency API
    code, _, _ = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-residency-mode", "off"], capsys)
    assert code == 0


def test_prompt_longer_than_ctx(capsys, fake_runs, fake_gguf, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    fake_runs["n_tokens"] = 900
    code, _, err = run_main(["gate", "equiv", "--model", str(fake_gguf), "--prompt-file", str(prompt), "--ctx", "512"], capsys)
    assert code == 2 and "does not fit --ctx 512" in _one_error(err)  # usage errors, as in gate needle (issue 27: 14)
    code, _, err = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "1280"], capsys)
    assert code == 2 and "smaller than the context (1280)" in _one_error(err)


def test_synthetic_text_is_deterministic():
    from rollingkv_cli.gate.runner import synthetic_text

    a, b = synthetic_text(5000), synthetic_text(5000)
    assert a == b and len(a) >= 5000 and a != synthetic_text(5000, seed=1)
    assert any(ch.isdigit() for ch in a) and "Alice" in a and "\n\n" in a


# ---------------------------------------------------------------- real runs on the CPU build

def _gate(cpu_build, args, timeout=300, env_extra=None):
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), **(env_extra or {})}
    env.pop("LLAMA_CPP_LIB_PATH", None)
    return subprocess.run([sys.executable, "-m", "rollingkv_cli", "gate", "equiv", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _has_residency(lib_dir: Path) -> bool:
    code = f"import ctypes; print(hasattr(ctypes.CDLL({str(lib_dir / 'libllama.so')!r}), 'llama_init_from_model_rolling_kv'))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"


SMALL = ["--synthetic-tokens", "512", "--ctx", "1024", "--threads", "2"]


@pytest.mark.build
def test_e2e_mode_off_twice_is_deterministic(cpu_build, demo_model, tmp_path):
    """Mode off against the resident reference is the same library decoding the same cache twice: this shows the
    decode is deterministic (and the plumbing exact), not that it equals upstream, which
    test_e2e_unpatched_reference_is_bitwise_identical shows against `rollingkv build --unpatched`."""
    out = tmp_path / "r.json"
    proc = _gate(cpu_build, ["--model", str(demo_model), *SMALL, "--kv-residency-mode", "off", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "PASS" in proc.stdout
    r = json.loads(out.read_text())
    m = r["metrics"]
    assert m["n"] == 512 and m["mean_tv"] == 0.0 and m["max_kl"] == 0.0 and m["top1_agreement"] == 1.0
    assert m["bitwise_identical"] and m["max_abs_logit_diff"] == 0.0
    assert_reference_resident(r)
    assert r["reference"]["lib"] == r["candidate"]["lib"] == str(cpu_build.lib_dir / "libllama.so")
    assert cpu_build.manifest["series_hash"][:16] in r["candidate"]["build_info"]
    assert Path(r["positions_file"]).is_file()


@pytest.mark.build
def test_e2e_window_mode(cpu_build, demo_model, tmp_path):
    """A split cache (window 256 of 1024) against the resident run: same-type tail, exact."""
    assert _has_residency(cpu_build.lib_dir)
    out = tmp_path / "r.json"
    proc = _gate(cpu_build, ["--model", str(demo_model), *SMALL, "--kv-window-cells", "256", "--json", str(out)])
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["profile"] == "same_type" and r["candidate"]["plan"] and r["thresholds"]["require_bitwise"]
    assert r["metrics"]["bitwise_identical"] and r["metrics"]["max_abs_logit_diff"] == 0.0
    assert_reference_resident(r)  # the identity is against the whole cache, not against another split
    assert r["tail_positions"] == 512 - 256 and r["window_cells"] == 256


@pytest.mark.build
def test_the_tokenize_phase_shows_a_bar_with_counts(cpu_build, demo_model, tmp_path):
    """issue 39: the tokenize phase showed a spinner without counts ("tokenizing"), unlike the decode phases' bars. Now
    it is a bar of the same progress display, with the tokens it found, and it stays in a captured run's output."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    proc = _gate(cpu_build, ["--model", str(demo_model), "--prompt-file", str(prompt), "--ctx", "1024", "--threads", "2",
                             "--kv-residency-mode", "off"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    n = int(next(ln for ln in lines if " tokens, ctx 1024" in ln).split(": ")[1].split()[0])
    bar = next(i for i, ln in enumerate(lines) if ln.strip().startswith("tokens "))
    assert f"{n}/{n} done" in lines[bar], lines[bar]
    reference = next(i for i, ln in enumerate(lines) if ln.strip().startswith("reference (resident)"))
    assert bar < reference  # the first phase, shown as the others are


@pytest.mark.build
def test_e2e_unpatched_reference_is_bitwise_identical(cpu_build, unpatched_build, demo_model, tmp_path):
    """Residency mode off on our build == the pin as upstream ships it, bit for bit."""
    VANILLA = unpatched_build.lib_dir
    out = tmp_path / "r.json"
    proc = _gate(cpu_build, ["--model", str(demo_model), *SMALL, "--kv-residency-mode", "off",
                             "--reference", f"lib:{VANILLA}", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["reference"]["rollingkv_lib"] is False and r["reference"]["build_info"] is None
    assert r["metrics"]["bitwise_identical"] and r["metrics"]["mean_tv"] == 0.0
    assert_reference_resident(r)


@pytest.mark.build
def test_runner_refuses_residency_on_an_unpatched_library(unpatched_build, demo_model, tmp_path):
    import numpy as np

    VANILLA = unpatched_build.lib_dir
    np.save(tmp_path / "t.npy", np.arange(8, dtype=np.int32))
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    proc = subprocess.run([sys.executable, "-m", "rollingkv_cli.gate.runner", "--lib-dir", str(VANILLA), "--model", str(demo_model),
                           "--tokens", str(tmp_path / "t.npy"), "--ctx", "256", "--threads", "2", "--residency", '{"mode": "window"}',
                           "--reference-logits", str(tmp_path / "nope.npy"), "--out", str(tmp_path / "o.json")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    err = [line for line in proc.stdout.splitlines() if line.startswith("ERROR ")]
    assert err and "no KV residency API" in json.loads(err[0][6:])["message"]


@pytest.mark.build
def test_gate_fails_on_a_perturbed_merge(cpu_build, demo_model, tmp_path):
    """The gate can fail: the op's test hook scales every tail score by (1+x) in the candidate only; x = 1.2e-7, the
    smallest f32 change (1 + 5e-8 rounds to 1), breaks the bit-identity of every position that reads the tail."""
    out = tmp_path / "r.json"
    env_proc = _gate(cpu_build, ["--model", str(demo_model), *SMALL, "--kv-window-cells", "256", "--json", str(out)],
                     env_extra={"ROLLINGKV_DEBUG_PERTURB_TAIL": "1.2e-7"})
    assert env_proc.returncode == 1, env_proc.stdout + env_proc.stderr
    r = json.loads(out.read_text())
    assert r["verdict"] == "fail" and "bitwise" in r["failed_checks"] and r["metrics"]["bitwise_equal_rows"] < 512


@pytest.mark.build
@pytest.mark.slow
def test_e2e_auto_tail_types_report_the_loss_and_the_needle(cpu_build, demo_model, tmp_path):
    """-ctkt/-ctvt auto on the CPU: the planner takes the q8_0 floor (a short tail of the demo model weighs less than its
    weights), the gate reports the loss over the positions that read the tail within the 8-bit bounds, and the needle placed in
    the tail is retrieved as the resident server retrieves it."""
    out = tmp_path / "r.json"
    proc = _gate(cpu_build, ["--model", str(demo_model), *SMALL, "--kv-window-cells", "128", "-ctkt", "auto", "-ctvt", "auto",
                             "--json", str(out)], timeout=900)
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    a = r["auto_tail"]
    assert r["profile"] == "auto" and a["requested"] == {"k": "auto", "v": "auto"} and a["chosen"] == {"k": "q8_0", "v": "q8_0"}
    assert "the floor" in a["reason"] and r["candidate"]["plan"]["type_k_tail"] == "q8_0"
    loss = a["loss"]
    assert loss["positions"] == 512 - 128 and 0 < loss["mean_tv"] <= 0.04 and loss["p99_tv"] <= 0.11 and loss["top1_agreement"] >= 0.90
    assert a["bounds"] == {"max_mean_tv": 0.04, "max_p99_tv": 0.11, "min_top1_agreement": 0.90} and a["loss_passed"]
    assert_reference_resident(r)  # the loss is against the whole resident cache, not another split
    nd = a["needle"]
    assert nd["verdict"] == "pass" and nd["tail_types"] == {"k": "q8_0", "v": "q8_0"} and len(nd["placements"]) == 2
    assert all(p["needle_start"] > 128 and p["candidate_retrieved"] and p["reference_retrieved"] for p in nd["placements"])
    assert "needle in the tail (K q8_0, V q8_0): pass" in proc.stdout


@pytest.mark.build
def test_e2e_auto_tail_types_fail_on_a_perturbed_merge(cpu_build, demo_model, tmp_path):
    """The auto gate can fail: every tail score x 2 in the candidate (the op's test hook) is a loss no tail type makes."""
    out = tmp_path / "r.json"
    proc = _gate(cpu_build, ["--model", str(demo_model), *SMALL, "--kv-window-cells", "256", "-ctkt", "auto", "-ctvt", "auto",
                             "--no-needle", "--json", str(out)], env_extra={"ROLLINGKV_DEBUG_PERTURB_TAIL": "1"})
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["verdict"] == "fail" and {"max_mean_tv", "max_p99_tv", "min_top1_agreement"} <= set(r["failed_checks"])
    assert r["auto_tail"]["chosen"] == {"k": "q8_0", "v": "q8_0"} and not r["auto_tail"]["loss_passed"]
    assert "FAIL" in proc.stdout and "p99_tv over the positions that read the tail" in proc.stdout
    assert_reference_resident(r)


@pytest.mark.build
@pytest.mark.parametrize("perturb", [None, "0.25"], ids=["correct", "scores-25pct-off"])
def test_e2e_auto_picks_q4_0_and_its_bounds_bite(cpu_build, demo_model, tmp_path, perturb):
    """Auto on a slow link (ROLLINGKV_PCIE_BW_GBPS=0.01: the tail's link time exceeds the resident time) picks q4_0. Its real
    loss passes the 4-bit bounds (measured here: mean TV 0.119, p99 0.35, top-1 0.832 against 0.16, 0.8, 0.78), and every
    tail score 25 % off (ROLLINGKV_DEBUG_PERTURB_TAIL=0.25 in the candidate: mean TV 0.187) fails them: the bounds sit
    between a correct q4_0 tail and a wrong merge behind it. Seen failing on the bounds before (0.2 / 0.8 / 0.85): the
    correct run failed too (top-1 0.832 < 0.85), so they told nothing apart, and the perturbed one was inside their mean TV
    (0.187 < 0.2). 10 % off is inside a correct q4_0 tail's spread on this model (docs/design/auto-tail-types.md). The
    reference is asserted resident."""
    out = tmp_path / "r.json"
    env = {"ROLLINGKV_PCIE_BW_GBPS": "0.01", **({"ROLLINGKV_DEBUG_PERTURB_TAIL": perturb} if perturb else {})}
    proc = _gate(cpu_build, ["--model", str(demo_model), *SMALL, "--kv-window-cells", "256", "-ctkt", "auto", "-ctvt", "auto",
                             "--no-needle", "--json", str(out)], env_extra=env)
    assert "Traceback" not in proc.stderr
    r = json.loads(out.read_text())
    a = r["auto_tail"]
    assert a["chosen"] == {"k": "q4_0", "v": "q4_0"} and "exceeds" in a["reason"] and r["candidate"]["plan"]["type_k_tail"] == "q4_0"
    assert a["bounds"] == {"max_mean_tv": 0.16, "max_p99_tv": 0.8, "min_top1_agreement": 0.78}
    assert a["loss"]["positions"] == 512 - 256
    assert_reference_resident(r)
    if perturb is None:
        assert proc.returncode == 0 and a["loss_passed"], proc.stdout[-4000:]
        assert 0 < a["loss"]["mean_tv"] <= 0.16
    else:
        assert proc.returncode == 1 and not a["loss_passed"], proc.stdout[-4000:]
        assert "max_mean_tv" in r["failed_checks"] and a["loss"]["mean_tv"] > 0.16


@pytest.mark.build
def test_e2e_a_window_holding_every_token_refuses_to_pass(cpu_build, demo_model, tmp_path):
    """256 tokens in a 1024-cell window: no position reads the tail, so not even a tail-score perturbation of x = 0.5
    can show (every row stays bit-identical, and the gate used to PASS this run); it exits 1 and says why."""
    out = tmp_path / "r.json"
    proc = _gate(cpu_build, ["--model", str(demo_model), "--synthetic-tokens", "256", "--ctx", "2048", "--threads", "2",
                             "--kv-window-cells", "1024", "--json", str(out)], env_extra={"ROLLINGKV_DEBUG_PERTURB_TAIL": "0.5"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the tail was never used: lower --kv-window-cells or use more tokens" in proc.stdout
    r = json.loads(out.read_text())
    assert r["tail_positions"] == 0 and r["failed_checks"] == ["min_tail_positions"] and r["metrics"]["bitwise_identical"]


QUANT = ["--synthetic-tokens", "512", "--ctx", "1024", "--threads", "2", "--kv-window-cells", "256", "--tail-baseline"]


@pytest.mark.build
@pytest.mark.slow
@pytest.mark.parametrize("tail,x_old_pass", [("q8_0", "0.1"), ("q4_0", "0.3")])
def test_quantized_tail_fails_on_perturbations_the_old_bound_passed(cpu_build, demo_model, tmp_path, tail, x_old_pass):
    """--tail-baseline on the demo model (512 tokens, window 256; the old bound, max(0.02, 3 x the baseline's mean over
    every position), passed q8_0 at x = 0.1 and q4_0 at x = 0.3):

    - x = 0 passes: the loss over the 256 positions that read the tail is 0.99x (q8_0) / 1.59x (q4_0) the baseline's
      there, inside 1.5x / 2.5x, and the control (window and tail of the tail's type vs the baseline) is bit-identical;
    - x = 1.2e-7, the smallest f32 change of a score (1 + 5e-8 rounds to 1: no change, passes), fails the control
      (bisected: 5e-8 passes, 1.2e-7 fails, for both types). The quantization itself moves a key's score by ~1/254
      (q8_0) to ~1/16 (q4_0) of a block's largest value: the control sees merge errors 4-5 orders below it;
    - the loss bound alone fails from x ~ 0.05 (q8_0: ratio 1.54 > 1.5; 0.03 gives 1.22) and x ~ 0.25 (q4_0: 2.77 >
      2.5; 0.2 gives 2.12), so at the old passing x (ratios 2.37 and 3.17) both fail.
    """
    args = ["--model", str(demo_model), *QUANT, "-ctkt", tail, "-ctvt", tail]
    runs = {}
    for x in ("0", "1.2e-7", x_old_pass):
        out = tmp_path / f"r{x}.json"
        proc = _gate(cpu_build, [*args, "--json", str(out)], env_extra={"ROLLINGKV_DEBUG_PERTURB_TAIL": x})
        assert proc.returncode == (0 if x == "0" else 1), proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[x] = json.loads(out.read_text())
    ok = runs["0"]
    assert ok["tail_positions"] == 256 and ok["control"]["metrics"]["bitwise_identical"]
    assert ok["tail_metrics"]["mean_tv"] <= ok["thresholds"]["max_mean_tv"] == pytest.approx(
        ok["thresholds"]["baseline_factor"] * ok["baseline"]["tail_metrics"]["mean_tv"])
    assert ok["thresholds"]["baseline_factor"] == (1.5 if tail == "q8_0" else 2.5)
    assert "control.bitwise" in runs["1.2e-7"]["failed_checks"] and "max_mean_tv" not in runs["1.2e-7"]["failed_checks"]
    assert {"max_mean_tv", "control.bitwise"} <= set(runs[x_old_pass]["failed_checks"])


@pytest.mark.build
def test_equiv_tail_baseline_on_a_quantized_tail(cpu_build, demo_model, tmp_path):
    """--tail-baseline: a third child decodes the resident q8_0 cache, the bounds follow its loss at the positions that
    read the tail, and a fourth (the control) decodes a q8_0 window + q8_0 tail against it."""
    out = tmp_path / "r.json"
    proc = _gate(cpu_build, ["--model", str(demo_model), "--synthetic-tokens", "256", "--ctx", "512", "--threads", "2",
                             "--kv-window-cells", "128", "-ctkt", "q8_0", "-ctvt", "q8_0", "--tail-baseline", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    b = r["baseline"]
    assert r["profile"] == "quantized" and b["cache_types"] == {"k": "q8_0", "v": "q8_0"}
    assert b["metrics"]["mean_tv"] > 0  # a q8_0 cache is not the f16 one
    tv = b["bounds"]["max_mean_tv"]
    assert tv["bound"] == 1.5 * b["tail_metrics"]["mean_tv"] == r["thresholds"]["max_mean_tv"] and b["tail_metrics"]["n"] == 128
    assert set(r["commands"]) == {"tokenize", "reference", "baseline", "candidate", "control"}


@pytest.mark.build
def test_equiv_order_floor_decodes_a_half_batch_resident_run(cpu_build, demo_model, tmp_path):
    """--order-floor: a third child decodes the resident cache with half the batch, and the bounds are the looser
    of the absolute ones and 2 x its distance (on the CPU the split is bit-identical, so it passes either way)."""
    out = tmp_path / "r.json"
    proc = _gate(cpu_build, ["--model", str(demo_model), "--synthetic-tokens", "256", "--ctx", "512", "--threads", "2",
                             "--n-batch", "128", "--kv-window-cells", "128", "--order-floor", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    f = r["order_floor"]
    assert f["n_batch"] == 64 and f["metrics"]["n"] == 256
    assert r["thresholds"]["max_mean_tv"] == max(1e-4, 2.0 * f["metrics"]["mean_tv"]) == f["bounds"]["max_mean_tv"]["bound"]
    cmd = r["commands"]["order_floor"]
    assert cmd[cmd.index("--n-batch") + 1] == "64" and r["commands"]["candidate"][cmd.index("--n-batch") + 1] == "128"
    assert set(r["commands"]) == {"tokenize", "reference", "order_floor", "candidate"}
    assert r["metrics"]["bitwise_equal_rows"] == 256
    # the per-position bound, from the floor run's own rows over the 128 positions that read the tail
    of = r["over_floor"]
    assert "--positions-out" in cmd and of["n"] == 128 == r["tail_positions"] and of["n_over"] == 0
    assert of["bound_tv"] == 2.0 * of["floor_tv"] and "max_frac_over_floor" in [c["name"] for c in r["checks"]]
    # perturbed (the mean bounds turned off: --tolerance 1, no top-1 or real-flip bound): the per-position check fails it
    th = tmp_path / "t.yaml"
    th.write_text("min_top1_agreement: null\nmax_real_frac: null\n")
    bad = _gate(cpu_build, ["--model", str(demo_model), "--synthetic-tokens", "256", "--ctx", "512", "--threads", "2", "--n-batch", "128",
                            "--kv-window-cells", "128", "--order-floor", "--tolerance", "1", "--thresholds", str(th), "--json", str(out)],
                env_extra={"ROLLINGKV_DEBUG_PERTURB_TAIL": "0.02"})
    assert bad.returncode == 1, bad.stdout + bad.stderr
    r = json.loads(out.read_text())
    assert r["failed_checks"] == ["max_frac_over_floor"] and r["over_floor"]["n_over"] > 0.9 * 128
    assert "positions that read the tail exceed 2 x the order floor's 99th-percentile TV" in bad.stdout


@pytest.mark.build
def test_equiv_four_sequences_side_by_side(cpu_build, demo_model, tmp_path):
    """--n-seq 4: four sequences in every batch of one unified cache (llama-server's parallel slots), their cells
    interleaved across the window and the tail: bit-identical on the CPU; the perturbed merge fails it."""
    out = tmp_path / "r.json"
    args = ["--model", str(demo_model), "--synthetic-tokens", "512", "--ctx", "768", "--threads", "2", "--n-batch", "128",
            "--n-seq", "4", "--kv-window-cells", "128", "--json", str(out)]
    proc = _gate(cpu_build, args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["n_seq"] == 4 and r["metrics"]["n"] == 512 and r["metrics"]["bitwise_equal_rows"] == 512
    assert r["candidate"]["plan"]["split"] and r["candidate"]["plan"]["window_cells"] == 128
    cmd = r["commands"]["candidate"]
    assert cmd[cmd.index("--n-seq") + 1] == "4" and r["commands"]["reference"][cmd.index("--n-seq") + 1] == "4"
    bad = _gate(cpu_build, args, env_extra={"ROLLINGKV_DEBUG_PERTURB_TAIL": "0.02"})
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert json.loads(out.read_text())["metrics"]["mean_tv"] > 1e-4


def test_a_killed_gates_work_folder_is_removed_by_the_next(tmp_path):
    """Issue 27 (8): SIGKILL leaves a gate's work folder (hundreds of MiB of logits) behind; the next gate removes the
    folders whose owner is gone, and only those (a live owner's, and a folder without an owner file, stay)."""
    import signal
    import subprocess
    import sys

    from rollingkv_cli.gate import common

    code = ("import sys, time\n"
            f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
            "from pathlib import Path\n"
            "from rollingkv_cli.gate import common\n"
            f"with common.work_dir(Path({str(tmp_path)!r}), 'rollingkv-gate-') as td:\n"
            "    (Path(td) / 'logits.npy').write_bytes(b'x' * 1000)\n"
            "    print(td, flush=True)\n"
            "    time.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    killed = Path(child.stdout.readline().strip())
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (killed / "logits.npy").is_file(), "SIGKILL left it behind"
    foreign = tmp_path / "rollingkv-gate-foreign"
    foreign.mkdir()
    with common.work_dir(tmp_path, "rollingkv-gate-") as live:
        assert not killed.exists() and foreign.is_dir()
        assert common.remove_stale_work_dirs(tmp_path, "rollingkv-gate-") == []  # our own, alive, stays
        assert Path(live).is_dir()
    assert not Path(live).exists() and foreign.is_dir()


def test_each_gate_run_logs_into_a_folder_of_its_own(isolated_cache):
    from rollingkv_cli.gate import common

    a, b = common.logs_dir(), common.logs_dir()
    assert a != b and a.parent == b.parent == isolated_cache / "gate"


# ---------------------------------------------------------------- what the run writes, checked before it (issue 39)

@pytest.mark.parametrize("where", ["a link to /dev/full", "under a file"])
def test_a_report_that_cannot_be_written_is_refused_before_the_run(where, capsys, fake_runs, fake_gguf, tmp_path):
    """issue 39: 6. Seen failing before the fix: tokenize, reference and candidate ran, then "cannot write", and the
    positions file had been written beside the link (with /dev/full itself: /dev/full.positions.npz in /dev)."""
    if where == "a link to /dev/full":
        out = tmp_path / "r.json"
        out.symlink_to("/dev/full")
        expect = f"cannot write report {out}: it is a device, not a regular file"
    else:
        (tmp_path / "afile").write_text("x")
        out = tmp_path / "afile" / "r.json"
        expect = f"cannot write report {out}: a part of the path is a file, not a directory"
    code, _, err = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "--json", str(out)], capsys)
    assert code == 1 and expect in _one_error(err)
    assert fake_runs["calls"] == [], "nothing ran"
    assert not list(tmp_path.glob("*.npz")), "nothing written beside it"


def test_each_report_names_its_own_positions_file(capsys, fake_runs, fake_gguf, tmp_path):
    """issue 39: 7. OUT.positions.npz, OUT without .json. Seen failing before the fix: `--json jj/run.v1` and `run.v2`
    both wrote jj/run.positions.npz, and the first report named the second's data."""
    jj = tmp_path / "jj"
    for name, positions in (("run.v1", "run.v1.positions.npz"), ("run.v2", "run.v2.positions.npz"), ("gate.json", "gate.positions.npz")):
        code, _, err = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "--json", str(jj / name)], capsys)
        assert code == 0, err
        assert json.loads((jj / name).read_text())["positions_file"] == str(jj / positions)
    assert sorted(p.name for p in jj.glob("*.npz")) == ["gate.positions.npz", "run.v1.positions.npz", "run.v2.positions.npz"]


def test_synthetic_tokens_the_disk_cannot_hold_are_refused_before_tokenizing(capsys, fake_runs, demo_model):
    """issue 39: 8. Seen failing before the fix: the (here faked) runs went ahead; for real, the tokenize child took 50 s
    and 7.2 GB, then died of std::bad_alloc."""
    code, _, err = run_main(["gate", "equiv", "--model", str(demo_model), "--synthetic-tokens", "100000000"], capsys)
    assert code == 1 and fake_runs["calls"] == []
    assert ("--synthetic-tokens 100000000: the reference logits alone would be 17.9 TiB (100000000 tokens x 49152 vocabulary "
            "x 4 bytes)") in _one_error(err)


def test_synthetic_tokens_whose_cache_the_memory_cannot_hold_are_refused(capsys, fake_runs, demo_model, tmp_path, monkeypatch):
    """issue 39: 8, the memory side (the cache of the context on the CPU against MemAvailable, here 1 MiB). Seen failing
    before the fix: the runs went ahead."""
    from rollingkv_cli.gate import equiv as gate_equiv

    monkeypatch.setattr(gate_equiv, "mem_available", lambda: 1 << 20)
    code, _, err = run_main(["gate", "equiv", "--model", str(demo_model), "--synthetic-tokens", "2048", "--work-dir", str(tmp_path)], capsys)
    assert code == 1 and fake_runs["calls"] == []
    # the demo model: 30 layers x 3 KV heads x 64 x (K + V) x 2 bytes = 23040 bytes a cell, 2304 cells
    assert "the KV cache of 2304 cells (f16/f16) alone would take 50.6 MiB of memory, and the host has 1.0 MiB available" in _one_error(err)


def test_a_work_dir_on_a_pseudo_filesystem_is_one_line(capsys, fake_runs, fake_gguf):
    """issue 39: 12. Seen failing before the fix: "internal error: FileNotFoundError"."""
    code, _, err = run_main(["gate", "equiv", "--model", str(fake_gguf), "--work-dir", "/proc"], capsys)
    assert code == 1 and fake_runs["calls"] == []
    assert "cannot use --work-dir /proc: /proc is not on a disk" in _one_error(err)

# ---------------------------------------------------------------- signals: the runner dies with us, the work folder goes

def _spawn_gate(cpu_build, work: Path, n_tokens: int = 4096, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), "PYTHONUNBUFFERED": "1"}
    env.pop("LLAMA_CPP_LIB_PATH", None)
    return subprocess.Popen([sys.executable, "-m", "rollingkv_cli", "gate", "equiv", "--model", "demo", "--synthetic-tokens",
                             str(n_tokens), "--threads", "2", "--kv-window-cells", "256", "--work-dir", str(work),
                             "--json", str(work.parent / "r.json"), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _decoding_runner(proc: subprocess.Popen) -> int | None:
    """The runner child while it decodes (its command line has --tokens; the tokenizer's has --tokens-out)."""
    from proctree import cmdline, descendants

    for pid in sorted(descendants(proc.pid)):
        args = cmdline(pid)
        if "rollingkv_cli.gate.runner" in args and "--tokens" in args:
            return pid
    return None


@pytest.mark.build
def test_sigkill_of_the_gate_takes_its_runner_down(cpu_build, demo_model, tmp_path):
    """SIGKILL of `gate equiv` while its runner decodes: the runner (and anything below it) is gone within 2 s. It passed
    on the code before this test (the runner is tied through procs.popen_tied); it was seen failing with the tie removed
    (popen_tied without its preexec_fn: the runner, re-parented, decoded its whole batch of 4096 tokens, until its next
    line to the closed pipe ended it)."""
    from proctree import cpu_seconds, killed_outright, wait_for

    work = tmp_path / "work"
    work.mkdir()
    proc = _spawn_gate(cpu_build, work, 4096, "--n-batch", "4096")  # one long llama_decode: no line written for seconds
    with killed_outright(proc, "the gate"):
        runner = wait_for(lambda: _decoding_runner(proc), 120, "the reference run to start")
        wait_for(lambda: cpu_seconds(runner) > 1.0, 120, "the reference run to decode")  # past loading: in its one batch
    proc.communicate()



@pytest.mark.build
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1"])
def test_every_stop_signal_removes_the_work_folder(cpu_build, demo_model, tmp_path, sig):
    """SIGINT, SIGTERM or SIGHUP while the reference run decodes: the runner is stopped, the work folder (the reference
    logits) removed, and the gate exits 128 + the signal's number with one line naming it. Seen failing before the fix
    (issue 39 row 5): SIGTERM and SIGHUP killed the CLI where it stood (exit -15 / -1), leaving the work folder and an
    orphaned runner; only SIGINT cleaned up, and it exited 130 with the line `aborted`. SIGQUIT and SIGUSR1 (the second
    sweep; every signal that ends a process: procs.OTHER_ENDING_SIGNALS) still did so (exit -3 / -10, the folder left)."""
    import signal

    from proctree import descendants, kill_all, wait_for, wait_gone

    signum = getattr(signal, sig)
    work = tmp_path / "work"
    work.mkdir()
    proc = _spawn_gate(cpu_build, work)
    kids: set[int] = set()
    try:
        wait_for(lambda: _decoding_runner(proc), 120, "the reference run to start decoding")
        assert [p.name for p in work.iterdir()], "the gate made its work folder"
        kids = descendants(proc.pid)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signum, (proc.returncode, out, err)
        assert list(work.iterdir()) == [], "the work folder is removed"
        assert not wait_gone(kids, 2.0), "no child outlives the gate"
        lines = [line for line in err.splitlines() if line.strip()]
        assert "Traceback" not in err and len(lines) == 1 and sig in lines[0], err
    finally:
        kill_all(kids)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
