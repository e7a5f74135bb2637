"""userinput.py: what a user's file may hold. A YAML alias bomb (issue 39: 1) is refused at the read, and a value
shown in an error line is cut short."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

# nine nested anchors, each list nine aliases of the one before: 9^9 = 387 million strings once expanded
def bomb(key: str) -> str:
    """key's value: a list of the nine levels, the last one the whole bomb."""
    return f"{key}:\n  - &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"  - &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))

MEMORY_LIMIT = 1 << 30  # a regression must fail the test, not eat the machine (the error message once took 19 GB)


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _cli(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROLLINGKV_CACHE_DIR": str(tmp / "cache"), "ROLLINGKV_OFFLINE": "1", "OPENBLAS_NUM_THREADS": "1"}
    env.pop("ROLLINGKV_BUILD", None)
    return subprocess.run([sys.executable, "-m", "rollingkv_cli", *args], capture_output=True, text=True, timeout=120,
                          env=env, preexec_fn=_limited)


@pytest.mark.parametrize("where", ["serve --config", "gate equiv --thresholds"])
def test_a_yaml_alias_bomb_is_refused_in_one_line(where, tmp_path, fake_gguf):
    """Seen failing before the fix: under this memory limit both commands ended in "internal error: MemoryError" (the
    message `must be an integer, not [[[...` expanded the value; without a limit it grew to 19 GB)."""
    if where == "serve --config":
        (tmp_path / "c.yaml").write_text("model: demo\n" + bomb("port"))
        args = ["serve", "--config", str(tmp_path / "c.yaml"), "--print-args"]
    else:
        (tmp_path / "t.yaml").write_text(bomb("max_mean_tv"))
        args = ["gate", "equiv", "--model", str(fake_gguf), "--thresholds", str(tmp_path / "t.yaml")]
    proc = _cli(args, tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "uses a YAML alias (*a, line " in errors[0], proc.stderr[-2000:]
    assert len(proc.stderr) < 400 and "Traceback" not in proc.stderr


def test_a_value_in_an_error_line_is_cut_short(tmp_path, capsys, isolated_cache):
    """A long value without aliases (a list of 6000 items: a settings file holds at most 64 KiB since 2026-12-06) is
    shown by its first items. Seen failing before the fix: the line held the whole list (about 800 kB at 100000 items)."""
    from test_cli import run_main

    (tmp_path / "c.yaml").write_text("model: demo\nport: [" + ", ".join(["12345678"] * 6000) + "]\n")
    code, _, err = run_main(["serve", "--config", str(tmp_path / "c.yaml"), "--print-args"], capsys)
    assert code == 2
    assert err.startswith("error: ") and "port must be an integer, not [12345678, 12345678, 12345678, ...]" in err
    assert len(err) < 300, len(err)
