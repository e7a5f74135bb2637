"""The PCIe link profile: what the host<->GPU link is, what it should carry, and what it carries.

Three sources, best last:

* NVML (pynvml) for the GPUs and their link (generation and width, current and max), with the kernel's
  sysfs (`/sys/bus/pci/devices/<bus id>/{current,max}_link_{speed,width}`) for any field NVML lacks;
* the theoretical per-direction bandwidth of that link: GT/s per lane x lanes x encoding (8b/10b for
  Gen1-2, 128b/130b for Gen3-5, FLIT 242/256 for Gen6) / 8, in GB/s (10^9 bytes/s);
* a measurement: pinned host<->device copies of 1, 16 and 256 MiB through the CUDA runtime (libcudart via
  ctypes: no PyTorch, no CuPy), cached in `<cache dir>/pcie/profile.json` keyed by GPU UUID + driver version.

`resolve_bandwidth()` turns that into the one number the server plans with (see its docstring for the
order). No click in here: the command is rollingkv_cli/commands/probe.py.
"""

from __future__ import annotations

import ctypes
import glob
import json
import math
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from rollingkv_cli.lib import paths
from rollingkv_cli.console import RollingKVError, abort, warn

# Where the kernel lists PCI devices; module level so that tests can point it at a fake tree.
SYSFS_PCI_DEVICES = Path("/sys/bus/pci/devices")

EXIT_NO_GPU = 3  # `rollingkv probe pcie` without an NVIDIA GPU / NVML
NO_GPU_MESSAGE = "no NVIDIA GPU found"

# Pinned copies reach about 80-90 % of the 128b/130b line rate: each TLP carries 256 B (typical max
# payload) behind ~20-26 B of header/framing/CRC, plus DLLP flow-control and ACK traffic and DMA-engine
# gaps. 0.85 maps Gen4 x16 (31.5 GB/s) to ~26.8 and Gen5 x16 (63.0 GB/s) to ~53.6, what such links measure.
EFFICIENCY = 0.85
# Nothing known about the link: assume PCIe 3.0 x8 (7.9 GB/s theoretical, ~6.5 achievable): slow, so safe.
DEFAULT_GBPS = 6.5
DEFAULT_DETAIL = "PCIe 3.0 x8 assumed"

SIZES_MIB = (1, 16, 256)
RESOLVE_SIZE_MIB = 256  # the measured figure the server plans with (large copies: what KV streaming does)
_REPS = {1: 20, 16: 10, 256: 5}  # timed copies per size after one warm-up copy; the median is kept
_LOAD_BURST = 4  # 256 MiB copies in flight while the link state is read "under load"

_GT_PER_LANE = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
_SPEED_TO_GEN = {v: k for k, v in _GT_PER_LANE.items()}
PROFILE_VERSION = 1


# --------------------------------------------------------------------------------------------- link


def gen_from_speed(text: str | None) -> int | None:
    """'32.0 GT/s PCIe' (or '8 GT/s', '2.5 GT/s') -> 5; None for 'Unknown' or anything unparsable."""
    if not text:
        return None
    m = re.search(r"(\d+(?:\.\d+)?)\s*GT/s", text)
    if not m:
        return None
    return _SPEED_TO_GEN.get(float(m.group(1)))


def encoding_efficiency(gen: int) -> float:
    if gen <= 2:
        return 8 / 10
    if gen <= 5:
        return 128 / 130
    return 242 / 256  # Gen6: PAM4 + FLIT mode (no 128b/130b); 236 B TLP + 6 B DLP per 256 B flit


def theoretical_gbps(gen: int | None, width: int | None) -> float | None:
    """Per-direction line rate in GB/s (10^9 B/s): Gen3 x8 -> 7.88, Gen4 x16 -> 31.5, Gen5 x16 -> 63.0."""
    if not gen or not width or gen not in _GT_PER_LANE or width <= 0:
        return None
    return _GT_PER_LANE[gen] * width * encoding_efficiency(gen) / 8


def sysfs_address(bus_id: str) -> str:
    """NVML's '00000000:3B:00.0' -> sysfs's '0000:3b:00.0' (4-digit domain, lower case)."""
    bus_id = bus_id.strip()
    parts = bus_id.split(":")
    if len(parts) == 3:
        try:
            return f"{int(parts[0], 16):04x}:{parts[1].lower()}:{parts[2].lower()}"
        except ValueError:
            pass
    elif len(parts) == 2:
        return f"0000:{bus_id.lower()}"
    return bus_id.lower()


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    try:
        v = int(str(text).strip())
    except (TypeError, ValueError):
        return None
    return v if v > 0 else None


def read_sysfs_link(bus_id: str) -> dict:
    """{'cur_gen', 'cur_width', 'max_gen', 'max_width'} from sysfs; a value is None where unreadable."""
    d = SYSFS_PCI_DEVICES / sysfs_address(bus_id)
    return {
        "cur_gen": gen_from_speed(_read(d / "current_link_speed")),
        "cur_width": _int(_read(d / "current_link_width")),
        "max_gen": gen_from_speed(_read(d / "max_link_speed")),
        "max_width": _int(_read(d / "max_link_width")),
    }


@dataclass
class GpuInfo:
    index: int
    name: str
    uuid: str
    driver_version: str
    pci_bus_id: str
    cur_gen: int | None = None
    cur_width: int | None = None
    max_gen: int | None = None  # what this GPU in this slot can reach (NVML: min of device and system)
    max_width: int | None = None
    gpu_max_gen: int | None = None  # what the GPU itself supports, whatever the slot
    source: dict = field(default_factory=dict)  # field -> 'nvml' | 'sysfs'

    @property
    def downtrained(self) -> bool:
        return _downtrained(self.cur_gen, self.cur_width, self.max_gen, self.max_width)

    @property
    def theoretical_current(self) -> float | None:
        return theoretical_gbps(self.cur_gen, self.cur_width)

    @property
    def theoretical_max(self) -> float | None:
        return theoretical_gbps(self.max_gen, self.max_width)

    def link_str(self, which: str = "cur") -> str:
        gen, width = (self.cur_gen, self.cur_width) if which == "cur" else (self.max_gen, self.max_width)
        return f"Gen{gen or '?'} x{width or '?'}"

    def cache_key(self) -> str:
        return f"{self.uuid}|{self.driver_version}"


def _downtrained(cur_gen, cur_width, max_gen, max_width) -> bool:
    return bool((cur_gen and max_gen and cur_gen < max_gen) or (cur_width and max_width and cur_width < max_width))


class NoGpuError(RollingKVError):
    def __init__(self, reason: str):
        super().__init__(NO_GPU_MESSAGE, f"{reason}; set {paths.ENV_PCIE_BW} to give the link bandwidth by hand", EXIT_NO_GPU)
        self.reason = reason


def _s(v) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _nvml_call(fn_name: str, *args):
    """A pynvml getter, or None where it is missing or not supported (old driver, vGPU, ...)."""
    import pynvml

    fn = getattr(pynvml, fn_name, None)
    if fn is None:
        return None
    try:
        v = fn(*args)
    except Exception:
        return None
    if isinstance(v, int) and (v <= 0 or v >= 0xFFFF):  # NVML reports "unknown" as 0 or 0xFFFFFFFF
        return None
    return v


def discover() -> list[GpuInfo]:
    """Every NVIDIA GPU NVML sees, with its link; NoGpuError (exit 3) without NVML or GPUs."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise NoGpuError(f"NVML unavailable: {e}") from None
    try:
        try:
            count = pynvml.nvmlDeviceGetCount()
            driver = _s(pynvml.nvmlSystemGetDriverVersion())
        except Exception as e:
            raise NoGpuError(f"NVML failed: {e}") from None
        if count <= 0:
            raise NoGpuError("NVML sees no devices")
        gpus = []
        for i in range(count):
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = _s(pynvml.nvmlDeviceGetName(h))
                uuid = _s(pynvml.nvmlDeviceGetUUID(h))
                pci = pynvml.nvmlDeviceGetPciInfo(h)
                bus_id = _s(getattr(pci, "busId", b"") or getattr(pci, "busIdLegacy", b""))
            except Exception as e:
                warn(f"GPU {i}: NVML could not describe it ({e}); skipped")
                continue
            g = GpuInfo(i, name, uuid, driver, bus_id)
            for attr, fn in (("cur_gen", "nvmlDeviceGetCurrPcieLinkGeneration"), ("cur_width", "nvmlDeviceGetCurrPcieLinkWidth"),
                             ("max_gen", "nvmlDeviceGetMaxPcieLinkGeneration"), ("max_width", "nvmlDeviceGetMaxPcieLinkWidth"),
                             ("gpu_max_gen", "nvmlDeviceGetGpuMaxPcieLinkGeneration")):
                v = _nvml_call(fn, h)
                if v is not None:
                    setattr(g, attr, int(v))
                    g.source[attr] = "nvml"
            _fill_from_sysfs(g)
            gpus.append(g)
        if not gpus:
            raise NoGpuError("NVML could not describe any device")
        return gpus
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _fill_from_sysfs(g: GpuInfo) -> None:
    missing = [a for a in ("cur_gen", "cur_width", "max_gen", "max_width") if getattr(g, a) is None]
    if not missing or not g.pci_bus_id:
        return
    sysfs = read_sysfs_link(g.pci_bus_id)
    for a in missing:
        if sysfs[a] is not None:
            setattr(g, a, sysfs[a])
            g.source[a] = "sysfs"


def read_current_link(index: int) -> tuple[int | None, int | None]:
    """(generation, width) now, from NVML: read while copies are in flight to see the link out of power saving."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None, None
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        return _nvml_call("nvmlDeviceGetCurrPcieLinkGeneration", h), _nvml_call("nvmlDeviceGetCurrPcieLinkWidth", h)
    except Exception:
        return None, None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


# ------------------------------------------------------------------------------------------- cache


def profile_path() -> Path:
    return paths.cache_dir() / "pcie" / "profile.json"


def _valid_entry(e) -> bool:
    if not isinstance(e, dict) or not isinstance(e.get("measured_at"), str):
        return False
    for d in ("h2d", "d2h"):
        figures = e.get(d)
        if not isinstance(figures, dict) or not figures:
            return False
        for v in figures.values():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                return False
    return True


def _move_aside(p: Path, why: str) -> None:
    stamp = time.strftime("%Y%m%dT%H%M%S")
    dest = p.with_name(f"{p.name}.corrupt-{stamp}")
    n = 1
    while dest.exists():
        dest = p.with_name(f"{p.name}.corrupt-{stamp}-{n}")
        n += 1
    try:
        os.replace(p, dest)
    except OSError as e:
        warn(f"{p} is unreadable ({why}) and could not be moved aside ({e}); ignoring it")
        return
    warn(f"{p} was unreadable ({why}); moved it to {dest.name} and will measure again")


def _load_doc() -> dict:
    """The whole profile: {"version", "entries": {GPU key: link measurement}, "cpu_attn": {machine key: entry}}. A missing
    file is empty; a corrupt one (or one with a malformed link entry) is renamed aside with a warning, never lost; a
    malformed CPU attention entry is dropped with a warning (measured again), the link figures kept."""
    empty = {"version": PROFILE_VERSION, "entries": {}, "cpu_attn": {}}
    p = profile_path()
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return empty
    except OSError as e:
        warn(f"cannot read {p} ({e.strerror or e}); ignoring the cached measurements")
        return empty
    try:
        data = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        _move_aside(p, f"not JSON: {e}")
        return empty
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        _move_aside(p, "not a rollingkv PCIe profile")
        return empty
    bad = [k for k, e in data["entries"].items() if not _valid_entry(e)]
    if bad:
        _move_aside(p, f"malformed entries: {', '.join(bad)}")
        return empty
    cpu = data.get("cpu_attn", {})
    if not isinstance(cpu, dict):
        _warn_once(f"{p}: its cpu_attn part is not an object; ignoring it (the CPU attention is measured again)")
        cpu = {}
    bad_cpu = [k for k, e in cpu.items() if not _valid_cpu_attn_entry(e)]
    if bad_cpu:
        _warn_once(f"{p}: malformed CPU attention entries ({', '.join(bad_cpu)}); ignoring them (measured again)")
        cpu = {k: e for k, e in cpu.items() if k not in bad_cpu}
    return {"version": PROFILE_VERSION, "entries": data["entries"], "cpu_attn": cpu}


_warned: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        warn(text)


def _write_doc(doc: dict) -> Path:
    p = profile_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"version": PROFILE_VERSION, "entries": doc.get("entries", {}), "cpu_attn": doc.get("cpu_attn", {})},
                              indent=2, sort_keys=True) + "\n")
    os.replace(tmp, p)
    return p


def load_profile() -> dict:
    """{cache key: entry}. A missing file is empty; a corrupt one is renamed aside with a warning, never lost."""
    return _load_doc()["entries"]


def cached_measurement(gpu: GpuInfo, entries: dict | None = None) -> dict | None:
    """The measurement of this GPU under this driver, if it was made in the same slot."""
    entries = load_profile() if entries is None else entries
    e = entries.get(gpu.cache_key())
    if e is None:
        return None
    if e.get("pci_bus_id") and gpu.pci_bus_id and e["pci_bus_id"] != gpu.pci_bus_id:
        return None  # the card moved to another slot: another link
    return e


def save_measurement(gpu: GpuInfo, m: dict) -> Path:
    doc = _load_doc()
    doc["entries"][gpu.cache_key()] = m
    return _write_doc(doc)


# ------------------------------------------------------------------------------------ CPU attention
#
# The hybrid tail attends part of each split layer's host tail on the CPU; its planner splits by the link bandwidth
# above and the CPU decode attention's bandwidth for the tail's K type, measured by libllama's calibration
# (cpu_attn.py runs it in a child). Cached next to the link figures, per CPU model, logical CPU count, thread count
# and build (the kernel is the build's code): {"cpu", "logical_cpus", "n_threads", "build", "build_info",
# "gbps": {f16, q8_0, q4_0: GB/s or null}, "errors", "measured_at"}.


def _valid_cpu_attn_entry(e) -> bool:
    if not isinstance(e, dict) or not isinstance(e.get("measured_at"), str) or not isinstance(e.get("gbps"), dict):
        return False
    n = e.get("n_threads")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return False
    good = 0
    for v in e["gbps"].values():
        if v is None:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            return False
        good += 1
    return good > 0


def cpu_attn_key(n_threads: int, build_key: str, cpu: str | None = None, logical_cpus: int | None = None) -> str:
    from rollingkv_cli.hw import hostinfo

    return f"{cpu or hostinfo.cpu_model()}|{logical_cpus or os.cpu_count() or 0}|t{int(n_threads)}|{build_key}"


def cached_cpu_attn(n_threads: int, build_key: str, doc: dict | None = None) -> dict | None:
    """This machine's CPU attention figures at n_threads for that build, if measured."""
    doc = _load_doc() if doc is None else doc
    return doc["cpu_attn"].get(cpu_attn_key(n_threads, build_key))


def save_cpu_attn(n_threads: int, build_key: str, result: dict) -> dict:
    """Cache a calibration (cpu_attn.measure's result) as this machine's entry; returns the entry."""
    from rollingkv_cli.hw import hostinfo

    entry = {
        "cpu": hostinfo.cpu_model(),
        "logical_cpus": os.cpu_count(),
        "n_threads": int(n_threads),
        "build": build_key,
        "build_info": result.get("build_info"),
        "lib": result.get("lib"),
        "gbps": dict(result.get("gbps") or {}),
        "errors": dict(result.get("errors") or {}),
        "seconds": dict(result.get("seconds") or {}),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "measured_at_unix": int(time.time()),
    }
    if not _valid_cpu_attn_entry(entry):
        raise ValueError(f"no usable CPU attention figure to cache: {entry['gbps']} ({entry['errors']})")
    doc = _load_doc()
    doc["cpu_attn"][cpu_attn_key(n_threads, build_key)] = entry
    _write_doc(doc)
    return entry


def cpu_attn_gbps_for(type_k: str | None, n_threads: int, build_key: str, doc: dict | None = None) -> tuple[float | None, str]:
    """(GB/s, where from) of the CPU attention for a tail whose K type is type_k (None: f16, llama.cpp's default),
    from the cache; (None, why) when nothing is cached for that type, thread count and build."""
    t = type_k or "f16"
    entry = cached_cpu_attn(n_threads, build_key, doc)
    if entry is None:
        return None, f"no CPU attention measured at {n_threads} threads for this build (`rollingkv probe pcie` measures it)"
    v = entry["gbps"].get(t)
    if not isinstance(v, (int, float)) or v <= 0:
        return None, f"no CPU attention figure for a {t} tail in the profile" + (f" ({entry['errors'][t]})" if t in entry.get("errors", {}) else "")
    return float(v), f"{t} tail, {n_threads} threads, measured {entry['measured_at']}"


# ------------------------------------------------------------------------------------- measurement


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


def link_under_load(entry: dict | None) -> tuple[int | None, int | None]:
    if not entry or not isinstance(entry.get("link_under_load"), dict):
        return None, None
    ll = entry["link_under_load"]
    return _int(ll.get("gen")), _int(ll.get("width"))


def effective_link(gpu: GpuInfo, entry: dict | None = None) -> tuple[int | None, int | None, bool]:
    """(gen, width, under_load): the link as seen while copies ran, when a measurement read it, else now."""
    gen, width = link_under_load(entry)
    if gen and width:
        return gen, width, True
    return gpu.cur_gen, gpu.cur_width, False


def is_downtrained(gpu: GpuInfo, entry: dict | None = None) -> bool:
    gen, width, _ = effective_link(gpu, entry)
    return _downtrained(gen, width, gpu.max_gen, gpu.max_width)


# --------------------------------------------------------------------------------------- resolution


class Resolution(NamedTuple):
    gbps: float
    tier: str  # 'explicit' | 'measured' | 'theoretical' | 'default'
    detail: str


def parse_explicit(value, source: str) -> float:
    """A positive finite number of GB/s, or a clear error naming where the value came from."""
    try:
        v = float(str(value).strip())
    except ValueError:
        abort(f"{source}={value!r} is not a number of GB/s", "give the host<->GPU bandwidth per direction, e.g. 25 or 53.5")
    if not math.isfinite(v) or v <= 0:
        abort(f"{source}={value!r} must be a positive number of GB/s", "give the host<->GPU bandwidth per direction, e.g. 25 or 53.5")
    return v


def resolve_bandwidth(gpu_index: int = 0, explicit=None, gpus: list[GpuInfo] | None = None,
                      entries: dict | None = None, explicit_name: str = "--pcie-bw-gbps") -> Resolution:
    """The host<->GPU bandwidth (GB/s per direction) the server plans with, from the first that applies:

    1. explicit: `explicit` (a flag's value) or $ROLLINGKV_PCIE_BW_GBPS; <= 0 or non-numeric is refused;
    2. measured: this GPU's cached profile (UUID + driver), its 256 MiB host-to-device figure;
    3. theoretical: the link's line rate (NVML, else sysfs) x EFFICIENCY (0.85);
    4. default: 6.5 GB/s (PCIe 3.0 x8), with a warning.

    Never measures (that is `rollingkv probe pcie`), so it is cheap enough to call at every start.
    """
    if explicit is not None:
        return Resolution(parse_explicit(explicit, explicit_name), "explicit", f"given with {explicit_name}")
    env = paths.pcie_bw_env()
    if env is not None:
        return Resolution(env, "explicit", f"from ${paths.ENV_PCIE_BW}")
    why = ""
    if gpus is None:
        try:
            gpus = discover()
        except NoGpuError as e:
            gpus, why = [], e.reason
    gpu = next((g for g in gpus if g.index == gpu_index), None)
    if gpu is None and not why:
        why = f"no GPU {gpu_index}" if gpus else "no GPU"
    entry = cached_measurement(gpu, entries) if gpu is not None else None
    if entry is not None:
        figure = entry["h2d"].get(str(RESOLVE_SIZE_MIB))
        if isinstance(figure, (int, float)) and figure > 0:
            return Resolution(float(figure), "measured", f"{RESOLVE_SIZE_MIB} MiB pinned host-to-device copies, measured {entry['measured_at']}")
    if gpu is not None:
        gen, width, loaded = effective_link(gpu, entry)
        t = theoretical_gbps(gen, width)
        if t:
            note = f"Gen{gen} x{width} = {t:.1f} GB/s x {EFFICIENCY} efficiency"
            if not loaded and gpu.max_gen and gen < gpu.max_gen and (width or 0) >= (gpu.max_width or 0):
                note += f" (the link reads Gen{gen} of Gen{gpu.max_gen}: possibly idle power saving; `rollingkv probe pcie` measures it)"
            return Resolution(round(t * EFFICIENCY, 3), "theoretical", note)
        why = f"NVML and sysfs give no link generation/width for GPU {gpu_index}"
    warn(f"PCIe bandwidth unknown ({why}): assuming {DEFAULT_GBPS} GB/s ({DEFAULT_DETAIL}); "
         f"run `rollingkv probe pcie` or set {paths.ENV_PCIE_BW}")
    return Resolution(DEFAULT_GBPS, "default", f"{DEFAULT_DETAIL}; {why}")


def gpu_dict(g: GpuInfo) -> dict:
    d = asdict(g)
    d["downtrained"] = g.downtrained
    return d
