"""`gate needle` and `gate vram` without a model or a GPU: their logic (prompt construction, verdicts, the NVML
sampler with a fake NVML) and the whole commands against a fake llama-server (a small HTTP server that speaks
the endpoints the gates use). The real needle runs on the demo model are in test_gate.py."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from test_cli import run_main

# ---------------------------------------------------------------- a fake llama-server

FAKE_SERVER = r'''
import json, os, re, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
def opt(name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default
mode = opt("--kv-residency-mode", "auto")
ctx = int(opt("-c", "4096"))
window = int(opt("--kv-window-cells", "0") or 0)
if mode != "off" and not window and opt("--vram-target"):
    window = 1024
behaviour = os.environ.get("FAKE_NEEDLE", "retrieve")
log = os.environ.get("FAKE_ARGV_LOG")
if log:
    with open(log, "a") as f:
        f.write(json.dumps(argv) + "\n")
split = mode != "off" and 0 < window < ctx and not os.environ.get("FAKE_NO_SPLIT")
plan = {"mode_requested": mode, "mode_chosen": "window" if split else "off", "split": split,
        "reason": "fake: explicit window" if split else "fake: resident", "kv_size": ctx,
        "window_cells": window if split else 0, "tail_cells": ctx - window if split else 0,
        "vram_target_mib": int(opt("--vram-target", "0") or 0)}

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def send(self, obj, code=200):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/health":
            return self.send({"status": "ok"})
        if self.path == "/props":
            return self.send({"rolling_kv": plan})
        self.send({"error": "not found"}, 404)
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/tokenize":  # one token per character
            return self.send({"tokens": [ord(c) for c in body["content"]]})
        if self.path == "/apply-template":
            return self.send({"prompt": "<|user|>" + body["messages"][0]["content"] + "<|assistant|>"})
        if self.path == "/completion":
            prompt = body["prompt"]
            text = "".join(chr(t) for t in prompt) if isinstance(prompt, list) else prompt
            m = re.search(r"secret number is (\d+)", text)
            number = m.group(1) if m else "0"
            answer = " %s." % number
            if behaviour == "forget":
                answer = " 11111."
            elif behaviour == "differ" and mode != "off":
                answer = " %s, or so." % number
            time.sleep(float(os.environ.get("FAKE_COMPLETION_S", "0")))
            toks = [ord(c) for c in answer][: body.get("n_predict", 16)]
            return self.send({"content": "".join(chr(t) for t in toks), "tokens": toks, "tokens_evaluated": len(prompt),
                              "tokens_predicted": len(toks),
                              "timings": {"prompt_ms": 10.0, "prompt_per_second": 1000.0, "predicted_ms": 5.0, "predicted_per_second": 200.0}})
        self.send({"error": "not found"}, 404)

ThreadingHTTPServer((opt("--host", "127.0.0.1"), int(opt("--port"))), H).serve_forever()
'''


@pytest.fixture
def fake_server_build(monkeypatch, isolated_cache, tmp_path):
    """The active build: an empty libllama.so and the fake llama-server; `cuda` as the test sets it."""
    from rollingkv_cli import builder

    bdir = tmp_path / "build"
    bin_dir = bdir / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "libllama.so").write_bytes(b"")
    server = bin_dir / "llama-server"
    server.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    server.chmod(0o755)
    state = {"options": {"cuda": False}, "argv_log": tmp_path / "argv.jsonl"}
    monkeypatch.setattr(builder, "active_build", lambda required=True: builder.Build(bdir, {"pin": "x", "series_hash": "y", "options": state["options"]}))
    monkeypatch.setenv("FAKE_ARGV_LOG", str(state["argv_log"]))
    return state


def _argvs(state) -> list[list[str]]:
    return [json.loads(line) for line in state["argv_log"].read_text().splitlines()]


# ---------------------------------------------------------------- needle: pure parts

def test_needle_numbers_are_seeded_and_distinct():
    from rollingkv_cli.gate_needle import needle_number

    assert needle_number(0, 0) == needle_number(0, 0)
    assert len({needle_number(s, i) for s in range(5) for i in range(3)}) == 15
    assert all(len(needle_number(s, 0)) == 5 and needle_number(s, 0).isdigit() for s in range(20))


def test_filler_prose_has_no_digits_and_is_deterministic():
    from rollingkv_cli.gate_needle import filler_prose

    a = filler_prose(4000, 3)
    assert a == filler_prose(4000, 3) and a != filler_prose(4000, 4)
    assert len(a) >= 4000 and not any(ch.isdigit() for ch in a)


def test_sentence_cut():
    from rollingkv_cli.gate_needle import sentence_cut

    t = "One two. Three four five. Six.\nSeven eight."
    assert sentence_cut(t, 0.0) == 8
    assert t[:sentence_cut(t, 0.5)].endswith("five.")
    assert sentence_cut(t, 1.0) == len(t)
    assert sentence_cut("no boundary here", 0.5) == 8


def test_make_filler_hits_the_length():
    from rollingkv_cli.gate_needle import make_filler

    words = lambda s: s.split()  # noqa: E731 - a whitespace "tokenizer"
    for n in (100, 700, 2000):
        f = make_filler(words, n, seed=1)
        assert abs(len(words(f)) - n) <= max(8, n // 50), (n, len(words(f)))
        assert f.rstrip().endswith(".")
    short = "Just one sentence here."
    assert make_filler(words, 500, 0, source_text=short) == short  # a short file is used whole


def test_placements_mark_the_needle_exactly():
    from rollingkv_cli.gate_needle import MARK, build_placements, build_text, filler_prose

    class Side:  # one token per character, like the fake server
        def tokenize(self, text, add_special=False):
            return ([1] if add_special else []) + [ord(c) for c in text]

        def apply_template(self, content):
            return "<s>" + content + "</s>"

    filler = filler_prose(3000, 0)
    text, needle = build_text(filler, 0.5, "12345", "plain")
    assert text.count(MARK) == 1 and text.endswith("Answer: The secret number is")
    assert needle == " The secret number is 12345."
    for fmt in ("plain", "chat"):
        (p,) = build_placements(Side(), filler, [0.3], seed=7, fmt=fmt)
        span = "".join(chr(t) for t in p.tokens[p.needle_start:p.needle_end])
        assert span == f" The secret number is {p.number}."
        assert abs(p.needle_start - 0.3 * len(filler)) < 200
        assert MARK not in "".join(chr(t) for t in p.tokens if t > 1)


def test_needle_verdicts():
    from rollingkv_cli.gate_needle import Answer, first_difference, overall_verdict, placement_verdict

    ref = Answer([1, 2, 3], " 48213.")
    assert placement_verdict(ref, Answer([1, 2, 3], " 48213."), "48213") == "pass"
    assert placement_verdict(ref, Answer([1, 2, 4], " 48214."), "48213") == "fail"
    assert placement_verdict(Answer([5], " 1."), Answer([5], " 1."), "48213") == "inconclusive"
    assert placement_verdict(Answer([5], " 1."), Answer([6], " 48213."), "48213") == "fail"  # a difference is a failure
    # match="answer" (GPU): identical through the number; what follows it may differ
    ref = Answer([1, 2, 3, 2], " 48213.")
    assert placement_verdict(ref, Answer([1, 2, 3, 9, 9], " 48213.\n\nThe answer is"), "48213", "answer") == "pass"
    assert placement_verdict(ref, Answer([1, 2, 3, 9, 9], " 48213.\n\nThe answer is"), "48213") == "fail"
    assert placement_verdict(ref, Answer([1, 4], " 4821."), "48213", "answer") == "fail"
    assert placement_verdict(ref, Answer([7, 1, 2, 3], " is 48213."), "48213", "answer") == "fail"  # not the same answer
    assert placement_verdict(Answer([5], " 1."), Answer([6], " 2."), "48213", "answer") == "inconclusive"
    assert placement_verdict(Answer([5], " 1."), Answer([6], " 48213."), "48213", "answer") == "fail"
    assert overall_verdict(["pass", "pass"]) == "pass"
    assert overall_verdict(["pass", "inconclusive"]) == "inconclusive"
    assert overall_verdict(["inconclusive", "fail"]) == "fail"
    assert overall_verdict([]) == "fail"
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1 and first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1], [1]) is None


# ---------------------------------------------------------------- needle: the command against the fake server

NEEDLE = ["gate", "needle", "--filler-tokens", "3000", "--threads", "1"]


def test_needle_passes(capsys, fake_server_build, fake_gguf, tmp_path):
    out = tmp_path / "n.json"
    code, stdout, err = run_main([*NEEDLE, "--model", str(fake_gguf), "--json", str(out)], capsys)
    assert code == 0, stdout + err
    assert "PASS" in stdout
    r = json.loads(out.read_text())
    assert r["verdict"] == "pass" and len(r["placements"]) == 2
    assert [p["depth"] for p in r["placements"]] == [0.5, 0.85]
    for p in r["placements"]:
        assert p["identical"] and p["reference_retrieved"] and p["needle_in_tail"]
        assert p["needle_start"] >= 256 and p["reference"]["text"] == f" {p['number']}."
    assert r["plan"]["split"] and r["plan"]["window_cells"] == 256
    ref_argv, cand_argv = _argvs(fake_server_build)
    assert ref_argv[ref_argv.index("--kv-residency-mode") + 1] == "off"
    assert cand_argv[cand_argv.index("--kv-residency-mode") + 1] == "window"
    assert cand_argv[cand_argv.index("--kv-window-cells") + 1] == "256"
    assert "-fa" in cand_argv and cand_argv[cand_argv.index("-c") + 1] == str(r["n_ctx"])


def test_needle_differs_exit_1(capsys, fake_server_build, fake_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NEEDLE", "differ")
    out = tmp_path / "n.json"
    code, stdout, _ = run_main([*NEEDLE, "--model", str(fake_gguf), "--depth", "0.6", "--json", str(out)], capsys)
    assert code == 1 and "FAIL" in stdout
    r = json.loads(out.read_text())
    (p,) = r["placements"]
    assert r["verdict"] == "fail" and not p["identical"] and p["first_difference"] == 6


def test_needle_not_retrieved_is_inconclusive_exit_4(capsys, fake_server_build, fake_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NEEDLE", "forget")
    out = tmp_path / "n.json"
    code, stdout, _ = run_main([*NEEDLE, "--model", str(fake_gguf), "--format", "chat", "--json", str(out)], capsys)
    assert code == 4 and "INCONCLUSIVE" in stdout and "does not retrieve this needle even fully resident" in stdout
    r = json.loads(out.read_text())
    assert r["verdict"] == "inconclusive" and all(p["identical"] and not p["reference_retrieved"] for p in r["placements"])


def test_needle_in_the_window_is_refused(capsys, fake_server_build, fake_gguf):
    code, _, err = run_main([*NEEDLE, "--model", str(fake_gguf), "--depth", "0.05", "--kv-window-cells", "1024"], capsys)
    assert code == 1 and "inside the window [0, 1024)" in err and "Traceback" not in err


def test_needle_window_as_large_as_the_context(capsys, fake_server_build, fake_gguf):
    code, _, err = run_main([*NEEDLE, "--model", str(fake_gguf), "--kv-window-cells", "1000", "--ctx", "1000"], capsys)
    assert code == 2 and "must be smaller than the context (1000)" in err  # flags that contradict: a usage error


def test_needle_unsplit_candidate_is_refused(capsys, fake_server_build, fake_gguf, monkeypatch):
    monkeypatch.setenv("FAKE_NO_SPLIT", "1")  # e.g. --vram-target on a CPU build: the planner stays resident
    code, _, err = run_main([*NEEDLE, "--model", str(fake_gguf), "--kv-residency-mode", "auto", "--vram-target", "100"], capsys)
    assert code == 1 and "the candidate's cache was not split (fake: resident)" in err


def test_needle_window_from_the_plan(capsys, fake_server_build, fake_gguf, tmp_path):
    """With --vram-target the window is the planner's: the needle is checked against the plan's window."""
    out = tmp_path / "n.json"
    code, _, _ = run_main([*NEEDLE, "--model", str(fake_gguf), "--vram-target", "100", "--json", str(out)], capsys)
    r = json.loads(out.read_text())
    assert code == 0 and r["plan"]["window_cells"] == 1024 and all(p["needle_in_tail"] for p in r["placements"])
    code, _, err = run_main([*NEEDLE, "--model", str(fake_gguf), "--vram-target", "100", "--depth", "0.2"], capsys)
    assert code == 1 and "inside the window [0, 1024) (the candidate's plan: fake: explicit window)" in err


@pytest.mark.parametrize("args,match", [
    (["--depth", "1.5"], "strictly between 0 and 1"),
    (["--depth", "half"], "not a number"),
    (["--kv-window-cells", "8", "--vram-target", "100"], "not both"),
    (["--format", "xml"], "xml"),
    (["--filler-tokens", "0"], "at least 1"),
])
def test_needle_usage_errors(capsys, isolated_cache, fake_gguf, args, match):
    code, _, err = run_main(["gate", "needle", "--model", str(fake_gguf), *args], capsys)
    assert code == 2 and match in err


def test_needle_without_a_server_binary(capsys, fake_server_build, fake_gguf, tmp_path):
    (tmp_path / "build" / "build" / "bin" / "llama-server").unlink()
    code, _, err = run_main([*NEEDLE, "--model", str(fake_gguf)], capsys)
    assert code == 1 and "no llama-server" in err


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
    from rollingkv_cli.gate_vram import MIB, NvmlSampler

    nv = FakeNvml(proc_mib=[300, 900, 700, 850], device_mib=[2000, 2600, 2400, 2500], proc_pid=42)
    st = _sample_n(NvmlSampler(nv, ("gpu", 0), {42}, baseline_used_bytes=1500 * MIB), 4)
    assert st.source == "process" and st.peak_bytes == 900 * MIB and st.peak_process_bytes == 900 * MIB
    assert st.peak_device_used_bytes == 2600 * MIB and st.peak_device_delta_bytes == 1100 * MIB
    d = st.to_dict()
    assert d["peak_mib"] == 900 and d["samples"] == 4 and d["process_samples"] == 4 and d["peak_device_delta_mib"] == 1100


def test_sampler_falls_back_to_the_device_growth():
    from rollingkv_cli.gate_vram import MIB, NvmlSampler

    # NVML lists no process with our pid (a container's pid namespace): the device's growth counts
    nv = FakeNvml(proc_mib=[500], device_mib=[1200, 1900, 1700], proc_pid=7)
    st = _sample_n(NvmlSampler(nv, ("gpu", 0), {42}, baseline_used_bytes=1000 * MIB), 3)
    assert st.source == "device" and st.peak_bytes == 900 * MIB and st.peak_process_bytes is None
    # the pid is listed but its memory is "not available" (None): the same fallback
    nv = FakeNvml(proc_mib=[None], device_mib=[1300], proc_pid=42)
    st = _sample_n(NvmlSampler(nv, ("gpu", 0), {42}, baseline_used_bytes=1000 * MIB), 2)
    assert st.source == "device" and st.peak_bytes == 300 * MIB


def test_sampler_survives_nvml_errors():
    from rollingkv_cli.gate_vram import MIB, NvmlSampler

    nv = FakeNvml(proc_mib=[RuntimeError("NVML_ERROR_GPU_IS_LOST"), 400, 600], device_mib=[RuntimeError("x"), 1500, 1600], proc_pid=42)
    st = _sample_n(NvmlSampler(nv, ("gpu", 0), {42}, baseline_used_bytes=1000 * MIB), 3)
    assert st.errors == 1 and st.peak_bytes == 600 * MIB and st.samples[0].process_bytes is None


def test_sampler_thread_samples_until_stopped():
    from rollingkv_cli.gate_vram import NvmlSampler

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
    from rollingkv_cli.gate_vram import MIB, Sample, VramStats, verdict

    def stats(peak_bytes):
        return VramStats(0, [Sample(0.0, peak_bytes, None)])

    assert verdict(stats(1200 * MIB), 1000, 200)[0] == "pass"
    v, why = verdict(stats(1200 * MIB + 1), 1000, 200)
    assert v == "fail" and "over by" in why
    assert verdict(stats(1000 * MIB), 1000, 0)[0] == "pass"
    assert verdict(VramStats(0, []), 1000, 200)[0] == "fail"


# ---------------------------------------------------------------- vram: the command

def _use_nvml(monkeypatch, nv):
    from rollingkv_cli import gate_vram

    monkeypatch.setattr(gate_vram, "nvml_module", lambda: nv)


@pytest.mark.parametrize("how", ["init", "import", "none"])
def test_vram_without_a_gpu_exits_3(capsys, isolated_cache, monkeypatch, tmp_path, how):
    from rollingkv_cli import gate_vram

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
    from rollingkv_cli import gate_common, pcie

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
])
def test_vram_bad_input(capsys, fake_server_build, fake_gguf, monkeypatch, args, match, code):
    _use_nvml(monkeypatch, FakeNvml())
    base = ["gate", "vram", "--model", str(fake_gguf), "--vram-target", "1000"]
    c, _, err = run_main([*base, *args], capsys)
    assert c == code and match in err


def _track_server_pids(monkeypatch) -> set[int]:
    from rollingkv_cli.server import ServerProcess

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
