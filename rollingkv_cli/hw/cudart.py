"""Measuring the host<->GPU link: pinned host<->device copies of 1, 16 and 256 MiB through the CUDA runtime (libcudart
via ctypes: no PyTorch, no CuPy), timed with CUDA events, and the link state read while copies are in flight. The
result is a profile entry (profile.save_measurement); `rollingkv probe pcie` measures and shows it.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import statistics
import time
from pathlib import Path
from typing import Callable

from rollingkv_cli.hw.pcie import SIZES_MIB, GpuInfo, read_current_link, sysfs_address

_REPS = {1: 20, 16: 10, 256: 5}  # timed copies per size after one warm-up copy; the median is kept
_LOAD_BURST = 4  # 256 MiB copies in flight while the link state is read "under load"


class CudaUnavailable(Exception):
    """No CUDA runtime library could be loaded: measuring is skipped (theoretical figures only)."""


class MeasureError(Exception):
    """The CUDA runtime loaded but a call failed."""


_H2D, _D2H = 1, 2  # cudaMemcpyKind
_STREAM_NON_BLOCKING = 1


def cudart_candidates() -> list[str]:
    """Sonames for the loader first, then files: next to the active build, CUDA_HOME, /usr/local/cuda, pip's nvidia wheels."""
    out = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    dirs: list[Path] = []
    try:
        from rollingkv_cli.lib import builder

        b = builder.active_build(required=False)
        if b is not None:
            dirs.append(b.lib_dir)
    except Exception:
        pass
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            dirs += [Path(os.environ[env]) / "lib64", Path(os.environ[env]) / "lib"]
    dirs += [Path("/usr/local/cuda/lib64"), Path("/usr/local/cuda/targets/x86_64-linux/lib"),
             Path("/usr/local/cuda/targets/sbsa-linux/lib")]
    try:
        import importlib.util

        spec = importlib.util.find_spec("nvidia")
        for loc in (spec.submodule_search_locations or []) if spec else []:
            dirs += [Path(loc) / "cu13" / "lib", Path(loc) / "cuda_runtime" / "lib"]
    except Exception:
        pass
    seen: set[str] = set()
    for d in dirs:
        found = glob.glob(str(d / "libcudart.so*"))
        # newest major first: libcudart.so.13.0.88 before libcudart.so.12
        found.sort(key=lambda f: [int(x) for x in re.findall(r"\d+", Path(f).name)], reverse=True)
        for f in found:
            real = os.path.realpath(f)  # libcudart.so -> .so.13 -> .so.13.0.96: one file, tried once
            if real not in seen:
                seen.add(real)
                out.append(f)
    return out


class _Cudart:
    def __init__(self, lib: ctypes.CDLL, where: str):
        self.lib, self.where = lib, where
        vp, sz, c_int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        sigs = {
            "cudaGetDeviceCount": [ctypes.POINTER(c_int)],
            "cudaDeviceGetByPCIBusId": [ctypes.POINTER(c_int), ctypes.c_char_p],
            "cudaSetDevice": [c_int],
            "cudaMallocHost": [ctypes.POINTER(vp), sz],
            "cudaFreeHost": [vp],
            "cudaMalloc": [ctypes.POINTER(vp), sz],
            "cudaFree": [vp],
            "cudaMemset": [vp, c_int, sz],
            "cudaStreamCreateWithFlags": [ctypes.POINTER(vp), ctypes.c_uint],
            "cudaStreamDestroy": [vp],
            "cudaStreamSynchronize": [vp],
            "cudaMemcpyAsync": [vp, vp, sz, c_int, vp],
            "cudaEventCreate": [ctypes.POINTER(vp)],
            "cudaEventDestroy": [vp],
            "cudaEventRecord": [vp, vp],
            "cudaEventSynchronize": [vp],
            "cudaEventElapsedTime": [ctypes.POINTER(ctypes.c_float), vp, vp],
            "cudaRuntimeGetVersion": [ctypes.POINTER(c_int)],
            "cudaDriverGetVersion": [ctypes.POINTER(c_int)],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)  # AttributeError: not a CUDA runtime
            fn.argtypes, fn.restype = argtypes, c_int
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [c_int], ctypes.c_char_p

    def check(self, err: int, what: str) -> None:
        if err != 0:
            msg = self.lib.cudaGetErrorString(err)
            raise MeasureError(f"{what} failed: {msg.decode() if msg else 'error'} ({err})")

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def version(self) -> str:
        v = ctypes.c_int(0)
        if self.lib.cudaRuntimeGetVersion(ctypes.byref(v)) != 0:
            return "?"
        return f"{v.value // 1000}.{v.value % 1000 // 10}"


def load_cudart() -> _Cudart:
    """The first CUDA runtime that loads and sees a device; CudaUnavailable if none loads at all."""
    tried, failures = [], []
    for cand in cudart_candidates():
        try:
            lib = ctypes.CDLL(cand)
        except OSError:
            tried.append(cand)
            continue
        try:
            rt = _Cudart(lib, cand)
        except AttributeError:
            failures.append((cand, "not a CUDA runtime"))
            continue
        n = ctypes.c_int(0)
        err = rt.cudaGetDeviceCount(ctypes.byref(n))
        if err == 0 and n.value > 0:
            return rt
        msg = rt.cudaGetErrorString(err) if err else b"no devices"
        failures.append((cand, msg.decode() if msg else str(err)))  # e.g. a runtime newer than the driver: try the next
    if failures:
        by_error: dict[str, list[str]] = {}
        for cand, msg in failures:
            by_error.setdefault(msg, []).append(cand)
        parts = [f"{msg} ({', '.join(c[:3])}{f' and {len(c) - 3} more' if len(c) > 3 else ''})" for msg, c in by_error.items()]
        hidden = " (CUDA_VISIBLE_DEVICES is set)" if os.environ.get("CUDA_VISIBLE_DEVICES") is not None else ""
        raise MeasureError("no usable CUDA runtime: " + "; ".join(parts) + hidden)
    raise CudaUnavailable("no CUDA runtime (libcudart) found")


def _touch(host: ctypes.c_void_p, nbytes: int) -> None:
    """Write every page of the pinned buffer once: nothing is left to fault in while timing."""
    ctypes.memset(host, 0x5A, nbytes)


def measure(gpu: GpuInfo, link_reader: Callable[[int], tuple] | None = read_current_link, rt: _Cudart | None = None) -> dict:
    """Pinned H2D and D2H copies of 1/16/256 MiB on their own stream, timed with CUDA events (one warm-up,
    then the median of several copies). Returns the cache entry (GB/s = 10^9 B/s per direction)."""
    rt = rt or load_cudart()
    dev = ctypes.c_int(-1)
    rt.check(rt.cudaDeviceGetByPCIBusId(ctypes.byref(dev), sysfs_address(gpu.pci_bus_id).encode()),
             f"finding GPU {gpu.index} ({gpu.pci_bus_id}) in CUDA (is it hidden by CUDA_VISIBLE_DEVICES?); cudaDeviceGetByPCIBusId")
    rt.check(rt.cudaSetDevice(dev.value), "cudaSetDevice")
    nbytes = max(SIZES_MIB) << 20
    host, devp, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    ev0, ev1 = ctypes.c_void_p(), ctypes.c_void_p()
    h2d: dict[str, float] = {}
    d2h: dict[str, float] = {}
    under_load = (None, None)
    try:
        rt.check(rt.cudaMallocHost(ctypes.byref(host), nbytes), f"cudaMallocHost({nbytes >> 20} MiB pinned)")
        _touch(host, nbytes)
        rt.check(rt.cudaMalloc(ctypes.byref(devp), nbytes), f"cudaMalloc({nbytes >> 20} MiB)")
        rt.check(rt.cudaMemset(devp, 0, nbytes), "cudaMemset")
        rt.check(rt.cudaStreamCreateWithFlags(ctypes.byref(stream), _STREAM_NON_BLOCKING), "cudaStreamCreateWithFlags")
        rt.check(rt.cudaEventCreate(ctypes.byref(ev0)), "cudaEventCreate")
        rt.check(rt.cudaEventCreate(ctypes.byref(ev1)), "cudaEventCreate")

        def copy(kind: int, size: int) -> None:
            dst, src = (devp, host) if kind == _H2D else (host, devp)
            rt.check(rt.cudaMemcpyAsync(dst, src, size, kind, stream), "cudaMemcpyAsync")

        def timed(kind: int, size: int) -> float:
            rt.check(rt.cudaEventRecord(ev0, stream), "cudaEventRecord")
            copy(kind, size)
            rt.check(rt.cudaEventRecord(ev1, stream), "cudaEventRecord")
            rt.check(rt.cudaEventSynchronize(ev1), "cudaEventSynchronize")
            ms = ctypes.c_float(0)
            rt.check(rt.cudaEventElapsedTime(ctypes.byref(ms), ev0, ev1), "cudaEventElapsedTime")
            return ms.value

        for kind, out in ((_H2D, h2d), (_D2H, d2h)):
            for mib in SIZES_MIB:
                size = mib << 20
                timed(kind, size)  # warm-up (first-touch of the mapping, clocks and link out of idle)
                ms = statistics.median(timed(kind, size) for _ in range(_REPS.get(mib, 5)))
                if ms <= 0:
                    raise MeasureError(f"a {mib} MiB copy timed at {ms} ms")
                out[str(mib)] = round(size / (ms / 1e3) / 1e9, 3)
        if link_reader is not None:
            # Idle GPUs drop their link generation to save power: read it while big copies are in flight.
            for _ in range(_LOAD_BURST):
                copy(_H2D, nbytes)
            try:
                under_load = tuple(link_reader(gpu.index))
            finally:
                rt.check(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
    finally:
        if ev0.value:
            rt.cudaEventDestroy(ev0)
        if ev1.value:
            rt.cudaEventDestroy(ev1)
        if stream.value:
            rt.cudaStreamSynchronize(stream)
            rt.cudaStreamDestroy(stream)
        if devp.value:
            rt.cudaFree(devp)
        if host.value:
            rt.cudaFreeHost(host)
    return {
        "uuid": gpu.uuid,
        "driver_version": gpu.driver_version,
        "name": gpu.name,
        "pci_bus_id": gpu.pci_bus_id,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "measured_at_unix": int(time.time()),
        "cudart": rt.where,
        "cudart_version": rt.version(),
        "cuda_device": dev.value,
        "h2d": h2d,
        "d2h": d2h,
        "link_idle": {"gen": gpu.cur_gen, "width": gpu.cur_width},
        "link_under_load": {"gen": under_load[0], "width": under_load[1]},
    }
