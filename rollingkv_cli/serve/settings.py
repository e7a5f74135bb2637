"""serve's settings: the one table of what serve accepts (SETTINGS: the flags and the config file check against it), the
config file's keys, and the checks of settings against each other and against llama-server's own arguments after `--`.
No click: the click command is cli.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from rollingkv_cli.console import abort, note, usage_error
from rollingkv_cli.lib.residency import MODES as RESIDENCY_MODES  # the one list, shared with the gates and benches
from rollingkv_cli.lib.residency import PLACEMENTS, WINDOW_POLICIES, ResidencyConflict, ResidencyRequest
from rollingkv_cli.userinput import shown  # a config value in a message: cut short
from rollingkv_cli.lib.limits import MAX_THREADS, MAX_THREADS_WHY  # one cap for every command's threads
from rollingkv_cli.kvtypes import TAIL_TYPE_CHOICES, TAIL_TYPES, WINDOW_TYPES  # the one list of KV types (the library's)

CACHE_TYPES = WINDOW_TYPES  # -ctk/-ctv: llama.cpp's, iq4_nl too, for an unsplit cache only (check_split_types)
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
_FLAG_KEYS = ("kv_residency_mode", "vram_target", "kv_window_cells", "kv_device_heads", "ctx_size", "parallel", "cache_type_k", "cache_type_v",
              "cache_type_k_tail", "cache_type_v_tail", "pcie_bw_gbps", "kv_tail_cpu_frac", "kv_windows", "kv_placement", "kv_share_prefix", "host",
              "port", "slot_save")
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
    kv_windows: str | None = None  # elastic | static; None: llama-server's default (elastic with several slots)
    kv_placement: str | None = None  # auto | upstream | sequences; None: llama-server's default (auto)
    kv_share_prefix: int | None = None  # least tokens a prompt shares with another slot to take its cells; 0: off
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
    cap: float | None = None  # the most llama-server's field holds: said only to a value above it
    cap_why: str = "what llama-server takes"

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    def check(self, value, from_text: bool = False):
        """The value, converted; SettingError when it is not acceptable."""
        if self.kind == "choice":
            v = str(value) if from_text else value
            if v not in self.choices:
                raise SettingError(f"{shown(value)} is not one of {', '.join(self.choices)}")
            return v
        if self.kind == "fraction_or_auto":
            return fraction_or_auto(value, from_text)
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            raise SettingError(f"must be true or false, not {shown(value)}")
        if self.kind == "str":
            if from_text:
                value = str(value)
            if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
                raise SettingError(f"must be a host name or address, not {shown(value)}")
            return value
        if self.kind == "int":
            v = _as_int(value, from_text)
        else:
            v = _as_float(value, from_text)
        positive = self.kind == "float" and self.lo == 0  # an exclusive bound: a positive number
        if (self.lo is not None and (v <= self.lo if positive else v < self.lo)) or (self.hi is not None and v > self.hi):
            raise SettingError(f"must be {self._range()}, not {value if from_text else shown(value)}")
        if self.cap is not None and v > self.cap:
            cap = f"{self.cap:g}" if isinstance(self.cap, float) else str(self.cap)
            raise SettingError(f"must be at most {cap} ({self.cap_why}), not {value if from_text else shown(value)}")
        return v

    def _range(self) -> str:
        noun = "an integer" if self.kind == "int" else "a number"
        if self.kind == "float" and self.lo == 0:
            return "a positive number"
        num = (lambda v: str(int(v))) if self.kind == "int" else (lambda v: f"{v:g}")  # noqa: E731
        if self.hi is not None:
            return f"{noun} from {num(self.lo)} to {num(self.hi)}"
        return f"{noun} of at least {num(self.lo)}" if self.lo is not None else noun


def fraction_or_auto(value, from_text: bool) -> float | str:
    """"auto", or a share of the tail from 0 to 1 (a float)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if not from_text and isinstance(value, str):
        raise SettingError(f"must be auto or a fraction from 0 to 1, not {shown(value)}")
    try:
        v = _as_float(value, from_text)
    except SettingError:
        raise SettingError(f"must be auto or a fraction from 0 to 1, not {value if from_text else shown(value)}") from None
    if not 0.0 <= v <= 1.0:
        raise SettingError(f"must be auto or a fraction from 0 to 1 (0: no CPU part, 1: the whole tail on the CPU), "
                           f"not {value if from_text else shown(value)}")
    return v


def _as_int(value, from_text: bool) -> int:
    if from_text:
        try:
            return int(str(value).strip(), 10)
        except ValueError:
            raise SettingError(f"{shown(value)} is not an integer") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingError(f"must be an integer, not {shown(value)}")
    return value


def _as_float(value, from_text: bool) -> float:
    if from_text:
        try:
            v = float(str(value).strip())
        except ValueError:
            raise SettingError(f"{shown(value)} is not a number") from None
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingError(f"must be a number, not {shown(value)}")
    else:
        try:
            v = float(value)
        except OverflowError:  # a YAML integer of 400 digits: "internal error: OverflowError" before
            v = math.inf
    if not math.isfinite(v):
        raise SettingError(f"must be a finite number, not {shown(value)}")
    return v


INT32_MAX = 2**31 - 1
FLT_MAX = 3.4028234663852886e38  # a C float
MAX_VRAM_TARGET_MIB = 2**24  # 16 TiB per device: far above any GPU, far below an overflow of MiB -> bytes

# the one table of what serve accepts: the flags (cli.py) and the config file check against it
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
    # llama-server reads a float: 1e308 became inf there, which it refused after loading the model
    Setting("pcie_bw_gbps", "float", lo=0, cap=FLT_MAX, cap_why="the most llama-server's float holds"),
    Setting("kv_tail_cpu_frac", "fraction_or_auto"),
    Setting("kv_windows", "choice", choices=WINDOW_POLICIES),
    Setting("kv_placement", "choice", choices=PLACEMENTS),
    Setting("kv_share_prefix", "int", lo=0, cap=INT32_MAX),
    Setting("host", "str"),
    Setting("port", "int", lo=0, hi=65535),
    Setting("slot_save", "bool"),
)}
assert set(SETTINGS) == set(_FLAG_KEYS)


def check_setting(key: str, value, from_text: bool = False):
    return SETTINGS[key].check(value, from_text)


def load_config(path: Path) -> dict:
    """The config file's settings by key (`-` read as `_`); its structure and keys checked here, each value where it is
    used (config_value, from serve's click types)."""
    from rollingkv_cli.userinput import read_data

    data = read_data(path, "config file")  # JSON for a .json file (as a thresholds file), else YAML
    if data is None:
        data = {}
    if not isinstance(data, dict):
        abort(f"config file {path}: expected a mapping of settings, got {type(data).__name__}",
              "write one `key: value` per line, e.g. `ctx_size: 4096`")
    spelled: dict[str, str] = {}
    for k in data:  # `ctx-size: 4096` and `ctx_size: 2048` are one key: the last one won silently
        key = str(k).replace("-", "_")
        if key in spelled:
            usage_error(f"config file {path}: {spelled[key]} and {k} are the same setting, given twice", "give it once")
        spelled[key] = str(k)
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - set(CONFIG_KEYS))
    if unknown:
        usage_error(f"config file {path}: unknown key(s) {', '.join(unknown)}", f"known keys: {', '.join(CONFIG_KEYS)}")
    return data


def config_value(key: str, value, source: str):
    """A config file's value for key (YAML's type, not text), checked by the key's Setting; a usage error names the file and the key."""
    if value is None:
        return None
    if key == "extra_args":
        if not isinstance(value, list) or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in value):
            usage_error(f"{source}: extra_args must be a list of strings")
        return [str(a) for a in value]
    if key == "model":
        if not isinstance(value, str) or not value.strip():
            usage_error(f"{source}: model must be a GGUF path or `demo`, not {shown(value)}")
        return value
    try:
        return check_setting(key, value)
    except SettingError as e:
        usage_error(f"{source}: {key} {e}")


def resolve_settings(model_spec: str | None, merged: dict, where: dict[str, str], extra_args: list[str],
                     extra_where: str) -> ServeSettings:
    """The settings as click resolved them (each flag over its config file key: serve/cli.py; every value checked by its
    Setting), `where` each came from (a flag, or the config file's key), then the checks across settings, which name it."""
    from rollingkv_cli import models

    _check_extra_args(extra_args, merged, where, extra_where)
    _check_together(merged, where, unified=arg_given(extra_args, "--kv-unified") or arg_given(extra_args, "-kvu"))
    if not model_spec:
        usage_error("no MODEL given", "pass a GGUF path or `demo`, or set `model:` in --config")
    # what splits on any build; serve checks auto on a GPU once it knows the build
    check_split_types({where["cache_type_k"]: merged["cache_type_k"], where["cache_type_v"]: merged["cache_type_v"]},
                      *split_asked(merged, extra_args), cuda=False)
    model = models.resolve_model(str(model_spec), log=note)
    s = ServeSettings(model=model, extra_args=extra_args,
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
                "pcie_bw_gbps": ("--pcie-bw-gbps",), "kv_tail_cpu_frac": ("--kv-tail-cpu-frac",), "kv_windows": ("--kv-windows",),
                "kv_placement": ("--kv-placement",), "kv_share_prefix": ("--kv-share-prefix",), "slot_save": ("--slot-save-path",)}


def _arg_name(a: str) -> str:
    return a.split("=", 1)[0] if a.startswith("--") else a


# llama-server's residency flags and serve's own settings, given to llama-server after `--`: their values are known, so
# a bad one is refused before the server starts (it started, loaded the model, then exited with a log box). llama-server
# takes 0 for "the planner decides" where serve's own flags take a count.
_PASSTHROUGH_VALUES: dict[str, Setting] = {
    **{f: SETTINGS[k] for k, fs in _LLAMA_FLAGS.items() if k != "slot_save" for f in fs},
    "--kv-window-cells": Setting("kv_window_cells", "int", lo=0, cap=INT32_MAX),
    "--kv-device-heads": Setting("kv_device_heads", "int", lo=0, cap=INT32_MAX),
    "--vram-target": Setting("vram_target", "int", lo=0, cap=MAX_VRAM_TARGET_MIB),
    # 0 or less: llama-server's default; more than ggml's most: it crashed (SIGSEGV at -t 100000, in its threadpool)
    **{f: Setting("threads", "int", cap=MAX_THREADS, cap_why=MAX_THREADS_WHY) for f in ("-t", "--threads", "-tb", "--threads-batch")},
}


def check_server_args(extra: list[str], extra_where: str, command: str, owned: dict[str, str] | None = None) -> None:
    """llama-server's arguments that a command passes on unchanged (serve's and bench load's after `--`): the address
    and the model are the command's own (it binds, checks and reports them), so are the flags in owned (flag -> what
    sets it), and the residency flags' values must be ones llama-server takes. Usage errors, before any server starts."""
    for i, a in enumerate(extra):
        name = _arg_name(a)
        if name in ("--host", "--port"):
            if command == "serve":
                usage_error(f"{name} {extra_where} clashes with serve's own {name} (serve binds, checks and reports that address)",
                            f"give it to serve before `--`: rollingkv serve MODEL {name} VALUE")
            usage_error(f"{name} {extra_where} clashes with {command}, which runs each llama-server on a free loopback port",
                        f"leave {name} out")
        if name in ("-m", "--model"):
            usage_error(f"{name} {extra_where} clashes with {command}'s MODEL (it checks and reports the model it loads)",
                        f"give the model as {command}'s MODEL argument (a GGUF path or `demo`)")
        if owned and name in owned:
            usage_error(f"{name} {extra_where} clashes with {owned[name]}: llama-server would take only one of them",
                        "leave it out")
        setting = _PASSTHROUGH_VALUES.get(name)
        if setting is None:
            continue
        if a.startswith("--") and "=" in a:
            value = a.split("=", 1)[1]
        elif i + 1 < len(extra):
            value = extra[i + 1]
        else:
            usage_error(f"{name} {extra_where} has no value", f"give it one: {name} VALUE")
        try:
            setting.check(value, from_text=True)
        except SettingError as e:
            usage_error(f"{name} {extra_where} {e}" if str(e).startswith("must") else f"{name} {extra_where}: {e}",
                        "llama-server would refuse it, or fail on it, after loading the model")


def _check_extra_args(extra: list[str], merged: dict, where: dict[str, str], extra_where: str) -> None:
    """llama-server's arguments after `--` go unchanged, so none may contradict what serve passes itself: serve binds
    --host/--port and loads MODEL (what it checks and reports), and a setting given both ways would leave one of the
    two ignored. Usage errors, naming both."""
    check_server_args(extra, extra_where, "serve")
    owner = {f: k for k, fs in _LLAMA_FLAGS.items() for f in fs}
    for a in extra:
        name = _arg_name(a)
        key = owner.get(name)
        if key is not None and merged.get(key) not in (None, False):
            usage_error(f"{name} {extra_where} clashes with {where[key]}: llama-server would take only one of them",
                        "give the setting once")


# serve's setting keys of a ResidencyRequest's fields
_REQUEST_KEYS = {"mode": "kv_residency_mode", "window_cells": "kv_window_cells", "device_heads": "kv_device_heads",
                 "vram_target": "vram_target", "type_k_tail": "cache_type_k_tail", "type_v_tail": "cache_type_v_tail",
                 "tail_cpu_frac": "kv_tail_cpu_frac", "pcie_bw_gbps": "pcie_bw_gbps", "windows": "kv_windows"}


def residency_request(settings: dict) -> ResidencyRequest:
    """The residency request of serve's settings (by key)."""
    return ResidencyRequest(**{field: settings.get(key) for field, key in _REQUEST_KEYS.items()})


def _check_together(m: dict, where: dict[str, str], unified: bool = False) -> None:
    """Settings that are fine alone but not together (usage errors, as a bad flag)."""
    window, ctx, parallel = m.get("kv_window_cells"), m.get("ctx_size"), m.get("parallel")
    heads, mode = m.get("kv_device_heads"), m.get("kv_residency_mode")
    if ctx and parallel and ctx < parallel:
        # llama-server splits the context between the slots: fewer cells than slots leaves a slot none
        usage_error(f"{where['ctx_size']} {ctx} has fewer cells than {where['parallel']} {parallel} has slots",
                    "each slot gets ctx_size / parallel cells: raise the context or lower the slots")
    request = residency_request(m)
    try:
        request.check({field: where[key] for field, key in _REQUEST_KEYS.items() if key in where})
    except ResidencyConflict as e:
        usage_error(e.message, e.hint)
    if window and ctx and window > ctx:
        usage_error(f"{where['kv_window_cells']} {window} is larger than the context ({where['ctx_size']} {ctx})",
                    "a window of the whole context is the resident cache: use --kv-residency-mode off")
    auto = request.auto_tail_axes({field: where[key] for field, key in _REQUEST_KEYS.items() if key in where})
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


def split_asked(settings: dict, extra_args: list[str]) -> tuple[str | None, bool]:
    """(the residency mode, whether a budget, window or head split is asked for), from serve's settings (by key) or after
    `--`."""
    mode = arg_value(extra_args, "--kv-residency-mode") or settings.get("kv_residency_mode")
    budgeted = any(settings.get(k) is not None for k in ("vram_target", "kv_window_cells", "kv_device_heads")) or any(
        arg_given(extra_args, f) for f in ("--vram-target", "--kv-window-cells", "--kv-device-heads"))
    return mode, budgeted



def arg_given(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def arg_value(args: list[str], flag: str) -> str | None:
    """The last value of flag in a llama-server argument list (as llama.cpp reads it), else None."""
    found = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found


