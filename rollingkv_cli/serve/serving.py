"""What `rollingkv serve` does: settings from flags + config file, the llama-server command line,
pre-flight checks, supervision, live status. The click layer is commands/serve.py."""

from __future__ import annotations

import ctypes
import math
import re
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rollingkv_cli.lib import paths
from rollingkv_cli.kvtypes import TAIL_AUTO, TAIL_TYPE_CHOICES, TAIL_TYPES, WINDOW_TYPES  # the one list of KV types (the library's)
from rollingkv_cli.console import (RollingKVError, abort, console, esc, info, is_interactive, log_panel, note, print_error,
                                   success, usage_error, warn)

RESIDENCY_MODES = ("auto", "window", "head", "off")
CACHE_TYPES = WINDOW_TYPES  # -ctk/-ctv: llama.cpp's, iq4_nl too, for an unsplit cache only (check_split_types)
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
_FLAG_KEYS = ("kv_residency_mode", "vram_target", "kv_window_cells", "kv_device_heads", "ctx_size", "parallel", "cache_type_k", "cache_type_v",
              "cache_type_k_tail", "cache_type_v_tail", "pcie_bw_gbps", "kv_tail_cpu_frac", "host", "port", "slot_save")
CONFIG_KEYS = ("model", "extra_args") + _FLAG_KEYS


@dataclass
class ServeSettings:
    model: Path
    kv_residency_mode: str | None = None
    vram_target: int | None = None
    kv_window_cells: int | None = None
    kv_device_heads: int | None = None  # the head split: KV heads per layer kept on the device
    ctx_size: int | None = None
    parallel: int | None = None
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    cache_type_k_tail: str | None = None
    cache_type_v_tail: str | None = None
    pcie_bw_gbps: float | None = None
    kv_tail_cpu_frac: float | str | None = None  # "auto" or 0 <= F <= 1; None: llama-server's default (auto)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    slot_save: bool = False  # llama-server's slot save/restore into <cache>/slots (off: any client could write files there)
    extra_args: list[str] = field(default_factory=list)


class SettingError(ValueError):
    """A setting's value is bad: the text says why, without naming where it came from."""


@dataclass(frozen=True)
class Setting:
    """One serve setting, checked the same way from a flag (text) and from the config file (YAML values)."""

    key: str
    kind: str  # "int" | "float" | "choice" | "str" | "fraction_or_auto" | "bool"
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    cap: int | None = None  # the most llama-server's field holds: said only to a value above it

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    def check(self, value, from_text: bool = False):
        """The value, converted; SettingError when it is not acceptable."""
        if self.kind == "choice":
            v = str(value) if from_text else value
            if v not in self.choices:
                raise SettingError(f"{value!r} is not one of {', '.join(self.choices)}")
            return v
        if self.kind == "fraction_or_auto":
            return _fraction_or_auto(value, from_text)
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            raise SettingError(f"must be true or false, not {value!r}")
        if self.kind == "str":
            if from_text:
                value = str(value)
            if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
                raise SettingError(f"must be a host name or address, not {value!r}")
            return value
        if self.kind == "int":
            v = _as_int(value, from_text)
        else:
            v = _as_float(value, from_text)
        positive = self.kind == "float" and self.lo == 0  # an exclusive bound: a positive number
        if (self.lo is not None and (v <= self.lo if positive else v < self.lo)) or (self.hi is not None and v > self.hi):
            raise SettingError(f"must be {self._range()}, not {value if from_text else repr(value)}")
        if self.cap is not None and v > self.cap:
            raise SettingError(f"must be at most {self.cap} (what llama-server takes), not {value if from_text else repr(value)}")
        return v

    def _range(self) -> str:
        noun = "an integer" if self.kind == "int" else "a number"
        if self.kind == "float" and self.lo == 0:
            return "a positive number"
        num = (lambda v: str(int(v))) if self.kind == "int" else (lambda v: f"{v:g}")  # noqa: E731
        if self.hi is not None:
            return f"{noun} from {num(self.lo)} to {num(self.hi)}"
        return f"{noun} of at least {num(self.lo)}" if self.lo is not None else noun


def _fraction_or_auto(value, from_text: bool) -> float | str:
    """"auto", or a share of the tail from 0 to 1 (a float)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if not from_text and isinstance(value, str):
        raise SettingError(f"must be auto or a fraction from 0 to 1, not {value!r}")
    try:
        v = _as_float(value, from_text)
    except SettingError:
        raise SettingError(f"must be auto or a fraction from 0 to 1, not {value if from_text else repr(value)}") from None
    if not 0.0 <= v <= 1.0:
        raise SettingError(f"must be auto or a fraction from 0 to 1 (0: no CPU part, 1: the whole tail on the CPU), "
                           f"not {value if from_text else repr(value)}")
    return v


def _as_int(value, from_text: bool) -> int:
    if from_text:
        try:
            return int(str(value).strip(), 10)
        except ValueError:
            raise SettingError(f"{value!r} is not an integer") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingError(f"must be an integer, not {value!r}")
    return value


def _as_float(value, from_text: bool) -> float:
    if from_text:
        try:
            v = float(str(value).strip())
        except ValueError:
            raise SettingError(f"{value!r} is not a number") from None
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingError(f"must be a number, not {value!r}")
    else:
        v = float(value)
    if not math.isfinite(v):
        raise SettingError(f"must be a finite number, not {value!r}")
    return v


INT32_MAX = 2**31 - 1
MAX_VRAM_TARGET_MIB = 2**24  # 16 TiB per device: far above any GPU, far below an overflow of MiB -> bytes

# the one table of what serve accepts: the flags (commands/serve.py) and the config file check against it
SETTINGS: dict[str, Setting] = {s.key: s for s in (
    Setting("kv_residency_mode", "choice", choices=RESIDENCY_MODES),
    # caps: what llama-server's int32 / MiB fields hold (a value past them failed only after start-up)
    Setting("vram_target", "int", lo=1, cap=MAX_VRAM_TARGET_MIB),
    Setting("kv_window_cells", "int", lo=1, cap=INT32_MAX),
    Setting("kv_device_heads", "int", lo=1, cap=INT32_MAX),
    Setting("ctx_size", "int", lo=64, cap=INT32_MAX),
    Setting("parallel", "int", lo=1, hi=256),
    Setting("cache_type_k", "choice", choices=CACHE_TYPES),
    Setting("cache_type_v", "choice", choices=CACHE_TYPES),
    Setting("cache_type_k_tail", "choice", choices=TAIL_TYPE_CHOICES),  # a type, or auto: the planner's when the cache spills
    Setting("cache_type_v_tail", "choice", choices=TAIL_TYPE_CHOICES),
    Setting("pcie_bw_gbps", "float", lo=0),
    Setting("kv_tail_cpu_frac", "fraction_or_auto"),
    Setting("host", "str"),
    Setting("port", "int", lo=0, hi=65535),
    Setting("slot_save", "bool"),
)}
assert set(SETTINGS) == set(_FLAG_KEYS)


def check_setting(key: str, value, from_text: bool = False):
    return SETTINGS[key].check(value, from_text)


def _load_config(path: Path) -> dict:
    from rollingkv_cli.userinput import read_yaml

    data = read_yaml(path, "config file")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        abort(f"config file {path}: expected a mapping of settings, got {type(data).__name__}",
              "write one `key: value` per line, e.g. `ctx_size: 4096`")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - set(CONFIG_KEYS))
    if unknown:
        usage_error(f"config file {path}: unknown key(s) {', '.join(unknown)}", f"known keys: {', '.join(CONFIG_KEYS)}")
    return data


def _config_value(key: str, value, source: str):
    if value is None:
        return None
    if key == "extra_args":
        if not isinstance(value, list) or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in value):
            usage_error(f"{source}: extra_args must be a list of strings")
        return [str(a) for a in value]
    if key == "model":
        if not isinstance(value, str) or not value.strip():
            usage_error(f"{source}: model must be a GGUF path or `demo`, not {value!r}")
        return value
    try:
        return check_setting(key, value)
    except SettingError as e:
        usage_error(f"{source}: {key} {e}")


def resolve_settings(model_spec: str | None, flags: dict, explicit: set[str], config_file: Path | None, extra: list[str]) -> ServeSettings:
    """Flags (already checked by their click type, SettingType) over the config file (checked here by the same
    Setting), then the checks across settings, which name where each value came from."""
    from rollingkv_cli import models

    config = _load_config(config_file) if config_file else {}
    source = f"config file {config_file}"
    merged: dict = {}
    where: dict[str, str] = {}
    for key in _FLAG_KEYS:
        if key in explicit or key not in config:
            merged[key] = flags.get(key)
            where[key] = SETTINGS[key].flag
        else:
            merged[key] = _config_value(key, config[key], source)
            where[key] = f"{source}: {key}"
    spec = model_spec or _config_value("model", config.get("model"), source)
    extra_args = list(extra) if extra else _config_value("extra_args", config.get("extra_args", []), source)
    extra_where = "after `--`" if extra else f"in {source}: extra_args"
    _check_extra_args(extra_args or [], merged, where, extra_where)
    _check_together(merged, where, unified=_given(extra_args or [], "--kv-unified") or _given(extra_args or [], "-kvu"))
    if not spec:
        usage_error("no MODEL given", "pass a GGUF path or `demo`, or set `model:` in --config")
    # what splits on any build; serve checks auto on a GPU once it knows the build
    check_split_types({where["cache_type_k"]: merged["cache_type_k"], where["cache_type_v"]: merged["cache_type_v"]},
                      *_split_asked(merged, extra_args or []), cuda=False)
    model = models.resolve_model(str(spec), log=note)
    s = ServeSettings(model=model, extra_args=extra_args or [],
                      **{k: v for k, v in merged.items() if k not in ("host", "port", "slot_save")})
    s.host = merged.get("host") or DEFAULT_HOST
    s.port = DEFAULT_PORT if merged.get("port") is None else merged["port"]
    s.slot_save = bool(merged.get("slot_save"))
    return s


# llama-server's spellings of what serve sets from its own settings (server_command_args)
_LLAMA_FLAGS = {"ctx_size": ("-c", "--ctx-size"), "parallel": ("-np", "--parallel"), "cache_type_k": ("-ctk", "--cache-type-k"),
                "cache_type_v": ("-ctv", "--cache-type-v"), "kv_residency_mode": ("--kv-residency-mode",),
                "vram_target": ("--vram-target",), "kv_window_cells": ("--kv-window-cells",), "kv_device_heads": ("--kv-device-heads",),
                "cache_type_k_tail": ("-ctkt", "--cache-type-k-tail"), "cache_type_v_tail": ("-ctvt", "--cache-type-v-tail"),
                "pcie_bw_gbps": ("--pcie-bw-gbps",), "kv_tail_cpu_frac": ("--kv-tail-cpu-frac",), "slot_save": ("--slot-save-path",)}


def _check_extra_args(extra: list[str], merged: dict, where: dict[str, str], extra_where: str) -> None:
    """llama-server's arguments after `--` go unchanged, so none may contradict what serve passes itself: serve binds
    --host/--port and loads MODEL (what it checks and reports), and a setting given both ways would leave one of the
    two ignored. Usage errors, naming both."""
    owner = {f: k for k, fs in _LLAMA_FLAGS.items() for f in fs}
    for a in extra:
        name = a.split("=", 1)[0] if a.startswith("--") else a
        if name in ("--host", "--port"):
            usage_error(f"{name} {extra_where} clashes with serve's own {name} (serve binds, checks and reports that address)",
                        f"give it to serve before `--`: rollingkv serve MODEL {name} VALUE")
        if name in ("-m", "--model"):
            usage_error(f"{name} {extra_where} clashes with serve's MODEL (serve checks and reports the model it loads)",
                        "give the model as serve's MODEL argument (a GGUF path or `demo`)")
        key = owner.get(name)
        if key is not None and merged.get(key) not in (None, False):
            usage_error(f"{name} {extra_where} clashes with {where[key]}: llama-server would take only one of them",
                        "give the setting once")


def _check_together(m: dict, where: dict[str, str], unified: bool = False) -> None:
    """Settings that are fine alone but not together (usage errors, as a bad flag)."""
    window, ctx, parallel = m.get("kv_window_cells"), m.get("ctx_size"), m.get("parallel")
    heads, mode = m.get("kv_device_heads"), m.get("kv_residency_mode")
    if ctx and parallel and ctx < parallel:
        # llama-server splits the context between the slots: fewer cells than slots leaves a slot none
        usage_error(f"{where['ctx_size']} {ctx} has fewer cells than {where['parallel']} {parallel} has slots",
                    "each slot gets ctx_size / parallel cells: raise the context or lower the slots")
    if heads and window:
        usage_error(f"{where['kv_device_heads']} and {where['kv_window_cells']} exclude each other (a head split or a window split)",
                    "give one of them")
    if heads and mode in ("window", "off"):
        usage_error(f"{where['kv_device_heads']} {heads} sets a head split, which {where['kv_residency_mode']} {mode} does not make",
                    "use --kv-residency-mode head (or auto, which it then means)")
    if window and mode == "head":
        usage_error(f"{where['kv_window_cells']} {window} sets a window, which {where['kv_residency_mode']} head does not make",
                    "use --kv-device-heads N for the head split, or --kv-residency-mode window")
    if window and ctx and window > ctx:
        usage_error(f"{where['kv_window_cells']} {window} is larger than the context ({where['ctx_size']} {ctx})",
                    "a window of the whole context is the resident cache: use --kv-residency-mode off")
    auto = [where[k] for k in ("cache_type_k_tail", "cache_type_v_tail") if m.get(k) == TAIL_AUTO]
    if auto and mode == "off":
        usage_error(f"{' and '.join(auto)} auto chooses the type of a split's tail, and {where['kv_residency_mode']} off never splits",
                    "use --kv-residency-mode auto or window, or give the tail a type")
    slot_cells = ctx // parallel if ctx and parallel and parallel > 1 and not unified else ctx
    if auto and window and slot_cells and window >= slot_cells:
        usage_error(f"{where['kv_window_cells']} {window} holds each slot's whole context ({slot_cells} cells): nothing spills, so "
                    f"{' and '.join(auto)} auto has no tail to choose a type for",
                    f"give a window below {slot_cells} cells, or a tail type")
    if window and ctx and parallel and parallel > 1 and not unified and window > ctx // parallel:
        # llama-server gives each of N slots its own stream of ctx / N cells; the window is per stream
        usage_error(f"{where['kv_window_cells']} {window} is larger than each slot's context ({where['ctx_size']} {ctx} / "
                    f"{where['parallel']} {parallel} = {ctx // parallel} cells): the cache would stay resident",
                    f"the window is per slot: give fewer than {ctx // parallel + 1} cells, or raise the context")


def may_split(mode: str | None, budgeted: bool, cuda: bool) -> bool:
    """Whether llama-server may split the cache: any mode but off, except auto on a CPU build without a vram_target,
    window or heads (resident: nothing to budget)."""
    mode = mode or "auto"
    return mode != "off" and (cuda or mode != "auto" or budgeted)


def check_split_types(types: dict[str, str | None], mode: str | None, budgeted: bool, cuda: bool,
                      split_types: tuple[str, ...] = TAIL_TYPES) -> None:
    """-ctk/-ctv (types: where each was given -> its type) of a type only an unsplit cache takes (iq4_nl), where the cache
    may split: a usage error here, not llama.cpp's abort (GGML_ASSERT in the scheduler) after start-up. A split's tail
    takes the window's types unless -ctkt/-ctvt say otherwise, and its window takes only the tail types."""
    for where, t in types.items():
        if t is not None and t not in split_types and may_split(mode, budgeted, cuda):
            usage_error(f"{where} {t}: only an unsplit cache takes {t}, and this one may split (a split's window and tail take "
                        f"{', '.join(split_types)})",
                        f"pick one of those types, or keep the cache whole with --kv-residency-mode off ({t} then works)")


def _split_asked(settings: dict, extra_args: list[str]) -> tuple[str | None, bool]:
    """(the residency mode, whether a budget, window or head split is asked for), from serve's settings (by key) or after
    `--`."""
    mode = _flag_value(extra_args, "--kv-residency-mode") or settings.get("kv_residency_mode")
    budgeted = any(settings.get(k) is not None for k in ("vram_target", "kv_window_cells", "kv_device_heads")) or any(
        _given(extra_args, f) for f in ("--vram-target", "--kv-window-cells", "--kv-device-heads"))
    return mode, budgeted


# ------------------------------------------------------------------ checks on the build and the model

def build_has_rolling_kv(lib: Path) -> bool:
    try:
        return hasattr(ctypes.CDLL(str(lib)), "llama_init_from_model_rolling_kv")
    except OSError:
        return False


def build_has_tail_cpu(lib: Path) -> bool:
    """The build has the hybrid tail (rolling-KV API 4: its llama-server takes --kv-tail-cpu-frac and --cpu-attn-gbps)."""
    from rollingkv_cli.lib.llama_ext import MEASURE_CPU_ATTN_SYMBOL

    try:
        return hasattr(ctypes.CDLL(str(lib)), MEASURE_CPU_ATTN_SYMBOL)
    except OSError:
        return False


def _api_version(lib: Path) -> int:
    """The library's rolling-KV API version (0 when it has none)."""
    try:
        fn = ctypes.CDLL(str(lib)).llama_rolling_kv_api_version
    except (OSError, AttributeError):
        return 0
    fn.restype = ctypes.c_int32
    fn.argtypes = []
    return int(fn())


def build_has_head_split(lib: Path) -> bool:
    """The build has the head split (rolling-KV API 5: its llama-server takes --kv-residency-mode head and --kv-device-heads)."""
    from rollingkv_cli.lib.llama_ext import API_HEAD_SPLIT

    return _api_version(lib) >= API_HEAD_SPLIT


def build_has_tail_auto(lib: Path) -> bool:
    """The build chooses tail types (rolling-KV API 7: its llama-server takes -ctkt/-ctvt auto)."""
    from rollingkv_cli.lib.llama_ext import API_TAIL_AUTO

    return _api_version(lib) >= API_TAIL_AUTO


def auto_tail_head_refusal(head_k: int, head_v: int, auto_k: bool, auto_v: bool, type_k: str, type_v: str) -> str | None:
    """Why a requested head split cannot take the tail types auto would choose (None: it can). Auto picks q8_0 or q4_0
    (blocks of 32 elements) for a wider window; a host head must hold whole blocks (the library refuses the same)."""
    compact = {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"}  # already compact: auto keeps the window's type
    for axis, on, head, window in (("K", auto_k, head_k, type_k), ("V", auto_v, head_v, type_v)):
        if on and window not in compact and head % 32 != 0:
            return (f"the head split's host heads ({axis} head size {head}) cannot take the q8_0/q4_0 tail that "
                    f"-ct{axis.lower()}t auto chooses (blocks of 32)")
    return None


def check_auto_tail_heads(s: ServeSettings) -> None:
    """A requested head split (mode head or --kv-device-heads) with auto tail types: refused before llama-server starts
    when the model's KV heads cannot take the compressed types auto would choose."""
    auto_k, auto_v = s.cache_type_k_tail == TAIL_AUTO, s.cache_type_v_tail == TAIL_AUTO
    if not (auto_k or auto_v) or not (s.kv_residency_mode == "head" or s.kv_device_heads is not None):
        return
    from rollingkv_cli.bench.gguf import read_model

    info = read_model(s.model)
    why = auto_tail_head_refusal(info.head_dim_k, info.head_dim_v, auto_k, auto_v, s.cache_type_k or "f16", s.cache_type_v or "f16")
    if why:
        usage_error(f"{s.model.name}: {why}", "give -ctkt/-ctvt a type that divides the heads (f16, bf16, f32), or split by window")


def model_weight_bytes(model: Path) -> int:
    from rollingkv_cli.gguf_header import read_header

    return sum(t.n_bytes for t in read_header(model).tensors)


# llama-server's flags that decide the GPU layers (its --fit is on by default and adjusts unset ones)
_GPU_LAYER_FLAGS = ("-ngl", "--gpu-layers", "--n-gpu-layers", "-fit", "--fit")
# what must stay free next to the weights for `-ngl all` to be safe: the GPU runtime (CUDA context, cuBLAS, pools),
# compute buffers and the smallest window with its slot ring (the planner refuses less, naming the minimum)
GPU_LAYERS_HEADROOM_MIB = 1024


def _free_vram_mib() -> int | None:
    """Free memory over all NVIDIA GPUs (NVML: total - used), or None where NVML does not answer."""
    vram = _vram_mib()
    return sum(total - used for used, total in vram) if vram else None


def gpu_layers(s: ServeSettings, cuda: bool, free_vram_mib=_free_vram_mib, weights_mib=None) -> tuple[list[str], str | None]:
    """(extra llama-server args, a note) for the GPU layers.

    llama-server's --fit (on by default) makes a context whose KV does not fit in VRAM fit by moving layers to the
    CPU. After that the whole KV of the remaining GPU layers fits, so auto residency plans resident, and decoding
    runs at the speed of vanilla's partial offload. The rolling-KV cache is the better trade: all layers on the
    GPU, the KV that does not fit in pinned host memory. So when the weights fit with room to spare, pass
    `-ngl all` (a set value, which --fit leaves alone). The user's own -ngl/--fit always wins; residency off,
    CPU builds and weights that do not fit keep llama-server's behaviour.
    """
    if not cuda or s.kv_residency_mode == "off":
        return [], None
    if any(a == f or a.startswith(f + "=") for a in s.extra_args for f in _GPU_LAYER_FLAGS):
        return [], None
    weights = model_weight_bytes(s.model) / 2**20 if weights_mib is None else weights_mib
    budget, what = (s.vram_target, "--vram-target") if s.vram_target is not None else (free_vram_mib(), "free VRAM")
    if budget is None:
        return [], "GPU layers: llama-server's --fit decides (NVML did not report free VRAM)"
    if weights + GPU_LAYERS_HEADROOM_MIB > budget:
        return [], (f"GPU layers: the weights ({weights:.0f} MiB) + {GPU_LAYERS_HEADROOM_MIB} MiB do not fit the {what} "
                    f"({budget} MiB): llama-server's --fit moves layers to the CPU; the rolling KV covers those on the GPU")
    return ["-ngl", "all"], (f"GPU layers: all (weights {weights:.0f} MiB of {budget} MiB {what}); the rolling KV cache, "
                             "not --fit, makes room for the context")


def model_alias(model: Path) -> str:
    """The model's id in the OpenAI API (/v1/models, "model" in answers): its file name without .gguf."""
    return model.name[:-5] if model.name.lower().endswith(".gguf") else model.name


def server_command_args(s: ServeSettings, slot_dir: Path, bandwidth: float | None, gpu_layer_args: list[str] | None = None,
                        cpu_attn_gbps: float | None = None) -> list[str]:
    # what serve turns on that llama-server leaves off: flash attention (the rolling KV's op needs it) and /metrics (the
    # live status reads its counters; no prompt or answer text). Slot save/restore writes files into slot_dir on any
    # client's request: only with --slot-save.
    args = ["-m", str(s.model), "-fa", "on", "--metrics"]
    if not (_given(s.extra_args, "--alias") or _given(s.extra_args, "-a")):
        args += ["--alias", model_alias(s.model)]  # /v1/models names the model, not the path of the user's cache
    if s.slot_save:
        args += ["--slot-save-path", str(slot_dir)]
    args += gpu_layer_args or []
    for key, flag in (("ctx_size", "-c"), ("parallel", "-np"), ("cache_type_k", "-ctk"), ("cache_type_v", "-ctv"),
                      ("kv_residency_mode", "--kv-residency-mode"), ("vram_target", "--vram-target"),
                      ("kv_window_cells", "--kv-window-cells"), ("kv_device_heads", "--kv-device-heads"),
                      ("cache_type_k_tail", "-ctkt"), ("cache_type_v_tail", "-ctvt")):
        value = getattr(s, key)
        if value is not None:
            args += [flag, str(value)]
    if s.kv_tail_cpu_frac is not None:
        args += ["--kv-tail-cpu-frac", "auto" if s.kv_tail_cpu_frac == "auto" else f"{s.kv_tail_cpu_frac:g}"]
    if bandwidth is not None:
        args += ["--pcie-bw-gbps", f"{bandwidth:g}"]
    if cpu_attn_gbps is not None:
        args += ["--cpu-attn-gbps", f"{cpu_attn_gbps:g}"]
    return args + list(s.extra_args)


ENV_CPU_ATTN = "LLAMA_ARG_CPU_ATTN_GBPS"  # llama-server's own variable for --cpu-attn-gbps
ENV_TAIL_CPU_FRAC = "LLAMA_ARG_KV_TAIL_CPU_FRAC"  # and for --kv-tail-cpu-frac


def _given(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _flag_value(args: list[str], flag: str) -> str | None:
    """The last value of flag in a llama-server argument list (as llama.cpp reads it), else None."""
    found = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found


def requested_tail_cpu_frac(s: ServeSettings) -> float | str | None:
    """The CPU part llama-server will be asked for: --kv-tail-cpu-frac after `--` (it comes last, so it wins), else
    serve's own setting, else $LLAMA_ARG_KV_TAIL_CPU_FRAC; "auto", a share from 0 to 1, or None (llama-server's
    default: auto). A value llama-server would refuse counts as None (it says why when it starts)."""
    import os

    text = _flag_value(s.extra_args, "--kv-tail-cpu-frac")
    if text is None and s.kv_tail_cpu_frac is not None:
        return s.kv_tail_cpu_frac
    if text is None:
        text = os.environ.get(ENV_TAIL_CPU_FRAC, "").strip() or None
    if text is None:
        return None
    try:
        return _fraction_or_auto(text, from_text=True)
    except SettingError:
        return None


def resolve_cpu_attn(s: ServeSettings, cuda: bool, build_key: str, tail_cpu: bool, doc: dict | None = None) -> tuple[float | None, str | None]:
    """(the --cpu-attn-gbps to pass, a note): the cached CPU attention figure for the tail's K type at the CPU part's
    thread count (cpu_attn.part_threads: not -t), when the hybrid tail will use it: a CUDA build that has
    it, residency not off, a CPU part not turned off (auto, llama-server's default, picks the share with it; a fixed share
    only reports its estimate with it; 0 has none), and no --cpu-attn-gbps / $LLAMA_ARG_CPU_ATTN_GBPS of the user's.
    Nothing cached: None, and llama-server calibrates when it plans (auto only)."""
    import os

    from rollingkv_cli.hw import cpu_attn
    from rollingkv_cli.lib.llama_ext import CPU_ATTN_TYPES

    requested = requested_tail_cpu_frac(s)
    if not cuda or not tail_cpu or s.kv_residency_mode == "off" or requested == 0:
        return None, None
    if _given(s.extra_args, "--cpu-attn-gbps") or os.environ.get(ENV_CPU_ATTN, "").strip():
        return None, None
    if s.cache_type_k_tail == TAIL_AUTO:
        return None, "CPU attention: auto tail types: llama-server measures it for the type it chooses"
    type_k = s.cache_type_k_tail or s.cache_type_k or "f16"
    if type_k not in CPU_ATTN_TYPES:
        return None, f"CPU attention: the hybrid tail attends {', '.join(CPU_ATTN_TYPES)} tails on the CPU, not {type_k}"
    threads = cpu_attn.part_threads()
    from rollingkv_cli.hw import profile

    gbps, detail = profile.cpu_attn_gbps_for(type_k, threads, build_key, doc)
    if gbps is None:
        return None, f"CPU attention: {detail}; " + ("llama-server measures it when it plans" if requested in (None, "auto") else
                                                      "the plan's estimate for the requested share goes without it")
    return gbps, f"CPU attention for planning: {gbps:g} GB/s — {detail}"


def _resolve_bandwidth(s: ServeSettings, cuda: bool) -> tuple[float | None, str]:
    if s.pcie_bw_gbps is not None:
        return s.pcie_bw_gbps, "explicit --pcie-bw-gbps"
    if not cuda:
        return None, "CPU build: no link to model"
    env = paths.pcie_bw_env()  # a bad value is an error here, as in `probe pcie`, not a warning below
    if env is not None:
        return env, f"explicit ${paths.ENV_PCIE_BW}"
    try:
        from rollingkv_cli.hw import pcie
    except ImportError:
        return None, "no PCIe profile support in this install"
    try:
        r = pcie.resolve_bandwidth()
    except RollingKVError as e:
        warn(f"PCIe profile: {e.message}")
        return None, "unresolved"
    return float(r.gbps), f"{r.tier} ({r.detail})" if getattr(r, "detail", None) else str(r.tier)


# ------------------------------------------------------------------ supervision

class _Stop(Exception):
    pass


def api_key(extra_args: list[str]) -> str | None:
    """The API key llama-server will require (--api-key or --api-key-file after `--`, else $LLAMA_API_KEY, as llama-server
    reads them): serve's own requests (/props, /metrics) send it. None: the server is open to whoever reaches it."""
    import os

    text = _flag_value(extra_args, "--api-key")
    path = _flag_value(extra_args, "--api-key-file") or os.environ.get("LLAMA_ARG_API_KEY_FILE")
    if text is None and path is None:
        text = os.environ.get("LLAMA_API_KEY")
    if text is not None:
        keys = [k for k in text.split(",") if k.strip()]
        return keys[0].strip() if keys else None
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.rstrip("\r\n")
                if line and not line.startswith("#"):
                    return line
    except OSError:
        return "(unreadable)"  # llama-server refuses the file at start and says why; there is a key meant
    return None


def is_loopback(host: str) -> bool:
    """Whether host names only this machine (every address it resolves to is a loopback one)."""
    import ipaddress
    import socket

    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        return False
    try:
        return bool(addrs) and all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addrs)
    except ValueError:
        return False


def _metrics_text(srv) -> str:
    """llama-server's /metrics page ("" where it does not answer)."""
    try:
        with urllib.request.urlopen(srv.http_request("/metrics"), timeout=2) as r:
            return r.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return ""


def parse_metrics(text: str) -> dict[str, float]:
    """The unlabeled llamacpp:NAME VALUE lines of a /metrics page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^llamacpp:(\w+)\s+([-+0-9.eE]+|nan|inf)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _metrics(srv) -> dict[str, float]:
    return parse_metrics(_metrics_text(srv))


def residency_line(text: str) -> str | None:
    """The split cache's live figures from /metrics text (llamacpp:rolling_kv_*): each slot's cells on the device and
    in host memory, and the tail the last step attended against what its streams occupy; None when not split."""
    slots: dict[int, dict[str, int]] = {}
    for line in text.splitlines():
        m = re.match(r'^llamacpp:rolling_kv_slot_(device|tail)_cells\{slot="(\d+)"\}\s+([0-9.eE+]+)$', line)
        if m:
            slots.setdefault(int(m.group(2)), {})[m.group(1)] = int(float(m.group(3)))
    flat = {k: v for k, v in parse_metrics(text).items() if k.startswith("rolling_kv_")}
    if not slots and not flat:
        return None
    cells = ", ".join(f"{i}: {d.get('device', 0)}+{d.get('tail', 0)}" for i, d in sorted(slots.items()) if d.get("device") or d.get("tail"))
    mib = 1024 * 1024
    last = (f"last step attended {flat.get('rolling_kv_last_tail_bytes', 0) / mib:.0f} MiB of tail "
            f"({flat.get('rolling_kv_last_occupied_bytes', 0) / mib:.0f} MiB occupied, "
            f"{flat.get('rolling_kv_last_streamed_bytes', 0) / mib:.0f} MiB streamed)")
    return f"slot cells device+tail {cells or 'none in use'}; {last}"


def _vram_mib() -> list[tuple[int, int]]:
    try:
        import pynvml

        pynvml.nvmlInit()
        res = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i))
            res.append((mem.used // 2**20, mem.total // 2**20))
        return res
    except Exception:
        return []


def _plural(n, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def plan_reason(plan: dict, chosen: str) -> str:
    """The plan's reason without what the line around it says already: the mode's name in front ("window: explicit
    window of 256 cells" -> "explicit window of 256 cells"), a "...: resident (why)" tail (-> "...: why"), and with
    singulars where the count is 1 (the library writes "1 device KV heads")."""
    r = str(plan.get("reason") or "").strip()
    for prefix in {f"mode {chosen}: ", f"{chosen}: ", f"mode {plan.get('mode_requested')}: ", f"{plan.get('mode_requested')}: "}:
        if r.startswith(prefix):
            r = r[len(prefix):]
    r = re.sub(rf":\s*{re.escape(chosen)}\s*\((.*)\)$", r": \1", r)
    r = re.sub(rf"^{re.escape(chosen)}\s*\((.*)\)$", r"\1", r)
    if r == chosen or r == f"{chosen} cache":
        return ""
    return re.sub(r"\b1 (device KV head|KV head|thread|cell|layer)s\b", r"1 \1", r)


def describe_plan(plan: dict | None, gpu: bool = True) -> str:
    """One line: the mode chosen, why (once), the split, the bytes ("on device" / "on host" on a GPU build; a CPU build
    holds them all in host memory)."""
    if not plan:
        return "residency plan: not reported by this build"
    chosen = plan.get("mode_chosen") or plan.get("mode") or "?"
    head = f"residency: {chosen}"
    reason = plan_reason(plan, chosen)
    if reason:
        head += f" — {reason}"
    parts = [head]
    heads = plan.get("heads") if isinstance(plan.get("heads"), dict) else {}
    if chosen == "head" and heads.get("summary"):
        # the library's reason ends with the summary in brackets, which the next part says already
        parts[0] = parts[0].removesuffix(f" ({heads['summary']})")
        per_layer = heads.get("per_layer") or []
        shown = ",".join(str(h) for h in per_layer[:12]) + (",..." if len(per_layer) > 12 else "")
        parts.append(f"{heads['summary']} (per layer {shown})")
    elif plan.get("window_cells") is not None and plan.get("split", True):
        parts.append(f"window {plan.get('window_cells')} / tail {plan.get('tail_cells', 0)} cells")
    if gpu:
        for k, label in (("device_bytes", "on device"), ("host_bytes", "on host")):
            if plan.get(k) is not None:
                parts.append(f"{plan[k] / 2**20:.1f} MiB {label}")
    else:
        total = sum(plan.get(k) or 0 for k in ("device_bytes", "host_bytes"))
        if total:
            parts.append(f"{total / 2**20:.1f} MiB in host memory (CPU build)")
    return "; ".join(parts)


def describe_plan_details(plan: dict | None) -> list[str]:
    """The planner's budget terms, a hybrid model's layers (which split, the recurrent state whole), its link model and
    (split plans only) its CPU part of the tail, one line each (nothing for builds that do not report them)."""
    if not plan:
        return []
    lines = []
    budget = plan.get("budget")
    if isinstance(budget, dict) and budget.get("devices"):
        mib = lambda b: f"{(b or 0) / 2**20:.0f}"  # noqa: E731
        for d in budget["devices"]:
            head = (f"target {budget['vram_target_mib']} MiB" if budget.get("vram_target_mib")
                    else f"free {mib(d.get('free_bytes'))} MiB - reserve {mib(budget.get('reserve_bytes'))} MiB")
            recr = f" (recurrent state {mib(d['recurrent_bytes'])})" if d.get("recurrent_bytes") else ""
            lines.append(f"budget on {d.get('name', '?')}: {head}; weights {mib(d.get('weights_bytes'))} + compute ~{mib(d.get('compute_bytes'))}"
                         f" + other KV {mib(d.get('other_kv_bytes'))}{recr} + streaming ring {mib(d.get('ring_bytes'))} MiB;"
                         f" whole KV {mib(d.get('kv_resident_bytes'))} MiB; minimum target {d.get('min_target_mib', '?')} MiB")
    recurrent = plan.get("recurrent")
    if isinstance(recurrent, dict):  # a hybrid model: only its attention layers' cache may split
        layers = recurrent.get("layers") or []
        attn = [layer.get("il") for layer in plan.get("layers") or []]
        lines.append(f"hybrid model: the attention layers' cache ({len(attn)} layers) {'splits' if plan.get('split') else 'stays whole'}; "
                     f"the recurrent state ({len(layers)} layers, {(recurrent.get('bytes') or 0) / 2**20:.1f} MiB) stays whole")
    link = plan.get("link") or {}
    est = plan.get("estimate") or {}
    if est.get("ms_per_token") is not None:
        # the link's source last, after a dash: it has brackets of its own ("host memory bandwidth (the tail is ...)")
        lines.append(f"expected {est['ms_per_token']:.2f} ms/token at full context: {est['t_resident_ms']:.2f} ms resident"
                     f" ({link.get('mem_bw_gbps', 0):.0f} GB/s measured) + {est['t_tail_ms']:.2f} ms tail"
                     f" at {link.get('link_bw_gbps', 0):.1f} GB/s — {link.get('link_bw_source', '?')}")
    elif plan.get("split") and link:
        lines.append(f"no ms/token estimate: memory bandwidth {link.get('mem_bw_gbps')} GB/s, link {link.get('link_bw_gbps')} GB/s"
                     f" — {link.get('link_bw_source', '?')}")
    auto = plan.get("auto")
    if isinstance(auto, dict) and auto.get("reason"):  # auto weighed the window against the head split
        lines.append(auto["reason"])
    line = describe_tail_types(plan)
    if line:
        lines.append(line)
    line = describe_tail_cpu(plan) if plan.get("split") else None  # the CPU part only where the tail is split
    if line:
        lines.append(line)
    return lines


def describe_tail_types(plan: dict | None) -> str | None:
    """The tail types the planner chose for auto (-ctkt/-ctvt auto) and why; None when no axis was auto or the build does
    not report it."""
    tt = (plan or {}).get("tail_types")
    if not isinstance(tt, dict) or not tt.get("auto"):
        return None
    asked = "/".join(str(tt.get(k) or "=") for k in ("requested_k", "requested_v"))
    return f"tail types (asked {asked}): K {tt.get('k')}, V {tt.get('v')} — {tt.get('reason') or '?'}"


def describe_tail_cpu(plan: dict | None) -> str | None:
    """The hybrid tail's split from the plan's tail_cpu (None for builds that do not report one)."""
    tc = (plan or {}).get("tail_cpu")
    if not isinstance(tc, dict):
        return None
    frac = tc.get("frac") or 0
    req = tc.get("requested")
    head = (f"CPU part of the tail: {frac * 100:.0f}% of each split layer's host tail attended on the CPU" if frac
            else "CPU part of the tail: none")
    parts = [f"requested {req}" if req is not None else None]
    if tc.get("cpu_attn_gbps") is not None:  # its source last: it has commas and brackets of its own
        parts.append(f"CPU attention {tc['cpu_attn_gbps']:.3g} GB/s")
    if tc.get("n_threads"):
        parts.append(_plural(tc["n_threads"], "thread"))
    hybrid = ((plan or {}).get("link") or {}).get("t_token_hybrid_ms")
    if hybrid is None:
        hybrid = ((plan or {}).get("estimate") or {}).get("t_token_hybrid_ms")
    if isinstance(hybrid, (int, float)):
        parts.append(f"expected {hybrid:.2f} ms/token with it")
    text = head + " (" + ", ".join(p for p in parts if p) + ")"
    text += f": {tc['reason']}" if tc.get("reason") else ""
    if tc.get("cpu_attn_gbps") is not None and tc.get("cpu_attn_source"):
        text += f"; CPU attention {tc['cpu_attn_source']}"
    return text


def _slots(srv) -> list[dict] | None:
    """llama-server's /slots (each slot's tokens decoded so far), None where it does not answer (`--no-slots`)."""
    import json

    try:
        with urllib.request.urlopen(srv.http_request("/slots"), timeout=2) as r:
            data = json.loads(r.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return data if isinstance(data, list) else None


def _decoding_now(slots: list[dict] | None) -> int:
    """Tokens generated so far by the requests still running (llama-server counts a request's tokens in /metrics'
    tokens_predicted_total only when it ends)."""
    n = 0
    for slot in slots or []:
        nt = slot.get("next_token")
        if slot.get("is_processing") and isinstance(nt, list) and nt and isinstance(nt[0], dict):
            n += int(nt[0].get("n_decoded") or 0)
    return n


class LiveStatus:
    """What serve's live status shows, sampled about once a second: rows() is a list of (label, text), one function per
    row (rows_* below), so that more rows (e.g. per-slot residency counters) are one more entry in ROWS.

    The decode rate is the tokens generated over the last WINDOW_S seconds: /metrics' tokens_predicted_total (finished
    requests) plus the running requests' tokens so far (/slots). llama-server's own predicted_tokens_seconds is a mean
    over the requests that ended since its last poll: 0.0 while two requests decode."""

    WINDOW_S = 5.0
    ROWS = ("uptime", "requests", "decode", "prompt", "vram", "kv", "kv_now")

    def __init__(self, srv, started: float, plan: dict | None, gpu: bool = True, vram=None):
        from collections import deque

        self.srv, self.started, self.plan, self.gpu = srv, started, plan, gpu
        self.vram = _vram_mib if vram is None else vram
        self.metrics: dict[str, float] = {}
        self.metrics_text = ""
        self.slots: list[dict] | None = None
        self.history: deque = deque()  # (time, tokens generated in all) over the last WINDOW_S seconds

    def sample(self, now: float | None = None, metrics: dict | None = None, slots: list[dict] | None = None) -> None:
        now = time.monotonic() if now is None else now
        # one /metrics read a sample: its counters, and its text for the split cache's per-slot lines
        self.metrics_text = _metrics_text(self.srv) if metrics is None else ""
        self.metrics = parse_metrics(self.metrics_text) if metrics is None else metrics
        self.slots = _slots(self.srv) if slots is None else slots
        self.history.append((now, self.tokens_generated()))
        while len(self.history) > 2 and now - self.history[1][0] >= self.WINDOW_S:
            self.history.popleft()

    def tokens_generated(self) -> int:
        return int(self.metrics.get("tokens_predicted_total", 0)) + _decoding_now(self.slots)

    def decode_rate(self) -> float | None:
        """Tokens per second over the window; None before two samples."""
        if len(self.history) < 2:
            return None
        (t0, n0), (t1, n1) = self.history[0], self.history[-1]
        return max(0.0, (n1 - n0) / (t1 - t0)) if t1 > t0 else None

    def in_flight(self) -> int:
        return int(self.metrics.get("requests_processing", 0))

    def rows_uptime(self):
        return [("uptime", f"{time.time() - self.started:.0f} s")]

    def rows_requests(self):
        return [("requests", f"{self.in_flight()} in flight, {self.metrics.get('requests_deferred', 0):.0f} waiting")]

    def rows_decode(self):
        rate = self.decode_rate()
        shown = "…" if rate is None else f"{rate:.1f}"
        return [("decode", f"{shown} tok/s over the last {self.WINDOW_S:g} s, {self.tokens_generated()} tokens generated")]

    def rows_prompt(self):
        m = self.metrics
        return [("prompt", f"{m.get('prompt_tokens_total', 0):.0f} tokens read, {m.get('prompt_tokens_seconds', 0):.1f} tok/s "
                           "(llama-server's mean of the requests ended)")]

    def rows_vram(self):
        vram = self.vram()
        return [("VRAM", ", ".join(f"GPU{i} {u}/{tot} MiB" for i, (u, tot) in enumerate(vram)))] if vram else []

    def rows_kv(self):
        return [("KV", describe_plan(self.plan, gpu=self.gpu))]

    def rows_kv_now(self):
        live = residency_line(self.metrics_text) if self.plan and self.plan.get("split") else None
        return [("KV now", live)] if live else []

    def rows(self) -> list[tuple[str, str]]:
        return [row for name in self.ROWS for row in getattr(self, f"rows_{name}")()]

    def table(self):
        from rich.table import Table

        t = Table(show_header=False, box=None, title=f"llama-server {esc(self.srv.url)}", title_justify="left")
        t.add_column(style="bold")
        t.add_column()
        for label, value in self.rows():
            t.add_row(esc(label), esc(value))
        return t

    def line(self) -> str:
        """The plain status line (not a terminal)."""
        rate = self.decode_rate()
        return (f"in flight {self.in_flight()}, generated {self.tokens_generated()} tokens"
                + ("" if rate is None else f", {rate:.1f} tok/s over the last {self.WINDOW_S:g} s"))


def serve(s: ServeSettings, print_args: bool = False, quiet: bool = False) -> None:
    import shlex

    from rollingkv_cli.lib import builder
    from rollingkv_cli.serve.server import ServerProcess, free_port, port_in_use, resolve_host

    from rollingkv_cli.userinput import check_native_knobs

    check_native_knobs()  # the variables llama-server's library reads itself: refused here, not ignored or clamped there
    b = builder.active_build(required=True)
    assert b is not None
    binary = b.artifact("llama-server")
    if not binary.exists():
        abort(f"the active build has no llama-server ({binary})", "run `rollingkv build`")
    rolling = (s.kv_residency_mode is not None or s.vram_target is not None or s.kv_window_cells is not None or s.cache_type_k_tail
               or s.cache_type_v_tail or s.kv_tail_cpu_frac is not None or s.kv_device_heads is not None)
    if not build_has_rolling_kv(b.lib_dir / "libllama.so"):
        if rolling:
            abort(f"the active build {b.dir} lacks the rolling-KV patches (no llama_init_from_model_rolling_kv)", "rebuild with `rollingkv build`")
        warn("this build has no rolling-KV support: serving the plain llama.cpp cache")
        tail_cpu = False
    else:
        tail_cpu = build_has_tail_cpu(b.lib_dir / "libllama.so")
    from rollingkv_cli.kvtypes import library_tail_types

    lib_types = library_tail_types(b.lib_dir)  # the build's own list: a build that takes fewer types says so here
    for flag, t in (("-ctkt", s.cache_type_k_tail), ("-ctvt", s.cache_type_v_tail)):
        if t == TAIL_AUTO:
            if not build_has_tail_auto(b.lib_dir / "libllama.so"):
                abort(f"{flag} auto: the active build {b.dir} predates the planner's tail types (rolling-KV API 7)",
                      "rebuild with `rollingkv build`, or give the tail a type")
            continue
        if t is not None and lib_types is not None and t not in lib_types:
            abort(f"{flag} {t}: the active build {b.dir} takes the tail types {', '.join(lib_types)}",
                  "pick one of those, or rebuild with `rollingkv build`")
    cuda = bool(b.manifest.get("options", {}).get("cuda"))
    if cuda:  # auto on a GPU may split without being asked to (resolve_settings checked what a CPU build splits)
        check_split_types({"--cache-type-k": s.cache_type_k, "--cache-type-v": s.cache_type_v}, *_split_asked(vars(s), s.extra_args), cuda=True,
                          split_types=lib_types or TAIL_TYPES)
    if s.kv_tail_cpu_frac is not None and not tail_cpu:
        abort(f"the active build {b.dir} predates the hybrid tail: its llama-server has no --kv-tail-cpu-frac",
              "rebuild with `rollingkv build`, or drop --kv-tail-cpu-frac")
    if (s.kv_residency_mode == "head" or s.kv_device_heads is not None) and not build_has_head_split(b.lib_dir / "libllama.so"):
        abort(f"the active build {b.dir} predates the head split (rolling-KV API 5): its llama-server refuses head mode",
              "rebuild with `rollingkv build`, or use --kv-residency-mode window")
    check_auto_tail_heads(s)
    if s.vram_target is not None:
        weights_mib = model_weight_bytes(s.model) / 2**20
        if s.vram_target < weights_mib:
            abort(f"--vram-target {s.vram_target} MiB is below the model's weights ({weights_mib:.0f} MiB)",
                  f"the minimum is about {weights_mib + 512:.0f} MiB (weights + compute buffers), or drop --vram-target")
    bandwidth, tier = _resolve_bandwidth(s, cuda)
    start_timeout = paths.serve_start_timeout()
    resolve_host(s.host)  # a name that does not resolve is said so, before anything is created
    port = s.port or free_port(s.host)
    if not print_args and port_in_use(s.host, port):
        abort(f"port {port} on {s.host} is already in use", "pick another with --port (0 = any free port), or stop what holds it")
    slot_dir = paths.cache_dir() / "slots"
    log_dir = paths.cache_dir() / "logs"
    key = api_key(s.extra_args)
    log_path = log_dir / f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{port}.log"
    ngl_args, ngl_note = gpu_layers(s, cuda)
    cpu_attn_gbps, cpu_note = resolve_cpu_attn(s, cuda, b.dir.name, tail_cpu)
    srv = ServerProcess(binary, server_command_args(s, slot_dir, bandwidth, ngl_args, cpu_attn_gbps), host=s.host, port=port,
                        log_path=log_path, api_key=key)
    if print_args:
        print(shlex.join(srv.command))
        return
    made = [log_dir] + ([slot_dir] if s.slot_save else [])
    try:
        for d in made:
            d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        abort(f"cannot create {d}: {e.strerror or e}", f"point {paths.ENV_CACHE_DIR} at a directory you can write")
    if not key and not is_loopback(s.host):
        warn(f"--host {s.host} serves beyond this machine and no API key is set: anyone who reaches port {port} can use the "
             "server; pass `-- --api-key KEY` (or set $LLAMA_API_KEY)")
    if s.slot_save or _given(s.extra_args, "--slot-save-path"):  # serve's option, or llama-server's own after `--`
        where = slot_dir if s.slot_save else _flag_value(s.extra_args, "--slot-save-path")
        warn(f"{'--slot-save' if s.slot_save else '--slot-save-path'}: any client of the server can write and read KV cache "
             f"files in {where} (POST /slots/N?action=save|restore)" + ("" if key else "; set an API key to limit who can"))
    if bandwidth is not None:
        note(f"PCIe bandwidth for planning: {bandwidth:g} GB/s — {tier}")
    if ngl_note:
        note(ngl_note)
    if cpu_note:
        note(cpu_note)
    note(f"log: {log_path}")

    def on_term(signum, frame):
        raise _Stop()

    # SIGHUP (the terminal closed) stops the server as SIGTERM and Ctrl-C do
    old = {sig: signal.signal(sig, on_term) for sig in (signal.SIGTERM, signal.SIGHUP)}
    exit_code = 0
    try:
        srv.start()
        status = f"starting llama-server on {esc(srv.url)} ({esc(s.model.name)})"
        with console.status(status, spinner="dots") if not quiet else _null():
            srv.wait_healthy(timeout=start_timeout)
        props = srv.request("/props")
        plan = props.get("rolling_kv")
        success(f"serving {s.model.name} at {srv.url} (OpenAI API at {srv.url}/v1)")
        info(describe_plan(plan, gpu=cuda))
        for line in describe_plan_details(plan):
            note(line)
        started = time.time()
        status = LiveStatus(srv, started, plan, gpu=cuda)
        if is_interactive() and not quiet:
            from rich.live import Live

            status.sample()
            with Live(status.table(), console=console, refresh_per_second=2) as live:
                while srv.alive():
                    time.sleep(1)
                    status.sample()
                    live.update(status.table())
        else:
            last = ""
            while srv.alive():
                time.sleep(1)
                if quiet:
                    continue
                status.sample()
                line = status.line()
                if line != last:
                    print(line, flush=True)
                    last = line
        code = srv.proc.returncode if srv.proc else None
        _report_death(srv, code, log_path)
        exit_code = 1
    except (KeyboardInterrupt, _Stop):
        info("stopping llama-server …")
    except RollingKVError as e:
        from rollingkv_cli.lib.builder import log_tail

        if srv.proc is not None:
            log_panel(log_tail(log_path, 15), f"last lines of {log_path}")
        raise e
    finally:
        # a second Ctrl-C / SIGTERM / SIGHUP while stopping only hurries the stop: stop_group kills, then re-raises
        try:
            srv.stop()
        except _Stop:
            pass
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
    if exit_code:
        raise SystemExit(exit_code)
    success("llama-server stopped")


def _report_death(srv, code, log_path: Path) -> None:
    from rollingkv_cli.lib.builder import log_tail
    from rollingkv_cli.lib.procs import exit_parts

    what, advice = exit_parts(code)
    log_panel(log_tail(log_path, 20), f"last lines of {log_path}")
    print_error(RollingKVError(f"llama-server exited unexpectedly ({what})", f"{advice}; full log: {log_path}" if advice else f"full log: {log_path}"))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
