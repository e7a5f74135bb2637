"""`rollingkv patches`: the patch-series workflow (checkout, export, apply, list)."""

from __future__ import annotations

from pathlib import Path

import click

from rollingkv_cli.cliopts import NonEmptyPath


@click.group(short_help="Work on the patch series against the pin.")
def patches() -> None:
    """Work on the patch series against the pinned llama.cpp.

    \b
    rollingkv patches checkout DIR   git work tree at the pin, a commit per patch
    (edit, commit: one commit per hook, its message saying why)
    rollingkv patches export DIR     regenerate patches/ and native/ from it
    (--lab: the lab series too, patches/lab/ and native-lab/, on top)
    """


@patches.command(short_help="A git work tree at the pin, a commit per patch.")
@click.argument("dest", type=NonEmptyPath(file_okay=False, path_type=Path))
@click.option("--lab", is_flag=True, help="Add the lab series on top: a commit of native-lab/ (tag rollingkv-lab-native), then a commit per lab patch.")
def checkout(dest: Path, lab: bool) -> None:
    """Make DEST a git work tree at the pin with native/ and every patch applied as commits."""
    from rollingkv_cli.lib import patchset, upstream
    from rollingkv_cli.console import note, success
    from rollingkv_cli.userinput import check_output_dir

    check_output_dir(dest, "checkout directory")  # before the pin's tree is fetched or extracted
    series = patchset.load_series(lab=lab)
    pristine = upstream.pristine_tree(log=note)
    patchset.checkout(dest, pristine, series)
    extra = f" + lab: {len(series.lab_native_files)} native files + {len(series.lab_patches)} patches" if lab else ""
    success(f"{dest}: llama.cpp {upstream.PIN.short} + {len(series.native_files)} native files + {len(series.patches)} patches{extra}")


@patches.command(short_help="Regenerate patches/ and native/ from a checkout.")
@click.argument("src", type=NonEmptyPath(exists=True, file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite native/ files that changed since SRC last synced with native/.")
def export(src: Path, force: bool) -> None:
    """Regenerate patches/ (format-patch, stable names) and native/ from a checkout SRC.

    A lab checkout (`checkout --lab`) also regenerates patches/lab/ and native-lab/; any other leaves them as they are.
    Refuses when a native/ file was edited directly since SRC was checked out or last exported (it would be
    lost): copy it into SRC first, or pass --force."""
    from rollingkv_cli.lib import patchset
    from rollingkv_cli.console import success

    written = patchset.export(src, force=force)
    series = patchset.load_series(lab=True)
    lab = f", lab {len(series.lab_patches)} patches and {len(series.lab_native_files)} native files (lab series {series.hash[:12]})"
    success(f"exported {len(written)} patches and {len(series.native_files)} native files (series {patchset.load_series().hash[:12]}){lab}")


@patches.command("apply", short_help="Apply the series to a llama.cpp tree in place.")
@click.argument("tree", type=NonEmptyPath(exists=True, file_okay=False, path_type=Path))
@click.option("--lab", is_flag=True, help="Apply the lab series on top (patches/lab/, native-lab/).")
def apply_cmd(tree: Path, lab: bool) -> None:
    """Apply the series to a llama.cpp TREE in place (idempotent; refuses foreign changes)."""
    from rollingkv_cli.lib import patchset
    from rollingkv_cli.console import info, success

    done = patchset.apply_series(tree, patchset.load_series(lab=lab), log=lambda m: None)
    if done:
        success(f"applied to {tree}: " + ", ".join(done))
    else:
        info(f"{tree}: the series is already applied (nothing to do)")


@patches.command("list", short_help="Each patch, why it exists, what it touches.")
def list_cmd() -> None:
    """Show the series: each patch, why it exists and the files it touches."""
    from rich.table import Table

    from rollingkv_cli.lib import patchset
    from rollingkv_cli.console import console

    series = patchset.load_series(lab=True)
    table = Table(title=f"patch series {patchset.load_series().hash[:12]} (lab series {series.hash[:12]})")
    table.add_column("patch")
    table.add_column("purpose")
    table.add_column("files")
    for p in (*series.patches, *series.lab_patches):
        subject, why, files = patchset.describe_patch(p)
        table.add_row(("lab/" if p in series.lab_patches else "") + p.name, subject, "\n".join(files))
    console.print(table)
    console.print(f"{len(series.native_files)} native files under native/")
