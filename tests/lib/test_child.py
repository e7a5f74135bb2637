"""lib/child.py, the one way a command runs libllama in a child: the module child's answer, its environment, and its
whole process group stopped past its time (the forked shape, run_isolated: tests/test_bad_input_run_model_build.py)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from rollingkv_cli.lib import child


def test_last_json_is_the_last_object_line():
    assert child.last_json('llama.cpp says {hello}\n{"a": 1}\nnoise\n{"b": 2}\n') == {"b": 2}
    assert child.last_json("no answer\n") is None and child.last_json("") is None and child.last_json(None) is None
    assert child.last_json('{"a": 1}\n{not json\n') is None  # the last one is the answer: broken is none, not an older one
    assert child.last_json("[1, 2]\n") is None


def test_the_child_binds_its_own_library_and_answers_one_line(monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", "/somewhere/else")
    code = ("import os, sys; print('before'); from rollingkv_cli.lib.child import reply; "
            "reply({'lib': os.environ.get('LLAMA_CPP_LIB_PATH'), 'unbuffered': os.environ.get('PYTHONUNBUFFERED'), "
            "'stdin': sys.stdin.read()})")
    rc, out, err = child.run([sys.executable, "-c", code], timeout=60)
    assert rc == 0, err
    assert out.splitlines()[0] == "before"
    assert child.last_json(out) == {"lib": None, "unbuffered": "1", "stdin": ""}
    assert child.python_command("rollingkv_cli.gate.runner", "--n", 3) == [sys.executable, "-m", "rollingkv_cli.gate.runner", "--n", "3"]


def _alive(pid: int) -> bool:
    """Running (a zombie left for an init that does not reap is dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_child_past_its_time_is_stopped_with_its_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    t0 = time.monotonic()
    with pytest.raises(child.Timeout, match="ran past 2 s"):
        child.run([sys.executable, "-c", code], timeout=2)
    assert time.monotonic() - t0 < 30
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    else:
        os.kill(grandchild, 9)
        raise AssertionError("the child's own child outlived the timeout")
