"""The `gate` click group; each subcommand is a module here (equiv, needle, vram, matrix)."""

from __future__ import annotations

import click

from rollingkv_cli.gate.cli.equiv import equiv
from rollingkv_cli.gate.cli.matrix import matrix
from rollingkv_cli.gate.cli.needle import needle
from rollingkv_cli.gate.cli.vram import vram


@click.group(short_help="Check the split cache against the resident run.")
def gate() -> None:
    """Check the split KV cache against the fully resident run.

    \b
    equiv   teacher-forced next-token distributions, split vs resident
    needle  a fact placed in the host tail is retrieved exactly as resident
    vram    device memory stays within --vram-target + 200 MiB (GPU only)
    matrix  equiv over tail types x split points, plus needle; JSON + markdown
    """


for _cmd in (equiv, needle, vram, matrix):
    gate.add_command(_cmd)
