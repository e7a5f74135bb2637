"""What the host CPU is and which of its features a build's CPU backend uses: what a crash report needs."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
MEMINFO = Path("/proc/meminfo")
# Flags that pick a different ggml CPU kernel (the ones a SIGILL or a wrong result depends on).
KERNEL_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "sve", "asimd", "i8mm")


def mem_available_bytes() -> int | None:
    """The kernel's MemAvailable (what can be allocated without swapping: free memory plus the reclaimable caches), None
    where /proc/meminfo does not say. Not MemTotal, which ggml's CPU device reports as its "free" memory."""
    try:
        for line in MEMINFO.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                kib, *unit = value.split()
                return int(kib) * 1024 if unit in ([], ["kB"]) else None
    except (OSError, ValueError):
        return None
    return None


def cpu_model() -> str:
    for key in ("model name", "Model", "cpu model", "Hardware"):
        for line in _cpuinfo_lines():
            name, _, value = line.partition(":")
            if name.strip() == key and value.strip():
                return value.strip()
    import platform

    return platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> set[str]:
    for line in _cpuinfo_lines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def has_amx() -> bool:
    """The CPU has AMX int8 tiles (what ggml's AMX buffer type runs on)."""
    return {"amx_tile", "amx_int8"} <= cpu_flags()


def _cpuinfo_lines() -> list[str]:
    try:
        return CPUINFO.read_text(errors="replace").splitlines()
    except OSError:
        return []


@dataclass
class BackendInfo:
    """What a build's libraries report about the CPU backend, read in a child process (a library that
    dies on load is then reported, not fatal)."""

    features: dict[str, str] = field(default_factory=dict)  # ggml's system info: "AVX2" -> "1", ...
    extra_buffer_types: list[str] = field(default_factory=list)  # e.g. ["AMX", "CPU_REPACK"]
    system_info: str = ""
    error: str | None = None

    @property
    def enabled(self) -> list[str]:
        return [k for k, v in self.features.items() if v not in ("0", "")]


def backend_info(lib_dir: Path, timeout: float = 60) -> BackendInfo:
    """What the build in lib_dir's libraries say about the CPU backend, asked in a child (lib/child.py)."""
    from rollingkv_cli.lib import child
    from rollingkv_cli.lib.procs import describe_exit

    try:
        rc, out, err = child.run(child.python_command("rollingkv_cli.hw.hostinfo", lib_dir), timeout)
    except child.Timeout:
        return BackendInfo(error=f"loading the libraries in {lib_dir} took over {timeout:.0f} s")
    data = child.last_json(out)
    if rc != 0 or data is None:
        last = (err.strip().splitlines() or [""])[-1]
        return BackendInfo(error=f"loading the libraries in {lib_dir} failed: {describe_exit(rc)}"
                           + (f" ({last})" if last else ""))
    return BackendInfo(parse_system_info(data["system_info"]), data["extra_buffer_types"], data["system_info"])


def _probe(d: str) -> dict:
    """The child side: load the build's libraries (backends built as modules too) and ask ggml's CPU device."""
    import ctypes

    try:
        ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        pass
    ggml = ctypes.CDLL(d + "/libggml.so", mode=ctypes.RTLD_GLOBAL)
    base = ctypes.CDLL(d + "/libggml-base.so", mode=ctypes.RTLD_GLOBAL)
    ggml.ggml_backend_load_all_from_path(d.encode())  # backends built as modules; a no-op otherwise
    llama = ctypes.CDLL(d + "/libllama.so")
    llama.llama_print_system_info.restype = ctypes.c_char_p
    info = llama.llama_print_system_info().decode(errors="replace")
    P = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.restype = P
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    base.ggml_backend_dev_backend_reg.restype = P
    base.ggml_backend_dev_backend_reg.argtypes = [P]
    base.ggml_backend_reg_get_proc_address.restype = P
    base.ggml_backend_reg_get_proc_address.argtypes = [P, ctypes.c_char_p]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    base.ggml_backend_buft_name.argtypes = [P]
    bufts = []
    dev = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if dev:
        fn = base.ggml_backend_reg_get_proc_address(base.ggml_backend_dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts")
        if fn:
            arr = ctypes.CFUNCTYPE(ctypes.POINTER(P), P)(fn)(dev)
            i = 0
            while arr and arr[i]:
                bufts.append(base.ggml_backend_buft_name(arr[i]).decode())
                i += 1
    return {"system_info": info, "extra_buffer_types": bufts}


def parse_system_info(text: str) -> dict[str, str]:
    """ggml's "CPU : SSE3 = 1 | AVX2 = 1 | AMX_INT8 = 1 | ..." as {"SSE3": "1", ...} (every backend's part)."""
    features: dict[str, str] = {}
    for part in text.replace(":", "|").split("|"):
        name, eq, value = part.partition("=")
        if eq and name.strip():
            features[name.strip()] = value.strip()
    return features


if __name__ == "__main__":  # python -m rollingkv_cli.hw.hostinfo LIB_DIR (backend_info's child)
    from rollingkv_cli.lib.child import reply

    reply(_probe(sys.argv[1]))
