"""Block residency in one unified cache (llama-server's default): the window is a pool of 256-cell slots, and between
ubatches the blocks the ubatch writes and reads take free slots, or the slots of blocks no one read lately (demoted to
their tail rows). Teacher-forced logits on the demo model after moves both ways are bit-identical to the resident
unified cache under the same batches (the op attends the logical keys in order through its block map), the stats count
the moves, and a move that gets one K row wrong is caught.

It can fail: a promotion that copies the wrong rows, a block map that does not follow the slots, a mask whose columns
are not those of the pool's and the tail's rows, or a CPU forward that attends in the physical order all change the
logits (the must-fail control below perturbs one row per promotion; the op test's --map-wrong cases swap two blocks of
the map: tests/test_ops_must_fail.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import LIB_PRELUDE, run_python
from test_gpu import cuda_build, synth_model  # noqa: F401 (the GPU tests' fixtures: skipped without a GPU and a CUDA build)

pytestmark = pytest.mark.build

# A unified cache of 4096 cells, window 768 (3 slots), ubatches of 256. Sequence 0 (300 tokens) and 1 (600) are
# prefilled and decode together; sequence 2 (500) is prefilled and decodes alone for 40 steps, long enough for the blocks
# only 0 and 1 read to go idle and give their slots up (demotions) to 2's; 0 and 1 come back and decode (their blocks
# promoted from the tail as slots free up: 2 is removed, a hole); sequence 3 is prefilled into the hole; everyone
# decodes. Logits of the last four tokens of every prefill and of every decode step are kept.
_BODY = """
import numpy as np
mp = llama_cpp.llama_model_default_params()
mp.n_gpu_layers = int(os.environ.get("RKV_TEST_NGL", "0"))
model = llama_cpp.llama_model_load_from_file(os.environ["RKV_TEST_MODEL"].encode(), mp)
cp = llama_cpp.llama_context_default_params()
cp.n_ctx = 4096; cp.n_batch = 512; cp.n_ubatch = 256; cp.flash_attn_type = 1
cp.n_threads = 2; cp.n_threads_batch = 2; cp.n_seq_max = 4; cp.kv_unified = True
kw = json.loads(os.environ["RKV_TEST_KW"])
ctx = ext.init_context(model, cp, ext.make_params(**kw))
assert ctx, ext.last_error()
n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
toks = [[(i * 37 + 11 + 101 * s) % 20000 + 100 for i in range(2000)] for s in range(4)]
pos = [0, 0, 0, 0]
logits, steps = [], []
def decode(label, items):  # items: (seq, token, want_logits); each item takes its sequence's next position
    placed = []
    for s, t, lg in items:
        placed.append((s, pos[s], t, lg))
        pos[s] += 1
    assert batch_decode(ctx, placed) == 0
    n_out = sum(1 for it in items if it[2])
    out = llama_cpp.llama_get_logits(ctx)
    logits.append(np.ctypeslib.as_array(out, shape=(n_out * n_vocab,)).copy())
    steps.append({"label": label, "stats": ext.stats(ctx)})
def prefill(s, n):
    for c0 in range(0, n, 512):
        c1 = min(n, c0 + 512)
        decode(f"prefill {s}", [(s, toks[s][pos[s]], i >= n - 4) for i in range(c0, c1)])
def step(label, seqs):
    decode(label, [(s, toks[s][pos[s]], True) for s in seqs])
prefill(0, 300)
prefill(1, 600)
for _ in range(3):
    step("decode 0 1", [0, 1])
prefill(2, 500)
for _ in range(40):
    step("decode 2", [2])
for _ in range(3):
    step("decode 0 1 again", [0, 1])
mem = llama_cpp.llama_get_memory(ctx)
assert llama_cpp.llama_memory_seq_rm(mem, 2, -1, -1)
pos[2] = 0
for _ in range(3):
    step("decode 0 1 (2 removed)", [0, 1])
prefill(3, 400)
for _ in range(3):
    step("decode 0 1 3", [0, 1, 3])
np.save(os.environ["RKV_TEST_OUT"], np.concatenate(logits))
print(json.dumps({"plan": ext.plan(ctx), "steps": steps}))
"""


# The same harness, another load: a prefix read by several sequences. Sequence 3 (768 tokens, blocks 0-2) fills the
# pool; sequence 0's 768 tokens (blocks 3-5) spill, and sequences 1 and 2 take them by seq_cp (llama-server's prefix
# sharing); then six rounds in which each sequence decodes one token in a ubatch of its own.
_SHARED_BODY = _BODY[: _BODY.index("prefill(0, 300)")] + """
prefill(3, 768)
prefill(0, 768)
mem = llama_cpp.llama_get_memory(ctx)
for s in (1, 2):
    llama_cpp.llama_memory_seq_cp(mem, 0, s, -1, -1)
    pos[s] = pos[0]
for r in range(6):
    for s in (0, 1, 2, 3):
        step(f"round {r} seq {s}", [s])
np.save(os.environ["RKV_TEST_OUT"], np.concatenate(logits))
print(json.dumps({"plan": ext.plan(ctx), "steps": steps}))
"""


def _run(build, model, tmp_path, name, kw, ngl=0, body=_BODY, **env):
    out = tmp_path / f"{name}.npy"
    r = run_python(LIB_PRELUDE + body, build.lib_dir, timeout=900,
                   env_extra={"RKV_TEST_MODEL": str(model), "RKV_TEST_KW": json.dumps(kw), "RKV_TEST_OUT": str(out),
                              "RKV_TEST_NGL": str(ngl), **env})
    return r, np.load(out)


# opt-in (API 7 windows 2); placed as upstream places (the layout the tests below describe; by sequence: the last test)
BLOCKS = dict(mode="window", window_cells=768, windows="blocks", placement="upstream")


@pytest.fixture(scope="module")
def resident(cpu_build, demo_model, tmp_path_factory):
    return _run(cpu_build, demo_model, tmp_path_factory.mktemp("resident"), "resident", dict(mode="off"))


@pytest.fixture(scope="module")
def placed_resident(cpu_build, demo_model, tmp_path_factory):
    """The resident unified cache placed by sequence, as a window split is by default (API 11)."""
    return _run(cpu_build, demo_model, tmp_path_factory.mktemp("placed"), "resident", dict(mode="off", placement="sequences"))


@pytest.fixture(scope="module")
def blocks(cpu_build, demo_model, tmp_path_factory):
    return _run(cpu_build, demo_model, tmp_path_factory.mktemp("blocks"), "blocks", BLOCKS)


def _moves(r):
    return r["steps"][-1]["stats"]["moves"]


def test_blocks_after_moves_both_ways_equal_the_resident_unified_cache_bit_for_bit(resident, blocks):
    (ref_r, ref), (r, got) = resident, blocks
    assert ref_r["plan"]["mode_chosen"] == "off" and not ref_r["plan"]["split"]  # the reference is the upstream cache
    assert r["plan"]["split"] and r["plan"]["n_stream"] == 1
    assert r["plan"]["windows"]["policy"] == "blocks" and r["plan"]["windows"]["requested"] == "blocks", r["plan"]["windows"]
    moves = _moves(r)
    # the path ran: blocks moved both ways
    assert moves["promoted_cells"] > 0 and moves["demoted_cells"] > 0 and moves["bytes"] > 0, moves
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert np.array_equal(got, ref), f"max |diff| {np.abs(got - ref).max()}"


def test_blocks_follow_the_load(blocks):
    """A new request's prefill lands on the device while its blocks fit; an idle sequence's blocks go to the host for an
    active one's; at every step the device holds at most the pool (3 slots of 256 cells)."""
    r, _ = blocks
    steps = r["steps"]
    seqs = lambda i: {q["seq"]: q for q in steps[i]["stats"]["seqs"]}  # noqa: E731
    first = [i for i, s in enumerate(steps) if s["label"] == "prefill 0"][-1]
    assert seqs(first)[0]["device_cells"] == 300 and seqs(first)[0]["tail_cells"] == 0
    # after 40 lone steps of sequence 2, its cells are all on the device and 0's and 1's idle blocks gave way
    lone = [i for i, s in enumerate(steps) if s["label"] == "decode 2"][-1]
    assert seqs(lone)[2]["tail_cells"] == 0, seqs(lone)
    assert _moves({"steps": steps[: lone + 1]})["demoted_cells"] > 0
    for i, s in enumerate(steps):
        assert sum(q["device_cells"] for q in s["stats"]["seqs"]) <= 3 * 256 * 2, (i, s["stats"]["seqs"])


def test_a_block_read_by_more_sequences_is_worth_more_on_the_device(cpu_build, demo_model, tmp_path):
    """A shared prefix takes the device from a private prompt (issue 37, 2). Sequence 3's blocks fill the pool and stay
    active; the prefix its three readers share spilled before they shared it. Once two of them are active, the prefix's
    blocks (more readers) take the slots of sequence 3's (one reader), and keep them: in the last round each reader's
    ubatch reads less of the tail than sequence 3's does, and no block moves in the last two rounds (the hysteresis).
    Bit-identical to the resident unified cache under the same ubatches.

    It can fail: the policy before readers counted (an active block never gave way to another active one) kept
    sequence 3's blocks on the device, so each of the prefix's readers streamed its 768 cells every step (seen failing
    on that build: each reader's ubatch read 1024 tail cells, the prefix and the block of new tokens, and sequence 3's
    256)."""
    _, ref = _run(cpu_build, demo_model, tmp_path, "shared-resident", dict(mode="off"), body=_SHARED_BODY)
    r, got = _run(cpu_build, demo_model, tmp_path, "shared-blocks", BLOCKS, body=_SHARED_BODY)
    assert r["plan"]["windows"]["policy"] == "blocks"
    assert got.shape == ref.shape and np.array_equal(got, ref), f"max |diff| {np.abs(got - ref).max()}"
    steps = {s["label"]: s["stats"] for s in r["steps"]}
    tail = {lb: st["last"]["tail_bytes"] for lb, st in steps.items() if lb.startswith("round 5")}
    prefix_before = steps["round 0 seq 0"]["last"]["tail_bytes"]  # the prefix spilled whole: its 768 cells + the new one
    assert prefix_before > 0
    for s in (0, 1, 2):
        assert tail[f"round 5 seq {s}"] < tail["round 5 seq 3"], tail
        assert tail[f"round 5 seq {s}"] < prefix_before / 2, (tail, prefix_before)
    seqs = {q["seq"]: q for q in steps["round 5 seq 3"]["seqs"]}
    assert seqs[0]["device_cells"] >= 512 and seqs[3]["tail_cells"] >= 768, seqs
    moves = lambda label: steps[label]["moves"]  # noqa: E731
    assert moves("round 5 seq 3")["promoted_cells"] == moves("round 4 seq 0")["promoted_cells"] > 0
    assert moves("round 5 seq 3")["demoted_cells"] == moves("round 4 seq 0")["demoted_cells"] > 0


def test_a_perturbed_move_is_caught(cpu_build, demo_model, tmp_path, resident):
    """Must-fail control: one K row written wrong by every promotion changes the logits."""
    r, got = _run(cpu_build, demo_model, tmp_path, "perturbed", BLOCKS, ROLLINGKV_DEBUG_PERTURB_MOVE="1")
    assert _moves(r)["promoted_cells"] > 0
    assert not np.array_equal(got, resident[1])


def test_blocks_placed_by_sequence_equal_a_resident_cache_placed_alike(cpu_build, demo_model, tmp_path, placed_resident):
    """Block residency with each sequence's cells in blocks of its own (auto's placement for a window split): the same
    load moves blocks both ways and stays bit-identical to a resident unified cache placed alike. Placed by sequence, an
    idle sequence's block holds no active one's cell, so the moves carry only what they are for: after sequence 2's lone
    steps, its blocks are all on the device and sequences 0's and 1's gave way."""
    ref = placed_resident[1]
    r, got = _run(cpu_build, demo_model, tmp_path, "placed-blocks", dict(BLOCKS, placement="auto"))
    assert r["plan"]["placement"]["chosen"] == "sequences" and r["plan"]["windows"]["policy"] == "blocks"
    moves = _moves(r)
    assert moves["promoted_cells"] > 0 and moves["demoted_cells"] > 0, moves
    assert got.shape == ref.shape and np.array_equal(got, ref), f"max |diff| {np.abs(got - ref).max()}"
    steps = r["steps"]
    lone = [i for i, s in enumerate(steps) if s["label"] == "decode 2"][-1]
    seqs = {q["seq"]: q for q in steps[lone]["stats"]["seqs"]}
    assert seqs[2]["tail_cells"] == 0 and seqs[2]["device_cells"] == 500 + 40, seqs
    assert steps[lone]["stats"]["last"]["tail_bytes"] <= steps[lone]["stats"]["block_bytes"], steps[lone]["stats"]["last"]


@pytest.mark.gpu
def test_blocks_on_the_gpu_move_both_ways_and_stream_only_host_blocks(cuda_build, synth_model, tmp_path):
    """The same load offloaded, on the small synthetic model: blocks move both ways through the device's copies, the
    logits stay within 2x the resident run's own distance to itself at another ubatch size (a GPU ignores the block map:
    it attends the pool's and the tail's keys in their own order, the mask hiding the stale ones), and at every step the
    bytes the CUDA copy plan issued equal the cache's account of the runs, which leave out the blocks on the device."""
    from test_gpu import _mean_tv

    _, ref = _run(cuda_build, synth_model, tmp_path, "resident", dict(mode="off"), ngl=99)
    floor_body = _BODY.replace("cp.n_ubatch = 256", "cp.n_ubatch = 128")
    out = tmp_path / "floor.npy"
    run_python(LIB_PRELUDE + floor_body, cuda_build.lib_dir, timeout=900,
               env_extra={"RKV_TEST_MODEL": str(synth_model), "RKV_TEST_KW": json.dumps(dict(mode="off")),
                          "RKV_TEST_OUT": str(out), "RKV_TEST_NGL": "99"})
    floor_run = np.load(out)
    r, got = _run(cuda_build, synth_model, tmp_path, "blocks", dict(BLOCKS, tail_cpu_frac=0), ngl=99)
    assert r["plan"]["windows"]["policy"] == "blocks"
    moves = _moves(r)
    assert moves["promoted_cells"] > 0 and moves["demoted_cells"] > 0, moves
    assert np.isfinite(got).all() and got.shape == ref.shape
    tv, floor = _mean_tv(got, ref), _mean_tv(floor_run, ref)
    print(f"unified blocks vs resident mean TV {tv:.3g}, the resident run's own floor {floor:.3g}; moves {moves}")
    assert floor > 0 and tv <= 2 * floor, (tv, floor)
    for s in r["steps"]:
        st, last = s["stats"], s["stats"]["last"]
        assert st["plan_streamed"]["last_bytes"] == last["streamed_bytes"] == last["tail_bytes"], (s["label"], st)


# ---------------------------------------------------------------------------------------------- quantized tails move too

N_VOCAB = 49152  # the demo model's


def _tv(a, b) -> np.ndarray:
    """Per-row total variation between the softmaxes of two runs' logits."""
    def sm(x):
        x = x.reshape(-1, N_VOCAB).astype(np.float64)
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    return 0.5 * np.abs(sm(a) - sm(b)).sum(axis=-1)


Q8 = dict(type_k_tail="q8_0", type_v_tail="q8_0")


@pytest.fixture(scope="module")
def static_q8(cpu_build, demo_model, tmp_path_factory):
    """The loss of a q8_0 tail without moves: the same load with the window kept static."""
    return _run(cpu_build, demo_model, tmp_path_factory.mktemp("static-q8"), "static-q8",
                dict(BLOCKS, windows="static", **Q8))


def test_quantized_blocks_move_within_the_loss_of_the_quantized_tail(cpu_build, demo_model, tmp_path, resident, static_q8):
    """A q8_0 tail: demotion quantizes a block into the tail's type, promotion dequantizes it. Against the resident
    cache the moves cost no more than the quantized tail itself does without them (mean TV at most 1.25x the static
    window's with the same tail), and a twin whose promotions write each block's K rows one cell off (an offset bug) is
    caught by that bound (measured: 0.96x and 1.72x)."""
    ref = resident[1]
    r, got = _run(cpu_build, demo_model, tmp_path, "blocks-q8", dict(BLOCKS, **Q8))
    assert r["plan"]["windows"]["policy"] == "blocks" and r["plan"]["type_k_tail"] == "q8_0"
    moves = _moves(r)
    assert moves["promoted_cells"] > 0 and moves["demoted_cells"] > 0, moves
    base = _tv(static_q8[1], ref).mean()
    tv = _tv(got, ref).mean()
    assert base > 0 and tv <= 1.25 * base, (tv, base)
    _, bad = _run(cpu_build, demo_model, tmp_path, "blocks-q8-offset", dict(BLOCKS, **Q8), ROLLINGKV_DEBUG_PERTURB_MOVE="2")
    assert _tv(bad, ref).mean() > 1.25 * base, (_tv(bad, ref).mean(), base)


def test_q4_0_blocks_move_within_the_gates_q4_0_bounds(cpu_build, demo_model, tmp_path, resident):
    """A q4_0 tail (what -ctkt auto picks where the link is slow): blocks still follow the load, within the equivalence
    gate's bounds for a q4_0 tail (gate/metrics.py: mean TV 0.2, p99 0.8, top-1 agreement 0.85). Its loss is too large
    for a one-cell offset to stand out (measured 0.110 against 0.118 mean TV): the q8_0 test above is the must-fail
    control of the conversion path both share."""
    r, got = _run(cpu_build, demo_model, tmp_path, "blocks-q4", dict(BLOCKS, type_k_tail="q4_0", type_v_tail="q4_0"))
    moves = _moves(r)
    assert r["plan"]["windows"]["policy"] == "blocks" and moves["promoted_cells"] > 0 and moves["demoted_cells"] > 0
    tv = _tv(got, resident[1])
    top1 = (got.reshape(-1, N_VOCAB).argmax(-1) == resident[1].reshape(-1, N_VOCAB).argmax(-1)).mean()
    assert tv.mean() <= 0.2 and np.percentile(tv, 99) <= 0.8 and top1 >= 0.85, (tv.mean(), np.percentile(tv, 99), top1)


def test_a_unified_cache_keeps_its_window_static_unless_blocks_are_asked_for(cpu_build, demo_model, tmp_path, placed_resident):
    """Block residency is opt-in: under a random mix on an H100 it was slower than the static window
    (docs/perf/2026-12-06-h100-unified-blocks). The default (elastic) request keeps a unified cache's window static,
    moves nothing, places each sequence's cells in blocks of its own, and stays bit-identical to the resident cache
    placed alike."""
    r, got = _run(cpu_build, demo_model, tmp_path, "default", dict(mode="window", window_cells=768))
    assert r["plan"]["windows"]["policy"] == "static" and r["plan"]["windows"]["requested"] == "elastic", r["plan"]["windows"]
    assert "--kv-windows blocks" in r["plan"]["windows"]["reason"]
    assert r["plan"]["placement"] == {"requested": "auto", "chosen": "sequences"}
    assert _moves(r)["promoted_cells"] == 0 and _moves(r)["demoted_cells"] == 0
    assert np.array_equal(got, placed_resident[1])
