"""lib/paths.py: the runs' logs kept (the gates' folders and serve's files alike)."""

from __future__ import annotations

import os

from rollingkv_cli.lib import paths


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
