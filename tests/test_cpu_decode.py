"""The hybrid tail's CPU decode attention (native/ggml/src/ggml-cpu/rolling-kv-cpu-decode.*: the CPU
backend's, which the binary reaches through its registry), through its test binary.

Every instruction-set path this CPU has must run and match attention in double precision; a path is reported
"not available" only when /proc/cpuinfo lacks its features, so nothing passes because a feature is absent; and where
the run expects a path ($ROLLINGKV_EXPECT_ISA, which .ci/run sets: tests/isa.py), its absence fails the test."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from rollingkv_cli.console import RollingKVError

from rollingkv_cli.hw import hostinfo

import isa

pytestmark = pytest.mark.build

CASES_PER_ISA = 252


def _binary(cpu_build):
    b = cpu_build.artifact("test-rolling-kv-cpu-decode")
    assert b.is_file(), f"{b} was not built"
    return b


def _expected_isas() -> dict[str, bool]:
    flags = hostinfo.cpu_flags()
    return {"avx512vnni": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags,
            "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags,
            "avx2": {"avx2", "fma", "f16c"} <= flags,
            "scalar": True}


def _check_paths(stdout: str, available: dict[str, bool], expect: set[str]) -> None:
    """Every available path ran its cases and passed; an unavailable one says so, and fails where the run expects it
    ($ROLLINGKV_EXPECT_ISA, set by .ci/run: tests/isa.py)."""
    ran = 0
    for isa_name, has in available.items():
        if has:
            m = re.search(rf"^isa {isa_name}: (\d+) cases, (\d+) failed, worst relative error (\S+)$", stdout, re.M)
            assert m, f"the {isa_name} path did not run on a CPU that has it:\n{stdout}"
            assert int(m.group(1)) == CASES_PER_ISA and int(m.group(2)) == 0
            assert float(m.group(3)) < 2e-6
            ran += 1
        else:
            assert f"isa {isa_name}: not available on this CPU" in stdout
    assert stdout.strip().splitlines()[-1] == f"{ran * CASES_PER_ISA} passed, 0 failed"
    missing = [n for n, has in available.items() if n in expect and not has]
    if missing:
        pytest.fail(f"{isa.ENV} expects the {', '.join(missing)} path(s) of the CPU decode attention to run, but this CPU "
                    f"({hostinfo.cpu_model()}) lacks them: they were only reported not available", pytrace=False)


def test_every_path_this_cpu_has_matches_double_precision(cpu_build):
    """Seen failing as an AVX2-only runner under CI's expectation: test_an_expected_path_this_cpu_lacks_fails below."""
    proc = subprocess.run([str(_binary(cpu_build))], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    _check_paths(proc.stdout, _expected_isas(), isa.expected())


def test_an_expected_path_this_cpu_lacks_fails(monkeypatch):
    """The check on an AVX2 runner (its flags, the binary's output there): a pass outside CI, where nothing is expected;
    a failure naming avx512vnni and avx512 under the list .ci/run declares."""
    avx2_host = {"fpu", "sse4_2", "avx", "avx2", "fma", "f16c"}
    monkeypatch.setattr(hostinfo, "cpu_flags", lambda: avx2_host)
    out = "\n".join([f"isa {n}: not available on this CPU" for n in ("avx512vnni", "avx512")] +
                    [f"isa {n}: {CASES_PER_ISA} cases, 0 failed, worst relative error 1e-07" for n in ("avx2", "scalar")] +
                    [f"{2 * CASES_PER_ISA} passed, 0 failed"]) + "\n"
    _check_paths(out, _expected_isas(), set())
    with pytest.raises(pytest.fail.Exception, match="expects the avx512vnni, avx512 path"):
        _check_paths(out, _expected_isas(), isa.parse("scalar,avx2,avx512,avx512vnni,amx,neon,neon-dotprod"))


def test_the_comparison_bites_on_the_scalar_path(cpu_build):
    """Scores of the reference times 1 + 1e-4: every case with a visible cell fails; the 36 whose cells are all
    masked (output 0, LSE -inf either way) pass."""
    proc = subprocess.run([str(_binary(cpu_build)), "--isa", "scalar", "--perturb-ref", "1e-4"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines()[-1] == "36 passed, 216 failed"
    assert all("mask 2" not in line for line in proc.stdout.splitlines() if line.startswith("FAIL"))


def test_the_bench_reports_attention_next_to_a_read_scan_and_ggml(cpu_build):
    """The microbenchmark runs and reports its figures (speed is measured on the GPU host, not asserted here)."""
    proc = subprocess.run([str(_binary(cpu_build)), "--bench", "-t", "2", "--layers", "2", "--cells", "1024", "--reps", "1", "--type", "q8_0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert r["type"] == "q8_0" and r["layers"] == 2 and r["cells"] == 1024
    assert r["gb"] == pytest.approx(2 * 2 * 1024 * 8 * 136 / 1e9, abs=1e-6)  # K and V, 8 heads of 128 q8_0 values (printed to 1 kB)
    assert min(r["attention_ms"], r["scan_ms"], r["copy_ms"], r["ggml_fa_ms"]) > 0


def test_the_bench_times_each_kind_of_host_memory(cpu_build):
    """--alloc: the K/V bytes in the CPU backend's buffer and in anonymous memory advised for 2 MiB pages, each timed; the
    GPU's kinds (cudahost, tail) are refused by a CPU build, in one line, before anything is timed."""
    b = _binary(cpu_build)
    proc = subprocess.run([str(b), "--bench", "-t", "2", "--layers", "1", "--cells", "512", "--reps", "1", "--alloc", "cpu,thp"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["alloc"] for r in rows] == ["cpu", "thp"] and all(r["attention_ms"] > 0 and r["scan_ms"] > 0 for r in rows)
    assert rows[0]["ggml_fa_ms"] > 0 and rows[1]["ggml_fa_ms"] == 0  # the vanilla comparison runs on the first kind only
    proc = subprocess.run([str(b), "--bench", "--layers", "1", "--cells", "256", "--alloc", "tail"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "offers no tail memory" in proc.stderr


@pytest.mark.parametrize("args", [["--bench", "-t", "0"], ["--type", "q5_0"], ["--cells"], ["--isa", "sse9"], ["--bench", "--alloc", "foo"]])
def test_bad_arguments_are_refused(cpu_build, args):
    proc = subprocess.run([str(_binary(cpu_build)), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip()


def test_the_pools_generations_never_mix_a_width_with_another_task(cpu_build):
    """Tasks of changing widths back to back on 8 threads (more than this CPU has: workers are descheduled mid-step):
    each runs once per id below its width and never late. The pool before issue 26 read the width and the task apart
    from the generation, and failed this within seconds (wrong calls or a crash)."""
    proc = subprocess.run([str(_binary(cpu_build)), "--pool-stress", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    m = re.search(r"^pool stress: (\d+) runs of up to 8 threads, 0 wrong calls, 0 late calls$", proc.stdout, re.M)
    assert m and int(m.group(1)) > 100, proc.stdout


def _pool_affinity(cpu_build, n, cpus=None, env=None):
    import os

    def confine():
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    e = dict(os.environ)
    e.pop("ROLLINGKV_CPU_PART_THREADS", None)
    e.update(env or {})
    proc = subprocess.run([str(_binary(cpu_build)), "--pool-affinity", str(n)], capture_output=True, text=True, timeout=60,
                          preexec_fn=confine, env=e)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_the_pool_runs_on_the_processs_cpus_only(cpu_build):
    """Under taskset (here: the process confined to one CPU) the part takes 1 thread, and workers made anyway (a
    bench's pool run of 3) stay on that CPU, though made from a thread confined elsewhere; without a confinement they
    run on every CPU of the process, not only on the CPU of the thread that made them."""
    import os

    mine = sorted(os.sched_getaffinity(0))
    one = {mine[0]}
    r, _ = _pool_affinity(cpu_build, 3, cpus=one, env={"ROLLINGKV_CPU_PART_THREADS": "4"})
    assert r == {"process_cpus": 1, "part_threads": 1, "worker_cpus": [[mine[0]], [mine[0]]]}
    r, _ = _pool_affinity(cpu_build, 3)
    assert r["process_cpus"] == len(mine) and r["part_threads"] == max(1, len(mine) - 1)
    assert r["worker_cpus"] == [mine, mine]


@pytest.mark.parametrize("raw", ["x", "-2", "1.5", "3x"])
def test_a_bad_part_threads_variable_is_one_warning_line_and_the_default(cpu_build, raw):
    """libllama reads $ROLLINGKV_CPU_PART_THREADS as the CLI does (rollingkv_cli.hw.cpu_attn.part_threads): a value that is
    not a whole number >= 0 is named in one line and the default is used (not atoi's reading of it)."""
    import os

    r, err = _pool_affinity(cpu_build, 2, env={"ROLLINGKV_CPU_PART_THREADS": raw})
    assert r["part_threads"] == max(1, len(os.sched_getaffinity(0)) - 1)
    lines = [line for line in err.splitlines() if "ROLLINGKV_CPU_PART_THREADS" in line]
    assert len(lines) == 1 and raw in lines[0] and "default" in lines[0]


def test_the_part_threads_are_capped_at_the_processs_cpus(cpu_build, monkeypatch):
    """One meaning everywhere: N threads, at most the CPUs the process may use (the CLI's part_threads says the same)."""
    import os

    from rollingkv_cli.hw import cpu_attn

    n = len(os.sched_getaffinity(0))
    for raw, want in (("1", 1), ("0", max(1, n - 1)), ("5000", n)):
        r, err = _pool_affinity(cpu_build, 2, env={"ROLLINGKV_CPU_PART_THREADS": raw})
        assert r["part_threads"] == want and "ROLLINGKV_CPU_PART_THREADS" not in err
        monkeypatch.setenv("ROLLINGKV_CPU_PART_THREADS", raw)
        if raw == "5000":  # libllama clamps it; the CLI refuses it before the library runs (issue 27, item 13)
            with pytest.raises(RollingKVError, match="more than the library takes"):
                cpu_attn.part_threads()
        else:
            assert cpu_attn.part_threads() == want


def test_idle_workers_sleep_after_a_bounded_spin(cpu_build):
    """After a task on 3 threads both workers sleep (the spin, 300 µs by default, ran out: an idle process leaves the CPUs
    to others); with a spin of 1 s they are still spinning 100 ms later, which the count sees (the test bites: a pool that
    never sleeps, or sleeps before its spin ran out, fails it). The binary counts the sleepers once, 100 ms after the task;
    on a loaded CI machine a worker may not have been scheduled by then, so a count short of "all asleep" is taken again
    (a new run) until a deadline, not read as a failure at once; the spinning case needs no retry (1 s > 100 ms)."""
    import os
    import time

    def idle(spin):
        e = dict(os.environ)
        e.pop("ROLLINGKV_CPU_PART_SPIN_US", None)
        if spin is not None:
            e["ROLLINGKV_CPU_PART_SPIN_US"] = spin
        proc = subprocess.run([str(_binary(cpu_build)), "--pool-idle", "3"], capture_output=True, text=True, timeout=60, env=e)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    for spin in (None, "0"):
        deadline, tries = time.monotonic() + 60, 0
        while True:
            r, tries = idle(spin), tries + 1
            if r["asleep"] == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r["threads"] == 3 and r["asleep"] == 2, (spin, r, f"{tries} runs")
    r = idle("1000000")
    assert r["threads"] == 3 and r["asleep"] == 0, r
