"""ggml's AMX weight path on Intel Xeons with AMX (the upstream fixes in patches/upstream-fixes/).

Without the first fix the first quantized matmul through the AMX buffer type dies with SIGILL at `tilezero`: the tile
config was filled on the stack and the compiler dropped the stores. Without the second, a matmul of more than one
batch (a 2D weight times a 3D activation: a hybrid model's recurrent layers with several sequences) reads past the
weight (SIGSEGV in the f16 kernel) or writes batch 1 on at the wrong rows. These tests run real weights through that
path and prove from the library that it is the path taken; on a CPU without AMX they skip and say so (nothing here
passes because AMX is absent), or fail where the run expects AMX ($ROLLINGKV_EXPECT_ISA, as CI does).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from rollingkv_cli.hw import hostinfo

import isa

pytestmark = pytest.mark.build


def require_amx() -> None:
    """Skip without AMX, saying so; fail instead where the run expects the AMX path ($ROLLINGKV_EXPECT_ISA, as .ci/run
    sets it: tests/isa.py). Seen failing on a host without AMX: `ROLLINGKV_EXPECT_ISA=amx` with hostinfo.has_amx False
    (tests/test_ci_isa.py)."""
    if not hostinfo.has_amx():
        isa.unavailable("amx", f"this CPU ({hostinfo.cpu_model()}) has no AMX (amx_tile/amx_int8 not in /proc/cpuinfo): "
                               "ggml's AMX kernels cannot run here")


@pytest.fixture
def _amx_cpu():
    require_amx()


_REQUIRES_AMX = pytest.mark.usefixtures("_amx_cpu")

# Teacher-forced logits of a fixed prompt, with ggml's extra weight buffer types (AMX, CPU_REPACK) on or off.
_LOGITS = """
import json, math, os, sys
from pathlib import Path
from rollingkv_cli.gate.runner import load_bindings
llama_cpp, _, _ = load_bindings(Path(os.environ["RKV_TEST_LIB_DIR"]))  # ours or the reference
import llama_cpp.llama_cpp as low  # Llama() takes its model params from here
extra = os.environ["RKV_EXTRA_BUFTS"] == "1"
default_params = low.llama_model_default_params
def params():
    p = default_params()
    p.use_extra_bufts = extra
    return p
low.llama_model_default_params = params
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_batch=64, n_threads=2, logits_all=True, verbose=True, flash_attn=True)
toks = llm.tokenize(b"The quick brown fox jumps over the lazy dog. The capital of France is Paris, and the capital of Italy is")
llm.eval(toks)
rows = [list(map(float, llm.scores[i])) for i in range(len(toks))]
print(json.dumps({"n": len(toks), "finite": all(math.isfinite(x) for r in rows for x in r),
                  "argmax": [max(range(len(r)), key=r.__getitem__) for r in rows]}))
"""


def _logits(lib_dir, model, extra_bufts: bool) -> tuple[dict, str]:
    env = {**os.environ, "RKV_TEST_LIB_DIR": str(lib_dir), "RKV_EXTRA_BUFTS": "1" if extra_bufts else "0"}
    env.pop("LLAMA_CPP_LIB_PATH", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_LOGITS), str(model)], capture_output=True, text=True,
                          env=env, timeout=600)
    from rollingkv_cli.lib.procs import describe_exit

    assert proc.returncode == 0, f"the demo model through {'the AMX path' if extra_bufts else 'plain CPU buffers'}: " \
                                 f"{describe_exit(proc.returncode)}\n{proc.stderr[-3000:]}"
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1]), proc.stderr


@_REQUIRES_AMX
def test_the_build_uses_amx_on_an_amx_cpu(cpu_build):
    """On an AMX CPU a native build must compile and offer the AMX path: else the decode test below proves nothing."""
    info = hostinfo.backend_info(cpu_build.lib_dir)
    assert info.error is None, info.error
    assert info.features.get("AMX_INT8") == "1", f"the CPU has AMX, the build's CPU backend reports: {info.system_info}"
    assert "AMX" in info.extra_buffer_types, info.extra_buffer_types


@_REQUIRES_AMX
@pytest.mark.parametrize("which", ["ours", "reference"])
def test_demo_model_decodes_through_the_amx_buffer_type(which, cpu_build, unpatched_build, demo_model):
    build = cpu_build if which == "ours" else unpatched_build  # the reference build carries the fix too
    amx, log = _logits(build.lib_dir, demo_model, extra_bufts=True)
    assert "AMX model buffer size" in log, "the weights did not go to the AMX buffer type: the test would prove nothing"
    plain, plain_log = _logits(build.lib_dir, demo_model, extra_bufts=False)
    assert "AMX model buffer size" not in plain_log
    assert amx["finite"] and plain["finite"]
    # int8 tiles and the plain q8 dot products round differently; a wrong tile config gives garbage, not a near miss
    agree = sum(a == b for a, b in zip(amx["argmax"], plain["argmax"])) / amx["n"]
    assert agree >= 0.9, f"AMX and plain CPU buffers agree on the top token at only {agree:.0%} of {amx['n']} positions"


# Four sequences side by side through a hybrid model's f16 weights: the recurrent layers multiply each 2D weight by a
# [n_embd, n_seq_tokens, n_seqs] activation, a batched mul_mat the AMX buffer type takes.
_BATCHED = """
import numpy as np
p = llama_cpp.llama_model_default_params()
p.use_extra_bufts = os.environ["RKV_EXTRA_BUFTS"] == "1"
model = llama_cpp.llama_model_load_from_file(os.environ["RKV_TEST_MODEL"].encode(), p)
assert model
n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
cp = llama_cpp.llama_context_default_params()
cp.n_ctx = 512; cp.n_batch = cp.n_ubatch = 128; cp.flash_attn_type = 1
cp.n_threads = cp.n_threads_batch = 2; cp.n_seq_max = 4; cp.kv_unified = True
ctx = llama_cpp.llama_init_from_model(model, cp)
assert ctx
n = 24
b = llama_cpp.llama_batch_init(4 * n, 0, 1)
for s in range(4):
    for i in range(n):
        j = s * n + i
        b.token[j] = (i * 37 + 11 + 101 * s) % 700 + 260; b.pos[j] = i; b.n_seq_id[j] = 1; b.seq_id[j][0] = s
        b.logits[j] = True
b.n_tokens = 4 * n
assert llama_cpp.llama_decode(ctx, b) == 0
rows = np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, j), shape=(n_vocab,)).copy() for j in range(4 * n)])
np.save(os.environ["RKV_OUT"], rows)
print(json.dumps({"amx": "AMX model buffer size" in "".join(logs)}))
"""


@_REQUIRES_AMX
@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_batched_matmul_through_the_amx_buffer_type(arch, cpu_build, tmp_path):
    """Every sequence's logits through the AMX buffer type are plain CPU buffers' (the f16 kernels round alike up to
    the order of the dot products); without the fix the run dies with SIGSEGV or sequences 1-3 get other rows."""
    import numpy as np

    from conftest import LIB_PRELUDE, run_python
    from rollingkv_cli import models

    model = models.write_synthetic(tmp_path / f"{arch}.gguf", models.SynthSpec(
        layers=4, embd=256, heads=4, kv_heads=2, ff=512, vocab=1000, ctx=4096, attn_interval=2, arch=arch))
    out = {}
    for extra in (True, False):
        path = tmp_path / f"logits-{int(extra)}.npy"
        r = run_python(LIB_PRELUDE + _BATCHED, cpu_build.lib_dir, timeout=300, env_extra={
            "RKV_TEST_MODEL": str(model), "RKV_EXTRA_BUFTS": "1" if extra else "0", "RKV_OUT": str(path)})
        assert r["amx"] == extra, "the weights did not go where the test asked: it would prove nothing"
        out[extra] = np.load(path)
    amx, plain = out[True], out[False]
    assert np.isfinite(amx).all()
    scale = float(np.abs(plain).max())
    for s in range(4):
        err = float(np.abs(amx[s * 24:(s + 1) * 24] - plain[s * 24:(s + 1) * 24]).max())
        assert err <= 1e-2 * scale, f"sequence {s}: the AMX path's logits differ from plain buffers' by {err:.3g} (scale {scale:.3g})"


def test_cpu_facts_come_from_the_host():
    """What `rollingkv info` reports about the CPU is read from this host (not a default that hides a missing feature)."""
    flags = hostinfo.cpu_flags()
    if not hostinfo.CPUINFO.is_file():
        pytest.skip("no /proc/cpuinfo on this host")
    assert flags, "no flags line in /proc/cpuinfo"
    assert hostinfo.has_amx() == ({"amx_tile", "amx_int8"} <= flags)
    assert hostinfo.cpu_model() != "unknown"


def test_parse_system_info():
    text = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | F16C = 0 | LLAMAFILE = 1 | REPACK = 1 | "
    feats = hostinfo.parse_system_info(text)
    assert feats["AMX_INT8"] == "1" and feats["F16C"] == "0"
    assert hostinfo.BackendInfo(features=feats).enabled == ["SSE3", "AVX2", "AVX512", "AMX_INT8", "LLAMAFILE", "REPACK"]


@pytest.mark.build
def test_info_shows_the_cpu_backend_features(cpu_build, monkeypatch):
    from click.testing import CliRunner

    from rollingkv_cli.cli import rollingkv

    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    r = CliRunner().invoke(rollingkv, ["info", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    host = json.loads(r.output)["host"]
    assert host["error"] is None, host["error"]
    assert host["cpu_model"] == hostinfo.cpu_model()
    # the features the CPU backend reports match what this CPU has (the native build compiles for it)
    assert ("AVX2" in host["ggml_features"]) == ("avx2" in hostinfo.cpu_flags())
    assert ("AMX_INT8" in host["ggml_features"]) == hostinfo.has_amx()
    assert ("AMX" in host["cpu_extra_buffer_types"]) == hostinfo.has_amx()
    assert "CPU :" in host["ggml_system_info"]
    r = CliRunner().invoke(rollingkv, ["info"], catch_exceptions=False)
    assert r.exit_code == 0 and "CPU backend uses" in r.output and hostinfo.cpu_model()[:20] in r.output


def test_the_tile_config_is_loaded_from_static_storage(cpu_build, tmp_path):
    """Host-independent half of the fix: compile the prepared tree's AMX kernels for Sapphire Rapids with this
    machine's compiler, as a Release build does (-O3), and check every `ldtilecfg` reads the constant config in
    .rodata with the rows and column widths the kernels use.

    Without the fix (the pristine mmq.cpp) gcc 12.2 -O3 emits `vpxor; vmovdqa64 %zmm0,0xc0(%rsp); movb $0x1,0xc0(%rsp);
    ldtilecfg 0xc0(%rsp)`: a stack config with the palette set and every row and width store dropped, which is the
    SIGILL at the first tile instruction; this test then fails on the stack operand (checked once against the pristine
    tree). gcc 13.3 on the H200 host kept the stores, which is why the crash depends on the compiler, not the CPU."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    objdump = shutil.which("objdump")
    assert cxx and objdump, "a C++ compiler and objdump (binutils) are needed to build llama.cpp at all"
    tree = cpu_build.dir / "src"
    src = tree / "ggml/src/ggml-cpu/amx/mmq.cpp"
    obj = tmp_path / "mmq.o"
    inc = [f"-I{tree / d}" for d in ("ggml/include", "ggml/src", "ggml/src/ggml-cpu", "ggml/src/ggml-cpu/amx")]
    cc = subprocess.run([cxx, "-std=c++17", "-O3", "-march=sapphirerapids", "-DNDEBUG", *inc, "-c", str(src), "-o", str(obj)],
                        capture_output=True, text=True, timeout=600)
    assert cc.returncode == 0, cc.stderr[-2000:]
    dis = subprocess.run([objdump, "-d", "-r", "--no-show-raw-insn", str(obj)], capture_output=True, text=True, check=True).stdout
    lines = dis.splitlines()
    loads = [i for i, line in enumerate(lines) if "ldtilecfg" in line]
    assert loads, "no ldtilecfg in the AMX kernels: the test would prove nothing"
    targets = set()
    for i in loads:
        assert "(%rip)" in lines[i], f"the tile config is not static data: {lines[i].strip()}"
        reloc = re.search(r"R_X86_64_PC32\s+(\S+)\+0x([0-9a-f]+)", lines[i + 1])
        assert reloc, lines[i + 1]
        targets.add((reloc.group(1), int(reloc.group(2), 16) + 4))  # PC32: the operand is 4 bytes before the next insn
    for section, offset in targets:
        dump = subprocess.run([objdump, "-s", "-j", section, f"--start-address={offset}", f"--stop-address={offset + 64}", str(obj)],
                              capture_output=True, text=True, check=True).stdout
        data = bytes.fromhex("".join("".join(line.split()[1:5]) for line in dump.splitlines() if re.match(r"^ [0-9a-f]+ ", line)))
        assert len(data) == 64, dump
        palette, colsb, rows = data[0], [int.from_bytes(data[16 + 2 * t:18 + 2 * t], "little") for t in range(16)], list(data[48:64])
        assert palette == 1
        assert colsb[:8] == [64, 64, 32, 32, 64, 64, 64, 64] and rows[:8] == [8, 8, 16, 16, 16, 16, 16, 16], (colsb, rows)
