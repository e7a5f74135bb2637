"""The head split (--kv-residency-mode head, issue 18) on the CPU build: each attention layer's first KV heads on the
"device" for every cell, the others in the tail tensors, attended by the streaming op with an empty window and
concatenated by head. On the CPU it must be invisible: teacher-forced logits bit-identical to the resident cache in
prefill batches (the tiled flash attention, n_q >= 64), decode steps (the split-KV path above 512 cells) and four
sequences side by side, on an iSWA model's global layers and on a hybrid model's attention layers; the gate fails on it
when the host heads' scores are perturbed by the smallest f32 step; a same-type state is the unsplit cache's bytes;
llama-server shifts its context as the resident cache does. The planner's arithmetic on given figures:
tests/test_planner.py; the op itself: tests/test_ops_must_fail.py (--heads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import LIB_PRELUDE, STATE_ROUND_TRIP, assert_reference_resident, run_python

pytestmark = pytest.mark.build

_PRELUDE = LIB_PRELUDE + """import numpy as np
model = llama_cpp.llama_model_load_from_file(os.environ["RKV_TEST_MODEL"].encode(), llama_cpp.llama_model_default_params())
def cparams(n_ctx=2048, n_seq=1):
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = n_ctx; cp.n_batch = 512; cp.n_ubatch = 512; cp.flash_attn_type = 1
    cp.n_threads = 2; cp.n_threads_batch = 2; cp.n_seq_max = n_seq
    return cp
def plan(p, **cp):
    ctx = ext.init_context(model, cparams(**cp), p)
    if not ctx:
        return {"refused": ext.last_error()}
    out = ext.plan(ctx)
    llama_cpp.llama_free(ctx)
    return out
"""


def _py(cpu_build, model, body: str) -> dict:
    return run_python(_PRELUDE + body, cpu_build.lib_dir, env_extra={"RKV_TEST_MODEL": str(model)})


def _gate(cpu_build, model, tmp_path, *args, env_extra=None):
    out = tmp_path / "gate.json"
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), **(env_extra or {})}
    env.pop("LLAMA_CPP_LIB_PATH", None)
    if out.exists():
        out.unlink()
    proc = subprocess.run([sys.executable, "-m", "rollingkv_cli", "gate", "equiv", "--model", str(model), "--threads", "2",
                           "--kv-residency-mode", "head", "--json", str(out), *args], capture_output=True, text=True, timeout=1200, env=env)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


# ------------------------------------------------------------------------------------------------ the plan

ROW = 64 * 2  # one KV head of the demo model (SmolLM2-135M: 30 layers, 3 KV heads of 64, 9 query heads), f16


def test_plan_and_refusals(cpu_build, demo_model):
    r = _py(cpu_build, demo_model, """
out = {}
for n in (1, 2, 3, 7):
    out[f"h{n}"] = plan(ext.make_params(mode="head", device_heads=n))
out["h1_q8"] = plan(ext.make_params(mode="head", device_heads=1, type_k_tail="q8_0", type_v_tail="q8_0"))
out["auto_n"] = plan(ext.make_params(mode="auto", device_heads=2))
out["budget"] = plan(ext.make_params(mode="head", vram_target_mib=300), n_ctx=8192)
out["auto_budget"] = plan(ext.make_params(mode="auto", vram_target_mib=300), n_ctx=8192)
out["no_target"] = plan(ext.make_params(mode="head"))
out["window_n"] = plan(ext.make_params(mode="window", window_cells=256, device_heads=1))
out["off_n"] = plan(ext.make_params(mode="off", device_heads=1))
out["head_wc"] = plan(ext.make_params(mode="head", window_cells=256))
out["auto_both"] = plan(ext.make_params(mode="auto", window_cells=256, device_heads=1))
p = ext.make_params(mode="head"); p.device_heads = -1
out["negative"] = plan(p)
print(json.dumps(out))
""")
    for n in (1, 2):
        p = r[f"h{n}"]
        assert p["mode_chosen"] == "head" and p["split"] and p["mode_requested"] == "head"
        assert p["heads"]["per_layer"] == [n] * 30 and p["heads"]["device"] == 30 * n and p["heads"]["host"] == 30 * (3 - n)
        assert p["heads"]["summary"] == f"{n} of 3 KV heads on the device, 30 of 30 layers split"
        assert len(p["layers"]) == 30
        for layer in p["layers"]:
            assert (layer["device_heads"], layer["host_heads"], layer["n_head_kv"]) == (n, 3 - n, 3) and layer["split"]
            # K and V, every cell of the device's heads / of the host's (no trash row: every token goes to both)
            assert layer["device_bytes"] == 2 * 2048 * n * ROW and layer["host_bytes"] == 2 * 2048 * (3 - n) * ROW
        assert p["window_cells"] == 0 and p["tail_cells"] == 2048
    q8 = r["h1_q8"]
    assert q8["type_k_tail"] == "q8_0" and q8["host_bytes"] == 30 * 2 * 2048 * 2 * (64 // 32 * 34)
    assert q8["device_bytes"] == r["h1"]["device_bytes"]
    for name in ("h3", "h7"):  # every head (or more) on the device: the resident cache
        assert r[name]["mode_chosen"] == "resident" and not r[name]["split"] and "resident" in r[name]["reason"]
    assert r["auto_n"]["mode_chosen"] == "head" and r["auto_n"]["heads"]["per_layer"] == [2] * 30
    b = r["budget"]
    assert b["mode_chosen"] == "head" and b["budget"]["budgeted"]
    h = b["heads"]["per_layer"]
    assert max(h) - min(h) <= 1 and 1 <= min(h) and max(h) <= 3 and h == sorted(h, reverse=True)
    d = b["budget"]["devices"][0]
    assert d["host_memory"] and b["device_bytes"] <= d["kv_budget_bytes"] < b["device_bytes"] + 2 * 8192 * ROW
    # auto on host memory: the two splits move the same bytes at the same speed; the window wins the tie
    a = r["auto_budget"]
    assert a["mode_chosen"] == "window" and a["auto"]["head"]["candidate"] and a["auto"]["reason"].startswith("auto: window")
    assert r["no_target"]["mode_chosen"] == "resident" and "no GPU and no vram_target" in r["no_target"]["reason"]
    assert "needs mode head or auto, not window" in r["window_n"]["refused"]
    assert "needs mode head or auto, not off" in r["off_n"]["refused"]
    assert "needs mode window or auto, not head" in r["head_wc"]["refused"]
    assert "exclude each other" in r["auto_both"]["refused"]
    assert "device_heads must be >= 0" in r["negative"]["refused"]


def test_mqa_cannot_split_by_head(cpu_build, tmp_path):
    """A model with one KV head per layer: an explicit head split is refused with the reason, auto takes the window."""
    from rollingkv_cli import models

    m = models.write_synthetic(tmp_path / "mqa.gguf", models.SynthSpec(layers=2, embd=128, heads=2, kv_heads=1, ff=256, vocab=1000, ctx=32768))
    # 16 MiB of KV at 32768 cells; the weights and the compute estimate take ~72 MiB of a target
    r = _py(cpu_build, m, """
print(json.dumps({"head": plan(ext.make_params(mode="head", device_heads=1)),
                  "auto": plan(ext.make_params(mode="auto", vram_target_mib=80), n_ctx=32768)}))
""")
    assert "the head split is not possible for this model" in r["head"]["refused"] and "MQA" in r["head"]["refused"]
    a = r["auto"]
    assert a["mode_chosen"] == "window" and a["heads"]["eligible"] is False and "MQA" in a["heads"]["refuse"]
    assert a["auto"]["head"]["candidate"] is False and "MQA" in a["auto"]["head"]["why_not"]


# ------------------------------------------------------------------------------------------- exactness


@pytest.mark.slow
@pytest.mark.parametrize("name, args, n, tail", [
    # prefill batches of 512 (the tiled path) over 1 of 3 heads on the device
    ("prefill-h1", ["--synthetic-tokens", "2048", "--ctx", "2304", "--kv-device-heads", "1"], 2048, 2048),
    # batches of 96 (one-chunk for the first 64 ... tiled after) over 2 of 3 heads
    ("batch96-h2", ["--synthetic-tokens", "1024", "--ctx", "1280", "--n-batch", "96", "--kv-device-heads", "2"], 1024, 1024),
    # decode, one token per step: the split-KV path once n_kv >= 512
    ("decode-h1", ["--synthetic-tokens", "700", "--ctx", "768", "--n-batch", "1", "--kv-device-heads", "1"], 700, 700),
    # four sequences side by side in one unified cache, their cells interleaved
    ("4seq-h1", ["--synthetic-tokens", "1024", "--ctx", "1280", "--n-seq", "4", "--n-batch", "128", "--kv-device-heads", "1"], 1024, 1024),
    # the heads from a budget in host memory (per layer, from the planner)
    ("budget", ["--synthetic-tokens", "1024", "--ctx", "8192", "--vram-target", "300"], 1024, 1024),
])
def test_head_split_is_bit_identical(cpu_build, demo_model, tmp_path, name, args, n, tail):
    proc, r = _gate(cpu_build, demo_model, tmp_path, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = r["metrics"]
    assert m["n"] == n and m["bitwise_identical"] and m["max_abs_logit_diff"] == 0.0 and m["nonfinite"] == 0
    assert_reference_resident(r)  # the identity is against the whole cache, not against another split
    plan = r["candidate"]["plan"]
    assert plan["mode_chosen"] == "head" and plan["split"]
    # what was asked for, layer by layer (the demo: 30 layers of 3 KV heads): the host really holds heads of every layer
    layers = plan["layers"]
    assert len(layers) == 30 and all(layer["n_head_kv"] == 3 for layer in layers)
    assert all(layer["device_heads"] + layer["host_heads"] == 3 and layer["host_heads"] >= 1 for layer in layers)
    if "--kv-device-heads" in args:
        asked = int(args[args.index("--kv-device-heads") + 1])
        assert [layer["device_heads"] for layer in layers] == [asked] * 30
    else:  # from the budget: fewer device heads than the whole cache, more than the least
        assert plan["budget"]["budgeted"] and 30 < sum(layer["device_heads"] for layer in layers) < 90


@pytest.mark.slow
def test_gate_fails_on_a_perturbed_head_split(cpu_build, demo_model, tmp_path):
    """The must-fail control: every host head's score x (1 + 1.2e-7), the smallest f32 change, breaks the bit-identity."""
    proc, r = _gate(cpu_build, demo_model, tmp_path, "--synthetic-tokens", "512", "--ctx", "768", "--kv-device-heads", "2",
                    env_extra={"ROLLINGKV_DEBUG_PERTURB_TAIL": "1.2e-7"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["verdict"] == "fail" and "bitwise" in r["failed_checks"] and r["metrics"]["bitwise_equal_rows"] < 512
    assert r["candidate"]["plan"]["mode_chosen"] == "head"


@pytest.mark.slow
def test_quantized_host_heads_with_the_baseline_and_an_exact_control(cpu_build, demo_model, tmp_path):
    """q8_0 host heads: bounded against the resident q8_0 cache over the positions, and the control (every head q8_0, the
    same head split) bit-identical to that baseline."""
    proc, r = _gate(cpu_build, demo_model, tmp_path, "--synthetic-tokens", "1024", "--ctx", "1280", "--kv-device-heads", "1",
                    "-ctkt", "q8_0", "-ctvt", "q8_0", "--tail-baseline")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["profile"] == "quantized" and r["control"]["passed"] and r["control"]["metrics"]["bitwise_identical"]
    assert_reference_resident(r)
    assert r["control"]["plan"]["mode_chosen"] == "head" and r["control"]["plan"]["heads"]["per_layer"] == [1] * 30


@pytest.mark.slow
def test_iswa_global_layers_split_by_head(cpu_build, tmp_path):
    """gemma2 (softcap, sliding-window layers 0 and 2): only the global layers 1 and 3 split, 1 of 2 KV heads each."""
    from rollingkv_cli import models

    m = models.write_synthetic(tmp_path / "g2.gguf", models.SynthSpec(layers=4, embd=256, heads=4, kv_heads=2, ff=512, vocab=1000,
                                                                      ctx=4096, arch="gemma2", sliding_window=128))
    proc, r = _gate(cpu_build, m, tmp_path, "--synthetic-tokens", "1024", "--ctx", "1280", "--kv-device-heads", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = r["candidate"]["plan"]
    assert plan["mode_chosen"] == "head" and [layer["il"] for layer in plan["layers"]] == [1, 3]
    assert all(layer["device_heads"] == 1 and layer["host_heads"] == 1 for layer in plan["layers"])
    assert r["metrics"]["bitwise_identical"] and r["metrics"]["n"] == 1024
    assert_reference_resident(r)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_hybrid_attention_layers_split_by_head(cpu_build, tmp_path, arch):
    from rollingkv_cli import models

    m = models.write_synthetic(tmp_path / f"{arch}.gguf", models.SynthSpec(layers=4, embd=256, heads=4, kv_heads=2, ff=512, vocab=1000,
                                                                           ctx=4096, attn_interval=2, arch=arch))
    proc, r = _gate(cpu_build, m, tmp_path, "--synthetic-tokens", "768", "--ctx", "1024", "--n-batch", "96", "--kv-device-heads", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = r["candidate"]["plan"]
    assert plan["mode_chosen"] == "head" and [layer["il"] for layer in plan["layers"]] == [1, 3] and plan["recurrent"]["layers"] == [0, 2]
    assert r["metrics"]["bitwise_identical"] and r["metrics"]["n"] == 768
    assert_reference_resident(r)


# ------------------------------------------------------------------------------------------------ state


def test_state_bytes_and_round_trips(cpu_build, demo_model):
    """A same-type head split's state is the unsplit cache's bytes; it loads exactly into the resident cache, a window split
    and another head split, and a resident state into a head split. Two types (q8_0 host heads): its own marker, loaded
    exactly into the same split, converted (same argmax, q8_0-sized logit changes) into another head split, refused by a
    window split and by the resident cache: never silently wrong."""
    r = _py(cpu_build, demo_model, STATE_ROUND_TRIP + """
res = {"f16": {}, "mixed": {}, "resident": {}}
h1 = dict(mode="head", device_heads=1)
buf_h, size_h, ref_h = saved(h1)
buf_r, size_r, ref_r = saved(dict(mode="off"))
res["same_bytes"] = size_h == size_r and bytes(buf_h) == bytes(buf_r)
res["same_logits"] = bool(np.array_equal(ref_h, ref_r))
for name, kw in {"same": h1, "h2": dict(mode="head", device_heads=2), "window": dict(mode="window", window_cells=256),
                 "resident": dict(mode="off")}.items():
    res["f16"][name] = load(kw, buf_h, size_h, ref_h)
res["resident"]["h2"] = load(dict(mode="head", device_heads=2), buf_r, size_r, ref_r)
mixed = dict(h1, type_k_tail="q8_0", type_v_tail="q8_0")
buf, size, ref = saved(mixed)
for name, kw in {"same": mixed, "h2": dict(mixed, device_heads=2), "f16_heads": h1,
                 "window_mixed": dict(mode="window", window_cells=256, type_k_tail="q8_0", type_v_tail="q8_0"),
                 "resident": dict(mode="off")}.items():
    res["mixed"][name] = load(kw, buf, size, ref)
print(json.dumps(res))
""")
    assert r["same_bytes"] and r["same_logits"], r
    for name, got in r["f16"].items():
        assert got != "refused" and got["exact"], (name, got)
    assert r["resident"]["h2"]["exact"]
    mixed = r["mixed"]
    assert mixed["same"]["exact"], mixed
    assert mixed["window_mixed"] == "refused" and mixed["resident"] == "refused"
    for name in ("h2", "f16_heads"):  # rows converted through f32: the same cache up to q8_0 rounding
        got = mixed[name]
        assert got != "refused" and got["same_top1"] and got["mean_abs"] < 0.25, (name, got)


# ------------------------------------------------------------------------------------------ llama-server


def _server(cpu_build, demo_model, tmp_path, name, *args):
    from rollingkv_cli.serve.server import ServerProcess

    return ServerProcess(cpu_build.artifact("llama-server"),
                         ["-m", str(demo_model), "-fa", "on", "-t", "2", "--slot-save-path", str(tmp_path), *args],
                         log_path=tmp_path / f"{name}.log")


@pytest.mark.slow
def test_server_context_shift_head_equals_resident(cpu_build, demo_model, tmp_path):
    """Generation past the context with --context-shift: the K-shift re-rotates every cached key of the device's heads and
    the host's; greedy output equals the resident server's; /props and the log show the head split."""
    from rollingkv_cli.lib.text import synthetic_text

    prompt = synthetic_text(900)
    outs, props = {}, {}
    for name, extra in (("resident", ["--kv-residency-mode", "off"]), ("head", ["--kv-residency-mode", "head", "--kv-device-heads", "1"])):
        with _server(cpu_build, demo_model, tmp_path, f"shift-{name}", "-c", "512", "-np", "1", "--context-shift", *extra) as srv:
            r = srv.request("/completion", {"prompt": prompt, "n_predict": 450, "temperature": 0, "seed": 0,
                                            "ignore_eos": True, "n_keep": 32, "cache_prompt": False}, timeout=900)
            outs[name] = r["content"]
            props[name] = srv.request("/props")["rolling_kv"]
        log = (tmp_path / f"shift-{name}.log").read_text()
        assert "context shift" in log, "the generation must run past the context"
    assert outs["head"] == outs["resident"]
    p = props["head"]
    assert p["mode_chosen"] == "head" and p["split"] and p["heads"]["per_layer"] == [1] * 30
    log = (tmp_path / "shift-head.log").read_text()
    assert "KV residency: split by head, 1 of 3 KV heads on the device" in log and "device KV heads per layer [1,1,1" in log


def test_server_and_bench_flags(cpu_build, demo_model):
    """--kv-device-heads at parse time (llama-server and llama-bench), and llama-bench's head rows."""
    for tool, args, message in (("llama-server", ["--kv-device-heads", "0"], "--kv-device-heads must be a number of KV heads >= 1"),
                                ("llama-server", ["--kv-device-heads", "x"], "not an integer"),
                                ("llama-bench", ["--kv-device-heads", "-1"], "--kv-device-heads must be >= 0")):
        proc = subprocess.run([str(cpu_build.artifact(tool)), "-m", str(demo_model), *args, *(["--port", "1"] if tool == "llama-server" else [])],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and message in proc.stdout + proc.stderr, (tool, args, proc.stderr[-500:])
    proc = subprocess.run([str(cpu_build.artifact("llama-bench")), "-m", str(demo_model), "-p", "0", "-n", "4", "-r", "1", "-fa", "1",
                           "-t", "2", "-d", "512", "-o", "json", "--kv-residency-mode", "head", "--kv-device-heads", "1,2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert {(r["kv_device_heads"], r["heads_device"], r["heads_host"]) for r in rows} == {(1, 30, 60), (2, 60, 30)}
    assert all(r["kv_mode"] == "head" and r["kv_mode_chosen"] == "head" and r["avg_ts"] > 0 for r in rows)
