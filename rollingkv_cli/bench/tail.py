"""`rollingkv bench tail`: decode speed of the split KV cache against its PCIe floor and against what
vanilla llama.cpp offers at the same depth, in one run (issue 4, item 5).

One llama-bench process per cell (`-fa 1 -p 0 -n N -d DEPTH -r R -o json`), so that every cell has its own
command line, wall time and timeout, and the JSON report is rewritten after every cell: a run cut short
(a device-call limit, Ctrl-C) leaves every finished cell on disk, and `--resume` runs only what is missing.
No click in here: the command is cli.py; the arithmetic is arithmetic.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from rollingkv_cli.bench import arithmetic as bm
from rollingkv_cli.console import abort, console, esc

SCHEMA = "rollingkv.bench.tail/1"
DEFAULT_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_MIXED_FRACTIONS = (0.5,)
DEFAULT_TAIL_TYPES = ("f16", "q8_0", "q4_0")
# the hybrid cells' CPU part (--kv-tail-cpu-frac): auto by default, the library's default (what users get); the window cells
# are the GPU-only ones (0)
DEFAULT_CPU_FRACS: tuple = ("auto",)
LINK_PLACEHOLDER = "MEASURED"  # in an auto cell's args (hybrid, tail type) until the run knows the link bandwidth the plan is given
TAIL_AUTO = "auto"  # a tail type the planner chooses (kvtypes.TAIL_AUTO)
AUTO_CANDIDATES = ("q8_0", "q4_0")  # what auto may choose under a float window
DEFAULT_RING_SLOTS, DEFAULT_RING_SLOT_MIB = 3, 32  # the CUDA op's defaults (ggml-rolling-kv-impl.h: ROLLINGKV_SLOTS x ROLLINGKV_SLOT_MIB)
STDERR_TAIL = 25


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
                gpu_only = ["--kv-tail-cpu-frac", "0"] if cfg.hybrid_build else []
                c = cell("window", "", cfg.bench,
                         ["-ngl", "99", "--kv-residency-mode", "window", "--kv-window-cells", str(w), "-ctkt", t, "-ctvt", t, *gpu_only,
                          *_auto_tail_link(cfg, t)], cfg.reps,
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
                split = ["-ngl", "99", "--kv-residency-mode", "window", "--kv-window-cells", str(w), "-ctkt", t, "-ctvt", t]
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
    gpu_only = ["--kv-tail-cpu-frac", "0"] if cfg.hybrid_build else []
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
                     ["-ngl", "99", "--kv-residency-mode", "head", "--kv-device-heads", str(n), "-ctkt", t, "-ctvt", t, *gpu_only,
                      *_auto_tail_link(cfg, t)],
                     cfg.reps, tail_type=t, fractions=[f], device_heads=n, tail_fraction=host / total,
                     tail_bytes_per_token=0.0 if t == TAIL_AUTO else  # auto: the chosen type's, once the cell ran
                     bm.head_tail_bytes_per_token(model.n_head_kv, n, model.head_dim_k, model.head_dim_v, depth, cfg.n_gen, t, t))
            if t == TAIL_AUTO:
                c["command_key"] = c["command"]
            seen[(t, n)] = c
            cells.append(c)
    return cells


# ------------------------------------------------------------------------------------ one llama-bench


CPU_PART_STATS_PREFIX = "rolling KV: CPU part:"  # libllama's ROLLINGKV_CPU_PART_STATS lines (at exit, on stderr)


class CellRunner:
    """Runs one llama-bench process; stderr lines feed a callback (progress).

    llama-bench starts no children, so the process stays in our process group: a Ctrl-C or a group kill
    from an outer `timeout` reaches it too, and our own timeout stops just it (terminate, then kill). It is
    tied to us as well (procs.popen_tied): a SIGKILL of ours or a closed terminal takes it down."""

    def __init__(self, on_line=None):
        self.on_line = on_line

    @staticmethod
    def _stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
        from rollingkv_cli.lib.procs import stop_group

        stop_group(proc, grace)  # in our group: just it; a second Ctrl-C while it stops kills it at once

    def run(self, args: list[str], timeout: float | None) -> tuple[int | None, str, list[str], float, bool]:
        """(returncode, stdout, stderr tail, wall seconds, timed out)."""
        t0 = time.monotonic()
        from rollingkv_cli.lib.procs import popen_tied

        # a hybrid cell's CPU parts report their time and bandwidth at exit (a few clock reads per part): where its
        # decode time goes, kept in the report next to the figure
        env = dict(os.environ, ROLLINGKV_CPU_PART_STATS="1")
        proc = popen_tied(args, new_session=False, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                          stdin=subprocess.DEVNULL, env=env)
        tail: deque[str] = deque(maxlen=STDERR_TAIL)
        out_chunks: list[str] = []

        def read_err():
            assert proc.stderr is not None
            for line in proc.stderr:
                tail.append(line.rstrip("\n"))
                if self.on_line is not None:
                    try:
                        self.on_line(line.rstrip("\n"))
                    except Exception:
                        pass

        def read_out():
            assert proc.stdout is not None
            out_chunks.append(proc.stdout.read())

        threads = [threading.Thread(target=read_err, daemon=True), threading.Thread(target=read_out, daemon=True)]
        for t in threads:
            t.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self._stop(proc)
        except BaseException:
            self._stop(proc)
            raise
        for t in threads:
            t.join(timeout=5.0)
        return proc.returncode, "".join(out_chunks), list(tail), time.monotonic() - t0, timed_out


def parse_bench_json(stdout: str, n_gen: int) -> dict:
    """The n_gen row of llama-bench's -o json output; ValueError when there is none."""
    try:
        rows = json.loads(stdout)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench printed no JSON ({e})") from None
    if not isinstance(rows, list):
        raise ValueError("llama-bench's JSON is not a list of tests")
    for r in rows:
        if isinstance(r, dict) and r.get("n_gen") == n_gen and r.get("n_prompt", 0) == 0:
            return r
    raise ValueError(f"llama-bench's JSON has no generation test of {n_gen} tokens")


def fill_measurement(cell: dict, row: dict, model) -> None:
    """Copy the figures of a llama-bench row into the cell; the tail from the plan the bench reports."""
    ts = float(row.get("avg_ts") or 0.0)
    cell["tokens_per_s"] = ts
    cell["stddev_ts"] = float(row.get("stddev_ts") or 0.0)
    cell["samples_ts"] = row.get("samples_ts")
    cell["ms_per_token"] = 1e3 / ts if ts > 0 else None
    cell["bench"] = {k: row.get(k) for k in ("backends", "gpu_info", "cpu_info", "n_threads", "n_gpu_layers", "no_kv_offload",
                                             "type_k", "type_v", "model_size", "test_time", "build_commit")}
    if "kv_mode_chosen" in row:
        cell["plan"] = {k: row.get(k) for k in ("kv_mode", "kv_mode_chosen", "window_cells", "tail_cells", "type_k_tail", "type_v_tail")}
        for k in ("type_k_tail_chosen", "type_v_tail_chosen"):  # the types the plan chose (API 7 builds): auto's choice
            if k in row:
                cell["plan"][k] = row[k]
        for k in ("kv_device_heads", "heads_device", "heads_host"):  # the head split (API 5 builds)
            if k in row:
                cell["plan"][k] = row[k]
        for k in ("kv_tail_cpu_frac", "kv_tail_cpu_frac_chosen"):  # the hybrid tail's (requested; chosen where reported)
            if k in row:
                cell["plan"][k] = row[k]
    if cell["kind"] == "hybrid":
        chosen = (cell.get("plan") or {}).get("kv_tail_cpu_frac_chosen")
        try:
            cell["cpu_frac_chosen"] = None if chosen is None else float(chosen)
        except (TypeError, ValueError):
            cell["cpu_frac_chosen"] = None
    if cell["kind"] == "head":
        plan = cell.get("plan") or {}
        split = plan.get("kv_mode_chosen") == "head"
        if not split:
            cell["note"] = f"asked for {cell['device_heads']} device KV heads per layer, the plan chose {plan.get('kv_mode_chosen')}: no tail"
        t, tv = plan.get("type_k_tail_chosen") or plan.get("type_k_tail"), plan.get("type_v_tail_chosen") or plan.get("type_v_tail")
        if cell.get("tail_type") == TAIL_AUTO:
            cell["tail_type_chosen"] = f"{t}/{tv}" if split else None
        heads = [min(cell["device_heads"], h) for h in model.n_head_kv]
        if split and plan.get("heads_device") is not None and int(plan["heads_device"]) != sum(heads):
            cell["note"] = f"asked for {cell['device_heads']} device KV heads per layer ({sum(heads)} in all), the plan kept {plan['heads_device']}"
        cell["tail_bytes_per_token"] = (bm.head_tail_bytes_per_token(model.n_head_kv, cell["device_heads"], model.head_dim_k, model.head_dim_v,
                                                                     cell["depth"], cell["n_gen"], t, tv)
                                        if split and t in bm.TYPE_BLOCK and tv in bm.TYPE_BLOCK else 0.0)
    if cell["kind"] in ("window", "auto", "hybrid"):
        plan = cell.get("plan") or {}
        w = plan.get("window_cells") or 0
        split = plan.get("kv_mode_chosen") == "window" and w > 0
        fixed = cell["kind"] in ("window", "hybrid")
        if fixed and cell["window_cells"] < cell["kv_size"] and not split:
            cell["note"] = f"asked for a window of {cell['window_cells']} cells, the plan chose {plan.get('kv_mode_chosen')}: no tail"
        if fixed and split and w != cell["window_cells"]:
            cell["note"] = f"asked for a window of {cell['window_cells']} cells, the plan made {w}"
        t = (plan.get("type_k_tail_chosen") or plan.get("type_k_tail")) if split else None
        tv = (plan.get("type_v_tail_chosen") or plan.get("type_v_tail")) if split else None
        if cell.get("tail_type") == TAIL_AUTO:
            cell["tail_type_chosen"] = f"{t}/{tv}" if split else None
            if split and t not in bm.TYPE_BLOCK:
                cell["note"] = "an auto tail type, but this llama-bench does not report the type its plan chose"
        tcells = bm.tail_cells_per_token(cell["depth"], cell["n_gen"], w if split else None)
        cell["tail_cells_per_token"] = tcells
        cell["tail_bytes_per_token"] = tcells * model.kv.row_bytes(t, tv) if split and t in bm.TYPE_BLOCK and tv in bm.TYPE_BLOCK else 0.0
        if split and cell["kind"] == "auto":
            cell["window_cells"] = w


_FLOOR_KEYS = ("t_resident_ms", "floor_ms", "stretch_floor_ms", "ratio_floor", "ratio_stretch",
               "cpu_attn_gbps", "hybrid_serial_floor_ms", "hybrid_floor_ms", "ratio_hybrid_serial", "ratio_hybrid")


def apply_floors(cells: list[dict], gbps: float | None, cpu_gbps: dict | None = None) -> None:
    """Floors and ratios of every measured window/auto/hybrid cell, against the resident cell of its depth: the link
    floors for all of them; the hybrid cells also against the third floor, the tail leaving host memory over the link
    and through the CPU attention together (cpu_gbps: the calibration's GB/s per tail K type, measured in the run)."""
    resident = {c["depth"]: c for c in cells if c["kind"] == "resident" and c.get("status") == "ok" and (c.get("tokens_per_s") or 0) > 0}
    for c in cells:
        for k in _FLOOR_KEYS:
            c.pop(k, None)
        if c["kind"] not in ("window", "auto", "hybrid", "head") or c.get("status") != "ok" or not c.get("tokens_per_s"):
            continue
        r = resident.get(c["depth"])
        if r is None or gbps is None:
            continue
        t_res = 1.0 / r["tokens_per_s"]
        serial, stretch = bm.floors(t_res, c.get("tail_bytes_per_token") or 0.0, gbps * 1e9)
        t = 1.0 / c["tokens_per_s"]
        c["t_resident_ms"] = t_res * 1e3
        c["floor_ms"] = serial * 1e3
        c["stretch_floor_ms"] = stretch * 1e3
        c["ratio_floor"] = t / serial
        c["ratio_stretch"] = t / stretch
        k_type = (c.get("tail_type_chosen") or "").split("/")[0] or c.get("tail_type")  # auto: the K type the plan chose
        cpu = (cpu_gbps or {}).get(k_type) if c["kind"] == "hybrid" else None
        if isinstance(cpu, (int, float)) and cpu > 0:
            h_serial, h_over = bm.hybrid_floors(t_res, c.get("tail_bytes_per_token") or 0.0, gbps * 1e9, cpu * 1e9)
            c["cpu_attn_gbps"] = cpu
            c["hybrid_serial_floor_ms"] = h_serial * 1e3
            c["hybrid_floor_ms"] = h_over * 1e3
            c["ratio_hybrid_serial"] = t / h_serial
            c["ratio_hybrid"] = t / h_over


# ------------------------------------------------------------------------------------------ bandwidth


def measure_bandwidth(gpu_index: int, explicit: float | None) -> dict:
    """Pinned host-to-device GB/s for the floors, measured now (cudart.measure, 256 MiB copies); None without a GPU."""
    from rollingkv_cli.hw import cudart, pcie

    if explicit is not None:
        return {"gbps": float(explicit), "source": "explicit", "note": "given with --pcie-bw-gbps, not measured"}
    try:
        gpus = pcie.discover()
    except pcie.NoGpuError as e:
        return {"gbps": None, "source": None, "note": f"no host-to-GPU link ({e.reason}): bandwidth null, floors skipped"}
    gpu = next((g for g in gpus if g.index == gpu_index), None)
    if gpu is None:
        abort(f"--gpu {gpu_index}: no such GPU", f"NVML sees GPUs {', '.join(str(g.index) for g in gpus)}")
    try:
        with console.status(f"measuring pinned host-to-device copies on GPU {gpu.index} ({esc(gpu.name)})"):
            entry = cudart.measure(gpu)
    except (cudart.CudaUnavailable, cudart.MeasureError) as e:
        res = pcie.resolve_bandwidth(gpu_index, gpus=gpus)
        return {"gbps": res.gbps, "source": f"resolved ({res.tier})", "gpu": pcie.gpu_dict(gpu),
                "note": f"measuring failed ({e}); using {res.gbps:g} GB/s: {res.detail}"}
    gbps = entry["h2d"].get(str(pcie.RESOLVE_SIZE_MIB))
    return {"gbps": gbps, "source": "measured", "gpu": pcie.gpu_dict(gpu), "measurement": entry,
            "note": f"pinned host-to-device, {pcie.RESOLVE_SIZE_MIB} MiB copies, median, measured in this run"}


def measure_cpu_attn(cfg: TailConfig) -> dict:
    """The CPU decode attention's GB/s per tail type of the hybrid cells, measured now at the CPU part's thread count
    (what the cells' llama-bench gives it, whatever -t) by the build's libllama (its calibration, in a child: cpu_attn.py); null with the reason when it cannot be."""
    from rollingkv_cli.hw import cpu_attn

    n = cpu_attn.part_threads()
    # auto: the types it may choose under an f16/bf16/f32 window (the q8_0 floor, q4_0), or the window's own
    asked = [t for tt in cfg.tail_types for t in ((AUTO_CANDIDATES + (cfg.window_type,)) if tt == TAIL_AUTO else (tt,))]
    types = tuple(t for t in dict.fromkeys(asked) if t in cpu_attn.CPU_ATTN_TYPES)
    out = {"gbps": None, "n_threads": n, "threads_source": "the CPU part's (every CPU but one, or $ROLLINGKV_CPU_PART_THREADS; not -t)",
           "types": list(types), "source": None,
           "note": "libllama's calibration (llama_rolling_kv_measure_cpu_attn_gbps: GB/s of K+V read by the CPU decode attention "
                   "over a ~256 MiB tail of each type), in this run; the cells' own plans calibrate again (--cpu-attn-gbps not given)"}
    if not types:
        out["error"] = f"no tail type the CPU part attends ({', '.join(cpu_attn.CPU_ATTN_TYPES)})"
        return out
    try:
        with console.status(f"measuring the CPU decode attention on {n} threads ({', '.join(types)})"):
            r = cpu_attn.measure(cfg.bench.parent, n, types)
    except cpu_attn.Unavailable as e:
        out["error"] = e.message
        return out
    out.update(gbps=r["gbps"], errors=r.get("errors") or {}, seconds=r.get("seconds"), build_info=r.get("build_info"), source="measured")
    return out


def bind_link(doc: dict, gbps: float | None) -> None:
    """Fill the link figure into the pending hybrid auto cells' --pcie-bw-gbps (their plan's split depends on it): the
    bandwidth the floors use, measured in this run unless given; without one the option is left out."""
    for c in doc["cells"]:
        if c.get("status") == "ok" or LINK_PLACEHOLDER not in c.get("args", []):
            continue
        i = c["args"].index(LINK_PLACEHOLDER)
        if gbps is None:
            del c["args"][i - 1:i + 1]
            c["plan_link"] = None
        else:
            c["args"][i] = f"{gbps:.4g}"
            c["plan_link"] = {"gbps": float(f"{gbps:.4g}"), "source": "measured"}
        c["command"] = shlex.join(c["args"])


# ------------------------------------------------------------------------------------------ the report


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        abort(f"cannot write the report {path}: {e.strerror or e}", "give another --json")


def refresh(doc: dict) -> None:
    gbps = doc["bandwidth"].get("gbps")
    cpu = doc.get("cpu_attn") or {}
    apply_floors(doc["cells"], gbps, cpu.get("gbps"))
    if gbps and isinstance(cpu.get("gbps"), dict):  # the design's split, cpu / (cpu + link), per type: what auto starts from
        cpu["expected_auto_frac"] = {t: round(bm.cpu_share(gbps, v), 4) for t, v in cpu["gbps"].items() if isinstance(v, (int, float)) and v > 0}
    doc["targets"] = bm.evaluate_targets(doc["cells"], doc["config"]["depths"], doc["config"]["window_type"], gbps)
    doc["updated_at"] = _now()


def _cpu_cell(c: dict) -> str:
    """The CPU part of a cell: '-' (none), the fraction asked for, 'auto' with the chosen one where the bench reports it."""
    if c["kind"] != "hybrid":
        return "-"
    chosen = c.get("cpu_frac_chosen")
    if c.get("cpu_frac") == "auto":
        return "auto" + (f" {_pct(chosen)}" if isinstance(chosen, (int, float)) else "")
    return _pct(c["cpu_frac"]) if isinstance(c.get("cpu_frac"), (int, float)) else str(c.get("cpu_frac"))


def _mb(b: float | None) -> str:
    return "-" if b is None else f"{b / 1e6:.3g}"


def _num(v: float | None, fmt: str = ".3g") -> str:
    return "-" if v is None else format(v, fmt)


def cell_line(c: dict) -> str:
    """One cell as console markup (its label and error are escaped: stderr lines hold brackets)."""
    if c["status"] == "ok" and c.get("tail_type_chosen"):
        c = dict(c, label=f"{c['label']} (chose {c['tail_type_chosen']})")
    if c["status"] != "ok":
        return f"{esc(str(c['label']))} at d={c['depth']}: [red]{esc(str(c['status']))}[/]" + (f" ({esc(str(c.get('error')))})" if c.get("error") else "")
    s = f"{esc(str(c['label']))} at d={c['depth']}: [bold]{c['tokens_per_s']:.4g} tok/s[/] (±{c.get('stddev_ts', 0):.2g}), {c['ms_per_token']:.3g} ms/token"
    if c.get("tail_bytes_per_token"):
        s += f", tail {_mb(c['tail_bytes_per_token'])} MB/token"
    if c.get("ratio_floor") is not None:
        s += f", {c['ratio_floor']:.2f}x floor"
    if c.get("ratio_hybrid") is not None:
        s += f", {c['ratio_hybrid']:.2f}x hybrid floor"
    return s + f" [dim]({c.get('wall_s', 0):.1f} s)[/]"


def report_console():
    """The console for wide tables: ours on a terminal or with $COLUMNS, else one 200 columns wide (a log file
    or a device call's captured output would otherwise squeeze 12 columns into 80)."""
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    from rich.console import Console

    return Console(width=200, highlight=False)


def print_report(doc: dict) -> None:
    from rich.table import Table

    out = report_console()

    for depth in doc["config"]["depths"]:
        cells = [c for c in doc["cells"] if c["depth"] == depth]
        dp = doc["depths"].get(str(depth), {})
        tb = Table(title=esc(f"decode at depth {depth} (kv_size {dp.get('kv_size')}, n_gen {doc['config']['n_gen']}), {doc['build']['backend']}"),
                   title_justify="left")
        for col, just in (("cell", "left"), ("window", "right"), ("tail", "right"), ("CPU", "right"), ("tail MB/tok", "right"),
                          ("tok/s", "right"), ("ms/tok", "right"), ("floor ms", "right"), ("x floor", "right"), ("stretch ms", "right"),
                          ("x stretch", "right"), ("hybrid ms", "right"), ("x hybrid", "right"), ("wall s", "right"), ("status", "left")):
            tb.add_column(col, justify=just)
        for c in cells:
            ok = c["status"] == "ok"
            tb.add_row(
                esc(str(c["label"]) + (f" (→{c['tail_type_chosen']})" if c.get("tail_type_chosen") else "")),
                f"h{c['device_heads']}" if c["kind"] == "head" else "-" if c.get("window_cells") is None else str(c["window_cells"]),
                _pct(c["tail_fraction"]) if c["kind"] in ("window", "hybrid", "head") else "-",
                _cpu_cell(c),
                _mb(c.get("tail_bytes_per_token")) if c["kind"] in ("window", "auto", "hybrid", "head") else "-",
                f"{c['tokens_per_s']:.4g}" if ok else "-",
                _num(c.get("ms_per_token")) if ok else "-",
                _num(c.get("floor_ms")), _num(c.get("ratio_floor"), ".2f"),
                _num(c.get("stretch_floor_ms")), _num(c.get("ratio_stretch"), ".2f"),
                _num(c.get("hybrid_floor_ms")), _num(c.get("ratio_hybrid"), ".2f"),
                _num(c.get("wall_s"), ".1f"),
                {"ok": "[green]ok[/]", "pending": "[dim]pending[/]"}.get(c["status"], f"[red]{esc(str(c['status']))}[/]"),
            )
        out.print(tb)
    bw = doc["bandwidth"]
    out.print(f"bandwidth: {bw['gbps']:.4g} GB/s ({bw['source']}; {bw['note']})" if bw.get("gbps") is not None
              else f"bandwidth: null ({bw['note']})", soft_wrap=True, markup=False)
    ca = doc.get("cpu_attn") or {}
    if isinstance(ca.get("gbps"), dict):
        figures = ", ".join(f"{t} {_num(v, '.4g')}" for t, v in ca["gbps"].items())
        split = ca.get("expected_auto_frac") or {}
        out.print(f"CPU attention: {figures} GB/s on {ca.get('n_threads')} threads ({ca.get('source')})"
                  + (f"; cpu / (cpu + link) = " + ", ".join(f"{t} {_pct(v)}" for t, v in split.items()) if split else ""),
                  soft_wrap=True, markup=False)
    elif any(c["kind"] == "hybrid" for c in doc["cells"]):
        out.print(f"CPU attention: null ({ca.get('error') or ca.get('note')})", soft_wrap=True, markup=False)
    tt = Table(title="issue 4 targets, and issue 16's for the hybrid cells (computed from the cells above)", title_justify="left")
    for col in ("target", "depth", "value", "need", "status", "detail"):
        tt.add_column(col)
    for t in doc["targets"]:
        style = {"met": "green", "not met": "red", "n/a": "dim", "info": "yellow"}[t["status"]]
        detail = "; ".join(x for x in (t.get("detail"), t.get("note")) if x)
        tt.add_row(esc(str(t["target"])), str(t["depth"]), _num(t["value"], ".3g"), esc(f"{t['op']} {t['threshold']:g}"), f"[{style}]{t['status']}[/]", esc(detail))
    out.print(tt)
    for n in doc.get("notes", []):
        out.print(f"[dim]note:[/] {esc(str(n))}", soft_wrap=True)


# ------------------------------------------------------------------------------------------ the run


def _compatible(old: dict, doc: dict) -> list[str]:
    diffs = []
    for path in (("model", "path"), ("model", "file_bytes"), ("build", "dir"), ("config", "n_gen"), ("config", "window_type"),
                 ("config", "threads"), ("vanilla", "llama_bench")):
        a, b = old, doc
        for k in path:
            a = a.get(k) if isinstance(a, dict) else None
            b = b.get(k) if isinstance(b, dict) else None
        if a != b:
            diffs.append(f"{'.'.join(path)}: {a!r} -> {b!r}")
    return diffs


def resume_cells(out: Path, doc: dict) -> int:
    """Take over the measured cells of an earlier run of the same configuration (same command line per cell)."""
    from rollingkv_cli.console import RollingKVError
    from rollingkv_cli.userinput import read_json

    if not out.exists():
        return 0
    try:
        old = read_json(out, "--resume report")
    except RollingKVError as e:
        abort(e.message, "give another --json, or drop --resume to start over")
    if not isinstance(old, dict) or old.get("schema") != SCHEMA:
        abort(f"--resume: {out} is not a `bench tail` report (schema {old.get('schema')!r})")
    diffs = _compatible(old, doc)
    if diffs:
        abort(f"--resume: {out} was made with another configuration ({'; '.join(diffs)})", "give another --json, or drop --resume to start over")
    done = {c.get("command_key", c["command"]): c for c in old.get("cells", []) if c.get("status") == "ok"}
    n = 0
    for i, c in enumerate(doc["cells"]):
        key = c.get("command_key", c["command"])
        if key in done:
            doc["cells"][i] = dict(done[key], resumed=True)
            n += 1
    return n


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_CELL_OPTIONAL_NUMBERS = ("window_cells", "tail_fraction", "tail_bytes_per_token", "host_kv_bytes_per_token", "wall_s", "stddev_ts",
                          "ms_per_token", "n_gpu_layers", "cpu_frac_chosen")


def report_problem(doc) -> str | None:
    """The first part of a `bench tail` report that `bench show`/`bench plot` could not use, or None.

    A report is ours (its schema) but may be cut off, hand-edited or from a broken run: say what is wrong
    instead of failing somewhere in the tables."""
    if not isinstance(doc, dict):
        return f"the top level is a {type(doc).__name__}, not an object"
    for key, typ in (("config", dict), ("bandwidth", dict), ("cells", list), ("depths", dict), ("build", dict), ("model", dict)):
        if not isinstance(doc.get(key), typ):
            return f"'{key}' is missing or not {'an object' if typ is dict else 'a list'}"
    cfg = doc["config"]
    if not isinstance(cfg.get("depths"), list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in cfg["depths"]):
        return "'config.depths' is not a list of integers"
    if not isinstance(cfg.get("n_gen"), int) or not isinstance(cfg.get("window_type"), str):
        return "'config.n_gen' or 'config.window_type' is missing"
    if not isinstance(cfg.get("tail_types"), list) or not all(isinstance(t, str) for t in cfg["tail_types"]):
        return "'config.tail_types' is not a list of type names"
    gbps = doc["bandwidth"].get("gbps")
    if gbps is not None and not (_is_num(gbps) and gbps > 0):
        return f"'bandwidth.gbps' is {gbps!r}, not a positive number or null"
    ca = doc.get("cpu_attn", {})
    if not isinstance(ca, dict):
        return "'cpu_attn' is not an object"
    cg = ca.get("gbps")
    if cg is not None and not (isinstance(cg, dict) and all(v is None or (_is_num(v) and v > 0) for v in cg.values())):
        return f"'cpu_attn.gbps' is {cg!r}, not null or an object of positive numbers (or nulls) per tail type"
    if not isinstance(doc.get("notes", []), list):
        return "'notes' is not a list"
    if not isinstance(doc["model"].get("path", ""), str):
        return "'model.path' is not a string"
    for i, c in enumerate(doc["cells"]):
        where = f"cells[{i}]"
        if not isinstance(c, dict):
            return f"{where} is not an object"
        for key, typ in (("label", str), ("status", str), ("kind", str)):
            if not isinstance(c.get(key), typ):
                return f"{where}.{key} is missing or not a string"
        if not isinstance(c.get("depth"), int) or isinstance(c.get("depth"), bool):
            return f"{where}.depth is missing or not an integer"
        for key in _CELL_OPTIONAL_NUMBERS:
            if c.get(key) is not None and not _is_num(c[key]):
                return f"{where}.{key} is {c[key]!r}, not a number"
        if c["kind"] in ("window", "hybrid", "head") and not _is_num(c.get("tail_fraction")):
            return f"{where} is a {c['kind']} cell without a numeric tail_fraction"
        if c["kind"] == "hybrid" and not (c.get("cpu_frac") == "auto" or _is_num(c.get("cpu_frac"))):
            return f"{where}.cpu_frac is {c.get('cpu_frac')!r}, not auto or a number"
        if c["status"] == "ok" and not (_is_num(c.get("tokens_per_s")) and c["tokens_per_s"] > 0 and _is_num(c.get("ms_per_token"))):
            return f"{where} is 'ok' without positive tokens_per_s and ms_per_token"
        if not isinstance(c.get("fractions", []), list) or not all(_is_num(f) for f in c.get("fractions", [])):
            return f"{where}.fractions is not a list of numbers"
    return None


def new_document(cfg: TailConfig, build, model, plans: dict[int, dict], vanilla_desc: str) -> dict:
    from rollingkv_cli import __version__

    notes = list(model.notes)
    notes.append("tail bytes per token = mean over the decoded tokens of (n_kv - window) cells x K+V row bytes at the tail type, "
                 "summed over layers; n_kv = min(kv_size, max(256, pad256(pos + 1)))")
    notes.append(f"windows are multiples of 256 cells; the 100% tail is the smallest explicit window, {bm.MIN_WINDOW} cells "
                 "(--kv-window-cells 0 means 'the planner decides' in the patched llama-bench)")
    if cfg.head_fractions:
        notes.append("head cells: --kv-residency-mode head --kv-device-heads N, N = round((1 - f) x n_head_kv) KV heads of every layer on "
                     "the device; tail bytes per token = mean n_kv x the host heads of all layers x their K+V bytes at the tail type "
                     "(a head split streams its host heads of every attended cell from the first token on); the same floors as "
                     "the window cells")
    if cfg.cpu_fracs:
        notes.append("hybrid cells: a window cell's split with part of each layer's tail attended on the CPU while the rest streams "
                     "(--kv-tail-cpu-frac; auto cells get the link bandwidth of the floors as --pcie-bw-gbps); their third floor is "
                     "max(t_res, tail_bytes / (link + cpu_attn)), serial t_res + tail_bytes / (link + cpu_attn), with the CPU "
                     "attention GB/s of the tail's K type measured in this run")
    return {
        "schema": SCHEMA, "rollingkv_version": __version__, "created_at": _now(), "updated_at": _now(), "finished_at": None,
        "complete": False, "argv": sys.argv, "cwd": os.getcwd(),
        "host": {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "build": {"dir": str(cfg.build_dir), "llama_bench": str(cfg.bench), "backend": cfg.backend,
                  "series_hash": build.manifest.get("series_hash"), "pin": build.manifest.get("pin"),
                  "cuda_arch": build.manifest.get("cuda_arch")},
        "vanilla": {"source": vanilla_desc, "llama_bench": str(cfg.vanilla_bench or cfg.bench)},
        "model": model.to_json(), "config": cfg.to_json(),
        "bandwidth": {"gbps": None, "source": None, "note": "not measured yet"},
        "cpu_attn": {"gbps": None, "note": "not measured yet" if cfg.cpu_fracs else "no hybrid cells in this run"},
        "depths": {str(d): p for d, p in plans.items()},
        "cells": build_cells(cfg, model, plans), "targets": [], "notes": notes, "png": None,
    }


def run(cfg: TailConfig, doc: dict, model, resume: bool) -> dict:
    """Measure every cell not taken over from an earlier report; the report is rewritten after each one."""
    t0 = time.monotonic()  # --time-budget counts from here: the link measurement is part of the run
    if resume:
        n = resume_cells(cfg.out, doc)
        if n:
            console.print(f"--resume: {n} measured cells taken over from {cfg.out}", style="dim", markup=False)
    doc["bandwidth"] = measure_bandwidth(cfg.gpu, cfg.pcie_bw_gbps)
    if doc["bandwidth"]["gbps"] is None:
        doc["notes"].append(doc["bandwidth"]["note"])
    if any(c["kind"] == "hybrid" for c in doc["cells"]):
        bind_link(doc, doc["bandwidth"]["gbps"])
        doc["cpu_attn"] = measure_cpu_attn(cfg)
        if doc["cpu_attn"]["gbps"] is None:
            doc["notes"].append(f"CPU attention not measured ({doc['cpu_attn']['error']}): the hybrid floors are skipped")
    refresh(doc)
    write_json(cfg.out, doc)

    todo = [c for c in doc["cells"] if c["status"] != "ok"]
    with _sigterm_as_interrupt():
        _run_cells(cfg, doc, model, todo, t0)
    doc["complete"] = all(c["status"] == "ok" for c in doc["cells"])
    doc["finished_at"] = _now()
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    refresh(doc)
    write_json(cfg.out, doc)
    return doc


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (an outer timeout) or SIGHUP (the terminal closed) ends the run like Ctrl-C: the running cell is
    stopped and marked, the report written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _run_cells(cfg: TailConfig, doc: dict, model, todo: list[dict], t0: float) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console.print(f"{len(todo)} cells to run ({len(doc['cells']) - len(todo)} already measured); report: {cfg.out}", style="dim", markup=False)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("cells", total=len(todo))
        for i, c in enumerate(todo, 1):
            desc = esc(f"[{i}/{len(todo)}] {c['label']} at d={c['depth']}")  # markup-safe: a progress description
            timeout, limit = cfg.cell_timeout, "--cell-timeout"
            if cfg.time_budget:
                left = cfg.time_budget - (time.monotonic() - t0)
                if left <= 1:
                    c["status"], c["error"] = "skipped", "the --time-budget was spent before this cell"
                    progress.advance(task)
                    continue
                if not timeout or left < timeout:
                    timeout, limit = left, "--time-budget"
            progress.update(task, description=desc)

            def on_line(line: str, desc=desc) -> None:
                if line.startswith("llama-bench: benchmark"):
                    progress.update(task, description=f"{desc}: {esc(line.split(':', 2)[-1].strip())}")

            if not console.is_terminal:  # a log: say what runs, so a cut-off run shows where it stopped
                console.print(f"{desc}: running", soft_wrap=True)
            c["started_at"] = _now()
            c["status"] = "running"
            write_json(cfg.out, doc)
            try:
                rc, out, err_tail, wall, timed_out = CellRunner(on_line).run(c["args"], timeout)
            except KeyboardInterrupt:
                c["status"], c["error"] = "interrupted", "Ctrl-C or SIGTERM while it ran"
                refresh(doc)
                write_json(cfg.out, doc)
                raise
            except OSError as e:
                rc, out, err_tail, wall, timed_out = None, "", [str(e)], 0.0, False
            c["wall_s"] = round(wall, 2)
            if timed_out:
                c["status"], c["error"] = "timeout", f"stopped after {wall:.0f} s ({limit})"
                c["stderr_tail"] = err_tail
            elif rc != 0:
                from rollingkv_cli.lib.procs import describe_exit

                how = "could not start" if rc is None else describe_exit(rc)
                c["status"], c["error"] = "failed", f"llama-bench {how}: {err_tail[-1] if err_tail else ''} (stderr_tail in {cfg.out})"
                c["stderr_tail"] = err_tail
            else:
                try:
                    fill_measurement(c, parse_bench_json(out, cfg.n_gen), model)
                    c["status"] = "ok"
                    stats = [line for line in err_tail if line.startswith(CPU_PART_STATS_PREFIX)]
                    if stats:
                        c["cpu_part_stats"] = stats
                except ValueError as e:
                    c["status"], c["error"] = "failed", str(e)
                    c["stderr_tail"] = err_tail
            refresh(doc)
            write_json(cfg.out, doc)
            progress.console.print(esc(f"[{i}/{len(todo)}] ") + cell_line(c), soft_wrap=True)
            progress.advance(task)
