"""The hybrid tail's CPU decode attention on AArch64, under emulation (scripts/check-neon.sh): the NEON path with the
dot-product extension (vdotq_s32) and without it (vmull/vpadal), each against the decode test's double-precision
reference. The test fails unless the kernel picked the NEON path by itself (rkv_cpu_decode_isa) and every case passed;
it is skipped, saying why, where the cross compiler or qemu-aarch64 is missing, and fails there instead when the run
expects the NEON paths ($ROLLINGKV_EXPECT_ISA=neon,neon-dotprod, as .ci/run sets it). Seen failing on this x86-64 host
without the tools: `ROLLINGKV_EXPECT_ISA=neon python -m pytest tests/test_check_neon.py` (skipped without the variable)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import isa

pytestmark = pytest.mark.build  # the pinned llama.cpp source, which the build fetches

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("aarch64-linux-gnu-g++", "aarch64-linux-gnu-gcc", "qemu-aarch64", "cmake", "ninja")


def test_the_neon_paths_match_double_precision_under_qemu(request, tmp_path):
    missing = [t for t in TOOLS if not shutil.which(t)]
    if missing:  # a skip, or a failure where the run expects the NEON paths ($ROLLINGKV_EXPECT_ISA, as CI does: tests/isa.py)
        isa.unavailable(("neon", "neon-dotprod"), f"{', '.join(missing)} not found: the NEON path is checked under emulation "
                        "(apt-get install g++-aarch64-linux-gnu qemu-user)")
    request.getfixturevalue("cpu_build")  # the build fetched the pinned source the script checks out
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "check-neon.sh"), str(tmp_path / "neon")],
                          capture_output=True, text=True, timeout=3000, env={**os.environ, "PYTHON": sys.executable})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for path in ("neon-dotprod", "neon"):
        assert re.search(rf"^default isa: {path}$", out, re.M), f"the kernel did not pick the {path} path:\n{out[-3000:]}"
        m = re.search(rf"^isa {path}: 252 cases, 0 failed, worst relative error (\S+)$", out, re.M)
        assert m and float(m.group(1)) < 2e-6, out[-3000:]
    assert out.count("isa scalar: 252 cases, 0 failed") == 1
    assert "check-neon: passed" in out
