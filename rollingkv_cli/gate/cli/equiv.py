"""`gate equiv`: split vs resident next-token distributions, teacher-forced. The click layer: the work is gate/equiv_gate.py
(prepare, decode, judge, print_results, build_report), the runs gate/equiv.py."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from rollingkv_cli.cliopts import NonEmptyPath, ctx_size_option, model_argument, threads_in_range
from rollingkv_cli.gate.cli.options import build_options, cache_type_options, ngl_option, positive, tail_cpu_frac
from rollingkv_cli.gate.common import EXIT_FAIL

MODES = ["window", "head", "auto", "off"]


@click.command(short_help="Split vs resident logits, teacher-forced.")
@model_argument()
@click.option("--prompt-file", type=NonEmptyPath(path_type=Path),
              help="Text to decode (tokenized with the model's vocabulary). Default: synthetic text.")
@click.option("--synthetic-tokens", type=int, callback=positive, default=None,
              help="Decode N tokens of built-in deterministic public-domain prose.  [default: 2048]")
@ctx_size_option(callback=positive, default=None,
              help="Context size. Default: the token count rounded up to 256, plus 256.")
@click.option("--kv-window-cells", type=int, callback=positive, default=None, help="Cells of the device window per stream.")
@click.option("--kv-device-heads", type=int, callback=positive, default=None, metavar="N",
              help="Head split: KV heads of each layer kept on the device, the others streamed from host memory for every cell "
                   "(--kv-residency-mode head, or auto which it then means).")
@click.option("--vram-target", type=int, callback=positive, default=None, metavar="MiB", help="Device memory budget; the planner sizes the window (or the head split).")
@cache_type_options
@click.option("--kv-residency-mode", "mode", type=click.Choice(MODES), default="window", show_default=True,
              help="The candidate's residency mode (off: the plain resident cache, a sanity run).")
@click.option("--kv-tail-cpu-frac", "cpu_frac", callback=tail_cpu_frac, default=None, metavar="F|auto",
              help="The candidate's CPU part: the share of each split layer's host tail attended on the CPU while the rest streams "
                   "(0: none, 1: all). The op uses it on decode-sized batches (use --n-batch 1, or --n-seq N --n-batch N); the "
                   "report shows the plan's split.  [default: the library's, auto]")
@click.option("--reference", "reference", default="resident", show_default=True, metavar="resident|lib:PATH",
              help="resident: the active build with residency off; lib:PATH: the libllama in PATH (a directory or the file) of another build, e.g. an unpatched one.")
@click.option("--thresholds", "thresholds_file", type=NonEmptyPath(path_type=Path), default=None,
              help="YAML/JSON file overriding the default bounds (flat keys, or per profile: same_type/quantized).")
@click.option("--tail-baseline", is_flag=True,
              help="Quantized tail: also decode the resident cache with every K/V in the tail's type (the baseline): over the "
                   "positions that read the tail the split's mean TV may be at most baseline_factor x the baseline's at the "
                   "same positions (1.5 for q8_0, 2.5 for q4_0: the K type's rounding bias); and a control, window and tail "
                   "both of the tail's type against the baseline, must be exact (bit-identical on the CPU).")
@click.option("--tolerance", type=float, default=None, metavar="TV",
              help="Same-type split on the CPU: accept a mean TV up to TV instead of requiring bit-identical logits.  "
                   "[default: bit-identity]")
@click.option("--order-floor/--no-order-floor", default=None,
              help="Also decode the resident cache with half the batch (the same math in another floating-point order, as GPU "
                   "attention kernels tile by shape), and let the split differ up to order_factor (2) times what that run "
                   "differs (upper bounds max(bound, 2 x floor); agreement bounds min(bound, 1 - 2 x (1 - floor))); per "
                   "position, at most max_frac_over_floor (5%) of the positions that read the tail may exceed 2 x the floor "
                   "run's 99th-percentile TV over them (same-type bounds).  "
                   "[default: on for the CUDA backend, off on the CPU, where the split is bit-identical]")
@click.option("--needle/--no-needle", "needle", default=None,
              help="Auto tail types: also run the needle (gate needle's, llama-server with the candidate's residency at the same "
                   "context): a number placed in the tail, which the split must retrieve wherever the resident run does.  "
                   "[default: on with -ctkt/-ctvt auto]")
@click.option("--json", "json_out", type=NonEmptyPath(dir_okay=False, path_type=Path), default=None,
              help="Write the full report here.")
@click.option("--threads", type=int, callback=threads_in_range, default=None, help="CPU threads per run.  [default: all cores]")
@click.option("--n-batch", type=int, callback=positive, default=512, show_default=True, help="Tokens per llama_decode (and per ubatch), the same for both runs.")
@click.option("--n-seq", type=int, callback=positive, default=1, show_default=True,
              help="Decode the text as N equal sequences side by side, each batch holding positions of all of them in one "
                   "unified KV cache (as llama-server's --parallel N slots): their cells interleave in the window and the tail.")
@ngl_option()
@build_options
@click.option("--work-dir", type=NonEmptyPath(file_okay=False, path_type=Path), default=None,
              help="Where the reference logits (n_tokens x n_vocab x 4 bytes) are kept during the run.  [default: the temp dir]")
def equiv(model_spec, prompt_file, synthetic_tokens, n_ctx, kv_window_cells, kv_device_heads, vram_target, ctk, ctv, ctkt, ctvt, mode, cpu_frac,
          reference, thresholds_file, tail_baseline, tolerance, order_floor, needle, json_out, threads, n_batch, n_seq, n_gpu_layers,
          build_dir, lib_dir, work_dir) -> None:
    """Decode a text teacher-forced with the reference and the candidate and compare every position's distribution.

    The text runs as one sequence, or as --n-seq sequences side by side. A tail of the window's own type on the
    CPU must give bit-identical logits (--tolerance: a mean-TV bound instead); on the CUDA backend the bounds
    follow the resident run's own floating-point order floor (--order-floor). A split candidate must have put
    a position in the tail: the report says how many read it, and none fails the gate.

    A quantized tail with --tail-baseline: over the positions that read the tail, the split's mean TV may be at
    most baseline_factor x the mean TV of the resident cache of the tail's type at the same positions (the cost
    of the quantization itself); the factor, 1 + max(0.5, 12 x the K type's rounding step) (1.5 for q8_0, 2.5
    for q4_0), admits the rounding bias that tail keys carry and a fully quantized cache cancels. Single
    positions are too noisy to compare one by one. A control, window and tail both of the tail's type against
    that baseline, checks the merge exactly (bit-identical on the CPU).

    Auto tail types (-ctkt/-ctvt auto: the planner picks q8_0 or q4_0 when the cache spills): the loss against
    the resident cache of the window's type over the positions that read the tail, bounded for the type the plan
    chose (q8_0: mean TV <= 0.04, 99th-percentile TV <= 0.11, top-1 agreement >= 0.90; q4_0: 0.16, 0.8, 0.78;
    --thresholds overrides them), and the needle (--needle) retrieved wherever the resident run retrieves it.

    Exit status: 0 when every bound holds, 1 when one does not (or on an error), 2 on a usage error.
    """
    from rollingkv_cli.console import console, esc, note
    from rollingkv_cli.gate import common, equiv_gate

    if prompt_file is not None and synthetic_tokens is not None:
        raise click.UsageError("give --prompt-file or --synthetic-tokens, not both")
    if build_dir is not None and lib_dir is not None:
        raise click.UsageError("give --build or --lib-dir, not both")
    if tolerance is not None and not 0 <= tolerance <= 1:
        raise click.BadParameter("a mean total variation, between 0 and 1", param_hint="'--tolerance'")
    ref_kind, ref_lib = _parse_reference(reference)
    options = equiv_gate.EquivOptions(
        model_spec=model_spec, prompt_file=prompt_file, synthetic_tokens=synthetic_tokens, n_ctx=n_ctx, kv_window_cells=kv_window_cells,
        kv_device_heads=kv_device_heads, vram_target=vram_target, ctk=ctk, ctv=ctv, ctkt=ctkt, ctvt=ctvt, mode=mode, cpu_frac=cpu_frac,
        reference=reference, ref_kind=ref_kind, ref_lib=ref_lib, thresholds_file=thresholds_file, tail_baseline=tail_baseline,
        tolerance=tolerance, order_floor=order_floor, needle=needle, json_out=json_out, threads=threads, n_batch=n_batch, n_seq=n_seq,
        n_gpu_layers=n_gpu_layers, build_dir=build_dir, lib_dir=lib_dir, work_dir=work_dir)
    setup = equiv_gate.prepare(options)
    runs = equiv_gate.decode(setup)
    verdict = equiv_gate.judge(setup, runs)
    equiv_gate.print_results(setup, runs, verdict)
    if json_out is not None:
        common.write_json(json_out, equiv_gate.build_report(setup, runs, verdict))
        note(f"report: {json_out}")
    if verdict.passed:
        console.print("[bold green]PASS[/] the candidate reproduces the reference within every bound")
        return
    console.print("[bold red]FAIL[/] " + esc("; ".join(equiv_gate.failures(verdict))), soft_wrap=True)
    # SystemExit, not click's Exit: with standalone_mode=False click turns Exit into a return value
    sys.exit(EXIT_FAIL)


def _parse_reference(spec: str) -> tuple[str, Path | None]:
    from rollingkv_cli.console import abort

    if spec == "resident":
        return "resident", None
    if spec.startswith("lib:") and len(spec) > 4:
        p = Path(spec[4:]).expanduser()
        if p.is_file():
            p = p.parent
        if not p.is_dir():
            abort(f"--reference {spec}: {p} does not exist", "give lib:DIR with the libllama.so of another build, e.g. lib:/path/llama.cpp/build/bin")
        if not (p / "libllama.so").is_file():
            abort(f"--reference {spec}: no libllama.so in {p}", "give the directory holding libllama.so (llama.cpp's build/bin)")
        return "lib", p.resolve()
    raise click.BadParameter(f"{spec!r} is neither `resident` nor `lib:PATH`", param_hint="'--reference'")

