"""`rollingkv build`: fetch the pinned llama.cpp, apply the series, build CPU or CUDA."""

from __future__ import annotations

from pathlib import Path

import click

from rollingkv_cli.cliopts import NonEmptyPath
from rollingkv_cli.lib.paths import ENV_SOURCE_DIR


@click.command(short_help="Build the patched llama.cpp (a no-op when built).")
@click.option("--cuda/--no-cuda", default=None, help="Build the CUDA backend. Default: only when nvcc and an NVIDIA GPU are both present.")
@click.option("--cuda-arch", metavar="ARCHS", help="CMAKE_CUDA_ARCHITECTURES (e.g. 90 or 86;90). Default: the GPUs' compute capability via NVML, else native.")
@click.option("--backend-dl", is_flag=True, help="Build ggml backends as runtime-loaded modules (llamafile-style: CUDA in its own shared object).")
@click.option("--toolchain", type=click.Choice(["gcc", "cosmocc"]), default="gcc", show_default=True, help="Host compiler; cosmocc must be on PATH.")
@click.option("--source", type=NonEmptyPath(file_okay=False, path_type=Path), envvar=ENV_SOURCE_DIR,
              help=f"A local llama.cpp tree instead of the pinned sdist [env: {ENV_SOURCE_DIR}].")
@click.option("--allow-unpinned", is_flag=True, help="Accept a --source tree at another commit than the pin.")
@click.option("--unpatched", is_flag=True, help="Build libllama of the pin with only the upstream fixes (patches/upstream-fixes/), none of our series: the reference for `gate equiv --reference lib:DIR`; never becomes the active build.")
@click.option("--lab", is_flag=True, help="Apply the lab series on top (patches/lab/, native-lab/: the GPU timeline profile, speed probes, A/B switches); its own build directory, never the product's.")
@click.option("-j", "--jobs", type=click.IntRange(1, 512), help="Parallel compile jobs (default: all cores).")
@click.option("--print-dir", is_flag=True, help="Print the build directory for these options and exit (it must be built).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def build(cuda, cuda_arch, backend_dl, toolchain, source, allow_unpinned, unpatched, lab, jobs, print_dir, quiet) -> None:
    """Build the patched llama.cpp (libllama, llama-server, llama-bench, the op tests).

    The build goes into a directory keyed by (pin, patch series, options) with a manifest.json;
    building again with nothing changed is a no-op. The finished build becomes the active one.
    """
    from rollingkv_cli.lib import builder
    from rollingkv_cli.console import abort, note, success

    use_cuda, arch = builder.resolve_cuda(cuda, cuda_arch)
    if cuda_arch and not use_cuda:
        abort("--cuda-arch given but this is not a CUDA build", "add --cuda")
    opts = builder.BuildOptions(
        cuda=use_cuda, cuda_arch=arch, backend_dl=backend_dl, toolchain=toolchain,
        source=str(source.expanduser().resolve()) if source else None, pinned=not allow_unpinned, unpatched=unpatched,
        lab=lab,
    )
    if unpatched and lab:
        abort("--lab and --unpatched exclude each other", "the reference build applies the upstream fixes alone; drop one of them")
    series = builder.series_for(opts)
    if print_dir:
        bdir = builder.build_dir_for(opts, series)
        if builder.Build.load(bdir) is None:
            abort(f"not built yet with these options ({bdir})", "run `rollingkv build` with the same options")
        click.echo(str(bdir))
        return
    existing = builder.Build.load(builder.build_dir_for(opts, series))
    b = builder.build(opts, series, jobs=jobs, quiet=quiet)
    kind = ("CUDA " + str(arch) if use_cuda else "CPU") + (" unpatched" if unpatched else "") + (" lab" if lab else "")
    if existing is not None:
        success(f"up to date: {kind} build {b.dir}")
    else:
        success(f"built {kind}{' (backends as modules)' if backend_dl else ''} in {b.manifest['build_seconds']} s: {b.dir}")
    note(f"{'reference (not active)' if unpatched else 'active build'}; libllama: {b.lib_dir / 'libllama.so'}")
