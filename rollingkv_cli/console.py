"""One rich wrapper for every kind of output, and clean exits without tracebacks.

Messages are plain text: paths, model names, log lines and hints like `pip install 'rollingkv[plot]'` hold
brackets that rich would read as markup (and drop, or fail on: `[/]` in a path). So every helper here
prints its message literally; a caller that wants our styling says so with markup=True, and escapes what
it interpolates with `esc`.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from rich.console import Console
from rich.markup import escape as esc  # noqa: F401  (re-exported: f"[dim]{esc(path)}[/]")
from rich.text import Text

def _console(stderr: bool = False) -> Console:
    """Rich's console, except that output to a file or a pipe is never hard-wrapped: rich wraps at 80 columns when it
    does not write to a terminal, and redirected output came out cut mid-phrase ("K/V" / "f16/f16"). Tables and panels
    keep their width."""
    c = Console(stderr=stderr, highlight=False)
    if c.width < 1:  # COLUMNS=0 (set so by some scripts and CI runners): rich printed every line empty, errors included
        c = Console(stderr=stderr, highlight=False, width=80)
    if not c.is_terminal:
        c.soft_wrap = True
    return c


console = _console()
err_console = _console(stderr=True)

# Exit status of a bad setting: a value out of range or of the wrong kind, or settings that contradict each
# other, whether from a flag or from a config file, as far as the settings alone tell. 2 because click already
# exits 2 for every flag value it checks itself (types, choices, ranges) and the commands document 2 as the
# usage error: one code wherever the value was given. 1 is every other failure, including what needs a look
# beyond the settings (a file that cannot be read, a bad environment variable, the model, the build, a port).
EXIT_USAGE = 2


class RollingKVError(Exception):
    """An expected failure: printed as one line plus a hint, never as a traceback."""

    def __init__(self, message: str, hint: str | None = None, code: int = 1, markup: bool = False):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.code = code
        self.markup = markup


def abort(message: str, hint: str | None = None, code: int = 1, markup: bool = False) -> NoReturn:
    raise RollingKVError(message, hint, code, markup)


def usage_error(message: str, hint: str | None = None) -> NoReturn:
    """A bad setting value (see EXIT_USAGE), in our one-line format."""
    raise RollingKVError(message, hint, EXIT_USAGE)


def text(message: str, markup: bool = False, style: str | None = None) -> Text:
    """The message as a rich Text: literal unless markup=True."""
    t = Text.from_markup(message) if markup else Text(message)
    if style:
        t.stylize(style)
    return t


def visible(message: str) -> str:
    """message with each character a terminal would act on or hide (a NUL, a newline, ESC, other controls, an invisible
    separator) written as Python escapes it (`\\x00`, `\\n`, `\\x1b`, `\\u2028`): a model path holding one was printed
    raw, an error in two lines or an escape sequence the terminal ran. A byte of a path that is not UTF-8 (a surrogate
    escape of the file system's encoding) is written as that byte, `\\xff`. Spaces and printable text stay as they are."""
    if message.isprintable():
        return message
    return "".join(ch if ch.isprintable() else f"\\x{ord(ch) - 0xDC00:02x}" if 0xDC80 <= ord(ch) <= 0xDCFF
                   else repr(ch)[1:-1] for ch in message)


def _line(label: str, label_style: str, message: str, markup: bool) -> Text:
    return Text.assemble((label, label_style), " ", text(visible(message), markup))


def print_error(err: RollingKVError) -> None:
    err_console.print(_line("error:", "bold red", err.message, err.markup), soft_wrap=True)
    if err.hint:
        err_console.print(_line("hint:", "dim", err.hint, err.markup), soft_wrap=True)


def warn(message: str, markup: bool = False) -> None:
    err_console.print(_line("warning:", "yellow", message, markup), soft_wrap=True)


def info(message: str, markup: bool = False, style: str | None = None) -> None:
    console.print(text(message, markup, style), soft_wrap=True)


def note(message: str) -> None:
    """A dim side remark (what a step does, where its log is); usable as a `log=` callback."""
    info(message, style="dim")


def success(message: str, markup: bool = False) -> None:
    console.print(_line("✓", "green", message, markup), soft_wrap=True)


def log_panel(body: str, title: str, target: Console | None = None) -> None:
    """The last lines of a child's log in a red panel, printed literally (logs are full of brackets)."""
    from rich.panel import Panel

    body = body.rstrip()
    if body:
        # wrapped inside the box even where the console does not hard-wrap (a file, a pipe): cropped otherwise
        (target or err_console).print(Panel(Text(body), title=Text(title), title_align="center", border_style="red"), soft_wrap=False)


def is_interactive() -> bool:
    return sys.stdout.isatty()
