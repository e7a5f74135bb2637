"""`gate equiv`: split vs resident next-token distributions, teacher-forced (the runs: gate/equiv.py)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import click

from rollingkv_cli.cliopts import ctx_size_option, model_argument
from rollingkv_cli.gate.cli.options import build_options, cache_type_options, check_request, ngl_option, positive, tail_cpu_frac
from rollingkv_cli.gate.common import EXIT_FAIL
from rollingkv_cli.lib.residency import ResidencyRequest

MODES = ["window", "head", "auto", "off"]


@click.command(short_help="Split vs resident logits, teacher-forced.")
@model_argument()
@click.option("--prompt-file", type=click.Path(path_type=Path),
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
@click.option("--thresholds", "thresholds_file", type=click.Path(path_type=Path), default=None,
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
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the full report here.")
@click.option("--threads", type=int, callback=positive, default=None, help="CPU threads per run.  [default: all cores]")
@click.option("--n-batch", type=int, callback=positive, default=512, show_default=True, help="Tokens per llama_decode (and per ubatch), the same for both runs.")
@click.option("--n-seq", type=int, callback=positive, default=1, show_default=True,
              help="Decode the text as N equal sequences side by side, each batch holding positions of all of them in one "
                   "unified KV cache (as llama-server's --parallel N slots): their cells interleave in the window and the tail.")
@ngl_option()
@build_options
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
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
    chose (q8_0: mean TV <= 0.05, 99th-percentile TV <= 0.25, top-1 agreement >= 0.92; q4_0: 0.2, 0.8, 0.85;
    --thresholds overrides them), and the needle (--needle) retrieved wherever the resident run retrieves it.

    Exit status: 0 when every bound holds, 1 when one does not (or on an error), 2 on a usage error.
    """
    from rollingkv_cli import __version__, models
    from rollingkv_cli.lib import paths
    from rollingkv_cli.gate import common, metrics
    from rollingkv_cli.gate import equiv as equiv_runs
    from rollingkv_cli.console import abort, console, esc, note, usage_error, warn

    t_start = time.time()
    # ---------------------------------------------------------------- input checks, cheapest first
    if prompt_file is not None and synthetic_tokens is not None:
        raise click.UsageError("give --prompt-file or --synthetic-tokens, not both")
    request = ResidencyRequest(mode=mode, window_cells=kv_window_cells, device_heads=kv_device_heads, vram_target=vram_target,
                               type_k_tail=ctkt, type_v_tail=ctvt, tail_cpu_frac=cpu_frac)
    check_request(request)
    if build_dir is not None and lib_dir is not None:
        raise click.UsageError("give --build or --lib-dir, not both")
    auto_axes = request.auto_tail_axes()
    if auto_axes and tail_baseline:
        usage_error("--tail-baseline compares with the resident cache of the tail's type, which auto chooses only when it plans",
                    "drop --tail-baseline (auto's loss is bounded against the resident cache), or give the tail a type")
    if needle and not auto_axes:
        usage_error("--needle goes with auto tail types (-ctkt/-ctvt auto)", "run `rollingkv gate needle` for a tail of a given type")
    if prompt_file is None and synthetic_tokens is None:
        synthetic_tokens = 2048
    if n_ctx is not None and kv_window_cells is not None and kv_window_cells >= n_ctx:
        usage_error(f"--kv-window-cells {kv_window_cells} must be smaller than --ctx {n_ctx}",
              "the window holds cells [0, window); a window as large as the context leaves no tail to check")
    if n_ctx is not None and synthetic_tokens is not None and synthetic_tokens > n_ctx:
        usage_error(f"{synthetic_tokens} tokens do not fit --ctx {n_ctx}", "raise --ctx or lower --synthetic-tokens")
    if tolerance is not None and not 0 <= tolerance <= 1:
        raise click.BadParameter("a mean total variation, between 0 and 1", param_hint="'--tolerance'")
    if mode == "off" and (kv_window_cells or vram_target or ctkt or ctvt or cpu_frac is not None):
        warn("--kv-residency-mode off ignores --kv-window-cells, --vram-target, the tail types and --kv-tail-cpu-frac")
    if mode == "head" and kv_device_heads is None and vram_target is None:
        kv_device_heads = 1  # the most streamed: every layer's first KV head on the device, the others from host memory
    profile = metrics.profile_for((ctk, ctv), (None, None) if mode == "off" else (ctkt, ctvt))
    try:
        thresholds = metrics.load_thresholds(thresholds_file, profile)
    except metrics.ThresholdsError as e:
        abort(str(e), e.hint or "keys: " + ", ".join(sorted(set(metrics.CHECKS) | metrics.PARAM_KEYS)))
    if profile == "auto":
        thresholds = metrics.auto_thresholds(thresholds)
        if needle is None:
            needle = True
    if tail_baseline and profile != "quantized":
        warn("--tail-baseline applies to a quantized tail only: the tail holds the window's type, the same-type bounds apply")
        tail_baseline = False
    ref_kind, ref_lib = _parse_reference(reference)
    threads = threads or os.cpu_count() or 1
    if prompt_file is not None:
        from rollingkv_cli.userinput import read_text

        read_text(prompt_file, "prompt file")  # readable UTF-8 text, said here rather than by the runner
    pcie_bw = paths.pcie_bw_env() if mode != "off" else None
    if json_out is not None:  # said now, not after the run
        from rollingkv_cli.userinput import check_output_file

        check_output_file(json_out, "report")
        check_output_file(equiv_runs.positions_path(json_out), "positions file")

    model_path = models.resolve_model(model_spec, log=note)
    if auto_axes and (mode == "head" or kv_device_heads is not None):
        equiv_runs.check_auto_tail_heads(model_path, ctk, ctv, ctkt, ctvt)
    build = common.resolve_build(build_dir, lib_dir)
    if needle:
        build.require_server()
    cand_lib = build.lib_dir
    if order_floor is None:
        order_floor = build.on_gpu(n_gpu_layers)
    on_cpu = not build.on_gpu(n_gpu_layers)
    exact_bits = on_cpu and tolerance is None  # the CPU split stores and sums the same bits as the resident run
    if profile == "same_type":
        thresholds["require_bitwise"] = exact_bits and metrics.bitwise_types((ctk, ctv), (None, None) if mode == "off" else (ctkt, ctvt))
        if tolerance is not None:
            thresholds["max_mean_tv"] = tolerance
    thresholds["require_tail"] = mode != "off"
    if ref_kind == "resident":
        ref_lib = cand_lib

    residency = None
    if mode != "off":
        # device_heads: head mode's default of 1 was filled in after the request was checked
        residency = replace(request, device_heads=kv_device_heads, pcie_bw_gbps=pcie_bw).params()
        if cpu_frac is not None:
            if cpu_frac != 0 and n_batch // n_seq > 1 and build.on_gpu(n_gpu_layers):
                warn(f"--n-batch {n_batch} decodes {n_batch // n_seq} positions of each sequence per batch: the op attends the CPU part "
                     f"only on decode-sized batches, so these run GPU-only; --n-batch {n_seq} decodes one position per sequence at a time")
    cand_residency = residency or {"mode": "off"}
    ref_residency = {"mode": "off"} if ref_kind == "resident" else None

    tmp_root = Path(work_dir) if work_dir else Path(tempfile.gettempdir())
    if work_dir:
        from rollingkv_cli.userinput import check_output_dir

        check_output_dir(tmp_root, "--work-dir")
    try:
        tmp_root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        abort(f"cannot use --work-dir {tmp_root}: {e.strerror or e}")
    if synthetic_tokens is not None:  # a file's count is known once tokenized (checked again then, below)
        equiv_runs.check_room(model_path, synthetic_tokens, n_ctx or -(-synthetic_tokens // 256) * 256 + 256, ctk, ctv, tmp_root,
                              2 if tail_baseline else 1, f"--synthetic-tokens {synthetic_tokens}", kv_on_host=on_cpu)
    logs_dir = common.logs_dir()
    results: dict[str, dict] = {}
    baseline_how = None
    floor_how = None
    control = control_th = None
    above = None
    with common.work_dir(tmp_root, "rollingkv-gate-") as td:
        wd = Path(td)
        sess = equiv_runs.EquivSession(model=model_path, wd=wd, logs=logs_dir, threads=threads, n_batch=n_batch, n_seq=n_seq,
                                       n_gpu_layers=n_gpu_layers)
        # ------------------------------------------------------------ tokens (with the candidate's library)
        with console.status("tokenizing"):
            tok = sess.tokenize(cand_lib, prompt_file, synthetic_tokens)
        n_tokens, n_vocab = sess.n_tokens, sess.n_vocab
        if n_tokens == 0:
            abort(f"{prompt_file or 'the text'} holds fewer than {n_seq} tokens" if n_seq > 1 else f"{prompt_file} holds no tokens")
        if mode != "off" and not tok.get("has_residency"):
            abort("this build has no KV residency API; rebuild",
                  f"{build.dir or build.lib_dir} lacks llama_init_from_model_rolling_kv: run `rollingkv build`, or check with --kv-residency-mode off")
        if n_ctx is None:
            n_ctx = -(-n_tokens // 256) * 256 + 256
        elif n_tokens > n_ctx:
            usage_error(f"{prompt_file or 'the text'} is {n_tokens} tokens and does not fit --ctx {n_ctx}", "raise --ctx or shorten the prompt")
        if kv_window_cells is not None and kv_window_cells >= n_ctx:
            # the context is --ctx or follows from the text: a usage error either way (as in gate needle)
            usage_error(f"--kv-window-cells {kv_window_cells} must be smaller than the context ({n_ctx})", "lower it, or raise --ctx")
        if mode != "off" and kv_window_cells is not None and kv_window_cells >= n_tokens:
            warn(f"the window ({kv_window_cells} cells) holds all {n_tokens} tokens: the tail is never read")
        sess.n_ctx = n_ctx
        need = sess.logits_bytes() * (2 if tail_baseline else 1)
        free = shutil.disk_usage(wd).free
        if need > free - (64 << 20):
            abort(f"the reference logits need {need / 2**20:.0f} MiB in {tmp_root}, {free / 2**20:.0f} MiB are free",
                  "point --work-dir at a larger disk, or decode fewer tokens")

        ref_label = "reference (resident)" if ref_kind == "resident" else f"reference ({esc(equiv_runs.short_path(ref_lib))})"
        cand_label = f"candidate ({mode})"
        console.print(f"[dim]{esc(model_path.name)}: {n_tokens} tokens{f' as {n_seq} sequences side by side' if n_seq > 1 else ''}, "
                      f"ctx {n_ctx}, batch {n_batch}, {threads} threads, "
                      f"K/V {ctk}/{ctv}{equiv_runs.tail_desc(mode, ctkt, ctvt)}"
                      f"{'' if n_gpu_layers is None else f', -ngl {n_gpu_layers}'}[/]")
        positions_tmp = wd / "positions.npz"
        with equiv_runs.progress(console) as progress:
            results["reference"] = sess.decode("reference", ref_lib, ctk, ctv, ref_residency, save=wd / "ref.npy",
                                               progress=progress, label=ref_label)
            if tail_baseline:
                bk, bv = ctkt or ctk, ctvt or ctv
                results["baseline"] = sess.decode("baseline", cand_lib, bk, bv, {"mode": "off"}, save=wd / "baseline.npy",
                                                  reference=wd / "ref.npy", positions_out=wd / "baseline.npz",
                                                  real_margin_nats=thresholds["real_margin_nats"], progress=progress,
                                                  label=f"baseline (resident {bk}/{bv})")
            if order_floor:
                fb = equiv_runs.order_floor_batch(n_batch, n_seq)
                results["order_floor"] = sess.decode("order_floor", cand_lib, ctk, ctv, {"mode": "off"}, reference=wd / "ref.npy",
                                                     real_margin_nats=thresholds["real_margin_nats"], positions_out=wd / "order_floor.npz",
                                                     progress=progress, label=f"order floor (resident, batch {fb})", n_batch=fb)
            results["candidate"] = sess.decode("candidate", cand_lib, ctk, ctv, cand_residency, reference=wd / "ref.npy",
                                               real_margin_nats=thresholds["real_margin_nats"], positions_out=positions_tmp,
                                               progress=progress, label=cand_label)
            cand_rows = metrics.load_positions(positions_tmp)
            summary, tail_mask = equiv_runs.split_summary(results["candidate"], cand_rows, n_seq, n_batch, thresholds["real_margin_nats"])
            if profile == "auto":  # the bounds of the types the plan chose
                tt = (results["candidate"].get("plan") or {}).get("tail_types") or {}
                thresholds = metrics.auto_thresholds(thresholds, (tt.get("k"), tt.get("v")))
            if tail_baseline:
                base_rows = metrics.load_positions(wd / "baseline.npz")
                base_tail = metrics.subset_summary(base_rows, tail_mask, thresholds["real_margin_nats"])
                thresholds, baseline_how = metrics.relative_thresholds(thresholds, base_tail, bk)
                above = int((cand_rows["tv"][tail_mask[cand_rows["pos"]]] > base_rows["tv"][tail_mask[base_rows["pos"]]]).sum())
                hs = summary.get("head_split")
                if hs is not None and hs["uniform"] is None:
                    warn("no control: the head split keeps different numbers of KV heads per layer on the device "
                         f"({hs['summary']}), which --kv-device-heads cannot repeat")
                if summary["window_cells"] or (hs is not None and hs["uniform"] is not None):
                    control_th = equiv_runs.control_thresholds(thresholds_file, exact_bits, tolerance)
                    control_res = (dict(cand_residency, mode="window", window_cells=summary["window_cells"], vram_target_mib=0,
                                        type_k_tail=None, type_v_tail=None) if hs is None else
                                   dict(cand_residency, mode="head", device_heads=hs["uniform"], window_cells=0, vram_target_mib=0,
                                        type_k_tail=None, type_v_tail=None))
                    results["control"] = sess.decode("control", cand_lib, bk, bv, control_res, reference=wd / "baseline.npy",
                                                     positions_out=wd / "control.npz", real_margin_nats=control_th["real_margin_nats"],
                                                     progress=progress, label=f"control ({bk}/{bv} {'window + tail' if hs is None else 'device + host heads'} vs baseline)")
                    control, _ = equiv_runs.split_summary(results["control"], metrics.load_positions(wd / "control.npz"), n_seq, n_batch,
                                                          control_th["real_margin_nats"])
            if order_floor:
                thresholds, floor_how = metrics.order_floor_thresholds(thresholds, results["order_floor"]["summary"])
                floor_rows = metrics.load_positions(wd / "order_floor.npz")
                if thresholds.get("max_frac_over_floor") is not None:  # same-type bounds: the per-position bound
                    summary["over_floor"] = metrics.over_floor(cand_rows, floor_rows, tail_mask, thresholds["order_factor"])
                if control is not None:
                    control_th, _ = metrics.order_floor_thresholds(control_th, results["order_floor"]["summary"])
                    if control_th.get("max_frac_over_floor") is not None:
                        control["over_floor"] = metrics.over_floor(metrics.load_positions(wd / "control.npz"), floor_rows, tail_mask,
                                                                   control_th["order_factor"])
        positions_file = None
        if json_out is not None:
            positions_file = equiv_runs.positions_path(json_out)
            try:
                positions_file.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(positions_tmp, positions_file)
            except OSError:
                positions_file = None

    cand_plan = results["candidate"].get("plan")
    needle_report = None
    if needle:
        needle_report = equiv_runs.auto_needle(model_path, build, cand_plan, n_ctx=n_ctx, mode=mode, window_cells=kv_window_cells,
                                               vram_target=vram_target, device_heads=kv_device_heads, ctk=ctk, ctv=ctv, ctkt=ctkt,
                                               ctvt=ctvt, threads=threads, n_gpu_layers=n_gpu_layers, console=console, logs=logs_dir)
    v = metrics.verdict(summary, thresholds)
    vc = metrics.verdict(control, control_th) if control is not None else None
    needle_failed = needle_report is not None and needle_report["verdict"] == "fail"
    passed = v.passed and (vc is None or vc.passed) and not needle_failed
    title = None
    if baseline_how:
        title = (f"equivalence gate (quantized bounds over the {summary['tail_positions']} positions that read the tail, relative "
                 f"to the resident {ctkt or ctk}/{ctvt or ctv} cache at the same positions")
    if profile == "auto":
        tt = (cand_plan or {}).get("tail_types") or {}
        title = (f"auto tail types: K {tt.get('k', '?')}, V {tt.get('v', '?')}; the loss against the resident {ctk}/{ctv} cache over "
                 f"the {summary['tail_positions']} positions that read the tail (auto bounds")
    if floor_how:
        title = (title or f"equivalence gate ({profile.replace('_', '-')} bounds") + ", relaxed to the order floor where looser"
    title = title + ")" if title else None
    equiv_runs.print_table(console, summary, thresholds, v, profile, title=title)
    ref_r, cand_r = results["reference"], results["candidate"]
    if baseline_how:
        bt = base_tail
        console.print(f"[dim]baseline (the whole cache {ctkt or ctk}/{ctvt or ctv}, resident) over the same positions: mean TV "
                      f"{equiv_runs.fmt(bt['mean_tv'])}, real {equiv_runs.fmt(bt['real_frac'])}; bound = {thresholds['baseline_factor']:g} x "
                      f"baseline; {above} of {summary['tail_positions']} positions lost more than their baseline[/]")
    if vc is not None:
        mark = "[green]✓[/]" if vc.passed else "[bold red]✗[/]"
        console.print(f"{mark} control ({ctkt or ctk}/{ctvt or ctv} {'window + tail' if summary.get('head_split') is None else 'device + host heads'} vs the baseline): mean TV {equiv_runs.fmt(control['mean_tv'])}, "
                      f"{control.get('bitwise_equal_rows')}/{control['n']} rows bitwise identical"
                      + ("" if vc.passed else ": " + esc("; ".join(c.describe() for c in vc.failed))), soft_wrap=True)
    if floor_how:
        fs = results["order_floor"]["summary"]
        of = summary.get("over_floor")
        per_pos = ("" if not of or of["floor_tv"] is None else
                   f"; per position: its {100 * of['quantile']:g}th-percentile TV over the {of['n']} positions that read the tail "
                   f"{equiv_runs.fmt(of['floor_tv'])}, {of['n_over']} of the split's above {of['factor']:g} x that "
                   f"({equiv_runs.fmt(of['bound_tv'])})")
        console.print(f"[dim]order floor (the resident cache, batch {equiv_runs.order_floor_batch(n_batch, n_seq)}): mean TV {equiv_runs.fmt(fs['mean_tv'])}, "
                      f"top-1 {equiv_runs.fmt(fs['top1_agreement'])}, real {equiv_runs.fmt(fs['real_frac'])}; "
                      f"bounds relaxed to {thresholds['order_factor']:g} x floor where looser{per_pos}[/]")
    equiv_runs.print_plan(console, cand_r.get("plan"))
    from rollingkv_cli.serve.status import describe_tail_cpu, describe_tail_types

    types_line = describe_tail_types(cand_r.get("plan"))
    if types_line:
        console.print(types_line, style="dim", markup=False, soft_wrap=True)
    if needle_report is not None:
        equiv_runs.print_needle(console, needle_report)

    split_line = describe_tail_cpu(cand_r.get("plan"))
    if split_line:
        console.print(split_line, style="dim", markup=False, soft_wrap=True)
    console.print(f"[dim]decode: reference {ref_r['timings']['decode_s']:.1f} s ({ref_r['timings']['tokens_per_s']} tok/s), "
                  f"candidate {cand_r['timings']['decode_s']:.1f} s ({cand_r['timings']['tokens_per_s']} tok/s); "
                  f"compare {cand_r['timings']['compare_s']:.1f} s[/]")

    report = {
        "rollingkv": __version__,
        "verdict": "pass" if passed else "fail",
        "passed": passed,
        "failed_checks": [c.name for c in v.failed] + ([f"control.{c.name}" for c in vc.failed] if vc is not None else [])
                         + (["needle"] if needle_failed else []),
        "profile": profile,
        "thresholds": thresholds,
        "thresholds_file": str(thresholds_file.resolve()) if thresholds_file else None,
        "metrics": {k: x for k, x in summary.items() if k not in ("tail", "window", "over_floor")},
        "tail_positions": summary["tail_positions"],
        "over_floor": summary.get("over_floor"),
        "window_cells": summary["window_cells"],
        "head_split": summary.get("head_split"),
        "tail_cpu": {"requested": cpu_frac if cpu_frac is not None else "the library's default (auto)",
                     "plan": (cand_r.get("plan") or {}).get("tail_cpu")},
        "tail_metrics": summary["tail"],
        "window_metrics": summary["window"],
        "auto_tail": None if profile != "auto" else equiv_runs.auto_tail_report(cand_plan, summary, thresholds, v, needle_report),
        "checks": v.to_dict()["checks"],
        "model": str(model_path),
        "tokens": {"n": n_tokens, "n_vocab": n_vocab, **tok.get("source", {})},
        "n_ctx": n_ctx,
        "n_batch": n_batch,
        "n_seq": n_seq,
        "threads": threads,
        "n_gpu_layers": n_gpu_layers,
        "cache_types": {"k": ctk, "v": ctv, "k_tail": ctkt or ctk, "v_tail": ctvt or ctv},
        "reference": {"spec": reference, "lib": ref_r.get("lib"), "build_info": ref_r.get("build_info"),
                      "rollingkv_lib": ref_r.get("rollingkv"), "residency": ref_residency, "context_via": ref_r.get("context_via"),
                      "plan": ref_r.get("plan"), "n_ctx": ref_r.get("n_ctx"), "timings": ref_r.get("timings")},
        "candidate": {"lib": cand_r.get("lib"), "build_info": cand_r.get("build_info"), "residency": cand_residency,
                      "context_via": cand_r.get("context_via"), "plan": cand_r.get("plan"), "n_ctx": cand_r.get("n_ctx"),
                      "cpu_part_runs": cand_r.get("cpu_part_runs"), "timings": cand_r.get("timings")},
        "baseline": None if not baseline_how else {"cache_types": {"k": ctkt or ctk, "v": ctvt or ctv}, "metrics": results["baseline"]["summary"],
                                                   "tail_metrics": base_tail, "bounds": baseline_how, "tail_positions_above": above,
                                                   "timings": results["baseline"].get("timings")},
        "control": None if control is None else {"cache_types": {"k": ctkt or ctk, "v": ctvt or ctv}, "passed": vc.passed,
                                                 "thresholds": control_th, "metrics": {k: x for k, x in control.items() if k not in ("tail", "window", "over_floor")},
                                                 "over_floor": control.get("over_floor"),
                                                 "checks": vc.to_dict()["checks"], "plan": results["control"].get("plan"),
                                                 "timings": results["control"].get("timings")},
        "order_floor": None if not floor_how else {"n_batch": equiv_runs.order_floor_batch(n_batch, n_seq), "metrics": results["order_floor"]["summary"],
                                                   "bounds": floor_how, "timings": results["order_floor"].get("timings")},
        "build": build.describe(),
        "positions_file": str(positions_file) if positions_file else None,
        "commands": sess.commands,
        "logs": str(logs_dir),
        "wall_s": round(time.time() - t_start, 2),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if json_out is not None:
        common.write_json(json_out, report)
        note(f"report: {json_out}")
    if passed:
        console.print("[bold green]PASS[/] the candidate reproduces the reference within every bound")
        return
    fails = [c.describe() for c in v.failed] + (["control: " + c.describe() for c in vc.failed] if vc is not None else [])
    if needle_failed:
        fails.append("the needle: the split does not retrieve the number the resident run retrieves")
    console.print("[bold red]FAIL[/] " + esc("; ".join(fails)), soft_wrap=True)
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

