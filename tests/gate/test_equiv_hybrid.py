"""`gate equiv --kv-tail-cpu-frac F|auto`: the candidate's residency parameters carry the CPU part to the runner
(llama_ext.make_params' tail_cpu_frac), a bad value is a usage error, the report shows the plan's split (its
tail_cpu), and a batch the op would attend GPU-only is said so. The runner children are faked (as in test_equiv.py);
the real library: tests/test_hybrid_tail.py."""

from __future__ import annotations

import json

import pytest

from test_cli import run_main

SUMMARY = {"n": 512, "mean_tv": 0.0, "max_tv": 0.0, "mean_kl": 0.0, "max_kl": 0.0, "top1_agreement": 1.0, "real_frac": 0.0,
           "frac_full_agree": 1.0, "nonfinite": 0, "n_top1_disagree": 0, "n_real": 0, "real_margin_nats": 0.5, "topk": 5,
           "worst": [], "max_abs_logit_diff": 0.0, "bitwise_equal_rows": 512, "bitwise_identical": True}
TAIL_CPU = {"requested": 0.5, "frac": 0.5, "cpu_attn_gbps": 40.0, "cpu_attn_source": "measured", "n_threads": 8,
            "reason": "requested"}


@pytest.fixture
def runs(monkeypatch, isolated_cache, tmp_path):
    """An active build (CPU unless state["cuda"]); every runner child answers at once: bit-identical logits, a split plan
    with a 256-cell window and the tail_cpu object of state["tail_cpu"]; the candidate's --residency JSON is kept."""
    import numpy as np

    from rollingkv_cli.lib import builder
    from rollingkv_cli.gate import equiv as gate_equiv

    bdir = tmp_path / "build"
    (bdir / "build" / "bin").mkdir(parents=True)
    (bdir / "build" / "bin" / "libllama.so").write_bytes(b"")
    state = {"cuda": False, "tail_cpu": dict(TAIL_CPU), "residency": {}}
    monkeypatch.setattr(builder, "active_build",
                        lambda required=True: builder.Build(bdir, {"pin": "x", "series_hash": "y", "options": {"cuda": state["cuda"]}}))

    def run_child(role, cmd, log_path, result_path, progress=None, label="", total=0):
        timings = {"load_s": 0.1, "decode_s": 1.0, "tokens_per_s": 512.0, "compare_s": 0.5, "total_s": 1.6}
        if role == "tokenize":
            return {"n_tokens": 512, "n_vocab": 100, "has_residency": True, "source": {"kind": "synthetic"}}
        if role == "reference":
            return {"lib": "ref/libllama.so", "timings": timings, "plan": None}
        residency = json.loads(cmd[cmd.index("--residency") + 1]) if "--residency" in cmd else None
        state["residency"][role] = residency
        split = residency is not None and residency["mode"] != "off"
        plan = {"mode_requested": "window", "mode": "window", "split": True, "window_cells": 256, "tail_cpu": state["tail_cpu"]} if split else None
        if "--positions-out" in cmd:
            n = 512
            z = np.zeros(n)
            np.savez(cmd[cmd.index("--positions-out") + 1], pos=np.arange(n), tv=z, kl=z, top1_ref=np.zeros(n, dtype=np.int64),
                     top1_cand=np.zeros(n, dtype=np.int64), margin=np.ones(n), topk_agree=np.ones(n, dtype=bool),
                     nonfinite=np.zeros(n, dtype=bool), bitwise=np.ones(n, dtype=bool))
        return {"lib": "cand/libllama.so", "timings": timings, "summary": dict(SUMMARY), "plan": plan}

    monkeypatch.setattr(gate_equiv, "run_child", run_child)
    return state


def _gate(capsys, fake_gguf, tmp_path, *args):
    out = tmp_path / "r.json"
    code, stdout, err = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-window-cells", "256", "--json", str(out), *args], capsys)
    return code, stdout, err, (json.loads(out.read_text()) if out.exists() else None)


def test_the_cpu_part_reaches_the_runner_and_the_report(capsys, runs, fake_gguf, tmp_path):
    code, stdout, err, r = _gate(capsys, fake_gguf, tmp_path, "--kv-tail-cpu-frac", "0.5")
    assert code == 0, err
    assert runs["residency"]["candidate"]["tail_cpu_frac"] == 0.5 and r["candidate"]["residency"]["tail_cpu_frac"] == 0.5
    assert r["tail_cpu"] == {"requested": 0.5, "plan": TAIL_CPU}
    assert "CPU part of the tail: 50% of each split layer's host tail attended on the CPU" in stdout and "CPU attention 40 GB/s," in stdout and "CPU attention measured" in stdout
    code, stdout, err, r = _gate(capsys, fake_gguf, tmp_path, "--kv-tail-cpu-frac", "auto")
    assert code == 0 and runs["residency"]["candidate"]["tail_cpu_frac"] == "auto" and r["tail_cpu"]["requested"] == "auto"


def test_without_the_option_the_library_decides(capsys, runs, fake_gguf, tmp_path):
    """Not given: the runner's make_params leaves the library's default (auto in this series), and the report says so."""
    from rollingkv_cli.lib import llama_ext

    runs["tail_cpu"] = None  # a build that reports no split
    code, stdout, err, r = _gate(capsys, fake_gguf, tmp_path)
    assert code == 0, err
    assert "tail_cpu_frac" not in runs["residency"]["candidate"] and llama_ext.tail_cpu_frac_value(None) is None
    assert r["tail_cpu"] == {"requested": "the library's default (auto)", "plan": None} and "CPU part of the tail" not in stdout
    # a build that reports its split (here one of API 4 from before, whose default was off): the plan, as the native planner words it
    runs["tail_cpu"] = {"requested": 0, "frac": 0, "cpu_attn_gbps": None, "cpu_attn_source": "none", "n_threads": 8,
                        "reason": "off (tail_cpu_frac 0)"}
    code, stdout, err, r = _gate(capsys, fake_gguf, tmp_path)
    assert code == 0, err
    assert r["tail_cpu"] == {"requested": "the library's default (auto)", "plan": runs["tail_cpu"]}
    assert "CPU part of the tail: none (requested 0, 8 threads): off (tail_cpu_frac 0)" in stdout


def test_the_tail_baseline_control_keeps_the_cpu_part(capsys, runs, fake_gguf, tmp_path):
    code, _, err, r = _gate(capsys, fake_gguf, tmp_path, "-ctkt", "q8_0", "-ctvt", "q8_0", "--tail-baseline", "--kv-tail-cpu-frac", "1")
    assert code == 0, err
    assert runs["residency"]["candidate"]["tail_cpu_frac"] == 1.0 and runs["residency"]["control"]["tail_cpu_frac"] == 1.0


@pytest.mark.parametrize("value,match", [("2", "not 2"), ("-1", "not -1"), ("most", "not most")])
def test_a_bad_value_is_a_usage_error(capsys, isolated_cache, fake_gguf, value, match):
    code, _, err = run_main(["gate", "equiv", "--model", str(fake_gguf), "--kv-tail-cpu-frac", value], capsys)
    assert code == 2 and "must be auto or a fraction from 0 to 1" in err and match in err and "Traceback" not in err


def test_batches_the_op_attends_gpu_only_are_said_so(capsys, runs, fake_gguf, tmp_path):
    runs["cuda"] = True
    code, _, err, _ = _gate(capsys, fake_gguf, tmp_path, "--kv-tail-cpu-frac", "0.5", "--no-order-floor")
    assert code == 0 and "only on decode-sized batches" in err and "--n-batch 1 " in err
    code, _, err, _ = _gate(capsys, fake_gguf, tmp_path, "--kv-tail-cpu-frac", "0.5", "--no-order-floor", "--n-batch", "4", "--n-seq", "4")
    assert code == 0 and "decode-sized" not in err
    code, _, err, _ = _gate(capsys, fake_gguf, tmp_path, "--kv-tail-cpu-frac", "0", "--no-order-floor")
    assert code == 0 and "decode-sized" not in err  # no CPU part: nothing to say
    runs["cuda"] = False
    code, _, err, _ = _gate(capsys, fake_gguf, tmp_path, "--kv-tail-cpu-frac", "0.5")
    assert code == 0 and "decode-sized" not in err  # a CPU build: the CPU part is moot


def test_mode_off_ignores_it(capsys, runs, fake_gguf, tmp_path):
    code, _, err, _ = _gate(capsys, fake_gguf, tmp_path, "--kv-residency-mode", "off", "--kv-tail-cpu-frac", "0.5")
    assert "--kv-tail-cpu-frac" in err and "ignores" in err
