"""`gate vram` without a GPU: the NVML sampler with a fake NVML, the verdict, and the whole command against a
fake llama-server (conftest.py)."""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest

from test_cli import run_main


def _argvs(state) -> list[list[str]]:
    return [json.loads(line) for line in state["argv_log"].read_text().splitlines()]


# ---------------------------------------------------------------- vram: the sampler with a fake NVML

class FakeNvml:
    """pynvml's surface that gate_vram uses; memory figures scripted per call."""

    def __init__(self, gpus=1, proc_mib=(), device_mib=(), init_error=None, proc_pid=None, total_mib=81559):
        self.gpus = gpus
        self.proc_mib = list(proc_mib)
        self.device_mib = list(device_mib)
        self.init_error = init_error
        self.proc_pid = proc_pid  # a pid, a set of pids, or a callable returning them
        self.total = total_mib << 20
        self.calls = 0

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlDeviceGetCount(self):
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("gpu", i)

    def nvmlDeviceGetName(self, h):
        return b"Fake H200"

    def _next(self, seq, default):
        if not seq:
            return default
        return seq.pop(0) if len(seq) > 1 else seq[0]

    def nvmlDeviceGetMemoryInfo(self, h):
        v = self._next(self.device_mib, 1000)
        if isinstance(v, Exception):
            raise v
        return SimpleNamespace(used=v << 20, total=self.total, free=self.total - (v << 20))

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        self.calls += 1
        v = self._next(self.proc_mib, None)
        if isinstance(v, Exception):
            raise v
        pids = self.proc_pid() if callable(self.proc_pid) else self.proc_pid
        pids = pids if isinstance(pids, (set, list, tuple)) else [pids]
        other = SimpleNamespace(pid=1, usedGpuMemory=5000 << 20)  # someone else's process: never counted
        return [other] + [SimpleNamespace(pid=p, usedGpuMemory=None if v is None else v << 20) for p in pids if p is not None]


def _sample_n(sampler, n):
    for _ in range(n):
        sampler.sample()
    return sampler.stats


def test_sampler_peak_of_the_process():
    from rollingkv_cli.gate.vram import MIB, NvmlSampler

    nv = FakeNvml(proc_mib=[300, 900, 700, 850], device_mib=[2000, 2600, 2400, 2500], proc_pid=42)
    st = _sample_n(NvmlSampler(nv, ("gpu", 0), {42}, baseline_used_bytes=1500 * MIB), 4)
    assert st.source == "process" and st.peak_bytes == 900 * MIB and st.peak_process_bytes == 900 * MIB
    assert st.peak_device_used_bytes == 2600 * MIB and st.peak_device_delta_bytes == 1100 * MIB
    d = st.to_dict()
    assert d["peak_mib"] == 900 and d["samples"] == 4 and d["process_samples"] == 4 and d["peak_device_delta_mib"] == 1100


def test_sampler_falls_back_to_the_device_growth():
    from rollingkv_cli.gate.vram import MIB, NvmlSampler

    # NVML lists no process with our pid (a container's pid namespace): the device's growth counts
    nv = FakeNvml(proc_mib=[500], device_mib=[1200, 1900, 1700], proc_pid=7)
    st = _sample_n(NvmlSampler(nv, ("gpu", 0), {42}, baseline_used_bytes=1000 * MIB), 3)
    assert st.source == "device" and st.peak_bytes == 900 * MIB and st.peak_process_bytes is None
    # the pid is listed but its memory is "not available" (None): the same fallback
    nv = FakeNvml(proc_mib=[None], device_mib=[1300], proc_pid=42)
    st = _sample_n(NvmlSampler(nv, ("gpu", 0), {42}, baseline_used_bytes=1000 * MIB), 2)
    assert st.source == "device" and st.peak_bytes == 300 * MIB


def test_sampler_survives_nvml_errors():
    from rollingkv_cli.gate.vram import MIB, NvmlSampler

    nv = FakeNvml(proc_mib=[RuntimeError("NVML_ERROR_GPU_IS_LOST"), 400, 600], device_mib=[RuntimeError("x"), 1500, 1600], proc_pid=42)
    st = _sample_n(NvmlSampler(nv, ("gpu", 0), {42}, baseline_used_bytes=1000 * MIB), 3)
    assert st.errors == 1 and st.peak_bytes == 600 * MIB and st.samples[0].process_bytes is None


def test_sampler_thread_samples_until_stopped():
    from rollingkv_cli.gate.vram import NvmlSampler

    nv = FakeNvml(proc_mib=[100, 200, 300, 250], proc_pid=42)
    seen = []
    s = NvmlSampler(nv, ("gpu", 0), lambda: {42}, interval_s=0.01, on_sample=lambda smp, st: seen.append(smp))
    with s:
        deadline = time.time() + 5
        while len(seen) < 5 and time.time() < deadline:
            time.sleep(0.01)
    n = s.stats.n
    assert n >= 5 and s.stats.peak_process_bytes == 300 << 20
    time.sleep(0.05)
    assert s.stats.n == n  # stopped: no more samples
    assert not any(t.name == "rollingkv-nvml-sampler" for t in threading.enumerate())
    assert [x.t for x in s.stats.samples] == sorted(x.t for x in s.stats.samples)


def test_vram_verdict_bounds():
    from rollingkv_cli.gate.vram import MIB, Sample, VramStats, verdict

    def stats(peak_bytes):
        return VramStats(0, [Sample(0.0, peak_bytes, None)])

    assert verdict(stats(1200 * MIB), 1000, 200)[0] == "pass"
    v, why = verdict(stats(1200 * MIB + 1), 1000, 200)
    assert v == "fail" and "over by" in why
    assert verdict(stats(1000 * MIB), 1000, 0)[0] == "pass"
    assert verdict(VramStats(0, []), 1000, 200)[0] == "fail"


# ---------------------------------------------------------------- vram: the command

def _use_nvml(monkeypatch, nv):
    from rollingkv_cli.gate import vram as gate_vram

    monkeypatch.setattr(gate_vram, "nvml_module", lambda: nv)


@pytest.mark.parametrize("how", ["init", "import", "none"])
def test_vram_without_a_gpu_exits_3(capsys, isolated_cache, monkeypatch, tmp_path, how):
    from rollingkv_cli.gate import vram as gate_vram

    if how == "init":
        _use_nvml(monkeypatch, FakeNvml(init_error=RuntimeError("NVML Shared Library Not Found")))
    elif how == "none":
        _use_nvml(monkeypatch, FakeNvml(gpus=0))
    else:
        def missing():
            raise ImportError("No module named 'pynvml'")
        monkeypatch.setattr(gate_vram, "nvml_module", missing)
    out = tmp_path / "v.json"
    # no model file either: the GPU is checked first, as `probe pcie` answers without one
    code, _, err = run_main(["gate", "vram", "--model", "/nonexistent.gguf", "--vram-target", "1000", "--json", str(out)], capsys)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 3 and lines == ["error: no NVIDIA GPU found"], err
    assert "Traceback" not in err
    r = json.loads(out.read_text())
    assert r["verdict"] == "no-gpu" and r["error"] == "no NVIDIA GPU found" and r["gpus"] == [] and not r["passed"]


def test_vram_exit_code_matches_probe_pcie():
    from rollingkv_cli.hw import pcie
    from rollingkv_cli.gate import common as gate_common

    assert gate_common.EXIT_NO_GPU == pcie.EXIT_NO_GPU == 3


def test_vram_refuses_a_cpu_build(capsys, fake_server_build, fake_gguf, monkeypatch):
    _use_nvml(monkeypatch, FakeNvml())
    code, _, err = run_main(["gate", "vram", "--model", str(fake_gguf), "--vram-target", "1000"], capsys)
    assert code == 1 and "CPU-only" in err


@pytest.mark.parametrize("args,match,code", [
    (["--gpu", "3"], "no such GPU", 1),
    (["--vram-target", "999999"], "more than GPU 0 has", 1),
    (["--prompt-tokens", "4000", "--ctx", "4096"], "exceed --ctx 4096", 2),  # flags that contradict: a usage error
    (["--allowance", "-1"], "at least 0", 2),
    (["--kv-unified"], "--kv-unified needs --parallel 2 or more", 2),
    # 4096 / 4 = 1024 cells a request: 900 + 512 do not fit one of them, though they fit the context
    (["--ctx", "4096", "-np", "4", "--prompt-tokens", "900"], "exceed what one of 4 requests may hold (1024 of --ctx 4096)", 2),
    (["--ctx", "4", "-np", "4"], "leaves 1 cells to each of --parallel 4 requests", 2),
    (["-np", "0"], "at least 1", 2),
])
def test_vram_bad_input(capsys, fake_server_build, fake_gguf, monkeypatch, args, match, code):
    _use_nvml(monkeypatch, FakeNvml())
    base = ["gate", "vram", "--model", str(fake_gguf), "--vram-target", "1000"]
    c, _, err = run_main([*base, *args], capsys)
    assert c == code and match in err


def _track_server_pids(monkeypatch) -> set[int]:
    from rollingkv_cli.serve.server import ServerProcess

    pids: set[int] = set()
    orig = ServerProcess.start

    def start(self):
        r = orig(self)
        pids.add(self.proc.pid)
        return r

    monkeypatch.setattr(ServerProcess, "start", start)
    return pids


@pytest.mark.parametrize("peak,target,code", [(900, 1000, 0), (900, 600, 1)])
def test_vram_run_against_the_fake_server(capsys, fake_server_build, fake_gguf, monkeypatch, tmp_path, peak, target, code):
    fake_server_build["options"] = {"cuda": True}
    pids = _track_server_pids(monkeypatch)
    nv = FakeNvml(proc_mib=[200, 400, peak, 600], device_mib=[1000, 1300, 1500], proc_pid=lambda: pids)
    _use_nvml(monkeypatch, nv)
    monkeypatch.setenv("FAKE_COMPLETION_S", "0.3")  # the decode lasts long enough for several samples
    out = tmp_path / "v.json"
    c, stdout, err = run_main(["gate", "vram", "--model", str(fake_gguf), "--vram-target", str(target), "--ctx", "4096",
                               "--n-predict", "64", "--interval-ms", "10", "--json", str(out)], capsys)
    assert c == code, stdout + err
    r = json.loads(out.read_text())
    assert r["memory"]["source"] == "process" and r["memory"]["peak_mib"] == peak
    assert r["verdict"] == ("pass" if code == 0 else "fail") and r["limit_mib"] == target + 200
    assert r["plan"]["split"] and r["plan"]["vram_target_mib"] == target and r["prompt_tokens"] == 2048
    assert r["tokens_evaluated"] == 2048 and r["memory"]["samples"] >= 3
    (argv,) = _argvs(fake_server_build)
    assert argv[argv.index("--vram-target") + 1] == str(target) and argv[argv.index("-ngl") + 1] == "999"
    assert argv[argv.index("--kv-residency-mode") + 1] == "auto" and argv[argv.index("-fit") + 1] == "off"
    assert ("PASS" if code == 0 else "FAIL") in stdout
    assert pids and not any(os.path.exists(f"/proc/{p}") for p in pids)  # the server was stopped and reaped


@pytest.mark.parametrize("unified", [False, True])
def test_vram_several_slots_decode_at_once(capsys, fake_server_build, fake_gguf, monkeypatch, tmp_path, unified):
    """-np 4 (a cache per slot) and -np 4 -kvu (llama-server's default): the server gets the layout, and four requests,
    each of its own text and half a slot's share of the context, run at the same time (the fake server logs when)."""
    fake_server_build["options"] = {"cuda": True}
    pids = _track_server_pids(monkeypatch)
    _use_nvml(monkeypatch, FakeNvml(proc_mib=[300, 700, 500], device_mib=[1000, 1400], proc_pid=lambda: pids))
    runs = tmp_path / "completions.jsonl"
    monkeypatch.setenv("FAKE_COMPLETION_S", "1.0")
    monkeypatch.setenv("FAKE_COMPLETION_LOG", str(runs))
    out = tmp_path / "v.json"
    c, stdout, err = run_main(["gate", "vram", "--model", str(fake_gguf), "--vram-target", "1000", "--ctx", "4096",
                               "--n-predict", "64", "-np", "4", *(["-kvu"] if unified else []), "--interval-ms", "10",
                               "--json", str(out)], capsys)
    assert c == 0, stdout + err
    (argv,) = _argvs(fake_server_build)
    assert argv[argv.index("-np") + 1] == "4" and ("-kvu" in argv) == unified
    r = json.loads(out.read_text())
    assert r["parallel"] == 4 and r["kv_unified"] == unified and r["prompt_tokens"] == 512
    assert r["layout"] == ("4 slots, one unified cache" if unified else "4 slots, a cache each")
    assert [q["tokens_evaluated"] for q in r["requests"]] == [512] * 4 and r["tokens_evaluated"] == 2048
    done = [json.loads(line) for line in runs.read_text().splitlines()]
    assert len(done) == 4 and max(d["start"] for d in done) < min(d["end"] for d in done)  # all four in flight at once
