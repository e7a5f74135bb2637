"""console.py: output redirected to a file or a pipe (issue 39)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_redirected_output_is_not_hard_wrapped():
    """rich wraps at 80 columns when it does not write to a terminal: a line of gate equiv's came out as "... K/V" /
    "f16/f16 ...". Seen failing before the fix: the 144-character line came out as two. A log panel still wraps its
    lines inside the box (not cropped)."""
    code = ("from rollingkv_cli.console import console, info, log_panel\n"
            "console.print('[dim]' + 'K/V f16/f16 ' * 12 + '[/]')\n"  # as gate equiv prints its settings
            "log_panel('a line of a log ' * 10 + 'END', 'title', console)\n")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout.splitlines()
    assert out[0].rstrip() == ("K/V f16/f16 " * 12).rstrip()
    assert all(len(line) <= 80 for line in out[1:]) and "END" in "".join(out[1:])
