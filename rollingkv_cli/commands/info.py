"""`rollingkv info`: the active build and what it was made from."""

from __future__ import annotations

import json

import click


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def info(as_json: bool) -> None:
    """Show the active build: pin, patch series, options, artifacts."""
    from rich.table import Table

    from rollingkv_cli import builder, patchset, upstream
    from rollingkv_cli.console import console, warn

    b = builder.active_build(required=True)
    assert b is not None
    current = patchset.load_series().hash
    stale = b.manifest.get("series_hash") != current
    if as_json:
        click.echo(json.dumps({"dir": str(b.dir), "stale": stale, **b.manifest}, indent=2))
        return
    t = Table(show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()
    m = b.manifest
    opts = m.get("options", {})
    t.add_row("build", str(b.dir))
    t.add_row("llama.cpp", f"{m.get('pin', '?')[:12]} ({m.get('source')})")
    t.add_row("bindings", m.get("bindings", upstream.PIN.bindings_package))
    t.add_row("series", f"{m.get('series_hash', '?')[:12]} ({len(m.get('patches', {}))} patches, {len(m.get('native_files', []))} native files)")
    t.add_row("backend", ("CUDA " + str(m.get("cuda_arch"))) if opts.get("cuda") else "CPU")
    t.add_row("backends as modules", "yes" if opts.get("backend_dl") else "no")
    t.add_row("toolchain", opts.get("toolchain", "gcc"))
    t.add_row("artifacts", ", ".join(m.get("artifacts", [])))
    t.add_row("built", f"{m.get('built_at')} in {m.get('build_seconds')} s")
    console.print(t)
    if stale:
        warn("the patch series changed since this build: run `rollingkv build`")
