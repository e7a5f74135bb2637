"""The arithmetic of `rollingkv bench tail`, with no I/O: windows from tail fractions, tail bytes per
token, the PCIe floors, the VRAM budget of a window run and the largest vanilla `-ngl` that fits it,
and the targets of issue 4 evaluated on measured cells.

Conventions (from the pinned llama.cpp and our patches):

* llama-bench asks for a context of depth + n_gen tokens; the context pads it to a multiple of 256,
  so kv_size = pad256(depth + n_gen).
* While decoding the token at position p the cache attends over n_kv = min(kv_size, max(256,
  pad256(p + 1))) cells (llama_kv_cache::get_n_kv); a split layer reads the tail cells [wc, n_kv),
  so each decoded token streams max(0, n_kv - wc) tail cells per layer.
* A window must be a multiple of 256 cells (n_kv steps; the CUDA VEC kernel needs parts of a multiple
  of 256 cells). `--kv-window-cells 0` means "the planner decides" in the patched llama-bench, so the
  smallest explicit window, and the 100% tail, is 256 cells. A window >= kv_size is the resident cache.
* A tail fraction f is a share of the depth + n_gen cells in use: W = (1 - f) x (depth + n_gen) rounded
  to the nearest multiple of 256, at least 256; f = 0 is the whole cache (W = kv_size).
* The split window holds wc + 1 rows per layer (a trash row), the tail kv_size - wc + 1.
* With `-ngl n` (n <= n_layer) llama.cpp offloads the last n repeating layers and their KV; the output
  layer only when n > n_layer; token_embd always stays in host memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KV_PAD = 256
MIN_WINDOW = 256

# ggml (block elements, block bytes) of the K/V cache types the split accepts (llama_rkv_tail_type_ok)
TYPE_BLOCK = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
}
CACHE_TYPES = tuple(TYPE_BLOCK)
from rollingkv_cli.kvtypes import TAIL_TYPES as _TAIL_TYPES  # noqa: E402

assert set(CACHE_TYPES) == set(_TAIL_TYPES), "TYPE_BLOCK covers exactly the library's tail types (kvtypes.TAIL_TYPES)"


def pad(n: int, to: int = KV_PAD) -> int:
    return -(-n // to) * to


def row_bytes(type_name: str, n_elements: int) -> int:
    """Bytes of one cache row of n_elements at a ggml type; ValueError when the row is not whole blocks."""
    if type_name not in TYPE_BLOCK:
        raise ValueError(f"unknown cache type {type_name!r} (known: {', '.join(CACHE_TYPES)})")
    blk, size = TYPE_BLOCK[type_name]
    if n_elements % blk:
        raise ValueError(f"a row of {n_elements} elements is not a whole number of {type_name} blocks of {blk}")
    return n_elements // blk * size


@dataclass(frozen=True)
class KVShape:
    """The K and V row widths (elements) of every layer whose cache splits."""

    k_elements: tuple[int, ...]
    v_elements: tuple[int, ...]

    @property
    def n_layer(self) -> int:
        return len(self.k_elements)

    def layer_row_bytes(self, type_k: str, type_v: str) -> list[int]:
        """Per layer: bytes of one cell's K row + V row."""
        return [row_bytes(type_k, k) + row_bytes(type_v, v) for k, v in zip(self.k_elements, self.v_elements)]

    def row_bytes(self, type_k: str, type_v: str) -> int:
        """Bytes of one cell across all layers (K + V): the KV bytes per token."""
        return sum(self.layer_row_bytes(type_k, type_v))


def kv_size(depth: int, n_gen: int) -> int:
    return pad(depth + n_gen)


def window_for_fraction(fraction: float, depth: int, n_gen: int) -> int:
    """The window (cells) that leaves about `fraction` of the depth + n_gen cells in use in the tail:
    (1 - fraction) x (depth + n_gen) rounded to the nearest multiple of 256, at least 256; fraction 0 is
    the whole cache (kv_size: resident)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"tail fraction {fraction} is outside [0, 1]")
    kv = kv_size(depth, n_gen)
    if fraction == 0.0:
        return kv
    w = int(math.floor((1.0 - fraction) * (depth + n_gen) / KV_PAD + 0.5)) * KV_PAD
    return min(max(w, MIN_WINDOW), kv)


def tail_fraction(window: int, depth: int, n_gen: int) -> float:
    """The share of the depth + n_gen cells in use that lie in the tail [window, ...)."""
    used = depth + n_gen
    return min(1.0, max(0.0, (used - window) / used)) if used > 0 else 0.0


def n_kv_at(pos: int, kv: int) -> int:
    """Cells attended while decoding the token at position pos."""
    return min(kv, max(KV_PAD, pad(pos + 1)))


def tail_cells_per_token(depth: int, n_gen: int, window: int | None) -> float:
    """Mean tail cells read per decoded token over the n_gen tokens after depth (0 when not split)."""
    kv = kv_size(depth, n_gen)
    if not window or window >= kv or n_gen <= 0:
        return 0.0
    return sum(max(0, n_kv_at(p, kv) - window) for p in range(depth, depth + n_gen)) / n_gen


def tail_bytes_per_token(shape: KVShape, depth: int, n_gen: int, window: int | None, type_k_tail: str, type_v_tail: str) -> float:
    """Bytes streamed from the host tail per decoded token: tail cells x (K+V row bytes at the tail types), summed over layers."""
    return tail_cells_per_token(depth, n_gen, window) * shape.row_bytes(type_k_tail, type_v_tail)


def device_heads_for_fraction(fraction: float, n_head_kv: int) -> int:
    """The head split's KV heads per layer on the device for a tail fraction: round((1 - fraction) x n_head_kv), at least 1
    (the head split keeps one head of every layer on the device)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"tail fraction {fraction} is outside [0, 1]")
    return max(1, int(math.floor((1.0 - fraction) * n_head_kv + 0.5)))


def head_tail_bytes_per_token(n_head_kv: list[int], device_heads: int, head_dim_k: int, head_dim_v: int, depth: int, n_gen: int,
                              type_k_tail: str, type_v_tail: str) -> float:
    """Bytes a head split streams per decoded token: its host heads (n_head_kv - min(device_heads, n_head_kv) per layer) of
    every attended cell (n_kv, from the first token on) at the tail types."""
    kv = kv_size(depth, n_gen)
    n_kv_mean = sum(n_kv_at(p, kv) for p in range(depth, depth + n_gen)) / n_gen if n_gen > 0 else 0.0
    host = sum(h - min(device_heads, h) for h in n_head_kv)
    return n_kv_mean * host * (row_bytes(type_k_tail, head_dim_k) + row_bytes(type_v_tail, head_dim_v))


def floors(t_resident_s: float, tail_bytes: float, bandwidth_bytes_per_s: float) -> tuple[float, float]:
    """(serialized, overlapped) floor on the time per token: t_res + bytes/bw, and max(t_res, bytes/bw)."""
    if t_resident_s <= 0 or bandwidth_bytes_per_s <= 0:
        raise ValueError("floors need a positive resident time and bandwidth")
    t_link = tail_bytes / bandwidth_bytes_per_s
    return t_resident_s + t_link, max(t_resident_s, t_link)


def hybrid_floors(t_resident_s: float, tail_bytes: float, link_bytes_per_s: float, cpu_bytes_per_s: float) -> tuple[float, float]:
    """(serialized, overlapped) floor when the CPU attends part of the tail while the rest streams (the hybrid tail):
    the tail leaves host memory at link + CPU attention bandwidth together, t_res + bytes/(link + cpu) and
    max(t_res, bytes/(link + cpu)); the best split puts cpu/(link + cpu) of the bytes on the CPU (cpu_share)."""
    if cpu_bytes_per_s <= 0 or link_bytes_per_s <= 0:
        raise ValueError("hybrid floors need a positive link and CPU attention bandwidth")
    return floors(t_resident_s, tail_bytes, link_bytes_per_s + cpu_bytes_per_s)


def hybrid_dependent_floor(t_resident_s: float, tail_bytes: float, link_bytes_per_s: float, cpu_bytes_per_s: float) -> tuple[float, float]:
    """(floor, share) of a single sequence's decode when the CPU attends a share f of the tail: its part waits for its
    layer's query, so the CPU's attention adds to the resident work while the link's copies run ahead across layers,
    min over f of max(t_res + f x bytes/cpu, (1 - f) x bytes/link). The overlapped hybrid floor assumes the CPU part
    overlaps the resident work too, which the query's dependency forbids (docs/design/hybrid-tail.md)."""
    if cpu_bytes_per_s <= 0 or link_bytes_per_s <= 0:
        raise ValueError("hybrid floors need a positive link and CPU attention bandwidth")
    t_link, t_cpu = tail_bytes / link_bytes_per_s, tail_bytes / cpu_bytes_per_s
    if t_link <= t_resident_s:
        return t_resident_s, 0.0
    f = (t_link - t_resident_s) / (t_cpu + t_link)
    return t_resident_s + f * t_cpu, f


def cpu_share(link_gbps: float, cpu_gbps: float) -> float:
    """The share of the tail bytes on the CPU that makes both parts end together: cpu / (cpu + link) (the planner's
    starting point, before its per-layer latency and 256-cell rounding; docs/design/hybrid-tail.md)."""
    if link_gbps <= 0 or cpu_gbps <= 0:
        raise ValueError("the split needs a positive link and CPU attention bandwidth")
    return cpu_gbps / (cpu_gbps + link_gbps)


# ---------------------------------------------------------------------------------- VRAM and -ngl


@dataclass(frozen=True)
class WeightSplit:
    """Weight bytes by where llama.cpp puts them: repeating blocks (by layer), the output layer, the input embedding."""

    block_bytes: tuple[int, ...]
    output_bytes: int  # everything -ngl > n_layer adds to the device (output norm + output, or the tied embedding copy)
    input_bytes: int  # token_embd: host memory whatever -ngl

    @property
    def device_bytes_all(self) -> int:
        """What -ngl 99 puts on the device."""
        return sum(self.block_bytes) + self.output_bytes


def window_budget(weights: WeightSplit, window_cells: int, window_row_bytes: int, ring_bytes: int) -> dict:
    """The device memory of a window run: all weights (-ngl 99), the window KV (wc + 1 rows), the slot ring."""
    window_kv = (window_cells + 1) * window_row_bytes
    return {
        "weights_bytes": weights.device_bytes_all,
        "window_kv_bytes": window_kv,
        "slot_ring_bytes": ring_bytes,
        "total_bytes": weights.device_bytes_all + window_kv + ring_bytes,
    }


def vanilla_device_bytes(n_gpu_layers: int, weights: WeightSplit, kv_layer_bytes: list[int]) -> int:
    """Device bytes of vanilla llama.cpp with -ngl n: the last n blocks and their KV (+ the output layer when n > n_layer)."""
    n_layer = len(weights.block_bytes)
    if len(kv_layer_bytes) != n_layer:
        raise ValueError(f"{len(kv_layer_bytes)} KV layer sizes for {n_layer} layers")
    n = max(0, min(n_gpu_layers, n_layer + 1))
    first = n_layer - min(n, n_layer)
    total = sum(weights.block_bytes[first:]) + sum(kv_layer_bytes[first:])
    if n > n_layer:
        total += weights.output_bytes
    return total


def choose_ngl(weights: WeightSplit, kv_layer_bytes: list[int], budget_bytes: int) -> tuple[int, int]:
    """(n, device bytes): the largest -ngl (0 .. n_layer + 1) whose weights + KV fit budget_bytes."""
    best = (0, 0)
    for n in range(0, len(weights.block_bytes) + 2):
        b = vanilla_device_bytes(n, weights, kv_layer_bytes)
        if b <= budget_bytes:
            best = (n, b)
        else:
            break  # monotonic in n
    return best


# ------------------------------------------------------------------------------------------ targets

# The speed targets of issue 4. `depth`: the depth the issue states it at (evaluated at other depths too,
# reported but not judged).
TARGETS = {
    "floor": dict(op="<=", threshold=1.10, what="measured time per token / (t_resident + tail_bytes / bandwidth), worst window cell with a tail"),
    "stretch": dict(op="<=", threshold=1.15, what="measured time per token / max(t_resident, tail_bytes / bandwidth), worst window cell with a tail"),
    "vs_ngl": dict(op=">=", threshold=2.5, what="tokens/s of the 50%-tail cell / vanilla at the largest -ngl that fits the same VRAM"),
    "vs_nkvo": dict(op=">=", threshold=5.0, depth=16384, what="tokens/s of the 100%-tail cell / vanilla -nkvo 1 (KV in host memory, attention on the CPU)"),
    "auto_vs_vanilla": dict(op=">=", threshold=0.98, what="tokens/s of auto with 0% tail / vanilla fully resident (at most 2% slower)"),
    "q4_0_bytes": dict(op="<=", threshold=0.30, what="tail bytes per token of a q4_0 tail / the window-type tail, at 50%"),
    "q4_0_faster": dict(op=">", threshold=1.0, what="tokens/s of a q4_0 tail / the window-type tail, at 50%"),
    # issue 16 (the hybrid tail), from the hybrid cells with the CPU part at auto
    "hybrid_full_vs_floor": dict(op="<=", threshold=0.55, depths=(16384, 65536),
                                 what="time per token of the hybrid auto cell at the 100% tail / the link-only serial floor t_res + tail_bytes / link"),
    "hybrid_vs_ngl": dict(op=">=", threshold=3.0, depth=16384,
                          what="tokens/s of the hybrid auto cell at the 50% tail / vanilla at the largest -ngl that fits the same VRAM"),
    "hybrid_vs_ngl_65536": dict(op=">=", threshold=5.0, depth=65536,
                                what="tokens/s of the hybrid auto cell at the 50% tail / vanilla at the largest -ngl that fits the same VRAM"),
    "hybrid_q8_0_gains": dict(op=">", threshold=1.0, what="tokens/s of the hybrid auto cell with a q8_0 tail / the same tail GPU-only, at 50%"),
    "hybrid_q4_0_gains": dict(op=">", threshold=1.0, what="tokens/s of the hybrid auto cell with a q4_0 tail / the same tail GPU-only, at 50%"),
}


def judge(value: float | None, op: str, threshold: float) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    ok = {"<=": value <= threshold, ">=": value >= threshold, ">": value > threshold, "<": value < threshold}[op]
    return "met" if ok else "not met"


def _ok(cell: dict | None) -> bool:
    return bool(cell) and cell.get("status") == "ok" and (cell.get("tokens_per_s") or 0) > 0


def evaluate_targets(cells: list[dict], depths: list[int], window_type: str, bandwidth_gbps: float | None) -> list[dict]:
    """One entry per (target, depth): value, threshold, status (met / not met / n/a) and why.

    Cells are the JSON cells of a run (see tail.py): kind, depth, tail_type, fractions, status,
    tokens_per_s, tail_bytes_per_token, ratio_floor, ratio_stretch."""
    out = []

    def add(key: str, depth: int, value: float | None, detail: str, why_na: str | None = None) -> None:
        t = TARGETS[key]
        status = judge(value, t["op"], t["threshold"]) if why_na is None else "n/a"
        if status == "n/a" and why_na is None:
            why_na = "a cell it needs is missing or failed"
        entry = {"target": key, "depth": depth, "what": t["what"], "op": t["op"], "threshold": t["threshold"],
                 "value": None if value is None else round(value, 4), "status": status, "detail": detail}
        at_depths = t.get("depths") or ((t["depth"],) if t.get("depth") is not None else None)
        if at_depths is not None and depth not in at_depths and status != "n/a":
            entry["status"] = "info"
            why_na = f"the issue states this target at depth {' and '.join(map(str, at_depths))}; reported, not judged"
        if why_na:
            entry["note"] = why_na
        out.append(entry)

    for d in depths:
        at = [c for c in cells if c.get("depth") == d]

        def find(kind: str, tail_type: str | None = None, fraction: float | None = None, cpu_frac=None) -> dict | None:
            for c in at:
                if c.get("kind") != kind:
                    continue
                if cpu_frac is not None and c.get("cpu_frac") != cpu_frac:
                    continue
                if tail_type is not None and c.get("tail_type") != tail_type:
                    continue
                if fraction is not None and not any(abs(f - fraction) < 1e-9 for f in c.get("fractions", [])):
                    continue
                return c
            return None

        # floors
        tailed = [c for c in at if c.get("kind") == "window" and _ok(c) and (c.get("tail_bytes_per_token") or 0) > 0]
        for key, field in (("floor", "ratio_floor"), ("stretch", "ratio_stretch")):
            if bandwidth_gbps is None:
                add(key, d, None, "", "no host-to-device bandwidth (no GPU link): floors skipped")
                continue
            rated = [c for c in tailed if c.get(field) is not None]
            if not rated:
                add(key, d, None, "", "no measured window cell with a tail and a resident baseline")
                continue
            worst = max(rated, key=lambda c: c[field])
            n_ok = sum(1 for c in rated if judge(c[field], TARGETS[key]["op"], TARGETS[key]["threshold"]) == "met")
            add(key, d, worst[field], f"worst {worst['label']}; {n_ok} of {len(rated)} cells within")

        half = find("window", window_type, 0.5)
        full = find("window", window_type, 1.0)
        ngl = find("vanilla_ngl")
        nkvo = find("vanilla_nkvo")
        auto = find("auto")
        vanilla_res = find("vanilla_resident") or find("resident")
        q4 = find("window", "q4_0", 0.5)

        def speed_ratio(key: str, a: dict | None, b: dict | None, what_b=lambda c: "") -> None:
            """Target `key` = tokens/s of cell a over cell b (no value when either did not run)."""
            if _ok(a) and _ok(b):
                add(key, d, a["tokens_per_s"] / b["tokens_per_s"], f"{a['tokens_per_s']:.3g} vs {b['tokens_per_s']:.3g} tok/s{what_b(b)}")
            else:
                add(key, d, None, "")

        speed_ratio("vs_ngl", half, ngl, lambda c: f" (-ngl {c.get('n_gpu_layers')})")
        speed_ratio("vs_nkvo", full, nkvo)
        speed_ratio("auto_vs_vanilla", auto, vanilla_res, lambda c: f" ({c['label']})")
        if window_type == "q4_0":
            add("q4_0_bytes", d, None, "", "the window type is q4_0 already")
            add("q4_0_faster", d, None, "", "the window type is q4_0 already")
        else:
            if q4 and half and (half.get("tail_bytes_per_token") or 0) > 0 and q4.get("tail_bytes_per_token") is not None:
                add("q4_0_bytes", d, q4["tail_bytes_per_token"] / half["tail_bytes_per_token"],
                    f"{q4['tail_bytes_per_token'] / 1e6:.3g} vs {half['tail_bytes_per_token'] / 1e6:.3g} MB/token")
            else:
                add("q4_0_bytes", d, None, "")
            speed_ratio("q4_0_faster", q4, half)

        # issue 16: the hybrid cells, CPU part at auto
        hyb = [c for c in at if c.get("kind") == "hybrid"]
        none = "no hybrid cell (CUDA build, --cpu-fracs with auto)" if not hyb else None
        h_full = find("hybrid", window_type, 1.0, "auto")
        h_half = find("hybrid", window_type, 0.5, "auto")
        if bandwidth_gbps is None:
            add("hybrid_full_vs_floor", d, None, "", none or "no host-to-device bandwidth: floors skipped")
        elif _ok(h_full) and h_full.get("ratio_floor") is not None:
            add("hybrid_full_vs_floor", d, h_full["ratio_floor"], f"{h_full['label']}: {h_full['ms_per_token']:.3g} ms vs floor "
                f"{h_full['floor_ms']:.3g} ms" if h_full.get("ms_per_token") and h_full.get("floor_ms") else h_full["label"])
        else:
            add("hybrid_full_vs_floor", d, None, "", none)
        for key in ("hybrid_vs_ngl", "hybrid_vs_ngl_65536"):
            if none:
                add(key, d, None, "", none)
            else:
                speed_ratio(key, h_half, ngl, lambda c: f" (-ngl {c.get('n_gpu_layers')})")
        for t_name in ("q8_0", "q4_0"):
            key = f"hybrid_{t_name}_gains"
            if none:
                add(key, d, None, "", none)
            else:
                speed_ratio(key, find("hybrid", t_name, 0.5, "auto"), find("window", t_name, 0.5))
    return out
