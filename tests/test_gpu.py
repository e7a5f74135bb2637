"""GPU tests: the CUDA path for real, on a machine with an NVIDIA GPU and a CUDA build of the series.

They run when an NVIDIA GPU answers through NVML and the active build ($ROLLINGKV_BUILD, or what `rollingkv build
--cuda` activated) is a CUDA build; otherwise every test here is skipped with the reason (CI has no GPU). On the
GPU machine: `python -m pytest -m gpu tests/test_gpu.py` (scripts/device/gpu-tests.sh runs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.build]


def _gpu_count() -> tuple[int, str]:
    from rollingkv_cli import pcie

    try:
        return len(pcie.discover()), ""
    except pcie.NoGpuError as e:
        return 0, e.reason


@pytest.fixture(scope="module")
def cuda_build():
    n, why = _gpu_count()
    if n == 0:
        pytest.skip(f"no NVIDIA GPU: {why}")
    from rollingkv_cli import builder
    from rollingkv_cli.gate import common as gate_common

    if builder.active_build(required=False) is None:
        pytest.skip("no active build: run `rollingkv build --cuda` (or set ROLLINGKV_BUILD)")
    b = gate_common.resolve_build()
    if not b.cuda:
        pytest.skip(f"the active build {b.dir or b.lib_dir} is a CPU build: run `rollingkv build --cuda`")
    return b


def _cli(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("LLAMA_CPP_LIB_PATH", None)
    return subprocess.run([sys.executable, "-m", "rollingkv_cli", *args], capture_output=True, text=True, timeout=timeout, env=env)


def _op_test(cuda_build, *args: str) -> str:
    exe = cuda_build.lib_dir / "test-rolling-kv-ops"
    proc = subprocess.run([str(exe), "-b", "CUDA0", *args], capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    last = [line for line in proc.stdout.splitlines() if "passed" in line][-1]
    assert last.endswith(" 0 failed"), tail
    assert int(last.split()[0]) > 100, tail  # the cases ran on CUDA0 (a skipped op would not count as passed)
    return proc.stdout


def test_op_on_cuda_matches_flash_attention(cuda_build):
    """GGML_OP_STREAMING_FLASH_ATTN on CUDA0 against ggml_flash_attn_ext over the concatenation (quick matrix)."""
    out = _op_test(cuda_build, "--quick")
    assert "D=256" in out and "q4_0" in out and "sinks" in out and "softcap" in out and "alibi" in out


def test_op_streams_a_pinned_host_tail(cuda_build):
    """The tail in pinned host memory, through ggml_backend_sched: one split, no device compute buffer, CUDA graph
    replays identical, rows written by the same graph taken again (the op test asserts all of it per case)."""
    out = _op_test(cuda_build, "--quick", "--tail-host")
    assert "SCHED" not in out and "REPLAY-DIFF" not in out


def test_probe_pcie_measures_the_link(tmp_path, monkeypatch):
    """NVML for real: the link and a measured pinned host-to-device copy, cached."""
    n, why = _gpu_count()
    if n == 0:
        pytest.skip(f"no NVIDIA GPU: {why}")
    monkeypatch.setenv("ROLLINGKV_CACHE_DIR", str(tmp_path))  # a fresh profile (restored after the test)
    proc = _cli(["probe", "pcie", "--json", "--refresh"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    g = r["gpus"][0]
    assert g["uuid"].startswith("GPU-") and g["link"]["max"]["gen"] >= 3 and g["link"]["max"]["width"] >= 8
    assert g["measure_error"] is None
    h2d = g["measured"]["h2d"]
    assert set(h2d) == {"1", "16", "256"} and h2d["256"] > 5.0  # GB/s: a pinned copy over PCIe 3.0 x8 or better
    assert g["resolved"]["tier"] == "measured" and g["resolved"]["gbps"] == pytest.approx(h2d["256"])
    assert r["profile"].startswith(str(tmp_path))  # cached in this cache dir


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory) -> Path:
    """A small Llama-shaped GGUF with random f16 weights (4 layers, GQA 4, head 128), made with gguf-py."""
    pytest.importorskip("gguf", reason="gguf-py is needed to write the synthetic model")
    path = tmp_path_factory.mktemp("synth") / "synth-4L.gguf"
    proc = _cli(["model", "synth", str(path), "--layers", "4", "--embd", "1024", "--heads", "8", "--kv-heads", "2",
                 "--ff", "2816", "--vocab", "32000", "--ctx", "4096", "--force"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return path


def test_gate_equiv_split_within_the_order_floor(cuda_build, synth_model, tmp_path):
    """Fully offloaded, a 256-cell window of 1024 tokens: the split's distance to the resident run is at most 2x the
    resident run's own distance to itself at half the batch (docs/perf/2026-11-30-gpu-exactness.md)."""
    out = tmp_path / "r.json"
    proc = _cli(["gate", "equiv", "--model", str(synth_model), "--synthetic-tokens", "1024", "--kv-window-cells", "256",
                 "-ngl", "99", "--order-floor", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["candidate"]["plan"]["split"] and r["candidate"]["plan"]["window_cells"] == 256
    assert r["metrics"]["nonfinite"] == 0
    assert r["metrics"]["mean_tv"] <= 2 * r["order_floor"]["metrics"]["mean_tv"]
    assert r["verdict"] == "pass" and r["order_floor"]["n_batch"] == 256 and r["order_floor"]["metrics"]["n"] == 1024


def test_gate_equiv_four_parallel_sequences_within_the_order_floor(cuda_build, synth_model, tmp_path):
    """Four sequences side by side in one unified cache (llama-server's --parallel 4), spilled: their interleaved tail
    rows are written and streamed in the same graphs. A race (a row copied before its write, a slot reused early)
    would put the split far outside the floor, or make it non-finite."""
    out = tmp_path / "r.json"
    proc = _cli(["gate", "equiv", "--model", str(synth_model), "--synthetic-tokens", "2048", "--n-seq", "4", "--n-batch", "128",
                 "--kv-window-cells", "256", "-ngl", "99", "--order-floor", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["n_seq"] == 4 and r["candidate"]["plan"]["split"] and r["metrics"]["nonfinite"] == 0
    assert r["verdict"] == "pass" and r["metrics"]["mean_tv"] <= 2 * r["order_floor"]["metrics"]["mean_tv"]
