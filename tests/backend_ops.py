"""Running upstream's test-backend-ops on the streaming op's cases (native/tests/test-backend-ops-rolling-kv.inc,
patch 0023), shared by tests/test_ops.py (the CPU against its reference path) and tests/test_gpu.py (CUDA0).

What test-backend-ops prints per case: "  STREAMING_FLASH_ATTN(<vars>): OK", "...: FAIL" (with the NMSE line
before it), or "...: not supported [<backend>]"; per backend "  P/N tests passed" (N: the cases that ran).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

OP = "STREAMING_FLASH_ATTN"
CASE = re.compile(rf"^\s*{OP}\((.*)\): (.*)$")
TOTAL = re.compile(r"^\s*(\d+)/(\d+) tests passed", re.M)


@dataclass
class Run:
    returncode: int
    ok: list[str]             # the cases' vars, by verdict
    failed: list[str]
    unsupported: list[str]
    passed: int               # test-backend-ops' own count: P of "P/N tests passed"
    ran: int                  # N
    stdout: str


def run(binary: Path, backend: str, timeout: float = 900) -> Run:
    proc = subprocess.run([str(binary), "-b", backend, "-o", OP], capture_output=True, text=True, timeout=timeout)
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)  # its verdicts are coloured
    ok, failed, unsupported = [], [], []
    for line in out.splitlines():
        m = CASE.match(line)
        if not m:
            continue
        verdict = m.group(2).strip()
        (ok if verdict == "OK" else unsupported if verdict.startswith("not supported") else failed).append(m.group(1))
    totals = TOTAL.findall(out)
    passed, ran = map(int, totals[-1]) if totals else (-1, -1)
    return Run(proc.returncode, ok, failed, unsupported, passed, ran, out + proc.stderr)
