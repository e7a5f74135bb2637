"""Serving: the pre-flight checks on the build and the model, llama-server's command line (GPU layers, the link and CPU
attention bandwidths it plans with), and the supervision of the running server (signals, its death described, the live
status of status.py)."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

from rollingkv_cli.console import (RollingKVError, abort, console, esc, info, is_interactive, log_panel, note, print_error,
                                   success, usage_error, warn)
from rollingkv_cli.kvtypes import FLOAT_TYPES, TAIL_AUTO, TAIL_TYPES, WINDOW_TYPES
from rollingkv_cli.lib import paths
from rollingkv_cli.serve.settings import (ServeSettings, SettingError, arg_given, arg_value, check_split_types, fraction_or_auto,
                                          may_split, split_asked)
from rollingkv_cli.serve.status import LiveStatus, describe_plan, describe_plan_details, vram_mib


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
    compact = set(WINDOW_TYPES) - set(FLOAT_TYPES)  # already compact: auto keeps the window's type
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


def check_host_kv(s: ServeSettings) -> None:
    """A CPU build keeps the whole KV cache in host memory: a context whose cache cannot fit MemAvailable is refused
    before llama-server starts (`serve demo -c 2000000000` had it killed by the kernel's out-of-memory killer, which may
    pick another process; -c 4000000 failed its allocation after a log box). The context is -c (serve's or after `--`),
    else the model's trained context, llama-server's default; counted at the smaller of the window's and the tail's
    types."""
    from rollingkv_cli.bench import gguf as model_shape
    from rollingkv_cli.lib.gguf_header import read_header

    text = s.ctx_size or arg_value(s.extra_args, "-c") or arg_value(s.extra_args, "--ctx-size")
    try:
        ctx = int(text) if text else 0
        info = model_shape.read_model(s.model)
        if ctx <= 0:
            ctx = int(read_header(s.model).get(f"{info.arch}.context_length") or 0)
    except (RollingKVError, ValueError, TypeError):  # a shape this reader does not know: llama-server says what it thinks
        return
    if ctx <= 0:
        return
    k, v = s.cache_type_k or "f16", s.cache_type_v or "f16"
    flag = "-c/--ctx-size" if text else "-c/--ctx-size (the model's trained context is the default)"
    model_shape.check_host_kv(info, ctx, [(k, v), (s.cache_type_k_tail or k, s.cache_type_v_tail or v)], f"a context of {ctx} cells",
                              f"lower {flag}")


def model_weight_bytes(model: Path) -> int:
    from rollingkv_cli.lib.gguf_header import read_header

    return sum(t.n_bytes for t in read_header(model).tensors)


# llama-server's flags that decide the GPU layers (its --fit is on by default and adjusts unset ones)
_GPU_LAYER_FLAGS = ("-ngl", "--gpu-layers", "--n-gpu-layers", "-fit", "--fit")
# what must stay free next to the weights for `-ngl all` to be safe: the GPU runtime (CUDA context, cuBLAS, pools),
# compute buffers and the smallest window with its slot ring (the planner refuses less, naming the minimum)
GPU_LAYERS_HEADROOM_MIB = 1024


def _free_vram_mib() -> int | None:
    """Free memory over all NVIDIA GPUs (NVML: total - used), or None where NVML does not answer."""
    vram = vram_mib()
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
    """The model's id in the OpenAI API (/v1/models, "model" in answers): its file name without .gguf, as llama-server
    keeps it. Its --alias is a list: split at commas, each item stripped of blanks (common/arg.cpp), so `a, b.gguf` was
    served as "a" (and "b"), and a name of blanks left no alias (the id was then the model's full path); commas become
    `_`. A leading `-` stays: llama-server takes the word after --alias as its value whatever it is (`-x.gguf` is
    "-x")."""
    name = model.name[:-5] if model.name.lower().endswith(".gguf") else model.name
    return name.replace(",", "_").strip() or "model"


def prompt_cache_args(s: ServeSettings, may_split_cache: bool) -> list[str]:
    """llama-server's RAM prompt cache off (`--cache-ram 0`) where the cache may split, unless the user set it (after
    `--` or LLAMA_ARG_CACHE_RAM). At every new task the prompt cache copies each idle slot's state into RAM through
    state IO: for a split cache a copy of a tail that already lives in host memory (on an H100 it cost the split default
    server 40 % of its time to first token under random arrivals, docs/perf/2026-12-06-h100-unified-tail-runs), and in a
    unified cache it then clears the slot. Without it an idle slot's sequence stays where it is: block residency demotes
    its blocks to the host when a running request needs the device, a returning user's prompt is reused in place, and
    llama-server purges idle slots (try_clear_idle_slots) only when a request needs their cells."""
    if not may_split_cache or arg_given(s.extra_args, "--cache-ram") or arg_given(s.extra_args, "-cram") \
            or os.environ.get("LLAMA_ARG_CACHE_RAM") is not None:
        return []
    return ["--cache-ram", "0"]


def server_command_args(s: ServeSettings, slot_dir: Path, bandwidth: float | None, gpu_layer_args: list[str] | None = None,
                        cpu_attn_gbps: float | None = None, may_split_cache: bool = False) -> list[str]:
    # what serve turns on that llama-server leaves off: flash attention (the rolling KV's op needs it) and /metrics (for
    # scrapers such as Prometheus; no prompt or answer text; serve's live status never reads it: each read resets its
    # per-interval gauges). Slot save/restore writes files into slot_dir on any client's request: only with --slot-save.
    args = ["-m", str(s.model), "-fa", "on", "--metrics", *prompt_cache_args(s, may_split_cache)]
    if not (arg_given(s.extra_args, "--alias") or arg_given(s.extra_args, "-a") or os.environ.get("LLAMA_ARG_ALIAS")):
        args += ["--alias", model_alias(s.model)]  # /v1/models names the model, not the path of the user's cache
    if s.slot_save:
        args += ["--slot-save-path", str(slot_dir)]
    args += gpu_layer_args or []
    for key, flag in (("ctx_size", "-c"), ("parallel", "-np"), ("cache_type_k", "-ctk"), ("cache_type_v", "-ctv"),
                      ("kv_residency_mode", "--kv-residency-mode"), ("vram_target", "--vram-target"),
                      ("kv_window_cells", "--kv-window-cells"), ("kv_device_heads", "--kv-device-heads"),
                      ("cache_type_k_tail", "-ctkt"), ("cache_type_v_tail", "-ctvt"), ("kv_windows", "--kv-windows"),
                      ("kv_placement", "--kv-placement"), ("kv_share_prefix", "--kv-share-prefix")):
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



def requested_tail_cpu_frac(s: ServeSettings) -> float | str | None:
    """The CPU part llama-server will be asked for: --kv-tail-cpu-frac after `--` (it comes last, so it wins), else
    serve's own setting, else $LLAMA_ARG_KV_TAIL_CPU_FRAC; "auto", a share from 0 to 1, or None (llama-server's
    default: auto). A value llama-server would refuse counts as None (it says why when it starts)."""
    import os

    text = arg_value(s.extra_args, "--kv-tail-cpu-frac")
    if text is None and s.kv_tail_cpu_frac is not None:
        return s.kv_tail_cpu_frac
    if text is None:
        text = os.environ.get(ENV_TAIL_CPU_FRAC, "").strip() or None
    if text is None:
        return None
    try:
        return fraction_or_auto(text, from_text=True)
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
    if arg_given(s.extra_args, "--cpu-attn-gbps") or os.environ.get(ENV_CPU_ATTN, "").strip():
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
    # a bad value is an error here, as in `probe pcie` and the gates, not a warning below; on a CPU build too (it was
    # ignored there, then refused once the same setup met a GPU)
    env = paths.pcie_bw_env()
    if s.pcie_bw_gbps is not None:
        return s.pcie_bw_gbps, "explicit --pcie-bw-gbps"
    if not cuda:
        return None, "CPU build: no link to model"
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

def new_log(path: Path) -> Path:
    """path, or path with -2, -3, ... before .log: a file created here, empty, that no other run writes. The name was
    the time and the port alone: two serves started in the same second on one port appended to one log, and the second's
    "port taken" line was read from among the first's lines. The pid in the name parts processes; creating the file
    exclusively parts two serves of one process (the tests) and a pid used again."""
    n = 1
    while True:
        candidate = path if n == 1 else path.with_name(f"{path.stem}-{n}{path.suffix}")
        try:
            with open(candidate, "xb"):
                return candidate
        except FileExistsError:
            n += 1


# How long a stopped serve gives llama-server after SIGTERM before its SIGKILL. Idle, it ends in well under a second;
# with a streaming request in flight it never ends on SIGTERM (its HTTP thread waits for the request the stopped task
# loop will not finish), and the 15 s grace kept Ctrl-C waiting for nothing. A second Ctrl-C cuts even this short.
SERVE_STOP_GRACE = 3.0

def api_key(extra_args: list[str]) -> str | None:
    """The API key llama-server will require (--api-key or --api-key-file after `--`, else $LLAMA_API_KEY, as llama-server
    reads them): serve's own requests (/props, /slots) send it. None: the server is open to whoever reaches it."""
    import os

    text = arg_value(extra_args, "--api-key")
    path = arg_value(extra_args, "--api-key-file") or os.environ.get("LLAMA_ARG_API_KEY_FILE")
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



def serve(s: ServeSettings, print_args: bool = False, quiet: bool = False) -> None:
    import shlex

    from rollingkv_cli.lib import builder
    from rollingkv_cli.serve.server import SAVE_STALL, ServerProcess, free_port, port_in_use, resolve_host

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
    if not cuda:
        check_host_kv(s)
    if cuda:  # auto on a GPU may split without being asked to (resolve_settings checked what a CPU build splits)
        check_split_types({"--cache-type-k": s.cache_type_k, "--cache-type-v": s.cache_type_v}, *split_asked(vars(s), s.extra_args), cuda=True,
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
    slot_dir = paths.cache_dir(write=not print_args) / "slots"  # --print-args writes nothing: a read-only cache will do
    log_dir = paths.cache_dir(write=not print_args) / "logs"
    key = api_key(s.extra_args)
    # the pid: two serves started in the same second on one port (new_log makes the file this run's own)
    log_path = log_dir / f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{port}-{os.getpid()}.log"
    ngl_args, ngl_note = gpu_layers(s, cuda)
    cpu_attn_gbps, cpu_note = resolve_cpu_attn(s, cuda, b.dir.name, tail_cpu)
    may_split_cache = may_split(*split_asked(vars(s), s.extra_args), cuda=cuda) and build_has_rolling_kv(b.lib_dir / "libllama.so")
    srv = ServerProcess(binary, server_command_args(s, slot_dir, bandwidth, ngl_args, cpu_attn_gbps, may_split_cache), host=s.host, port=port,
                        log_path=log_path, api_key=key, stop_grace=SERVE_STOP_GRACE)
    if print_args:
        print(shlex.join(srv.command))
        return
    made = [log_dir] + ([slot_dir] if s.slot_save else [])
    try:
        for d in made:
            d.mkdir(parents=True, exist_ok=True)
        srv.log_path = log_path = new_log(log_path)
    except OSError as e:
        abort(f"cannot create {e.filename or d}: {e.strerror or e}",
              f"point {paths.ENV_CACHE_DIR} at a directory you can write")
    paths.prune_run_logs(log_dir, "serve-", paths.KEEP_RUN_LOGS)  # this run's log among the newest kept, as the gates'
    if not key and not is_loopback(s.host):
        warn(f"--host {s.host} serves beyond this machine and no API key is set: anyone who reaches port {port} can use the "
             "server; pass `-- --api-key KEY` (or set $LLAMA_API_KEY)")
    if s.slot_save or arg_given(s.extra_args, "--slot-save-path"):  # serve's option, or llama-server's own after `--`
        where = slot_dir if s.slot_save else arg_value(s.extra_args, "--slot-save-path")
        warn(f"{'--slot-save' if s.slot_save else '--slot-save-path'}: any client of the server can write and read KV cache "
             f"files in {where} (POST /slots/N?action=save|restore)" + ("" if key else "; set an API key to limit who can"))
        if where:  # a stop waits for a save in progress there instead of cutting its file short
            srv.slot_dir = Path(where)
            srv.on_save_wait = lambda path: info(f"llama-server is saving a slot to {path}: waiting for the save to "
                                                 "end (Ctrl-C again to kill it; the half-written file is then removed)")
    if bandwidth is not None:
        note(f"PCIe bandwidth for planning: {bandwidth:g} GB/s — {tier}")
    if ngl_note:
        note(ngl_note)
    if cpu_note:
        note(cpu_note)
    note(f"log: {log_path}")

    from rollingkv_cli.lib.procs import signal_name, stop_signals_raise, stop_signum

    # Ctrl-C, SIGTERM and SIGHUP (the terminal closed) stop the server alike; we exit 128 + the signal's number
    exit_code = 0
    stopped_by: int | None = None
    with stop_signals_raise():
        try:
            exit_code = _supervise(srv, s, log_path, start_timeout, cuda, quiet)
        except KeyboardInterrupt as e:  # Terminated too (SIGTERM, SIGHUP)
            stopped_by = stop_signum(e)
            info("stopping llama-server …")
        except RollingKVError as e:
            from rollingkv_cli.lib.builder import log_tail

            if srv.proc is not None and not getattr(srv, "failure_reason", None):  # the line says why: no log box
                log_panel(log_tail(log_path, 15), f"last lines of {log_path}")
            raise e
        finally:
            # a second signal while stopping only hurries the stop: stop_group kills and reaps the group, then re-raises
            try:
                srv.stop()
            except KeyboardInterrupt as e:
                stopped_by = stopped_by or stop_signum(e)
    if stopped_by is not None:
        cut = f"; its half-written slot file {', '.join(srv.saves_cut)} removed" if srv.saves_cut else ""
        if srv.kill_reason == "signal":  # a second Ctrl-C (or SIGTERM, SIGHUP) while it stopped or saved a slot
            warn(f"llama-server killed (SIGKILL) at a second stop signal, {srv.killed_after:.1f} s after SIGTERM "
                 f"(serve stopped by {signal_name(stopped_by)}){cut}")
        elif srv.kill_reason == "stalled save":  # the file stood still for SAVE_STALL seconds: a disk that hangs
            warn(f"llama-server killed (SIGKILL): its slot save had not moved for {SAVE_STALL:g} s (serve stopped by "
                 f"{signal_name(stopped_by)}){cut}")
        elif srv.killed:  # not "stopped": it did not end on SIGTERM (a streaming request holds its HTTP thread)
            warn(f"llama-server killed (SIGKILL): it had not ended {srv.stop_grace:g} s after SIGTERM, most often because a "
                 f"request was still in flight (serve stopped by {signal_name(stopped_by)})")
        elif srv.saves_waited:
            success(f"llama-server stopped ({signal_name(stopped_by)}) once its slot save to "
                    f"{', '.join(srv.saves_waited)} ended, {srv.stopped_after:.1f} s after SIGTERM")
        else:
            success(f"llama-server stopped ({signal_name(stopped_by)})")
        raise SystemExit(128 + stopped_by)
    if exit_code:
        raise SystemExit(exit_code)
    success("llama-server stopped")


def _supervise(srv, s: ServeSettings, log_path: Path, start_timeout: float, cuda: bool, quiet: bool) -> int:
    """Start llama-server, wait for it, show the plan and the live status until it dies (1, reported) or a stop
    signal comes (raised)."""
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
    _report_death(srv, srv.proc.returncode if srv.proc else None, log_path)
    return 1


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
