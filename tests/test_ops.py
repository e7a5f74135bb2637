"""The op tests of the patch series (test-rolling-kv-ops, built by `rollingkv build`): the streaming
flash-attention op against ggml_flash_attn_ext over the concatenated K/V, on every backend present."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

import backend_ops

pytestmark = pytest.mark.build


def _run(binary, *args, timeout=900):
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=timeout)
    summary = [line for line in proc.stdout.splitlines() if re.fullmatch(r"\d+ passed, \d+ failed", line.strip())]
    return proc, summary


def test_streaming_flash_attn_matches_flash_attn_ext_on_cpu(cpu_build):
    binary = cpu_build.artifact("test-rolling-kv-ops")
    assert binary.exists(), "the op test binary is part of every build"
    proc, summary = _run(binary, "-b", "CPU", "-t", "2")
    assert summary, proc.stdout[-3000:] + proc.stderr[-3000:]
    passed, failed = map(int, re.findall(r"\d+", summary[-1]))
    assert proc.returncode == 0 and failed == 0, proc.stdout[-5000:]
    assert passed >= 800  # the full matrix: dims x GQA x n_q x splits x masks x softcap/sinks/ALiBi x types
    # head size 72 (only the stock TILE kernel runs it on CUDA/HIP, which writes no LSE, so the GPU backends refuse
    # it): the CPU runs the op exactly
    tile = [line for line in proc.stdout.splitlines() if "D= 72" in line]
    assert len(tile) == 6 and all(line.endswith(" OK") and "bitexact" in line for line in tile), tile


def test_perturbed_tail_makes_exactly_the_live_tail_cases_fail(cpu_build):
    """The self-check of the op test: with the test hook ROLLINGKV_DEBUG_PERTURB_TAIL every case whose tail holds a
    key some query row reads must fail, every other case must still pass (--expect-perturbed counts both as passed)."""
    binary = cpu_build.artifact("test-rolling-kv-ops")
    proc = subprocess.run([str(binary), "-b", "CPU", "-t", "2", "--quick", "--expect-perturbed"], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "ROLLINGKV_DEBUG_PERTURB_TAIL": "1"})
    summary = [line for line in proc.stdout.splitlines() if re.fullmatch(r"\d+ passed, \d+ failed", line.strip())]
    assert summary, proc.stdout[-3000:] + proc.stderr[-3000:]
    passed, failed = map(int, re.findall(r"\d+", summary[-1]))
    assert proc.returncode == 0 and failed == 0, proc.stdout[-5000:]
    caught = proc.stdout.count("OK (fails: perturbed tail)")
    clean = proc.stdout.count("OK (no live tail)")
    assert caught >= 100 and clean >= 20 and caught + clean == passed, (caught, clean, passed)


def test_expect_perturbed_needs_the_hook(cpu_build):
    env = {k: v for k, v in os.environ.items() if k != "ROLLINGKV_DEBUG_PERTURB_TAIL"}
    proc = subprocess.run([str(cpu_build.artifact("test-rolling-kv-ops")), "--quick", "--expect-perturbed"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "ROLLINGKV_DEBUG_PERTURB_TAIL" in proc.stderr


@pytest.mark.parametrize("x", ["abc", "-1", "nan", "1e40"])
def test_the_op_test_refuses_a_perturbation_the_op_cannot_take(cpu_build, x):
    """The op test sets the op's tail_perturb parameter from the variable (the library reads none): a value the op's
    setter would abort on (x <= -1, not finite) or that is not a number is one line and exit 2, before any case runs."""
    proc = subprocess.run([str(cpu_build.artifact("test-rolling-kv-ops")), "--quick", "--expect-perturbed"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "ROLLINGKV_DEBUG_PERTURB_TAIL": x})
    assert proc.returncode == 2 and f"ROLLINGKV_DEBUG_PERTURB_TAIL={x} is not a finite number above -1" in proc.stderr, proc.stderr


def test_unknown_backend_skips_cleanly(cpu_build):
    proc, summary = _run(cpu_build.artifact("test-rolling-kv-ops"), "-b", "NoSuchBackend0", "--quick")
    assert proc.returncode == 0
    assert summary and summary[-1].strip() == "0 passed, 0 failed"


def test_the_cpu_share_becomes_256_aligned_cells_once(cpu_build):
    """ggml_rkv_tail_cpu_cells, the one rounding of a share into the cells the op carries (issue 29, 4): the streamed part
    keeps a multiple of 256 cells, the nearest one, and the ends are exact."""
    import ctypes

    base = ctypes.CDLL(str(cpu_build.lib_dir / "libggml-base.so"))
    cells = base.ggml_rkv_tail_cpu_cells
    cells.restype, cells.argtypes = ctypes.c_int64, [ctypes.c_int64, ctypes.c_float]
    for n_tail in (0, 1, 255, 256, 257, 700, 768, 4096, 16384 + 100):
        for frac in (0.0, 0.01, 0.25, 0.37, 0.5, 0.99, 1.0):
            n = cells(n_tail, frac)
            assert 0 <= n <= n_tail, (n_tail, frac, n)
            assert n in (0, n_tail) or (n_tail - n) % 256 == 0, (n_tail, frac, n)
            want_stream = min(n_tail, int((1 - frac) * n_tail / 256 + 0.5) * 256) if 0 < frac < 1 else (0 if frac >= 1 else n_tail)
            assert n == n_tail - want_stream, (n_tail, frac, n, want_stream)
    assert cells(1000, 0.0) == 0 and cells(1000, 1.0) == 1000 and cells(16384, 0.5) == 8192


def test_op_takes_the_cpu_cells_on_every_case(cpu_build):
    """The op carries an integer cell count (256-aligned or the whole tail) that its setter checks: every case of the
    matrix builds with a CPU share (the CPU backend attends the whole tail itself, so the outputs are unchanged)."""
    proc, summary = _run(cpu_build.artifact("test-rolling-kv-ops"), "-b", "CPU", "-t", "2", "--quick", "--tail-cpu-frac", "0.37")
    assert summary, proc.stdout[-3000:] + proc.stderr[-3000:]
    passed, failed = map(int, re.findall(r"\d+", summary[-1]))
    assert proc.returncode == 0 and failed == 0 and passed >= 100, proc.stdout[-3000:]


def test_the_op_cases_of_test_backend_ops_pass_on_the_cpu(cpu_build):
    """Upstream's test-backend-ops runs the op's cases (patch 0023) on the CPU against the CPU's reference path
    (use_ref: one-chunk kernels, no tiles, no split KV): every case runs and passes, and the cases cover what the
    include file lists. A wrong tail weight bites there: a tail score factor of 1.05 off the reference path failed
    116 of 139 cases when this test was written (docs/testing.md)."""
    r = backend_ops.run(cpu_build.artifact("test-backend-ops"), "CPU")
    assert r.returncode == 0 and not r.failed and not r.unsupported, r.stdout[-5000:]
    assert len(r.ok) == r.passed == r.ran >= 130, (len(r.ok), r.passed, r.ran)
    cases = " ".join(r.ok)
    for feature in ("n_win=0", "n_tail=0", "nr23=[4,1]", "nr23=[2,2]", "sinks=1", "max_bias=8", "logit_softcap=10",
                    "type_tail_k=q4_0", "type_tail_k=q8_0,type_tail_v=q4_0", "tail_read=runs", "tail_read=map",
                    "masked_parts=1", "nb=512"):
        assert feature in cases, feature
