"""CI states the instruction-set paths it must exercise, and a test of a stated path fails (not skips) where it cannot
run (tests/isa.py, .ci/run). Outside CI ($ROLLINGKV_EXPECT_ISA unset) a missing path still skips, saying why."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import isa

REPO = Path(__file__).resolve().parent.parent
CI_RUN = REPO / ".ci" / "run"


def _ci_isas(text: str) -> set[str]:
    m = re.search(r'^CI_ISAS="([^"]*)"$', text, re.M)
    assert m, ".ci/run declares no CI_ISAS"
    assert re.search(r'^export ROLLINGKV_EXPECT_ISA="\$\{ROLLINGKV_EXPECT_ISA-\$CI_ISAS\}"$', text, re.M), \
        ".ci/run does not export its list as ROLLINGKV_EXPECT_ISA"
    return isa.parse(m.group(1))


def _install_condition(text: str) -> str:
    """The test that decides whether .ci/run installs the NEON check's tools (the first `if` naming qemu-aarch64)."""
    return next(line for line in text.splitlines() if line.lstrip().startswith("if ") and "qemu-aarch64" in line)


def _installs_when_any_is_missing(cond: str) -> bool:
    from test_check_neon import TOOLS

    aarch64 = [t for t in TOOLS if "aarch64" in t]
    return all(f"! command -v {t} " in cond for t in aarch64)


def test_ci_demands_every_path_the_tests_can_exercise():
    """.ci/run lists every known path (x86: scalar, AVX2, AVX-512, VNNI, AMX; NEON and NEON+dotprod under qemu) and
    exports the list; a list that left one out, or a name the tests do not know, fails here."""
    assert _ci_isas(CI_RUN.read_text()) == set(isa.KNOWN)
    with pytest.raises(ValueError, match="unknown instruction set"):
        isa.parse("avx2,avx512_vnni")


def test_ci_installs_the_neon_tools_whenever_one_is_missing():
    """The install ran only when qemu-aarch64 was absent: a runner with qemu but no cross compiler skipped the NEON check.
    Seen failing on that .ci/run (its condition is checked below as the bite)."""
    assert _installs_when_any_is_missing(_install_condition(CI_RUN.read_text()))
    old = ('if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v qemu-aarch64 >/dev/null; then\n')
    assert not _installs_when_any_is_missing(_install_condition(old))


def test_a_missing_path_skips_outside_ci_and_fails_where_expected(monkeypatch):
    monkeypatch.delenv(isa.ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no qemu"):
        isa.unavailable(("neon", "neon-dotprod"), "no qemu")
    monkeypatch.setenv(isa.ENV, "avx2 neon-dotprod")
    with pytest.raises(pytest.fail.Exception, match="expects the neon-dotprod path to run, but no qemu"):
        isa.unavailable(("neon", "neon-dotprod"), "no qemu")
    with pytest.raises(pytest.skip.Exception):
        isa.unavailable("amx", "no AMX")
    monkeypatch.setenv(isa.ENV, "avx512_vnni")  # a typo must not demand nothing
    with pytest.raises(pytest.fail.Exception, match="unknown instruction set"):
        isa.unavailable("amx", "no AMX")


def test_the_amx_tests_fail_without_amx_where_ci_expects_it(monkeypatch):
    from rollingkv_cli.hw import hostinfo
    from test_amx import require_amx

    monkeypatch.setattr(hostinfo, "has_amx", lambda: False)
    monkeypatch.delenv(isa.ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="has no AMX"):
        require_amx()
    monkeypatch.setenv(isa.ENV, ",".join(isa.KNOWN))
    with pytest.raises(pytest.fail.Exception, match="expects the amx path"):
        require_amx()
