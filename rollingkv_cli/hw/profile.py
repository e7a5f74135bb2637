"""The per-machine profile: `<cache dir>/pcie/profile.json`, what was measured on this machine and is not measured again.

{"version", "entries": {GPU UUID|driver: a link measurement (link_bw.measure)}, "cpu_attn": {machine key: a CPU
attention calibration (cpu_attn.measure)}}. A corrupt file is moved aside with a warning, never lost.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Protocol

from rollingkv_cli.console import warn
from rollingkv_cli.lib import paths


class MeasuredGpu(Protocol):
    """What a link measurement is filed under (pcie.GpuInfo is one); a protocol, so that this cache does not import
    the module that reads it."""

    pci_bus_id: str

    def cache_key(self) -> str: ...


PROFILE_VERSION = 1


def profile_path() -> Path:
    return paths.cache_dir(write=False) / "pcie" / "profile.json"


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
    except ValueError as e:  # not UTF-8, not JSON, or an integer past Python's 4300 digits
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
    paths.cache_dir()  # a cache we can write, or one line
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


def cached_measurement(gpu: MeasuredGpu, entries: dict | None = None) -> dict | None:
    """The measurement of this GPU under this driver, if it was made in the same slot."""
    entries = load_profile() if entries is None else entries
    e = entries.get(gpu.cache_key())
    if e is None:
        return None
    if e.get("pci_bus_id") and gpu.pci_bus_id and e["pci_bus_id"] != gpu.pci_bus_id:
        return None  # the card moved to another slot: another link
    return e


def save_measurement(gpu: MeasuredGpu, m: dict) -> Path:
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

