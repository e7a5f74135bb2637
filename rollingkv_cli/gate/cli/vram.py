"""`gate vram`: the NVML peak of a llama-server with --vram-target stays within the target (gate/vram.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from rollingkv_cli.cliopts import NonEmptyPath, ctx_size_option, model_argument, threads_in_range
from rollingkv_cli.gate.cli.options import build_options, cache_type_options, ngl_option, non_negative, positive
from rollingkv_cli.gate.common import EXIT_FAIL


@click.command(short_help="The peak VRAM stays within --vram-target (NVIDIA).")
@model_argument()
@click.option("--vram-target", type=int, callback=positive, required=True, metavar="MiB",
              help="The device memory budget given to llama-server (--vram-target), checked against the process's peak.")
@click.option("--allowance", type=int, callback=non_negative, default=200, show_default=True, metavar="MiB",
              help="How far above the target the peak may go.")
@ctx_size_option(callback=positive, default=32768, show_default=True, help="Context size.")
@click.option("--prompt-tokens", type=int, callback=positive, default=None,
              help="Prompt length of each request.  [default: half of what one request may hold]")
@click.option("--n-predict", type=int, callback=positive, default=512, show_default=True, help="Tokens generated after the prompt (EOS ignored).")
@click.option("-np", "--parallel", type=int, callback=positive, default=1, show_default=True, metavar="N",
              help="Server slots, each prefilling and decoding a request of its own at once (llama-server's -np).")
@click.option("-kvu", "--kv-unified", is_flag=True,
              help="One cache for all slots (llama-server's -kvu; its layout without -np is -np 4 -kvu).")
@click.option("--kv-residency-mode", "mode", type=click.Choice(["auto", "window", "head"]), default="auto", show_default=True,
              help="auto: resident when the KV fits the target, a window (or a head split, where cheaper) otherwise; window; head.")
@cache_type_options
@click.option("--gpu", "gpu_index", type=int, callback=non_negative, default=0, show_default=True, metavar="N", help="The GPU (NVML index) to watch.")
@click.option("--interval-ms", type=int, callback=positive, default=50, show_default=True, help="NVML sampling interval.")
@click.option("--threads", type=int, callback=threads_in_range, default=None, help="CPU threads of the server.  [default: llama-server's]")
@ngl_option(default=999, help_default="999: every layer")
@build_options
@click.option("--json", "json_out", type=NonEmptyPath(dir_okay=False, path_type=Path), default=None,
              help="Write the full report here.")
def vram(model_spec, vram_target, allowance, n_ctx, prompt_tokens, n_predict, parallel, kv_unified, mode, ctk, ctv, ctkt, ctvt, gpu_index, interval_ms,
         threads, n_gpu_layers, build_dir, lib_dir, json_out) -> None:
    """Device memory stays within --vram-target + allowance through a long decode (NVIDIA GPUs only).

    Starts llama-server with --vram-target on the model, prefills --prompt-tokens and generates --n-predict
    tokens (in each of --parallel slots at once), and samples NVML every --interval-ms from the moment the
    process starts: the server process's memory (usedGpuMemory of its pid), or, where NVML does not report it,
    the growth of the device's used memory. Pass: the peak <= target + allowance.

    The target holds in every layout: check one slot, -np 4 and -np 8 (a cache per slot), and llama-server's
    default (-np 4 -kvu, one unified cache).

    \b
    Exit status:
      0  pass
      1  the peak exceeded the limit (or an error)
      2  usage error
      3  no NVIDIA GPU found (no driver, no NVML, or no device), as
         `rollingkv probe pcie`; with --json the report is {"gate": "vram",
         "verdict": "no-gpu", "error": "no NVIDIA GPU found", ...}
    """
    from rollingkv_cli import models
    from rollingkv_cli.gate import common
    from rollingkv_cli.gate import vram as vram_runs
    from rollingkv_cli.console import RollingKVError, abort, console, esc, note, usage_error
    from rollingkv_cli.hw.pcie import NO_GPU_MESSAGE

    if build_dir is not None and lib_dir is not None:
        raise click.UsageError("give --build or --lib-dir, not both")
    if kv_unified and parallel == 1:
        usage_error("--kv-unified needs --parallel 2 or more (one slot has one cache anyway)", "add e.g. -np 4")
    per_request = n_ctx // parallel
    if per_request < 2:
        usage_error(f"--ctx {n_ctx} leaves {per_request} cells to each of --parallel {parallel} requests", "raise --ctx")
    if prompt_tokens is not None and prompt_tokens + n_predict > per_request:
        where = f"--ctx {n_ctx}" if parallel == 1 else f"what one of {parallel} requests may hold ({per_request} of --ctx {n_ctx})"
        usage_error(f"--prompt-tokens {prompt_tokens} + --n-predict {n_predict} exceed {where}", "raise --ctx or shorten the run")
    if json_out is not None:  # said now, not after the run
        from rollingkv_cli.userinput import check_output_file

        check_output_file(json_out, "report")
    # the GPU first: without one nothing else matters (and the answer is the same as probe pcie's)
    try:
        nvml = vram_runs.nvml_module()
        handle, gpu_name, total = vram_runs.open_gpu(nvml, gpu_index)
    except (ImportError, vram_runs.NoGpu) as e:
        reason = f"nvidia-ml-py (pynvml) is not installed: {e}" if isinstance(e, ImportError) else str(e)
        if json_out is not None:
            common.write_json(json_out, vram_runs.no_gpu_report(reason))
        raise RollingKVError(NO_GPU_MESSAGE, f"{reason}; gate vram needs an NVIDIA GPU and its driver", common.EXIT_NO_GPU) from None
    except IndexError:
        abort(f"--gpu {gpu_index}: no such GPU", "see `rollingkv probe pcie` for the GPUs NVML lists")
    if vram_target * 2**20 > total:
        abort(f"--vram-target {vram_target} MiB is more than GPU {gpu_index} has ({total / 2**20:.0f} MiB)")
    model_path = models.resolve_model(model_spec, log=note)
    build = common.resolve_build(build_dir, lib_dir)
    if not build.cuda:
        abort(f"the build {build.dir or build.lib_dir} is CPU-only: nothing would use the GPU", "build with `rollingkv build --cuda`, or give --build/--lib-dir of a CUDA build")
    cfg = vram_runs.VramConfig(model=model_path, build=build, vram_target=vram_target, allowance=allowance, n_ctx=n_ctx,
                               prompt_tokens=prompt_tokens, n_predict=n_predict, mode=mode, ctk=ctk, ctv=ctv, ctkt=ctkt, ctvt=ctvt,
                               gpu=gpu_index, interval_s=interval_ms / 1000, threads=threads, n_gpu_layers=n_gpu_layers,
                               parallel=parallel, kv_unified=kv_unified)
    r = vram_runs.run(cfg, nvml, handle, gpu_name, console, common.logs_dir())
    vram_runs.print_report(console, r)
    if json_out is not None:
        common.write_json(json_out, r)
        note(f"report: {json_out}")
    if r["passed"]:
        console.print(f"[bold green]PASS[/] {esc(r['why'])}")
        return
    console.print(f"[bold red]FAIL[/] {esc(r['why'])}", soft_wrap=True)
    sys.exit(EXIT_FAIL)

