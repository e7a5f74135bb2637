"""`rollingkv probe`: what the hardware gives the KV stream (the PCIe link, for now)."""

from __future__ import annotations

import json

import click


@click.group(short_help="Inspect the hardware that rollingkv plans with.")
def probe() -> None:
    """Inspect the hardware that rollingkv plans with."""


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
    copies of 1, 16 and 256 MiB measured by the active build's libllama in a child process (a CUDA build:
    the copies a host tail makes, through its GPU backend; cached in <cache>/pcie/profile.json per GPU
    UUID and driver; --refresh measures again), and the resolved bandwidth with its tier:
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
    from rollingkv_cli.console import abort, err_console, esc
    from rollingkv_cli.hw import pcie as link, probe as work, profile
    from rollingkv_cli.lib import paths

    if refresh and no_measure:
        raise click.UsageError("--refresh and --no-measure contradict each other")
    paths.pcie_bw_env()  # refuse a bad value before spending time measuring
    try:
        gpus = link.discover()
    except link.NoGpuError:
        if as_json:
            click.echo(json.dumps({"gpus": [], "error": link.NO_GPU_MESSAGE}, indent=2))
        raise
    shown = gpus if gpu_index is None else [g for g in gpus if g.index == gpu_index]
    if not shown:
        abort(f"--gpu {gpu_index}: no such GPU", f"GPUs found: {', '.join(str(g.index) for g in gpus)}")
    entries, errors = profile.load_profile(), {}
    if not no_measure:
        entries, errors = work.measure_links(shown, entries, refresh,
                                             status=None if as_json else lambda text: err_console.status(esc(text)))
    doc = work.pcie_report(gpus, shown, entries, errors, work.cpu_attn_report(refresh, no_measure, as_json, threads))
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        work.print_pcie_report(doc)
