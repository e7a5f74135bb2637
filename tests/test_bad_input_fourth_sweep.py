"""Issue 39's fourth pass: the third sweep's leftovers and what a fourth sweep as a new user found (docs/testing.md,
"The fourth sweep"). Each test was seen failing on the code before its fix, as its docstring says; in-process where no
child is needed, against the real llama-server of the CPU build where its behaviour is the point."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from test_cli import run_main


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def _serve(args: list[str], env: dict) -> subprocess.Popen:
    """`rollingkv serve ARGS` in a session of its own, its output (both streams) on a pipe."""
    return subprocess.Popen([sys.executable, "-m", "rollingkv_cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                            start_new_session=True)


def _cache_with_demo(tmp_path: Path, demo_model: Path) -> Path:
    """A cache of its own (logs, slots) whose models/ is the demo model's folder: nothing fetched, nothing shared."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(demo_model.parent, target_is_directory=True)
    return cache


# ------------------------------------------------------------------------------------------------ b: empty paths

@pytest.mark.parametrize("args,option", [
    (["gate", "needle", "demo", "--json", ""], "'--json'"),
    (["gate", "equiv", "demo", "--json", ""], "'--json'"),
    (["gate", "vram", "demo", "--vram-target", "1000", "--json", ""], "'--json'"),
    (["gate", "equiv", "demo", "--work-dir", ""], "'--work-dir'"),
    (["gate", "equiv", "demo", "--prompt-file", ""], "'--prompt-file'"),
    (["gate", "equiv", "demo", "--thresholds", ""], "'--thresholds'"),
    (["gate", "equiv", "demo", "--build", ""], "'--build'"),
    (["gate", "equiv", "demo", "--lib-dir", ""], "'--lib-dir'"),
    (["gate", "needle", "demo", "--filler-file", ""], "'--filler-file'"),
    (["gate", "matrix", "--out", ""], "'--out'"),
    (["gate", "matrix", "--work-dir", ""], "'--work-dir'"),
    (["bench", "tail", "demo", "--dry-run", "--json", ""], "'--json'"),
    (["bench", "tail", "demo", "--dry-run", "--vanilla-build", ""], "'--vanilla-build'"),
    (["bench", "load", "demo", "--dry-run", "--json", ""], "'--json'"),
    (["bench", "plot", "r.json", "-o", ""], "'-o' / '--output'"),
    (["bench", "plot", ""], "'REPORT'"),
    (["bench", "show", ""], "'REPORT'"),
    (["model", "synth", ""], "'OUT'"),
    (["patches", "checkout", ""], "'DEST'"),
    (["patches", "export", " "], "'SRC'"),
    (["run", "demo", "-f", ""], "'-f' / '--prompt-file'"),
    (["build", "--source", ""], "'--source'"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_an_empty_path_is_named_as_such(args, option, capsys, isolated_cache):
    """An empty path (an unset shell variable) is the current directory to Path(''): `gate needle --json ''` said
    "cannot write report .: it is a directory", `gate matrix --out ''` and `gate equiv --work-dir ''` worked in ./,
    `bench tail --dry-run --json ''` and `bench load --dry-run --json ''` passed, the readers said "cannot read ... .:
    it is a directory", `patches checkout ''` ". exists and is not empty". Seen failing before the fix: each of those
    lines (or exit 0). Now click's usage error on the option, naming the empty path (exit 2), before anything runs."""
    code, out, err = run_main(args, capsys)
    assert code == 2, out + err
    assert f"Invalid value for {option}: an empty path (an unset shell variable?)" in err, err
