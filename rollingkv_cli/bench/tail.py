"""`rollingkv bench tail`: decode speed of the split KV cache against its PCIe floor and against what
vanilla llama.cpp offers at the same depth, in one run (issue 4, item 5).

One llama-bench process per cell (`-fa 1 -p 0 -n N -d DEPTH -r R -o json`), so that every cell has its own
command line, wall time and timeout, and the JSON report is rewritten after every cell: a run cut short
(a device-call limit, Ctrl-C) leaves every finished cell on disk, and `--resume` runs only what is missing.
No click in here: the command is cli.py; the arithmetic is arithmetic.py, the grid of cells tail_grid.py, the report's
printing and checking tail_report.py.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from rollingkv_cli.bench import arithmetic as bm
from rollingkv_cli.bench.tail_grid import AUTO_CANDIDATES, LINK_PLACEHOLDER, TailConfig, build_cells
from rollingkv_cli.bench.tail_report import cell_line
from rollingkv_cli.console import abort, console, esc
from rollingkv_cli.kvtypes import TAIL_AUTO

SCHEMA = "rollingkv.bench.tail/1"
STDERR_TAIL = 25


# ------------------------------------------------------------------------------------ one llama-bench


CPU_PART_STATS_PREFIX = "rolling KV: CPU part:"  # libllama's ROLLINGKV_CPU_PART_STATS lines (at exit, on stderr)


def cpu_part_runs(stats_lines: list[str]) -> int:
    """How many CPU parts ran in a cell's process, from its ROLLINGKV_CPU_PART_STATS lines (0: no line, none ran)."""
    import re

    for line in stats_lines:
        m = re.match(re.escape(CPU_PART_STATS_PREFIX) + r" (\d+) runs", line)
        if m:
            return int(m.group(1))
    return 0


def check_cpu_part_ran(cell: dict) -> None:
    """A hybrid cell whose plan gave the CPU a share proves that the CPU part ran (a GPU-only run would time the
    streamed tail under the hybrid's name): failed otherwise."""
    runs = cpu_part_runs(cell.get("cpu_part_stats") or [])
    cell["cpu_part_runs"] = runs
    if cell.get("kind") == "hybrid" and (cell.get("cpu_frac_chosen") or 0) > 0 and runs == 0:
        cell["status"] = "failed"
        cell["error"] = (f"the plan gave the CPU {cell['cpu_frac_chosen']:.0%} of the tail but no CPU part ran "
                         "(ROLLINGKV_CPU_PART_STATS counted none): the cell timed the GPU-only stream")


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


CONTEXT_FAILED = "failed to create context"  # llama-bench's own line when llama_init_from_model_rolling_kv refuses


def context_refusal_reason(args: list[str], err_tail: list[str], timeout: float = 120.0) -> str | None:
    """Why the library refused a cell's context. llama-bench silences the library's log (and so its reason) unless -v:
    a cell that failed there is asked again with -v, which fails as fast (the context comes before any timing)."""
    from rollingkv_cli.lib.llama_ext import refusal_in_log

    if not any(CONTEXT_FAILED in line for line in err_tail):
        return None
    reason = refusal_in_log(err_tail)
    if reason:
        return reason
    from rollingkv_cli.lib.procs import popen_tied, stop_group

    try:
        proc = popen_tied([*args, "-v"], new_session=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          errors="replace", stdin=subprocess.DEVNULL)
    except OSError:
        return None
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(proc, 5.0)
        return None
    except BaseException:
        stop_group(proc, 5.0)
        raise
    return refusal_in_log(err.splitlines())


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
               "cpu_attn_gbps", "hybrid_serial_floor_ms", "hybrid_floor_ms", "ratio_hybrid_serial", "ratio_hybrid",
               "hybrid_dependent_floor_ms", "hybrid_dependent_share", "ratio_hybrid_dependent")


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
            h_dep, share = bm.hybrid_dependent_floor(t_res, c.get("tail_bytes_per_token") or 0.0, gbps * 1e9, cpu * 1e9)
            c["hybrid_dependent_floor_ms"] = h_dep * 1e3
            c["hybrid_dependent_share"] = share
            c["ratio_hybrid_dependent"] = t / h_dep


# ------------------------------------------------------------------------------------------ bandwidth


def measure_bandwidth(gpu_index: int, explicit: float | None, lib_dir: Path) -> dict:
    """Pinned host-to-device GB/s for the floors, measured now by the build's libllama (link_bw.measure, 256 MiB
    copies); None without a GPU."""
    from rollingkv_cli.hw import link_bw, pcie

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
            entry = link_bw.measure(lib_dir, gpu)
    except link_bw.Unavailable as e:
        res = pcie.resolve_bandwidth(gpu_index, gpus=gpus)
        return {"gbps": res.gbps, "source": f"resolved ({res.tier})", "gpu": pcie.gpu_dict(gpu),
                "note": f"measuring failed ({e.message}); using {res.gbps:g} GB/s: {res.detail}"}
    gbps = entry["h2d"].get(str(pcie.RESOLVE_SIZE_MIB))
    return {"gbps": gbps, "source": "measured", "gpu": pcie.gpu_dict(gpu), "measurement": entry,
            "note": f"pinned host-to-device, {pcie.RESOLVE_SIZE_MIB} MiB copies, median of 3 runs, measured in this run "
                    "by the build's libllama"}


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
    """Fill the link figure into the pending auto cells' --pcie-bw-gbps (hybrid: their plan's split depends on it; auto
    tail types: their type does): the bandwidth the floors use, measured in this run unless given; without one the
    option is left out."""
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
    doc["bandwidth"] = measure_bandwidth(cfg.gpu, cfg.pcie_bw_gbps, cfg.bench.parent)
    if doc["bandwidth"]["gbps"] is None:
        doc["notes"].append(doc["bandwidth"]["note"])
    # every auto cell's plan gets the link (hybrid and tail-type cells: without it an auto tail-type cell passed the
    # placeholder itself to llama-bench, which refused it, on the H100 2026-12-06)
    bind_link(doc, doc["bandwidth"]["gbps"])
    if any(c["kind"] == "hybrid" for c in doc["cells"]):
        doc["cpu_attn"] = measure_cpu_attn(cfg)
        if doc["cpu_attn"]["gbps"] is None:
            doc["notes"].append(f"CPU attention not measured ({doc['cpu_attn']['error']}): the hybrid floors are skipped")
    refresh(doc)
    write_json(cfg.out, doc)

    todo = [c for c in doc["cells"] if c["status"] != "ok"]
    from rollingkv_cli.lib.procs import stop_signals_raise

    # SIGTERM (an outer timeout) or SIGHUP (the terminal closed) end the run as Ctrl-C does: the running cell is stopped
    # and marked, the report written (also where tail runs outside cli.main, which installs the same)
    with stop_signals_raise():
        _run_cells(cfg, doc, model, todo, t0)
    doc["complete"] = all(c["status"] == "ok" for c in doc["cells"])
    doc["finished_at"] = _now()
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    refresh(doc)
    write_json(cfg.out, doc)
    return doc


def estimate_line(cfg: TailConfig, model, cells: list[dict]) -> str:
    from rollingkv_cli.bench import estimate

    return estimate.tail_line(model, cells, n_gen=cfg.n_gen, reps=cfg.reps, vanilla_reps=cfg.vanilla_reps, threads=cfg.threads,
                              backend=cfg.backend, preset=cfg.preset, window_type=cfg.window_type)


def _stop_if_the_model_did_not_load(cfg: TailConfig, doc: dict, cell: dict, rest: list[dict],
                                    err_tail: list[str]) -> None:
    """A cell's llama-bench could not load the model (a GGUF llama.cpp refuses: `invalid n_rot`): every other cell
    would fail the same way. They ran anyway, each a line of "failed to load model" without llama.cpp's reason, then a
    table of n/a and exit 1 with no error line. Now the rest is skipped and the run ends in one line with the reason."""
    from rollingkv_cli.lib import child
    from rollingkv_cli.serve.server import model_error_in_log

    if not any("failed to load model" in line for line in err_tail):
        return
    # llama-bench keeps llama.cpp's log to itself unless -v: the reason, from one more (short) try that prints it
    try:
        _, _, err = child.run([str(cfg.bench), "-m", str(cfg.model), "-p", "0", "-n", "1", "-r", "1", "-v"],
                              timeout=120)
        reason = model_error_in_log(err.splitlines())
    except (OSError, child.Timeout):
        reason = None
    if reason is None:  # our llama-bench loads it (an unpatched vanilla build's cell failed): the run goes on
        return
    cell["error"] = f"{reason} (stderr_tail in {cfg.out})"
    for c in rest:
        c["status"], c["error"] = "skipped", "not run: llama.cpp could not load the model"
    refresh(doc)
    write_json(cfg.out, doc)
    abort(f"{reason.replace('the model', cfg.model.name, 1)}", f"the file is corrupt or not a model this build runs; "
          f"the report {cfg.out} keeps the failed cell")


def _run_cells(cfg: TailConfig, doc: dict, model, todo: list[dict], t0: float) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console.print(f"{len(todo)} cells to run ({len(doc['cells']) - len(todo)} already measured); report: {cfg.out}", style="dim", markup=False)
    if todo:  # before the first cell: what they do and how long they may take here (hours on a CPU at the defaults)
        console.print(estimate_line(cfg, model, todo), markup=False, soft_wrap=True)
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
                last = err_tail[-1] if err_tail else ""
                reason = context_refusal_reason(c["args"], err_tail)
                if reason:
                    last = f"the library refused the context: {reason}"
                c["status"], c["error"] = "failed", f"llama-bench {how}: {last} (stderr_tail in {cfg.out})"
                c["stderr_tail"] = err_tail
                _stop_if_the_model_did_not_load(cfg, doc, c, todo[i:], err_tail)
            else:
                try:
                    fill_measurement(c, parse_bench_json(out, cfg.n_gen), model)
                    c["status"] = "ok"
                    stats = [line for line in err_tail if line.startswith(CPU_PART_STATS_PREFIX)]
                    if stats:
                        c["cpu_part_stats"] = stats
                    check_cpu_part_ran(c)
                except ValueError as e:
                    c["status"], c["error"] = "failed", str(e)
                    c["stderr_tail"] = err_tail
            refresh(doc)
            write_json(cfg.out, doc)
            progress.console.print(esc(f"[{i}/{len(todo)}] ") + cell_line(c), soft_wrap=True)
            progress.advance(task)
