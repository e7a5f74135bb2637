"""The host<->GPU link's measured speed: the profile entry `rollingkv probe pcie` caches and the server plans with.

libllama measures it (`llama_rolling_kv_measure_link`, rolling-KV API 9): copies of 1, 16 and 256 MiB between the GPU
and its backend's pinned host memory (the memory a host tail lives in), host-to-device and device-to-host, queued back
to back on one backend stream and timed through ggml-backend, the median of 3 runs per size: the copies the planner's
auto times for its own link figure. This module runs that measurement in a child process, so that the CLI never loads
libllama itself (a library that crashes ends only the child, which is reported):

    python -m rollingkv_cli.hw.link_bw --lib-dir DIR --bus-id 0000:3b:00.0 [--nvml-index N]

prints one JSON line (`{"h2d": {MiB: GB/s}, "d2h": {...}, "device", "link_under_load", ...}` or `{"error", "kind"}`).
The child reads the link's state through NVML while copies are in flight (the library calls back then): idle GPUs
lower their link's generation to save power.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from rollingkv_cli.hw.pcie import SIZES_MIB, sysfs_address

REPS = {1: 20, 16: 10, 256: 5}  # copies per timed run of each size (3 runs, one warm-up copy first)
MEASURE_TIMEOUT_S = 120.0  # the measurement takes about a second; a stuck child is stopped after this
METHOD = ("llama_rolling_kv_measure_link: copies between the device and its backend's pinned host memory through "
          "ggml-backend, queued back to back on one stream; median of 3 runs, one warm-up copy first")

# Unavailable.kind values that hold for every GPU of the machine (the build cannot measure any of them)
PER_BUILD = ("no_build", "load", "no_function", "no_gpu")


class Unavailable(Exception):
    """Nothing measured: kind "no_build" (no build to measure with), "load" (its libllama does not load), "no_function"
    (a build before API 9), "no_gpu" (its libllama sees no GPU: a CPU build, or every GPU hidden), "not_found" (the
    library's GPUs do not include this one) or "failed" (the library or the child failed)."""

    def __init__(self, message: str, kind: str = "failed"):
        super().__init__(message)
        self.message = message
        self.kind = kind

    @property
    def per_build(self) -> bool:
        return self.kind in PER_BUILD


# ------------------------------------------------------------------------------------------ the parent side


def measure(lib_dir: Path | None, gpu, timeout: float = MEASURE_TIMEOUT_S) -> dict:
    """Measure GPU `gpu` (a pcie.GpuInfo) with the libllama in lib_dir (None: there is no build) in a child: the profile
    entry (profile.save_measurement; GB/s = 10^9 B/s per direction). Unavailable when nothing was measured."""
    from rollingkv_cli.lib import child as lib_child
    from rollingkv_cli.lib.procs import describe_exit

    if lib_dir is None:
        raise Unavailable("no rollingkv build: the link is measured by its libllama", "no_build")
    cmd = lib_child.python_command("rollingkv_cli.hw.link_bw", "--lib-dir", lib_dir, "--bus-id",
                                   sysfs_address(gpu.pci_bus_id), "--nvml-index", gpu.index)
    try:
        rc, out, err = lib_child.run(cmd, timeout)
    except lib_child.Timeout:
        raise Unavailable(f"the link measurement took over {timeout:.0f} s and was stopped") from None
    return entry_for(gpu, parse_child_output(rc, out, err, describe_exit))


def parse_child_output(rc: int | None, out: str, err: str, describe_exit=None) -> dict:
    """The child's JSON line, or Unavailable saying why there is none."""
    from rollingkv_cli.lib.child import last_json

    doc = last_json(out)
    if isinstance(doc, dict) and doc.get("error"):
        raise Unavailable(str(doc["error"]), str(doc.get("kind") or "failed"))
    if rc != 0 or not isinstance(doc, dict) or not all(isinstance(doc.get(d), dict) for d in ("h2d", "d2h")):
        how = describe_exit(rc) if describe_exit else f"exit status {rc}"
        last = ((err or "").strip().splitlines() or [""])[-1]
        raise Unavailable(f"the link measurement failed ({how})" + (f": {last}" if last else ""))
    for d in ("h2d", "d2h"):
        bad = {k: v for k, v in doc[d].items()
               if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0}
        if bad or set(doc[d]) != {str(m) for m in SIZES_MIB}:
            raise Unavailable(f"the link measurement gave no usable {d} figures: {doc[d]}")
    return doc


def entry_for(gpu, doc: dict) -> dict:
    """The profile entry of a measurement the child made (doc): the GPU as NVML names it, the figures, where from."""
    gen, width = (list(doc.get("link_under_load") or []) + [None, None])[:2]
    return {
        "uuid": gpu.uuid,
        "driver_version": gpu.driver_version,
        "name": gpu.name,
        "pci_bus_id": gpu.pci_bus_id,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "measured_at_unix": int(time.time()),
        "lib": doc.get("lib"),
        "build_info": doc.get("build_info"),
        "backend_device": doc.get("device"),
        "backend_description": doc.get("description"),
        "method": METHOD,
        "h2d": doc["h2d"],
        "d2h": doc["d2h"],
        "link_idle": {"gen": gpu.cur_gen, "width": gpu.cur_width},
        "link_under_load": {"gen": gen, "width": width},
    }


def measured_with(entry: dict) -> str:
    """What measured an entry, for a note: the library and its device (an entry of an older rollingkv: its CUDA runtime)."""
    if entry.get("lib"):
        return f"{entry['lib']} ({entry.get('backend_device') or '?'})"
    return f"{entry.get('cudart')} (CUDA {entry.get('cudart_version')})"


# ------------------------------------------------------------------------------------------ the child side


def child(lib_dir: Path, bus_id: str, nvml_index: int | None) -> dict:
    from rollingkv_cli.lib import llama_ext

    lib, about = llama_ext.load_rollingkv_build(lib_dir)
    if lib is None:
        return about
    api = about["api_version"]
    if not hasattr(lib, llama_ext.MEASURE_LINK_SYMBOL):
        return {"error": f"this build predates the link measurement (rolling-KV API {api}, no "
                         f"{llama_ext.MEASURE_LINK_SYMBOL}; it needs API {llama_ext.API_MEASURE_LINK})",
                "kind": "no_function", **about}
    if hasattr(lib, "llama_backend_init"):
        lib.llama_backend_init()
    seen: list = []

    def under_load() -> None:
        from rollingkv_cli.hw.pcie import read_current_link

        try:
            seen.append(list(read_current_link(nvml_index)))
        except Exception:  # noqa: BLE001  (a callback must not raise into the library)
            seen.append([None, None])

    t0 = time.perf_counter()
    try:
        f = llama_ext.measure_link(lib, bus_id, [m << 20 for m in SIZES_MIB], [REPS[m] for m in SIZES_MIB],
                                   under_load if nvml_index is not None else None)
    except llama_ext.LinkUnavailable as e:
        kind = {llama_ext.LINK_NO_GPU: "no_gpu", llama_ext.LINK_NOT_FOUND: "not_found"}.get(e.status, "failed")
        return {"error": e.reason, "kind": kind, **about}
    return {
        "h2d": {str(m): round(f.h2d_gbps[i], 3) for i, m in enumerate(SIZES_MIB)},
        "d2h": {str(m): round(f.d2h_gbps[i], 3) for i, m in enumerate(SIZES_MIB)},
        "device": f.device.decode(errors="replace"),
        "description": f.description.decode(errors="replace"),
        "device_id": f.device_id.decode(errors="replace"),
        "link_under_load": seen[0] if seen else [None, None],
        "seconds": round(time.perf_counter() - t0, 3),
        **about,
    }


def main(argv: list[str] | None = None) -> int:
    from rollingkv_cli.lib.child import reply

    ap = argparse.ArgumentParser(prog="python -m rollingkv_cli.hw.link_bw", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib-dir", required=True, type=Path)
    ap.add_argument("--bus-id", default="", help="the GPU's PCI bus id (or ggml name); empty: the first GPU")
    ap.add_argument("--nvml-index", type=int, default=None, help="the GPU's NVML index, to read its link under load")
    a = ap.parse_args(argv)
    reply(child(a.lib_dir.resolve(), a.bus_id, a.nvml_index))
    return 0


if __name__ == "__main__":
    sys.exit(main())
