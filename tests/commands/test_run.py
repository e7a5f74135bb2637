"""`rollingkv run`'s checks of the message (commands/run.py: _prompt_text, _temperature), called without click, and one
answer on the demo model.

Seen failing: with the NUL check removed, test_a_nul_byte_is_not_a_message (no error); with the empty check on the raw
text instead of its stripped form, test_a_blank_message_is_a_usage_error.
"""

from __future__ import annotations

import os
import subprocess
import sys

import click
import pytest

from rollingkv_cli.commands.run import _prompt_text, _temperature
from rollingkv_cli.console import RollingKVError


def test_the_message_from_a_flag_or_a_file(tmp_path):
    f = tmp_path / "m.txt"
    f.write_text("Bonjour ?\n", encoding="utf-8")
    assert _prompt_text("Hello", None) == "Hello" and _prompt_text(None, f) == "Bonjour ?\n"


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_a_blank_message_is_a_usage_error(prompt, tmp_path):
    with pytest.raises(click.UsageError, match="is empty"):
        _prompt_text(prompt, None)
    f = tmp_path / "blank.txt"
    f.write_text(prompt)
    with pytest.raises((click.UsageError, RollingKVError), match="empty"):
        _prompt_text(None, f)


def test_a_nul_byte_is_not_a_message(tmp_path):
    with pytest.raises(RollingKVError, match="NUL byte at character 2"):
        _prompt_text("hi\0there", None)


def test_a_message_that_is_not_utf8():
    with pytest.raises(RollingKVError, match="not UTF-8 text"):
        _prompt_text("caf\udce9", None)  # an undecodable argv byte arrives as a surrogate


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.1])
def test_temperature_must_be_finite_and_not_negative(value):
    with pytest.raises(click.BadParameter):
        _temperature(None, None, value)
    assert _temperature(None, None, 0.7) == 0.7


@pytest.mark.build
def test_one_answer_on_the_demo_model(cpu_build, demo_model):
    """The answer alone on stdout; the banner and the timings on stderr."""
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir)}
    p = subprocess.run([sys.executable, "-m", "rollingkv_cli", "run", str(demo_model), "-p", "What is the capital of France? Answer in one sentence.",
                        "-n", "32"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout and "generated tokens" in p.stderr and "generated tokens" not in p.stdout
