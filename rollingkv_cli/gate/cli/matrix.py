"""`gate matrix`: equiv over tail types x split points, the exactness cells and the needle (gate/matrix.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from rollingkv_cli.cliopts import NonEmptyPath, model_argument, threads_in_range
from rollingkv_cli.gate.cli.options import build_options, fraction_list, ngl_option, positive, tail_type_list
from rollingkv_cli.gate.common import EXIT_FAIL, EXIT_INCONCLUSIVE


@click.command(short_help="gate equiv over tail types x windows, and the needle.")
@model_argument(default="demo")
@click.option("--tokens", "n_tokens", type=int, callback=positive, default=1024, show_default=True,
              help="Synthetic tokens decoded teacher-forced per equivalence cell.")
@click.option("--splits", callback=fraction_list, default="0.25,0.5,0.75", show_default=True,
              help="Window sizes as fractions of the sequence (the window holds the oldest positions).")
@click.option("--tail-types", callback=tail_type_list, default="f16,q8_0,q4_0,auto", show_default=True,
              help="Tail K/V types (the window is f16); auto: the planner's choice, bounded by the auto profile.")
@click.option("--exact-split", type=float, default=0.5, show_default=True,
              help="Window fraction of the exactness cells (quantized window + same tail vs the resident quantized cache).")
@click.option("--needle/--no-needle", default=True, show_default=True, help="Also run the needle gate (f16 tail).")
@click.option("--needle-filler-tokens", type=int, callback=positive, default=1536, show_default=True, help="The needle's filler length.")
@click.option("--needle-depths", callback=fraction_list, default="0.5,0.85", show_default=True, help="The needle's placements.")
@click.option("--thresholds", "thresholds_file", type=NonEmptyPath(path_type=Path), default=None,
              help="YAML/JSON file overriding the default bounds (as for gate equiv).")
@click.option("--tolerance", type=float, default=None, metavar="TV",
              help="Same-type cells on the CPU: accept a mean TV up to TV instead of requiring bit-identical logits (as gate equiv).")
@click.option("--order-floor/--no-order-floor", default=None,
              help="Bounds relaxed to the resident run's own floating-point order floor (as gate equiv --order-floor).  "
                   "[default: on for the CUDA backend, off on the CPU, where the split is bit-identical]")
@click.option("--threads", type=int, callback=threads_in_range, default=None, help="CPU threads per run.  [default: all cores]")
@click.option("--n-batch", type=int, callback=positive, default=512, show_default=True, help="Tokens per llama_decode.")
@ngl_option()
@build_options
@click.option("--out", "out_dir", type=NonEmptyPath(file_okay=False, path_type=Path), default=None,
              help="Where NAME.json and NAME.md go.  [default: the checkout's docs/gates when run inside the rollingkv "
                   "repository, else the current directory]")
@click.option("--name", default=None,
              help="Report file name.  [default: <date>-<host>-<backend> in docs/gates, gate-matrix-<date>-<host>-<backend> "
                   "elsewhere; -2, -3, ... added when that report exists]")
@click.option("--force", is_flag=True, help="Replace the reports NAME.json and NAME.md of an explicit --name if they exist.")
@click.option("--work-dir", type=NonEmptyPath(file_okay=False, path_type=Path), default=None,
              help="Where the reference logits are kept during the run.  [default: the temp dir]")
def matrix(model_spec, n_tokens, splits, tail_types, exact_split, needle, needle_filler_tokens, needle_depths, thresholds_file,
           tolerance, order_floor, threads, n_batch, n_gpu_layers, build_dir, lib_dir, out_dir, name, force, work_dir) -> None:
    """The gates over tail types x split points: one JSON report and a markdown table.

    Per tail type T and split S: the f16-window + T-tail cache with a window of S x the sequence against
    the resident f16 cache (same-type bounds for f16; for a quantized T, the quantized bounds relative to
    the resident T cache, as `gate equiv --tail-baseline`); per quantized T, a T window + T tail against
    the resident T cache (must be exact); the auto row (the planner's tail type, the auto bounds over the
    positions that read the tail); and the needle gate. Every cell reuses one reference decode.

    Exit status: 0 every cell passes, 1 one fails (or an error), 2 usage error, 4 every cell passes but the
    needle is inconclusive (the model misses it even resident).
    """
    from rollingkv_cli import models
    from rollingkv_cli.gate import common
    from rollingkv_cli.gate import matrix as matrix_runs
    from rollingkv_cli.console import abort, console, note, usage_error

    if build_dir is not None and lib_dir is not None:
        raise click.UsageError("give --build or --lib-dir, not both")
    if not 0 < exact_split < 1:
        raise click.BadParameter("must be a fraction strictly between 0 and 1", param_hint="'--exact-split'")
    if name is not None and not name.strip():  # it said "a plain file name (no '/')" of ''
        raise click.BadParameter("an empty name (an unset shell variable?): give a plain file name",
                                 param_hint="'--name'")
    if name is not None and ("/" in name or name.startswith(".")):
        raise click.BadParameter("a plain file name (no '/', not starting with '.')", param_hint="'--name'")
    if tolerance is not None and not 0 <= tolerance <= 1:
        raise click.BadParameter("a mean total variation, between 0 and 1", param_hint="'--tolerance'")
    if n_tokens < 16:
        usage_error(f"--tokens {n_tokens} is too short for windows at {', '.join(f'{s:g}' for s in splits)} of it", "use at least 16")
    model_path = models.resolve_model(model_spec, log=note)
    build = common.resolve_build(build_dir, lib_dir)
    if needle:
        build.require_server()
    tmp_root = common.work_root(work_dir)
    out_dir, name = matrix_runs.report_place(out_dir, name, matrix_runs.backend_label(build, n_gpu_layers), force)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        abort(f"cannot create --out {out_dir}: {e.strerror or e}")
    cfg = matrix_runs.MatrixConfig(model=model_path, model_spec=model_spec, build=build, tokens=n_tokens, splits=tuple(splits),
                                   tail_types=tuple(tail_types), exact_split=exact_split, needle=needle,
                                   needle_filler_tokens=needle_filler_tokens, needle_depths=tuple(needle_depths),
                                   thresholds_file=thresholds_file,
                                   order_floor=build.on_gpu(n_gpu_layers) if order_floor is None else order_floor, tolerance=tolerance,
                                   threads=threads or os.cpu_count() or 1, n_batch=n_batch,
                                   n_gpu_layers=n_gpu_layers, argv=_argv_after("matrix"))
    r = matrix_runs.run(cfg, console, common.logs_dir(), tmp_root)
    jp, mp = matrix_runs.write_outputs(r, out_dir, name)
    _print_matrix(console, r)
    note(f"report: {jp}\ntable:  {mp}")
    if r["verdict"] == "pass":
        console.print("[bold green]PASS[/] every cell holds its bounds" + (" and the needle is retrieved exactly" if needle else ""))
        return
    if r["verdict"] == "inconclusive":
        console.print("[bold yellow]INCONCLUSIVE[/] every cell passes, but the model does not retrieve the needle even fully resident")
        sys.exit(EXIT_INCONCLUSIVE)
    what = list(r["failed_cells"]) + (["needle"] if r.get("needle") and r["needle"]["verdict"] == "fail" else [])
    console.print("[bold red]FAIL[/] " + ", ".join(what), soft_wrap=True)
    sys.exit(EXIT_FAIL)


def _argv_after(word: str) -> list[str]:
    argv = list(sys.argv[1:])
    return argv[argv.index(word) + 1:] if word in argv else []


def _print_matrix(console, r: dict) -> None:
    from rich.table import Table

    from rollingkv_cli.gate.matrix import _g

    floor = " (tail positions over the order floor's per-position bound)" if r.get("order_floors") else ""
    t = Table(title=f"gate matrix: mean TV / real flips{floor} vs resident f16 ({r['tokens']['n']} tokens)", title_justify="left")
    t.add_column("tail")
    by = {(c["tail"], c["split"]): c for c in r["cells"]}
    for s in r["splits"]:
        w = next((c["window_cells"] for c in r["cells"] if c["split"] == s), "?")
        t.add_column(f"window {s:g} ({w})", justify="right")
    t.add_column("baseline (resident)", justify="right")
    for ty in r["tail_types"]:
        row = [ty]
        for s in r["splits"]:
            c = by.get((ty, s))
            if c is None:
                row.append("")
                continue
            m = c["metrics"]
            if c["profile"] == "auto":  # the planner's type; its loss over the positions that read the tail
                ch, tm = c.get("tail_types_chosen") or {}, m.get("tail") or {}
                row.append(f"{'[green]✓[/]' if c['passed'] else '[bold red]✗[/]'} →{ch.get('k')}/{ch.get('v')}: tail "
                           f"{_g(tm.get('mean_tv'))}, p99 {_g(tm.get('p99_tv'))}")
                continue
            of = m.get("over_floor")
            over = f" ({of['n_over']}/{of['n']} over floor)" if of and of.get("bound_tv") is not None else ""
            row.append(f"{'[green]✓[/]' if c['passed'] else '[bold red]✗[/]'} {_g(m['mean_tv'])} / {_g(m['real_frac'])}{over}")
        bl = r["baselines"].get(ty)
        row.append(f"{_g(bl['metrics']['mean_tv'])} / {_g(bl['metrics']['real_frac'])}" if bl else "[dim]–[/]")
        t.add_row(*row)
    console.print(t)
    for c in r["exact"]:
        m = c["metrics"]
        console.print(f"{'[green]✓[/]' if c['passed'] else '[bold red]✗[/]'} {c['type']} window + {c['type']} tail vs resident {c['type']}: "
                      f"mean TV {_g(m['mean_tv'])}, {m.get('bitwise_equal_rows')}/{m['n']} rows bitwise identical"
                      + (f", {m['over_floor']['n_over']}/{m['over_floor']['n']} tail positions over the order floor"
                         if (m.get("over_floor") or {}).get("bound_tv") is not None else ""))
    nd = r.get("needle")
    if nd:
        mark = {"pass": "[green]✓[/]", "fail": "[bold red]✗[/]", "inconclusive": "[yellow]?[/]"}[nd["verdict"]]
        console.print(f"{mark} needle: " + ", ".join(
            f"depth {p['depth']:g} ({p['number']}): {p['verdict']}" for p in nd["placements"]))
