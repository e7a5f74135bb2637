"""The `bench` click group: speed benchmarks of the split KV cache (the work lives in the modules next to this one)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import click

from rollingkv_cli.cliopts import FiniteFloatRange, NonEmptyPath, PassThroughCommand, option, threads_in_range
from rollingkv_cli.kvtypes import TAIL_AUTO, TAIL_TYPES  # the library's list (a tiny module: registering commands stays cheap)

CACHE_TYPES = list(TAIL_TYPES)
SKIPPABLE = ["auto", "ngl", "nkvo"]


@click.group(short_help="Decode speed against the PCIe floor; load tests.")
def bench() -> None:
    """Measure decode speed of the split KV cache against its PCIe floor and vanilla llama.cpp."""


def _positive(ctx, param, value):
    if value is None:
        return value
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if v < 1:
            raise click.BadParameter(f"must be at least 1, got {v}")
    return value


def _names(value: str, allowed: list[str], what: str) -> list[str]:
    """A comma-separated list of names from `allowed`, in order, each once; an unknown one is a usage error."""
    out = []
    for t in (x.strip() for x in value.split(",")):
        if not t:
            continue
        if t not in allowed:
            raise click.BadParameter(f"unknown {what} {t!r} (allowed: {', '.join(allowed)})")
        if t not in out:
            out.append(t)
    return out


def _types(ctx, param, value: str):
    out = _names(value, [*CACHE_TYPES, TAIL_AUTO], "tail type")
    if not out:
        raise click.BadParameter("give at least one tail type")
    return out


def _fractions(ctx, param, value: str):
    out = []
    for s in (x.strip() for x in value.split(",")):
        if not s:
            continue
        try:
            f = float(s[:-1]) / 100 if s.endswith("%") else float(s)
        except ValueError:
            raise click.BadParameter(f"{s!r} is not a fraction (use 0.5 or 50%)") from None
        if not 0.0 <= f <= 1.0:
            raise click.BadParameter(f"tail fraction {s} is outside [0, 1] (0 = everything in the window, 1 = all but 256 cells in the tail)")
        if f not in out:
            out.append(f)
    if not out and param.name == "fractions":
        raise click.BadParameter("give at least one fraction")
    return out


def _cpu_fracs(ctx, param, value: str):
    """'0.25,0.5,auto' -> [0.25, 0.5, 'auto']; '' or 'none' -> [] (no hybrid cells). 0 is the window cells themselves."""
    out: list = []
    for s in (x.strip() for x in (value or "").split(",")):
        if not s or s.lower() == "none":
            continue
        if s.lower() == "auto":
            f = "auto"
        else:
            try:
                f = float(s[:-1]) / 100 if s.endswith("%") else float(s)
            except ValueError:
                raise click.BadParameter(f"{s!r} is neither auto nor a fraction (use 0.5, 50% or auto)") from None
            if not 0.0 < f <= 1.0:
                raise click.BadParameter(f"CPU fraction {s} is outside (0, 1] (0 is the window cells themselves: the GPU-only split; "
                                         "1 = the whole tail on the CPU)")
        if f not in out:
            out.append(f)
    return out


# --preset cpu-small: runs a CPU host finishes in minutes (the defaults are sized for a GPU: bench tail fills 16384 tokens
# of context three times over a dozen cells, bench load's long request is 24000 tokens). Each value is what the flag
# would give; a flag given on the command line wins over its preset value.
TAIL_PRESETS = {"cpu-small": {"depths": (2048,), "n_gen": 8, "reps": 1, "tail_types": ["f16", "q8_0"], "fractions": [0.5, 1.0],
                              "mixed_fractions": [0.5]}}
TAIL_PRESET_HELP = "-d 2048 -n 8 -r 1 --tail-types f16,q8_0 --fractions 0.5,1"
LOAD_PRESETS = {"cpu-small": {"long_sizes": (2048, 32), "short_sizes": (256, 16), "n_short": 2, "n_slots": 3,
                              "ramp_levels": [1, 2, 3, 2, 1], "ramp_sizes": (1024, 16), "n_requests": 6,
                              "prompt_range": (200, 2000), "gen_range": (8, 32), "cell_names": ["default", "split", "resident"],
                              "shared_sizes": (1536, 64, 16), "n_clients": 3}}
LOAD_PRESET_HELP = ("--long 2048 32 --short 256 16 --shorts 2 -np 3 --cells default,split,resident; ramp: --ramp 1,2,3,2,1 "
                    "--ramp-size 1024 16; random: --requests 6 --prompt-range 200 2000 --gen-range 8 32; shared: --shared 1536 64 16 --clients 3")


def _preset_values(ctx: click.Context, preset: str | None, table: dict[str, dict]) -> dict:
    """The command's values with the preset's put in for every parameter not given on the command line."""
    values = dict(ctx.params)
    if preset:
        for name, value in table[preset].items():
            if ctx.get_parameter_source(name) != click.core.ParameterSource.COMMANDLINE:
                values[name] = value
    return values


def _vanilla_bench(d: Path) -> Path:
    from rollingkv_cli.console import abort

    d = d.expanduser()
    for cand in (d, d / "llama-bench", d / "bin" / "llama-bench", d / "build" / "bin" / "llama-bench"):
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand.resolve()
    abort(f"--vanilla-build {d}: no llama-bench executable there (looked in it, bin/ and build/bin/)",
          "build llama.cpp at the pin with its llama-bench target, or drop --vanilla-build to use our build with --kv-residency-mode off")


@bench.command(short_help="Decode speed against the PCIe floor and vanilla.")
@click.argument("model_spec", metavar="MODEL")
@click.option("-d", "--depth", "depths", type=int, multiple=True, callback=_positive, default=(16384,), show_default=True,
              help="Context depth before the timed tokens (repeat for several).")
@click.option("-n", "--n-gen", type=int, callback=_positive, default=32, show_default=True, help="Tokens decoded and timed per repetition.")
@click.option("-r", "--reps", type=int, callback=_positive, default=3, show_default=True, help="Repetitions per cell (llama-bench -r).")
@click.option("--vanilla-reps", type=int, callback=_positive, default=None, help="Repetitions of the vanilla -ngl/-nkvo cells (slow).  [default: --reps]")
@click.option("--tail-types", "tail_types", default="f16,q8_0,q4_0", show_default=True, callback=_types,
              help=f"Comma-separated tail K/V types (-ctkt/-ctvt): {', '.join(CACHE_TYPES)}, or auto (the planner's choice, "
                   "given the run's link figure; the report names the type it chose).")
@click.option("--fractions", default="0,0.25,0.5,0.75,1", show_default=True, callback=_fractions,
              help="Tail fractions of the KV cells for the tail type equal to the window type (0.5 or 50%).")
@click.option("--mixed-fractions", default="0.5", show_default=True, callback=_fractions,
              help="Tail fractions for the other tail types.")
@click.option("--cpu-fracs", default="auto", show_default=True, callback=_cpu_fracs, metavar="LIST",
              help="Hybrid cells: each window cell with a tail again with this share of its tail attended on the CPU while the rest "
                   "streams (--kv-tail-cpu-frac: auto or a fraction, comma-separated; none: no hybrid cells). CUDA builds with the "
                   "hybrid tail only (elsewhere the default makes none). auto by default: what users get (the library's default), "
                   "next to the window cells, which stay GPU-only (--kv-tail-cpu-frac 0); give auto,0.4,0.5 to see fixed shares.")
@click.option("--head-fractions", default="", callback=_fractions, metavar="LIST",
              help="Head-split cells: for each tail type and fraction f, N = round((1 - f) x n_head_kv) KV heads of every layer "
                   "on the device (--kv-residency-mode head --kv-device-heads N: the VRAM of the window cell at f at full "
                   "context), the others streamed from host memory for every cell; e.g. 0.25,0.5,0.75.  [default: none]")
@click.option("--window-type", type=click.Choice(CACHE_TYPES), default="f16", show_default=True, help="The window's (and vanilla's) K/V type, -ctk/-ctv.")
@click.option("--vanilla-build", type=NonEmptyPath(path_type=Path), default=None, metavar="DIR",
              help="An unpatched llama.cpp build of the pin (DIR, DIR/bin or DIR/build/bin holding llama-bench) for the vanilla cells.  "
                   "[default: our build with --kv-residency-mode off, bit-identical to upstream]")
@click.option("--skip", multiple=True, type=click.Choice(SKIPPABLE), help="Leave out the auto, vanilla -ngl or vanilla -nkvo cells (repeatable).")
@click.option("-t", "--threads", type=int, callback=threads_in_range, default=None, help="CPU threads for llama-bench (-t).  [default: llama-bench's]")
@click.option("--slot-ring-mib", type=click.IntRange(min=0), default=None,
              help="Device slot ring of the tail stream counted in the VRAM budget.  [default: $ROLLINGKV_SLOTS x $ROLLINGKV_SLOT_MIB, else 3 x 32]")
@click.option("--pcie-bw-gbps", type=float, default=None,
              help="Use this host-to-device GB/s for the floors instead of measuring, and give it to the hybrid auto cells' plan "
                   "(a simulated link: the CPU share auto picks for it, on this machine).")
@click.option("--gpu", "gpu_index", type=click.IntRange(min=0), default=0, show_default=True, help="GPU (NVML index) whose link is measured.")
@click.option("--cell-timeout", type=FiniteFloatRange(min=1), default=None, metavar="S",
              help="Stop a cell after S seconds (recorded as timeout).")
@click.option("--time-budget", type=FiniteFloatRange(min=1), default=None, metavar="S",
              help="Start no cell after S seconds and stop a running one then: the report stays complete up to there.")
@click.option("--json", "json_out", type=NonEmptyPath(dir_okay=False, path_type=Path), default=None,
              help="The report, rewritten after every cell.  [default: <date>-bench-tail-<model>/bench-tail.json, a new folder per run, in docs/perf inside the checkout, else here]")
@click.option("--resume", is_flag=True, help="Keep the measured cells of --json from an earlier run of the same configuration; run the rest.")
@click.option("--no-plot", is_flag=True, help="Do not draw the PNG (drawn next to the JSON when matplotlib is installed).")
@click.option("--dry-run", is_flag=True, help="Print the cells and their llama-bench command lines, run nothing.")
@click.option("--preset", type=click.Choice(sorted(TAIL_PRESETS)), default=None,
              help=f"A small grid for a CPU host, minutes instead of hours: cpu-small = {TAIL_PRESET_HELP} (a flag given "
                   "as well wins).")
@click.pass_context
def tail(ctx, model_spec, depths, n_gen, reps, vanilla_reps, tail_types, fractions, mixed_fractions, cpu_fracs, head_fractions, window_type, vanilla_build,
         skip, threads, slot_ring_mib, pcie_bw_gbps, gpu_index, cell_timeout, time_budget, json_out, resume, no_plot, dry_run,
         preset) -> None:
    """Decode tokens/s with part of the KV cache in a host tail, against the PCIe floor and vanilla llama.cpp.

    \b
    Per depth, one llama-bench process per cell (-fa 1 -p 0 -n N -d DEPTH -r R
    -o json):
      resident       --kv-residency-mode off, -ngl 99 (the floor's t_resident)
      window         --kv-residency-mode window --kv-window-cells W -ctkt/-ctvt
                     T, for each tail type T and tail fraction: W = (1 -
                     fraction) x (depth + n_gen) to a multiple of 256, at least
                     256 (the 100% tail); 0% = the whole cache
      hybrid         a window cell again with --kv-tail-cpu-frac F for each F of
                     --cpu-fracs (CUDA builds with the hybrid tail; auto by
                     default, the library's default): part of the tail attended
                     on the CPU while the rest streams
      head           --kv-residency-mode head --kv-device-heads N -ctkt/-ctvt T
                     for each tail type and --head-fractions f (none by
                     default): N = round((1 - f) x n_head_kv) KV heads of every
                     layer on the device, the others streamed for every cell
      auto           --kv-residency-mode auto (0% tail when the cache fits)
      vanilla -ngl   the largest -ngl whose last layers' weights + KV fit the
                     VRAM of the 50%-tail window run (all weights + window KV +
                     slot ring), sizes read from the GGUF
      vanilla -nkvo  -nkvo 1 (KV in host memory, attention on the CPU), run
                     last: the slowest cell

    The host-to-device bandwidth is measured in the same run (none on a CPU-only machine: floors skipped).
    Each cell's tail bytes per token, floors (t_res + bytes/bw, max(t_res, bytes/bw)) and ratios, the hybrid
    cells' third floor (max(t_res, bytes/(bw + cpu_attn)) and its serial form, with the CPU attention GB/s
    measured in the same run), and the issue 4 and 16 targets, go to the table and the JSON report (rewritten
    after every cell, with every command line); a PNG next to it when matplotlib is installed (else
    `rollingkv bench plot REPORT.json`).

    Exit status: 0 when every cell ran, 1 when one failed, timed out or was skipped (the report is
    written all the same), 2 on a usage error. Unmet targets do not change the exit status.
    """
    from rollingkv_cli.bench import arithmetic, tail_setup
    from rollingkv_cli.console import warn

    from rollingkv_cli.userinput import check_native_knobs

    check_native_knobs()  # llama-bench's library reads them itself: refused here, not ignored or misread there
    v = _preset_values(ctx, preset, TAIL_PRESETS)
    depths, n_gen, reps, tail_types, fractions, mixed_fractions = (
        v[k] for k in ("depths", "n_gen", "reps", "tail_types", "fractions", "mixed_fractions"))
    if pcie_bw_gbps is not None and not 0 < pcie_bw_gbps <= 3.4e38:  # inf went into the report as Infinity (not JSON)
        raise click.BadParameter("must be a positive finite number of GB/s", param_hint="--pcie-bw-gbps")
    if not any(t == window_type for t in tail_types) and not mixed_fractions:
        raise click.UsageError("no cell to run: no tail type equals --window-type and --mixed-fractions is empty")
    for d in depths:
        if d + n_gen > 2**31 - 1:  # llama-bench's -d is an int: it printed its usage for every cell
            raise click.BadParameter(f"depth {d} + {n_gen} generated tokens is more than llama-bench's int holds (2147483647)",
                                     param_hint="--depth")
        if arithmetic.kv_size(d, n_gen) <= arithmetic.MIN_WINDOW:
            raise click.BadParameter(f"depth {d} + {n_gen} generated tokens fit in {arithmetic.MIN_WINDOW} cells, the smallest window: "
                                     f"nothing could go to the tail (use a depth of at least {arithmetic.MIN_WINDOW})", param_hint="--depth")
    if resume and json_out is None:  # the default report is a new folder each run: nothing was kept, silently
        raise click.UsageError("--resume keeps the measured cells of an earlier report: give that report with --json "
                               "FILE")
    run = tail_setup.prepare(
        model_spec, depths=list(dict.fromkeys(depths)), n_gen=n_gen, reps=reps, vanilla_reps=vanilla_reps, tail_types=tail_types,
        fractions=fractions, mixed_fractions=mixed_fractions, cpu_fracs=cpu_fracs,
        cpu_fracs_explicit=ctx.get_parameter_source("cpu_fracs") == click.core.ParameterSource.COMMANDLINE,
        head_fractions=head_fractions, window_type=window_type,
        vanilla_bench=_vanilla_bench(vanilla_build) if vanilla_build else None, skip=tuple(skip), threads=threads,
        slot_ring_mib=slot_ring_mib, pcie_bw_gbps=pcie_bw_gbps, gpu_index=gpu_index, cell_timeout=cell_timeout,
        time_budget=time_budget, out=json_out, dry_run=dry_run, plot=not no_plot, preset=preset)
    tail_setup.print_setup(run)
    if dry_run:
        from rollingkv_cli.bench.tail import estimate_line

        tail_setup.print_dry_run(run.doc, estimate_line(run.cfg, run.info, run.doc["cells"]))
        return
    if json_out and json_out.exists() and not resume:
        warn(f"{json_out} exists: overwriting it (--resume would keep its measured cells)")
    doc = tail_setup.run_and_report(run, resume)
    if any(c["status"] != "ok" for c in doc["cells"]):
        raise click.exceptions.Exit(1)


LOAD_CELLS = ["default", "default-blocks", "default-upstream", "default-noshare", "split", "static", "one-op", "resident", "default-resident",
              "vanilla"]
LOAD_CELLS_DEFAULT = ["default", "split", "resident", "default-resident", "vanilla"]
SHARED_CELLS_DEFAULT = ["default", "default-noshare", "default-resident", "vanilla"]  # --mix shared without --cells


def _load_cells(ctx, param, value: str):
    out = _names(value, LOAD_CELLS, "cell")
    if "split" not in out and "default" not in out:
        raise click.BadParameter("the cells must include split or default (the others are compared with them)")
    return out


def _shared_sizes(ctx, param, value):
    prefix, suffix, gen = value
    if prefix < 1 or suffix < 1 or gen < 1:
        raise click.BadParameter(f"{prefix} {suffix} {gen}: give PREFIX SUFFIX GEN, each at least 1")
    return value


def _range(ctx, param, value):
    lo, hi = value
    if lo < 1 or hi < lo:
        raise click.BadParameter(f"{lo} {hi} is not a range: give LOW HIGH with 1 <= LOW <= HIGH")
    return value


def _ramp_levels(ctx, param, value: str):
    try:
        levels = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of client counts (e.g. 1,2,4,8,4,2,1)") from None
    if not levels or min(levels) < 1:
        raise click.BadParameter("give client counts of at least 1, e.g. 1,2,4,8,4,2,1")
    return levels


def _server_args_after_dashes(ctx, param, value):
    from rollingkv_cli.cliopts import pass_through

    return tuple(pass_through(ctx, value, "rollingkv bench load MODEL [options]"))


@bench.command(cls=PassThroughCommand, short_help="A server under a mixed load of concurrent clients.")
@click.argument("model_spec", metavar="MODEL")
@click.option("--mix", "mix_name", type=click.Choice(["table", "ramp", "random", "shared"]), default="table", show_default=True,
              help="table: a long request alone, short ones alone, short ones beside the long one, then after it; "
                   "ramp: clients 1 -> max -> 1 (--ramp); random: --requests arriving at random (--arrival-mean, "
                   "--prompt-range, --gen-range, --seed); shared: --clients on one long document (--shared), the others "
                   "arriving while the first decodes, after one client alone on another (cells: "
                   + ",".join(SHARED_CELLS_DEFAULT) + " unless --cells).")
@click.option("-np", "--slots", "n_slots", type=int, callback=_positive, default=4, show_default=True, help="Server slots (-np).")
@click.option("--ctx-per-slot", type=int, callback=_positive, default=None, help="Context of each slot (-c is slots x this).  [default: the mix's longest request + 256]")
@option("--kv-window-cells", "window_cells", hidden_aliases=("--window-cells",), type=int, callback=_positive, default=None,
        metavar="N", help="The split cells' window per slot.")
@click.option("--vram-target", type=int, callback=_positive, default=None, metavar="MIB", help="The split cells' budget instead of --kv-window-cells.")
@click.option("--kv-tail-type", "tail_type", type=click.Choice([*CACHE_TYPES, TAIL_AUTO]), default=None, metavar="TYPE",
              help="The split cells' tail K and V type (-ctkt/-ctvt): " + ", ".join(CACHE_TYPES) + ", or auto (the "
                   "planner's choice). The resident and vanilla cells keep the window's type.  [default: the window's]")
@click.option("--long", "long_sizes", type=(int, int), default=(24000, 400), show_default=True, metavar="PROMPT GEN", help="table: the long request.")
@click.option("--short", "short_sizes", type=(int, int), default=(1500, 160), show_default=True, metavar="PROMPT GEN", help="table: each short request.")
@click.option("--shorts", "n_short", type=int, callback=_positive, default=3, show_default=True, help="table: short requests per stage.")
@click.option("--ramp", "ramp_levels", default="1,2,4,8,4,2,1", show_default=True, callback=_ramp_levels, help="ramp: clients per stage.")
@click.option("--ramp-size", "ramp_sizes", type=(int, int), default=(8000, 64), show_default=True, metavar="PROMPT GEN", help="ramp: each request (+-25%).")
@click.option("--requests", "n_requests", type=int, callback=_positive, default=16, show_default=True,
              help="random: requests in the mix.")
@click.option("--arrival-mean", type=FiniteFloatRange(min=0.0, min_open=True, max=3600), default=1.5, show_default=True,
              metavar="S",
              help="random: mean seconds between arrivals (exponential gaps).")
@click.option("--prompt-range", type=(int, int), default=(300, 24000), show_default=True, callback=_range,
              metavar="LOW HIGH", help="random: prompt tokens, uniform.")
@click.option("--gen-range", type=(int, int), default=(64, 200), show_default=True, callback=_range,
              metavar="LOW HIGH", help="random: tokens generated, uniform.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="random: the draw (kept in the report).")
@click.option("--shared", "shared_sizes", type=(int, int, int), default=(20000, 500, 200), show_default=True,
              metavar="PREFIX SUFFIX GEN", callback=_shared_sizes, help="shared: the document, each client's own suffix, tokens generated.")
@click.option("--clients", "n_clients", type=int, callback=_positive, default=4, show_default=True,
              help="shared: clients on the document.")
@click.option("--cells", "cell_names", default=",".join(LOAD_CELLS_DEFAULT), show_default=True, callback=_load_cells,
              help="Servers to run the mix on: default (llama-server's own layout, no -np: 4 slots on one unified "
                   "cache, split), default-blocks (the same with --kv-windows blocks: its blocks follow the load), default-upstream "
                   "(the default with --kv-placement upstream: tokens in the first free cells), split (-np "
                   "slots, elastic windows), static (--kv-windows static), one-op (static "
                   "windows and one op over all streams: the layout before; a lab build only), resident (-np, --kv-residency-mode off), "
                   "default-resident (no -np, off), vanilla (-ngl at the default or split cell's peak VRAM; GPU only).")
@click.option("--vanilla-ngl", type=click.IntRange(min=0), default=None, help="vanilla's -ngl.  [default: the largest whose weights + KV fit the split cell's peak VRAM]")
@click.option("--gpu", "gpu_index", type=click.IntRange(min=0), default=0, show_default=True, help="GPU (NVML index) sampled for peak VRAM.")
@click.option("--request-timeout", type=FiniteFloatRange(min=1), default=1800, show_default=True,
              metavar="S", help="Give up on a request after S seconds (recorded).")
@click.option("--json", "json_out", type=NonEmptyPath(dir_okay=False, path_type=Path), default=None,
              help="The report.  [default: <date>-bench-load-<model>/bench-load.json, in docs/perf inside the checkout, else here]")
@click.option("--dry-run", is_flag=True, help="Print the cells and the schedule, run nothing.")
@click.option("--preset", type=click.Choice(sorted(LOAD_PRESETS)), default=None,
              help=f"A small load for a CPU host, minutes instead of hours: cpu-small = {LOAD_PRESET_HELP} (a flag given "
                   "as well wins).")
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED, callback=_server_args_after_dashes)
@click.pass_context
def load(ctx, model_spec, mix_name, n_slots, ctx_per_slot, window_cells, vram_target, tail_type, long_sizes, short_sizes, n_short, ramp_levels,
         ramp_sizes, n_requests, arrival_mean, prompt_range, gen_range, seed, shared_sizes, n_clients, cell_names,
         vanilla_ngl, gpu_index, request_timeout, json_out, dry_run, preset, server_args) -> None:
    """A server under a mixed load: every cell's llama-server (loopback) gets the same requests from concurrent
    clients. Reports per request the decode speed and the time to first token, per cell the tail bytes each step
    attended against those its streams occupied, peak VRAM (NVML) and host memory; JSON + table. Arguments after
    `--` go to every llama-server (e.g. -- -t 2)."""
    from rollingkv_cli.lib import builder
    from rollingkv_cli.bench import arithmetic as bm
    from rollingkv_cli.bench import gguf
    from rollingkv_cli.bench import load as lb
    from rollingkv_cli.bench import load_time
    from rollingkv_cli.bench import tail as tail_runs
    from rollingkv_cli.console import abort, console, success, warn
    from rollingkv_cli.models import resolve_model

    from rollingkv_cli.lib.residency import ResidencyConflict, ResidencyRequest

    v = _preset_values(ctx, preset, LOAD_PRESETS)
    (long_sizes, short_sizes, n_short, n_slots, ramp_levels, ramp_sizes, n_requests, prompt_range, gen_range,
     cell_names, shared_sizes, n_clients) = (v[k] for k in ("long_sizes", "short_sizes", "n_short", "n_slots", "ramp_levels",
                                                            "ramp_sizes", "n_requests", "prompt_range", "gen_range",
                                                            "cell_names", "shared_sizes", "n_clients"))
    if mix_name == "shared" and ctx.get_parameter_source("cell_names") != click.core.ParameterSource.COMMANDLINE:
        cell_names = SHARED_CELLS_DEFAULT
    try:  # the split cells' size: a window or a budget
        ResidencyRequest(window_cells=window_cells, vram_target=vram_target).check(one_size=True)
    except ResidencyConflict as e:
        raise click.UsageError(e.message) from None
    from rollingkv_cli.serve.settings import check_server_args
    from rollingkv_cli.userinput import check_native_knobs

    check_native_knobs()  # the servers' library reads them itself: refused here, not ignored or misread there
    # what each cell sets itself (serve's check: the address and the model are bench load's too)
    check_server_args(list(server_args), "after `--`", "bench load", {
        **dict.fromkeys(("-c", "--ctx-size"), "bench load's -c (slots x --ctx-per-slot)"),
        **dict.fromkeys(("-np", "--parallel"), "bench load's -np/--slots"),
        **dict.fromkeys(("--kv-residency-mode", "--kv-windows", "--kv-placement", "-fa", "--flash-attn", "--kv-share-prefix"),
                       "the cell's own settings (--cells)"),
        **dict.fromkeys(("--kv-window-cells", "--vram-target"), "bench load's --kv-window-cells/--vram-target"),
        **dict.fromkeys(("-ngl", "--n-gpu-layers", "--gpu-layers"), "the cells' -ngl (99 on a GPU; vanilla: --vanilla-ngl)"),
        **(dict.fromkeys(("-ctkt", "--cache-type-k-tail", "-ctvt", "--cache-type-v-tail"), "bench load's --kv-tail-type")
           if tail_type else {}),
    })
    model = resolve_model(model_spec)
    build = builder.active_build()
    binary = build.artifact("llama-server")
    if not binary.is_file():
        abort(f"the active build {build.dir} has no llama-server", "run `rollingkv build`")
    if "one-op" in cell_names and not build.manifest.get("lab"):
        # its switch (ROLLINGKV_DEBUG_ONE_OP_STREAMS) is an A/B lever of the lab series: a product server has no such path
        abort(f"the one-op cell needs a lab build, and {build.dir} is a product build",
              "build one with `rollingkv build --lab` and point ROLLINGKV_BUILD at it, or leave one-op out of --cells")
    if mix_name == "table":
        need = max(long_sizes[0] + long_sizes[1], short_sizes[0] + short_sizes[1])
        ctx_per_slot = ctx_per_slot or bm.pad(need + 256)
        if n_slots < n_short + 1:
            raise click.BadParameter(f"the table mix runs {n_short} short requests beside the long one: give at least "
                                     f"{n_short + 1} slots", param_hint="-np")
        mix = lb.table_mix(*long_sizes, *short_sizes, n_short, n_slots, ctx_per_slot)
        window = window_cells or (None if vram_target else bm.pad(short_sizes[0] + short_sizes[1]))
    elif mix_name == "random":
        ctx_per_slot = ctx_per_slot or bm.pad(prompt_range[1] + gen_range[1] + 256)
        mix = lb.random_mix(n_requests, arrival_mean, prompt_range, gen_range, n_slots, ctx_per_slot, seed)
        window = window_cells or (None if vram_target else bm.pad(ctx_per_slot * 3 // 8))
    elif mix_name == "shared":
        ctx_per_slot = ctx_per_slot or bm.pad(sum(shared_sizes) + 256)
        mix = lb.shared_mix(n_clients, *shared_sizes, n_slots, ctx_per_slot)
        window = window_cells or (None if vram_target else bm.pad(ctx_per_slot // 8))  # the document spills
    else:
        ctx_per_slot = ctx_per_slot or bm.pad(int(ramp_sizes[0] * 1.25) + int(ramp_sizes[1] * 1.25) + 256)
        if max(ramp_levels) > n_slots:
            warn(f"the ramp reaches {max(ramp_levels)} clients on {n_slots} slots: the extra requests queue")
        mix = lb.ramp_mix(ramp_levels, *ramp_sizes, n_slots, ctx_per_slot)
        window = window_cells or (None if vram_target else bm.pad(ctx_per_slot * 3 // 8))
    for st in mix.stages:
        for r in st.reqs:
            if r.prompt + r.gen > ctx_per_slot:
                raise click.BadParameter(f"{r.name} needs {r.prompt + r.gen} tokens, more than the {ctx_per_slot} of a slot",
                                         param_hint="--ctx-per-slot")

    if not (build.manifest.get("options") or {}).get("cuda"):  # a CPU build: every server's cache in host memory
        from rollingkv_cli.serve.settings import arg_value

        def kv_type(*flags: str) -> str:  # the servers' cache type: llama-server's f16 unless given after `--`
            return next((v for v in (arg_value(list(server_args), f) for f in flags) if v), "f16")

        gguf.check_host_kv(gguf.read_model(model), n_slots * ctx_per_slot,
                           [(kv_type("-ctk", "--cache-type-k"), kv_type("-ctv", "--cache-type-v"))],
                           f"-np {n_slots} x {ctx_per_slot} cells", "lower -np, --ctx-per-slot or the mix's sizes (--preset cpu-small)")
    gpu = None
    try:
        from rollingkv_cli.gate import vram

        nv = vram.nvml_module()
        h, gpu_name, _ = vram.open_gpu(nv, gpu_index)
        gpu = (nv, h)
    except Exception:
        gpu_name = None
    ngl = ["-ngl", "99"] if gpu is not None else []
    split = ResidencyRequest(mode="window", window_cells=window, vram_target=None if window else vram_target,
                             type_k_tail=tail_type, type_v_tail=tail_type)
    split_flags = split.server_args()
    static_flags = replace(split, windows="static").server_args()
    # the default layout's one stream holds every slot: the same device cells as n_slots windows
    default_flags = replace(split, window_cells=window * n_slots if window else None).server_args()
    resident_flags = ResidencyRequest(mode="off").server_args()
    cells = {
        "default": lb.Cell("default", [*default_flags, *ngl], slots_flag=False,
                           what="llama-server's default layout (no -np: 4 slots on one unified cache), split (its window "
                                "static); each ubatch reads only its sequences' tail blocks"),
        "default-blocks": lb.Cell("default-blocks", [*replace(split, window_cells=window * n_slots if window else None,
                                                             windows="blocks").server_args(), *ngl], slots_flag=False,
                                  what="llama-server's default layout, split with block residency (--kv-windows blocks: "
                                       "its 256-cell blocks follow the load)"),
        "default-upstream": lb.Cell("default-upstream", [*default_flags, "--kv-placement", "upstream", *ngl], slots_flag=False,
                                    what="the default cell placed as upstream places (--kv-placement upstream: the slots' "
                                         "tokens side by side in the first free cells, not in blocks of their own)"),
        "default-noshare": lb.Cell("default-noshare", [*default_flags, "--kv-share-prefix", "0", *ngl], slots_flag=False,
                                   what="the default cell with cross-slot prefix sharing off (each client prefills and "
                                        "stores the document again)"),
        "default-resident": lb.Cell("default-resident", [*resident_flags, *ngl], slots_flag=False,
                                    what="llama-server's default layout, upstream's cache whole on the device"),
        "split": lb.Cell("split", [*split_flags, *ngl],
                         what="the split cache: elastic windows (one pool of the slots' device cells), one op per stream"),
        "static": lb.Cell("static", [*static_flags, *ngl],
                          what="the same split with static windows (each slot keeps its own window)"),
        "one-op": lb.Cell("one-op", [*static_flags, *ngl], {"ROLLINGKV_DEBUG_ONE_OP_STREAMS": "1"},
                          what="static windows and one op over all streams at the longest one's cells (the layout before)"),
        "resident": lb.Cell("resident", [*resident_flags, *ngl], what="upstream's cache, whole on the device"),
        # with the default cell, vanilla takes its layout (no -np) and its VRAM; else -np and the split cell's
        "vanilla": lb.Cell("vanilla", resident_flags, slots_flag="default" not in cell_names,
                           what="upstream with -ngl at the " + ("default" if "default" in cell_names else "split") +
                                " cell's VRAM"),
    }
    todo = [cells[c] for c in cell_names]
    if "vanilla" in cell_names and gpu is None:
        warn("no GPU (NVML): the vanilla -ngl cell is left out (it needs a device to compare VRAM with)")
        todo = [c for c in todo if c.name != "vanilla"]
    from rollingkv_cli.bench.tail_setup import default_report_path

    out = json_out or default_report_path(model).with_name("bench-load.json")
    if json_out is None:
        out = out.parent.with_name(out.parent.name.replace("bench-tail", "bench-load")) / "bench-load.json"
    if not dry_run:  # said now, not after the first cell
        from rollingkv_cli.userinput import check_output_file

        check_output_file(out, "report")
    console.print(f"bench load: {mix.name} mix on {model.name}, -np {n_slots} x {ctx_per_slot} cells, "
                  f"{'window ' + str(window) if window else 'vram target ' + str(vram_target) + ' MiB'}; "
                  f"cells {', '.join(c.name for c in todo)}; {gpu_name or 'no GPU'}", soft_wrap=True)
    # what the servers will be sent and how long that may take here, before the first one starts
    from rollingkv_cli.bench import estimate

    reqs = [r for st in mix.stages for r in st.reqs]
    console.print(estimate.load_line(gguf.read_model(model), [(r.prompt, r.gen) for r in reqs], len(todo),
                                     threads=estimate.server_threads(list(server_args)),
                                     backend="CUDA" if (build.manifest.get("options") or {}).get("cuda") else "CPU",
                                     preset=preset, last_arrival_s=max((r.at_s for r in reqs), default=0.0)),
                  markup=False, soft_wrap=True)
    if dry_run:
        for st in mix.stages:
            console.print(f"  stage {st.name}: " + ", ".join(f"{r.name} {r.prompt}+{r.gen}" + (f" at {r.at_s:g}s" if st.arrivals else "")
                                                          for r in st.reqs), soft_wrap=True)
        for c in todo:
            np_flag = f"-np {n_slots} " if c.slots_flag else ""
            console.print(f"  {c.name}: llama-server -c {n_slots * ctx_per_slot} {np_flag}-fa on {' '.join(c.args)} "
                          f"{' '.join(server_args)}" + (f"  ({' '.join(f'{k}={v}' for k, v in c.env.items())})" if c.env else ""),
                          soft_wrap=True)
        return
    doc = {"schema": lb.SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": str(model), "build": str(build.dir),
           "gpu": gpu_name, "mix": mix.to_json(), "window_cells": window, "vram_target_mib": vram_target,
           "server_args": list(server_args), "cells": []}
    log_dir = out.parent / "logs"
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    n_req = sum(len(st.reqs) for st in mix.stages)
    stopped = 0
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} requests"),
                      TimeElapsedColumn(), console=console, transient=True) as prog:
            for c in todo:
                if c.name == "vanilla":
                    split = next((x for x in doc["cells"] if x["name"] == "default"), None) or \
                        next((x for x in doc["cells"] if x["name"] == "split"), None)
                    n = vanilla_ngl
                    if n is None:
                        peak = (split or {}).get("vram_peak_mib")
                        if not peak:
                            warn("the split cell has no VRAM figure: vanilla is left out (give --vanilla-ngl)")
                            continue
                        info = gguf.read_model(model)
                        kv_layer = [b * n_slots * ctx_per_slot for b in info.kv.layer_row_bytes("f16", "f16")]
                        n, _ = bm.choose_ngl(info.weights, kv_layer, int(peak * lb.MIB))
                    c = lb.Cell("vanilla", [*c.args, "-ngl", str(n)], what=f"{c.what} (-ngl {n})", slots_flag=c.slots_flag)
                task = prog.add_task(f"{c.name}", total=n_req)
                rec = lb.run_cell(c, binary, model, mix, log_dir, request_timeout, gpu, list(server_args),
                                  on_done=lambda r, t=task: prog.advance(t))
                if rec["status"] == "failed" and "llama.cpp could not load the model" in str(rec.get("error")):
                    # every cell loads the same file: they failed in turn, then "✓ report" of nothing and exit 1
                    abort(f"cell {c.name}: {rec['error']}", "the file is corrupt or not a model this build runs; no "
                          "report written")
                if rec["status"] == "failed":  # why, now (the table only says "failed")
                    warn(f"cell {c.name} failed: {rec.get('error')}" + (f" ({rec['hint']})" if rec.get("hint") else ""))
                doc["cells"].append(rec)
                tail_runs.write_json(out, doc)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, SIGHUP: the running cell's server is stopped (run_cell's finally)
        from rollingkv_cli.lib.procs import signal_name, stop_signum

        stopped = stop_signum(e) or 2
        if not doc["cells"]:  # an empty report replaced an earlier one at --json, and was announced with a ✓
            warn(f"{'interrupted' if stopped == 2 else 'stopped'} by {signal_name(stopped)} before any cell was measured: "
                 f"no report written" + (f" ({out} is as it was)" if out.exists() else ""))
            raise SystemExit(128 + stopped) from None
        warn(f"{'interrupted' if stopped == 2 else 'stopped'} by {signal_name(stopped)}: the report keeps the cells measured so far")
    load_time.add_floors(doc)
    doc["targets"] = lb.evaluate_targets(doc)
    tail_runs.write_json(out, doc)
    lb.print_report(doc)
    success(f"report: {out}")
    if stopped:
        raise SystemExit(128 + stopped)  # the signal's status, after the report (the line above said which)
    if any(c.get("status") != "ok" for c in doc["cells"]):
        raise click.exceptions.Exit(1)


def _load_report(path: Path) -> dict:
    from rollingkv_cli.bench import tail as tail_runs, tail_report
    from rollingkv_cli.console import abort
    from rollingkv_cli.userinput import read_json

    doc = read_json(path, "report")
    if not isinstance(doc, dict) or doc.get("schema") != tail_runs.SCHEMA:
        abort(f"{path} is not a `rollingkv bench tail` report", f"expected schema {tail_runs.SCHEMA}")
    problem = tail_report.report_problem(doc)
    if problem:
        abort(f"{path} is a malformed `rollingkv bench tail` report: {problem}",
              "make a new one with `rollingkv bench tail`")
    return doc


@bench.command(short_help="Draw the PNG of a bench tail report.")
@click.argument("report", type=NonEmptyPath(path_type=Path))
@click.option("-o", "--output", type=NonEmptyPath(dir_okay=False, path_type=Path), default=None,
              help="The PNG.  [default: REPORT with .png]")
def plot(report: Path, output: Path | None) -> None:
    """Draw the PNG of a `bench tail` report (needs matplotlib: pip install 'rollingkv[plot]')."""
    from rollingkv_cli.bench import plot as plotting
    from rollingkv_cli.console import abort, success

    doc = _load_report(report)
    if not plotting.have_matplotlib():
        abort("matplotlib is not installed", "pip install 'rollingkv[plot]' (or pip install matplotlib)")
    out = output or report.with_suffix(".png")
    from rollingkv_cli.userinput import check_output_file

    check_output_file(out, "plot")  # a device (-o /dev/full) said "✓ plot: /dev/full"
    try:
        plotting.render(doc, out)
    except OSError as e:
        abort(f"cannot write the plot {out}: {e.strerror or e}", "give another path with -o")
    success(f"plot: {out}")


@bench.command(short_help="Print a bench tail report's tables again.")
@click.argument("report", type=NonEmptyPath(path_type=Path))
def show(report: Path) -> None:
    """Print the tables and targets of a `bench tail` report (a partial one too)."""
    from rollingkv_cli.bench import tail as tail_runs, tail_report

    doc = _load_report(report)
    tail_runs.refresh(doc)
    tail_report.print_report(doc)
