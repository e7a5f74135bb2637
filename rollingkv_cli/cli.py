"""The `rollingkv` command: a click root group; each command lives in rollingkv_cli/commands/<name>.py, or, for a
command family (gate, bench), in its package rollingkv_cli/<name>/ (the group in cli.py)."""

from __future__ import annotations

import os
import sys

import click

from rollingkv_cli import __version__
from rollingkv_cli.console import RollingKVError, print_error

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _never_break_inside_a_word() -> None:
    """click wraps help text with textwrap, which breaks after hyphens: option names came out as `--kv-` /
    `window-cells` on two lines. Its wrapper (click._textwrap.TextWrapper, looked up at each wrap) breaks at spaces only
    from here on."""
    from click import _textwrap

    base = _textwrap.TextWrapper
    if getattr(base, "rollingkv", False):
        return

    class TextWrapper(base):
        rollingkv = True

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("break_on_hyphens", False)
            super().__init__(*args, **kwargs)

        def _handle_long_word(self, reversed_chunks, cur_line, cur_len, width):
            """A word longer than a line (a default list, a path): on a line of its own, cut after its last comma or
            slash that fits (anywhere only where there is none). It was cut where the line ended: "[default: d" /
            "efault,split,..."."""
            if cur_line:
                return  # this line ends here; the word starts the next one
            chunk, space = reversed_chunks[-1], max(width, 1)
            at = max(chunk.rfind(",", 0, space), chunk.rfind("/", 0, space))
            end = at + 1 if at > 0 else space
            cur_line.append(chunk[:end])
            reversed_chunks[-1] = chunk[end:]

    _textwrap.TextWrapper = TextWrapper


_never_break_inside_a_word()


@click.group(context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, "--version", prog_name="rollingkv")
def rollingkv() -> None:
    """Exact long-context inference when the KV cache does not fit in VRAM.

    Builds a patched llama.cpp whose KV cache keeps a window of cells on the GPU and streams the rest
    from pinned host memory, serves it, and checks it against the fully resident run.
    """


def _register() -> None:
    """Each module rollingkv_cli/commands/<name>.py, and each command family's package rollingkv_cli/<name>/
    (its click group in <name>/cli.py, next to the modules doing the work), defines the click command <name>.

    Heavy imports stay inside the command bodies, so registering all of them is cheap.
    """
    import importlib
    import importlib.util
    import pkgutil

    import rollingkv_cli
    from rollingkv_cli import commands

    found = [f"rollingkv_cli.commands.{m.name}" for m in pkgutil.iter_modules(commands.__path__)]
    found += [f"rollingkv_cli.{m.name}.cli" for m in pkgutil.iter_modules(rollingkv_cli.__path__)
              if m.ispkg and importlib.util.find_spec(f"rollingkv_cli.{m.name}.cli") is not None]
    for mod in sorted(found):
        name = mod.removesuffix(".cli").rsplit(".", 1)[1]
        rollingkv.add_command(getattr(importlib.import_module(mod), name))


_register()


def _tolerant_output() -> None:
    """An output encoding that cannot write a character we print (`PYTHONIOENCODING=ascii`, a latin-1 terminal: "✓",
    "—", a model's UTF-8 text) writes a replacement instead: it was "internal error: UnicodeEncodeError" after the work
    was done."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if (stream.encoding or "").lower().replace("-", "") not in ("utf8", "utf8sig"):
                stream.reconfigure(errors="replace")
        except (AttributeError, ValueError, OSError):  # not a TextIOWrapper (a test's capture): leave it
            pass


def main() -> None:
    from rollingkv_cli.lib.procs import stop_signals_raise

    _tolerant_output()
    try:
        with stop_signals_raise():  # SIGTERM and SIGHUP unwind as Ctrl-C does: every command cleans up after each
            rv = rollingkv.main(standalone_mode=False)
        # without standalone mode click hands ctx.exit(code) back as a return value
        if isinstance(rv, int) and rv != 0:
            sys.exit(rv)
    except RollingKVError as err:
        print_error(err)
        sys.exit(err.code)
    except (click.exceptions.Abort, KeyboardInterrupt) as err:  # click wraps an interrupt in its Abort
        _stopped(err)
    except click.ClickException as err:
        _show_visibly(err)
        sys.exit(err.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except BrokenPipeError:
        # the reader went away (`rollingkv ... | head`): stop quietly; flushing at exit would fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except Exception as err:  # the last resort: every expected failure is a RollingKVError with its own message
        _internal_error(err)


def _show_visibly(err: click.ClickException) -> None:
    """click's own error line, with a control character of the user's value (a newline, ESC in a path) escaped as our
    lines have them (console.visible): `model synth $'a\\nb'` was an error in two lines."""
    from rollingkv_cli.console import visible

    message = err.format_message
    err.format_message = lambda: visible(message())
    err.show()


def _stopped(err: BaseException) -> None:
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) after the command cleaned up: one line naming it, and the shell's
    status for it, 128 + its number (130, 143, 129). An Abort without a signal (click's prompt ended) says so, 130."""
    from rollingkv_cli.lib.procs import signal_name, stop_signum

    signum = stop_signum(err)
    if signum is None:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    print("interrupted (SIGINT)" if signum == 2 else f"stopped by {signal_name(signum)}", file=sys.stderr)
    sys.exit(128 + signum)


def _internal_error(err: Exception) -> None:
    from rollingkv_cli.lib import paths
    from rollingkv_cli.console import err_console, text, visible

    if os.environ.get(paths.ENV_TRACEBACK, "").strip() not in ("", "0", "false", "no", "off"):
        raise err
    first = visible((str(err).strip().splitlines() or [""])[0])
    err_console.print(text(f"internal error: {type(err).__name__}: {first}".rstrip(": "), style="bold red"), soft_wrap=True)
    err_console.print(text(f"hint: this is a bug in rollingkv; please report it with the full traceback, which "
                           f"{paths.ENV_TRACEBACK}=1 shows (run the command again with it set)", style="dim"), soft_wrap=True)
    sys.exit(1)
