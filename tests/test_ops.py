"""The op tests of the patch series (test-rolling-kv-ops, built by `rollingkv build`): the streaming
flash-attention op against ggml_flash_attn_ext over the concatenated K/V, on every backend present."""

from __future__ import annotations

import re
import subprocess

import pytest

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


def test_unknown_backend_skips_cleanly(cpu_build):
    proc, summary = _run(cpu_build.artifact("test-rolling-kv-ops"), "-b", "NoSuchBackend0", "--quick")
    assert proc.returncode == 0
    assert summary and summary[-1].strip() == "0 passed, 0 failed"
