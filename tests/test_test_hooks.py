"""The must-fail controls' perturbations are parameters, not switches deep in the kernels (issue 36, item 10).

A context's test hooks (struct llama_rolling_kv_test_hooks, API 8) are fixed when it is created: through
llama_init_from_model_rolling_kv_test, or from ROLLINGKV_DEBUG_PERTURB_TAIL / ROLLINGKV_DEBUG_PERTURB_MOVE, which
llama_init_from_model_rolling_kv reads once per context (so llama-server, llama-bench and the runners take them without
a flag of their own) and refuses when it cannot take them. The graph passes perturb_tail to every split layer's op as
the op's tail_perturb parameter; no kernel reads the environment.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from conftest import LIB_PRELUDE, run_python
from rollingkv_cli.lib import llama_ext

REPO = Path(__file__).resolve().parent.parent
HEADER = REPO / "native" / "include" / "llama-rolling-kv.h"


def test_the_ctypes_mirror_of_the_hooks_follows_the_header():
    body = re.search(r"struct llama_rolling_kv_test_hooks\s*\{(.*?)\};", HEADER.read_text(), re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    fields = [m.group(1) for m in re.finditer(r"(\w+)\s*;", body)]
    assert fields == [f[0] for f in llama_ext.RollingKVTestHooks._fields_] == ["perturb_tail", "perturb_move"]


_PRELUDE = LIB_PRELUDE + """
import numpy as np
model = llama_cpp.llama_model_load_from_file(os.environ["RKV_TEST_MODEL"].encode(), llama_cpp.llama_model_default_params())
def cparams():
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = 1024; cp.n_batch = 512; cp.n_ubatch = 512; cp.flash_attn_type = 1
    cp.n_threads = 2; cp.n_threads_batch = 2
    return cp
toks = [(i * 37 + 11) % 20000 + 100 for i in range(600)]
def logits(ctx):
    out = []
    for p0 in (0, 512):
        chunk = toks[p0:p0 + 512]
        assert batch_decode(ctx, [(0, p0 + i, t, i == len(chunk) - 1) for i, t in enumerate(chunk)]) == 0
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
def hooks(tail=0.0, move=0):
    return llama_ext.RollingKVTestHooks(tail, move)
def window():
    return ext.make_params(mode="window", window_cells=256)
"""


@pytest.mark.build
def test_the_tail_perturbation_is_a_parameter_of_the_context(cpu_build, demo_model):
    """Two split contexts in one process, one with perturb_tail and one without, the second made after the first: only
    the first's logits differ from the resident cache's (a knob read once per process, the design before API 8, would
    give both the same perturbation). Seen failing with the graph not setting the op's parameter (llama_rkv_attn_op):
    the perturbed context then equals the resident one, here and in the next test."""
    r = run_python(_PRELUDE + """
res = ext.init_context(model, cparams(), ext.make_params(mode="off"), hooks())
ref = logits(res)
bad = ext.init_context(model, cparams(), window(), hooks(tail=1e-3))
assert bad, ext.last_error()
got_bad = logits(bad)
good = ext.init_context(model, cparams(), window(), hooks())
got_good = logits(good)
plan = ext.plan(good)
print(json.dumps({"split": plan["split"], "bad_equal": bool(np.array_equal(got_bad, ref)),
                  "good_equal": bool(np.array_equal(got_good, ref)), "warned": any("perturb_tail" in l for l in logs)}))
""", cpu_build.lib_dir, env_extra={"RKV_TEST_MODEL": str(demo_model)})
    assert r["split"] and r["good_equal"] and not r["bad_equal"] and r["warned"]


@pytest.mark.build
def test_the_environment_is_read_at_context_creation(cpu_build, demo_model):
    """llama_init_from_model_rolling_kv takes ROLLINGKV_DEBUG_PERTURB_TAIL as the context's hook (the children's way:
    llama-server and the runners create their contexts through it); llama_init_from_model_rolling_kv_test with its own
    hooks does not read the environment."""
    r = run_python(_PRELUDE + """
res = ext.init_context(model, cparams(), ext.make_params(mode="off"))
ref = logits(res)
env = ext.init_context(model, cparams(), window())
explicit = ext.init_context(model, cparams(), window(), hooks())
print(json.dumps({"env_equal": bool(np.array_equal(logits(env), ref)), "explicit_equal": bool(np.array_equal(logits(explicit), ref))}))
""", cpu_build.lib_dir, env_extra={"RKV_TEST_MODEL": str(demo_model), "ROLLINGKV_DEBUG_PERTURB_TAIL": "1e-3"})
    assert not r["env_equal"] and r["explicit_equal"]


@pytest.mark.build
@pytest.mark.parametrize("env,hook,why", [
    ({}, "hooks(tail=-1.0)", "perturb_tail must be finite and above -1"),
    ({}, "hooks(tail=float('nan'))", "perturb_tail must be finite and above -1"),
    ({}, "hooks(tail=float('inf'))", "perturb_tail must be finite and above -1"),
    ({}, "hooks(move=3)", "perturb_move must be 0 (off), 1 or 2"),
    ({"ROLLINGKV_DEBUG_PERTURB_TAIL": "abc"}, None, "ROLLINGKV_DEBUG_PERTURB_TAIL=abc is not a number"),
    ({"ROLLINGKV_DEBUG_PERTURB_TAIL": "-2"}, None, "perturb_tail must be finite and above -1"),
    ({"ROLLINGKV_DEBUG_PERTURB_MOVE": "3"}, None, "ROLLINGKV_DEBUG_PERTURB_MOVE=3 is neither 1 nor 2"),
], ids=["tail-1", "tail-nan", "tail-inf", "move-3", "env-tail-abc", "env-tail-2", "env-move-3"])
def test_a_hook_it_cannot_take_refuses_the_context(cpu_build, demo_model, env, hook, why):
    """Before API 8 the library read "abc" as 0 (off, silently) and ignored PERTURB_MOVE=3 with a warning: a must-fail
    control that silently did not perturb would pass for the wrong reason."""
    r = run_python(_PRELUDE + f"""
ctx = ext.init_context(model, cparams(), window(){', ' + hook if hook else ''})
print(json.dumps({{"ctx": bool(ctx), "error": ext.last_error()}}))
""", cpu_build.lib_dir, env_extra={"RKV_TEST_MODEL": str(demo_model), **env})
    assert not r["ctx"] and why in r["error"], r


def test_no_product_source_reads_a_debug_switch():
    """The product's sources (native/, the hook patches) read no ROLLINGKV_DEBUG_* variable but the two test hooks, and
    those only in llama_init_from_model_rolling_kv (once per context) and in the op test, which sets the op's parameter
    itself. The lab switches live in the lab series (patches/lab/, native-lab/). Seen failing on the tree before: the
    CPU and CUDA kernels read PERTURB_TAIL (ggml-rolling-kv.c's knobs), the block moves PERTURB_MOVE, the cache
    ONE_OP_STREAMS, the CUDA copy plan CHUNK_CELLS."""
    allowed = {("native/src/llama-rolling-kv.cpp", "ROLLINGKV_DEBUG_PERTURB_TAIL"),
               ("native/src/llama-rolling-kv.cpp", "ROLLINGKV_DEBUG_PERTURB_MOVE"),
               ("native/tests/test-rolling-kv-ops.cpp", "ROLLINGKV_DEBUG_PERTURB_TAIL")}
    reads = set()
    files = [p for p in (REPO / "native").rglob("*") if p.is_file()] + sorted((REPO / "patches").glob("0*.patch"))
    for p in files:
        text = p.read_text(errors="replace")
        if p.suffix == ".patch":  # the lines a hook adds
            text = "\n".join(line for line in text.splitlines() if line.startswith("+"))
        for m in re.finditer(r"getenv\s*\(\s*\"(ROLLINGKV_DEBUG_\w+)\"", text):
            reads.add((str(p.relative_to(REPO)), m.group(1)))
        for m in re.finditer(r"\"(ROLLINGKV_DEBUG_\w+)\"", text):
            reads.add((str(p.relative_to(REPO)), m.group(1)))
    assert reads <= allowed, sorted(reads - allowed)
    assert reads == allowed  # the test hooks are still read where documented
