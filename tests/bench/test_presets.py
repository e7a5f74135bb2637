"""`bench tail` and `bench load` on a CPU host (issue 39, new-user frictions): `--preset cpu-small` runs a grid that
finishes in minutes, a flag given as well wins over its preset value, and before a run starts one line says what it
will do and how long that may take here (the defaults: tens of minutes to hours on a CPU, with the preset named).
Dry runs: nothing is measured. The arithmetic: bench/estimate.py."""

from __future__ import annotations

import os

import pytest

from rollingkv_cli.bench import estimate
from test_cli import run_main


def _estimate_line(stdout: str, marker: str) -> str:
    lines = [ln for ln in stdout.splitlines() if marker in ln]
    assert len(lines) == 1, stdout[-3000:]
    return lines[0]


@pytest.fixture
def on_cpu_build(cpu_build, monkeypatch):
    from rollingkv_cli import console as console_mod

    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    monkeypatch.setattr(console_mod.console, "_width", 400)  # one table row per line
    monkeypatch.setattr(estimate, "default_threads", lambda: 2)  # the figures below are for 2 threads
    return cpu_build


@pytest.mark.build
def test_bench_tail_default_says_how_long_and_names_the_preset(capsys, on_cpu_build, demo_model):
    code, out, err = run_main(["bench", "tail", str(demo_model), "--dry-run"], capsys)
    assert code == 0, err
    line = _estimate_line(out, "cells, each a llama-bench")
    # 11 cells at depth 16384 of a 135M model: tens of minutes on two CPU threads
    assert line.startswith("11 cells") and "fills 16384 tokens" in line and "3 x 32" in line, line
    assert " min on this CPU at 2 threads" in line or " h on this CPU" in line, line
    assert "--preset cpu-small" in line


@pytest.mark.build
def test_bench_tail_cpu_small_preset(capsys, on_cpu_build, demo_model):
    code, out, err = run_main(["bench", "tail", str(demo_model), "--preset", "cpu-small", "--dry-run"], capsys)
    assert code == 0, err
    commands = [ln for ln in out.splitlines() if "llama-bench -m" in ln]
    assert len(commands) == 7 and all("-d 2048 " in c and "-n 8 " in c and "-r 1 " in c for c in commands), commands
    assert sum("-ctkt q8_0" in c for c in commands) == 1 and not any("q4_0" in c for c in commands)
    line = _estimate_line(out, "cells, each a llama-bench")
    assert line.startswith("7 cells") and " s on this CPU" in line and "--preset" not in line, line
    # a flag given as well wins over the preset's value
    code, out, err = run_main(["bench", "tail", str(demo_model), "--preset", "cpu-small", "-d", "1024", "--tail-types", "f16",
                               "--dry-run"], capsys)
    assert code == 0, err
    commands = [ln for ln in out.splitlines() if "llama-bench -m" in ln]
    assert commands and all("-d 1024 " in c and "-r 1 " in c and "q8_0" not in c for c in commands), commands


@pytest.mark.build
def test_bench_load_default_says_how_long_and_names_the_preset(capsys, on_cpu_build, demo_model):
    code, out, err = run_main(["bench", "load", str(demo_model), "--dry-run"], capsys)
    assert code == 0, err
    line = _estimate_line(out, " servers, each ")
    assert line.startswith("4 servers, each 11 requests") and "the longest prompt 24000" in line, line
    assert (" min on this CPU" in line or " h on this CPU" in line) and "--preset cpu-small" in line, line


@pytest.mark.build
def test_bench_load_cpu_small_preset(capsys, on_cpu_build, demo_model):
    code, out, err = run_main(["bench", "load", str(demo_model), "--preset", "cpu-small", "--dry-run"], capsys)
    assert code == 0, err
    assert "-np 3 x 2560 cells" in out and "cells default, split, resident;" in out
    assert "stage long alone: long 2048+32" in out and "short-2 256+16" in out and "short-3" not in out
    line = _estimate_line(out, " servers, each ")
    assert line.startswith("3 servers, each 8 requests") and "--preset" not in line, line
    assert " s on this CPU" in line or " 1 min on this CPU" in line, line
    # the other mixes shrink too; a flag given wins
    code, out, err = run_main(["bench", "load", str(demo_model), "--preset", "cpu-small", "--mix", "random", "--requests", "4",
                               "--dry-run"], capsys)
    assert code == 0, err
    assert _estimate_line(out, " servers, each ").startswith("3 servers, each 4 requests")
    stage = next(ln for ln in out.splitlines() if "stage " in ln)
    assert all(200 <= int(r.split()[1].split("+")[0]) <= 2000 for r in stage.split(":", 1)[1].split(",")), stage


def test_estimate_lines():
    """The arithmetic's shape: quadratic prefill attention, a line without a time on a GPU build, the preset named only
    for a long CPU run, and the server's -t read from the arguments after `--`."""
    shape = estimate.Shape(matmul_params=135_000_000, weight_bytes=96_000_000, file_bytes=98_000_000, attn_layers=30, n_head=9,
                           head_dim=64)
    # the calibration points (llama-bench -t 1 on the CPU build, SmolLM2-135M Q4_1): 2048 and 4096 tokens of prefill
    assert estimate.prefill_s(shape, 2048, 1) == pytest.approx(5.7, rel=0.3)
    assert estimate.prefill_s(shape, 4096, 1) == pytest.approx(19, rel=0.3)
    assert estimate.prefill_s(shape, 4096, 2) == pytest.approx(estimate.prefill_s(shape, 4096, 1) / 2)
    assert estimate.decode_s(shape, 4096, 8, 1) / 8 == pytest.approx(0.110, rel=0.3)  # 9 tok/s at depth 4096
    assert [estimate.duration(s) for s in (3, 42, 700, 3 * 3600, 40 * 3600)] == [
        "about 5 s", "about 40 s", "about 12 min", "about 3.0 h", "about 40 h"]
    assert estimate._how_long(3600, "CUDA", 2, None) == "no time estimate on a CUDA build"
    assert "--preset cpu-small" in estimate._how_long(3600, "CPU", 2, None)
    assert "--preset" not in estimate._how_long(3600, "CPU", 2, "cpu-small") and "--preset" not in estimate._how_long(60, "CPU", 2, None)
    assert estimate.server_threads(["-t", "3"]) == 3 and estimate.server_threads(["--threads=5", "-c", "9"]) == 5
    assert estimate.server_threads(["-c", "9"]) is None
    assert estimate.default_threads() == len(os.sched_getaffinity(0))
