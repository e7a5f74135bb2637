"""The CPU decode attention's speed on this machine: what the hybrid tail's planner splits the host tail with.

libllama measures it (`llama_rolling_kv_measure_cpu_attn_gbps(n_threads, type)`: GB/s of K+V bytes the CPU decode
attention reads over a ~256 MiB tail of that type); this module runs that calibration in a child process, so that
the CLI never loads libllama itself (a library that crashes or aborts ends only the child, which is reported):

    python -m rollingkv_cli.hw.cpu_attn --lib-dir DIR --threads N [--types f16,q8_0,q4_0]

prints one JSON line (`{"gbps": {type: GB/s or null}, "errors": {type: why}, ...}` or `{"error": ..., "kind": ...}`).
The cache of these figures is the per-machine profile (profile.py); `rollingkv probe pcie` measures and shows them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rollingkv_cli.lib.llama_ext import CPU_ATTN_TYPES, MEASURE_CPU_ATTN_SYMBOL

MEASURE_TIMEOUT_S = 300.0  # three ~256 MiB calibrations take seconds; a stuck child is stopped after this


class Unavailable(Exception):
    """The calibration cannot run with this build (no library, a library before the hybrid tail, a child that died)."""

    def __init__(self, message: str, kind: str = "failed"):
        super().__init__(message)
        self.message = message
        self.kind = kind  # "no_function" (a build before API 4) | "load" | "failed"


def part_threads() -> int:
    """The threads libllama gives the hybrid tail's CPU part (ggml_rkv_get_cpu_threads): $ROLLINGKV_CPU_PART_THREADS
    when set (1 to 1024: rollingkv refuses more before libllama would clamp it), else every CPU this process may run on but one (left to the thread that launches the
    GPU's work); either way at most the CPUs this process may run on (its affinity: taskset, numactl), as libllama
    caps it. Not llama-server's -t: its default is a heuristic for matrix work on the CPU (4 on the H200 host's 16
    cores), and the part, bound by memory bandwidth, needs more (docs/design/hybrid-tail.md). A bad value: one line, exit 1
    (libllama itself warns in one line and takes the default)."""
    from rollingkv_cli.lib.paths import ENV_CPU_PART_THREADS
    from rollingkv_cli.userinput import native_knob

    n = native_knob(ENV_CPU_PART_THREADS)  # above libllama's 1024: refused, not clamped
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 4
    want = n if n else usable - 1
    return max(1, min(want, usable))


# ------------------------------------------------------------------------------------------ the parent side


def measure(lib_dir: Path, n_threads: int, types: tuple[str, ...] = CPU_ATTN_TYPES, timeout: float = MEASURE_TIMEOUT_S) -> dict:
    """Run the calibration of every type in a child: {"gbps": {type: float | None}, "errors": {type: str}, "n_threads",
    "lib", "build_info", "api_version", "seconds"}. Unavailable when the child cannot measure at all."""
    from rollingkv_cli.lib import child as lib_child
    from rollingkv_cli.lib.procs import describe_exit

    bad = [t for t in types if t not in CPU_ATTN_TYPES]
    if bad or not types:
        raise ValueError(f"CPU attention types must be among {', '.join(CPU_ATTN_TYPES)}, not {', '.join(bad) or 'none'}")
    cmd = lib_child.python_command("rollingkv_cli.hw.cpu_attn", "--lib-dir", lib_dir, "--threads", int(n_threads), "--types", ",".join(types))
    try:
        rc, out, err = lib_child.run(cmd, timeout)
    except lib_child.Timeout:
        raise Unavailable(f"the CPU attention calibration took over {timeout:.0f} s and was stopped") from None
    return parse_child_output(rc, out, err, describe_exit)


def parse_child_output(rc: int | None, out: str, err: str, describe_exit=None) -> dict:
    """The child's JSON line as the result, or Unavailable saying why there is none."""
    from rollingkv_cli.lib.child import last_json

    doc = last_json(out)
    if isinstance(doc, dict) and doc.get("error"):
        raise Unavailable(str(doc["error"]), str(doc.get("kind") or "failed"))
    if rc != 0 or not isinstance(doc, dict) or not isinstance(doc.get("gbps"), dict):
        how = describe_exit(rc) if describe_exit else f"exit status {rc}"
        last = ((err or "").strip().splitlines() or [""])[-1]
        raise Unavailable(f"the CPU attention calibration failed ({how})" + (f": {last}" if last else ""))
    return doc


# ------------------------------------------------------------------------------------------ the child side


def child(lib_dir: Path, n_threads: int, types: list[str]) -> dict:
    from rollingkv_cli.lib.llama_ext import API_TAIL_CPU, load_rollingkv_build, measure_cpu_attn_gbps

    lib, about = load_rollingkv_build(lib_dir)
    if lib is None:
        return about
    info, api = about["build_info"], about["api_version"]
    if not hasattr(lib, MEASURE_CPU_ATTN_SYMBOL):
        return {"error": f"this build predates the hybrid tail (rolling-KV API {api}, no {MEASURE_CPU_ATTN_SYMBOL}; "
                         f"the calibration needs API {API_TAIL_CPU})", "kind": "no_function", "build_info": info, "api_version": api}
    if hasattr(lib, "llama_backend_init"):
        lib.llama_backend_init()
    gbps: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for t in types:
        t0 = time.perf_counter()
        v = measure_cpu_attn_gbps(lib, n_threads, t)
        seconds[t] = round(time.perf_counter() - t0, 3)
        if v > 0 and v == v and v != float("inf"):
            gbps[t] = round(v, 3)
        else:
            gbps[t] = None
            errors[t] = f"the library does not support a {t} tail on the CPU (it returned {v:g})"
    return {"gbps": gbps, "errors": errors, "seconds": seconds, "n_threads": n_threads, "lib": str(lib_dir / "libllama.so"),
            "build_info": info, "api_version": api}


def main(argv: list[str] | None = None) -> int:
    from rollingkv_cli.lib.child import reply

    ap = argparse.ArgumentParser(prog="python -m rollingkv_cli.hw.cpu_attn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib-dir", required=True, type=Path)
    ap.add_argument("--threads", required=True, type=int)
    ap.add_argument("--types", default=",".join(CPU_ATTN_TYPES))
    a = ap.parse_args(argv)
    types = [t for t in (x.strip() for x in a.types.split(",")) if t]
    bad = [t for t in types if t not in CPU_ATTN_TYPES]
    if bad or not types or a.threads < 1:
        reply({"error": f"bad arguments: types {a.types!r}, threads {a.threads}", "kind": "failed"})
        return 2
    reply(child(a.lib_dir.resolve(), a.threads, types))
    return 0


if __name__ == "__main__":
    sys.exit(main())
