"""How long a bench run may take on a CPU build, said before it starts (issue 39: the tour's heavy steps ran for hours on a
CPU host without a word). Arithmetic from the model's shape, not a measurement: the matrix products of a prefill, its
attention (quadratic in the tokens), and a decode step's weight bytes and attention at its depth, at per-thread rates
measured with llama-bench on the CPU build (a 2-core Xeon with AMX, SmolLM2-135M Q4_1 and a synthetic f16 model,
1 and 2 threads, depths 512 to 4096), scaled by the thread count. Good to a factor of about two there; a CPU without
AMX or AVX-512 is slower, so the line says it is rough. No estimate on a GPU build (its prefill is another world)."""

from __future__ import annotations

import os
from dataclasses import dataclass

# per CPU thread (llama-bench -t 1 on the build's host; 2 threads were 1.9x faster)
MATMUL_FLOPS = 250e9  # a prefill's matrix products (2 x params flops a token)
PREFILL_ATTN_FLOPS = 38e9  # a prefill's flash attention (2 x heads x head_dim x tokens^2 a layer)
DECODE_ATTN_FLOPS = 3e9  # a decode step's attention (4 x heads x head_dim x depth a layer): one query, slow on a CPU
DECODE_WEIGHT_BYTES = 11e9  # a decode step reads every weight once
LOAD_BYTES = 2e9  # mapping the GGUF (from the page cache; a cold disk is slower)
QUANT_KV_PREFILL = 8  # a prefill's attention over a quantized cache (q8_0/q4_0 tail): 8 x slower (2048 cells, q8_0 half)
FLOAT_TYPES = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model (bench.gguf.ModelInfo has it)."""

    matmul_params: int
    weight_bytes: int  # read once per decode step
    file_bytes: int
    attn_layers: int
    n_head: int
    head_dim: int

    @classmethod
    def of(cls, info) -> Shape:
        return cls(matmul_params=info.matmul_params, weight_bytes=info.weights.device_bytes_all, file_bytes=info.file_bytes,
                   attn_layers=sum(1 for h in info.n_head_kv if h > 0), n_head=info.n_head, head_dim=info.head_dim_k)


def default_threads() -> int:
    """llama.cpp's default thread count, near enough: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def server_threads(server_args: list[str]) -> int | None:
    """-t/--threads N among llama-server's arguments (None: its default)."""
    for i, a in enumerate(server_args):
        for flag in ("-t", "--threads"):
            if a == flag and i + 1 < len(server_args):
                try:
                    return max(1, int(server_args[i + 1]))
                except ValueError:
                    return None
            if a.startswith(flag + "="):
                try:
                    return max(1, int(a.split("=", 1)[1]))
                except ValueError:
                    return None
    return None


def prefill_s(shape: Shape, tokens: int, threads: int, quantized_kv: bool = False) -> float:
    mm = 2.0 * shape.matmul_params * tokens / MATMUL_FLOPS
    attn = 2.0 * shape.n_head * shape.head_dim * float(tokens) ** 2 * shape.attn_layers / PREFILL_ATTN_FLOPS
    return (mm + attn * (QUANT_KV_PREFILL if quantized_kv else 1)) / threads


def decode_s(shape: Shape, depth: int, tokens: int, threads: int) -> float:
    """`tokens` decode steps starting at `depth` cells of context."""
    mid = depth + tokens / 2
    step = shape.weight_bytes / DECODE_WEIGHT_BYTES + 4.0 * shape.n_head * shape.head_dim * mid * shape.attn_layers / DECODE_ATTN_FLOPS
    return tokens * step / threads


def load_s(shape: Shape) -> float:
    return shape.file_bytes / LOAD_BYTES


def bench_tail_s(shape: Shape, cells: list[dict], n_gen: int, reps: int, vanilla_reps: int, threads: int,
                 window_type: str = "f16") -> float:
    """llama-bench per cell: the model loaded, one warm-up token, the depth filled once (its state is reused across
    the repetitions), then reps x n_gen decoded tokens."""
    total = 0.0
    for c in cells:
        r = vanilla_reps if str(c.get("kind", "")).startswith("vanilla") else reps
        d = int(c["depth"])
        quant = window_type not in FLOAT_TYPES or c.get("tail_type") not in (None, "auto", *FLOAT_TYPES)
        total += load_s(shape) + prefill_s(shape, d, threads, quant) + decode_s(shape, d, r * n_gen + 1, threads)
    return total


def bench_load_s(shape: Shape, requests: list[tuple[int, int]], n_cells: int, threads: int,
                 last_arrival_s: float = 0.0) -> float:
    """Every request's prompt and generated tokens, one after another (on a CPU concurrent requests share the same
    cores), for each cell's server: requests as (prompt, gen); no less than the last request's arrival (a random mix
    with `--arrival-mean 600` was "about 35 s" for an hour of waiting)."""
    work = sum(prefill_s(shape, p, threads) + decode_s(shape, p, g, threads) for p, g in requests)
    return (load_s(shape) + max(work, last_arrival_s)) * n_cells


def duration(seconds: float) -> str:
    """'about 40 s', 'about 12 min', 'about 3 h' (two figures at most: it is rough)."""
    if seconds < 90:
        return f"about {max(5, round(seconds / 5) * 5):.0f} s"
    if seconds < 90 * 60:
        return f"about {round(seconds / 60):.0f} min"
    h = seconds / 3600
    return f"about {h:.1f} h" if h < 10 else f"about {h:.0f} h"


LONG_S = 10 * 60  # a CPU estimate past this names the small preset


def _how_long(seconds: float, backend: str, threads: int, preset: str | None) -> str:
    if backend != "CPU":
        return f"no time estimate on a {backend} build"
    line = f"{duration(seconds)} on this CPU at {threads} thread{'s' if threads != 1 else ''} (rough, from the model's shape)"
    if seconds > LONG_S and not preset:
        line += "; --preset cpu-small runs a small grid in minutes"
    return line


def tail_line(info, cells: list[dict], *, n_gen: int, reps: int, vanilla_reps: int, threads: int | None, backend: str,
              preset: str | None, window_type: str = "f16") -> str:
    """bench tail's one line before its cells run: what each does, and how long they may take here."""
    threads = threads or default_threads()
    shape = Shape.of(info)
    depths = sorted({int(c["depth"]) for c in cells})
    s = bench_tail_s(shape, cells, n_gen, reps, vanilla_reps, threads, window_type)
    reps_s = f"{reps}" if reps == vanilla_reps or not any(str(c.get("kind", "")).startswith("vanilla") for c in cells) \
        else f"{reps} (vanilla {vanilla_reps})"
    return (f"{len(cells)} cell{'s' if len(cells) != 1 else ''}, each a llama-bench that fills {', '.join(map(str, depths))} "
            f"tokens of context and decodes {reps_s} x {n_gen}: {_how_long(s, backend, threads, preset)}")


def load_line(info, requests: list[tuple[int, int]], n_cells: int, *, threads: int | None, backend: str,
              preset: str | None, last_arrival_s: float = 0.0) -> str:
    """bench load's one line before its first server starts."""
    threads = threads or default_threads()
    s = bench_load_s(Shape.of(info), requests, n_cells, threads, last_arrival_s)
    prompt, gen = sum(p for p, _ in requests), sum(g for _, g in requests)
    return (f"{n_cells} server{'s' if n_cells != 1 else ''}, each {len(requests)} requests of {prompt} prompt and {gen} "
            f"generated tokens in all (the longest prompt {max((p for p, _ in requests), default=0)}): "
            f"{_how_long(s, backend, threads, preset)}")
