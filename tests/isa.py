"""Which instruction-set paths a test run must exercise.

$ROLLINGKV_EXPECT_ISA lists them (comma- or space-separated names of KNOWN). `.ci/run` sets it from the list it declares,
so CI states what it checks: a test of a listed path FAILS where that path cannot run (the CPU lacks it, or the emulation
tools for NEON are missing) instead of passing or skipping as "not available". Unset (outside CI), a missing path
skips or is reported "not available" as before, saying why."""

from __future__ import annotations

import os
import re

import pytest

ENV = "ROLLINGKV_EXPECT_ISA"
# the paths the tests can exercise: the CPU decode attention's (tests/test_cpu_decode.py: scalar, avx2, avx512,
# avx512vnni; tests/test_check_neon.py under qemu: neon, neon-dotprod) and ggml's AMX weight path (tests/test_amx.py)
KNOWN = ("scalar", "avx2", "avx512", "avx512vnni", "amx", "neon", "neon-dotprod")


def parse(raw: str | None) -> set[str]:
    names = {w for w in re.split(r"[,\s]+", (raw or "").strip()) if w}
    unknown = sorted(names - set(KNOWN))
    if unknown:
        raise ValueError(f"{ENV}: unknown instruction set(s) {', '.join(unknown)} (known: {', '.join(KNOWN)})")
    return names


def expected() -> set[str]:
    """The paths this run must exercise ($ROLLINGKV_EXPECT_ISA); a bad name fails the test that asks."""
    try:
        return parse(os.environ.get(ENV))
    except ValueError as e:
        pytest.fail(str(e), pytrace=False)


def unavailable(isas: str | tuple[str, ...], why: str) -> None:
    """A path of ISAS cannot run here: fail when the run expects any of them, else skip saying WHY."""
    names = (isas,) if isinstance(isas, str) else isas
    wanted = [n for n in names if n in expected()]
    if wanted:
        pytest.fail(f"{ENV} expects the {'/'.join(wanted)} path{'s' if len(wanted) > 1 else ''} to run, but {why}", pytrace=False)
    pytest.skip(why)
