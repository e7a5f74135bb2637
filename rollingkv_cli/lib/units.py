"""Sizes for people to read, shared by every command that reports one (no imports: anything may use it)."""

from __future__ import annotations


def human_bytes(n: int) -> str:
    if n >= 2**40:
        return f"{n / 2**40:.1f} TiB"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"
