"""CI states the instruction-set paths it must exercise, and a test of a stated path fails (not skips) where it cannot
run (tests/isa.py, .ci/run). Outside CI ($ROLLINGKV_EXPECT_ISA unset) a missing path still skips, saying why."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import isa

REPO = Path(__file__).resolve().parent.parent
CI_RUN = REPO / ".ci" / "run"


CI_ISAS_SH = REPO / ".ci" / "isas.sh"

# /proc/cpuinfo flag lines of the runners CI has met (trimmed to the flags that matter, plus neighbours)
XEON_AMX = ("fpu sse2 avx avx2 fma f16c avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16 "
            "avx512_fp16 amx_bf16 amx_tile amx_int8")
EPYC_ZEN4 = "fpu sse2 avx avx2 fma f16c avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16"
AVX2_ONLY = "fpu sse2 avx avx2 fma f16c"


def _isas_for(tmp_path: Path, flags: str) -> tuple[set[str], str]:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    proc = subprocess.run(["bash", str(CI_ISAS_SH), str(cpuinfo)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return isa.parse(proc.stdout), proc.stderr


def test_ci_exports_the_list_its_runner_must_exercise():
    text = CI_RUN.read_text()
    assert re.search(r'^CI_ISAS="\$\(\.ci/isas\.sh\)"$', text, re.M), ".ci/run does not take its list from .ci/isas.sh"
    assert re.search(r'^export ROLLINGKV_EXPECT_ISA="\$\{ROLLINGKV_EXPECT_ISA-\$CI_ISAS\}"$', text, re.M), \
        ".ci/run does not export its list as ROLLINGKV_EXPECT_ISA"


def test_ci_demands_every_path_the_runners_cpu_has(tmp_path):
    """An AMX Xeon must exercise every known path; an AMD EPYC every one but AMX; an AVX2-only CPU scalar, AVX2 and
    NEON. What is left out is named with its reason. (CI once hard-coded the Xeon's list, and failed on an EPYC.)"""
    every, err = _isas_for(tmp_path, XEON_AMX)
    assert every == set(isa.KNOWN) and err == ""
    epyc, err = _isas_for(tmp_path, EPYC_ZEN4)
    assert epyc == set(isa.KNOWN) - {"amx"}
    assert err.strip() == "ci: not on this runner: amx (the CPU lacks amx_tile or amx_int8)"
    plain, err = _isas_for(tmp_path, AVX2_ONLY)
    assert plain == {"scalar", "avx2", "neon", "neon-dotprod"}
    assert "avx512vnni" in err and "amx" in err
    # one flag short of AVX-512 (no DQ): neither AVX-512 path is demanded
    short, _ = _isas_for(tmp_path, EPYC_ZEN4.replace(" avx512dq", ""))
    assert short == {"scalar", "avx2", "neon", "neon-dotprod"}
    # a flag's name inside another's is not the flag
    assert "amx" not in _isas_for(tmp_path, EPYC_ZEN4 + " xamx_tile amx_int8x")[0]


def test_ci_demands_what_this_machine_has():
    """On this machine, the list agrees with what the tests' own checks find (hostinfo reads the same /proc/cpuinfo)."""
    from rollingkv_cli.hw import hostinfo

    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo")
    proc = subprocess.run(["bash", str(CI_ISAS_SH)], capture_output=True, text=True, timeout=30)
    got = isa.parse(proc.stdout)
    assert ("amx" in got) == hostinfo.has_amx()
    assert ("avx512vnni" in got) == ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= hostinfo.cpu_flags())


def _install_condition(text: str) -> str:
    """The test that decides whether .ci/run installs the NEON check's tools (the first `if` naming qemu-aarch64)."""
    return next(line for line in text.splitlines() if line.lstrip().startswith("if ") and "qemu-aarch64" in line)


def _installs_when_any_is_missing(cond: str) -> bool:
    from test_check_neon import TOOLS

    aarch64 = [t for t in TOOLS if "aarch64" in t]
    return all(f"! command -v {t} " in cond for t in aarch64)


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
