"""A cache type the split cannot take keeps the cache whole, with the reason in the plan: the streaming op attends every
part of a split cache, the window included, in the types of ggml_rkv_tail_type_names only. A window of iq4_nl (which
llama.cpp takes for an unsplit cache) made llama-server's scheduler abort after start-up (issue 27: 10)."""

from __future__ import annotations

import json

import pytest

from conftest import LIB_PRELUDE, run_python

pytestmark = pytest.mark.build

_BODY = """
model = llama_cpp.llama_model_load_from_file(os.environ["RKV_TEST_MODEL"].encode(), llama_cpp.llama_model_default_params())
cp = llama_cpp.llama_context_default_params()
cp.n_ctx = 1024; cp.n_batch = 64; cp.n_ubatch = 64; cp.flash_attn_type = 1; cp.n_threads = 2; cp.n_threads_batch = 2
cp.type_k = cp.type_v = int(os.environ["RKV_TEST_TYPE"])
ctx = ext.init_context(model, cp, ext.make_params(mode="window", window_cells=256))
assert ctx, ext.last_error()
rc = batch_decode(ctx, [(0, i, 100 + i, i == 31) for i in range(32)])
print(json.dumps({"plan": ext.plan(ctx), "rc": rc}))
"""


def _plan(cpu_build, demo_model, ggml_type: int) -> dict:
    return run_python(LIB_PRELUDE + _BODY, cpu_build.lib_dir,
                      env_extra={"RKV_TEST_MODEL": str(demo_model), "RKV_TEST_TYPE": str(ggml_type)})


def test_an_iq4_nl_cache_stays_whole_with_the_reason(cpu_build, demo_model):
    r = _plan(cpu_build, demo_model, 20)  # GGML_TYPE_IQ4_NL
    plan = r["plan"]
    assert r["rc"] == 0 and not plan["split"] and not plan["eligible"], plan
    assert "iq4_nl" in plan["reason"] and "not ones a split cache takes" in plan["reason"]


def test_a_q8_0_cache_splits(cpu_build, demo_model):
    """Control: a type of the list splits as asked."""
    r = _plan(cpu_build, demo_model, 8)  # GGML_TYPE_Q8_0
    assert r["rc"] == 0 and r["plan"]["split"] and r["plan"]["window_cells"] == 256, r["plan"]
