"""Running libllama in a child process, the one way every command does it.

llama.cpp ends the process on some inputs (a GGML_ASSERT calls abort(), a corrupt tensor can segfault): in a child that
ends only the child, which the parent describes in one line. Every child is tied to our life and stopped as a group
(procs.py), inherits no LLAMA_CPP_LIB_PATH (it binds the library it is given) and its death is described by
procs.describe_exit. Two shapes:

* a module run as `python -m MODULE ARGS` (spawn; run to the end with a timeout: run): the gate runner (its own line
  protocol, read as it comes), the CPU attention calibration and the build's backend probe. A child that answers once
  prints one JSON object as the last line of its stdout (reply); the parent reads it with last_json;
* a function forked with the terminal (run_isolated): `rollingkv run`, whose child prints the answer itself; its
  error, exit or the assertion that killed it comes back over a pipe as JSON lines and is raised or reported here.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

from rollingkv_cli.console import abort
from rollingkv_cli.lib.procs import OTHER_ENDING_SIGNALS, STOP_SIGNALS, Terminated, die_with_parent, popen_tied, stop_group, stop_signum

# ------------------------------------------------------------------------------------ a module in a child


def python_command(module: str, *args) -> list[str]:
    """`python -m module args` with this interpreter."""
    return [sys.executable, "-m", module, *map(str, args)]


def child_env() -> dict[str, str]:
    """Our environment for a child that loads libllama: no LLAMA_CPP_LIB_PATH (the child sets it for the library it was
    given), unbuffered output (its lines arrive as it writes them)."""
    env = dict(os.environ)
    env.pop("LLAMA_CPP_LIB_PATH", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def spawn(cmd: list[str], **kwargs) -> subprocess.Popen:
    """The child started tied to our life in its own process group (procs.popen_tied), with child_env() and no stdin
    unless kwargs say otherwise. The caller reads it and stops it with procs.stop_group."""
    kwargs.setdefault("env", child_env())
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    return popen_tied(cmd, **kwargs)


class Timeout(Exception):
    """The child ran past its time and was stopped (its whole process group)."""


def run(cmd: list[str], timeout: float | None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the child run to its end; Timeout past `timeout` seconds. However we leave
    (a timeout, an interrupt), the child's group is stopped first."""
    proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        raise Timeout(f"it ran past {timeout:.0f} s and was stopped") from None
    except BaseException:
        stop_group(proc)
        raise
    return proc.returncode, out, err


def last_json(out: str | None) -> dict | None:
    """The child's answer: the last stdout line that is a JSON object (llama.cpp may print before it); None without one."""
    lines = [line for line in (out or "").splitlines() if line.startswith("{")]
    if not lines:
        return None
    try:
        doc = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def reply(doc: dict) -> None:
    """The child side: print the answer as the one JSON line last_json reads."""
    print(json.dumps(doc), flush=True)


# ------------------------------------------------------------------------------------ a function, forked


_SIGNAL_HINT = "the model file is corrupt or has a shape this build cannot run; -v shows llama.cpp's log"


def run_isolated(fn, what: str, verbose: bool = False) -> None:
    """Run fn() (which drives llama.cpp) in a forked child and re-raise its failure here.

    llama.cpp ends the process on some inputs (a GGML_ASSERT calls abort(), a corrupt tensor can segfault):
    in a child that ends only the child, and the parent reports it as one line, with the assertion that fired.
    fn's stdout and stderr are the command's own; its RollingKVError, interrupt or exit status come back here."""
    import json
    import signal

    if not hasattr(os, "fork"):
        fn()
        return
    child: list[int] = []

    def forward(signum, frame):  # the child unwinds and reports; we wait for it (never an orphan)
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child[0], signum)

    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    # every signal that ends a process, before fork (no gap): SIGQUIT or SIGUSR1 raised in this parent while the child
    # ran, and the child was left answering on its own
    old = {s: signal.signal(s, forward) for s in (*STOP_SIGNALS, *OTHER_ENDING_SIGNALS)}
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        die_with_parent(parent)  # SIGKILL of the parent: this child goes too (it went on answering, an orphan)
        _child(fn, w, verbose)  # never returns
    child.append(pid)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            report = f.read()
        _, status = os.waitpid(pid, 0)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    msgs = [json.loads(line) for line in report.decode(errors="replace").splitlines() if line.startswith("{")]
    if os.WIFSIGNALED(status):
        from rollingkv_cli.console import err_console

        err_console.show_cursor(True)  # a spinner of the child may have hidden it
        sig = signal.Signals(os.WTERMSIG(status)).name
        asserted = next((m["text"] for m in msgs if m.get("kind") == "ggml_abort"), None)
        abort(f"llama.cpp {'aborted' if asserted else f'crashed ({sig})'} while {what}" + (f": {asserted}" if asserted else ""),
              _SIGNAL_HINT)
    result = next((m for m in msgs if m.get("kind") != "ggml_abort"), None)
    code = os.waitstatus_to_exitcode(status)
    if result is None:
        if code:
            sys.exit(code)
        return
    kind = result["kind"]
    if kind == "error":
        abort(result["message"], result.get("hint"), result.get("code", 1))
    if kind == "interrupt":  # the child's stop signal, ours as well (we forwarded it): cli.main exits 128 + its number
        signum = result.get("signum", signal.SIGINT)
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)
    if kind == "exit":
        sys.exit(result["code"])
    import builtins

    exc = getattr(builtins, result["type"], None)
    exc = exc if isinstance(exc, type) and issubclass(exc, Exception) else RuntimeError
    raise exc(result["message"])  # an unexpected failure: cli.main reports it as such


def _child(fn, w: int, verbose: bool) -> None:
    import json
    import signal
    import traceback

    from rollingkv_cli.console import RollingKVError

    def send(msg: dict) -> None:
        try:
            os.write(w, (json.dumps(msg) + "\n").encode())
        except OSError:
            pass

    stops = (*STOP_SIGNALS, *OTHER_ENDING_SIGNALS)

    def interrupted_once(signum, frame):  # Ctrl-C reaches us from the terminal and from the parent: one is enough
        for s in stops:
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)

    for s in stops:
        signal.signal(s, interrupted_once)
    if not verbose:
        os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # no gdb attach on an assert: we report the assertion
    global _abort_report
    _abort_report = lambda text: send({"kind": "ggml_abort", "text": text})  # noqa: E731
    mod = sys.modules.get("llama_cpp")
    if mod is not None:
        install_abort_report(mod.llama_cpp._lib)
    code = 0
    try:
        fn()
    except RollingKVError as e:
        code = e.code
        send({"kind": "error", "message": e.message, "hint": e.hint, "code": e.code})
    except KeyboardInterrupt as e:
        signum = stop_signum(e) or signal.SIGINT
        code = 128 + signum
        send({"kind": "interrupt", "signum": int(signum)})
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        send({"kind": "exit", "code": code})
    except BaseException as e:  # noqa: BLE001 - handed to the parent, which raises it for cli.main
        code = 1
        if verbose:
            traceback.print_exc()
        send({"kind": "other", "type": type(e).__name__, "message": str(e)})
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: nothing more to say
                pass
        os._exit(code)


_abort_report = None  # set in a run_isolated child: where ggml's assertion text goes
_abort_callback = None  # the ctypes callback must outlive every call into ggml


def install_abort_report(lib: ctypes.CDLL) -> None:
    """ggml_set_abort_callback: ggml hands the failed assertion to us just before it calls abort()."""
    global _abort_callback
    if _abort_report is None or _abort_callback is not None:
        return
    base = Path(getattr(lib, "_name", "") or ".").parent / "libggml-base.so"
    try:
        setter = (ctypes.CDLL(str(base)) if base.is_file() else lib).ggml_set_abort_callback
    except (OSError, AttributeError):
        return
    proto = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
    report = _abort_report
    _abort_callback = proto(lambda msg: report((msg or b"").decode(errors="replace")))
    setter.restype = ctypes.c_void_p
    setter.argtypes = [proto]
    setter(_abort_callback)
