"""gate equiv's work, without click: from the command's options to the runs, the verdict and the report.

prepare (the checks that need no decode, the bounds, the build, the residency asked for) -> decode (the runner
children: reference, baseline, order floor, candidate, control) -> judge (the needle, the verdicts) -> print_results and
build_report. gate/cli/equiv.py is the click layer; gate/equiv.py the runs it shares with gate matrix."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rollingkv_cli.gate import equiv as equiv_runs
from rollingkv_cli.lib.residency import ResidencyRequest


@dataclass
class EquivOptions:
    """gate equiv's options as given (the click layer checked each alone, and parsed the reference's spec)."""

    model_spec: str
    prompt_file: Path | None = None
    synthetic_tokens: int | None = None
    n_ctx: int | None = None
    kv_window_cells: int | None = None
    kv_device_heads: int | None = None
    vram_target: int | None = None
    ctk: str = "f16"
    ctv: str = "f16"
    ctkt: str | None = None
    ctvt: str | None = None
    mode: str = "window"
    cpu_frac: float | str | None = None
    reference: str = "resident"
    ref_kind: str = "resident"
    ref_lib: Path | None = None
    thresholds_file: Path | None = None
    tail_baseline: bool = False
    tolerance: float | None = None
    order_floor: bool | None = None
    needle: bool | None = None
    json_out: Path | None = None
    threads: int | None = None
    n_batch: int = 512
    n_seq: int = 1
    n_gpu_layers: int | None = None
    build_dir: Path | None = None
    lib_dir: Path | None = None
    work_dir: Path | None = None


@dataclass
class EquivSetup:
    """The checked run: the options, and what follows from them (defaults filled in, the bounds, the build)."""

    options: EquivOptions
    t_start: float
    profile: str  # same_type | quantized | auto (metrics.profile_for)
    thresholds: dict
    needle: bool | None
    tail_baseline: bool
    ref_kind: str
    ref_lib: Path | None
    threads: int
    model_path: Path
    build: object  # common.GateBuild
    cand_lib: Path
    order_floor: bool
    exact_bits: bool
    synthetic_tokens: int | None
    kv_device_heads: int | None
    cand_residency: dict
    ref_residency: dict | None
    tmp_root: Path


@dataclass
class EquivRuns:
    """What the runs gave: each run's result, the candidate's summary and the bounds it is held to (relaxed by the
    baseline and the order floor where they ran), the control."""

    results: dict
    summary: dict
    thresholds: dict
    baseline_how: dict | None
    floor_how: dict | None
    control: dict | None
    control_th: dict | None
    above: int | None
    base_tail: dict | None
    positions_file: Path | None
    n_tokens: int
    n_vocab: int
    n_ctx: int
    tok: dict
    commands: list
    logs_dir: Path


@dataclass
class EquivVerdict:
    """The gate's verdict: the candidate's (v) and the control's (vc) checks, the needle's, and the table's title."""

    cand_plan: dict | None
    needle_report: dict | None
    v: object  # metrics.Verdict
    vc: object | None
    needle_failed: bool
    passed: bool
    title: str | None


def prepare(o: EquivOptions) -> EquivSetup:
    """Every check of the inputs that needs no decode (one line each, usage errors exit 2), the bounds, the build and the
    model, the residency the candidate asks for, and room for the reference logits."""
    from rollingkv_cli import models
    from rollingkv_cli.console import abort, note, usage_error, warn
    from rollingkv_cli.gate import common, metrics
    from rollingkv_cli.lib import paths

    model_spec, prompt_file, synthetic_tokens, n_ctx = o.model_spec, o.prompt_file, o.synthetic_tokens, o.n_ctx
    kv_window_cells, kv_device_heads, vram_target, ctk = o.kv_window_cells, o.kv_device_heads, o.vram_target, o.ctk
    ctv, ctkt, ctvt, mode = o.ctv, o.ctkt, o.ctvt, o.mode
    cpu_frac, thresholds_file, tail_baseline, tolerance = o.cpu_frac, o.thresholds_file, o.tail_baseline, o.tolerance
    order_floor, needle, json_out, threads = o.order_floor, o.needle, o.json_out, o.threads
    n_batch, n_seq, n_gpu_layers, build_dir = o.n_batch, o.n_seq, o.n_gpu_layers, o.build_dir
    lib_dir, work_dir = o.lib_dir, o.work_dir
    ref_kind, ref_lib = o.ref_kind, o.ref_lib
    t_start = time.time()
    # ---------------------------------------------------------------- input checks, cheapest first
    request = ResidencyRequest(mode=mode, window_cells=kv_window_cells, device_heads=kv_device_heads, vram_target=vram_target,
                               type_k_tail=ctkt, type_v_tail=ctvt, tail_cpu_frac=cpu_frac)
    common.check_request(request)
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
    # several sequences share one unified cache, where a split places each sequence's cells in blocks of its own (API 11);
    # on the CPU the rounding follows the cells' order, so every run of the gate places as the reference does: by
    # sequence against the resident run of this build, as upstream against another library
    placement = {} if n_seq == 1 else {"placement": "sequences" if ref_kind == "resident" else "upstream"}
    cand_residency = dict(residency or {"mode": "off"}, **placement)
    ref_residency = {"mode": "off", **placement} if ref_kind == "resident" else None

    tmp_root = common.work_root(work_dir)
    if synthetic_tokens is not None:  # a file's count is known once tokenized (checked again then, below)
        equiv_runs.check_room(model_path, synthetic_tokens, n_ctx or -(-synthetic_tokens // 256) * 256 + 256, ctk, ctv, tmp_root,
                              2 if tail_baseline else 1, f"--synthetic-tokens {synthetic_tokens}", kv_on_host=on_cpu)
    return EquivSetup(options=o, t_start=t_start, profile=profile, thresholds=thresholds, needle=needle, tail_baseline=tail_baseline,
                      ref_kind=ref_kind, ref_lib=ref_lib, threads=threads, model_path=model_path, build=build, cand_lib=cand_lib,
                      order_floor=order_floor, exact_bits=exact_bits, synthetic_tokens=synthetic_tokens, kv_device_heads=kv_device_heads,
                      cand_residency=cand_residency, ref_residency=ref_residency, tmp_root=tmp_root)


def decode(setup: EquivSetup) -> EquivRuns:
    """The runs, each a runner child (gate/equiv.py): tokens, the reference, the baseline and the order floor where
    asked, the candidate, the control; the candidate's summary and the bounds it is held to."""
    from rollingkv_cli.console import abort, console, esc, usage_error, warn
    from rollingkv_cli.gate import common, metrics

    o = setup.options
    prompt_file, n_ctx, kv_window_cells, ctk = o.prompt_file, o.n_ctx, o.kv_window_cells, o.ctk
    ctv, ctkt, ctvt, mode = o.ctv, o.ctkt, o.ctvt, o.mode
    thresholds_file, tolerance, json_out = o.thresholds_file, o.tolerance, o.json_out
    n_batch, n_seq, n_gpu_layers = o.n_batch, o.n_seq, o.n_gpu_layers
    profile, thresholds, tail_baseline = setup.profile, setup.thresholds, setup.tail_baseline
    ref_kind, ref_lib, threads, model_path = setup.ref_kind, setup.ref_lib, setup.threads, setup.model_path
    build, cand_lib, order_floor, exact_bits = setup.build, setup.cand_lib, setup.order_floor, setup.exact_bits
    synthetic_tokens, cand_residency = setup.synthetic_tokens, setup.cand_residency
    ref_residency, tmp_root = setup.ref_residency, setup.tmp_root
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
        with equiv_runs.progress(console) as progress:  # a bar with counts, as the decode phases below
            tok = sess.tokenize(cand_lib, prompt_file, synthetic_tokens, progress=progress)
        n_tokens, n_vocab = sess.n_tokens, sess.n_vocab
        if n_tokens == 0:
            if n_seq > 1:
                abort(f"{prompt_file or 'the text'} holds fewer than {n_seq} tokens", "lower --n-seq, or give more text")
            abort(f"{prompt_file} holds no tokens", "give a file with text in it, or --synthetic-tokens N")
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
        resident = {"mode": "off", **{k: v for k, v in cand_residency.items() if k == "placement"}}  # placed as the candidate
        with equiv_runs.progress(console) as progress:
            results["reference"] = sess.decode("reference", ref_lib, ctk, ctv, ref_residency, save=wd / "ref.npy",
                                               progress=progress, label=ref_label)
            if tail_baseline:
                bk, bv = ctkt or ctk, ctvt or ctv
                results["baseline"] = sess.decode("baseline", cand_lib, bk, bv, resident, save=wd / "baseline.npy",
                                                  reference=wd / "ref.npy", positions_out=wd / "baseline.npz",
                                                  real_margin_nats=thresholds["real_margin_nats"], progress=progress,
                                                  label=f"baseline (resident {bk}/{bv})")
            if order_floor:
                fb = equiv_runs.order_floor_batch(n_batch, n_seq)
                results["order_floor"] = sess.decode("order_floor", cand_lib, ctk, ctv, resident, reference=wd / "ref.npy",
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
    return EquivRuns(results=results, summary=summary, thresholds=thresholds, baseline_how=baseline_how, floor_how=floor_how,
                     control=control, control_th=control_th, above=above, base_tail=base_tail if baseline_how else None,
                     positions_file=positions_file, n_tokens=n_tokens, n_vocab=n_vocab, n_ctx=n_ctx, tok=tok, commands=sess.commands,
                     logs_dir=logs_dir)


def judge(setup: EquivSetup, runs: EquivRuns) -> EquivVerdict:
    """The needle where asked (auto tail types), the verdicts of the candidate and the control, the table's title."""
    from rollingkv_cli.console import console
    from rollingkv_cli.gate import metrics

    o = setup.options
    kv_window_cells, vram_target, ctk = o.kv_window_cells, o.vram_target, o.ctk
    ctv, ctkt, ctvt, mode = o.ctv, o.ctkt, o.ctvt, o.mode
    n_gpu_layers = o.n_gpu_layers
    profile, needle, threads, model_path = setup.profile, setup.needle, setup.threads, setup.model_path
    build, kv_device_heads = setup.build, setup.kv_device_heads
    results, summary, thresholds, baseline_how = runs.results, runs.summary, runs.thresholds, runs.baseline_how
    floor_how, control, control_th, n_ctx = runs.floor_how, runs.control, runs.control_th, runs.n_ctx
    logs_dir = runs.logs_dir
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
    return EquivVerdict(cand_plan=cand_plan, needle_report=needle_report, v=v, vc=vc, needle_failed=needle_failed, passed=passed,
                        title=title)


def print_results(setup: EquivSetup, runs: EquivRuns, verdict: EquivVerdict) -> None:
    """The table of bounds, the baseline, control and order floor lines, the plan, the needle, the timings."""
    from rollingkv_cli.console import console, esc

    o = setup.options
    ctk, ctv, ctkt, ctvt = o.ctk, o.ctv, o.ctkt, o.ctvt
    n_batch, n_seq = o.n_batch, o.n_seq
    profile = setup.profile
    results, summary, thresholds, baseline_how = runs.results, runs.summary, runs.thresholds, runs.baseline_how
    floor_how, control, above, base_tail = runs.floor_how, runs.control, runs.above, runs.base_tail
    tok = runs.tok
    needle_report, v, vc, title = verdict.needle_report, verdict.v, verdict.vc, verdict.title
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


def build_report(setup: EquivSetup, runs: EquivRuns, verdict: EquivVerdict) -> dict:
    """The JSON report (--json)."""
    from rollingkv_cli import __version__

    o = setup.options
    ctk, ctv, ctkt = o.ctk, o.ctv, o.ctkt
    ctvt, cpu_frac, reference, thresholds_file = o.ctvt, o.cpu_frac, o.reference, o.thresholds_file
    n_batch, n_seq, n_gpu_layers = o.n_batch, o.n_seq, o.n_gpu_layers
    t_start, profile, threads, model_path = setup.t_start, setup.profile, setup.threads, setup.model_path
    build, cand_residency, ref_residency = setup.build, setup.cand_residency, setup.ref_residency
    results, summary, thresholds, baseline_how = runs.results, runs.summary, runs.thresholds, runs.baseline_how
    floor_how, control, control_th, above = runs.floor_how, runs.control, runs.control_th, runs.above
    base_tail, positions_file, n_tokens, n_vocab = runs.base_tail, runs.positions_file, runs.n_tokens, runs.n_vocab
    n_ctx, tok, commands, logs_dir = runs.n_ctx, runs.tok, runs.commands, runs.logs_dir
    cand_plan, needle_report, v, vc = verdict.cand_plan, verdict.needle_report, verdict.v, verdict.vc
    needle_failed, passed = verdict.needle_failed, verdict.passed
    ref_r, cand_r = results["reference"], results["candidate"]
    return {
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
        "commands": commands,
        "logs": str(logs_dir),
        "wall_s": round(time.time() - t_start, 2),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def failures(verdict: EquivVerdict) -> list[str]:
    """What failed, in words (FAIL's line)."""
    v, vc = verdict.v, verdict.vc
    fails = [c.describe() for c in v.failed] + (["control: " + c.describe() for c in vc.failed] if vc is not None else [])
    if verdict.needle_failed:
        fails.append("the needle: the split does not retrieve the number the resident run retrieves")
    return fails
