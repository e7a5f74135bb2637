"""ctypes access to our libllama: llama_cpp's bindings pointed at our build, plus our extension functions.

llama_cpp resolves its library once, at import, from LLAMA_CPP_LIB_PATH. We set that to the active
build before the first import and then check that the library it loaded really is ours, so an
unpatched libllama (for example one a plain `pip install llama-cpp-python` compiled) is never used.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
from pathlib import Path
from types import ModuleType

from rollingkv_cli.console import abort

_BUILD_INFO_SYMBOL = "llama_rolling_kv_build_info"


def bundled_library() -> Path | None:
    """A libllama shipped inside the llama_cpp package (a plain install compiles one): never loaded by us."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        return None
    lib = Path(spec.origin).parent / "lib" / "libllama.so"
    return lib if lib.exists() else None


def import_llama_cpp(lib_dir: Path) -> ModuleType:
    """Import llama_cpp bound to the libllama in lib_dir, and prove it is ours."""
    lib_dir = Path(lib_dir).resolve()
    if not (lib_dir / "libllama.so").is_file():
        abort(f"no libllama.so in {lib_dir}", "run `rollingkv build`")
    mod = sys.modules.get("llama_cpp")
    if mod is None:
        preload_cxx_runtime()
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
        try:
            import llama_cpp as mod  # noqa: PLC0415
        except ImportError as e:
            abort(f"cannot import llama_cpp: {e}", 'install the bindings: CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" pip install llama-cpp-python==0.3.36')
        except (OSError, RuntimeError, AttributeError) as e:
            abort(f"llama_cpp could not load {lib_dir / 'libllama.so'}: {e}", "rebuild with `rollingkv build`; the bindings and the library must come from the same pin")
    loaded = loaded_library_path(mod)
    if loaded is None or loaded.resolve() != (lib_dir / "libllama.so").resolve():
        abort(f"llama_cpp is bound to {loaded}, not to {lib_dir / 'libllama.so'}", "import rollingkv_cli.lib.llama_ext before anything imports llama_cpp, in a fresh process")
    if not hasattr(mod.llama_cpp._lib, _BUILD_INFO_SYMBOL):
        abort(f"{loaded} is not a rollingkv build (no {_BUILD_INFO_SYMBOL})", "build it with `rollingkv build`")
    return mod


def preload_cxx_runtime() -> None:
    """Put libstdc++ in the process's global symbol scope before llama_cpp loads our libraries.

    A CUDA libggml exports thousands of weak libstdc++ template instances (nvcc output). A Python process
    has no libstdc++ in its global scope and llama_cpp loads libraries RTLD_LOCAL, so libllama's C++
    runtime calls could bind to those copies: on the H200 that segfaulted in llama_model::print_info
    (an ostream insert resolved inside libggml-cuda.so), while LD_PRELOAD of libstdc++ made the same load
    work. Loading it RTLD_GLOBAL first does the same for every library loaded after it."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass  # no system libstdc++: the libraries bring their own


def loaded_library_path(mod: ModuleType) -> Path | None:
    lib = getattr(getattr(mod, "llama_cpp", None), "_lib", None)
    name = getattr(lib, "_name", None)
    return Path(name) if name else None


# LLAMA_ROLLING_KV_API_VERSION (include/llama-rolling-kv.h) that RollingKVParams mirrors. A library of an older API reads
# a prefix of the struct (the fields it knows) and ignores the rest, so it stays usable as long as none of the newer
# fields is asked for; a newer one may have grown the struct, which a by-value return would overrun: refused.
API_VERSION = 11
API_TAIL_CPU = 4  # the first API with tail_cpu_frac, cpu_attn_gbps and llama_rolling_kv_measure_cpu_attn_gbps
API_HEAD_SPLIT = 5  # the first API with head mode (device_heads; an API 4 library refuses mode head)
API_LIVE_STATS = 6  # the first API with llama_rolling_kv_stats_json (a split cache's tail traffic and cells per stream)
API_ELASTIC_WINDOWS = 7  # the first API with the window policy (elastic windows: the streams' device cells as one pool)
WINDOW_POLICIES = {"elastic": 0, "static": 1, "blocks": 2}
API_TAIL_AUTO = 7  # the first API whose tail types take auto (LLAMA_ROLLING_KV_TAIL_TYPE_AUTO: the planner chooses them)
# the first API with the test hooks as a context's parameters (llama_init_from_model_rolling_kv_test; before it the kernels
# read ROLLINGKV_DEBUG_PERTURB_TAIL themselves, and a bad ROLLINGKV_DEBUG_PERTURB_MOVE was ignored)
API_TEST_HOOKS = 8
TEST_HOOKS_SYMBOL = "llama_init_from_model_rolling_kv_test"
# the first API with llama_rolling_kv_measure_link (the host<->GPU link timed by libllama through ggml-backend)
API_MEASURE_LINK = 9
MEASURE_LINK_SYMBOL = "llama_rolling_kv_measure_link"
MEASURE_CPU_ATTN_SYMBOL = "llama_rolling_kv_measure_cpu_attn_gbps"
API_EVAL_TIMES = 10  # the first API whose live stats time the context's evaluations by kind ("evals": where the time went)
# the first API with the placement of a unified cache's tokens (each sequence's cells in 256-cell blocks of its own)
API_PLACEMENT = 11
PLACEMENTS = {"auto": 0, "upstream": 1, "sequences": 2}
# the tail types the CPU part attends (and the calibration measures)
CPU_ATTN_TYPES = ("f16", "q8_0", "q4_0")

RESIDENCY_MODES = {"off": 0, "auto": 1, "head": 2, "window": 3}
GGML_TYPE_COUNT_SENTINEL = -1  # resolved against the library's GGML_TYPE_COUNT at call time
# ggml_type values (ggml.h of the pin) for the cache types users name
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
GGML_TYPE_COUNT = 43  # ggml.h of the pin
TAIL_TYPE_AUTO = GGML_TYPE_COUNT + 1  # LLAMA_ROLLING_KV_TAIL_TYPE_AUTO (include/llama-rolling-kv.h, API 7)


class RollingKVParams(ctypes.Structure):
    """struct llama_rolling_kv_params (include/llama-rolling-kv.h)."""

    _fields_ = [
        ("mode", ctypes.c_int),
        ("vram_target_mib", ctypes.c_int64),
        ("window_cells", ctypes.c_int64),
        ("type_k_tail", ctypes.c_int),
        ("type_v_tail", ctypes.c_int),
        ("pcie_bw_gbps", ctypes.c_float),
        # API 4: the hybrid tail. tail_cpu_frac < 0: auto (the planner picks the share; the default since 2026-12-03); 0: off;
        # 0 < F <= 1: that share of each split layer's host tail cells (in 256-cell chunks) attended on the CPU.
        # cpu_attn_gbps <= 0: libllama calibrates (for auto; for F it only feeds the plan's estimate).
        ("tail_cpu_frac", ctypes.c_float),
        ("cpu_attn_gbps", ctypes.c_float),
        # API 5: the head split. > 0: KV heads of every layer kept on the device (head mode; with auto it means head);
        # 0: the planner decides. In the padding of an API 4 struct (same size): written 0 for an older library, which
        # never reads it.
        ("device_heads", ctypes.c_int32),
        # API 7: the windows of a window split with several streams: 0 elastic (one pool that follows the load, the
        # default), 1 static (a window of window_cells per stream). Past an API 6 struct's end: never read by it.
        ("windows", ctypes.c_int),
        # API 11: where a unified cache (one stream, several sequences) puts new tokens: 0 auto (by sequence for a window
        # split), 1 upstream's find_slot, 2 by sequence in any cache (a resident reference of a placed split). In an API
        # 7-10 struct's tail padding (same size): written for an older library, never read there.
        ("placement", ctypes.c_int),
    ]


class RollingKVTestHooks(ctypes.Structure):
    """struct llama_rolling_kv_test_hooks (include/llama-rolling-kv.h, API 8): the must-fail controls' perturbations,
    WRONG outputs on purpose. perturb_tail: every tail score times (1 + x), x finite and > -1, 0 off; perturb_move: block
    promotions written wrong, 1 or 2, 0 off."""

    _fields_ = [
        ("perturb_tail", ctypes.c_float),
        ("perturb_move", ctypes.c_int32),
    ]


# llama_rolling_kv_default_params().tail_cpu_frac is auto (-1) in builds of this series: on the H200 the CPU part pays for f16
# and q8_0 tails and auto declines where its model says it would not (docs/perf/2026-12-03-h200-hybrid-tail). Builds of
# API 4 from before that default to 0 (off): None always means the library's own default.
TAIL_CPU_AUTO = -1.0


def is_auto(frac) -> bool:
    return isinstance(frac, str) and frac.strip().lower() == "auto"


def tail_cpu_frac_value(frac: float | str | None) -> float | None:
    """The struct's tail_cpu_frac for a user's value: None -> None (the library's default); "auto" -> -1 (the planner
    picks the share); else 0 <= F <= 1 (ValueError otherwise)."""
    if frac is None:
        return None
    if is_auto(frac):
        return TAIL_CPU_AUTO
    import math

    if isinstance(frac, bool):
        raise ValueError(f"tail_cpu_frac {frac!r} is not auto or a fraction from 0 to 1")
    f = float(frac)
    if not math.isfinite(f) or not 0.0 <= f <= 1.0:
        raise ValueError(f"tail_cpu_frac {frac!r} is not auto or a fraction from 0 to 1")
    return f


LINK_MAX_SIZES = 8  # LLAMA_ROLLING_KV_LINK_MAX_SIZES
# enum llama_rolling_kv_link_status
LINK_OK, LINK_NO_GPU, LINK_NOT_FOUND, LINK_FAILED = 0, 1, 2, 3


class LinkFigures(ctypes.Structure):
    """struct llama_rolling_kv_link_figures (include/llama-rolling-kv.h, API 9): the GPU measured and its GB/s per size."""

    _fields_ = [
        ("device", ctypes.c_char * 64),
        ("description", ctypes.c_char * 128),
        ("device_id", ctypes.c_char * 64),
        ("h2d_gbps", ctypes.c_double * LINK_MAX_SIZES),
        ("d2h_gbps", ctypes.c_double * LINK_MAX_SIZES),
    ]


LINK_UNDER_LOAD = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # void (*under_load)(void * user_data)
LINK_ARGTYPES = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int32), ctypes.c_int32,
                 LINK_UNDER_LOAD, ctypes.c_void_p, ctypes.POINTER(LinkFigures)]


class LinkUnavailable(Exception):
    """llama_rolling_kv_measure_link measured nothing: status (LINK_NO_GPU, LINK_NOT_FOUND, LINK_FAILED) and the
    library's reason."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def measure_link(lib: ctypes.CDLL, device: str | None, sizes: list[int], reps: list[int], under_load=None) -> LinkFigures:
    """llama_rolling_kv_measure_link on lib: copies of sizes[i] bytes, reps[i] per run, between the GPU `device` (its PCI
    bus id or ggml name; None: the first GPU) and its backend's pinned host memory; under_load() is called while copies
    are in flight. LinkUnavailable when it measured nothing; AttributeError when lib has no such function (before API 9)."""
    if not sizes or len(sizes) != len(reps) or len(sizes) > LINK_MAX_SIZES:
        raise ValueError(f"1 to {LINK_MAX_SIZES} sizes, each with its copies per run")
    fn = getattr(lib, MEASURE_LINK_SYMBOL)
    fn.restype = ctypes.c_int32
    fn.argtypes = LINK_ARGTYPES
    lib.llama_rolling_kv_last_error.restype = ctypes.c_char_p
    lib.llama_rolling_kv_last_error.argtypes = []
    n = len(sizes)
    out = LinkFigures()
    # a NULL function pointer without a callback; the callback object lives until the call returns
    cb = LINK_UNDER_LOAD(lambda _user: under_load()) if under_load else ctypes.cast(None, LINK_UNDER_LOAD)
    status = fn(device.encode() if device else None, (ctypes.c_size_t * n)(*sizes), (ctypes.c_int32 * n)(*reps), n, cb,
                None, ctypes.byref(out))
    if status != LINK_OK:
        raise LinkUnavailable(int(status), (lib.llama_rolling_kv_last_error() or b"").decode(errors="replace") or
                              f"status {status}")
    return out


def register_backend_modules(lib_dir: Path, mode: int = ctypes.DEFAULT_MODE) -> None:
    """Builds with backends as modules (GGML_BACKEND_DL) register none until they are loaded: load them from lib_dir
    (libggml.so opened with `mode`). A no-op for other builds, and for a build without a separate libggml."""
    try:
        ggml = ctypes.CDLL(str(lib_dir / "libggml.so"), mode=mode)
    except OSError:
        return
    if not hasattr(ggml, "ggml_backend_dev_count") or not hasattr(ggml, "ggml_backend_load_all_from_path"):
        return
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    if ggml.ggml_backend_dev_count() == 0:
        ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
        ggml.ggml_backend_load_all_from_path(str(lib_dir).encode())


def load_libllama(lib_dir: Path) -> ctypes.CDLL:
    """libllama of a build, loaded in this process (a child's: the CLI itself never loads it), with the ggml backends a
    build of backend modules registers only once loaded. OSError when it does not load."""
    preload_cxx_runtime()
    register_backend_modules(lib_dir, mode=ctypes.RTLD_GLOBAL)  # libggml global before libllama, which needs it
    return ctypes.CDLL(str(lib_dir / "libllama.so"))


def load_rollingkv_build(lib_dir: Path) -> tuple[ctypes.CDLL | None, dict]:
    """A child's libllama of a rollingkv build: (lib, {"build_info", "api_version", "lib"}); (None, {"error", "kind":
    "load"}) when the build has no libllama, it does not load, or it is not ours."""
    path = lib_dir / "libllama.so"
    if not path.is_file():
        return None, {"error": f"no libllama.so in {lib_dir}", "kind": "load"}
    try:
        lib = load_libllama(lib_dir)
    except OSError as e:
        return None, {"error": f"cannot load {path}: {e}", "kind": "load"}
    if not hasattr(lib, "llama_rolling_kv_build_info"):
        return None, {"error": f"{path} is not a rollingkv build", "kind": "load"}
    lib.llama_rolling_kv_build_info.restype = ctypes.c_char_p
    lib.llama_rolling_kv_api_version.restype = ctypes.c_int32
    return lib, {"build_info": lib.llama_rolling_kv_build_info().decode(errors="replace"),
                 "api_version": int(lib.llama_rolling_kv_api_version()), "lib": str(path)}


def bind_measure_cpu_attn(lib: ctypes.CDLL) -> bool:
    """Declare llama_rolling_kv_measure_cpu_attn_gbps on lib; False when lib has none (built before API 4)."""
    fn = getattr(lib, MEASURE_CPU_ATTN_SYMBOL, None)
    if fn is None:
        return False
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_int32, ctypes.c_int]
    return True


def measure_cpu_attn_gbps(lib: ctypes.CDLL, n_threads: int, type_name: str) -> float:
    """The library's CPU decode attention calibration: GB/s of K+V bytes read over a ~256 MiB tail of type_name on
    n_threads threads (< 0 when the library does not support that type). ValueError on a type outside CPU_ATTN_TYPES;
    AttributeError when the library has no such function."""
    if type_name not in CPU_ATTN_TYPES:
        raise ValueError(f"the CPU part attends {', '.join(CPU_ATTN_TYPES)} tails, not {type_name!r}")
    if n_threads < 1:
        raise ValueError(f"n_threads must be at least 1, not {n_threads}")
    if not bind_measure_cpu_attn(lib):
        raise AttributeError(f"{getattr(lib, '_name', 'libllama')} has no {MEASURE_CPU_ATTN_SYMBOL}")
    return float(getattr(lib, MEASURE_CPU_ATTN_SYMBOL)(int(n_threads), GGML_TYPES[type_name]))


class Extension:
    """Our functions from include/llama-rolling-kv.h, on the library llama_cpp loaded."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        self.has_residency = hasattr(lib, "llama_init_from_model_rolling_kv")
        if self.has_residency:
            lib.llama_rolling_kv_default_params.restype = RollingKVParams
            lib.llama_rolling_kv_default_params.argtypes = []
            lib.llama_init_from_model_rolling_kv.restype = ctypes.c_void_p
            lib.llama_init_from_model_rolling_kv.argtypes = [ctypes.c_void_p, _context_params_type(), ctypes.POINTER(RollingKVParams)]
            lib.llama_rolling_kv_plan_json.restype = ctypes.c_int32
            lib.llama_rolling_kv_plan_json.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
            lib.llama_kv_residency_mode_from_str.restype = ctypes.c_int32
            lib.llama_kv_residency_mode_from_str.argtypes = [ctypes.c_char_p]
        # API 8: the test hooks at context creation
        self.has_test_hooks = self.has_residency and hasattr(lib, TEST_HOOKS_SYMBOL)
        if self.has_test_hooks:
            fn = getattr(lib, TEST_HOOKS_SYMBOL)
            fn.restype = ctypes.c_void_p
            fn.argtypes = [ctypes.c_void_p, _context_params_type(), ctypes.POINTER(RollingKVParams), ctypes.POINTER(RollingKVTestHooks)]
        # API 2: why a context was refused; the planner on given figures is the test library next to libllama
        self.has_planner = hasattr(lib, "llama_rolling_kv_last_error")
        self._sim = None
        if self.has_planner:
            lib.llama_rolling_kv_last_error.restype = ctypes.c_char_p
            lib.llama_rolling_kv_last_error.argtypes = []
        lib.llama_rolling_kv_build_info.restype = ctypes.c_char_p
        lib.llama_rolling_kv_build_info.argtypes = []
        lib.llama_rolling_kv_api_version.restype = ctypes.c_int32
        lib.llama_rolling_kv_api_version.argtypes = []
        for fn in ("llama_rolling_kv_sizeof_context_params", "llama_rolling_kv_sizeof_model_params"):
            getattr(lib, fn).restype = ctypes.c_size_t
            getattr(lib, fn).argtypes = []
        self.api = self.api_version()
        # API 4: the hybrid tail (the params' tail_cpu_frac/cpu_attn_gbps, the CPU attention calibration)
        self.has_tail_cpu = self.api >= API_TAIL_CPU and bind_measure_cpu_attn(lib)

    def build_info(self) -> str:
        return self._lib.llama_rolling_kv_build_info().decode()

    def api_version(self) -> int:
        return int(self._lib.llama_rolling_kv_api_version())

    def abi_mismatches(self, llama_cpp_mod: ModuleType) -> list[str]:
        """Structs whose ctypes mirror in llama_cpp differs in size from the C library's."""
        bad = []
        for name, fn in (("llama_context_params", "llama_rolling_kv_sizeof_context_params"),
                         ("llama_model_params", "llama_rolling_kv_sizeof_model_params")):
            c_size = int(getattr(self._lib, fn)())
            py_size = ctypes.sizeof(getattr(llama_cpp_mod, name))
            if c_size != py_size:
                bad.append(f"{name}: C {c_size} bytes, llama_cpp ctypes {py_size} bytes")
        return bad


    # ------------------------------------------------------------ residency API
    def _require_residency(self) -> None:
        if not self.has_residency:
            abort("this build has no KV residency API (llama_init_from_model_rolling_kv)", "rebuild with `rollingkv build`")
        if self.api > API_VERSION:
            abort(f"this build's rolling-KV API is version {self.api}, newer than the {API_VERSION} this rollingkv knows "
                  "(its struct llama_rolling_kv_params may have grown)", "update rollingkv to the build's checkout, or rebuild from this one")

    def _require_tail_cpu(self, what: str) -> None:
        if not self.has_tail_cpu:
            abort(f"{what} needs the hybrid tail (rolling-KV API {API_TAIL_CPU}, {MEASURE_CPU_ATTN_SYMBOL}); "
                  f"this build has API {self.api}" + ("" if self.api < API_TAIL_CPU else f" without {MEASURE_CPU_ATTN_SYMBOL}"),
                  "rebuild with `rollingkv build`")

    def default_params(self) -> RollingKVParams:
        self._require_residency()
        return self._lib.llama_rolling_kv_default_params()

    def make_params(self, mode: str = "auto", vram_target_mib: int = 0, window_cells: int = 0,
                    type_k_tail: str | None = None, type_v_tail: str | None = None, pcie_bw_gbps: float = 0.0,
                    tail_cpu_frac: float | str | None = None, cpu_attn_gbps: float = 0.0, device_heads: int = 0,
                    windows: str = "elastic", placement: str = "auto") -> RollingKVParams:
        """tail_cpu_frac: None = the library's default (auto in this series); "auto" = the planner decides (-1 in the
        struct); 0 = no CPU part; 0 < F <= 1 = that share of each split layer's tail on the CPU. cpu_attn_gbps <= 0: libllama calibrates
        at plan time (auto only). A library before API 4 has no CPU part and ignores both fields: None or 0 is what it
        does; auto, a share or a CPU bandwidth there is refused. device_heads > 0: the head split's KV heads per layer on the
        device (API 5; mode head or auto); head mode or device heads on an older library are refused. type_k_tail/type_v_tail:
        a type name, None (the window's type) or "auto" (the planner chooses when the cache spills; API 7). windows:
        "elastic" (the default) or "static" (API 7; an older library has static windows only, so "static" is what it does).
        placement: "auto" (by sequence for a window split), "upstream" or "sequences" (API 11; an older library places as
        upstream does: "sequences" is refused there)."""
        try:
            frac = tail_cpu_frac_value(tail_cpu_frac)
        except (TypeError, ValueError):
            abort(f"tail_cpu_frac {tail_cpu_frac!r} is not auto or a fraction from 0 to 1",
                  "give auto, 0 (no CPU part), or a share of the tail such as 0.5")
        import math

        if not isinstance(cpu_attn_gbps, (int, float)) or isinstance(cpu_attn_gbps, bool) or not math.isfinite(cpu_attn_gbps):
            abort(f"cpu_attn_gbps {cpu_attn_gbps!r} is not a number", "give the CPU attention GB/s, or 0 to let libllama measure it")
        if frac is not None and frac != 0.0:
            self._require_tail_cpu(f"tail_cpu_frac {tail_cpu_frac!r}")
        if cpu_attn_gbps > 0:
            self._require_tail_cpu(f"cpu_attn_gbps {cpu_attn_gbps!r}")
        if isinstance(device_heads, bool) or not isinstance(device_heads, int) or device_heads < 0 or device_heads > 2**31 - 1:
            abort(f"device_heads {device_heads!r} is not a number of KV heads", "give 1 or more KV heads per layer, or 0 to let the planner decide")
        if (mode == "head" or device_heads > 0) and self.api < API_HEAD_SPLIT:
            abort(f"{'head mode' if mode == 'head' else f'device_heads {device_heads}'} needs the head split (rolling-KV API "
                  f"{API_HEAD_SPLIT}); this build has API {self.api}", "rebuild with `rollingkv build`, or use window mode")
        p = self.default_params()
        if mode not in RESIDENCY_MODES:
            abort(f"unknown KV residency mode {mode!r}", f"use one of {', '.join(RESIDENCY_MODES)}")
        p.mode = RESIDENCY_MODES[mode]
        p.vram_target_mib = int(vram_target_mib)
        p.window_cells = int(window_cells)
        for field, name in (("type_k_tail", type_k_tail), ("type_v_tail", type_v_tail)):
            if name == "auto":
                if self.api < API_TAIL_AUTO:
                    abort(f"{field} auto needs the planner's tail types (rolling-KV API {API_TAIL_AUTO}); this build has API "
                          f"{self.api}", "rebuild with `rollingkv build`, or give the tail a type")
                setattr(p, field, TAIL_TYPE_AUTO)
            elif name is not None:
                if name not in GGML_TYPES:
                    abort(f"unknown cache type {name!r}", f"use one of {', '.join(GGML_TYPES)}, or auto")
                setattr(p, field, GGML_TYPES[name])
        p.pcie_bw_gbps = float(pcie_bw_gbps)
        # written on every library: one before API 4 never reads them (its default_params left them unwritten); None keeps
        # an API 4 library's own default
        if frac is not None or self.api < API_TAIL_CPU:
            p.tail_cpu_frac = 0.0 if frac is None else frac
        p.cpu_attn_gbps = float(cpu_attn_gbps) if cpu_attn_gbps > 0 else 0.0
        p.device_heads = int(device_heads)  # an older library's padding: written, never read
        if windows not in WINDOW_POLICIES:
            abort(f"unknown window policy {windows!r}", f"use one of {', '.join(WINDOW_POLICIES)}")
        p.windows = WINDOW_POLICIES[windows]  # past an older library's struct: never read there (its windows are static)
        if placement not in PLACEMENTS:
            abort(f"unknown placement {placement!r}", f"use one of {', '.join(PLACEMENTS)}")
        if placement == "sequences" and self.api < API_PLACEMENT:
            abort(f"placement sequences needs rolling-KV API {API_PLACEMENT}; this build has API {self.api}",
                  "rebuild with `rollingkv build`, or leave placement at auto")
        p.placement = PLACEMENTS[placement]
        return p

    def measure_cpu_attn_gbps(self, n_threads: int, type_name: str = "f16") -> float:
        """llama_rolling_kv_measure_cpu_attn_gbps: the CPU decode attention's GB/s over a ~256 MiB tail of type_name
        (f16, q8_0, q4_0) on n_threads threads; < 0 when the library does not support it. A build before the hybrid
        tail: a clear error."""
        self._require_tail_cpu("measuring the CPU attention")
        try:
            return measure_cpu_attn_gbps(self._lib, n_threads, type_name)
        except ValueError as e:
            abort(str(e), f"use one of {', '.join(CPU_ATTN_TYPES)} and at least 1 thread")

    def init_context(self, model_ptr, cparams, rkv: RollingKVParams | None, test: RollingKVTestHooks | None = None):
        """llama_init_from_model_rolling_kv: a llama_context pointer (None on failure). test: the context's test hooks
        (llama_init_from_model_rolling_kv_test, API 8; the environment's ROLLINGKV_DEBUG_PERTURB_* are then not read)."""
        self._require_residency()
        rkv_ref = ctypes.byref(rkv) if rkv is not None else None
        if test is None:
            return self._lib.llama_init_from_model_rolling_kv(model_ptr, cparams, rkv_ref)
        if not self.has_test_hooks:
            abort(f"test hooks need rolling-KV API {API_TEST_HOOKS} ({TEST_HOOKS_SYMBOL}); this build has API {self.api}",
                  "rebuild with `rollingkv build`")
        return getattr(self._lib, TEST_HOOKS_SYMBOL)(model_ptr, cparams, rkv_ref, ctypes.byref(test))

    def plan(self, ctx_ptr) -> dict:
        import json

        self._require_residency()
        n = self._lib.llama_rolling_kv_plan_json(ctx_ptr, None, 0)
        if n < 0:
            abort("no residency plan: the context is NULL")
        buf = ctypes.create_string_buffer(n + 1)
        self._lib.llama_rolling_kv_plan_json(ctx_ptr, buf, n + 1)
        return json.loads(buf.value.decode())

    def stats(self, ctx_ptr) -> dict | None:
        """llama_rolling_kv_stats_json: what a split cache attended of its tail so far, and its cells per stream (None
        before API 6)."""
        fn = getattr(self._lib, "llama_rolling_kv_stats_json", None) if self.api >= API_LIVE_STATS else None
        if fn is None:
            return None
        fn.restype = ctypes.c_int32
        fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        n = fn(ctx_ptr, None, 0)
        if n < 0:
            return None
        buf = ctypes.create_string_buffer(n + 1)
        fn(ctx_ptr, buf, n + 1)
        return json.loads(buf.value.decode())

    def _require_planner(self) -> None:
        if not self.has_planner:
            abort("this build has no planner API (llama_rolling_kv_last_error)", "rebuild with `rollingkv build`")

    def simulate_plan(self, figures: dict) -> dict:
        """rollingkv_plan_simulate: the library's planner on the given figures (keys: see rollingkv/plan-simulate.cpp of
        the tree), without a model or a device, from the planner test library librollingkv-plan-sim.so next to libllama.
        Invalid input gives {"error": ..., "invalid_input": true}."""
        import json

        self._require_planner()
        if self._sim is None:
            path = Path(self._lib._name).parent / "librollingkv-plan-sim.so"
            if not path.is_file():
                abort(f"this build has no planner test library ({path.name} next to {Path(self._lib._name).name})",
                      "rebuild with `rollingkv build`")
            self._sim = ctypes.CDLL(str(path))
            self._sim.rollingkv_plan_simulate.restype = ctypes.c_int32
            self._sim.rollingkv_plan_simulate.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        data = json.dumps(figures).encode()
        n = self._sim.rollingkv_plan_simulate(data, None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self._sim.rollingkv_plan_simulate(data, buf, n + 1)
        return json.loads(buf.value.decode())

    def last_error(self) -> str:
        """Why the last init_context of this thread returned None ("" after a success)."""
        self._require_planner()
        return (self._lib.llama_rolling_kv_last_error() or b"").decode(errors="replace")


# llama_init_from_model_rolling_kv logs its refusal as "<function>: <reason>" (llama_rkv_fail), the function being the
# one that made the context (since API 8 llama_init_from_model_rolling_kv_test, which the plain one calls); the same
# text llama_rolling_kv_last_error returns in-process. A child's (llama-server's, llama-bench -v's) log carries it this way.
REFUSAL_PREFIXES = ("llama_init_from_model_rolling_kv: ", "llama_init_from_model_rolling_kv_test: ")
# what last_error says when llama.cpp itself, not the residency request, refused: no reason of its own
_NO_REASON = "llama_init_from_model failed (see the log)"


def refusal_reason(text: str | None) -> str | None:
    """The library's reason for refusing a context, from last_error()'s text: None when it gave none."""
    text = (text or "").strip()
    if not text or text == _NO_REASON:
        return None
    return text.removeprefix("rolling KV: ")


def refusal_in_log(lines) -> str | None:
    """The library's reason for refusing a context, found in a child's log lines (the last one wins)."""
    found = None
    for line in lines:
        for prefix in REFUSAL_PREFIXES:
            at = line.find(prefix)
            if at >= 0:
                found = refusal_reason(line[at + len(prefix):]) or found
    return found


def _context_params_type():
    import llama_cpp

    return llama_cpp.llama_context_params


def load(lib_dir: Path | None = None) -> tuple[ModuleType, Extension]:
    """(llama_cpp, our extension) bound to lib_dir or the active build."""
    if lib_dir is None:
        from rollingkv_cli.lib import builder

        b = builder.active_build(required=True)
        assert b is not None
        lib_dir = b.lib_dir
    mod = import_llama_cpp(lib_dir)
    from rollingkv_cli.lib import child

    child.install_abort_report(mod.llama_cpp._lib)  # in run_isolated's child: ggml's assertion comes back
    return mod, Extension(mod.llama_cpp._lib)


# ------------------------------------------------------------ loading models, and surviving llama.cpp's aborts

@contextlib.contextmanager
def captured_errors(llama_cpp_mod: ModuleType):
    """The error lines llama.cpp logs while the block runs (llama_cpp sends them to a silenced stderr unless
    verbose); its own callback still gets every line."""
    lines: list[str] = []
    original = llama_cpp_mod._logger.llama_log_callback
    last = [0]

    @llama_cpp_mod.llama_log_callback
    def callback(level, text, user_data):
        # ggml.h of the pin: ERROR = 4, CONT = 5 (llama_cpp's _logger still maps the older enum, one lower)
        if level == 4 or (level == 5 and last[0] == 4):
            lines.append((text or b"").decode(errors="replace"))
        if level != 5:
            last[0] = level
        original(level, text, user_data)

    llama_cpp_mod.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp_mod.llama_log_set(original, ctypes.c_void_p(0))


def _reason(lines: list[str]) -> str:
    """llama.cpp's first error line (the cause; the later ones say that the load failed)."""
    first = next((" ".join(line.split()) for line in lines if line.strip()), "")
    return first[:300] if first else "see its log with -v"


CTX_PAD = 256  # llama_context pads n_ctx up to a multiple of this (llama-context.cpp of the pin)


def open_model(llama_cpp_mod: ModuleType, path: Path, name: str, **kwargs):
    """llama_cpp.Llama on path; llama.cpp refusing the file or the context becomes one line naming the file."""
    if kwargs.get("n_ctx"):
        # llama_cpp sizes its token buffer by the n_ctx asked for but checks prompts against the padded one,
        # so a prompt between the two overran the buffer (a numpy ValueError): ask for the padded size
        kwargs["n_ctx"] = -(-int(kwargs["n_ctx"]) // CTX_PAD) * CTX_PAD
    from jinja2 import TemplateError  # llama_cpp's chat formatter's

    with captured_errors(llama_cpp_mod) as errors:
        try:
            return llama_cpp_mod.Llama(model_path=str(path), **kwargs)
        except TemplateError as e:  # the GGUF's chat template, compiled here: "internal error: RuntimeError" before
            abort(f"the chat template of {name} (tokenizer.chat_template) is not a valid Jinja template: {str(e)[:200]}",
                  "the file's metadata is broken: fix its tokenizer.chat_template (gguf-py's gguf_new_metadata.py "
                  "--chat-template), or use another file")
        except ValueError as e:
            if "context" in str(e):
                abort(f"llama.cpp could not create a context of {kwargs.get('n_ctx')} tokens for {name}: {_reason(errors)}",
                      "lower -c/--ctx-size, or free memory")
            abort(f"llama.cpp could not load {name}: {_reason(errors)}", "the file is corrupt or not a model this build runs")
