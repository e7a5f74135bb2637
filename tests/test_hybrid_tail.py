"""The hybrid tail's Python side against the real native side (rolling-KV API 4): the header the ctypes mirror
follows, the library's calibration and parameters, the plan's tail_cpu, llama-server's and llama-bench's flags, and
the commands over them (gate equiv, probe pcie on a GPU machine). These need a build of the series with the hybrid
tail; on an older build they fail (they are not skipped: CI builds the current series). The Python side alone, on
stand-ins: test_llama_ext_params.py, test_cpu_attn.py, test_serve.py, gate/test_equiv_hybrid.py, bench/test_hybrid.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LIB_PRELUDE, assert_reference_resident, run_python
from rollingkv_cli.lib import llama_ext

REPO = Path(__file__).resolve().parent.parent
HEADER = REPO / "native" / "include" / "llama-rolling-kv.h"
TAIL_CPU_KEYS = {"requested", "frac", "cpu_attn_gbps", "cpu_attn_source", "n_threads", "reason"}


def test_the_ctypes_mirror_follows_the_header():
    """RollingKVParams lists the header's fields in its order, the API version is the one llama_ext expects, and the
    calibration is declared: a field added or moved on one side only fails here before any library is built."""
    text = HEADER.read_text()
    body = re.search(r"struct llama_rolling_kv_params\s*\{(.*?)\};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    fields = [m.group(1) for m in re.finditer(r"(\w+)\s*;", body)]
    assert fields == [f[0] for f in llama_ext.RollingKVParams._fields_]
    assert re.search(r"#define\s+LLAMA_ROLLING_KV_API_VERSION\s+(\d+)", text).group(1) == str(llama_ext.API_VERSION)
    decl = re.search(r"double\s+llama_rolling_kv_measure_cpu_attn_gbps\s*\(([^)]*)\)", text)
    assert decl and re.fullmatch(r"\s*int32_t\s+\w+\s*,\s*enum\s+ggml_type\s+\w+\s*", decl.group(1))


_PRELUDE = LIB_PRELUDE


@pytest.mark.build
def test_the_library_is_api5_with_the_cpu_part_auto_by_default(cpu_build):
    """The library's default is auto (< 0: the planner's choice, none where it would not pay; on the H200 it pays for f16
    and q8_0 tails), and make_params' default is the same."""
    r = run_python(_PRELUDE + """
p = ext.default_params()
q = ext.make_params(mode="window")
print(json.dumps({"api": ext.api_version(), "has": ext.has_tail_cpu, "frac": p.tail_cpu_frac, "gbps": p.cpu_attn_gbps,
                  "made": q.tail_cpu_frac, "auto": ext.make_params(tail_cpu_frac="auto").tail_cpu_frac}))
""", cpu_build.lib_dir)
    assert r["api"] == llama_ext.API_VERSION == 11 and r["has"]
    assert r["frac"] < 0 and r["gbps"] <= 0  # auto; the CPU figure measured at plan time
    assert r["made"] == r["frac"] and r["auto"] < 0


@pytest.mark.build
def test_the_calibration_measures_every_tail_type(cpu_build):
    """Through the Extension in-process, and through the child that `probe pcie` and `bench tail` use."""
    from rollingkv_cli.hw import cpu_attn

    r = run_python(_PRELUDE + """
print(json.dumps({t: ext.measure_cpu_attn_gbps(2, t) for t in ("f16", "q8_0", "q4_0")}))
""", cpu_build.lib_dir)
    assert all(r[t] > 0.1 for t in ("f16", "q8_0", "q4_0")), r  # GB/s on 2 threads: any CPU reads a tail faster than this
    child = cpu_attn.measure(cpu_build.lib_dir, 2)
    assert all(v is not None and v > 0.1 for v in child["gbps"].values()) and child["errors"] == {} and child["api_version"] == llama_ext.API_VERSION


@pytest.mark.build
def test_the_plan_reports_the_split(cpu_build, demo_model):
    """A split CPU context's plan has tail_cpu (the value asked for, echoed: auto by default; a CPU-only build puts
    nothing on a CPU part: it attends everything on the CPU already) and the link model's hybrid estimate."""
    r = run_python(_PRELUDE + """
model = llama_cpp.llama_model_load_from_file(os.environ["RKV_TEST_MODEL"].encode(), llama_cpp.llama_model_default_params())
cp = llama_cpp.llama_context_default_params()
cp.n_ctx = 1024; cp.n_batch = 512; cp.n_ubatch = 512; cp.flash_attn_type = 1; cp.n_threads = 2; cp.n_threads_batch = 2
out = {}
cases = {"default": {}, "auto": {"tail_cpu_frac": "auto"}, "half": {"tail_cpu_frac": 0.5, "cpu_attn_gbps": 33.0},
         "off": {"tail_cpu_frac": 0}}
for name, kw in cases.items():
    ctx = ext.init_context(model, cp, ext.make_params(mode="window", window_cells=256, **kw))
    out[name] = ext.plan(ctx)
    llama_cpp.llama_free(ctx)
print(json.dumps(out))
""", cpu_build.lib_dir, env_extra={"RKV_TEST_MODEL": str(demo_model)})
    for name, plan in r.items():
        assert plan["split"] and TAIL_CPU_KEYS <= set(plan["tail_cpu"]), (name, plan.get("tail_cpu"))
        assert plan["tail_cpu"]["frac"] == 0 and isinstance(plan["tail_cpu"]["reason"], str) and plan["tail_cpu"]["reason"]
        assert "t_token_hybrid_ms" in plan["estimate"] and plan["estimate"]["t_token_hybrid_ms"] is None  # no CPU part: null
        assert plan["tail_cpu"]["reason"] == "no GPU: the CPU attends the whole tail already"
        assert plan["tail_cpu"]["n_threads"] > 0
    assert r["default"]["tail_cpu"]["requested"] == "auto" and r["auto"]["tail_cpu"]["requested"] == "auto"
    assert r["half"]["tail_cpu"]["requested"] == pytest.approx(0.5) and r["off"]["tail_cpu"]["requested"] == 0
    # a CPU figure asked for is kept (the planner stops before it on a CPU build); none asked for: null, not measured
    assert r["default"]["tail_cpu"]["cpu_attn_gbps"] is None and r["auto"]["tail_cpu"]["cpu_attn_gbps"] is None


@pytest.mark.build
def test_server_reports_the_split_in_props(cpu_build, demo_model, tmp_path):
    """/props has the plan's tail_cpu (auto requested by default). The log: llama-server's own line (patch 0012) gives the
    mode, cells, bytes and reason, not the CPU part; the planner's line on it ("rolling KV: CPU part of the tail: ...")
    is a libllama INFO line, which llama-server prints with -v only."""
    from rollingkv_cli.serve.server import ServerProcess

    base = ["-m", str(demo_model), "-fa", "on", "-t", "2", "-c", "1024", "--kv-residency-mode", "window", "--kv-window-cells", "256"]
    plans, logs = {}, {}
    for name, extra in {"half": ["--kv-tail-cpu-frac", "0.5", "--cpu-attn-gbps", "20", "-v"], "default": []}.items():
        srv = ServerProcess(cpu_build.artifact("llama-server"), base + extra, log_path=tmp_path / f"{name}.log")
        with srv:
            plans[name] = srv.request("/props")["rolling_kv"]
        logs[name] = (tmp_path / f"{name}.log").read_text()
    for name, plan in plans.items():
        assert plan["split"] and TAIL_CPU_KEYS <= set(plan["tail_cpu"]) and plan["tail_cpu"]["frac"] == 0, name
        assert "KV residency: requested window, chosen window, window 256 + tail 768 cells per stream" in logs[name]
    assert plans["half"]["tail_cpu"]["requested"] == pytest.approx(0.5) and plans["default"]["tail_cpu"]["requested"] == "auto"
    assert "rolling KV: CPU part of the tail: 0.000 (no GPU: the CPU attends the whole tail already)" in logs["half"]


@pytest.mark.build
def test_bench_sweeps_the_cpu_fraction(cpu_build, demo_model):
    proc = subprocess.run([str(cpu_build.artifact("llama-bench")), "-m", str(demo_model), "-p", "0", "-n", "2", "-r", "1", "-fa", "1",
                           "-t", "2", "-d", "512", "-o", "json", "--kv-residency-mode", "window", "--kv-window-cells", "256",
                           "--kv-tail-cpu-frac", "0,0.5,auto", "--cpu-attn-gbps", "20"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert len(rows) == 3 and all(r["avg_ts"] > 0 and r["window_cells"] == 256 for r in rows)
    requested = [r["kv_tail_cpu_frac"] for r in rows]
    assert requested[2] == "auto" and [float(x) for x in requested[:2]] == [0.0, 0.5]
    assert all(r["kv_tail_cpu_frac_chosen"] == 0 for r in rows)  # a CPU build: no CPU part (it attends all on the CPU)
    # not given: llama-bench's default, auto
    proc = subprocess.run([str(cpu_build.artifact("llama-bench")), "-m", str(demo_model), "-p", "0", "-n", "2", "-r", "1", "-fa", "1",
                           "-t", "2", "-d", "512", "-o", "json", "--kv-residency-mode", "window", "--kv-window-cells", "256"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(proc.stdout)
    assert row["kv_tail_cpu_frac"] == "auto" and row["kv_tail_cpu_frac_chosen"] == 0
    proc = subprocess.run([str(cpu_build.artifact("llama-bench")), "-m", str(demo_model), "--kv-tail-cpu-frac", "1.5"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "kv-tail-cpu-frac" in proc.stdout + proc.stderr


@pytest.mark.build
def test_gate_equiv_with_a_cpu_part_stays_bit_identical_on_the_cpu(cpu_build, demo_model, tmp_path):
    """A CPU-only build ignores the CPU part: the split stays bit-identical to resident, and the report carries the
    plan's tail_cpu."""
    out = tmp_path / "g.json"
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir)}
    proc = subprocess.run([sys.executable, "-m", "rollingkv_cli", "gate", "equiv", "--model", str(demo_model), "--synthetic-tokens", "512",
                           "--kv-window-cells", "256", "--kv-tail-cpu-frac", "0.5", "--n-batch", "8", "--threads", "2", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["metrics"]["bitwise_identical"] and r["tail_cpu"]["requested"] == 0.5
    assert_reference_resident(r)
    assert TAIL_CPU_KEYS <= set(r["tail_cpu"]["plan"]) and r["candidate"]["residency"]["tail_cpu_frac"] == 0.5
    # the count the GPU tests prove the path with is reported, and a CPU build runs no CPU part (it attends all on the CPU)
    assert r["candidate"]["cpu_part_runs"] == 0


@pytest.mark.gpu
def test_probe_pcie_measures_the_cpu_attention(tmp_path):
    """On the GPU machine, with the active (CUDA) build: the CPU attention in the profile, > 0 for every tail type, cached."""
    from rollingkv_cli.lib import builder
    from rollingkv_cli.hw import pcie

    try:
        pcie.discover()
    except pcie.NoGpuError as e:
        pytest.skip(f"no NVIDIA GPU: {e.reason}")
    b = builder.active_build(required=True)  # found in the real cache, before the profile moves to a fresh one
    env = {**os.environ, "ROLLINGKV_CACHE_DIR": str(tmp_path), "ROLLINGKV_BUILD": str(b.dir)}
    proc = subprocess.run([sys.executable, "-m", "rollingkv_cli", "probe", "pcie", "--json", "--refresh"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    c = json.loads(proc.stdout)["cpu_attn"]
    assert c["error"] is None and c["source"] == "measured now" and all(c["gbps"][t] > 1.0 for t in ("f16", "q8_0", "q4_0"))
    proc = subprocess.run([sys.executable, "-m", "rollingkv_cli", "probe", "pcie", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert json.loads(proc.stdout)["cpu_attn"]["source"] == "cached"


@pytest.mark.build
def test_batched_bench_honours_the_residency_flags(cpu_build, demo_model):
    """llama-batched-bench parses the common flags but created its context with llama_init_from_model: the residency
    flags were accepted and ignored (hook 0020). Several sequences decoding together now run on the split they ask for,
    and on the resident cache without them.

    Why a log line: the tool's only outputs are its timing table (or --output-format jsonl rows: pp, tg, pl, n_kv, times
    and speeds; n_kv is the context asked for, the same split or not), and its context's plan is not returned anywhere
    else (no /props, no JSON, no API call in the tool; adding one is a native change). libllama's plan line, printed by
    the planner from the same plan /props returns (-v prints libllama's INFO lines), is the one observable of the split
    here; the test pins its numbers (window and tail cells per stream, the stream count) and that the resident run prints
    the resident line and no split one. Seen failing on the hook-less tool (the flags ignored: "rolling KV: resident")."""
    exe = cpu_build.artifact("llama-batched-bench")
    assert exe.exists(), "llama-batched-bench is one of the build's targets"
    # -v: libllama's INFO lines (the plan's "rolling KV: ..." lines) are printed only in verbose mode
    base = [str(exe), "-m", str(demo_model), "-fa", "on", "-t", "2", "-c", "2048", "-b", "512", "-ub", "256",
            "-npp", "512", "-ntg", "4", "-npl", "2", "--output-format", "jsonl", "-v"]
    split = subprocess.run(base + ["--kv-residency-mode", "window", "--kv-window-cells", "256"], capture_output=True, text=True, timeout=600)
    assert split.returncode == 0, split.stderr[-2000:]
    assert "rolling KV: split, window 256 cells + tail 768 cells per stream (2 streams)" in split.stderr, split.stderr[-3000:]
    rows = [json.loads(line) for line in split.stdout.splitlines() if line.startswith("{")]
    assert rows and rows[0]["pl"] == 2 and rows[0]["speed_tg"] > 0
    off = subprocess.run(base + ["--kv-residency-mode", "off"], capture_output=True, text=True, timeout=600)
    assert off.returncode == 0 and "rolling KV: resident" in off.stderr and "rolling KV: split" not in off.stderr, off.stderr[-2000:]
