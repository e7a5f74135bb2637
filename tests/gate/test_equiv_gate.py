"""gate equiv's work as functions (gate/equiv_gate.py), called without click: prepare's checks and defaults, and one whole
run on the demo model through decode, judge and build_report.

Seen failing: with prepare leaving head mode's device heads unset, test_prepare_fills_in_the_defaults; with judge's
verdict forced to fail, test_a_whole_run. The control and the baseline need --tail-baseline: tests/gate/test_equiv.py
holds them through the command.
"""

from __future__ import annotations

import pytest

from rollingkv_cli.console import RollingKVError
from rollingkv_cli.gate import equiv_gate


@pytest.mark.build
def test_prepare_fills_in_the_defaults(cpu_build, demo_model, tmp_path):
    o = equiv_gate.EquivOptions(model_spec=str(demo_model), mode="head", build_dir=cpu_build.dir, work_dir=tmp_path, threads=2)
    s = equiv_gate.prepare(o)
    assert s.synthetic_tokens == 2048 and s.kv_device_heads == 1  # the most streamed head split
    assert s.cand_residency["mode"] == "head" and s.cand_residency["device_heads"] == 1
    assert s.ref_residency == {"mode": "off"} and s.ref_lib == cpu_build.lib_dir
    assert s.profile == "same_type" and s.thresholds["require_bitwise"] and not s.order_floor  # the CPU: bit-identity


def test_prepare_refuses_contradictions_before_any_work(isolated_cache, fake_gguf):
    with pytest.raises(RollingKVError, match="does not make: use head") as e:
        equiv_gate.prepare(equiv_gate.EquivOptions(model_spec=str(fake_gguf), mode="window", kv_device_heads=1))
    assert e.value.code == 2
    with pytest.raises(RollingKVError, match="--needle goes with auto tail types"):
        equiv_gate.prepare(equiv_gate.EquivOptions(model_spec=str(fake_gguf), needle=True))


@pytest.mark.build
def test_a_whole_run(cpu_build, demo_model, tmp_path):
    o = equiv_gate.EquivOptions(model_spec=str(demo_model), synthetic_tokens=256, n_ctx=512, kv_window_cells=128, threads=2,
                                build_dir=cpu_build.dir, work_dir=tmp_path)
    setup = equiv_gate.prepare(o)
    runs = equiv_gate.decode(setup)
    verdict = equiv_gate.judge(setup, runs)
    assert verdict.passed and verdict.needle_report is None and equiv_gate.failures(verdict) == []
    assert runs.n_tokens == 256 and runs.summary["tail_positions"] > 0 and runs.summary["window_cells"] == 128
    report = equiv_gate.build_report(setup, runs, verdict)
    assert report["verdict"] == "pass" and report["candidate"]["residency"]["window_cells"] == 128
    assert report["tokens"]["n"] == 256 and report["n_ctx"] == 512 and len(report["commands"]) >= 3
