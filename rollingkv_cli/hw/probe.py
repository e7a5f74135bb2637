"""`rollingkv probe pcie`'s work, without click: measure what is missing, the report (the JSON document `--json`
prints), and the table printed from that same report. commands/probe.py is the click layer."""

from __future__ import annotations

from rollingkv_cli.hw import link_bw, pcie as link, profile


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _triple(figures: dict | None) -> str:
    if not figures:
        return "-"
    return " ".join(f"{_fmt(figures.get(str(m))):>5}" for m in link.SIZES_MIB)


# what to do about a measurement the build cannot make (link_bw.Unavailable.kind), after its reason
_PER_BUILD_HINT = {
    "no_build": "`rollingkv build --cuda` makes one",
    "load": "rebuild with `rollingkv build --cuda`",
    "no_function": "rebuild with `rollingkv build --cuda`",
    "no_gpu": "a CPU build (`rollingkv build --cuda` makes a CUDA one), or the GPU hidden by CUDA_VISIBLE_DEVICES",
}


def measure_links(shown: list, entries: dict, refresh: bool, status=None) -> tuple[dict, dict[int, str]]:
    """Measure the GPUs in `shown` without a cached measurement (all of them with refresh) with the active build's
    libllama (link_bw.py, in a child); a failure only warns. (the profile's entries after it, {GPU index: why its
    measurement failed}). status(text): a context manager shown while a GPU measures, or None."""
    import contextlib

    from rollingkv_cli.console import warn
    from rollingkv_cli.lib import builder

    errors: dict[int, str] = {}
    build = builder.active_build(required=False)
    cannot: str | None = None  # why the build measures no GPU at all
    for g in shown:
        if profile.cached_measurement(g, entries) is not None and not refresh:
            continue
        if cannot is not None:
            errors[g.index] = cannot
            continue
        try:
            with (status(f"measuring GPU {g.index} ({g.name}): pinned copies of 1, 16, 256 MiB") if status
                  else contextlib.nullcontext()):
                m = link_bw.measure(build.lib_dir if build else None, g)
        except link_bw.Unavailable as e:
            errors[g.index] = e.message
            if e.per_build:
                cannot = e.message
                warn(f"{e.message}: not measuring, theoretical figures only ({_PER_BUILD_HINT[e.kind]})")
            else:
                warn(f"GPU {g.index}: measuring failed: {e.message}")
            continue
        profile.save_measurement(g, m)
        entries = profile.load_profile()
    return entries, errors


def pcie_report(gpus: list, shown: list, entries: dict, errors: dict[int, str], cpu: dict) -> dict:
    """The probe's report: per shown GPU its link (now, at most, under load, downtrained), theoretical and measured
    GB/s and the bandwidth the server plans with; the CPU attention part; where the profile lives."""
    out = []
    for g in shown:
        entry = profile.cached_measurement(g, entries)
        gen, width, loaded = link.effective_link(g, entry)
        res = link.resolve_bandwidth(g.index, gpus=gpus, entries=entries)
        out.append({
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
                "downtrained": link.is_downtrained(g, entry),
                "source": g.source,
            },
            "theoretical_gbps": {"current": _round(link.theoretical_gbps(gen, width)), "max": _round(g.theoretical_max)},
            "measured": entry,
            "measure_error": errors.get(g.index),
            "resolved": {"gbps": res.gbps, "tier": res.tier, "detail": res.detail},
        })
    return {"gpus": out, "cpu_attn": cpu, "profile": str(profile.profile_path()), "efficiency": link.EFFICIENCY}


def _effective(gpu: dict) -> tuple[int | None, int | None, bool]:
    """(gen, width, read under load) the report's link planned with: under load when measured so, else now."""
    loaded = gpu["link"]["under_load"]
    now = loaded or gpu["link"]["current"]
    return now["gen"], now["width"], loaded is not None


def print_pcie_report(doc: dict) -> None:
    """The table and the notes of a pcie_report."""
    from rich import box
    from rich.table import Table

    from rollingkv_cli.console import console, esc, note, warn

    t = Table(title="PCIe host<->GPU links, GB/s (10^9 B/s) per direction", title_justify="left", box=box.SIMPLE_HEAD,
              pad_edge=False)
    t.add_column("GPU", no_wrap=True)
    t.add_column("link", no_wrap=True)
    t.add_column("line\nrate", justify="right", no_wrap=True)
    t.add_column(f"measured {'/'.join(map(str, link.SIZES_MIB))} MiB", no_wrap=True)
    t.add_column("resolved", no_wrap=True)
    for g in doc["gpus"]:
        gen, width, loaded = _effective(g)
        mx = g["link"]["max"]
        linkcell = f"now Gen{gen or '?'} x{width or '?'}\nmax Gen{mx['gen'] or '?'} x{mx['width'] or '?'}"
        if g["link"]["downtrained"]:
            linkcell += "\n[bold red]downtrained[/]" + ("[dim]?[/]" if _maybe_idle(mx["width"], loaded, width) else "")
        entry = g["measured"]
        measured = f"H2D {_triple(entry.get('h2d'))}\nD2H {_triple(entry.get('d2h'))}" if entry else "-"
        res = g["resolved"]
        t.add_row(f"{g['index']} {esc(g['name'])}\n[dim]{esc(g['pci_bus_id'])}[/]", linkcell,
                  _fmt(g["theoretical_gbps"]["current"]), measured, f"[bold]{res['gbps']:.1f}[/]\n{res['tier']}")
    console.print(t)
    for g in doc["gpus"]:
        gen, width, loaded = _effective(g)
        mx, entry, res = g["link"]["max"], g["measured"], g["resolved"]
        if entry:
            note(f"GPU {g['index']}: measured {entry.get('measured_at')} by {link_bw.measured_with(entry)}")
        if g["link"]["downtrained"]:
            why = ("read at idle, when GPUs may lower the generation to save power: measuring reads it under load"
                   if _maybe_idle(mx["width"], loaded, width) else "under load" if loaded else "fewer lanes than the slot has")
            warn(f"GPU {g['index']}: link runs at Gen{gen} x{width} of Gen{mx['gen']} x{mx['width']} ({why}); "
                 "check the slot, riser and BIOS PCIe settings")
        note(f"GPU {g['index']}: resolved {res['gbps']:.2f} GB/s ({res['tier']}: {res['detail']})")
    print_cpu_attn(doc["cpu_attn"])
    note(f"cache: {doc['profile']}")


def cpu_attn_report(refresh: bool, no_measure: bool, quiet: bool, threads: int | None) -> dict:
    """The CPU attention part of the profile at `threads` for the active build: cached, or measured now (a failure
    only warns, as a failed link measurement does). The JSON's cpu_attn object."""
    from rollingkv_cli.lib import builder
    from rollingkv_cli.hw import cpu_attn
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


def print_cpu_attn(cpu: dict) -> None:
    from rollingkv_cli.console import console, esc, note

    if not cpu.get("gbps"):
        note(f"CPU attention at {cpu['n_threads']} threads: {cpu.get('error')}")
        return
    figures = ", ".join(f"{t} {_fmt(v)}" for t, v in cpu["gbps"].items())
    console.print(f"CPU decode attention, GB/s of K+V read on {cpu['n_threads']} threads: {esc(figures)}", soft_wrap=True)
    note(f"CPU attention: {cpu['source']}, measured {cpu['measured_at']} with build {cpu['build']}")


def _maybe_idle(max_width: int | None, loaded: bool, width: int | None) -> bool:
    """Only the generation is low, and it was read without traffic: possibly power saving, not a bad link."""
    return not loaded and (width or 0) >= (max_width or 0)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)
