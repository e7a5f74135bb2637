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
    """A file with the GGUF magic and nothing else: passes "is it a GGUF" checks, fails any real load."""
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF" + b"\0" * 60)
    return p


@pytest.fixture(scope="session")
def cpu_build():
    """The CPU build of the patched llama.cpp (built on demand; the same one `rollingkv build --no-cuda` makes)."""
    from rollingkv_cli import builder

    return builder.build(builder.BuildOptions(cuda=False), quiet=True, activate=False)


@pytest.fixture(scope="session")
def unpatched_build():
    """libllama of the pin WITHOUT our series: the reference for "off is bit-identical to upstream"."""
    from rollingkv_cli import builder

    return builder.build(builder.BuildOptions(cuda=False, unpatched=True), quiet=True, activate=False)


@pytest.fixture(scope="session")
def pristine_tree():
    from rollingkv_cli import upstream

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
from rollingkv_cli import llama_ext
llama_cpp, ext = llama_ext.load(Path(os.environ["RKV_TEST_LIB_DIR"]))
logs = []
_cb = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda l, t, u: logs.append(t.decode(errors="replace")))
llama_cpp.llama_log_set(_cb, None)
llama_cpp.llama_backend_init()
"""


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
