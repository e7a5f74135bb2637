"""bench tail's setup as functions (bench/tail_setup.py), called without click: the configuration and cells from the
options, the CPU fractions the hybrid cells get, and what a dry run prints.

Seen failing: with hybrid_fractions returning the fractions on a CPU build, test_no_hybrid_cells_on_a_cpu_build (a hybrid
cell among the cells); with print_dry_run wrapping the commands, the dry-run test (a command split over lines).
"""

from __future__ import annotations

import pytest

from rollingkv_cli.bench import tail_setup
from rollingkv_cli.console import EXIT_USAGE, RollingKVError

OPTIONS = dict(depths=[1024], n_gen=8, reps=1, vanilla_reps=None, tail_types=["f16", "q8_0"], fractions=[0.0, 0.5],
               mixed_fractions=[0.5], cpu_fracs=["auto"], cpu_fracs_explicit=False, head_fractions=[0.5], window_type="f16",
               vanilla_bench=None, skip=(), threads=2, slot_ring_mib=None, pcie_bw_gbps=None, gpu_index=0, cell_timeout=None,
               time_budget=None, dry_run=True, plot=False)


@pytest.fixture
def run(cpu_build, demo_model, monkeypatch, tmp_path):
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    return tail_setup.prepare(str(demo_model), out=tmp_path / "r.json", **OPTIONS)


@pytest.mark.build
def test_no_hybrid_cells_on_a_cpu_build(run):
    kinds = [c["kind"] for c in run.doc["cells"]]
    assert run.cfg.backend == "CPU" and run.cfg.cpu_fracs == [] and "hybrid" not in kinds
    assert {"resident", "window", "head"} <= set(kinds)
    assert not any("--kv-tail-cpu-frac" in c["command"] for c in run.doc["cells"])
    (head,) = [c for c in run.doc["cells"] if c["kind"] == "head" and c["tail_type"] == "f16"]
    assert "--kv-residency-mode head --kv-device-heads 2 -ctkt f16 -ctvt f16" in head["command"]  # round(0.5 x 3) heads


@pytest.mark.build
def test_dry_run_prints_every_command_whole(run, capsys):
    tail_setup.print_dry_run(run.doc)
    out = capsys.readouterr().out
    commands = [line for line in out.splitlines() if "llama-bench" in line and " -m " in line]
    assert len(commands) == len(run.doc["cells"]) and all(c["command"] in out for c in run.doc["cells"])


def test_hybrid_fractions_on_a_cpu_build():
    assert tail_setup.hybrid_fractions(["auto"], explicit=False, backend="CPU", build=None) == []
    with pytest.raises(RollingKVError, match="need a CUDA build") as e:
        tail_setup.hybrid_fractions([0.5], explicit=True, backend="CPU", build=None)
    assert e.value.code == EXIT_USAGE
    assert tail_setup.hybrid_fractions([], explicit=True, backend="CPU", build=None) == []
