"""`rollingkv probe`: what the hardware gives the KV stream (the PCIe link, for now)."""

from __future__ import annotations

import json

import click


@click.group(short_help="Inspect the hardware that rollingkv plans with.")
def probe() -> None:
    """Inspect the hardware that rollingkv plans with."""


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _triple(figures: dict | None) -> str:
    if not figures:
        return "-"
    from rollingkv_cli.hw.pcie import SIZES_MIB

    return " ".join(f"{_fmt(figures.get(str(m))):>5}" for m in SIZES_MIB)


@probe.command(short_help="Each GPU's PCIe link and its measured speed.")
@click.option("--refresh", is_flag=True, help="Measure again even where a cached measurement exists.")
@click.option("--no-measure", is_flag=True, help="Never measure: NVML/sysfs link data and cached measurements only.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of the table.")
@click.option("--gpu", "gpu_index", type=click.IntRange(min=0), default=None, metavar="N", help="Only GPU N (NVML index).")
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None, metavar="N",
              help="CPU threads of the CPU attention calibration.  [default: the CPU part's, every CPU but one or $ROLLINGKV_CPU_PART_THREADS]")
def pcie(refresh: bool, no_measure: bool, as_json: bool, gpu_index: int | None, threads: int | None) -> None:
    """Show each NVIDIA GPU's PCIe link and the host<->GPU bandwidth the server will plan with.

    Per GPU: the link generation and width now and at most (flagged "downtrained" when it runs below
    what GPU and slot allow), its theoretical per-direction GB/s, pinned host-to-device and device-to-host
    copies of 1, 16 and 256 MiB measured through the CUDA runtime (cached in <cache>/pcie/profile.json
    per GPU UUID and driver; --refresh measures again), and the resolved bandwidth with its tier:
    explicit ($ROLLINGKV_PCIE_BW_GBPS) > measured > theoretical x 0.85 > default 6.5 GB/s.

    Also the CPU decode attention's GB/s for f16, q8_0 and q4_0 tails at -t threads, measured by the active
    build's libllama (in a child process) and cached in the same profile per CPU, thread count and build: what
    the hybrid tail splits the host tail with (`serve` passes it as --cpu-attn-gbps). Without a build it is not
    measured (the kernel is the build's code); without an NVIDIA GPU neither is (there is no host tail to split).

    \b
    Exit codes:
      0  the GPUs were described (a failed or skipped measurement only warns)
      1  a bad $ROLLINGKV_PCIE_BW_GBPS, or --gpu N names no GPU
      3  no NVIDIA GPU found (no driver, no NVML, or no device); with --json
         the document is {"gpus": [], "error": "no NVIDIA GPU found"}
    """
    from rollingkv_cli.lib import paths
    from rollingkv_cli.hw import cudart, pcie as link, profile
    from rollingkv_cli.console import abort, console, err_console, esc, note, warn

    if refresh and no_measure:
        raise click.UsageError("--refresh and --no-measure contradict each other")
    paths.pcie_bw_env()  # refuse a bad value before spending time measuring
    try:
        gpus = link.discover()
    except link.NoGpuError:
        if as_json:
            click.echo(json.dumps({"gpus": [], "error": link.NO_GPU_MESSAGE}, indent=2))
        raise
    shown = gpus
    if gpu_index is not None:
        shown = [g for g in gpus if g.index == gpu_index]
        if not shown:
            abort(f"--gpu {gpu_index}: no such GPU", f"GPUs found: {', '.join(str(g.index) for g in gpus)}")

    entries = profile.load_profile()
    errors: dict[int, str] = {}
    if not no_measure:
        cuda_missing = False
        for g in shown:
            if profile.cached_measurement(g, entries) is not None and not refresh:
                continue
            if cuda_missing:
                errors[g.index] = "no CUDA runtime (libcudart) found"
                continue
            try:
                if as_json:
                    m = cudart.measure(g)
                else:
                    with err_console.status(f"measuring GPU {g.index} ({esc(g.name)}): pinned copies of 1, 16, 256 MiB"):
                        m = cudart.measure(g)
            except cudart.CudaUnavailable as e:
                cuda_missing = True
                errors[g.index] = str(e)
                warn(f"{e}: not measuring, theoretical figures only (install the CUDA runtime or set LD_LIBRARY_PATH)")
                continue
            except cudart.MeasureError as e:
                errors[g.index] = str(e)
                warn(f"GPU {g.index}: measuring failed: {e}")
                continue
            profile.save_measurement(g, m)
            entries = profile.load_profile()

    cpu = _cpu_attn(refresh, no_measure, as_json, threads)

    rows = []
    for g in shown:
        entry = profile.cached_measurement(g, entries)
        gen, width, loaded = link.effective_link(g, entry)
        res = link.resolve_bandwidth(g.index, gpus=gpus, entries=entries)
        rows.append((g, entry, loaded, link.is_downtrained(g, entry), res, gen, width))

    if as_json:
        doc = {
            "gpus": [
                {
                    "index": g.index,
                    "name": g.name,
                    "uuid": g.uuid,
                    "driver_version": g.driver_version,
                    "pci_bus_id": g.pci_bus_id,
                    "link": {
                        "current": {"gen": g.cur_gen, "width": g.cur_width},
                        "max": {"gen": g.max_gen, "width": g.max_width},
                        "gpu_max_gen": g.gpu_max_gen,
                        "under_load": {"gen": gen, "width": width} if loaded else None,
                        "downtrained": down,
                        "source": g.source,
                    },
                    "theoretical_gbps": {
                        "current": _round(link.theoretical_gbps(gen, width)),
                        "max": _round(g.theoretical_max),
                    },
                    "measured": entry,
                    "measure_error": errors.get(g.index),
                    "resolved": {"gbps": res.gbps, "tier": res.tier, "detail": res.detail},
                }
                for g, entry, loaded, down, res, gen, width in rows
            ],
            "cpu_attn": cpu,
            "profile": str(profile.profile_path()),
            "efficiency": link.EFFICIENCY,
        }
        click.echo(json.dumps(doc, indent=2))
        return

    from rich import box
    from rich.table import Table

    t = Table(title="PCIe host<->GPU links, GB/s (10^9 B/s) per direction", title_justify="left", box=box.SIMPLE_HEAD,
              pad_edge=False)
    t.add_column("GPU", no_wrap=True)
    t.add_column("link", no_wrap=True)
    t.add_column("line\nrate", justify="right", no_wrap=True)
    t.add_column(f"measured {'/'.join(map(str, link.SIZES_MIB))} MiB", no_wrap=True)
    t.add_column("resolved", no_wrap=True)
    for g, entry, loaded, down, res, gen, width in rows:
        linkcell = f"now Gen{gen or '?'} x{width or '?'}\nmax {g.link_str('max')}"
        if down:
            linkcell += "\n[bold red]downtrained[/]" + ("[dim]?[/]" if _maybe_idle(g, loaded, width) else "")
        measured = f"H2D {_triple(entry.get('h2d'))}\nD2H {_triple(entry.get('d2h'))}" if entry else "-"
        t.add_row(
            f"{g.index} {esc(g.name)}\n[dim]{esc(g.pci_bus_id)}[/]",
            linkcell,
            _fmt(link.theoretical_gbps(gen, width)),
            measured,
            f"[bold]{res.gbps:.1f}[/]\n{res.tier}",
        )
    console.print(t)
    for g, entry, loaded, down, res, gen, width in rows:
        if entry:
            note(f"GPU {g.index}: measured {entry.get('measured_at')} with {entry.get('cudart')} (CUDA {entry.get('cudart_version')})")
        if down:
            why = ("read at idle, when GPUs may lower the generation to save power: measuring reads it under load"
                   if _maybe_idle(g, loaded, width) else "under load" if loaded else "fewer lanes than the slot has")
            warn(f"GPU {g.index}: link runs at Gen{gen} x{width} of Gen{g.max_gen} x{g.max_width} ({why}); "
                 "check the slot, riser and BIOS PCIe settings")
        note(f"GPU {g.index}: resolved {res.gbps:.2f} GB/s ({res.tier}: {res.detail})")
    _print_cpu_attn(cpu)
    note(f"cache: {profile.profile_path()}")


def _cpu_attn(refresh: bool, no_measure: bool, quiet: bool, threads: int | None) -> dict:
    """The CPU attention part of the profile at `threads` for the active build: cached, or measured now (a failure
    only warns, as a failed link measurement does). The JSON's cpu_attn object."""
    from rollingkv_cli.lib import builder
    from rollingkv_cli.hw import cpu_attn, profile
    from rollingkv_cli.console import err_console, warn

    n = threads or cpu_attn.part_threads()
    out = {"n_threads": n, "threads_source": "-t" if threads else "the CPU part's (every CPU but one, or $ROLLINGKV_CPU_PART_THREADS)",
           "build": None, "gbps": None, "errors": {}, "measured_at": None, "source": None, "error": None}
    b = builder.active_build(required=False)
    if b is None:
        out["error"] = "no rollingkv build: the CPU attention is measured by its libllama (`rollingkv build`)"
        return out
    out["build"] = b.dir.name
    entry = profile.cached_cpu_attn(n, b.dir.name)
    source = "cached" if entry is not None else None
    if (entry is None or refresh) and not no_measure:
        try:
            if quiet:
                result = cpu_attn.measure(b.lib_dir, n)
            else:
                with err_console.status(f"measuring the CPU decode attention on {n} threads (f16, q8_0, q4_0 tails of 256 MiB)"):
                    result = cpu_attn.measure(b.lib_dir, n)
            entry, source = profile.save_cpu_attn(n, b.dir.name, result), "measured now"
        except cpu_attn.Unavailable as e:
            out["error"] = e.message
            warn(f"CPU attention: {e.message}" + (": rebuild with `rollingkv build`" if e.kind == "no_function" else ""))
        except ValueError as e:  # nothing usable came back
            out["error"] = str(e)
            warn(f"CPU attention: {e}")
    if entry is not None:
        out.update(gbps=entry["gbps"], errors=entry.get("errors") or {}, measured_at=entry["measured_at"], source=source,
                   build_info=entry.get("build_info"))
    elif out["error"] is None:
        out["error"] = "not measured (--no-measure) and nothing cached"
    return out


def _print_cpu_attn(cpu: dict) -> None:
    from rollingkv_cli.console import console, esc, note

    if not cpu.get("gbps"):
        note(f"CPU attention at {cpu['n_threads']} threads: {cpu.get('error')}")
        return
    figures = ", ".join(f"{t} {_fmt(v)}" for t, v in cpu["gbps"].items())
    console.print(f"CPU decode attention, GB/s of K+V read on {cpu['n_threads']} threads: {esc(figures)}", soft_wrap=True)
    note(f"CPU attention: {cpu['source']}, measured {cpu['measured_at']} with build {cpu['build']}")


def _maybe_idle(g, loaded: bool, width: int | None) -> bool:
    """Only the generation is low, and it was read without traffic: possibly power saving, not a bad link."""
    return not loaded and (width or 0) >= (g.max_width or 0)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)
