"""Child processes: started tied to our life, stopped as a group, and their deaths described.

Every long-lived child (llama-server, gate runners, llama-bench, the build's ninja) starts through
`popen_tied`: on Linux it gets a parent-death signal, so that it goes when we go, however we go (SIGKILL,
a closed terminal's SIGHUP, a crash), even from its own session where no signal of ours reaches it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()  # looked up here, not in the child between fork and exec


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """In a child forked without exec (child.run_isolated): the kernel sends `sig` when the parent's forking thread ends,
    so a SIGKILLed `rollingkv run` does not leave its child answering on the terminal; a parent already gone: now."""
    if _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _tie_to_parent(sig: int):
    """A preexec_fn: the kernel sends `sig` to the child when the thread that forked it ends."""
    parent = os.getpid()
    prctl = _PRCTL

    def tie() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # we died between fork and prctl: nobody would send the signal
            os.kill(os.getpid(), sig)

    return tie


def popen_tied(cmd, *, new_session: bool = True, death_signal: int = signal.SIGTERM, **kwargs) -> subprocess.Popen:
    """subprocess.Popen whose child dies with this process (Linux; elsewhere a plain Popen).

    new_session: the child leads its own session and process group (stop_group takes the group down, and
    a terminal's Ctrl-C reaches only us); False keeps it in ours. The death signal follows the *thread*
    that starts the child: call this from the main thread (as every caller does), not a short-lived worker.
    """
    if _PRCTL is not None:
        if "preexec_fn" in kwargs:
            raise TypeError("popen_tied sets its own preexec_fn")
        kwargs["preexec_fn"] = _tie_to_parent(death_signal)
    return subprocess.Popen(cmd, start_new_session=new_session, **kwargs)


def stop_group(proc: subprocess.Popen, grace: float = 10.0, on_kill=None, busy=None) -> int | None:
    """SIGTERM the child's whole process group (the child alone when it shares ours), wait up to `grace`
    seconds, then SIGKILL it: never an orphan. on_kill, when given, is called just before the SIGKILL with whether an
    interrupt cut the wait short (so that a caller can say the child was killed, not stopped, and why). busy, when
    given, is asked after the grace, then every half second, whether the child is in the middle of something a SIGKILL
    would leave half done (a file it writes): the wait goes on while it answers True, and for another grace after (the
    child ends once that is done).

    An interrupt while waiting (a second Ctrl-C, another SIGTERM/SIGHUP) cuts the wait short: the group is
    killed and reaped first, then the interrupt goes on.
    """
    if proc.poll() is not None:
        return proc.returncode
    _signal_group(proc, signal.SIGTERM)
    pending: BaseException | None = None
    try:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            if busy is not None and busy():
                while proc.poll() is None and busy():
                    try:
                        proc.wait(timeout=0.5)
                    except subprocess.TimeoutExpired:
                        pass
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
    except BaseException as e:  # KeyboardInterrupt, or a signal handler's exception
        pending = e
    if proc.poll() is None:
        if on_kill is not None:
            on_kill(pending is not None)
        _signal_group(proc, signal.SIGKILL)
        while True:
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                break  # SIGKILLed but not reaped in time (uninterruptible I/O): nothing more we can do
            except BaseException as e:  # even more interrupts: it is already SIGKILLed, just reap it
                pending = pending or e
    if pending is not None:
        raise pending
    return proc.returncode


def files_written(pid: int, folder: Path) -> dict[str, int]:
    """The files under folder that process pid holds open for writing, each with its file position (Linux's /proc;
    {} elsewhere, or for a process gone)."""
    root = os.path.realpath(folder) + os.sep
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return {}
    found = {}
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if not target.startswith(root):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["flags"].strip(), 8) & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
                found[target] = int(fields["pos"].strip())
        except (OSError, KeyError, ValueError):  # closed meanwhile, or a kernel that words fdinfo otherwise
            continue
    return found


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """The child's process group when it leads one (popen_tied's default), else the child alone."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass


# ------------------------------------------------------------------ our own stop signals

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, `kill`/`timeout`, a closed terminal
# the other signals whose default action ends the process (Ctrl-\, `kill -USR1`, an alarm, a CPU-time limit): by default
# they ended it on the spot, leaving a gate's work folder of reference logits (1.5 GB) for the next gate to find;
# raised as SIGTERM is, they clean up the same way (SIGPIPE stays Python's: ignored, a write to a closed pipe fails)
OTHER_ENDING_SIGNALS = (signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGXCPU)


class Terminated(KeyboardInterrupt):
    """SIGTERM, SIGHUP or another signal that ends a process (OTHER_ENDING_SIGNALS), raised where the main thread stands as Ctrl-C's KeyboardInterrupt is: every `finally`,
    `with` and `except KeyboardInterrupt` that cleans up after Ctrl-C (children stopped, work folders and half-written
    files removed) does the same for these; cli.main then exits 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signal_name(signum))
        self.signum = int(signum)


def stop_signum(exc: BaseException | None) -> int | None:
    """The stop signal behind exc: a Terminated's, SIGINT for a plain KeyboardInterrupt (also when click wrapped it in
    its Abort), None for anything else."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, Terminated):
            return exc.signum
        if isinstance(exc, KeyboardInterrupt):
            return int(signal.SIGINT)
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


@contextlib.contextmanager
def stop_signals_raise():
    """While the block runs, SIGTERM, SIGHUP and OTHER_ENDING_SIGNALS raise Terminated in the main thread (SIGINT raises
    KeyboardInterrupt as Python's own handler does); the handlers before are restored after. A no-op outside the main
    thread, where Python sets no handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP, *OTHER_ENDING_SIGNALS)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


# ------------------------------------------------------------------ how a child ended

_SIGNAL_CAUSES = {
    "SIGILL": ("the CPU met an instruction it does not allow: ggml's CPU code used a feature this CPU or kernel does not "
               "give it (e.g. AMX tile or AVX-512 kernels: a build made for another CPU, a VM that hides features, AMX without "
               "the kernel's permission); `rollingkv info` shows the host CPU's features and those the CPU backend uses",
               "turn off ggml's extra weight buffer types (AMX, repacking): llama-server --no-repack (after `--` for "
               "`rollingkv serve`), llama-bench --repack 0; or rebuild on this machine with `rollingkv build`"),
    "SIGSEGV": ("a crash in llama.cpp (a memory fault)",
                "if it is in ggml's CPU backend, try without its extra weight buffer types (llama-server --no-repack, "
                "llama-bench --repack 0) or rebuild with `rollingkv build`; else report it with the log"),
    "SIGBUS": ("a memory-mapped file went away under it: the model file was truncated or replaced while loaded, or the disk is full",
               "check the model file (and free disk space), then start again"),
    "SIGABRT": ("llama.cpp aborted (a failed GGML_ASSERT or an uncaught exception)", "the last lines of the log say why"),
    "SIGKILL": ("it was killed outright: most often the kernel's out-of-memory killer",
                "check `dmesg | grep -i oom`; a smaller context, window or batch needs less memory"),
    "SIGFPE": ("an arithmetic fault in llama.cpp", "report it with the log"),
}


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def exit_parts(rc: int | None, log_path: Path | str | None = None) -> tuple[str, str | None]:
    """(how it ended, what to do): ('killed by SIGILL (signal 4): <likely cause>', '<workaround>; log: <path>').

    rc is Popen.returncode: negative for a signal, None while it runs."""
    advice = None
    if rc is None:
        what = "still running"
    elif rc >= 0:
        what = f"exit status {rc}"
    else:
        name = signal_name(-rc)
        what = f"killed by {name} (signal {-rc})"
        cause = _SIGNAL_CAUSES.get(name)
        if cause:
            what += f": {cause[0]}"
            advice = cause[1]
    if log_path:
        advice = f"{advice}; log: {log_path}" if advice else f"log: {log_path}"
    return what, advice


def describe_exit(rc: int | None, log_path: Path | str | None = None) -> str:
    """How a child ended, in one phrase for a message: never a bare 'exit -11'."""
    what, advice = exit_parts(rc, log_path)
    return f"{what}; {advice}" if advice else what
