"""Shared fixtures. The patched llama.cpp is built once per session in the user cache (a no-op when
scripts/test.sh already built it); tests that change environment get an isolated cache dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch) -> Path:
    """An empty rollingkv cache, offline, and no active build."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ROLLINGKV_CACHE_DIR", str(cache))
    monkeypatch.setenv("ROLLINGKV_OFFLINE", "1")
    monkeypatch.delenv("ROLLINGKV_BUILD", raising=False)
    monkeypatch.delenv("ROLLINGKV_LLAMA_CPP_SOURCE", raising=False)
    return cache


@pytest.fixture
def fake_gguf(tmp_path) -> Path:
    """A GGUF v3 header with no keys and no tensors (and zeros after it): passes the header checks every command makes
    (models.resolve_model), fails any real load."""
    import struct

    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0) + b"\0" * 40)
    return p


@pytest.fixture(scope="session")
def cpu_build():
    """The CPU build of the patched llama.cpp (built on demand; the same one `rollingkv build --no-cuda` makes)."""
    from rollingkv_cli.lib import builder

    return builder.build(builder.BuildOptions(cuda=False), quiet=True, activate=False)


@pytest.fixture(scope="session")
def unpatched_build():
    """libllama of the pin WITHOUT our series: the reference for "off is bit-identical to upstream"."""
    from rollingkv_cli.lib import builder

    return builder.build(builder.BuildOptions(cuda=False, unpatched=True), quiet=True, activate=False)


@pytest.fixture(scope="session")
def pristine_tree():
    from rollingkv_cli.lib import upstream

    return upstream.pristine_tree(log=lambda m: None)


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from rollingkv_cli import models

    return models.fetch_demo(log=lambda m: None)


# The start of a child that asks libllama something through llama_ext (run_python): the library bound, its log lines
# collected in `logs` (not printed: the child's last stdout line is its JSON), the backend up.
LIB_PRELUDE = """
import ctypes, json, os, re
from pathlib import Path
from rollingkv_cli.lib import llama_ext
llama_cpp, ext = llama_ext.load(Path(os.environ["RKV_TEST_LIB_DIR"]))
logs = []
_cb = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda l, t, u: logs.append(t.decode(errors="replace")))
llama_cpp.llama_log_set(_cb, None)
llama_cpp.llama_backend_init()
def batch_decode(ctx, items):  # one llama_decode of (seq, pos, token, want_logits) items; its status
    b = llama_cpp.llama_batch_init(len(items), 0, 1)
    for i, (s, p, t, lg) in enumerate(items):
        b.token[i] = t; b.pos[i] = p; b.n_seq_id[i] = 1; b.seq_id[i][0] = s; b.logits[i] = lg
    b.n_tokens = len(items)
    rc = llama_cpp.llama_decode(ctx, b)
    llama_cpp.llama_batch_free(b)
    return rc
"""

# After a prelude that loads `model` and defines `cparams()`: a state round trip of one sequence through llama_state_*.
# saved(kw) feeds 699 tokens to a context made with make_params(**kw) and returns its state and the next token's
# logits; load(kw, ...) restores that state into another context and compares its next logits ("refused" when the
# library refuses the state).
STATE_ROUND_TRIP = """
import numpy as np
toks = [(i * 37 + 11) % 20000 + 100 for i in range(700)]
def new(kw):
    ctx = ext.init_context(model, cparams(), ext.make_params(**kw))
    assert ctx, ext.last_error()
    return ctx
def feed(ctx, tokens, pos0):
    assert batch_decode(ctx, [(0, pos0 + i, t, i == len(tokens) - 1) for i, t in enumerate(tokens)]) == 0
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
def saved(kw):
    a = new(kw)
    feed(a, toks[:512], 0); feed(a, toks[512:699], 512)
    size = llama_cpp.llama_state_get_size(a)
    buf = (ctypes.c_uint8 * size)()
    assert llama_cpp.llama_state_get_data(a, buf, size) == size
    ref = feed(a, toks[699:700], 699)
    llama_cpp.llama_free(a)
    return buf, size, ref
def load(kw, buf, size, ref):
    c = new(kw)
    n = llama_cpp.llama_state_set_data(c, buf, size)
    if n == 0:
        out = "refused"
    else:
        got = feed(c, toks[699:700], 699)
        out = {"exact": bool(np.array_equal(got, ref)), "same_top1": int(got.argmax()) == int(ref.argmax()),
               "mean_abs": float(np.abs(got - ref).mean())}
    llama_cpp.llama_free(c)
    return out
"""


def assert_reference_resident(report: dict) -> None:
    """A `gate equiv` report's reference ran on the whole, resident cache: residency off, a plan (from the patched
    library) that splits nothing, or another library's plain context. A bit-identity against a reference wired to the
    split would prove nothing (issue 27: 22)."""
    ref = report["reference"]
    plan = ref.get("plan")
    if ref["spec"] == "resident":
        # placed by sequence as the candidate is when several sequences share the cache (gate equiv --n-seq; API 11)
        assert ref["residency"] in ({"mode": "off"}, {"mode": "off", "placement": "sequences"}), ref["residency"]
        assert plan is not None and plan["mode_chosen"] == "off" and plan["split"] is False, plan
        for layer in plan.get("layers") or []:
            assert not layer.get("split") and layer.get("tail_cells", 0) == 0 and layer.get("host_heads", 0) == 0, layer
        assert not (plan.get("heads") or {}).get("split"), plan.get("heads")
    else:  # lib:PATH, e.g. the unpatched build: upstream's context, no plan to split with
        assert ref["context_via"] == "llama_init_from_model" or (plan is not None and plan["mode_chosen"] == "off" and not plan["split"]), ref


def run_python(code: str, lib_dir: Path | None = None, timeout: float = 600, env_extra: dict | None = None) -> dict:
    """Run code in a fresh interpreter (llama_cpp binds its library once per process); it prints one JSON line last."""
    env = dict(os.environ)
    env.pop("LLAMA_CPP_LIB_PATH", None)
    if lib_dir is not None:
        env["RKV_TEST_LIB_DIR"] = str(lib_dir)
    if env_extra:
        env.update(env_extra)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    last = [line for line in proc.stdout.splitlines() if line.startswith("{")][-1]
    return json.loads(last)
