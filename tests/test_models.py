"""Synthetic Llama-shaped GGUFs: written by gguf-py, loaded by our build, finite logits."""

from __future__ import annotations

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
        from rollingkv_cli import llama_ext
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
