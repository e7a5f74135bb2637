"""`rollingkv info`: the active build, what it was made from, and the CPU paths it runs on this host."""

from __future__ import annotations

import json

import click


@click.command(short_help="The active build and the host CPU it runs on.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest and the host's CPU facts as JSON.")
def info(as_json: bool) -> None:
    """Show the active build (pin, patch series, options, artifacts) and the host CPU: its model, and the
    features and weight buffer types (AMX, CPU_REPACK) the build's CPU backend uses, so a crash report says
    which kernels ran."""
    from rich.markup import escape
    from rich.table import Table

    from rollingkv_cli.lib import builder, upstream
    from rollingkv_cli.console import console, warn

    b = builder.active_build(required=True)
    assert b is not None
    report = info_report(b)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    stale, lab, host, cpu_error = report["stale"], bool(b.manifest.get("lab")), report["host"], report["host"]["error"]
    t = Table(show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()

    def row(key: str, value: str) -> None:
        t.add_row(key, escape(value))  # paths and library text may hold brackets

    m = b.manifest
    opts = m.get("options", {})
    row("build", str(b.dir))
    row("llama.cpp", f"{m.get('pin', '?')[:12]} ({m.get('source')})")
    row("bindings", m.get("bindings", upstream.PIN.bindings_package))
    row("series", f"{m.get('series_hash', '?')[:12]} ({len(m.get('patches', {}))} patches, {len(m.get('native_files', []))} native files)"
        + (f"; LAB build: + {len(m.get('lab_native_files', []))} lab native files (not the product)" if lab else ""))
    row("backend", ("CUDA " + str(m.get("cuda_arch"))) if opts.get("cuda") else "CPU")
    row("backends as modules", "yes" if opts.get("backend_dl") else "no")
    row("toolchain", opts.get("toolchain", "gcc"))
    row("artifacts", ", ".join(m.get("artifacts", [])))
    row("built", f"{m.get('built_at')} in {m.get('build_seconds')} s")
    row("host CPU", host["cpu_model"])
    row("CPU flags", " ".join(host["cpu_flags"]) or "(none of the kernel-relevant ones)")
    if cpu_error:
        t.add_row("CPU backend", f"[red]{escape(cpu_error)}[/]")
    else:
        row("CPU backend uses", " ".join(host["ggml_features"]) or "(no feature reported)")
        row("weight buffer types", ", ".join(host["cpu_extra_buffer_types"]) or "none (plain CPU buffers)")
    console.print(t)
    if stale:
        warn(f"the patch series changed since this build: run `rollingkv build{' --lab' if lab else ''}`")


def info_report(b) -> dict:
    """What `info --json` prints for build b: its directory, whether the patch series changed since (stale), its
    manifest, and the host CPU with what the build's CPU backend uses on it."""
    from rollingkv_cli.hw import hostinfo
    from rollingkv_cli.lib import patchset

    lab = bool(b.manifest.get("lab"))
    current = patchset.load_series(lab=lab).hash  # a lab build is stale against the lab series, not the product's
    cpu = hostinfo.backend_info(b.lib_dir)
    host = {"cpu_model": hostinfo.cpu_model(), "cpu_flags": sorted(set(hostinfo.KERNEL_FLAGS) & hostinfo.cpu_flags()),
            "ggml_features": cpu.enabled, "cpu_extra_buffer_types": cpu.extra_buffer_types,
            "ggml_system_info": cpu.system_info, "error": cpu.error}
    return {"dir": str(b.dir), "stale": b.manifest.get("series_hash") != current, **b.manifest, "host": host}
