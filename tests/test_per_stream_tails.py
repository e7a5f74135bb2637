"""Several sequences of different lengths in one ubatch (a server's slots): each stream attends, and streams, only its
own occupied cells, exactly. Teacher-forced logits on the demo model against the resident cache under the same batches,
bit for bit; the stats report what each step attended of the tail."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import LIB_PRELUDE, run_python

pytestmark = pytest.mark.build

# 4 sequences in one non-unified cache of 4 streams x 1024 cells, window 256: one long (its tail in use) and three
# short. Each is prefilled alone, then every step decodes one token of each sequence in one ubatch. The short ones
# start at 250, 120 and 60 tokens: the first crosses its 256-cell boundary (its own cell count grows while the
# ubatch's, the long one's, stays), which a graph reused across that step would attend wrongly.
_BODY = """
import numpy as np
model = llama_cpp.llama_model_load_from_file(os.environ["RKV_TEST_MODEL"].encode(), llama_cpp.llama_model_default_params())
cp = llama_cpp.llama_context_default_params()
cp.n_ctx = 4096; cp.n_batch = 1024; cp.n_ubatch = 1024; cp.flash_attn_type = 1
cp.n_threads = 2; cp.n_threads_batch = 2; cp.n_seq_max = 4; cp.kv_unified = False
kw = json.loads(os.environ["RKV_TEST_KW"])
ctx = ext.init_context(model, cp, ext.make_params(**kw))
assert ctx, ext.last_error()
n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
lens = [900, 250, 120, 60]
toks = [[(i * 37 + 11 + 101 * s) % 20000 + 100 for i in range(1000)] for s in range(4)]
def decode(items):  # items: (seq, pos, token, want_logits)
    assert batch_decode(ctx, items) == 0
for s in range(4):
    decode([(s, i, toks[s][i], False) for i in range(lens[s])])
logits, steps = [], []
for step in range(10):
    decode([(s, lens[s] + step, toks[s][lens[s] + step], True) for s in range(4)])
    out = llama_cpp.llama_get_logits(ctx)
    logits.append(np.ctypeslib.as_array(out, shape=(4 * n_vocab,)).copy())
    steps.append(ext.stats(ctx))
np.save(os.environ["RKV_TEST_OUT"], np.stack(logits))
print(json.dumps({"plan": ext.plan(ctx), "steps": steps}))
"""


def _run(cpu_build, demo_model, tmp_path, name, kw, **env):
    out = tmp_path / f"{name}.npy"
    r = run_python(LIB_PRELUDE + _BODY, cpu_build.lib_dir,
                   env_extra={"RKV_TEST_MODEL": str(demo_model), "RKV_TEST_KW": json.dumps(kw), "RKV_TEST_OUT": str(out), **env})
    return r, np.load(out)


WINDOW = dict(mode="window", window_cells=256)
# static windows: the layout whose per-stream tails the byte counts below follow (elastic windows move cells between
# streams: tests/test_elastic_windows.py)
STATIC = dict(WINDOW, windows="static")


@pytest.fixture(scope="module")
def resident(cpu_build, demo_model, tmp_path_factory):
    return _run(cpu_build, demo_model, tmp_path_factory.mktemp("resident"), "resident", dict(mode="off"))


@pytest.mark.parametrize("kw", [WINDOW, STATIC, dict(mode="head", device_heads=1)], ids=["window", "static", "head"])
def test_per_stream_ops_equal_resident_bit_for_bit(cpu_build, demo_model, tmp_path, resident, kw):
    r, got = _run(cpu_build, demo_model, tmp_path, "split", kw)
    ref_plan, ref = resident[0]["plan"], resident[1]
    assert ref_plan["mode_chosen"] == "off" and not ref_plan["split"]  # the reference is the upstream cache
    assert r["plan"]["split"] and r["plan"]["n_stream"] == 4
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert np.array_equal(got, ref), f"max |diff| {np.abs(got - ref).max()}"
    last = r["steps"][-1]["last"]
    assert last["streams"] == 4 and last["per_stream_ops"] == 4  # the split path ran, one op per stream


def test_each_stream_attends_only_its_own_tail(cpu_build, demo_model, tmp_path):
    """Window mode: the long sequence's tail is [256, 1024) (its cells padded to 1024), the short ones have none until
    one crosses 256 cells. One op over all streams (the layout before, now only in the lab series: `bench load`'s one-op
    cell) attended 4 x the long one's tail."""
    per, _ = _run(cpu_build, demo_model, tmp_path, "per", STATIC)
    cell = per["steps"][-1]["block_bytes"] // 256  # one tail cell of every layer (K and V)
    assert cell == 30 * 2 * 3 * 64 * 2
    for step, s_per in enumerate(per["steps"]):
        lp = s_per["last"]
        # the second sequence holds 251 + step cells: from step 6 on, its cells [256, 512) are a tail of its own
        n_short = 251 + step
        assert lp["tail_bytes"] == ((1024 - 256) + (256 if n_short > 256 else 0)) * cell
        assert lp["occupied_bytes"] == ((901 + step - 256) + max(0, n_short - 256)) * cell
        assert lp["per_stream_ops"] == 4
        # what is attended exceeds what is occupied by less than a block per stream
        assert lp["occupied_bytes"] <= lp["tail_bytes"] < lp["occupied_bytes"] + 4 * s_per["block_bytes"]
        assert lp["streamed_bytes"] == 0  # a CPU build streams nothing: its tail is attended in place
    slots = per["steps"][-1]["slots"]
    assert [s["tail_cells"] for s in slots] == [900 + 10 - 256, 260 - 256, 0, 0]
    assert [s["device_cells"] for s in slots] == [256, 256, 130, 70]


def test_a_perturbed_tail_is_caught(cpu_build, demo_model, tmp_path, resident):
    """Must-fail control: the comparison sees a tail that is attended wrongly."""
    _, got = _run(cpu_build, demo_model, tmp_path, "perturbed", WINDOW, ROLLINGKV_DEBUG_PERTURB_TAIL="1e-3")
    assert not np.array_equal(got, resident[1])

