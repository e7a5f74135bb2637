"""The PCIe link: what the host<->GPU link is, what it should carry, and the one figure the server plans with.

Three sources, best last:

* NVML (pynvml) for the GPUs and their link (generation and width, current and max), with the kernel's
  sysfs (`/sys/bus/pci/devices/<bus id>/{current,max}_link_{speed,width}`) for any field NVML lacks;
* the theoretical per-direction bandwidth of that link: GT/s per lane x lanes x encoding (8b/10b for
  Gen1-2, 128b/130b for Gen3-5, FLIT 242/256 for Gen6) / 8, in GB/s (10^9 bytes/s);
* a measurement: pinned host<->device copies of 1, 16 and 256 MiB timed by the build's libllama (link_bw.py), cached
  per GPU UUID + driver version in the per-machine profile (profile.py).

`resolve_bandwidth()` turns that into the one number the server plans with (see its docstring for the
order). No click in here: the command is rollingkv_cli/commands/probe.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from rollingkv_cli.console import RollingKVError, abort, warn
from rollingkv_cli.hw import profile
from rollingkv_cli.lib import paths

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

SIZES_MIB = (1, 16, 256)  # the copies a measurement times (link_bw.py), per direction
RESOLVE_SIZE_MIB = 256  # the measured figure the server plans with (large copies: what KV streaming does)

_GT_PER_LANE = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
_SPEED_TO_GEN = {v: k for k, v in _GT_PER_LANE.items()}


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
    entry = profile.cached_measurement(gpu, entries) if gpu is not None else None
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
