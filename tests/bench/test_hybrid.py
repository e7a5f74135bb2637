"""`rollingkv bench tail`'s hybrid cells (issue 16): the CPU part at auto and at fixed fractions through llama-bench's
--kv-tail-cpu-frac, the link figure the auto cells' plan gets (measured, or a simulated one with --pcie-bw-gbps), the
CPU attention measured in the run by the build's library (a stand-in libllama compiled here), the third floor and its
serial form, the targets, --resume, and the refusals (CPU build, a build before the hybrid tail, bad fractions). A fake
llama-bench; the real one: tests/test_hybrid_tail.py."""

from __future__ import annotations

import json
import sys

import pytest

from rollingkv_cli.bench import arithmetic as bm
from test_cli import run_main
from hw.test_cpu_attn import _standin_lib

# resident 100 tok/s, a GPU-only split 50, a hybrid split 80; the chosen CPU share of an auto cell: 40 / (40 + link)
FAKE_BENCH = r"""#!{python}
import json, sys
a = sys.argv[1:]
def get(flag, default=None):
    return a[a.index(flag) + 1] if flag in a else default
n, d, w = int(get("-n")), int(get("-d")), int(get("--kv-window-cells", "0"))
mode = get("--kv-residency-mode", "auto")
kv = -(-(d + n) // 256) * 256
split = mode == "window" and 0 < w < kv
cpu = get("--kv-tail-cpu-frac")
on = cpu is not None and (cpu == "auto" or float(cpu) > 0)  # the window cells ask for 0: GPU-only
ts = (80.0 if on else 50.0) if split else 100.0
row = {{"n_prompt": 0, "n_gen": n, "n_depth": d, "avg_ts": ts, "stddev_ts": 0.5, "samples_ts": [ts], "kv_mode": mode,
       "kv_mode_chosen": "window" if split else "resident", "window_cells": w if split else 0,
       "tail_cells": kv - w if split else 0, "type_k_tail": get("-ctkt", "f16"), "type_v_tail": get("-ctvt", "f16"),
       "backends": "FAKE", "n_gpu_layers": int(get("-ngl", "99")), "n_threads": int(get("-t", "4"))}}
if cpu is not None:  # as llama-bench writes them: "auto", or the request as %f
    row["kv_tail_cpu_frac"] = cpu if cpu == "auto" else "%f" % float(cpu)
    link = float(get("--pcie-bw-gbps", "0") or 0)
    row["kv_tail_cpu_frac_chosen"] = (40.0 / (40.0 + link) if link > 0 else 0.5) if cpu == "auto" else float(cpu)
if on and split:  # libllama's CPU part statistics at exit (ROLLINGKV_CPU_PART_STATS, which the bench sets)
    import os
    assert os.environ.get("ROLLINGKV_CPU_PART_STATS") == "1"
    runs = int(os.environ.get("FAKE_CPU_PART_RUNS", "56"))  # 0: a build whose CPU part never ran
    print(f"rolling KV: CPU part: {{runs}} runs, 500.0 us each (p50 490.0, p90 520.0, max 900.0), 60.0 GB/s of K+V", file=sys.stderr)
    print("rolling KV: CPU part: per part, the last thread started 3.0 us after the post", file=sys.stderr)
print(json.dumps([row]))
"""


@pytest.fixture
def cuda_build(tmp_path, monkeypatch, isolated_cache):
    """The active build: a CUDA one whose llama-bench is FAKE_BENCH and whose libllama is the API 4 stand-in
    (f16 10 GB/s per thread, q8_0 5, q4_0 unsupported). .api(3) makes a build whose library predates the hybrid tail
    the active one: another directory, as the command loads the library in-process to look for the calibration (a
    library overwritten in place under that mapping crashes the interpreter at exit)."""
    from rollingkv_cli.lib import builder
    from rollingkv_cli.bench import tail as bench_tail

    state = {"cuda": True, "dir": None}

    def api(n: int) -> None:
        bdir = tmp_path / f"cudabuild-api{n}"
        bin_dir = bdir / "build" / "bin"
        bin_dir.mkdir(parents=True)
        exe = bin_dir / "llama-bench"
        exe.write_text(FAKE_BENCH.format(python=sys.executable))
        exe.chmod(0o755)
        (tmp_path / f"api{n}").mkdir()
        (bin_dir / "libllama.so").write_bytes((_standin_lib(tmp_path / f"api{n}", n) / "libllama.so").read_bytes())
        state["dir"] = bdir

    api(4)
    monkeypatch.setattr(builder, "active_build",
                        lambda required=True: builder.Build(state["dir"], {"options": {"cuda": state["cuda"]}, "series_hash": "fake"}))
    link = {"gbps": 20.0}

    def measured(gpu, explicit, lib_dir):
        if explicit is not None:
            return {"gbps": float(explicit), "source": "explicit", "note": "given with --pcie-bw-gbps, not measured"}
        return {"gbps": link["gbps"], "source": "measured", "note": "fake link"}

    monkeypatch.setattr(bench_tail, "measure_bandwidth", measured)
    monkeypatch.setenv("COLUMNS", "300")

    class B:
        pass

    b = B()
    b.api, b.state, b.link = api, state, link
    return b


@pytest.fixture
def tiny(tmp_path):
    from rollingkv_cli import models

    return models.write_synthetic(tmp_path / "tiny.gguf", models.SynthSpec(layers=2, embd=128, heads=2, kv_heads=1, ff=256, vocab=300, ctx=4096))


ROW = {"f16": 2 * 2 * 64 * 2, "q8_0": 2 * 2 * 2 * 34, "q4_0": 2 * 2 * 2 * 18}  # 2 layers x (K + V) x 64 elements


def _run(capsys, tiny, out, *extra):
    return run_main(["bench", "tail", str(tiny), "-d", "1020", "-n", "4", "-r", "1", "-t", "3", "--fractions", "0,0.5,1",
                     "--tail-types", "f16,q8_0,q4_0", "--skip", "nkvo", "--json", str(out), "--no-plot", *extra], capsys)


def test_hybrid_cells_floors_and_targets(capsys, cuda_build, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLINGKV_CPU_PART_THREADS", "3")  # the CPU part's threads, whatever -t (here 3) says
    from rollingkv_cli.hw import cpu_attn

    monkeypatch.setattr(cpu_attn.os, "sched_getaffinity", lambda pid: set(range(16)))  # 3 threads: at most the process's CPUs
    out = tmp_path / "h.json"
    code, stdout, err = _run(capsys, tiny, out, "--cpu-fracs", "auto,0.25")
    assert code == 0, err
    doc = json.loads(out.read_text())
    hyb = [c for c in doc["cells"] if c["kind"] == "hybrid"]
    # every window cell with a tail (f16 50%, f16 100%, q8_0 50%, q4_0 50%) at auto and at 25%; auto first
    assert len(hyb) == 8 and [c["cpu_frac"] for c in hyb[:4]] == ["auto"] * 4 and all(c["status"] == "ok" for c in hyb)
    assert {(c["tail_type"], c["window_cells"]) for c in hyb} == {("f16", 512), ("f16", 256), ("q8_0", 512), ("q4_0", 512)}
    by = {c["id"]: c for c in doc["cells"]}
    auto = by["d1020/hybrid/f16/w512/cpuauto"]
    fixed = by["d1020/hybrid/f16/w512/cpu0.25"]
    window = by["d1020/window/f16/w512"]
    # the split of its window cell (which asks for no CPU part: GPU-only), with the CPU part instead; the auto cell's plan
    # gets the link the floors use (measured here)
    assert window["command"].endswith(" --kv-tail-cpu-frac 0")
    assert window["command"].removesuffix(" --kv-tail-cpu-frac 0") + " --kv-tail-cpu-frac auto --pcie-bw-gbps 20" == auto["command"]
    assert auto["command_key"].endswith("--kv-tail-cpu-frac auto --pcie-bw-gbps MEASURED") and auto["plan_link"]["source"] == "measured"
    assert fixed["command"].endswith("--kv-residency-mode window --kv-window-cells 512 -ctkt f16 -ctvt f16 --kv-tail-cpu-frac 0.25")
    assert auto["label"] == "hybrid f16 50% tail, CPU auto" and fixed["label"] == "hybrid f16 50% tail, CPU 25%"
    assert auto["cpu_frac_chosen"] == pytest.approx(40 / 60) and fixed["cpu_frac_chosen"] == 0.25
    assert auto["plan"]["kv_tail_cpu_frac"] == "auto"
    # the CPU attention, measured in the run at the CPU part's 3 threads through the library (the stand-in: 10 GB/s per
    # thread for f16)
    ca = doc["cpu_attn"]
    assert ca["gbps"] == {"f16": 30.0, "q8_0": 15.0, "q4_0": None} and ca["n_threads"] == 3 and ca["source"] == "measured"
    assert "CPU part" in ca["threads_source"] and "not -t" in ca["threads_source"]
    # each hybrid cell keeps the CPU part's statistics (where its time went); a GPU-only cell has none
    assert auto["cpu_part_stats"][0].startswith("rolling KV: CPU part: 56 runs") and len(auto["cpu_part_stats"]) == 2
    assert "cpu_part_stats" not in window
    assert ca["expected_auto_frac"] == {"f16": pytest.approx(30 / 50, abs=1e-4), "q8_0": pytest.approx(15 / 35, abs=1e-4)}
    # the third floor: the tail over link + CPU together, and its serial form
    t_res, t = 0.01, 1 / 80
    tail = (1024 - 512) * ROW["f16"]
    assert auto["tail_bytes_per_token"] == tail
    h_serial, h_over = t_res + tail / 50e9, max(t_res, tail / 50e9)
    assert auto["hybrid_floor_ms"] == pytest.approx(h_over * 1e3) and auto["hybrid_serial_floor_ms"] == pytest.approx(h_serial * 1e3)
    assert auto["ratio_hybrid"] == pytest.approx(t / h_over) and auto["ratio_hybrid_serial"] == pytest.approx(t / h_serial)
    assert auto["ratio_floor"] == pytest.approx(t / (t_res + tail / 20e9)) and auto["cpu_attn_gbps"] == 30.0
    # the floor a single sequence can reach: the CPU part after its layer's query (serial with the resident work), the
    # copies ahead across layers: min over f of max(t_res + f tail/cpu, (1 - f) tail/link), brute-forced here
    grid = [i / 10000 for i in range(10001)]
    f_best = min(grid, key=lambda f: max(t_res + f * tail / 30e9, (1 - f) * tail / 20e9))
    dep = max(t_res + f_best * tail / 30e9, (1 - f_best) * tail / 20e9)
    assert auto["hybrid_dependent_floor_ms"] == pytest.approx(dep * 1e3, rel=1e-3)
    assert auto["hybrid_dependent_share"] == pytest.approx(f_best, abs=2e-4)
    assert h_over <= dep <= h_serial and auto["ratio_hybrid_dependent"] == pytest.approx(t / dep, rel=1e-3)
    q8 = by["d1020/hybrid/q8_0/w512/cpuauto"]
    assert q8["hybrid_floor_ms"] == pytest.approx(max(t_res, (1024 - 512) * ROW["q8_0"] / 35e9) * 1e3)
    q4 = by["d1020/hybrid/q4_0/w512/cpuauto"]
    assert "hybrid_floor_ms" not in q4 and q4["ratio_floor"] is not None  # no CPU figure for q4_0: only the link floors
    assert "hybrid_floor_ms" not in window  # a GPU-only cell has no CPU part
    # the targets of issue 16 from these cells
    tg = {x["target"]: x for x in doc["targets"]}
    assert tg["hybrid_q8_0_gains"]["value"] == pytest.approx(80 / 50) and tg["hybrid_q8_0_gains"]["status"] == "met"
    assert tg["hybrid_vs_ngl"]["status"] == "info" and tg["hybrid_full_vs_floor"]["status"] == "info"  # not at 16384
    full = by["d1020/hybrid/f16/w256/cpuauto"]
    assert tg["hybrid_full_vs_floor"]["value"] == pytest.approx(full["ratio_floor"], abs=1e-4)
    assert "CPU attention: f16 30, q8_0 15, q4_0 -" in stdout and "x hybrid" in stdout and "auto 67%" in stdout


def test_resume_matches_the_auto_cells_by_their_link_source(capsys, cuda_build, tiny, tmp_path):
    out = tmp_path / "h.json"
    assert _run(capsys, tiny, out, "--cpu-fracs", "auto,0.5")[0] == 0
    cuda_build.link["gbps"] = 21.0  # measured again: another figure, the same cells
    code, stdout, err = _run(capsys, tiny, out, "--cpu-fracs", "auto,0.5", "--resume")
    assert code == 0 and "0 cells to run" in stdout, stdout + err
    # a simulated link is another plan: the auto hybrid cells run again, the rest is taken over
    code, stdout, err = _run(capsys, tiny, out, "--cpu-fracs", "auto,0.5", "--resume", "--pcie-bw-gbps", "6.5")
    assert code == 0, err
    doc = json.loads(out.read_text())
    again = [c for c in doc["cells"] if not c.get("resumed")]
    assert again and all(c["kind"] == "hybrid" and c["cpu_frac"] == "auto" for c in again) and len(again) == 4
    for c in again:
        assert c["command"].endswith("--kv-tail-cpu-frac auto --pcie-bw-gbps 6.5") and c["plan_link"] == {"gbps": 6.5, "source": "explicit"}
        assert c["cpu_frac_chosen"] == pytest.approx(40 / 46.5)
    assert doc["bandwidth"]["gbps"] == 6.5


def test_dry_run_shows_the_link_placeholder(capsys, cuda_build, tiny, tmp_path):
    code, stdout, _ = _run(capsys, tiny, tmp_path / "d.json", "--cpu-fracs", "auto", "--dry-run")
    assert code == 0 and "hybrid f16 50% tail, CPU auto" in stdout and "--pcie-bw-gbps MEASURED" in stdout
    assert not (tmp_path / "d.json").exists()


def test_dry_run_commands_are_whole_lines(capsys, cuda_build, tiny, tmp_path, monkeypatch):
    """Issue 27 (18): --dry-run's commands are for copying: each on a line of its own, whole, at any terminal width
    (they were folded inside a table column)."""
    import shlex

    monkeypatch.setenv("COLUMNS", "60")
    code, stdout, _ = _run(capsys, tiny, tmp_path / "d.json", "--dry-run")
    assert code == 0
    lines = stdout.splitlines()
    # the command lines (the line before the run that says what it does names llama-bench too)
    commands = [line for line in lines if line.split() and line.split()[0].endswith("llama-bench")]
    assert len(commands) >= 6 and all(len(c) > 60 for c in commands)
    for c in commands:
        argv = shlex.split(c)
        assert argv[0].endswith("llama-bench") and "-fa" in argv and "-d" in argv  # one whole command per line


def test_hybrid_auto_cells_by_default(capsys, cuda_build, tiny, tmp_path):
    """The CPU part's default is auto (the library's): the default run measures what users get, an auto hybrid cell next to
    each GPU-only window cell with a tail (--kv-tail-cpu-frac 0), and the CPU attention calibrated in the run."""
    from rollingkv_cli.bench import tail_grid

    assert tail_grid.DEFAULT_CPU_FRACS == ("auto",) and tail_grid.TailConfig(model=tiny, bench=tiny, build_dir=tmp_path, backend="CUDA",
                                                                              depths=[1020]).cpu_fracs == ["auto"]
    code, stdout, _ = _run(capsys, tiny, tmp_path / "d.json", "--dry-run")
    assert code == 0 and "--kv-tail-cpu-frac auto" in stdout and "MEASURED" in stdout
    out = tmp_path / "n.json"
    code, _, err = _run(capsys, tiny, out)
    assert code == 0, err
    doc = json.loads(out.read_text())
    hyb = [c for c in doc["cells"] if c["kind"] == "hybrid"]
    windows = [c for c in doc["cells"] if c["kind"] == "window"]
    assert doc["config"]["cpu_fracs"] == ["auto"] and hyb and all(c["cpu_frac"] == "auto" for c in hyb)
    assert {(c["tail_type"], c["window_cells"]) for c in hyb} == {("f16", 512), ("f16", 256), ("q8_0", 512), ("q4_0", 512)}
    assert windows and all(c["command"].endswith("--kv-tail-cpu-frac 0") for c in windows)
    assert doc["cpu_attn"]["source"] == "measured"


def test_no_hybrid_cells_where_there_is_no_cpu_part(capsys, cuda_build, tiny, tmp_path):
    out = tmp_path / "n.json"
    code, _, err = _run(capsys, tiny, out, "--cpu-fracs", "none")
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert not [c for c in doc["cells"] if c["kind"] == "hybrid"] and doc["config"]["cpu_fracs"] == []
    assert doc["cpu_attn"]["gbps"] is None and {t["status"] for t in doc["targets"] if t["target"].startswith("hybrid")} == {"n/a"}
    # a CPU build: none by default, refused when asked for
    cuda_build.state["cuda"] = False
    code, _, err = _run(capsys, tiny, out)
    assert code == 0, err
    cells = json.loads(out.read_text())["cells"]
    assert not [c for c in cells if c["kind"] == "hybrid"]
    assert not [c for c in cells if "--kv-tail-cpu-frac" in c["command"]]  # no hybrid tail on a CPU build: no flag at all
    code, _, err = _run(capsys, tiny, out, "--cpu-fracs", "0.5")
    assert code == 2 and "need a CUDA build" in err
    # a build before the hybrid tail: none and no word by default, an error when asked for
    cuda_build.state["cuda"] = True
    cuda_build.api(3)
    code, _, err = _run(capsys, tiny, out)
    assert code == 0 and "predates the hybrid tail" not in err, err
    assert not [c for c in json.loads(out.read_text())["cells"] if "--kv-tail-cpu-frac" in c["command"]]
    code, _, err = _run(capsys, tiny, out, "--cpu-fracs", "auto")
    assert code == 1 and "predates the hybrid tail" in err and "--cpu-fracs none" in err


@pytest.mark.parametrize("value,match", [("0", "outside (0, 1]"), ("1.5", "outside (0, 1]"), ("most", "neither auto nor a fraction")])
def test_bad_cpu_fracs_exit_2(capsys, isolated_cache, fake_gguf, value, match):
    code, _, err = run_main(["bench", "tail", str(fake_gguf), "--cpu-fracs", value], capsys)
    assert code == 2 and match in err, err


def test_cpu_fracs_parsing():
    from rollingkv_cli.bench.cli import _cpu_fracs

    assert _cpu_fracs(None, None, "auto, 25%,0.25,1,AUTO") == ["auto", 0.25, 1.0]
    assert _cpu_fracs(None, None, "") == [] and _cpu_fracs(None, None, "none") == []


def test_hybrid_floor_arithmetic():
    serial, over = bm.hybrid_floors(10e-3, 1.88e9, 54e9, 65e9)  # the H200's f16 tail at 16384: link + CPU together
    assert serial == pytest.approx(10e-3 + 1.88e9 / 119e9) and over == pytest.approx(max(10e-3, 1.88e9 / 119e9))
    assert bm.hybrid_floors(1e-3, 1e6, 1e9, 1e9) == bm.floors(1e-3, 1e6, 2e9)
    assert bm.cpu_share(6.5, 40.0) == pytest.approx(0.86, abs=0.005) and bm.cpu_share(25.0, 40.0) == pytest.approx(0.62, abs=0.005)
    with pytest.raises(ValueError):
        bm.hybrid_floors(1e-3, 1e6, 1e9, 0.0)
    with pytest.raises(ValueError):
        bm.cpu_share(0.0, 40.0)


def test_a_hybrid_cell_whose_cpu_part_never_ran_fails(capsys, cuda_build, tiny, tmp_path, monkeypatch):
    """Proof that the path ran: a hybrid cell that the plan gave a CPU share but whose process counted no CPU part (a
    build that streamed the whole tail) fails with the reason, instead of timing the GPU-only stream as the hybrid."""
    monkeypatch.setenv("ROLLINGKV_CPU_PART_THREADS", "3")
    from rollingkv_cli.hw import cpu_attn

    monkeypatch.setattr(cpu_attn.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("FAKE_CPU_PART_RUNS", "0")
    out = tmp_path / "h.json"
    code, stdout, err = _run(capsys, tiny, out, "--cpu-fracs", "0.25")
    doc = json.loads(out.read_text())
    hyb = [c for c in doc["cells"] if c["kind"] == "hybrid"]
    assert hyb and all(c["status"] == "failed" and c["cpu_part_runs"] == 0 and "no CPU part ran" in c["error"] for c in hyb)
    assert all(c["status"] == "ok" for c in doc["cells"] if c["kind"] == "window")
    assert code != 0


def test_cpu_part_runs_reads_the_stats_line():
    from rollingkv_cli.bench.tail import cpu_part_runs

    assert cpu_part_runs(["rolling KV: CPU part: 1234 runs, 5.0 us each", "rolling KV: CPU part: per part"]) == 1234
    assert cpu_part_runs(["rolling KV: CPU part: per part, the last thread"]) == 0 and cpu_part_runs([]) == 0


def test_an_auto_tail_type_cell_gets_the_measured_link(capsys, cuda_build, tiny, tmp_path):
    """An auto tail-type cell in a run without hybrid cells: its plan gets the link measured in the run, never the
    placeholder (which llama-bench refused: the cell failed on the H100, 2026-12-06)."""
    out = tmp_path / "a.json"
    code, stdout, err = run_main(["bench", "tail", str(tiny), "-d", "1020", "-n", "4", "-r", "1", "-t", "3", "--fractions", "0.5",
                                  "--tail-types", "f16,auto", "--cpu-fracs", "", "--skip", "nkvo", "--skip", "ngl",
                                  "--json", str(out), "--no-plot"], capsys)
    doc = json.loads(out.read_text())
    auto = next(c for c in doc["cells"] if c.get("tail_type") == "auto")
    assert "MEASURED" not in auto["command"] and auto["command"].endswith("--pcie-bw-gbps 20"), auto["command"]
    assert auto["plan_link"] == {"gbps": 20.0, "source": "measured"}
