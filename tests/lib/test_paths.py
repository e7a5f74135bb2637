"""lib/paths.py: the cache directory. A read-only cache serves the commands that only read it; the ones that must write
there say so in one line (issue 39: 15)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from test_cli import run_main


@pytest.fixture
def read_only_cache(tmp_path, monkeypatch, cpu_build, demo_model):
    """A cache holding the active build's pointer and the demo model, on a filesystem that statvfs and access(2) call
    read-only (what a read-only mount answers; root may not remount here)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "active-build").write_text(f"{cpu_build.dir}\n")
    (cache / "models").symlink_to(demo_model.parent)
    monkeypatch.setenv("ROLLINGKV_CACHE_DIR", str(cache))
    monkeypatch.setenv("ROLLINGKV_OFFLINE", "1")
    monkeypatch.delenv("ROLLINGKV_BUILD", raising=False)
    from rollingkv_cli.lib import paths

    monkeypatch.setattr(paths, "_usable", set())
    real_statvfs, real_access = os.statvfs, os.access

    def inside(p) -> bool:
        return str(Path(p).absolute()).startswith(str(cache))

    class ReadOnly:
        def __init__(self, r):
            self._r = r

        def __getattr__(self, k):
            return getattr(self._r, k)

        @property
        def f_flag(self):
            return self._r.f_flag | os.ST_RDONLY

    monkeypatch.setattr(os, "statvfs", lambda p: ReadOnly(real_statvfs(p)) if inside(p) else real_statvfs(p))
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if inside(p) and mode & os.W_OK else real_access(p, mode, **kw))
    return cache


@pytest.mark.build
@pytest.mark.parametrize("args,expect", [
    (["info"], "build"),
    (["model", "demo", "--print-path"], "SmolLM2-135M-Instruct.Q4_1.gguf"),
    (["patches", "list"], "native files"),
])
def test_a_read_only_cache_serves_what_only_reads(read_only_cache, capsys, args, expect):
    """Seen failing before the fix: info and model demo --print-path ended in "error: $ROLLINGKV_CACHE_DIR=... is not
    writable"."""
    code, out, err = run_main(args, capsys)
    assert code == 0 and expect in out, err
    assert not (read_only_cache / "builds").exists() and sorted(p.name for p in read_only_cache.iterdir()) == ["active-build", "models"]


@pytest.mark.build
@pytest.mark.parametrize("args", [["serve", "demo", "--port", "0", "-q"], ["gate", "equiv", "--model", "demo", "--synthetic-tokens", "64"]])
def test_a_read_only_cache_is_one_line_where_a_command_writes(read_only_cache, capsys, args):
    """serve and the gates write their logs into the cache: refused in one line that says why, nothing started."""
    code, _, err = run_main(args, capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, err
    assert "is on a read-only filesystem, and this command writes there" in errors[0]
