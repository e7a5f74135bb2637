"""Where a server's time goes: llama_rolling_kv_stats_json's "evals" (API 10), the context's evaluations (what
llama_decode queued between two synchronizations) by kind, decode, prefill and mixed, timed by the context and holding
the split cache's counters of the same evaluations. The demo model, a unified cache of two sequences, split by window
and resident: each evaluation below is one llama_decode followed by the logits' read (a synchronize), as llama-server's
loop does, so the counts are known exactly.

It can fail: without the context's hooks (patch 0024) every count stays 0; an evaluation of the wrong kind, a token
counted on the wrong side, or the split counters not carried over moves a count below."""

from __future__ import annotations

import json

import pytest

from conftest import LIB_PRELUDE, run_python

pytestmark = pytest.mark.build

_BODY = """
import time
mp = llama_cpp.llama_model_default_params()
model = llama_cpp.llama_model_load_from_file(os.environ["RKV_TEST_MODEL"].encode(), mp)
cp = llama_cpp.llama_context_default_params()
cp.n_ctx = 2048; cp.n_batch = 512; cp.n_ubatch = 256; cp.flash_attn_type = 1
cp.n_threads = 2; cp.n_threads_batch = 2; cp.n_seq_max = 2; cp.kv_unified = True
ctx = ext.init_context(model, cp, ext.make_params(**json.loads(os.environ["RKV_TEST_KW"])))
assert ctx, ext.last_error()
toks = [[(i * 37 + 11 + 101 * s) % 20000 + 100 for i in range(1000)] for s in range(2)]
pos = [0, 0]
snaps = [ext.stats(ctx)]
t0 = time.perf_counter()
def decode(items):  # (seq, n tokens); logits of each sequence's last token, read at once (the synchronize)
    placed = []
    for s, n in items:
        for i in range(n):
            placed.append((s, pos[s], toks[s][pos[s]], i == n - 1))
            pos[s] += 1
    assert batch_decode(ctx, placed) == 0
    llama_cpp.llama_get_logits(ctx)
    snaps.append(ext.stats(ctx))
decode([(0, 500)])          # prefill: two ubatches of one prompt
decode([(0, 100)])          # prefill
decode([(0, 1)])            # decode
decode([(0, 1)])            # decode
decode([(0, 1), (1, 300)])  # mixed: a decode token beside a new prompt's chunk
decode([(0, 1), (1, 1)])    # decode
print(json.dumps({"snaps": snaps, "wall_ms": (time.perf_counter() - t0) * 1000}))
"""

KINDS = ["prefill", "prefill", "decode", "decode", "mixed", "decode"]
TOKENS = [(500, 0), (100, 0), (0, 1), (0, 1), (300, 1), (0, 2)]  # (prompt, decode) tokens of each evaluation


def _run(build, model, kw):
    return run_python(LIB_PRELUDE + _BODY, build.lib_dir, timeout=600,
                      env_extra={"RKV_TEST_MODEL": str(model), "RKV_TEST_KW": json.dumps(kw)})


@pytest.fixture(scope="module", params=[dict(mode="window", window_cells=256, windows="static"), dict(mode="off")],
                ids=["split", "resident"])
def run(request, cpu_build, demo_model):
    return request.param, _run(cpu_build, demo_model, request.param)


def _delta(a: dict, b: dict) -> dict:
    return {k: {f: b["evals"][k][f] - a["evals"][k][f] for f in b["evals"][k]} for k in ("decode", "prefill", "mixed")}


def test_each_evaluation_is_counted_once_by_kind_with_its_tokens_and_time(run):
    kw, r = run
    snaps = r["snaps"]
    assert "evals" in snaps[0], f"no evaluation counters in the stats: {sorted(snaps[0])}"
    assert all(v["evals"] == 0 for k, v in snaps[0]["evals"].items() if k != "decode_by_seqs")  # nothing decoded yet
    for i, (kind, (prompt, dec)) in enumerate(zip(KINDS, TOKENS)):
        d = _delta(snaps[i], snaps[i + 1])
        assert d[kind]["evals"] == 1 and sum(v["evals"] for v in d.values()) == 1, (i, d)
        assert (d[kind]["prompt_tokens"], d[kind]["decode_tokens"]) == (prompt, dec), (i, d[kind])
        assert d[kind]["ms"] > 0, (i, d[kind])
    # the decode evaluations again by their sequences: two of one, one of two
    by = snaps[-1]["evals"]["decode_by_seqs"]
    assert len(by) == 8 and [b["evals"] for b in by] == [2, 1, 0, 0, 0, 0, 0, 0]
    assert [b["decode_tokens"] for b in by[:2]] == [2, 2]
    assert sum(b["ms"] for b in by) == pytest.approx(snaps[-1]["evals"]["decode"]["ms"], abs=0.01)
    total_ms = sum(v["ms"] for k, v in snaps[-1]["evals"].items() if k != "decode_by_seqs")
    assert 0 < total_ms <= r["wall_ms"]  # timed inside the calls that queued and synchronized them


def test_a_split_cache_counters_are_split_among_the_kinds(run):
    kw, r = run
    last = r["snaps"][-1]
    ev = {k: last["evals"][k] for k in ("decode", "prefill", "mixed")}
    if kw["mode"] == "off":
        assert not last["split"] and all(v["steps"] == 0 and v["tail_bytes"] == 0 for v in ev.values())
        return
    assert last["split"]
    # every ubatch that attended a tail belongs to one evaluation, and so do its bytes
    assert sum(v["steps"] for v in ev.values()) == last["steps"] > 0
    assert sum(v["tail_bytes"] for v in ev.values()) == last["tail_bytes_total"]
    assert sum(v["streamed_bytes"] for v in ev.values()) == last["streamed_bytes_total"]
    # the first prompt spills past the 256-cell window in its second ubatch: every kind read the tail after that
    assert ev["decode"]["steps"] == 3 and ev["mixed"]["steps"] >= 1 and ev["prefill"]["steps"] >= 2
    assert all(v["tail_bytes"] > 0 for v in ev.values())
