#!/usr/bin/env python3
"""Device-session smoke benchmark: llama-bench decode at one depth for a few residency configurations,
with the peak device memory of each llama-bench process sampled through NVML (per-process usedGpuMemory),
so the figures show both speed and where the tail lives. One JSON line per configuration.

  gpu_stream_bench.py LLAMA_BENCH MODEL DEPTH OUT.jsonl [label=extra-args-and-env ...]

Each configuration is `label=ARGS`; ARGS may start with ENV=VALUE words. This is the quick check used in
device sessions; `rollingkv bench tail` is the full benchmark.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time


def sample_peak(pid: int, stop: threading.Event, out: dict) -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception as e:  # no NVML: speed figures only
        out["nvml"] = f"unavailable: {e}"
        return
    peak_proc = 0
    peak_dev = 0
    while not stop.is_set():
        try:
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid and p.usedGpuMemory:
                    peak_proc = max(peak_proc, p.usedGpuMemory)
            peak_dev = max(peak_dev, pynvml.nvmlDeviceGetMemoryInfo(h).used)
        except Exception:
            pass
        time.sleep(0.05)
    out["peak_proc_mib"] = round(peak_proc / 2**20)
    out["peak_device_used_mib"] = round(peak_dev / 2**20)


def run(bench: str, model: str, depth: int, label: str, spec: str, n_gen: int, reps: int) -> dict:
    words = shlex.split(spec)
    env = dict(os.environ)
    while words and "=" in words[0] and not words[0].startswith("-"):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    cmd = [bench, "-m", model, "-fa", "1", "-p", "0", "-n", str(n_gen), "-d", str(depth), "-r", str(reps), "-o", "json", *words]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stop = threading.Event()
    mem: dict = {}
    th = threading.Thread(target=sample_peak, args=(proc.pid, stop, mem), daemon=True)
    th.start()
    out, err = proc.communicate()
    stop.set()
    th.join(timeout=2)
    rec = {"label": label, "cmd": " ".join(shlex.quote(c) for c in cmd), "env": {k: env[k] for k in env if k.startswith(("GGML_", "LLAMA_"))},
           "rc": proc.returncode, "wall_s": round(time.time() - t0, 1), **mem}
    try:
        res = json.loads(out)[0]
        rec.update({"avg_ts": res.get("avg_ts"), "stddev_ts": res.get("stddev_ts"), "avg_ms": 1e3 / res["avg_ts"] if res.get("avg_ts") else None,
                    "n_gen": res.get("n_gen"), "n_depth": res.get("n_depth")})
    except Exception as e:
        rec["error"] = f"{e}: {err[-1500:]}"
    log = [l for l in err.splitlines() if "rolling KV" in l or "graph" in l.lower() and "reuse" in l.lower()]
    rec["log"] = log[-8:]
    return rec


def main() -> int:
    bench, model, depth, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    n_gen = int(os.environ.get("BENCH_N", "32"))
    reps = int(os.environ.get("BENCH_R", "2"))
    with open(out_path, "a") as fh:
        for item in sys.argv[5:]:
            label, spec = item.split("=", 1)
            rec = run(bench, model, depth, label, spec, n_gen, reps)
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            ts = rec.get("avg_ts")
            print(f"{label:28s} {('%.2f tok/s' % ts) if ts else 'FAILED':>14s}  peak proc {rec.get('peak_proc_mib', '?')} MiB  "
                  f"({rec['wall_s']} s){'  ' + rec.get('error', '')[:300] if not ts else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
