"""Hybrid models (recurrent + attention layers, llama_memory_hybrid) on the CPU build: the attention layers' cache splits
into window and tail like a dense model's, the recurrent state stays whole; both families the pin runs that
`model synth` writes (qwen35: gated delta net, lfm2: short convolutions), each 4 layers of which 1 and 3 attend.

(Not the "hybrid tail", the CPU part of a GPU's tail: tests/test_hybrid_tail.py.)

The split must be invisible: teacher-forced logits bit-identical to the resident cache's (with a batch that straddles the
window, and four sequences side by side), a sequence's state saved from a spilled context loads into any split, a
rollback (seq_rm of the last tokens) and a whole sequence's removal followed by more decoding give the resident run's
logits bit for bit, and llama-server shifts the context of a spilled LFM2 model as it does a resident one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import LIB_PRELUDE, assert_reference_resident, run_python

pytestmark = pytest.mark.build

ARCHES = ("qwen35", "lfm2")
SHAPE = dict(layers=4, embd=256, heads=4, kv_heads=2, ff=512, vocab=1000, ctx=4096, attn_interval=2)
ATTN, RECR = [1, 3], [0, 2]
ROW = 2 * 64 * 2  # one attention layer's K (or V) row: 2 KV heads x 64, f16


def _recurrent_bytes(arch: str, n_seq: int = 1, n_rs_seq: int = 0, **shape) -> int:
    """The recurrent state as llama_memory_recurrent allocates it (f32 r and s rows, n_seq x (1 + n_rs_seq) cells per
    recurrent layer), from the shape alone: n_embd_r = (d_conv - 1) x conv channels, n_embd_s = d_state x d_inner
    (qwen35); (L - 1) x n_embd and none (lfm2)."""
    s = {**SHAPE, **shape}
    if arch == "qwen35":
        d_state = s.get("ssm_state") or s["embd"] // s["heads"]
        groups, vheads = s.get("ssm_groups") or s["kv_heads"], s.get("ssm_heads") or s["heads"]
        d_inner = d_state * vheads
        per_layer = 4 * ((4 - 1) * (d_inner + 2 * groups * d_state) + d_state * d_inner)
    else:
        per_layer = 4 * (3 - 1) * s["embd"]
    return len(RECR) * per_layer * n_seq * (1 + n_rs_seq)


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory) -> dict:
    from rollingkv_cli import models

    d = tmp_path_factory.mktemp("hybrid")
    return {arch: models.write_synthetic(d / f"{arch}.gguf", models.SynthSpec(**SHAPE, arch=arch)) for arch in ARCHES}


_PRELUDE = LIB_PRELUDE + """import numpy as np
model = llama_cpp.llama_model_load_from_file(os.environ["RKV_TEST_MODEL"].encode(), llama_cpp.llama_model_default_params())
assert model
n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
def cparams(n_ctx=2048, n_seq=1, unified=True, n_rs_seq=0, n_batch=512):
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = n_ctx; cp.n_batch = n_batch; cp.n_ubatch = n_batch; cp.flash_attn_type = 1
    cp.n_threads = 2; cp.n_threads_batch = 2; cp.n_seq_max = n_seq; cp.kv_unified = unified; cp.n_rs_seq = n_rs_seq
    return cp
def new(kw, **cp):
    ctx = ext.init_context(model, cparams(**cp), ext.make_params(**kw))
    assert ctx, ext.last_error()
    return ctx
def toks(n, seed=0):
    return [(i * 37 + 11 + 101 * seed) % 700 + 260 for i in range(n)]
def feed(ctx, seqs, pos0=0):
    # seqs: {seq_id: tokens}, positions from pos0 (an int, or {seq_id: pos0}); the logits of every sequence's last token
    n = sum(len(t) for t in seqs.values())
    b = llama_cpp.llama_batch_init(n, 0, 1)
    j = 0
    rows = {}
    for s, ts in seqs.items():
        p0 = pos0[s] if isinstance(pos0, dict) else pos0
        for i, t in enumerate(ts):
            b.token[j] = t; b.pos[j] = p0 + i; b.n_seq_id[j] = 1; b.seq_id[j][0] = s; b.logits[j] = i == len(ts) - 1
            if i == len(ts) - 1:
                rows[s] = j
            j += 1
    b.n_tokens = n
    rc = llama_cpp.llama_decode(ctx, b)
    llama_cpp.llama_batch_free(b)
    assert rc == 0, rc
    return {s: np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, r), shape=(n_vocab,)).copy() for s, r in rows.items()}
def feed_long(ctx, seq, tokens, pos0=0, step=96):
    out = None
    for i in range(0, len(tokens), step):
        out = feed(ctx, {seq: tokens[i:i + step]}, pos0 + i)[seq]
    return out
def same(a, b):
    return bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))
"""


def _py(cpu_build, model, body: str) -> dict:
    return run_python(_PRELUDE + body, cpu_build.lib_dir, env_extra={"RKV_TEST_MODEL": str(model)}, timeout=300)


# ------------------------------------------------------------------------------------------- the plan


@pytest.mark.parametrize("arch", ARCHES)
def test_plan_splits_the_attention_layers_only(cpu_build, hybrid_models, arch):
    """Window mode: the plan's layers are the attention layers, split; the recurrent layers are listed apart, with the
    bytes their state takes (what llama_memory_recurrent then allocates), counted in the budget next to the window. Off:
    the plan reports the same layers, nothing split. Auto without a target on a CPU: resident."""
    r = _py(cpu_build, hybrid_models[arch], """
out = {}
for name, kw in {"window": dict(mode="window", window_cells=256), "off": dict(mode="off"), "auto": dict(mode="auto")}.items():
    logs.clear()
    ctx = new(kw, n_ctx=2048)
    rs = re.search(r"RS buffer size = +([0-9.]+) MiB", "".join(logs))
    out[name] = {"plan": ext.plan(ctx), "rs_mib": float(rs.group(1)) if rs else None}
    llama_cpp.llama_free(ctx)
print(json.dumps(out))
""")
    recr = _recurrent_bytes(arch)
    w = r["window"]["plan"]
    assert w["split"] and w["mode_chosen"] == "window" and w["window_cells"] == 256 and w["tail_cells"] == 2048 - 256
    assert [layer["il"] for layer in w["layers"]] == ATTN and all(layer["split"] for layer in w["layers"])
    assert w["host_bytes"] == len(ATTN) * 2 * (2048 - 256 + 1) * ROW  # K and V tails, one trash row each
    assert w["recurrent"] == {"split": False, "layers": RECR, "bytes": recr}
    assert r["window"]["rs_mib"] == pytest.approx(recr / 2**20, abs=0.006)  # the recurrent memory's own log, %.2f MiB
    assert w["budget"]["recurrent_bytes"] == w["budget"]["other_kv_bytes"] == recr
    d = w["budget"]["devices"][0]
    assert d["recurrent_bytes"] == recr and d["kv_budget_bytes"] == d["avail_bytes"] - d["compute_bytes"] - d["other_kv_bytes"] - d["ring_bytes"]
    off = r["off"]["plan"]
    assert not off["split"] and off["mode_chosen"] == "off" and [layer["il"] for layer in off["layers"]] == ATTN
    assert off["recurrent"]["layers"] == RECR and off["host_bytes"] == 0
    auto = r["auto"]["plan"]
    assert not auto["split"] and auto["mode_chosen"] == "resident" and "no GPU and no vram_target" in auto["reason"]


def test_vram_target_counts_the_recurrent_state(cpu_build, tmp_path):
    """Auto with a vram_target on the CPU (the budget is host memory): the recurrent state comes off the budget before the
    window. A qwen35 model with a 1 MiB state per recurrent layer and sequence: at the target where its whole KV just fits
    with one sequence, eight sequences (unified: the same KV cache, 14 MiB more recurrent state) do not fit, and the
    window is the largest that fits the rest."""
    from rollingkv_cli import models

    shape = dict(ssm_state=128, ssm_heads=16, ssm_groups=2)
    model = models.write_synthetic(tmp_path / "q35big.gguf", models.SynthSpec(**SHAPE, arch="qwen35", **shape))
    r = _py(cpu_build, model, """
out = {}
ctx = new(dict(mode="auto", vram_target_mib=100000), n_ctx=65536, n_seq=1)
big = ext.plan(ctx); llama_cpp.llama_free(ctx)
d = big["budget"]["devices"][0]
fit_mib = -(-(d["weights_bytes"] + d["compute_bytes"] + d["other_kv_bytes"] + d["kv_resident_bytes"]) // 2**20)
for n_seq in (1, 8):
    ctx = new(dict(mode="auto", vram_target_mib=fit_mib), n_ctx=65536, n_seq=n_seq)
    out[str(n_seq)] = ext.plan(ctx)
    llama_cpp.llama_free(ctx)
out["fit_mib"] = fit_mib
print(json.dumps(out))
""")
    one, eight = r["1"], r["8"]
    assert one["mode_chosen"] == "resident" and "fits" in one["reason"]
    assert one["budget"]["recurrent_bytes"] == _recurrent_bytes("qwen35", 1, **shape)
    assert eight["budget"]["recurrent_bytes"] == _recurrent_bytes("qwen35", 8, **shape) > 14 * 2**20
    assert eight["split"] and eight["mode_chosen"] == "window" and eight["budget"]["budgeted"]
    d = eight["budget"]["devices"][0]
    assert d["other_kv_bytes"] == d["recurrent_bytes"] and d["kv_budget_bytes"] == d["avail_bytes"] - d["compute_bytes"] - d["other_kv_bytes"]
    assert d["cell_bytes"] == len(ATTN) * 2 * ROW
    assert eight["window_cells"] == (d["kv_budget_bytes"] // d["cell_bytes"] - 1) // 256 * 256 and 0 < eight["window_cells"] < 65536
    assert [layer["il"] for layer in eight["layers"]] == ATTN


# ------------------------------------------------------------------------------------------- gate equiv


def _gate(cpu_build, model, tmp_path, *args, env_extra=None):
    out = tmp_path / "gate.json"
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), **(env_extra or {})}
    env.pop("LLAMA_CPP_LIB_PATH", None)
    if not env_extra:
        env.pop("ROLLINGKV_DEBUG_PERTURB_TAIL", None)
    proc = subprocess.run([sys.executable, "-m", "rollingkv_cli", "gate", "equiv", "--model", str(model), "--threads", "2",
                           "--json", str(out), *args], capture_output=True, text=True, timeout=600, env=env)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.parametrize("arch", ARCHES)
def test_gate_equiv_bit_identical(cpu_build, hybrid_models, tmp_path, arch):
    """1024 tokens in batches of 96 through a 256-cell window (the batch at 192..287 straddles it): every position's
    logits equal the resident run's bit for bit, 768 positions read the tail."""
    proc, r = _gate(cpu_build, hybrid_models[arch], tmp_path, "--synthetic-tokens", "1024", "--ctx", "1280", "--n-batch", "96",
                    "--kv-window-cells", "256")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = r["candidate"]["plan"]
    assert plan["split"] and [layer["il"] for layer in plan["layers"]] == ATTN and plan["recurrent"]["layers"] == RECR
    m = r["metrics"]
    assert m["n"] == 1024 and m["bitwise_identical"] and m["max_abs_logit_diff"] == 0.0 and m["nonfinite"] == 0
    assert r["tail_positions"] == 1024 - 256
    assert_reference_resident(r)


@pytest.mark.parametrize("arch", ARCHES)
def test_gate_equiv_fails_on_a_perturbed_tail(cpu_build, hybrid_models, tmp_path, arch):
    """The gate can fail on a hybrid model: every tail score x (1 + 1.2e-7), the smallest f32 change, breaks the
    bit-identity of positions that read the tail (the recurrent layers carry the change to every later position)."""
    proc, r = _gate(cpu_build, hybrid_models[arch], tmp_path, "--synthetic-tokens", "512", "--ctx", "768", "--n-batch", "96",
                    "--kv-window-cells", "256", env_extra={"ROLLINGKV_DEBUG_PERTURB_TAIL": "1.2e-7"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["verdict"] == "fail" and "bitwise" in r["failed_checks"]
    assert r["metrics"]["bitwise_equal_rows"] < 512 and r["candidate"]["plan"]["split"]


@pytest.mark.parametrize("arch", ARCHES)
def test_gate_equiv_four_sequences_bit_identical(cpu_build, hybrid_models, tmp_path, arch):
    """Four sequences side by side in one unified cache (llama-server's --parallel 4), each with its own recurrent state:
    their attention cells interleave in the window and the tail; bit-identical to the resident run."""
    proc, r = _gate(cpu_build, hybrid_models[arch], tmp_path, "--synthetic-tokens", "1024", "--ctx", "1280", "--n-seq", "4",
                    "--n-batch", "96", "--kv-window-cells", "256")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["n_seq"] == 4 and r["candidate"]["plan"]["split"]
    assert r["metrics"]["bitwise_identical"] and r["metrics"]["n"] == 1024 and r["tail_positions"] > 0
    assert_reference_resident(r)


# ------------------------------------------------------------------------------------------- state, seq_rm


@pytest.mark.parametrize("arch", ARCHES)
def test_sequence_state_round_trip_across_splits(cpu_build, hybrid_models, arch):
    """A sequence of 700 tokens decoded through a 256-cell window (444 cells in the tail), its state saved (recurrent state
    + the split attention cache, llama_state_seq_get_data): loaded into the same split, another window, the resident cache
    and another sequence id, the next token's logits are the original context's, bit for bit. The whole context's state
    too. Saved, the state has the bytes the resident cache writes for the same tokens. The check can fail: the same state
    with one byte of the last token's key (a tail row) flipped gives other logits."""
    r = _py(cpu_build, hybrid_models[arch], """
t = toks(701)
W = dict(mode="window", window_cells=256)
def seq_state(kw, tokens):
    a = new(kw, n_seq=2)
    feed_long(a, 0, tokens)
    size = llama_cpp.llama_state_seq_get_size(a, 0)
    buf = (ctypes.c_uint8 * size)()
    assert llama_cpp.llama_state_seq_get_data(a, buf, size, 0) == size
    return a, buf, size
a, buf, size = seq_state(W, t[:700])
full = llama_cpp.llama_state_get_size(a)
fbuf = (ctypes.c_uint8 * full)()
assert llama_cpp.llama_state_get_data(a, fbuf, full) == full
ref = feed(a, {0: t[700:701]}, 700)[0]
llama_cpp.llama_free(a)
res = {}
b, rbuf, rsize = seq_state(dict(mode="off"), t[:700])
llama_cpp.llama_free(b)
same_bytes = rsize == size and bytes(rbuf) == bytes(buf)
# the first row of bytes that differs with another last token: the attention part comes first, so it is the first
# attention layer's key row of cell 699 (in the tail); a cell's metadata may differ in a byte or two (qwen35's M-RoPE)
b, obuf, osize = seq_state(W, t[:699] + [t[699] + 1])
llama_cpp.llama_free(b)
diffs = np.flatnonzero(np.frombuffer(bytes(buf), np.uint8) != np.frombuffer(bytes(obuf), np.uint8))
first_diff = int(next(i for k, i in enumerate(diffs) if k + 64 < len(diffs) and diffs[k + 64] < i + 256))
bad = (ctypes.c_uint8 * size).from_buffer_copy(bytes(buf))
bad[first_diff] ^= 0x40
def load(kw, seq, data, n_data):
    c = new(kw, n_seq=2)
    n = llama_cpp.llama_state_seq_set_data(c, data, n_data, seq)
    mem = llama_cpp.llama_get_memory(c)
    got = feed(c, {seq: t[700:701]}, 700)[seq] if n else None
    out = {"loaded": n == n_data, "pos_max": llama_cpp.llama_memory_seq_pos_max(mem, seq) if n else None,
           "exact": bool(got is not None and same(got, ref)), "split": ext.plan(c)["split"]}
    llama_cpp.llama_free(c)
    return out
for name, kw, seq in (("same", W, 0), ("other_window", dict(mode="window", window_cells=512), 0), ("resident", dict(mode="off"), 0),
                      ("other_seq", W, 1), ("other_seq_resident", dict(mode="off"), 1)):
    res[name] = load(kw, seq, buf, size)
for name, kw in (("full_other_window", dict(mode="window", window_cells=512)), ("full_resident", dict(mode="off"))):
    c = new(kw, n_seq=2)
    n = llama_cpp.llama_state_set_data(c, fbuf, full)
    res[name] = {"loaded": n == full, "exact": bool(n and same(feed(c, {0: t[700:701]}, 700)[0], ref))}
    llama_cpp.llama_free(c)
control = load(W, 0, bad, size)
print(json.dumps({"loads": res, "same_bytes": same_bytes, "control": control, "first_diff": first_diff, "size": size}))
""")
    for name, got in r["loads"].items():
        assert got["loaded"] and got["exact"], (name, got)
    for name in ("same", "other_window", "other_seq"):
        assert r["loads"][name]["split"] and r["loads"][name]["pos_max"] == 700, (name, r["loads"][name])
    assert not r["loads"]["resident"]["split"]
    assert r["same_bytes"]
    assert r["control"]["loaded"] and not r["control"]["exact"], r


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("placement", ["upstream", "sequences"])
def test_rollback_and_sequence_removal_equal_resident(cpu_build, hybrid_models, arch, placement):
    """seq_rm where the pin supports it on a hybrid memory, spilled vs resident, bit for bit:
    - a rollback of the last 3 of 600 tokens (n_rs_seq 4: the recurrent snapshots), tail cells then rewritten with other
      tokens; a rollback past the snapshots is refused (false) by both;
    - a whole sequence removed from a unified cache of three and a new one decoded into its freed cells, then both
      continued: placed as upstream places, the freed cells lie in the window and the tail interleaved with the surviving
      sequence's; placed by sequence (the split's default), each sequence's in blocks of its own, and the resident cache
      is placed alike (its rounding follows the cells' order)."""
    r = _py(cpu_build, hybrid_models[arch], f"PLACEMENT = {placement!r}\n" + """
def run(kw):
    kw = dict(kw, placement=PLACEMENT)
    out = {}
    c = new(kw, n_seq=1, n_rs_seq=4, n_ctx=1024)
    mem = llama_cpp.llama_get_memory(c)
    t = toks(600)
    feed_long(c, 0, t, step=100)
    out["too_far"] = bool(llama_cpp.llama_memory_seq_rm(mem, 0, 590, -1))
    out["rollback"] = bool(llama_cpp.llama_memory_seq_rm(mem, 0, 597, -1))
    out["pos_max"] = llama_cpp.llama_memory_seq_pos_max(mem, 0)
    after = feed(c, {0: toks(5, seed=3)}, 597)[0]
    llama_cpp.llama_free(c)
    c = new(kw, n_seq=3, n_ctx=2048)
    mem = llama_cpp.llama_get_memory(c)
    a, b = toks(400, seed=1), toks(400, seed=2)
    for i in range(0, 400, 80):
        feed(c, {0: a[i:i + 80], 1: b[i:i + 80]}, i)
    removed = bool(llama_cpp.llama_memory_seq_rm(mem, 0, -1, -1))
    n = toks(300, seed=5)
    rows = []
    for i in range(0, 300, 60):
        got = feed(c, {2: n[i:i + 60], 1: toks(60, seed=6 + i)}, {2: i, 1: 400 + i})
        rows += [got[2], got[1]]
    llama_cpp.llama_free(c)
    return out, after, removed, rows
o_s, after_s, removed_s, rows_s = run(dict(mode="window", window_cells=256))
o_r, after_r, removed_r, rows_r = run(dict(mode="off"))
print(json.dumps({"split": o_s, "resident": o_r, "after_exact": same(after_s, after_r), "removed": [removed_s, removed_r],
                  "rows_exact": all(same(x, y) for x, y in zip(rows_s, rows_r)), "n_rows": len(rows_s)}))
""")
    for run in ("split", "resident"):
        assert r[run] == {"too_far": False, "rollback": True, "pos_max": 596}, r
    assert r["after_exact"] and r["removed"] == [True, True] and r["rows_exact"] and r["n_rows"] == 10


# ------------------------------------------------------------------------------------------- llama-server


def test_server_context_shift_lfm2_window_equals_resident(cpu_build, hybrid_models, tmp_path, monkeypatch):
    """LFM2 (NEOX RoPE: its attention cache can shift) generating past a 512-cell context with --context-shift: seq_rm of
    the discarded positions from the recurrent and the attention memory, the K-shift of every kept key in the window and
    in the tail, cells reused out of order. Greedy output equals the resident server's; the shift happened; /props names
    only the attention layers as split. The comparison can fail: with every tail score doubled
    (ROLLINGKV_DEBUG_PERTURB_TAIL=1) the split server's answer differs from its second token on."""
    from rollingkv_cli.lib.text import synthetic_text
    from rollingkv_cli.serve.server import ServerProcess

    prompt = synthetic_text(100)  # ~2 tokens per character with the synthetic byte vocabulary
    outs, props = {}, {}
    monkeypatch.delenv("ROLLINGKV_DEBUG_PERTURB_TAIL", raising=False)
    window = ["--kv-residency-mode", "window", "--kv-window-cells", "128"]
    for name, extra in (("resident", ["--kv-residency-mode", "off"]), ("window", window), ("perturbed", window)):
        if name == "perturbed":
            monkeypatch.setenv("ROLLINGKV_DEBUG_PERTURB_TAIL", "1")
        with ServerProcess(cpu_build.artifact("llama-server"),
                           ["-m", str(hybrid_models["lfm2"]), "-fa", "on", "-t", "2", "-c", "512", "-np", "1", "--context-shift", *extra],
                           log_path=tmp_path / f"{name}.log") as srv:
            r = srv.request("/completion", {"prompt": prompt, "n_predict": 450, "temperature": 0, "seed": 0, "ignore_eos": True,
                                            "n_keep": 32, "cache_prompt": False}, timeout=600)
            outs[name] = r["content"]
            assert r["tokens_predicted"] == 450 and 100 < r["tokens_evaluated"] < 512 - 32
            props[name] = srv.request("/props")["rolling_kv"]
        assert "context shift" in (tmp_path / f"{name}.log").read_text(), "the generation must run past the context"
    w = props["window"]
    assert w["split"] and w["window_cells"] == 128 and [layer["il"] for layer in w["layers"]] == ATTN
    assert all(layer["split"] for layer in w["layers"]) and w["recurrent"] == {"split": False, "layers": RECR, "bytes": _recurrent_bytes("lfm2")}
    assert not props["resident"]["split"]
    assert outs["window"] == outs["resident"]
    assert outs["perturbed"] != outs["resident"]
