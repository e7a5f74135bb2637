"""GPU tests: the CUDA path for real, on a machine with an NVIDIA GPU and a CUDA build of the series.

They run when an NVIDIA GPU answers through NVML and the active build ($ROLLINGKV_BUILD, or what `rollingkv build
--cuda` activated) is a CUDA build; otherwise every test here is skipped with the reason (CI has no GPU). On the
GPU machine: `python -m pytest -m gpu tests/test_gpu.py` (scripts/device/gpu-tests.sh runs it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import backend_ops
import optest

pytestmark = [pytest.mark.gpu, pytest.mark.build]


def _gpu_count() -> tuple[int, str]:
    from rollingkv_cli.hw import pcie

    try:
        return len(pcie.discover()), ""
    except pcie.NoGpuError as e:
        return 0, e.reason


def gpu_tests_asked_for(markexpr: str) -> bool:
    """Whether `-m EXPR` selects the GPU tests (as scripts/device/gpu-tests.sh's `-m gpu` does)."""
    return re.search(r"(?<!not )\bgpu\b", markexpr or "") is not None


@pytest.fixture(scope="module")
def cuda_build(request):
    """The active CUDA build. No GPU: skipped. A GPU but no CUDA build: skipped in a general run, a failure when the GPU
    tests were asked for (`-m gpu`): 22 skips and exit 0 on the GPU machine would pass the device check having checked
    nothing (issue 27: 23)."""
    n, why = _gpu_count()
    if n == 0:
        pytest.skip(f"no NVIDIA GPU: {why}")
    from rollingkv_cli.lib import builder
    from rollingkv_cli.gate import common as gate_common

    refuse = pytest.fail if gpu_tests_asked_for(request.config.getoption("markexpr", "")) else pytest.skip
    if builder.active_build(required=False) is None:
        refuse(f"{n} NVIDIA GPU(s) but no active build: run `rollingkv build --cuda` (or set ROLLINGKV_BUILD)")
    b = gate_common.resolve_build()
    if not b.cuda:
        refuse(f"{n} NVIDIA GPU(s) but the active build {b.dir or b.lib_dir} is a CPU build: run `rollingkv build --cuda`")
    return b


def _cli(args: list[str], timeout: float = 600, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_CPP_LIB_PATH", "ROLLINGKV_DEBUG_PERTURB_TAIL")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "rollingkv_cli", *args], capture_output=True, text=True, timeout=timeout, env=env)


def _op_test(cuda_build, *args: str, perturb: str | None = None) -> optest.Run:
    """The op test on CUDA0: exit 0, every case from 0 on printed, 0 failed, the summary's counts the case lines'."""
    exe = cuda_build.lib_dir / "test-rolling-kv-ops"
    env = {k: v for k, v in os.environ.items() if k != "ROLLINGKV_DEBUG_PERTURB_TAIL"}
    if perturb is not None:
        env["ROLLINGKV_DEBUG_PERTURB_TAIL"] = perturb
    proc = subprocess.run([str(exe), "-b", "CUDA0", *args], capture_output=True, text=True, timeout=900, env=env)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert re.search(r"^test-rolling-kv-ops: (head split, )?backend CUDA0,", proc.stdout, re.M), tail  # not "backend CUDA0 not found, skipping"
    run = optest.parse(proc.stdout)
    optest.check_complete(run)
    assert run.failed == 0, "\n".join(c.line for c in run.cases.values() if c.ok is False)[-3000:]
    return run


def _check_skips(run: optest.Run, tail_host: bool) -> dict[str, list[str]]:
    """The cases CUDA0 refused ('not supported, skipped'), listed by reason: exactly those optest.cuda_skip_reason names
    (F32 K/V; with --tail-host also a non-cache-layout tail), no other; every other case ran and passed; head size 72
    was refused (the TILE kernel writes no LSE) and counts as passed. Returns {reason: [case lines]} (printed: -rP)."""
    by_reason: dict[str, list[str]] = {}
    for i, c in run.cases.items():
        if c.skipped:
            by_reason.setdefault(optest.cuda_skip_reason(c.desc, tail_host) or "UNEXPECTED (no known reason)", []).append(f"[{i}] {c.desc}")
    expected = {i for i, c in run.cases.items() if optest.cuda_skip_reason(c.desc, tail_host)}
    skipped = {i for i, c in run.cases.items() if c.skipped}
    for reason, lines in by_reason.items():
        print(f"skipped, {reason}: {len(lines)}", *lines[:5], "..." if len(lines) > 5 else "", sep="\n  ")
    assert skipped == expected, {"skipped without a known reason": by_reason.get("UNEXPECTED (no known reason)", [])[:20],
                                 "expected skipped, yet ran": [run.cases[i].line for i in sorted(expected - skipped)][:20]}
    assert run.passed == len(run.cases) - len(skipped) and run.n_skipped == len(skipped)
    tile = [c for c in run.cases.values() if optest.tile_only(c.desc)]
    assert tile and all(c.ok and " refused (TILE kernel: no LSE)" in c.line for c in tile), [c.line for c in tile]
    return by_reason


def _ran(run: optest.Run) -> dict[int, optest.Case]:
    return {i: c for i, c in run.cases.items() if not c.skipped}


def test_op_on_cuda_matches_flash_attention(cuda_build):
    """GGML_OP_STREAMING_FLASH_ATTN on CUDA0 against ggml_flash_attn_ext over the concatenation (quick matrix): every
    case passes except those CUDA refuses for a known reason (F32 K/V), listed by reason; the passes are exactly the
    cases that ran. Features are counted among the cases that ran (a 'not supported' line names them too)."""
    run = _op_test(cuda_build, "--quick")
    by_reason = _check_skips(run, tail_host=False)
    assert set(by_reason) <= {"F32 K/V: no CUDA FlashAttention kernel for them"}
    ran = " ".join(c.desc for c in _ran(run).values() if not optest.tile_only(c.desc))
    for feature in ("D=256", "q4_0", "q8_0", "bf16", "sinks", "softcap", "alibi", "mask=rows", "q-perm"):
        assert feature in ran, feature


def test_the_op_cases_of_test_backend_ops_pass_on_cuda(cuda_build):
    """Upstream's test-backend-ops on CUDA0 against the CPU backend (patch 0023's cases): none fails, and CUDA refuses
    exactly the softcap at head size 64, which its FlashAttention kernels have no variant for (the upstream fix
    0004: before it, that case trapped the device and aborted the run)."""
    r = backend_ops.run(cuda_build.lib_dir / "test-backend-ops", "CUDA0")
    assert r.returncode == 0 and not r.failed, r.stdout[-5000:]
    assert len(r.ok) == r.passed == r.ran >= 130, (len(r.ok), r.passed, r.ran, r.unsupported)
    assert r.unsupported and all("hs=64," in c and "logit_softcap=10" in c for c in r.unsupported), r.unsupported
    cases = " ".join(r.ok)
    for feature in ("n_win=0", "n_tail=0", "sinks=1", "max_bias=8", "type_tail_k=q4_0", "tail_read=runs",
                    "tail_read=map", "masked_parts=1", "nb=512"):
        assert feature in cases, feature


def test_op_streams_a_pinned_host_tail(cuda_build):
    """The tail in pinned host memory, through ggml_backend_sched: one split, no device compute buffer, CUDA graph
    replays identical, rows written by the same graph taken again (the op test asserts all of it per case). Skipped:
    F32 K/V and tails in the non-cache layout (rows not contiguous: not streamed), listed by reason; nothing else."""
    run = _op_test(cuda_build, "--quick", "--tail-host")
    _check_skips(run, tail_host=True)
    assert "SCHED" not in run.stdout and "REPLAY-DIFF" not in run.stdout
    assert sum(optest.live_tail_keys(c.desc) > 0 for c in _ran(run).values()) > 50  # streamed tails that were read


def test_op_on_cuda_perturbed_in_the_cpu_part_fails(cuda_build):
    """The must-fail that reaches the hybrid tail's CPU part on CUDA (issue 36: 2): the whole pinned-host tail attended
    on the CPU (--tail-cpu-frac 1) with every tail score x 2. Exactly the live-tail cases that ran fail, and the CPU part
    ran in them (their lines count its parts, `cpu-part=N`: the ops' own parts, not the calibration's): a build whose
    CPU part never ran, or ran without the perturbation, would pass the perturbed cases on the streamed tail or the
    unperturbed CPU attention. The device script's hybrid-op-tests check did this outside pytest."""
    run = _op_test(cuda_build, "--quick", "--tail-host", "--tail-cpu-frac", "1", "--expect-perturbed", perturb="1")
    _check_skips(run, tail_host=True)
    ran = _ran(run)
    must = {i for i, c in ran.items() if optest.live_tail_keys(c.desc) and not optest.tile_only(c.desc)}
    caught = {i for i, c in ran.items() if c.verdict == optest.CAUGHT}
    assert caught == must, {"live tail, not caught": [ran[i].line for i in sorted(must - caught)][:10]}
    in_cpu = {i for i in caught if "cpu-part=" in ran[i].line}
    # the CPU part reads f16, q8_0 and q4_0 tails of contiguous queries (the full matrix: 88 of its 309 caught cases ran
    # one, docs/perf/2026-12-06-h100-hybrid-calibration)
    assert len(in_cpu) >= 5, (len(in_cpu), len(caught))


@pytest.mark.parametrize("tail_host", [False, True], ids=["device-tail", "pinned-host-tail"])
def test_op_on_cuda_perturbed_fails_exactly_the_live_tail_cases(cuda_build, tail_host):
    """The must-fail of the CUDA merge: with ROLLINGKV_DEBUG_PERTURB_TAIL=1 (every tail score x 2, in the CUDA forward's
    tail parts: shadow scale and softcap, compacted mask) and --expect-perturbed, every case that ran and whose tail
    holds a key some query row reads must fail ("OK (fails: perturbed tail)"), every other one pass ("OK (no live
    tail)"); which cases hold a live tail is computed here from each case line (optest.live_tail_keys, the op test's
    mask rules), not taken from the binary. Head size 72 is refused, not run: no live tail.

    Why x = 1 and not the CPU's 1e-4: on CUDA the check is NMSE <= 5e-7 (mixed types 5e-5), not bit-identity, and a
    relative change x of the tail scores gives NMSE ~ 0.07 x^2 on these shapes (numpy, D 64-256, 512 keys, half in the
    tail: 7e-10 at 1e-4, 7e-6 at 1e-2, 0.11 at 1): 1e-4 stays far inside every CUDA bound, so the op test could not
    fail on it. The quick matrix's live tails hold at least 121 keys, so at x = 1 each is far over its bound."""
    args = ["--quick", "--expect-perturbed", *(["--tail-host"] if tail_host else [])]
    run = _op_test(cuda_build, *args, perturb="1")
    _check_skips(run, tail_host)
    ran = _ran(run)
    must = {i for i, c in ran.items() if optest.live_tail_keys(c.desc) and not optest.tile_only(c.desc)}
    caught = {i for i, c in ran.items() if c.verdict == optest.CAUGHT}
    clean = {i for i, c in ran.items() if c.verdict == optest.CLEAN}
    assert caught == must, {"live tail, not caught": [ran[i].line for i in sorted(must - caught)][:10],
                            "caught without a live tail": [ran[i].line for i in sorted(caught - must)][:10]}
    assert clean == set(ran) - must and run.passed == len(caught) + len(clean) == len(ran)
    assert len(must) > len(ran) // 3 and len(ran) - len(must) > 20  # both sides are populated (quick: 178 + 86, 98 + 86)


def test_probe_pcie_measures_the_link(cuda_build, tmp_path, monkeypatch):
    """NVML for real, and the link measured by the CUDA build's libllama (llama_rolling_kv_measure_link, in a child):
    plausible pinned copies both ways at every size, the link read under load, cached and planned with."""
    monkeypatch.setenv("ROLLINGKV_CACHE_DIR", str(tmp_path))  # a fresh profile (restored after the test)
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cuda_build.dir))  # the CUDA build measures, whatever the cache dir's
    proc = _cli(["probe", "pcie", "--json", "--refresh", "--gpu", "0"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    g = r["gpus"][0]
    assert g["uuid"].startswith("GPU-") and g["link"]["max"]["gen"] >= 3 and g["link"]["max"]["width"] >= 8
    assert g["measure_error"] is None
    m = g["measured"]
    # the native path ran: the build's libllama through its CUDA backend, on the GPU NVML calls 0 (found by bus id)
    assert Path(m["lib"]).resolve() == (cuda_build.lib_dir / "libllama.so").resolve(), m
    assert m["backend_device"].startswith("CUDA"), m
    assert "llama_rolling_kv_measure_link" in m["method"] and "api=9" in m["build_info"]
    for d in ("h2d", "d2h"):  # GB/s: pinned copies over PCIe 3.0 x8 or better, below any PCIe 6 x16 line rate
        assert set(m[d]) == {"1", "16", "256"} and all(1.0 < v < 130.0 for v in m[d].values()), m
    assert m["h2d"]["256"] > 5.0 and m["h2d"]["256"] >= 0.8 * m["h2d"]["1"]  # large copies: not slower than small ones
    assert m["link_under_load"]["gen"] and m["link_under_load"]["width"]  # read while copies were in flight
    assert g["resolved"]["tier"] == "measured" and g["resolved"]["gbps"] == pytest.approx(m["h2d"]["256"])
    assert r["profile"].startswith(str(tmp_path))  # cached in this cache dir


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory) -> Path:
    """A small Llama-shaped GGUF with random f16 weights (4 layers, GQA 4, head 128), made with gguf-py."""
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
    # per position: the 768 positions that read the tail, within 2 x the floor's p99 at all but 5 % of them (the H200's
    # synthetic runs: the split's largest TV below the floor's mean, so none is expected over)
    of = r["over_floor"]
    assert of["n"] == r["tail_positions"] == 768 and of["bound_tv"] == pytest.approx(2 * of["floor_tv"]) and of["floor_tv"] > 0
    assert of["n_over"] <= 0.05 * 768 and "max_frac_over_floor" in [c["name"] for c in r["checks"]]


def test_gate_equiv_fails_on_a_perturbed_tail_on_the_gpu(cuda_build, synth_model, tmp_path):
    """The GPU gate's must-fail: the same run with ROLLINGKV_DEBUG_PERTURB_TAIL=0.1 in the gate's environment (its runner
    children inherit it and ggml reads it once per process; the reference and the floor run are resident, hold no
    tail, and stay unperturbed) must exit 1, and most of the 768 tail positions exceed the per-position bound.

    Why 0.1 and not 1e-3: measured on the CPU build, where the split's TV is the perturbation's alone (this model, 1024
    tokens, window 256, tail positions): x = 1e-3 gives TV 4.1e-4 (max 5.5e-4), x = 1e-2 0.0023 (p99 0.0036), both
    inside the GPU's own order noise on this model (floor mean TV 0.002, per-position max ~0.0028 on the H200: docs/perf
    2026-11-30-gpu-exactness), so no bound relative to the floor can tell them from a correct split. x = 0.1 gives
    0.024 (5th percentile 0.011, top-1 0.887 over the tail), several times 2 x the floor's p99 (~0.005): a 10 % error of
    every tail score, the size of bug the gate must catch (a wrong scale or merge weight)."""
    out = tmp_path / "r.json"
    proc = _cli(["gate", "equiv", "--model", str(synth_model), "--synthetic-tokens", "1024", "--kv-window-cells", "256",
                 "-ngl", "99", "--order-floor", "--json", str(out)], env_extra={"ROLLINGKV_DEBUG_PERTURB_TAIL": "0.1"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["verdict"] == "fail" and r["candidate"]["plan"]["split"] and r["metrics"]["nonfinite"] == 0
    of = r["over_floor"]
    assert of["n"] == r["tail_positions"] == 768 and of["n_over"] > 0.5 * 768, of
    assert "max_frac_over_floor" in r["failed_checks"], r["failed_checks"]
    assert r["order_floor"]["metrics"]["mean_tv"] < 0.01  # the floor run is not perturbed (resident: no tail)


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


# ------------------------------------------------------------------------------ the head split (--kv-residency-mode head)


def _head_op_skips(run: optest.Run) -> list[str]:
    """The head cases CUDA0 refused: only F32 K/V (no CUDA FlashAttention kernel for them, the stock op's refusal too)."""
    skipped = [c.desc for c in run.cases.values() if c.skipped]
    assert all("K=f32" in d or "V=f32" in d for d in skipped), skipped
    return skipped


def test_head_split_op_on_cuda_matches_flash_attention(cuda_build):
    """The head split's op graph on CUDA0 (the op test's --heads set: the stock kernel on the device heads' query view, the
    streaming op with an EMPTY window over the host heads, concatenated by head) against ggml_flash_attn_ext over every
    head, within the CUDA bounds (NMSE 5e-7, two types 5e-5): every cut of 2..4 KV heads, GQA 1..4, decode, small batches
    and prefill, q8_0/q4_0/bf16, sinks, softcap, two streams; only F32 K/V refused."""
    run = _op_test(cuda_build, "--heads")
    skipped = _head_op_skips(run)
    ran = _ran(run)
    assert run.passed == len(ran) == len(run.cases) - len(skipped) and len(ran) >= 80
    descs = " ".join(c.desc for c in ran.values())
    for feature in ("q4_0", "q8_0", "bf16", "sinks", "softcap", "ne3=2", "n_q=512", "K=f16/q8_0"):
        assert feature in descs, feature


def test_head_split_op_on_cuda_perturbed_fails_every_case(cuda_build):
    """The must-fail: every head case keeps heads in host memory with keys its rows read, so with every host-head score
    x 2 (ROLLINGKV_DEBUG_PERTURB_TAIL=1, the streaming op's tail parts) every case that ran must fail, none pass."""
    run = _op_test(cuda_build, "--heads", "--expect-perturbed", perturb="1")
    _head_op_skips(run)
    ran = _ran(run)
    assert ran and all(c.verdict == optest.CAUGHT for c in ran.values()), [c.line for c in ran.values() if c.verdict != optest.CAUGHT][:10]


@pytest.mark.parametrize("n_seq, cpu_frac", [(1, "0"), (4, "0"), (1, "0.5"), (4, "0.5")],
                         ids=["1seq", "4seq", "1seq-cpu-part", "4seq-cpu-part"])
def test_gate_equiv_head_split_within_the_order_floor(cuda_build, synth_model, tmp_path, n_seq, cpu_frac):
    """The head split on the GPU, fully offloaded: 1 of the 2 KV heads of every layer on the device, the other in pinned host
    memory streamed for every position (with cpu_frac 0.5 half of its cells attended on the CPU, decode-sized batches);
    one sequence and four side by side; within 2x the resident run's own order floor, per position too."""
    n_tok = 1024 if cpu_frac == "0" else 512
    batch = ([] if n_seq == 1 else ["--n-batch", "128"]) if cpu_frac == "0" else ["--n-batch", str(n_seq)]
    out = tmp_path / "r.json"
    proc = _cli(["gate", "equiv", "--model", str(synth_model), "--synthetic-tokens", str(n_tok * (2 if n_seq == 4 else 1)),
                 "--n-seq", str(n_seq), *batch, "--kv-residency-mode", "head", "--kv-device-heads", "1",
                 "--kv-tail-cpu-frac", cpu_frac, "-ngl", "99", "--order-floor", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    plan = r["candidate"]["plan"]
    assert plan["split"] and plan["mode_chosen"] == "head" and r["metrics"]["nonfinite"] == 0
    assert plan["heads"]["per_layer"] == [1] * 4
    if cpu_frac != "0":
        assert plan["tail_cpu"]["frac"] == 0.5
        assert r["candidate"]["cpu_part_runs"] > 0, r["candidate"]  # the CPU part ran (counted on the device's host)
    assert r["tail_positions"] == r["metrics"]["n"]  # the host heads are read at every position
    assert r["verdict"] == "pass" and r["metrics"]["mean_tv"] <= 2 * r["order_floor"]["metrics"]["mean_tv"]


def test_gate_equiv_head_split_fails_perturbed_on_the_gpu(cuda_build, synth_model, tmp_path):
    """The head gate's must-fail on the GPU: every host-head score x 1.1 (ROLLINGKV_DEBUG_PERTURB_TAIL=0.1, why 0.1: see
    test_gate_equiv_fails_on_a_perturbed_tail_on_the_gpu) puts most positions over the per-position bound."""
    out = tmp_path / "r.json"
    proc = _cli(["gate", "equiv", "--model", str(synth_model), "--synthetic-tokens", "1024", "--kv-residency-mode", "head",
                 "--kv-device-heads", "1", "--kv-tail-cpu-frac", "0", "-ngl", "99", "--order-floor", "--json", str(out)],
                env_extra={"ROLLINGKV_DEBUG_PERTURB_TAIL": "0.1"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["verdict"] == "fail" and r["candidate"]["plan"]["mode_chosen"] == "head" and r["metrics"]["nonfinite"] == 0
    assert r["over_floor"]["n_over"] > 0.5 * r["over_floor"]["n"], r["over_floor"]


# ------------------------------------------------------------------------------ hybrid models (recurrent + attention)

HYBRID_SHAPE = dict(layers=8, embd=1024, heads=8, kv_heads=8, ff=2816, vocab=32000, ctx=65536, attn_interval=4)  # attention: 3, 7


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory) -> dict:
    """Synthetic qwen35 (gated delta net) and lfm2 (short convolutions) models, layers 3 and 7 attention, head 128."""
    from rollingkv_cli import models

    d = tmp_path_factory.mktemp("hybrid")
    return {arch: models.write_synthetic(d / f"{arch}.gguf", models.SynthSpec(**HYBRID_SHAPE, arch=arch)) for arch in ("qwen35", "lfm2")}


@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_hybrid_gate_equiv_within_the_order_floor(cuda_build, hybrid_models, tmp_path, arch):
    """A hybrid model fully offloaded, its attention cache split (window 256 of 1024 tokens, batches of 96 straddling it),
    its recurrent state whole on the GPU: within the resident run's own order floor, the plan splitting the attention
    layers only."""
    out = tmp_path / "r.json"
    proc = _cli(["gate", "equiv", "--model", str(hybrid_models[arch]), "--synthetic-tokens", "1024", "--ctx", "1280",
                 "--n-batch", "96", "--kv-window-cells", "256", "-ngl", "99", "--order-floor", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    plan = r["candidate"]["plan"]
    assert plan["split"] and [layer["il"] for layer in plan["layers"]] == [3, 7] and plan["recurrent"]["layers"] == [0, 1, 2, 4, 5, 6]
    assert r["verdict"] == "pass" and r["metrics"]["nonfinite"] == 0 and r["tail_positions"] == 768
    assert r["metrics"]["mean_tv"] <= 2 * r["order_floor"]["metrics"]["mean_tv"]


_HYBRID_AUTO = """
import json, os
import numpy as np
from pathlib import Path
from rollingkv_cli.lib import llama_ext
llama_cpp, ext = llama_ext.load(Path(os.environ["RKV_TEST_LIB_DIR"]))
llama_cpp.llama_backend_init()
mp = llama_cpp.llama_model_default_params(); mp.n_gpu_layers = 99
model = llama_cpp.llama_model_load_from_file(os.environ["RKV_TEST_MODEL"].encode(), mp)
n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
def cp(n_seq):
    c = llama_cpp.llama_context_default_params()
    c.n_ctx = 65536; c.n_batch = 1024; c.n_ubatch = 512; c.flash_attn_type = 1; c.n_seq_max = n_seq; c.kv_unified = True
    return c
ctx = ext.init_context(model, cp(1), ext.make_params(mode="auto", vram_target_mib=1000000))
big = ext.plan(ctx); llama_cpp.llama_free(ctx)
d = big["budget"]["devices"][0]
need = d["weights_bytes"] + d["compute_bytes"] + d["other_kv_bytes"] + d["runtime_bytes"] + d["kv_resident_bytes"]
target = (need - d["kv_resident_bytes"] // 2) // 2**20   # room for about half the KV
ctx = ext.init_context(model, cp(4), ext.make_params(mode="auto", vram_target_mib=int(target)))
plan = ext.plan(ctx)
b = llama_cpp.llama_batch_init(600, 0, 1)
for i in range(600):
    b.token[i] = (i * 37 + 11) % 20000 + 300; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = i == 599
b.n_tokens = 600
rc = llama_cpp.llama_decode(ctx, b)
row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
print(json.dumps({"big": big, "plan": plan, "target": int(target), "rc": rc, "finite": bool(np.isfinite(row).all())}))
"""


@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_hybrid_auto_splits_the_attention_cache_under_a_vram_target(cuda_build, hybrid_models, arch):
    """Auto residency on the GPU with a vram_target that holds about half of the attention layers' KV (65536 cells): the
    attention cache splits, the recurrent state (four sequences) is counted on the GPU next to the window, and a batch
    decodes to finite logits."""
    from conftest import run_python

    r = run_python(_HYBRID_AUTO, cuda_build.lib_dir, env_extra={"RKV_TEST_MODEL": str(hybrid_models[arch])})
    assert r["big"]["mode_chosen"] == "resident", r["big"]["reason"]
    p = r["plan"]
    assert p["split"] and p["mode_chosen"] == "window" and p["budget"]["budgeted"], p["reason"]
    assert [layer["il"] for layer in p["layers"]] == [3, 7] and p["recurrent"]["layers"] == [0, 1, 2, 4, 5, 6]
    d = p["budget"]["devices"][0]
    assert d["recurrent_bytes"] == p["recurrent"]["bytes"] > 0 and not d["host_memory"]
    assert 4 * r["big"]["budget"]["recurrent_bytes"] == d["recurrent_bytes"]
    assert r["rc"] == 0 and r["finite"]


@pytest.mark.parametrize("n_seq", [1, 4])
def test_gate_equiv_with_a_cpu_part_within_the_order_floor(cuda_build, synth_model, tmp_path, n_seq):
    """The hybrid tail on the GPU: half of each tail attended on the CPU from the pinned rows while the rest streams,
    decode-sized batches (the CPU part runs for batches of at most 8 rows per stream), one sequence and four side by side
    in one unified cache; within the resident run's own order floor, per position too. It can fail: the perturbation hook
    reaches the CPU part (test_op_on_cuda_perturbed_fails_exactly_the_live_tail_cases, --tail-cpu-frac in the device
    checks)."""
    out = tmp_path / "r.json"
    # 1024 tokens a sequence: a tail of 256 cells streams whole at a share of 0.5 (the streamed part keeps a multiple of
    # 256 cells), so 512 tokens never ran a CPU part (cpu_part_runs was 0 on the H100, 2026-12-06)
    proc = _cli(["gate", "equiv", "--model", str(synth_model), "--synthetic-tokens", str(1024 * n_seq), "--n-seq", str(n_seq),
                 "--n-batch", str(n_seq), "--kv-window-cells", "256", "--kv-tail-cpu-frac", "0.5", "-ngl", "99",
                 "--order-floor", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    plan = r["candidate"]["plan"]
    assert r["n_seq"] == n_seq and plan["split"] and plan["tail_cpu"]["frac"] == 0.5 and r["metrics"]["nonfinite"] == 0
    # the path ran: CPU parts counted on the device's host (a build that streamed the whole tail would pass the rest)
    assert r["candidate"]["cpu_part_runs"] > 0, r["candidate"]
    assert r["verdict"] == "pass" and r["tail_positions"] > 0
    assert r["metrics"]["mean_tv"] <= 2 * r["order_floor"]["metrics"]["mean_tv"]


def test_hybrid_model_server_two_slots_spilled(cuda_build, hybrid_models, tmp_path):
    """llama-server with a hybrid model (LFM2) on the GPU, its attention cache spilled (window 256 of 4096), two slots
    decoding at once: both answers complete with finite text, /props names the attention layers as split, and each
    answer alone (sequential requests) equals the resident server's alone where the GPU's order floor keeps the greedy
    argmax (the random-weight model's first tokens): the first 8 tokens must agree. The two answers decoded together
    must agree with the same server's answers alone over those 8 tokens too (a batch of two is another order of the
    same sums, within the same floor)."""
    import concurrent.futures

    from rollingkv_cli.gate.runner import synthetic_text
    from rollingkv_cli.serve.server import ServerProcess

    prompts = [synthetic_text(400 + 37 * i) for i in range(2)]
    answers, props = {}, {}
    for name, extra in (("resident", ["--kv-residency-mode", "off"]), ("window", ["--kv-residency-mode", "window", "--kv-window-cells", "256"])):
        with ServerProcess(cuda_build.server, ["-m", str(hybrid_models["lfm2"]), "-fa", "on", "-ngl", "99", "-c", "4096",
                           "-np", "2", "--kv-unified", *extra], log_path=tmp_path / f"{name}.log") as srv:
            def ask(p):
                return srv.request("/completion", {"prompt": p, "n_predict": 64, "temperature": 0, "seed": 0, "ignore_eos": True,
                                                   "cache_prompt": False, "n_probs": 0, "return_tokens": True}, timeout=300)
            alone = [ask(p) for p in prompts]
            with concurrent.futures.ThreadPoolExecutor(2) as ex:
                together = list(ex.map(ask, prompts))
            answers[name] = (alone, together)
            props[name] = srv.request("/props")["rolling_kv"]
    w = props["window"]
    assert w["split"] and [layer["il"] for layer in w["layers"]] == [3, 7] and not props["resident"]["split"]
    for alone, together in answers.values():
        assert all(r["tokens_predicted"] == 64 and len(r["tokens"]) == 64 and r["content"] for r in alone + together)
        for a, t in zip(alone, together):
            assert t["tokens"][:8] == a["tokens"][:8]  # tokens, not characters
    for a_w, a_r in zip(answers["window"][0], answers["resident"][0]):
        assert a_w["tokens_evaluated"] > 256  # the prompt reaches the tail
        assert a_w["tokens"][:8] == a_r["tokens"][:8]


def _elastic_load(cuda_build, model: Path, tmp_path: Path, name: str, kw: dict, ubatch: int = 256, env: dict | None = None):
    """tests/test_elastic_windows.py's load (windows that move every way), offloaded: (stats, logits rows)."""
    import numpy as np
    from conftest import LIB_PRELUDE, run_python
    from test_elastic_windows import ELASTIC_LOAD

    out = tmp_path / f"{name}.npy"
    r = run_python(LIB_PRELUDE + ELASTIC_LOAD, cuda_build.lib_dir, timeout=900,
                   env_extra={"RKV_TEST_MODEL": str(model), "RKV_TEST_KW": json.dumps(kw), "RKV_TEST_OUT": str(out),
                              "RKV_TEST_NGL": "99", "RKV_TEST_UBATCH": str(ubatch), **(env or {})})
    return r, np.load(out)


def _issued_within_occupied(stats: list[dict]) -> int:
    """Issue 36 (3), at every step of the load: the bytes the CUDA copy plan issued (counted where the copies are
    planned) equal the cache's account of what the step streamed, and are at most the tail its streams occupied plus
    one block (256 cells of every split layer) per stream. Returns the steps that streamed."""
    n = 0
    for i, st in enumerate(stats):
        last, plan = st["last"], st.get("plan_streamed")
        assert plan is not None, f"step {i}: no copy plan counted on a CUDA build"
        if not last["tail_bytes"]:
            continue
        assert plan["last_bytes"] == last["streamed_bytes"], (i, plan, last)
        assert plan["last_bytes"] <= last["occupied_bytes"] + st["block_bytes"] * max(1, last["streams"]), (i, plan, last)
        n += plan["last_bytes"] > 0
    return n


def test_the_issued_bytes_check_bites():
    """The check above, on steps a broken copy plan would report (no GPU needed): a plan that streams one block per
    stream more than the tail its streams occupy (the whole tail instead of the runs, a stale window), or that issues
    other bytes than the cache accounted for, fails it; a step within its bound passes."""
    block = 256 * 1000

    def step(issued, streamed, occupied, streams=2):
        return {"last": {"tail_bytes": streamed, "streamed_bytes": streamed, "occupied_bytes": occupied, "streams": streams},
                "plan_streamed": {"last_bytes": issued}, "block_bytes": block}

    assert _issued_within_occupied([step(10 * block, 10 * block, 8 * block), step(0, 0, 0)]) == 1
    for bad in (step(11 * block, 11 * block, 8 * block),   # beyond one block per stream
                step(9 * block, 10 * block, 8 * block)):   # the plan and the cache disagree
        with pytest.raises(AssertionError):
            _issued_within_occupied([step(block, block, block), bad])
    with pytest.raises(AssertionError):  # a CUDA build that counted no plan
        _issued_within_occupied([{**step(block, block, block), "plan_streamed": None}])


def _mean_tv(a, b) -> float:
    import numpy as np

    def softmax(x):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    return float(0.5 * np.abs(softmax(a.astype(np.float64)) - softmax(b.astype(np.float64))).sum(axis=-1).mean())


def test_elastic_windows_on_the_gpu_within_the_order_floor(cuda_build, synth_model, tmp_path):
    """Elastic windows on CUDA: the same moves as on the CPU (promotions, demotions and relocations in device memory and
    pinned host memory, counted), the logits within 2x the resident run's own distance to itself at another ubatch size."""
    import numpy as np

    _, ref = _elastic_load(cuda_build, synth_model, tmp_path, "resident", dict(mode="off"))
    _, floor_run = _elastic_load(cuda_build, synth_model, tmp_path, "floor", dict(mode="off"), ubatch=128)
    kw = dict(mode="window", window_cells=256, tail_cpu_frac=0)
    r, got = _elastic_load(cuda_build, synth_model, tmp_path, "elastic", kw)
    moves = r["stats"][-1]["moves"]
    assert r["plan"]["windows"]["policy"] == "elastic", r["plan"].get("windows")
    assert moves["promoted_cells"] > 0 and moves["demoted_cells"] > 0 and moves["relocated_cells"] > 0, moves
    assert r["stats"][-1]["streamed_bytes_total"] > 0  # the tails were streamed over the link, not attended on the CPU
    assert _issued_within_occupied(r["stats"]) > 0
    assert np.isfinite(got).all() and got.shape == ref.shape
    tv, floor = _mean_tv(got, ref), _mean_tv(floor_run, ref)
    print(f"elastic vs resident mean TV {tv:.3g}, the resident run's own floor {floor:.3g}")
    assert floor > 0 and tv <= 2 * floor, (tv, floor)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= (floor_run.argmax(-1) == ref.argmax(-1)).mean() - 0.05
    # issue 36 (7), the must-fail twin: every tail score 10 % off (the context's test hook) must leave the floor behind
    _, bad = _elastic_load(cuda_build, synth_model, tmp_path, "elastic-perturbed", kw, env={"ROLLINGKV_DEBUG_PERTURB_TAIL": "0.1"})
    bad_tv = _mean_tv(bad, ref)
    print(f"perturbed elastic vs resident mean TV {bad_tv:.3g}")
    assert bad_tv > 2 * floor, (bad_tv, floor)


def test_elastic_windows_with_cpu_parts_on_the_gpu_within_the_order_floor(cuda_build, synth_model, tmp_path):
    """Four streams decoding together with a CPU part each: the first op of a layer hands over every stream's part
    (rolling-kv-hybrid.cu, the group), each stream's merge waits for its own. The logits within 2x the resident run's own
    distance to itself at another ubatch size; the parts ran (counted on the device's host)."""
    import numpy as np

    _, ref = _elastic_load(cuda_build, synth_model, tmp_path, "resident", dict(mode="off"))
    _, floor_run = _elastic_load(cuda_build, synth_model, tmp_path, "floor", dict(mode="off"), ubatch=128)
    r, got = _elastic_load(cuda_build, synth_model, tmp_path, "hybrid", dict(mode="window", window_cells=256, tail_cpu_frac=0.5))
    assert r["plan"]["windows"]["policy"] == "elastic", r["plan"].get("windows")  # issue 36 (7): elastic, moving, a part per stream
    moves = r["stats"][-1]["moves"]
    assert moves["promoted_cells"] > 0 and moves["demoted_cells"] > 0, moves
    assert r["stats"][-1]["cpu_part_runs"] > 0, r["stats"][-1]
    # the op's own parts (calibration and probes are counted apart): at least one per split layer for every stream of a
    # step that attended a tail with several streams
    several = [st for st in r["stats"] if st["last"]["tail_bytes"] and st["last"]["streams"] > 1]
    assert several, "no step attended a tail with several streams"
    n_layers = len([layer for layer in r["plan"]["layers"] if layer["split"]])
    assert n_layers > 0, r["plan"]["layers"]
    assert r["stats"][-1]["cpu_part_runs"] >= n_layers * max(st["last"]["streams"] for st in several), (n_layers, r["stats"][-1])
    assert np.isfinite(got).all() and got.shape == ref.shape
    tv, floor = _mean_tv(got, ref), _mean_tv(floor_run, ref)
    print(f"hybrid elastic vs resident mean TV {tv:.3g}, the resident run's own floor {floor:.3g}")
    assert floor > 0 and tv <= 2 * floor, (tv, floor)
