"""`gate vram`: the device memory of a llama-server run with --vram-target stays within the target plus an
allowance through a long decode.

NVML is sampled in a thread every ~50 ms from the moment the server process starts (model load, context
creation, prefill and decode all count):

- the process's own memory: ``nvmlDeviceGetComputeRunningProcesses`` -> ``usedGpuMemory`` of the server's pid
  (what the verdict uses when NVML reports it);
- the device's used memory (``nvmlDeviceGetMemoryInfo().used``) minus what was used before the server
  started: the fallback when NVML lists no memory for the pid (containers with their own pid namespace,
  drivers that report "not available"). It counts every other process's growth too, so it errs on the
  side of failing.

The NVML module is passed in (``pynvml`` from nvidia-ml-py in real runs), so the sampler is tested with a
fake one on machines without a GPU.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

MIB = 1 << 20
DEFAULT_ALLOWANCE_MIB = 200
DEFAULT_INTERVAL_S = 0.05


class NoGpu(Exception):
    """NVML is missing, does not initialise, or has no such GPU."""


def nvml_module():
    """The NVML bindings (nvidia-ml-py's ``pynvml``); tests replace this function."""
    import pynvml

    return pynvml


def open_gpu(nvml, index: int):
    """(handle, name, total bytes) of GPU `index`; NoGpu when NVML or the GPU is missing."""
    try:
        nvml.nvmlInit()
    except Exception as e:  # ImportError is the caller's; NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise NoGpu(f"NVML unavailable: {e}") from None
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except Exception as e:
        raise NoGpu(f"NVML lists no devices: {e}") from None
    if count == 0:
        raise NoGpu("NVML found no GPU")
    if not 0 <= index < count:
        raise IndexError(index)
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    name = nvml.nvmlDeviceGetName(h)
    name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    total = int(nvml.nvmlDeviceGetMemoryInfo(h).total)
    return h, name, total


@dataclass
class Sample:
    t: float  # seconds since the sampler started
    process_bytes: int | None  # the watched pids' usedGpuMemory summed; None when NVML lists none of them
    device_used_bytes: int | None


@dataclass
class VramStats:
    baseline_used_bytes: int | None
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def peak_process_bytes(self) -> int | None:
        v = [s.process_bytes for s in self.samples if s.process_bytes is not None]
        return max(v) if v else None

    @property
    def peak_device_used_bytes(self) -> int | None:
        v = [s.device_used_bytes for s in self.samples if s.device_used_bytes is not None]
        return max(v) if v else None

    @property
    def peak_device_delta_bytes(self) -> int | None:
        p = self.peak_device_used_bytes
        if p is None:
            return None
        return max(0, p - (self.baseline_used_bytes or 0))

    @property
    def source(self) -> str | None:
        if self.peak_process_bytes is not None:
            return "process"
        if self.peak_device_used_bytes is not None:
            return "device"
        return None

    @property
    def peak_bytes(self) -> int | None:
        """What the verdict uses: the process's peak when NVML reported it, else the device's growth."""
        return self.peak_process_bytes if self.source == "process" else self.peak_device_delta_bytes

    def to_dict(self) -> dict:
        def mib(b):
            return None if b is None else round(b / MIB, 1)

        return {"source": self.source, "peak_mib": mib(self.peak_bytes), "peak_process_mib": mib(self.peak_process_bytes),
                "peak_device_used_mib": mib(self.peak_device_used_bytes), "peak_device_delta_mib": mib(self.peak_device_delta_bytes),
                "baseline_device_used_mib": mib(self.baseline_used_bytes), "samples": self.n,
                "process_samples": sum(1 for s in self.samples if s.process_bytes is not None), "sample_errors": self.errors,
                "duration_s": round(self.samples[-1].t, 2) if self.samples else 0.0}


class NvmlSampler:
    """Samples a GPU's memory for a set of pids in a daemon thread until stop()."""

    def __init__(self, nvml, handle, pids: set[int] | Callable[[], set[int]], interval_s: float = DEFAULT_INTERVAL_S,
                 baseline_used_bytes: int | None = None, on_sample: Callable[[Sample, "VramStats"], None] | None = None):
        self.nvml = nvml
        self.handle = handle
        self._pids = pids
        self.interval_s = interval_s
        self.on_sample = on_sample
        self.stats = VramStats(baseline_used_bytes)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()

    def pids(self) -> set[int]:
        return set(self._pids() if callable(self._pids) else self._pids)

    def sample(self) -> Sample:
        """One sample; an NVML call that fails leaves its field None (and counts an error)."""
        proc = dev = None
        failed = False
        try:
            want = self.pids()
            used = [p.usedGpuMemory for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
                    if int(p.pid) in want and p.usedGpuMemory is not None]
            proc = int(sum(used)) if used else None
        except Exception:
            failed = True
        try:
            dev = int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
        except Exception:
            failed = True
        if failed:
            self.stats.errors += 1
        s = Sample(round(time.monotonic() - self._t0, 4), proc, dev)
        self.stats.samples.append(s)
        if self.on_sample is not None:
            try:
                self.on_sample(s, self.stats)
            except Exception:
                pass
        return s

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                break

    def start(self) -> "NvmlSampler":
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="rollingkv-nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> VramStats:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
            self.sample()  # one last look after the run
        return self.stats

    def __enter__(self) -> "NvmlSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def verdict(stats: VramStats, target_mib: int, allowance_mib: int) -> tuple[str, str]:
    """('pass'|'fail', why)."""
    peak = stats.peak_bytes
    limit = (target_mib + allowance_mib) * MIB
    if peak is None:
        return "fail", "NVML reported no memory figure for the run"
    if peak <= limit:
        return "pass", f"peak {peak / MIB:.0f} MiB <= {target_mib} + {allowance_mib} MiB"
    return "fail", f"peak {peak / MIB:.0f} MiB > {target_mib} + {allowance_mib} MiB (over by {(peak - limit) / MIB:.0f} MiB)"


def no_gpu_report(reason: str) -> dict:
    from rollingkv_cli.hw.pcie import NO_GPU_MESSAGE

    return {"gate": "vram", "verdict": "no-gpu", "passed": False, "gpus": [], "error": NO_GPU_MESSAGE, "reason": reason}


# ------------------------------------------------------------------ the run

@dataclass
class VramConfig:
    model: Path
    build: object  # common.GateBuild
    vram_target: int
    allowance: int = DEFAULT_ALLOWANCE_MIB
    n_ctx: int = 32768
    prompt_tokens: int | None = None
    n_predict: int = 512
    mode: str = "auto"
    ctk: str = "f16"
    ctv: str = "f16"
    ctkt: str | None = None
    ctvt: str | None = None
    gpu: int = 0
    interval_s: float = DEFAULT_INTERVAL_S
    threads: int | None = None
    n_gpu_layers: int = 999
    parallel: int = 1  # slots, each prefilling and decoding a request of its own at once
    kv_unified: bool = False  # one cache for the slots (llama-server's layout without -np is 4 unified slots)

    @property
    def per_request_ctx(self) -> int:
        """What one request may hold: the whole context shared by the slots, split by them when not unified."""
        return self.n_ctx // self.parallel

    @property
    def request_prompt_tokens(self) -> int:
        return self.prompt_tokens or self.per_request_ctx // 2

    def layout(self) -> str:
        if self.parallel == 1:
            return "one slot"
        return f"{self.parallel} slots, one unified cache" if self.kv_unified else f"{self.parallel} slots, a cache each"

    def residency(self) -> dict:
        r: dict = {"mode": self.mode, "vram_target_mib": self.vram_target}
        if self.ctkt:
            r["type_k_tail"] = self.ctkt
        if self.ctvt:
            r["type_v_tail"] = self.ctvt
        return r


def run(cfg: VramConfig, nvml, handle, gpu_name: str, console, logs) -> dict:
    """Start llama-server with the target, sample NVML, prefill + decode; the report."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from rollingkv_cli.gate import common as gc
    from rollingkv_cli.lib import paths
    from rollingkv_cli.serve.server import ServerProcess

    t_start = time.time()
    binary = cfg.build.require_server()
    prompt_tokens = cfg.request_prompt_tokens
    if prompt_tokens + cfg.n_predict > cfg.per_request_ctx:
        from rollingkv_cli.console import abort

        abort(f"--prompt-tokens {prompt_tokens} + --n-predict {cfg.n_predict} exceed what one of {cfg.parallel} requests "
              f"may hold ({cfg.per_request_ctx} of --ctx {cfg.n_ctx})", "raise --ctx or shorten the run")
    args = gc.server_args(cfg.model, cfg.n_ctx, cfg.threads, cfg.n_gpu_layers, cfg.ctk, cfg.ctv, cfg.residency(),
                          n_parallel=cfg.parallel, kv_unified=cfg.kv_unified)
    bw = paths.pcie_bw_env()
    if bw is not None:
        args += ["--pcie-bw-gbps", f"{bw:g}"]
    start_timeout = paths.serve_start_timeout()
    log_path = logs / "vram-server.log"
    try:
        baseline = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:
        baseline = None
    srv = ServerProcess(binary, args, log_path=log_path)
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TextColumn("[dim]{task.fields[stage]}[/]"),
                        TextColumn("{task.fields[peak]}"), TimeElapsedColumn(), console=console, transient=False)
    timings: dict = {}
    plan = None
    completions: list[dict] = []
    with progress:
        task = progress.add_task(f"llama-server --vram-target {cfg.vram_target}", stage="starting", peak="")

        def on_sample(s: Sample, st: VramStats) -> None:
            p = st.peak_bytes
            if p is not None:
                progress.update(task, peak=f"peak {p / MIB:.0f} MiB ({st.source})")

        srv.start()
        sampler = NvmlSampler(nvml, handle, {srv.proc.pid}, cfg.interval_s, baseline, on_sample).start()
        try:
            t0 = time.perf_counter()
            try:
                srv.wait_healthy(timeout=start_timeout)
            except BaseException:
                gc.print_log_tail(log_path)
                raise
            timings["load_s"] = round(time.perf_counter() - t0, 2)
            plan = gc.plan_of(srv)
            progress.update(task, stage="building the prompts")
            # a text of its own per request: no slot reuses (or shares) another's cached prompt
            prompts = [_prompt(srv, prompt_tokens, seed) for seed in range(cfg.parallel)]
            what = f"prefill {prompt_tokens} + decode {cfg.n_predict} tokens"
            progress.update(task, stage=what if cfg.parallel == 1 else f"{cfg.parallel} requests at once, each: {what}")
            t1 = time.perf_counter()
            completions = _complete_all(srv, prompts, cfg.n_predict)
            timings["request_s"] = round(time.perf_counter() - t1, 2)
            progress.update(task, stage="done")
        finally:
            stats = sampler.stop()
            srv.stop()
    v, why = verdict(stats, cfg.vram_target, cfg.allowance)
    tm = (completions[0].get("timings") or {}) if completions else {}
    return {
        "gate": "vram",
        "verdict": v,
        "passed": v == "pass",
        "why": why,
        "vram_target_mib": cfg.vram_target,
        "allowance_mib": cfg.allowance,
        "limit_mib": cfg.vram_target + cfg.allowance,
        "memory": stats.to_dict(),
        "gpu": {"index": cfg.gpu, "name": gpu_name},
        "plan": plan,
        "model": str(cfg.model),
        "n_ctx": cfg.n_ctx,
        "parallel": cfg.parallel,
        "kv_unified": cfg.kv_unified,
        "layout": cfg.layout(),
        "prompt_tokens": prompt_tokens,
        "n_predict": cfg.n_predict,
        "tokens_evaluated": _total(completions, "tokens_evaluated"),
        "tokens_predicted": _total(completions, "tokens_predicted"),
        "server_timings": _timings(tm),
        "requests": [{"tokens_evaluated": c.get("tokens_evaluated"), "tokens_predicted": c.get("tokens_predicted"),
                      "server_timings": _timings(c.get("timings") or {})} for c in completions],
        "timings": timings,
        "cache_types": {"k": cfg.ctk, "v": cfg.ctv, "k_tail": cfg.ctkt or cfg.ctk, "v_tail": cfg.ctvt or cfg.ctv},
        "residency": cfg.residency(),
        "server": {"command": srv.command, "log": str(log_path)},
        "build": cfg.build.describe(),
        "wall_s": round(time.time() - t_start, 2),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _prompt(srv, n_tokens: int, seed: int) -> list[int]:
    """n_tokens of synthetic text (its own per seed), tokenized by the server."""
    from rollingkv_cli.gate import common as gc
    from rollingkv_cli.lib.text import synthetic_text

    text = synthetic_text(n_tokens * 6, seed=seed)
    toks = gc.request(srv, "/tokenize", {"content": text, "add_special": True}, timeout=300)["tokens"]
    while len(toks) < n_tokens:
        text = synthetic_text(len(text) * 2, seed=seed)
        toks = gc.request(srv, "/tokenize", {"content": text, "add_special": True}, timeout=300)["tokens"]
    return toks[:n_tokens]


def _complete_all(srv, prompts: list[list[int]], n_predict: int) -> list[dict]:
    """Every prompt's completion, all sent at once (one slot each); the first failure is raised after all returned."""
    from concurrent.futures import ThreadPoolExecutor

    from rollingkv_cli.gate import common as gc

    def one(toks: list[int]) -> dict:
        return gc.request(srv, "/completion", {"prompt": toks, "n_predict": n_predict, "ignore_eos": True, "temperature": 0,
                                               "top_k": 1, "cache_prompt": False})

    if len(prompts) == 1:
        return [one(prompts[0])]
    with ThreadPoolExecutor(max_workers=len(prompts), thread_name_prefix="rollingkv-vram-request") as pool:
        futures = [pool.submit(one, p) for p in prompts]
        return [f.result() for f in futures]


def _total(completions: list[dict], key: str) -> int | None:
    vals = [c.get(key) for c in completions]
    return sum(vals) if vals and all(isinstance(v, int) for v in vals) else None


def _timings(tm: dict) -> dict:
    return {k: tm.get(k) for k in ("prompt_ms", "prompt_per_second", "predicted_ms", "predicted_per_second") if k in tm}


def print_report(console, r: dict) -> None:
    from rich.table import Table

    from rollingkv_cli.console import esc
    from rollingkv_cli.serve.status import describe_plan

    m = r["memory"]
    t = Table(title=f"VRAM gate: GPU {r['gpu']['index']} ({esc(str(r['gpu']['name']))})", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("target", f"{r['vram_target_mib']} MiB + {r['allowance_mib']} MiB allowance = {r['limit_mib']} MiB")
    t.add_row("peak (verdict)", f"{m['peak_mib']} MiB, from {m['source'] or 'nothing'}")
    t.add_row("peak of the server process", f"{m['peak_process_mib']} MiB" if m["peak_process_mib"] is not None else "not reported by NVML")
    t.add_row("peak device used", f"{m['peak_device_used_mib']} MiB ({m['peak_device_delta_mib']} MiB above the {m['baseline_device_used_mib']} MiB before)")
    t.add_row("samples", f"{m['samples']} over {m['duration_s']} s ({m['process_samples']} with the process's figure)")
    t.add_row("layout", f"{r.get('layout', 'one slot')}")
    n = r.get("parallel", 1)
    each = f" ({n} requests at once)" if n > 1 else ""
    t.add_row("decode", f"{r['tokens_evaluated']} prompt + {r['tokens_predicted']} generated tokens{each}, ctx {r['n_ctx']}")
    st = r.get("server_timings") or {}
    if st and n == 1:
        t.add_row("speed", f"prefill {st.get('prompt_per_second', 0):.0f} tok/s, decode {st.get('predicted_per_second', 0):.1f} tok/s")
    t.add_row("plan", esc(describe_plan(r.get("plan"))))
    console.print(t)
