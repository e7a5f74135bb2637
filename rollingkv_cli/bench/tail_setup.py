"""bench tail's work before and after the cells, without click: the run's configuration from the command's options
(the build, the model's shapes, the cells and their plans, the report document), what is printed before the cells run
(and all a --dry-run prints), and the run with its plot. bench/cli.py is the click layer; tail.py runs the cells."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rollingkv_cli.bench import gguf, tail_grid
from rollingkv_cli.kvtypes import TAIL_AUTO


@dataclass
class TailRun:
    """Everything a bench tail run needs, and the report document it fills in (doc["cells"]: in the order they run)."""

    cfg: tail_grid.TailConfig
    build: object  # builder.Build
    info: gguf.ModelInfo
    plans: dict
    doc: dict
    vanilla_desc: str


def default_report_path(model: Path) -> Path:
    """<date>-bench-tail-<model>/bench-tail.json, a new folder per run (-2, -3, ... when one exists): in the checkout's
    docs/perf when run inside the rollingkv repository (docs/perf keeps one folder per record, its README.md discussing
    the raw files beside it), else in the current directory (it wrote into the checkout's docs/perf from anywhere, and
    created ./docs/perf outside a checkout). Created when the report is first written (a dry run creates nothing)."""
    from rollingkv_cli.lib import paths

    repo_perf = paths.REPO_ROOT / "docs" / "perf"
    in_repo = repo_perf.is_dir() and Path.cwd().resolve().is_relative_to(paths.REPO_ROOT.resolve())
    base = repo_perf if in_repo else Path.cwd()
    stem = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in model.stem)
    d = base / f"{time.strftime('%Y-%m-%d')}-bench-tail-{stem}"
    n = 2
    while d.exists():
        d = base / f"{time.strftime('%Y-%m-%d')}-bench-tail-{stem}-{n}"
        n += 1
    return d / "bench-tail.json"


def hybrid_fractions(cpu_fracs: list, explicit: bool, backend: str, build) -> list:
    """The CPU fractions the hybrid cells run at: none on a CPU build (it attends the whole cache on the CPU already)
    or a build before the hybrid tail; --cpu-fracs given explicitly there is refused."""
    from rollingkv_cli.console import abort, usage_error
    from rollingkv_cli.serve.launch import build_has_tail_cpu

    if not cpu_fracs:
        return []
    if backend != "CUDA":
        if explicit:
            usage_error("--cpu-fracs: hybrid cells need a CUDA build: a CPU build attends the whole tail on the CPU already",
                        "give --cpu-fracs none, or run a CUDA build")
        return []
    if not build_has_tail_cpu(build.lib_dir / "libllama.so"):
        if explicit:
            abort(f"the build {build.dir} predates the hybrid tail: its llama-bench has no --kv-tail-cpu-frac",
                  "rebuild with `rollingkv build`, or give --cpu-fracs none")
        return []  # the default on a build without the CPU part: the window cells are what it does
    return cpu_fracs


def prepare(model_spec: str, *, depths: list[int], n_gen: int, reps: int, vanilla_reps: int | None, tail_types: list[str],
            fractions: list[float], mixed_fractions: list[float], cpu_fracs: list, cpu_fracs_explicit: bool,
            head_fractions: list[float], window_type: str, vanilla_bench: Path | None, skip: tuple[str, ...],
            threads: int | None, slot_ring_mib: int | None, pcie_bw_gbps: float | None, gpu_index: int, cell_timeout: float | None,
            time_budget: float | None, out: Path | None, dry_run: bool, plot: bool, preset: str | None = None) -> TailRun:
    """The checked run: the model, the active build and what it can do, the report path (checked now unless a dry run),
    the cells. out None: a new folder in docs/perf (default_report_path). One line and exit 1 (2 for usage) on what cannot
    run."""
    from rollingkv_cli import models
    from rollingkv_cli.bench import tail as tail_runs
    from rollingkv_cli.console import abort, note
    from rollingkv_cli.lib import builder
    from rollingkv_cli.userinput import check_native_knobs

    check_native_knobs()  # llama-bench's library reads them: refused here, not ignored or clamped there
    model = models.resolve_model(model_spec, log=note)
    build = builder.active_build()
    bench_bin = build.artifact("llama-bench")
    if not bench_bin.is_file():
        abort(f"the build {build.dir} has no llama-bench", "run `rollingkv build` (it builds llama-bench)")
    info = gguf.read_model(model)
    for t in sorted({window_type, *tail_types} - {TAIL_AUTO}):  # auto: whatever the planner picks fits (it checks)
        try:
            info.kv.row_bytes(t, t)
        except ValueError as e:
            abort(f"cache type {t} does not fit this model: {e}", "leave it out of --tail-types / --window-type")
    vanilla_desc = (f"unpatched build: {vanilla_bench}" if vanilla_bench else
                    "our build with --kv-residency-mode off (bit-identical to the unpatched pin: tested in CI)")
    backend = "CUDA" if (build.manifest.get("options") or {}).get("cuda") else "CPU"
    if backend == "CPU":
        from rollingkv_cli.bench import arithmetic

        for d in depths:
            gguf.check_host_kv(info, arithmetic.kv_size(d, n_gen), [(window_type, window_type)], f"depth {d}",
                               "lower -d/--depth (--preset cpu-small runs 2048)")
    cpu_fracs = hybrid_fractions(cpu_fracs, cpu_fracs_explicit, backend, build)
    if head_fractions:
        from rollingkv_cli.serve.launch import build_has_head_split

        if not build_has_head_split(build.lib_dir / "libllama.so"):
            abort(f"the build {build.dir} predates the head split (rolling-KV API 5): its llama-bench refuses head mode",
                  "rebuild with `rollingkv build`, or drop --head-fractions")
        if min(info.n_head_kv) < 2:
            abort(f"{model.name} has a layer with one KV head (MQA): it cannot split by head", "drop --head-fractions")
    from rollingkv_cli.serve.launch import build_has_tail_cpu

    hybrid_build = backend == "CUDA" and build_has_tail_cpu(build.lib_dir / "libllama.so")
    out = out or default_report_path(model)
    if not dry_run:  # said now, not after the first cell
        from rollingkv_cli.userinput import check_output_file

        check_output_file(out, "report")
    cfg = tail_grid.TailConfig(
        model=model, bench=bench_bin, build_dir=build.dir, backend=backend, depths=depths, n_gen=n_gen, reps=reps,
        vanilla_reps=vanilla_reps or reps, tail_types=tail_types, fractions=fractions, mixed_fractions=mixed_fractions,
        cpu_fracs=cpu_fracs, head_fractions=head_fractions, hybrid_build=hybrid_build, window_type=window_type, threads=threads,
        ring_bytes=(slot_ring_mib << 20) if slot_ring_mib is not None else tail_grid.default_ring_bytes(),
        skip=tuple(skip), vanilla_bench=vanilla_bench, cell_timeout=cell_timeout, time_budget=time_budget,
        pcie_bw_gbps=pcie_bw_gbps, gpu=gpu_index, out=out, plot=plot, preset=preset)
    plans = {d: tail_grid.depth_plan(cfg, info, d) for d in depths}
    doc = tail_runs.new_document(cfg, build, info, plans, vanilla_desc)
    return TailRun(cfg=cfg, build=build, info=info, plans=plans, doc=doc, vanilla_desc=vanilla_desc)


def print_setup(run: TailRun) -> None:
    """The model, the vanilla cells' build, each depth's VRAM budget and -ngl choice, the model's notes."""
    from rollingkv_cli.console import console, esc, warn

    info, model, build = run.info, run.cfg.model, run.build
    console.print(f"model {esc(model.name)}: {info.n_layer} layers, {info.n_head_kv[0]} KV heads x {info.head_dim_k}, "
                  f"{info.weights.device_bytes_all / 2**30:.2f} GiB of weights on the device at -ngl 99; build {esc(build.dir.name)} "
                  f"({run.cfg.backend})", soft_wrap=True)
    console.print(f"vanilla: {run.vanilla_desc}", soft_wrap=True, markup=False)
    for d, p in run.plans.items():
        b, g = p["budget"], p["ngl"]
        console.print(f"depth {d}: kv_size {p['kv_size']}; VRAM of the 50%-tail run (window {p['window_cells_50pct']}): "
                      f"{b['weights_bytes'] / 2**30:.2f} GiB weights + {b['window_kv_bytes'] / 2**30:.2f} GiB window KV + "
                      f"{b['slot_ring_bytes'] / 2**20:.0f} MiB ring = {b['total_bytes'] / 2**30:.2f} GiB -> vanilla -ngl {g['n_gpu_layers']} "
                      f"({g['device_bytes'] / 2**30:.2f} GiB)" + (" (everything fits)" if g["all_fit"] else ""), soft_wrap=True)
    for n in info.notes:
        warn(n)


def print_dry_run(doc: dict, estimate: str | None = None) -> None:
    """The cells in the order they would run, what they would take (estimate), and each one's command line (never
    wrapped: they are for copying)."""
    from rich.table import Table

    from rollingkv_cli.bench import tail_report
    from rollingkv_cli.console import esc

    t = Table(title=f"{len(doc['cells'])} cells, in the order they would run (their commands below)")
    for col in ("#", "cell", "depth", "window", "tail MB/tok"):
        t.add_column(col, overflow="fold")
    for i, c in enumerate(doc["cells"], 1):
        t.add_row(str(i), esc(c["label"]), str(c["depth"]), "-" if c["window_cells"] is None else str(c["window_cells"]),
                  f"{c['tail_bytes_per_token'] / 1e6:.3g}" if c["kind"] in ("window", "hybrid", "head") else "-")
    out_console = tail_report.report_console()
    out_console.print(t)
    if estimate:
        out_console.print(estimate, markup=False, highlight=False, soft_wrap=True)
    for i, c in enumerate(doc["cells"], 1):
        out_console.print(f"# {i}\n{c['command']}", markup=False, highlight=False, soft_wrap=True)


def run_and_report(run: TailRun, resume: bool) -> dict:
    """Run the cells (tail.run: the report rewritten after each), print the tables and targets, draw the PNG (a plot
    never costs the measurements). The finished report."""
    from rollingkv_cli.bench import plot as plotting, tail as tail_runs, tail_report
    from rollingkv_cli.console import console, note, warn

    doc = tail_runs.run(run.cfg, run.doc, run.info, resume)
    tail_report.print_report(doc)
    out = run.cfg.out
    if run.cfg.plot:
        png = out.with_suffix(".png")
        if plotting.have_matplotlib():
            try:
                plotting.render(doc, png)
                doc["png"] = str(png)
                tail_runs.write_json(out, doc)
                console.print(f"plot: {png}", markup=False)
            except Exception as e:  # a plot must never cost the measurements
                warn(f"could not draw {png}: {e}")
        else:
            note(f"matplotlib is not installed: no PNG; `rollingkv bench plot {out}` draws it where it is "
                 "(pip install 'rollingkv[plot]')")
    console.print(f"report: {out}", markup=False)
    return doc
