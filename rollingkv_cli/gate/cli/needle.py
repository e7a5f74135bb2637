"""`gate needle`: a fact placed in the host tail, asked of a resident and a split llama-server (gate/needle.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from rollingkv_cli.cliopts import NonEmptyPath, ctx_size_option, model_argument, threads_in_range
from rollingkv_cli.gate.cli.options import build_options, cache_type_options, fraction_list, ngl_option, positive
from rollingkv_cli.gate.common import EXIT_FAIL, EXIT_INCONCLUSIVE, check_request
from rollingkv_cli.lib.residency import ResidencyRequest


@click.command(short_help="A number hidden in the tail: split answers as resident.")
@model_argument()
@click.option("--filler-tokens", type=int, callback=positive, default=1536, show_default=True,
              help="Length of the filler text the needle hides in (about; cut at a sentence).")
@click.option("--filler-file", type=NonEmptyPath(path_type=Path), default=None,
              help="Take the filler from this text file (cut to --filler-tokens). Default: built-in prose without numbers.")
@click.option("--depth", "--position", "depths", multiple=True, callback=fraction_list, metavar="F",
              help="Where the needle goes, as a fraction of the filler strictly between 0 and 1; repeat (or comma-separate) for several placements.  [default: 0.5, 0.85]")
@click.option("--seed", type=int, default=0, show_default=True, help="Draws the secret numbers (and the filler's sentences).")
@click.option("--format", "fmt", type=click.Choice(["plain", "chat"]), default="plain", show_default=True,
              help="plain: a completion prompt ending in 'Answer: The secret number is'; chat: the model's chat template.")
@click.option("--n-predict", type=int, callback=positive, default=16, show_default=True, help="Answer tokens generated greedily.")
@ctx_size_option(callback=positive, default=None, help="Context size.  [default: the prompt rounded up to 256, plus 256]")
@click.option("--kv-window-cells", type=int, callback=positive, default=None,
              help="Cells of the device window: positions [0, N); the needle must lie at N or later.  [default: 256]")
@click.option("--vram-target", type=int, callback=positive, default=None, metavar="MiB", help="Device memory budget; the planner sizes the window (GPU).")
@click.option("--kv-residency-mode", "mode", type=click.Choice(["window", "head", "auto"]), default="window", show_default=True,
              help="The candidate's residency mode (head: the needle's host heads are streamed wherever it lies).")
@click.option("--kv-device-heads", type=int, callback=positive, default=None, metavar="N",
              help="Head split: KV heads of each layer kept on the device.  [default with head mode and no --vram-target: 1]")
@cache_type_options
@click.option("--threads", type=int, callback=threads_in_range, default=None, help="CPU threads per server.  [default: all cores]")
@ngl_option(help_default="llama-server's")
@build_options
@click.option("--match", type=click.Choice(["tokens", "answer"]), default=None,
              help="tokens: identical answer tokens; answer: identical through the number (GPU kernels' float order may flip "
                   "a near tie after it).  [default: answer on the CUDA backend, tokens on the CPU]")
@click.option("--json", "json_out", type=NonEmptyPath(dir_okay=False, path_type=Path), default=None,
              help="Write the full report here.")
def needle(model_spec, filler_tokens, filler_file, depths, seed, fmt, n_predict, n_ctx, kv_window_cells, vram_target, mode,
           kv_device_heads, ctk, ctv, ctkt, ctvt, threads, n_gpu_layers, build_dir, lib_dir, match, json_out) -> None:
    """Retrieve a fact placed in the host tail: the split cache must answer exactly as the resident one.

    A seeded random number ("The secret number is 48213.") goes into filler text at each --depth; a
    resident llama-server (residency off) and a split one (window [0, N) on the device, the rest in the
    tail) answer the same prompt tokens greedily. Pass: identical answer tokens at every placement (on the
    GPU: identical answers through the number, see --match), and the resident run retrieved the number.

    \b
    Exit status:
      0  pass
      1  the answers differ (or an error)
      2  usage error
      4  inconclusive: the model does not retrieve this needle even fully resident
         (try another --seed, a shorter --filler-tokens, or --format chat)
    """
    from rollingkv_cli import models
    from rollingkv_cli.gate import common
    from rollingkv_cli.gate import needle as needle_runs
    from rollingkv_cli.console import console, note

    check_request(ResidencyRequest(mode=mode, window_cells=kv_window_cells, device_heads=kv_device_heads, vram_target=vram_target,
                                   type_k_tail=ctkt, type_v_tail=ctvt))
    if build_dir is not None and lib_dir is not None:
        raise click.UsageError("give --build or --lib-dir, not both")
    if mode == "head" and kv_device_heads is None and vram_target is None:
        kv_device_heads = 1
    if kv_window_cells is None and vram_target is None and kv_device_heads is None:
        kv_window_cells = 256
    depths = depths or (0.5, 0.85)
    if json_out is not None:  # said now, not after the run
        from rollingkv_cli.userinput import check_output_file

        check_output_file(json_out, "report")
    model_path = models.resolve_model(model_spec, log=note)
    build = common.resolve_build(build_dir, lib_dir)
    cfg = needle_runs.NeedleConfig(model=model_path, build=build, filler_tokens=filler_tokens, depths=tuple(depths), seed=seed,
                                   fmt=fmt, n_ctx=n_ctx, window_cells=kv_window_cells, device_heads=kv_device_heads,
                                   vram_target=vram_target, ctk=ctk, ctv=ctv,
                                   ctkt=ctkt, ctvt=ctvt, n_predict=n_predict, threads=threads or os.cpu_count() or 1,
                                   n_gpu_layers=n_gpu_layers, filler_file=filler_file, mode=mode,
                                   match=match or ("answer" if build.on_gpu(n_gpu_layers) else "tokens"))
    r = needle_runs.run(cfg, console, common.logs_dir())
    needle_runs.print_report(console, r)
    if json_out is not None:
        common.write_json(json_out, r)
        note(f"report: {json_out}")
    if r["verdict"] == "pass":
        console.print("[bold green]PASS[/] the split cache answers exactly as the resident one, and the number was retrieved")
        return
    if r["verdict"] == "inconclusive":
        console.print("[bold yellow]INCONCLUSIVE[/] the model does not retrieve this needle even fully resident "
                      "(the answers were identical, but prove nothing about the tail)", soft_wrap=True)
        sys.exit(EXIT_INCONCLUSIVE)
    bad = [p for p in r["placements"] if p["verdict"] == "fail"]
    console.print("[bold red]FAIL[/] the split cache answers differently at depth " + ", ".join(f"{p['depth']:g}" for p in bad), soft_wrap=True)
    sys.exit(EXIT_FAIL)

