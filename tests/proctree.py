"""Process trees from /proc, for the tests that kill the CLI outright: which processes a command started (recorded
before it is killed, since they are re-parented after), and whether they are gone (a zombie counts as gone: it runs no
more, and an init that does not reap leaves it so)."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of pid, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> set[int]:
    """Every live process below pid (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[0] != "Z":
                children.setdefault(st[1], []).append(int(name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Poll until none of pids runs or timeout seconds pass; the ones still running."""
    deadline = time.monotonic() + timeout
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {p for p in left if alive(p)}
    return left


def wait_for(pred, timeout: float, what: str, every: float = 0.2):
    """Poll pred() until it returns something true (returned) or timeout seconds pass (AssertionError naming what)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def kill_all(pids: set[int], sig: int = 9) -> None:
    """Clean-up after a failed assertion: the test's own recorded processes, by PID."""
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def descendant_running(pid: int, needle: str) -> int | None:
    """A live descendant of pid whose command line has an argument containing needle (None: none yet)."""
    for c in sorted(descendants(pid)):
        if any(needle in a for a in cmdline(c)):
            return c
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time pid has used so far (0 when it is gone): that a child is past its start-up and computing."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def sigkill_leaves_nothing(proc, what: str, within: float = 2.0) -> None:
    """SIGKILL proc (a command started in a session of its own, its children recorded first: once re-parented they are
    no longer below it) and assert that none of them still runs `within` seconds later; whatever is left is killed by
    PID either way, and proc reaped."""
    kids = descendants(proc.pid)
    try:
        assert kids, f"{what} started no process"
        proc.kill()
        proc.wait(timeout=10)
        left = wait_gone(kids, within)
        assert not left, f"still running {within:g} s after {what} was SIGKILLed: {sorted(left)}"
    finally:
        kill_all(kids)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextmanager
def killed_outright(proc, what: str, within: float = 2.0):
    """`with killed_outright(proc, "serve"): <wait until it is mid-work>`, then SIGKILL it and assert that nothing it
    started outlives it (sigkill_leaves_nothing); a wait that fails kills what it started, by PID, and re-raises."""
    try:
        yield
    except BaseException:
        kill_all(descendants(proc.pid))
        proc.kill()
        proc.wait()
        raise
    sigkill_leaves_nothing(proc, what, within)
