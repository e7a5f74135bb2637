"""One rich wrapper for every kind of output, and clean exits without tracebacks."""

from __future__ import annotations

import sys
from typing import NoReturn

from rich.console import Console

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


class RollingKVError(Exception):
    """An expected failure: printed as one line plus a hint, never as a traceback."""

    def __init__(self, message: str, hint: str | None = None, code: int = 1):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.code = code


def abort(message: str, hint: str | None = None, code: int = 1) -> NoReturn:
    raise RollingKVError(message, hint, code)


def print_error(err: RollingKVError) -> None:
    err_console.print(f"[bold red]error:[/] {err.message}", soft_wrap=True)
    if err.hint:
        err_console.print(f"[dim]hint:[/] {err.hint}", soft_wrap=True)


def warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {message}", soft_wrap=True)


def info(message: str) -> None:
    console.print(message, soft_wrap=True)


def success(message: str) -> None:
    console.print(f"[green]✓[/] {message}", soft_wrap=True)


def is_interactive() -> bool:
    return sys.stdout.isatty()
