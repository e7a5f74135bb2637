"""One unified cache (llama-server's default: every slot's sequence in one stream) split by window: each ubatch attends,
and on a GPU streams, only the tail blocks that hold a cell of one of its sequences (the op's tail runs). Teacher-forced
logits on the demo model against the resident unified cache under the same batches, bit for bit, while the stats show
that a new sequence's prefill and a lone sequence's decode read less than the whole tail.

It can fail: the CPU forward treats a tail cell outside the runs as masked, so runs that left out a block some sequence
of the ubatch reads change the logits (seen failing with llama_rkv_tail_runs made to skip the block of a ubatch's first
sequence; the op test's --runs-wrong cases fail the same way at the op level: tests/test_ops_must_fail.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import LIB_PRELUDE, run_python
from test_gpu import cuda_build, synth_model  # noqa: F401 (the GPU tests' fixtures: skipped without a GPU and a CUDA build)

pytestmark = pytest.mark.build

# _SCENARIO: a unified cache of 4096 cells, window 256. Sequences 0, 1 and 2 are prefilled one after the other
# (ubatches of 256 tokens: their cells follow each other, mostly in the tail), then decoded alone and together;
# sequence 1 is removed (a hole in the middle of the tail) and sequence 3 prefilled into the freed cells; then everyone
# decodes. Logits of the last four tokens of every prefill and of every decode step are kept (every scenario).
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
toks = [[(i * 37 + 11 + 101 * s) % 20000 + 100 for i in range(3000)] for s in range(4)]
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
#SCENARIO
np.save(os.environ["RKV_TEST_OUT"], np.concatenate(logits))
print(json.dumps({"plan": ext.plan(ctx), "steps": steps}))
"""

_SCENARIO = """
prefill(0, 700)
prefill(1, 600)
prefill(2, 300)
for _ in range(3):
    step("decode 1", [1])
for _ in range(3):
    step("decode 0 2", [0, 2])
for _ in range(2):
    step("decode 0 1 2", [0, 1, 2])
mem = llama_cpp.llama_get_memory(ctx)
assert llama_cpp.llama_memory_seq_rm(mem, 1, -1, -1)
pos[1] = 0
for _ in range(2):
    step("decode 0 2 (a hole)", [0, 2])
prefill(3, 400)
for _ in range(2):
    step("decode 0 2 3", [0, 2, 3])
"""

# Sequences 0 and 1 take turns, 256 tokens each (a context of 8192): 0 in the window, then the tail's blocks alternate
# 1, 0, 1, 0 ... for ten turns each, so a lone sequence's blocks lie apart: ten and eleven runs, more than the op
# takes (GGML_RKV_MAX_TAIL_RUNS), so the closest are joined
_TURNS = 10
_ALTERNATING = f"""
prefill(0, 256)
for _ in range({_TURNS}):
    prefill(1, 256)
    prefill(0, 256)
for _ in range(2):
    step("decode 0", [0])
for _ in range(2):
    step("decode 1", [1])
step("decode 0 1", [0, 1])
"""


def _run(build, model, tmp_path, name, kw, ngl=0, ubatch=256, scenario=_SCENARIO, n_ctx=4096, **env):
    out = tmp_path / f"{name}.npy"
    body = _BODY.replace("cp.n_ubatch = 256", f"cp.n_ubatch = {ubatch}").replace("#SCENARIO\n", scenario)
    body = body.replace("cp.n_ctx = 4096", f"cp.n_ctx = {n_ctx}")
    r = run_python(LIB_PRELUDE + body, build.lib_dir, timeout=900,
                   env_extra={"RKV_TEST_MODEL": str(model), "RKV_TEST_KW": json.dumps(kw), "RKV_TEST_OUT": str(out),
                              "RKV_TEST_NGL": str(ngl), **env})
    return r, np.load(out)


# static: the window stays [0, 256) (block residency, the default for a unified cache, moves blocks instead:
# tests/test_unified_blocks.py), so the runs below are those of the fixed layout; placed as upstream places (cells
# from the head, sequences side by side in every block): the layout the cells below describe
WINDOW = dict(mode="window", window_cells=256, windows="static", placement="upstream")


@pytest.fixture(scope="module")
def resident(cpu_build, demo_model, tmp_path_factory):
    return _run(cpu_build, demo_model, tmp_path_factory.mktemp("resident"), "resident", dict(mode="off"))


@pytest.fixture(scope="module")
def split(cpu_build, demo_model, tmp_path_factory):
    return _run(cpu_build, demo_model, tmp_path_factory.mktemp("split"), "split", WINDOW)


def test_tail_runs_equal_the_resident_unified_cache_bit_for_bit(resident, split):
    (ref_r, ref), (r, got) = resident, split
    assert ref_r["plan"]["mode_chosen"] == "off" and not ref_r["plan"]["split"]  # the reference is the upstream cache
    assert r["plan"]["split"] and r["plan"]["n_stream"] == 1  # one unified stream, split by window
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert np.array_equal(got, ref), f"max |diff| {np.abs(got - ref).max()}"


def test_a_ubatch_reads_only_its_sequences_blocks(split):
    """What each step attended of the tail (the cache's account of the op's runs) against the tail in use: a
    sequence's own prefill and a lone sequence's decode read less than the whole tail, a hole is read by no one, and
    a ubatch of every sequence reads all of it."""
    r, _ = split
    steps = r["steps"]
    cell = steps[-1]["stats"]["block_bytes"] // 256  # one tail cell of every layer (K and V)
    assert cell == 30 * 2 * 3 * 64 * 2

    def last(label, k=-1):
        return [s["stats"]["last"] for s in steps if s["label"] == label][k]

    # The cells (find_slot fills from the head): sequence 0 at 0-699, 1 at 700-1299, 2 at 1300-1599; the decodes at
    # 1600-1614; n_kv 1792 throughout, so the tail is [256, 1792): six blocks, b at cells [256 + 256 b, 512 + 256 b).
    # Sequence 2's prefill (its last ubatch, cells 1556-1599) reads blocks 4 and 5, not those of sequences 0 and 1
    p2 = last("prefill 2")
    assert (p2["tail_bytes"], p2["tail_runs"]) == ((1792 - 1280) * cell, 1), p2
    assert p2["occupied_bytes"] == (1600 - 256) * cell, p2
    # sequence 1 alone (cells 700-1299 and 1600-1602): blocks 1 to 5
    d1 = last("decode 1")
    assert (d1["tail_bytes"], d1["tail_runs"]) == ((1792 - 512) * cell, 1), d1
    # sequences 0 and 2 (cells 0-699, 1300-1599 and their decodes from 1603): blocks 0, 1, 4 and 5, not 2 and 3, which
    # only sequence 1 holds
    d02 = last("decode 0 2")
    assert (d02["tail_bytes"], d02["tail_runs"]) == ((1792 - 256 - 512) * cell, 2), d02
    # everyone: the whole tail (no runs)
    d012 = last("decode 0 1 2")
    assert (d012["tail_bytes"], d012["tail_runs"]) == ((1792 - 256) * cell, 0), d012
    # sequence 1 removed (the head goes back to 700): its blocks 2 and 3 are a hole no one reads
    hole = last("decode 0 2 (a hole)")
    assert (hole["tail_bytes"], hole["tail_runs"]) == ((1792 - 256 - 512) * cell, 2), hole
    # sequence 3's prefill lands in the hole (cells 704-1103): its last ubatch reads blocks 1 to 3 only
    p3 = last("prefill 3")
    assert (p3["tail_bytes"], p3["tail_runs"]) == ((1280 - 512) * cell, 1), p3
    d023 = last("decode 0 2 3")
    assert (d023["tail_bytes"], d023["tail_runs"]) == ((1792 - 256) * cell, 0), d023
    # each sequence's cells, device and tail, as the server shows them per slot
    seqs = {q["seq"]: q for q in steps[-1]["stats"]["seqs"]}
    assert sorted(seqs) == [0, 2, 3] and seqs[3]["device_cells"] == 0 and seqs[3]["tail_cells"] == 400 + 2
    assert seqs[0]["device_cells"] == 256 and seqs[0]["tail_cells"] == 700 - 256 + 3 + 2 + 2 + 2
    for s in steps:
        assert s["stats"]["last"]["streamed_bytes"] == 0  # a CPU build attends its tail in place


def test_a_perturbed_tail_is_caught(cpu_build, demo_model, tmp_path, resident):
    """Must-fail control: the comparison sees the tail the runs attend."""
    _, got = _run(cpu_build, demo_model, tmp_path, "perturbed", WINDOW, ROLLINGKV_DEBUG_PERTURB_TAIL="1e-3")
    assert not np.array_equal(got, resident[1])


@pytest.mark.gpu
def test_tail_runs_on_the_gpu_stream_only_the_runs(cuda_build, synth_model, tmp_path):
    """The same load offloaded, on the small synthetic model (head size 128, GQA 4) (the tail in pinned host memory, streamed; no CPU part): the logits within 2x the
    resident run's own distance to itself at another ubatch size, and at every step the bytes the CUDA copy plan
    issued (counted where the copies are planned) equal the cache's account of the runs' cells, less than the whole
    tail where the runs leave blocks out."""
    from test_gpu import _mean_tv

    _, ref = _run(cuda_build, synth_model, tmp_path, "resident", dict(mode="off"), ngl=99)
    _, floor_run = _run(cuda_build, synth_model, tmp_path, "floor", dict(mode="off"), ngl=99, ubatch=128)
    r, got = _run(cuda_build, synth_model, tmp_path, "split", dict(WINDOW, tail_cpu_frac=0), ngl=99)
    assert r["plan"]["split"] and r["plan"]["n_stream"] == 1
    assert np.isfinite(got).all() and got.shape == ref.shape
    tv, floor = _mean_tv(got, ref), _mean_tv(floor_run, ref)
    print(f"unified tail runs vs resident mean TV {tv:.3g}, the resident run's own floor {floor:.3g}")
    assert floor > 0 and tv <= 2 * floor, (tv, floor)
    short = 0
    for s in r["steps"]:
        st, last = s["stats"], s["stats"]["last"]
        assert st["plan_streamed"]["last_bytes"] == last["streamed_bytes"] == last["tail_bytes"], (s["label"], st)
        short += last["tail_runs"] > 0
    assert short >= 8  # the steps whose runs left blocks out (prefills, lone and joint decodes, the hole)


@pytest.mark.gpu
def test_the_cpu_part_takes_its_share_of_the_runs(cuda_build, synth_model, tmp_path):
    """With a CPU part (half of each tail), a ubatch that reads the tail in runs gives the CPU half of the cells it
    attends, to the nearest block (the far end of the tail, whose blocks of other sequences and holes it skips): taken
    of the whole tail instead, a lone sequence whose far end holds the others' cells left the CPU part little and the
    link the rest. The copy plan streams exactly the rest of the runs, the CPU parts ran, and the logits stay within the
    resident run's order floor."""
    from test_gpu import _mean_tv

    _, ref = _run(cuda_build, synth_model, tmp_path, "resident", dict(mode="off"), ngl=99)
    _, floor_run = _run(cuda_build, synth_model, tmp_path, "floor", dict(mode="off"), ngl=99, ubatch=128)
    r, got = _run(cuda_build, synth_model, tmp_path, "split", dict(WINDOW, tail_cpu_frac=0.5), ngl=99)
    tv, floor = _mean_tv(got, ref), _mean_tv(floor_run, ref)
    print(f"unified tail runs with a CPU part vs resident mean TV {tv:.3g}, the resident run's own floor {floor:.3g}")
    assert floor > 0 and tv <= 2 * floor, (tv, floor)
    cell = r["steps"][-1]["stats"]["block_bytes"] // 256
    checked = 0
    for s in r["steps"]:
        st, last = s["stats"], s["stats"]["last"]
        assert st["plan_streamed"]["last_bytes"] == last["streamed_bytes"], (s["label"], st)
        if s["label"].startswith("decode") and last["tail_runs"] > 0:
            cpu = (last["tail_bytes"] - last["streamed_bytes"]) // cell
            read = last["tail_bytes"] // cell
            assert abs(cpu - read / 2) <= 128, (s["label"], cpu, read)  # half of what it reads, to the nearest block
            checked += 1
    assert checked >= 5
    assert r["steps"][-1]["stats"]["cpu_part_runs"] > 0  # the CPU parts ran, on the device's behalf


@pytest.fixture(scope="module")
def alternating(cpu_build, demo_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("alternating")
    kw = dict(scenario=_ALTERNATING, n_ctx=8192)
    return (_run(cpu_build, demo_model, d, "resident", dict(mode="off"), **kw),
            _run(cpu_build, demo_model, d, "split", WINDOW, **kw))


def test_more_runs_than_the_op_takes_are_joined_exactly(alternating):
    """A lone sequence whose tail blocks alternate with another's: its runs past GGML_RKV_MAX_TAIL_RUNS (8) are joined
    where the gaps are smallest, reading the other's blocks between them (masked, so the logits stay those of the
    resident cache, bit for bit), and no more: with the limit at 4, as before, sequence 0 read 17 blocks, not 13."""
    (_, ref), (r, got) = alternating
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert np.array_equal(got, ref), f"max |diff| {np.abs(got - ref).max()}"
    steps = r["steps"]
    cell = steps[-1]["stats"]["block_bytes"] // 256

    def last(label):
        return [s["stats"]["last"] for s in steps if s["label"] == label][-1]

    # 5376 cells prefilled (window [0, 256): sequence 0; tail block b at [256 + 256 b, 512 + 256 b): sequence 1's for
    # even b < 20, sequence 0's for odd b), the four decodes in block 20: n_kv 5632, a tail of 21 blocks.
    # Sequence 0: blocks 1, 3, ..., 17 and 19-20, ten runs; the first three joined: 11 + 2 blocks in 8 runs
    d0 = last("decode 0")
    assert (d0["tail_bytes"], d0["tail_runs"]) == (13 * 256 * cell, 8), d0
    # sequence 1: blocks 0, 2, ..., 18 and 20, eleven runs; three joins: 11 + 3 blocks
    d1 = last("decode 1")
    assert (d1["tail_bytes"], d1["tail_runs"]) == (14 * 256 * cell, 8), d1
    # both: the whole tail, no runs
    d01 = last("decode 0 1")
    assert (d01["tail_bytes"], d01["tail_runs"]) == (21 * 256 * cell, 0), d01


# Placement by sequence (API 11: the default of a window split): _SCENARIO, then 200 steps of sequences 0, 2 and 3
# decoding side by side (one logit row a step), then sequence 2 alone. Placed as upstream places, their 600 new cells
# take turns in the same blocks; placed by sequence, each goes to the next free cell of its own newest block
_JOINT = _SCENARIO + """
for k in range(200):
    decode("joint 0 2 3", [(s, toks[s][pos[s]], s == 0) for s in (0, 2, 3)])
for _ in range(2):
    step("alone 2", [2])
"""
PLACED = dict(WINDOW, placement="auto")  # auto: by sequence for a window split


@pytest.fixture(scope="module")
def placed(cpu_build, demo_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("placed")
    kw = dict(scenario=_JOINT)
    return (_run(cpu_build, demo_model, d, "resident", dict(mode="off", placement="sequences"), **kw),
            _run(cpu_build, demo_model, d, "split", PLACED, **kw),
            _run(cpu_build, demo_model, d, "upstream", WINDOW, **kw))


def _read_beyond_own(step: dict, seqs: tuple[int, ...]) -> float:
    """Tail cells a step attended beyond the cells its sequences hold in the tail, in blocks (per layer). No cell of this
    load is shared, so the cache's own count of them (API 11's own_bytes) is their sum."""
    st = step["stats"]
    cell = st["block_bytes"] // 256
    own = sum(q["tail_cells"] for q in st["seqs"] if q["seq"] in seqs)
    assert st["last"]["own_bytes"] == own * cell, (step["label"], st["last"], st["seqs"])
    return (st["last"]["tail_bytes"] // cell - own) / 256


def test_placed_by_sequence_equals_a_resident_cache_placed_alike_bit_for_bit(placed):
    """A window split places each sequence's cells in blocks of its own by default (auto); a resident unified cache asked
    to place alike (placement sequences) gives the same logits, bit for bit, at every prefill and decode step."""
    (ref_r, ref), (r, got), _ = placed
    assert ref_r["plan"]["placement"] == {"requested": "sequences", "chosen": "sequences"} and not ref_r["plan"]["split"]
    assert r["plan"]["placement"] == {"requested": "auto", "chosen": "sequences"} and r["plan"]["split"]
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert np.array_equal(got, ref), f"max |diff| {np.abs(got - ref).max()}"


def test_placed_by_sequence_a_ubatch_reads_its_own_blocks(placed):
    """Each sequence's cells lie in blocks of its own, so what a ubatch attends of the tail is its sequences' cells and
    the rest of their newest blocks: at most one block per sequence beyond their own cells, at every step. Placed as
    upstream places, the joint decodes share blocks, and sequence 2 alone then reads the others' cells (it can fail)."""
    _, (r, _), (up, _) = placed
    seqs_of = {"decode 1": (1,), "decode 0 2": (0, 2), "decode 0 1 2": (0, 1, 2), "decode 0 2 (a hole)": (0, 2),
               "decode 0 2 3": (0, 2, 3), "joint 0 2 3": (0, 2, 3), "alone 2": (2,)}
    worst = {}
    for s in r["steps"]:
        if s["label"] in seqs_of:
            beyond = _read_beyond_own(s, seqs_of[s["label"]])
            assert beyond <= len(seqs_of[s["label"]]), (s["label"], beyond, s["stats"]["last"], s["stats"]["seqs"])
            worst[s["label"]] = max(worst.get(s["label"], 0), beyond)
    assert worst["alone 2"] < 1, worst
    # the server's own maximum over every ubatch (the prefills' first halves too, which no step above recorded)
    cell = r["steps"][-1]["stats"]["block_bytes"] // 256
    seen = max(s["stats"]["last"]["tail_bytes"] - s["stats"]["last"]["own_bytes"] for s in r["steps"])
    assert seen <= r["steps"][-1]["stats"]["beyond_own_bytes_max"] <= 3 * 256 * cell, (seen, r["steps"][-1]["stats"])
    alone_up = [_read_beyond_own(s, (2,)) for s in up["steps"] if s["label"] == "alone 2"]
    assert min(alone_up) >= 2, alone_up  # upstream's layout: sequence 2's decodes took turns with 0's and 3's
    # the same work either way: every sequence's cells, and no more of the cache in use
    last, last_up = r["steps"][-1]["stats"], up["steps"][-1]["stats"]
    cells = lambda st: {q["seq"]: q["device_cells"] + q["tail_cells"] for q in st["seqs"]}  # noqa: E731
    assert cells(last) == cells(last_up), (cells(last), cells(last_up))


def test_placed_by_sequence_is_the_same_as_upstream_for_one_sequence(cpu_build, demo_model, tmp_path):
    """One sequence fills the cells from the first as upstream does: a lone prompt's logits do not depend on the
    placement (each ubatch takes the next cells either way)."""
    scenario = "prefill(0, 900)\nfor _ in range(3):\n    step('decode 0', [0])\n"
    _, a = _run(cpu_build, demo_model, tmp_path, "one-placed", PLACED, scenario=scenario)
    _, b = _run(cpu_build, demo_model, tmp_path, "one-upstream", WINDOW, scenario=scenario)
    assert np.array_equal(a, b)
