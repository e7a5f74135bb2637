"""lib/paths.py: the cache directory (a read-only cache serves the commands that only read it; the ones that must write
there say so in one line: issue 39, 15) and the runs' logs kept (the gates' folders and serve's files alike)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollingkv_cli.lib import paths
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
    (["serve", "demo", "-c", "2048", "--print-args"], "llama-server --host 127.0.0.1 --port 8080"),
    (["bench", "tail", "demo", "--preset", "cpu-small", "--dry-run"], "llama-bench"),
])
def test_a_read_only_cache_serves_what_only_reads(read_only_cache, capsys, args, expect):
    """Seen failing before the fix: info and model demo --print-path ended in "error: $ROLLINGKV_CACHE_DIR=... is not
    writable". serve --print-args (it prints a command line, writes nothing) said "... is on a read-only filesystem, and
    this command writes there" until the sweep of 2026-12-06."""
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

def test_prune_run_logs_keeps_the_newest_runs_and_nothing_else_goes(tmp_path):
    """Only entries named <prefix><YYYYmmdd-HHMMSS>... are runs' logs; the oldest beyond `keep` go (folders and files),
    by the time in their names, not their mtimes. Written with serve's pruning (issue 39): there was no shared function,
    the gates pruned their folders inline and serve never pruned."""
    for i in range(5):
        (tmp_path / f"serve-2026120{i}-120000-8080.log").write_text("x")
        d = tmp_path / f"2026120{i}-120000-42-abc"
        d.mkdir()
        (d / "tokenize.log").write_text("x")
    os.utime(tmp_path / "serve-20261200-120000-8080.log", (2e9, 2e9))  # the oldest name, touched last: still the oldest
    (tmp_path / "serve-notes.txt").write_text("mine")
    (tmp_path / "README").write_text("mine")
    gone = paths.prune_run_logs(tmp_path, "serve-", 2)
    assert sorted(p.name for p in gone) == [f"serve-2026120{i}-120000-8080.log" for i in range(3)]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert "serve-20261203-120000-8080.log" in left and "serve-20261204-120000-8080.log" in left
    assert "serve-notes.txt" in left and "README" in left and len([n for n in left if n.startswith("2026")]) == 5
    assert [p.name for p in paths.prune_run_logs(tmp_path, "", 3)] == ["20261200-120000-42-abc", "20261201-120000-42-abc"]
    assert not (tmp_path / "20261200-120000-42-abc").exists() and (tmp_path / "20261204-120000-42-abc" / "tokenize.log").is_file()
    assert paths.prune_run_logs(tmp_path / "missing", "serve-") == []
