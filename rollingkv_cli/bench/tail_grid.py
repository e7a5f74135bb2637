"""`bench tail`'s grid: its configuration and every cell it runs (window, hybrid, head and vanilla -ngl cells per depth),
each a llama-bench command line. No I/O: tail.py runs the cells, tail_report.py shows the report.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from rollingkv_cli.bench import arithmetic as bm
from rollingkv_cli.kvtypes import TAIL_AUTO  # not a type: the planner's choice
from rollingkv_cli.lib.residency import ResidencyRequest

DEFAULT_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_MIXED_FRACTIONS = (0.5,)
DEFAULT_TAIL_TYPES = ("f16", "q8_0", "q4_0")
# the hybrid cells' CPU part (--kv-tail-cpu-frac): auto by default, the library's default (what users get); the window cells
# are the GPU-only ones (0)
DEFAULT_CPU_FRACS: tuple = ("auto",)
LINK_PLACEHOLDER = "MEASURED"  # in an auto cell's args (hybrid, tail type) until the run knows the link bandwidth the plan is given
AUTO_CANDIDATES = ("q8_0", "q4_0")  # what auto may choose under a float window
DEFAULT_RING_SLOTS, DEFAULT_RING_SLOT_MIB = 3, 32  # the CUDA op's defaults (ggml-rolling-kv-impl.h: ROLLINGKV_SLOTS x ROLLINGKV_SLOT_MIB)


def default_ring_bytes() -> int:
    """The CUDA op's slot ring: ROLLINGKV_SLOTS x ROLLINGKV_SLOT_MIB when set, else 3 x 32 MiB."""
    from rollingkv_cli.userinput import native_knob

    # the CUDA op reads the same variables: a value it would not take is refused (userinput.NATIVE_KNOBS), not guessed around
    slots = native_knob("ROLLINGKV_SLOTS", DEFAULT_RING_SLOTS)
    slot_mib = native_knob("ROLLINGKV_SLOT_MIB", DEFAULT_RING_SLOT_MIB)
    return slots * slot_mib << 20


@dataclass
class TailConfig:
    model: Path
    bench: Path  # our llama-bench
    build_dir: Path
    backend: str  # "CUDA" | "CPU"
    depths: list[int]
    n_gen: int = 32
    reps: int = 3
    vanilla_reps: int = 3
    tail_types: list[str] = field(default_factory=lambda: list(DEFAULT_TAIL_TYPES))
    fractions: list[float] = field(default_factory=lambda: list(DEFAULT_FRACTIONS))
    mixed_fractions: list[float] = field(default_factory=lambda: list(DEFAULT_MIXED_FRACTIONS))
    cpu_fracs: list = field(default_factory=lambda: list(DEFAULT_CPU_FRACS))  # "auto" or 0 < F <= 1; [] = no hybrid cells
    head_fractions: list[float] = field(default_factory=list)  # the head split's cells (share of the KV heads in host memory)
    # the build has the hybrid tail: the window cells then pass --kv-tail-cpu-frac 0 (GPU only). Its default is 0 now,
    # but builds of the series before that default changed took auto: the explicit 0 keeps them GPU-only too
    hybrid_build: bool = False
    window_type: str = "f16"
    threads: int | None = None
    ring_bytes: int = DEFAULT_RING_SLOTS * DEFAULT_RING_SLOT_MIB << 20
    skip: tuple[str, ...] = ()  # auto | nkvo | ngl
    vanilla_bench: Path | None = None  # an unpatched llama-bench; None: ours with --kv-residency-mode off
    cell_timeout: float | None = None
    time_budget: float | None = None
    pcie_bw_gbps: float | None = None  # explicit: used instead of measuring
    gpu: int = 0
    out: Path = Path("bench-tail.json")
    plot: bool = True
    preset: str | None = None  # --preset: named in the estimate line only (the report keeps the values it set)

    def to_json(self) -> dict:
        return {
            "depths": self.depths, "n_gen": self.n_gen, "reps": self.reps, "vanilla_reps": self.vanilla_reps,
            "tail_types": self.tail_types, "fractions": self.fractions, "mixed_fractions": self.mixed_fractions,
            "cpu_fracs": self.cpu_fracs, "head_fractions": self.head_fractions,
            "window_type": self.window_type, "threads": self.threads, "slot_ring_bytes": self.ring_bytes,
            "skip": list(self.skip), "cell_timeout_s": self.cell_timeout, "time_budget_s": self.time_budget,
            "pcie_bw_gbps_explicit": self.pcie_bw_gbps, "gpu": self.gpu,
        }


# ------------------------------------------------------------------------------------------ the grid


def _pct(f: float) -> str:
    return f"{f * 100:.0f}%"


def _cpu_arg(frac) -> str:
    return "auto" if frac == "auto" else f"{frac:g}"


def _cpu_label(frac) -> str:
    return "auto" if frac == "auto" else _pct(frac)


def depth_plan(cfg: TailConfig, model, depth: int) -> dict:
    """kv_size, the 50%-tail window's VRAM budget and the vanilla -ngl that fits it, at one depth."""
    kv = bm.kv_size(depth, cfg.n_gen)
    w_half = bm.window_for_fraction(0.5, depth, cfg.n_gen)
    shape = model.kv
    wt = cfg.window_type
    budget = bm.window_budget(model.weights, w_half, shape.row_bytes(wt, wt), cfg.ring_bytes)
    kv_layer = [b * kv for b in shape.layer_row_bytes(wt, wt)]
    n, dev = bm.choose_ngl(model.weights, kv_layer, budget["total_bytes"])
    n_kv_mean = sum(bm.n_kv_at(p, kv) for p in range(depth, depth + cfg.n_gen)) / cfg.n_gen
    return {
        "kv_size": kv, "n_kv_decode_mean": n_kv_mean, "window_cells_50pct": w_half,
        "budget": budget,
        "ngl": {"n_gpu_layers": n, "device_bytes": dev, "kv_bytes_per_layer": kv_layer,
                "all_fit": n > model.n_layer,
                "rule": "the largest -ngl whose last-n blocks + their KV at kv_size (+ the output layer when n > n_layer) fit the budget"},
    }


def build_cells(cfg: TailConfig, model, plans: dict[int, dict]) -> list[dict]:
    """Every cell of the run, in the order they run: per depth the baseline and the cells the targets need
    first, then the rest of the fractions, then the slow vanilla cells (-ngl, then -nkvo last)."""
    wt = cfg.window_type
    cells: list[dict] = []
    base = ["-fa", "1", "-p", "0", "-n", str(cfg.n_gen), "-o", "json", "--progress", "-ctk", wt, "-ctv", wt]
    if cfg.threads:
        base += ["-t", str(cfg.threads)]
    vanilla_bin = cfg.vanilla_bench or cfg.bench
    off = [] if cfg.vanilla_bench else ["--kv-residency-mode", "off"]

    for depth in cfg.depths:
        plan = plans[depth]
        kv = plan["kv_size"]
        row_all = model.kv.row_bytes(wt, wt)
        n_kv_mean = plan["n_kv_decode_mean"]
        d_cells: list[dict] = []

        def cell(kind: str, label: str, binary: Path, extra: list[str], reps: int, **kw) -> dict:
            args = [str(binary), "-m", str(cfg.model), "-d", str(depth), "-r", str(reps), *base, *extra]
            c = {"id": "", "label": label, "kind": kind, "depth": depth, "n_gen": cfg.n_gen, "reps": reps, "kv_size": kv,
                 "tail_type": None, "fractions": [], "window_cells": None, "tail_fraction": 0.0,
                 "tail_cells_per_token": 0.0, "tail_bytes_per_token": 0.0, "host_kv_bytes_per_token": 0.0,
                 "n_gpu_layers": 99, "binary": "vanilla" if binary == cfg.vanilla_bench else "rollingkv",
                 "args": args, "command": shlex.join(args), "status": "pending"}
            c.update(kw)
            c["id"] = f"d{depth}/{kind}" + (f"/{c['tail_type']}/w{c['window_cells']}" if kind in ("window", "hybrid") else "")
            if kind == "head":
                c["id"] = f"d{depth}/head/{c['tail_type']}/h{c['device_heads']}"
            if kind == "hybrid":
                c["id"] += f"/cpu{_cpu_arg(c['cpu_frac'])}"
            if kind == "vanilla_ngl":
                c["id"] += f"/ngl{c['n_gpu_layers']}"
            return c

        d_cells.append(cell("resident", "resident (off, -ngl 99)", cfg.bench, ["-ngl", "99", "--kv-residency-mode", "off"], cfg.reps))

        window_cells: dict[tuple[str, int], dict] = {}
        for t in cfg.tail_types:
            fracs = cfg.fractions if t == wt else cfg.mixed_fractions
            for f in fracs:
                if t != wt and f == 0.0:
                    continue  # no tail: the window type's 0% cell covers it
                w = bm.window_for_fraction(f, depth, cfg.n_gen)
                key = (t, w)
                if key in window_cells:
                    window_cells[key]["fractions"].append(f)
                    continue
                tcells = bm.tail_cells_per_token(depth, cfg.n_gen, w)
                request = ResidencyRequest(mode="window", window_cells=w, type_k_tail=t, type_v_tail=t,
                                           tail_cpu_frac=0.0 if cfg.hybrid_build else None)  # the window cells: GPU only
                c = cell("window", "", cfg.bench, ["-ngl", "99", *request.server_args(), *_auto_tail_link(cfg, t)], cfg.reps,
                         tail_type=t, fractions=[f], window_cells=w, tail_fraction=bm.tail_fraction(w, depth, cfg.n_gen),
                         tail_cells_per_token=tcells,
                         # auto: the bytes of the type the plan chooses, known once the cell ran (fill_measurement)
                         tail_bytes_per_token=0.0 if t == TAIL_AUTO else tcells * model.kv.row_bytes(t, t))
                if t == TAIL_AUTO:
                    c["command_key"] = c["command"]  # what --resume matches: the link placeholder, not the figure filled in
                window_cells[key] = c
        for c in window_cells.values():
            req = "/".join(_pct(f) for f in c["fractions"])
            c["label"] = f"window {c['tail_type']} {req} tail" + (" (= resident)" if c["window_cells"] >= kv else "")

        def priority(c: dict) -> tuple:
            fr = c["fractions"]
            same = c["tail_type"] == wt
            if same and 0.5 in fr:
                return (0,)
            if same and 1.0 in fr:
                return (1,)
            if c["tail_type"] == "q4_0" and 0.5 in fr:
                return (2,)
            if not same and 0.5 in fr:
                return (3,)
            return (4 if same else 5,)

        ordered = sorted(window_cells.values(), key=priority)  # stable: the given order within a priority
        head = [c for c in ordered if priority(c)[0] <= 3]
        rest = [c for c in ordered if priority(c)[0] > 3]
        d_cells += head
        # the hybrid cells: each window cell with a tail again, part of its tail attended on the CPU; those the issue 16
        # targets read first (CPU part auto, at 50% / 100%), in the window cells' order
        hybrid = []
        for w_cell in ordered:
            if w_cell["window_cells"] >= kv:
                continue  # no tail to split
            for frac in cfg.cpu_fracs:
                extra = ["--kv-tail-cpu-frac", _cpu_arg(frac)]
                link = None
                if frac == "auto":  # the plan's split depends on the link figure it is given: the one the floors use
                    link = f"{cfg.pcie_bw_gbps:g}" if cfg.pcie_bw_gbps is not None else LINK_PLACEHOLDER
                    extra += ["--pcie-bw-gbps", link]
                t, w = w_cell["tail_type"], w_cell["window_cells"]
                # the CPU share after the link: the order --resume matches on (command_key) since the hybrid cells began
                split = ["-ngl", "99", *ResidencyRequest(mode="window", window_cells=w, type_k_tail=t, type_v_tail=t).server_args()]
                if link is None:
                    split += _auto_tail_link(cfg, t)
                h = cell("hybrid", "", cfg.bench, split + extra, cfg.reps,
                         **{k: w_cell[k] for k in ("tail_type", "window_cells", "tail_fraction", "tail_cells_per_token", "tail_bytes_per_token")},
                         fractions=list(w_cell["fractions"]), cpu_frac=frac, cpu_frac_chosen=None,
                         plan_link=None if link is None else {"gbps": cfg.pcie_bw_gbps, "source": "explicit" if cfg.pcie_bw_gbps is not None else "measured"})
                h["label"] = w_cell["label"].replace("window ", "hybrid ", 1) + f", CPU {_cpu_label(frac)}"
                h["command_key"] = h["command"]  # what --resume matches: the link placeholder, not the figure filled in
                hybrid.append(h)
        hybrid.sort(key=lambda c: (c["cpu_frac"] != "auto", priority(c)[0] > 1))
        d_cells += hybrid
        d_cells += head_cells(cfg, model, depth, cell)
        if "auto" not in cfg.skip:
            d_cells.append(cell("auto", "auto (0% tail when it fits)", cfg.bench, ["-ngl", "99", "--kv-residency-mode", "auto"], cfg.reps))
        d_cells += rest
        vkind = "unpatched" if cfg.vanilla_bench else "off"
        if cfg.vanilla_bench:
            d_cells.append(cell("vanilla_resident", "vanilla resident (unpatched, -ngl 99)", vanilla_bin, ["-ngl", "99"], cfg.vanilla_reps))
        if "ngl" not in cfg.skip:
            n = plan["ngl"]["n_gpu_layers"]
            first = model.n_layer - min(n, model.n_layer)
            host_rows = sum(model.kv.layer_row_bytes(wt, wt)[:first])
            d_cells.append(cell("vanilla_ngl", f"vanilla -ngl {n} ({vkind})", vanilla_bin, ["-ngl", str(n), *off], cfg.vanilla_reps,
                                n_gpu_layers=n, host_kv_bytes_per_token=n_kv_mean * host_rows))
        if "nkvo" not in cfg.skip:
            d_cells.append(cell("vanilla_nkvo", f"vanilla -nkvo 1 ({vkind})", vanilla_bin, ["-ngl", "99", "-nkvo", "1", *off], cfg.vanilla_reps,
                                host_kv_bytes_per_token=n_kv_mean * row_all))
        cells += d_cells
    return cells


def _auto_tail_link(cfg: TailConfig, tail_type: str) -> list[str]:
    """An auto tail type's plan weighs the tail's link time against the resident time: give it the link figure the floors
    use (the run's measurement fills LINK_PLACEHOLDER in, bind_link), as for the hybrid auto cells."""
    if tail_type != TAIL_AUTO:
        return []
    return ["--pcie-bw-gbps", f"{cfg.pcie_bw_gbps:g}" if cfg.pcie_bw_gbps is not None else LINK_PLACEHOLDER]


def head_cells(cfg: TailConfig, model, depth: int, cell) -> list[dict]:
    """The head split's cells at a depth: for each tail type and --head-fractions f, N = round((1 - f) x n_head_kv) KV heads of
    every layer on the device (the VRAM of the window cell at f, at full context), the others streamed from host memory for
    every cell. None for a model with a single-KV-head layer (it cannot split by head)."""
    if not cfg.head_fractions or min(model.n_head_kv) < 2:
        return []
    h_max = max(model.n_head_kv)
    total = sum(model.n_head_kv)
    cells, seen = [], {}
    for t in cfg.tail_types:
        for f in cfg.head_fractions:
            n = bm.device_heads_for_fraction(f, h_max)
            if n >= h_max:
                continue  # every head on the device: the resident cell
            if (t, n) in seen:
                seen[(t, n)]["fractions"].append(f)  # another fraction that rounds to the same heads: one cell for both
                continue
            host = sum(h - min(n, h) for h in model.n_head_kv)
            c = cell("head", f"head {t} {_pct(host / total)} tail ({n} of {h_max} KV heads on the device)", cfg.bench,
                     ["-ngl", "99", *ResidencyRequest(mode="head", device_heads=n, type_k_tail=t, type_v_tail=t,
                                                      tail_cpu_frac=0.0 if cfg.hybrid_build else None).server_args(),
                      *_auto_tail_link(cfg, t)],
                     cfg.reps, tail_type=t, fractions=[f], device_heads=n, tail_fraction=host / total,
                     tail_bytes_per_token=0.0 if t == TAIL_AUTO else  # auto: the chosen type's, once the cell ran
                     bm.head_tail_bytes_per_token(model.n_head_kv, n, model.head_dim_k, model.head_dim_v, depth, cfg.n_gen, t, t))
            if t == TAIL_AUTO:
                c["command_key"] = c["command"]
            seen[(t, n)] = c
            cells.append(c)
    return cells

