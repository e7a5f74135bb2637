"""The proof that a hybrid tail's CPU part ran counts the ops' parts alone: the planner's calibration of the CPU
attention and a backend's hand-off probe run parts of their own (flagged calib), counted apart. Before, both bumped the
one counter that `bench tail`, the device checks and the GPU tests read, so an auto cell whose decode ran no CPU part
passed on the calibration's parts (issue 36: 1). Seen failing with the calib flag ignored in rkv_cpu_part_run: the
calibration's four parts counted as op parts."""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.build


def test_calibration_parts_are_not_op_parts(cpu_build):
    binary = cpu_build.artifact("test-rolling-kv-cpu-decode")
    proc = subprocess.run([str(binary), "--part-counts"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["calibration"]["runs"] == 0 and r["calibration"]["calib_runs"] >= 4, r  # a warm-up and three timed runs
    assert r["op_part"] == {"runs": 1, "calib_runs": 0}, r
    assert r["calib_part"] == {"runs": 0, "calib_runs": 1}, r
    # the calibration at 4 rows per cell (auto's slowdown per row count): calibration parts, a bandwidth; 0 rows and 9
    # (more than a CPU part takes) refused before any part runs
    assert r["rows4"]["gbps"] > 0 and r["rows4"]["runs"] == 0 and r["rows4"]["calib_runs"] >= 4, r
    assert r["refused"] == {"gbps": [-1.0, -1.0], "calib_runs": 0}, r
