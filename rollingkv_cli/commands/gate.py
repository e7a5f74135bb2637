"""`rollingkv gate`: prove that the split KV cache reproduces the fully resident run.

- `gate equiv` decodes one token sequence teacher-forced twice, each in its own process (llama_cpp binds
  one library per process): a reference (our build with residency off, or another build's libllama) and
  a candidate (our build with the residency parameters), and compares every position's next-token
  distribution (gate_math). The candidate compares its logits against the reference's on the fly.
- `gate needle` asks a resident and a split llama-server for a fact placed in the tail (gate_needle).
- `gate vram` samples NVML while a llama-server with --vram-target decodes a long sequence (gate_vram).
- `gate matrix` runs equiv over tail types x split points, the quantized parts' exactness, and the needle,
  and writes a JSON report and a markdown table (gate_matrix).

Exit status of every gate: 0 pass, 1 fail (or an error), 2 usage error; gate vram 3 without an NVIDIA GPU
(as `rollingkv probe pcie`); gate needle (and matrix) 4 when the resident model itself misses the needle.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click

from rollingkv_cli.gate_common import CACHE_TYPES, EXIT_FAIL, EXIT_INCONCLUSIVE

MODES = ["window", "auto", "off"]


@click.group()
def gate() -> None:
    """Check the split KV cache against the fully resident run.

    \b
    equiv   teacher-forced next-token distributions, split vs resident
    needle  a fact placed in the host tail is retrieved exactly as resident
    vram    device memory stays within --vram-target + 200 MiB (GPU only)
    matrix  equiv over tail types x split points, plus needle; JSON + markdown
    """


def _positive(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter("must be at least 1")
    return value


def _non_negative(ctx, param, value):
    if value is not None and value < 0:
        raise click.BadParameter("must be at least 0")
    return value


def _fraction_list(ctx, param, value):
    """'0.25,0.5' or several uses of the option -> a tuple of fractions in (0, 1)."""
    if value is None:
        return None
    items = value if isinstance(value, (tuple, list)) else (value,)
    out = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                f = float(part)
            except ValueError:
                raise click.BadParameter(f"{part!r} is not a number") from None
            if not 0 < f < 1:
                raise click.BadParameter(f"{part} is not a fraction strictly between 0 and 1")
            out.append(f)
    if not out and items:
        raise click.BadParameter("give at least one fraction")
    return tuple(out) or None


def _type_list(ctx, param, value):
    if value is None:
        return None
    out = [t.strip() for t in value.split(",") if t.strip()]
    bad = [t for t in out if t not in CACHE_TYPES]
    if bad:
        raise click.BadParameter(f"{', '.join(bad)}: not a cache type ({', '.join(CACHE_TYPES)})")
    if not out:
        raise click.BadParameter("give at least one type")
    return tuple(dict.fromkeys(out))


def _build_options(f):
    f = click.option("--lib-dir", type=click.Path(path_type=Path), default=None, metavar="DIR",
                     help="Run the libllama.so and llama-server in DIR (llama.cpp's build/bin of this series) instead of the active build.")(f)
    f = click.option("--build", "build_dir", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="DIR",
                     help="Run this `rollingkv build` directory (what `rollingkv build --print-dir` prints) instead of the active build.")(f)
    return f


def _ngl_option(default=None, help_default="the library's default"):
    return click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", type=int, callback=_non_negative, default=default,
                        help=f"Layers to offload to the GPU (0: none).  [default: {help_default}]")


def _cache_type_options(f):
    f = click.option("-ctvt", "--cache-type-v-tail", "ctvt", type=click.Choice(CACHE_TYPES), default=None, help="Type of V in the host tail. Default: -ctv.")(f)
    f = click.option("-ctkt", "--cache-type-k-tail", "ctkt", type=click.Choice(CACHE_TYPES), default=None, help="Type of K in the host tail. Default: -ctk.")(f)
    f = click.option("-ctv", "--cache-type-v", "ctv", type=click.Choice(CACHE_TYPES), default="f16", show_default=True, help="Type of V (the window's, and the reference's).")(f)
    f = click.option("-ctk", "--cache-type-k", "ctk", type=click.Choice(CACHE_TYPES), default="f16", show_default=True, help="Type of K (the window's, and the reference's).")(f)
    return f


# ====================================================================== equiv

@gate.command()
@click.option("--model", "model_spec", required=True, metavar="PATH|demo", help="A GGUF file, or `demo`.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Text to decode (tokenized with the model's vocabulary). Default: synthetic text.")
@click.option("--synthetic-tokens", type=int, callback=_positive, default=None,
              help="Decode N tokens of built-in deterministic public-domain prose.  [default: 2048]")
@click.option("--ctx", "n_ctx", type=int, callback=_positive, default=None,
              help="Context size. Default: the token count rounded up to 256, plus 256.")
@click.option("--kv-window-cells", type=int, callback=_positive, default=None, help="Cells of the device window per stream.")
@click.option("--vram-target", type=int, callback=_positive, default=None, metavar="MiB", help="Device memory budget; the planner sizes the window.")
@_cache_type_options
@click.option("--kv-residency-mode", "mode", type=click.Choice(MODES), default="window", show_default=True,
              help="The candidate's residency mode (off: the plain resident cache, a sanity run).")
@click.option("--reference", "reference", default="resident", show_default=True, metavar="resident|lib:PATH",
              help="resident: the active build with residency off; lib:PATH: the libllama in PATH (a directory or the file) of another build, e.g. an unpatched one.")
@click.option("--thresholds", "thresholds_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="YAML/JSON file overriding the default bounds (flat keys, or per profile: same_type/quantized).")
@click.option("--tail-baseline", is_flag=True,
              help="Quantized tail: also decode the resident cache with every K/V in the tail's type, and let the split lose up to "
                   "baseline_factor (3) times what that loses (each upper bound becomes max(bound, factor x baseline)).")
@click.option("--order-floor/--no-order-floor", default=None,
              help="Also decode the resident cache with half the batch (the same math in another floating-point order, as GPU "
                   "attention kernels tile by shape), and let the split differ up to order_factor (2) times what that run "
                   "differs (upper bounds max(bound, 2 x floor); agreement bounds min(bound, 1 - 2 x (1 - floor))).  "
                   "[default: on for the CUDA backend, off on the CPU, where the split is bit-identical]")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the full report here.")
@click.option("--threads", type=int, callback=_positive, default=None, help="CPU threads per run.  [default: all cores]")
@click.option("--n-batch", type=int, callback=_positive, default=512, show_default=True, help="Tokens per llama_decode (and per ubatch), the same for both runs.")
@click.option("--n-seq", type=int, callback=_positive, default=1, show_default=True,
              help="Decode the text as N equal sequences side by side, each batch holding positions of all of them in one "
                   "unified KV cache (as llama-server's --parallel N slots): their cells interleave in the window and the tail.")
@_ngl_option()
@_build_options
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the reference logits (n_tokens x n_vocab x 4 bytes) are kept during the run.  [default: the temp dir]")
def equiv(model_spec, prompt_file, synthetic_tokens, n_ctx, kv_window_cells, vram_target, ctk, ctv, ctkt, ctvt, mode,
          reference, thresholds_file, tail_baseline, order_floor, json_out, threads, n_batch, n_seq, n_gpu_layers, build_dir,
          lib_dir, work_dir) -> None:
    """Decode a text teacher-forced with the reference and the candidate and compare every position's distribution.

    The text runs as one sequence, or as --n-seq sequences side by side. On the CUDA backend the bounds also
    follow the resident run's own floating-point order floor (--order-floor).

    Exit status: 0 when every bound holds, 1 when one does not (or on an error), 2 on a usage error.
    """
    from rollingkv_cli import __version__, gate_common, gate_equiv, gate_math, models, paths
    from rollingkv_cli.console import abort, console, esc, note, usage_error, warn

    t_start = time.time()
    # ---------------------------------------------------------------- input checks, cheapest first
    if prompt_file is not None and synthetic_tokens is not None:
        raise click.UsageError("give --prompt-file or --synthetic-tokens, not both")
    if kv_window_cells is not None and vram_target is not None:
        raise click.UsageError("give --kv-window-cells or --vram-target, not both")
    if build_dir is not None and lib_dir is not None:
        raise click.UsageError("give --build or --lib-dir, not both")
    if prompt_file is None and synthetic_tokens is None:
        synthetic_tokens = 2048
    if n_ctx is not None and kv_window_cells is not None and kv_window_cells >= n_ctx:
        usage_error(f"--kv-window-cells {kv_window_cells} must be smaller than --ctx {n_ctx}",
              "the window holds cells [0, window); a window as large as the context leaves no tail to check")
    if n_ctx is not None and synthetic_tokens is not None and synthetic_tokens > n_ctx:
        usage_error(f"{synthetic_tokens} tokens do not fit --ctx {n_ctx}", "raise --ctx or lower --synthetic-tokens")
    if mode == "off" and (kv_window_cells or vram_target or ctkt or ctvt):
        warn("--kv-residency-mode off ignores --kv-window-cells, --vram-target and the tail types")
    profile = gate_math.profile_for((ctk, ctv), (None, None) if mode == "off" else (ctkt, ctvt))
    try:
        thresholds = gate_math.load_thresholds(thresholds_file, profile)
    except gate_math.ThresholdsError as e:
        abort(str(e), e.hint or "keys: " + ", ".join(sorted(set(gate_math.CHECKS) | gate_math.PARAM_KEYS)))
    if tail_baseline and profile != "quantized":
        warn("--tail-baseline applies to a quantized tail only: the tail holds the window's type, the same-type bounds apply")
        tail_baseline = False
    ref_kind, ref_lib = _parse_reference(reference)
    threads = threads or os.cpu_count() or 1
    if prompt_file is not None:
        from rollingkv_cli.userinput import read_text

        read_text(prompt_file, "prompt file")  # readable UTF-8 text, said here rather than by the runner
    pcie_bw = paths.pcie_bw_env() if mode != "off" else None

    model_path = models.resolve_model(model_spec, log=note)
    build = gate_common.resolve_build(build_dir, lib_dir)
    cand_lib = build.lib_dir
    if order_floor is None:
        order_floor = build.on_gpu(n_gpu_layers)
    if ref_kind == "resident":
        ref_lib = cand_lib

    residency = None
    if mode != "off":
        residency = {"mode": mode, "window_cells": kv_window_cells or 0, "vram_target_mib": vram_target or 0,
                     "type_k_tail": ctkt, "type_v_tail": ctvt}
        if pcie_bw is not None:
            residency["pcie_bw_gbps"] = pcie_bw
    cand_residency = residency or {"mode": "off"}
    ref_residency = {"mode": "off"} if ref_kind == "resident" else None

    tmp_root = Path(work_dir) if work_dir else Path(tempfile.gettempdir())
    try:
        tmp_root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        abort(f"cannot use --work-dir {tmp_root}: {e.strerror or e}")
    logs_dir = gate_common.logs_dir()
    results: dict[str, dict] = {}
    baseline_how = None
    floor_how = None
    with tempfile.TemporaryDirectory(prefix="rollingkv-gate-", dir=tmp_root) as td:
        wd = Path(td)
        sess = gate_equiv.EquivSession(model=model_path, wd=wd, logs=logs_dir, threads=threads, n_batch=n_batch, n_seq=n_seq,
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
            abort(f"{prompt_file or 'the text'} is {n_tokens} tokens and does not fit --ctx {n_ctx}", "raise --ctx or shorten the prompt")
        if kv_window_cells is not None and kv_window_cells >= n_ctx:
            abort(f"--kv-window-cells {kv_window_cells} must be smaller than the context ({n_ctx})", "lower it, or raise --ctx")
        if mode != "off" and kv_window_cells is not None and kv_window_cells >= n_tokens:
            warn(f"the window ({kv_window_cells} cells) holds all {n_tokens} tokens: the tail is never read")
        sess.n_ctx = n_ctx
        need = sess.logits_bytes() * (2 if tail_baseline else 1)
        free = shutil.disk_usage(wd).free
        if need > free - (64 << 20):
            abort(f"the reference logits need {need / 2**20:.0f} MiB in {tmp_root}, {free / 2**20:.0f} MiB are free",
                  "point --work-dir at a larger disk, or decode fewer tokens")

        ref_label = "reference (resident)" if ref_kind == "resident" else f"reference ({esc(gate_equiv.short_path(ref_lib))})"
        cand_label = f"candidate ({mode})"
        console.print(f"[dim]{esc(model_path.name)}: {n_tokens} tokens{f' as {n_seq} sequences side by side' if n_seq > 1 else ''}, "
                      f"ctx {n_ctx}, batch {n_batch}, {threads} threads, "
                      f"K/V {ctk}/{ctv}{gate_equiv.tail_desc(mode, ctkt, ctvt)}"
                      f"{'' if n_gpu_layers is None else f', -ngl {n_gpu_layers}'}[/]")
        positions_tmp = wd / "positions.npz"
        with gate_equiv.progress(console) as progress:
            results["reference"] = sess.decode("reference", ref_lib, ctk, ctv, ref_residency, save=wd / "ref.npy",
                                               progress=progress, label=ref_label)
            if tail_baseline:
                bk, bv = ctkt or ctk, ctvt or ctv
                results["baseline"] = sess.decode("baseline", cand_lib, bk, bv, {"mode": "off"}, reference=wd / "ref.npy",
                                                  real_margin_nats=thresholds["real_margin_nats"], progress=progress,
                                                  label=f"baseline (resident {bk}/{bv})")
                thresholds, baseline_how = gate_math.relative_thresholds(thresholds, results["baseline"]["summary"])
            if order_floor:
                fb = gate_equiv.order_floor_batch(n_batch)
                results["order_floor"] = sess.decode("order_floor", cand_lib, ctk, ctv, {"mode": "off"}, reference=wd / "ref.npy",
                                                     real_margin_nats=thresholds["real_margin_nats"], progress=progress,
                                                     label=f"order floor (resident, batch {fb})", n_batch=fb)
                thresholds, floor_how = gate_math.order_floor_thresholds(thresholds, results["order_floor"]["summary"])
            results["candidate"] = sess.decode("candidate", cand_lib, ctk, ctv, cand_residency, reference=wd / "ref.npy",
                                               real_margin_nats=thresholds["real_margin_nats"], positions_out=positions_tmp,
                                               progress=progress, label=cand_label)
        positions_file = None
        if json_out is not None:
            positions_file = json_out.with_suffix(".positions.npz")
            try:
                positions_file.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(positions_tmp, positions_file)
            except OSError:
                positions_file = None

    summary = results["candidate"]["summary"]
    v = gate_math.verdict(summary, thresholds)
    title = None
    if baseline_how:
        title = f"equivalence gate (quantized bounds, relative to the resident {ctkt or ctk}/{ctvt or ctv} cache)"
    if floor_how:
        title = (title or f"equivalence gate ({profile.replace('_', '-')} bounds") + (", " if title else "") + "relaxed to the order floor where looser)"
    gate_equiv.print_table(console, summary, thresholds, v, profile, title=title)
    ref_r, cand_r = results["reference"], results["candidate"]
    if baseline_how:
        bs = results["baseline"]["summary"]
        console.print(f"[dim]baseline (the whole cache {ctkt or ctk}/{ctvt or ctv}, resident): mean TV {gate_equiv.fmt(bs['mean_tv'])}, "
                      f"real {gate_equiv.fmt(bs['real_frac'])}; bounds = max(absolute, {thresholds['baseline_factor']:g} x baseline)[/]")
    if floor_how:
        fs = results["order_floor"]["summary"]
        console.print(f"[dim]order floor (the resident cache, batch {gate_equiv.order_floor_batch(n_batch)}): mean TV {gate_equiv.fmt(fs['mean_tv'])}, "
                      f"top-1 {gate_equiv.fmt(fs['top1_agreement'])}, real {gate_equiv.fmt(fs['real_frac'])}; "
                      f"bounds relaxed to {thresholds['order_factor']:g} x floor where looser[/]")
    gate_equiv.print_plan(console, cand_r.get("plan"))
    console.print(f"[dim]decode: reference {ref_r['timings']['decode_s']:.1f} s ({ref_r['timings']['tokens_per_s']} tok/s), "
                  f"candidate {cand_r['timings']['decode_s']:.1f} s ({cand_r['timings']['tokens_per_s']} tok/s); "
                  f"compare {cand_r['timings']['compare_s']:.1f} s[/]")

    report = {
        "rollingkv": __version__,
        "verdict": "pass" if v.passed else "fail",
        "passed": v.passed,
        "failed_checks": [c.name for c in v.failed],
        "profile": profile,
        "thresholds": thresholds,
        "thresholds_file": str(thresholds_file.resolve()) if thresholds_file else None,
        "metrics": summary,
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
                      "timings": cand_r.get("timings")},
        "baseline": None if not baseline_how else {"cache_types": {"k": ctkt or ctk, "v": ctvt or ctv}, "metrics": results["baseline"]["summary"],
                                                   "bounds": baseline_how, "timings": results["baseline"].get("timings")},
        "order_floor": None if not floor_how else {"n_batch": gate_equiv.order_floor_batch(n_batch), "metrics": results["order_floor"]["summary"],
                                                   "bounds": floor_how, "timings": results["order_floor"].get("timings")},
        "build": build.describe(),
        "positions_file": str(positions_file) if positions_file else None,
        "commands": sess.commands,
        "logs": str(logs_dir),
        "wall_s": round(time.time() - t_start, 2),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if json_out is not None:
        gate_common.write_json(json_out, report)
        note(f"report: {json_out}")
    if v.passed:
        console.print("[bold green]PASS[/] the candidate reproduces the reference within every bound")
        return
    console.print("[bold red]FAIL[/] " + esc("; ".join(c.describe() for c in v.failed)), soft_wrap=True)
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


# ====================================================================== needle

@gate.command()
@click.option("--model", "model_spec", required=True, metavar="PATH|demo", help="A GGUF file, or `demo`.")
@click.option("--filler-tokens", type=int, callback=_positive, default=1536, show_default=True,
              help="Length of the filler text the needle hides in (about; cut at a sentence).")
@click.option("--filler-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Take the filler from this text file (cut to --filler-tokens). Default: built-in prose without numbers.")
@click.option("--depth", "--position", "depths", multiple=True, callback=_fraction_list, metavar="F",
              help="Where the needle goes, as a fraction of the filler (0..1); repeat (or comma-separate) for several placements.  [default: 0.5, 0.85]")
@click.option("--seed", type=int, default=0, show_default=True, help="Draws the secret numbers (and the filler's sentences).")
@click.option("--format", "fmt", type=click.Choice(["plain", "chat"]), default="plain", show_default=True,
              help="plain: a completion prompt ending in 'Answer: The secret number is'; chat: the model's chat template.")
@click.option("--n-predict", type=int, callback=_positive, default=16, show_default=True, help="Answer tokens generated greedily.")
@click.option("--ctx", "n_ctx", type=int, callback=_positive, default=None, help="Context size.  [default: the prompt rounded up to 256, plus 256]")
@click.option("--kv-window-cells", type=int, callback=_positive, default=None,
              help="Cells of the device window: positions [0, N); the needle must lie at N or later.  [default: 256]")
@click.option("--vram-target", type=int, callback=_positive, default=None, metavar="MiB", help="Device memory budget; the planner sizes the window (GPU).")
@click.option("--kv-residency-mode", "mode", type=click.Choice(["window", "auto"]), default="window", show_default=True,
              help="The candidate's residency mode.")
@_cache_type_options
@click.option("--threads", type=int, callback=_positive, default=None, help="CPU threads per server.  [default: all cores]")
@_ngl_option(help_default="llama-server's")
@_build_options
@click.option("--match", type=click.Choice(["tokens", "answer"]), default=None,
              help="tokens: identical answer tokens; answer: identical through the number (GPU kernels' float order may flip "
                   "a near tie after it).  [default: answer on the CUDA backend, tokens on the CPU]")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the full report here.")
def needle(model_spec, filler_tokens, filler_file, depths, seed, fmt, n_predict, n_ctx, kv_window_cells, vram_target, mode,
           ctk, ctv, ctkt, ctvt, threads, n_gpu_layers, build_dir, lib_dir, match, json_out) -> None:
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
    from rollingkv_cli import gate_common, gate_needle, models
    from rollingkv_cli.console import console, note

    if kv_window_cells is not None and vram_target is not None:
        raise click.UsageError("give --kv-window-cells or --vram-target, not both")
    if build_dir is not None and lib_dir is not None:
        raise click.UsageError("give --build or --lib-dir, not both")
    if kv_window_cells is None and vram_target is None:
        kv_window_cells = 256
    depths = depths or (0.5, 0.85)
    model_path = models.resolve_model(model_spec, log=note)
    build = gate_common.resolve_build(build_dir, lib_dir)
    cfg = gate_needle.NeedleConfig(model=model_path, build=build, filler_tokens=filler_tokens, depths=tuple(depths), seed=seed,
                                   fmt=fmt, n_ctx=n_ctx, window_cells=kv_window_cells, vram_target=vram_target, ctk=ctk, ctv=ctv,
                                   ctkt=ctkt, ctvt=ctvt, n_predict=n_predict, threads=threads or os.cpu_count() or 1,
                                   n_gpu_layers=n_gpu_layers, filler_file=filler_file, mode=mode,
                                   match=match or ("answer" if build.on_gpu(n_gpu_layers) else "tokens"))
    r = gate_needle.run(cfg, console, gate_common.logs_dir())
    gate_needle.print_report(console, r)
    if json_out is not None:
        gate_common.write_json(json_out, r)
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


# ====================================================================== vram

@gate.command()
@click.option("--model", "model_spec", required=True, metavar="PATH|demo", help="A GGUF file, or `demo`.")
@click.option("--vram-target", type=int, callback=_positive, required=True, metavar="MiB",
              help="The device memory budget given to llama-server (--vram-target), checked against the process's peak.")
@click.option("--allowance", type=int, callback=_non_negative, default=200, show_default=True, metavar="MiB",
              help="How far above the target the peak may go.")
@click.option("--ctx", "n_ctx", type=int, callback=_positive, default=32768, show_default=True, help="Context size.")
@click.option("--prompt-tokens", type=int, callback=_positive, default=None, help="Prompt length.  [default: half the context]")
@click.option("--n-predict", type=int, callback=_positive, default=512, show_default=True, help="Tokens generated after the prompt (EOS ignored).")
@click.option("--kv-residency-mode", "mode", type=click.Choice(["auto", "window"]), default="auto", show_default=True,
              help="auto: resident when the KV fits the target, a window otherwise.")
@_cache_type_options
@click.option("--gpu", "gpu_index", type=int, callback=_non_negative, default=0, show_default=True, metavar="N", help="The GPU (NVML index) to watch.")
@click.option("--interval-ms", type=int, callback=_positive, default=50, show_default=True, help="NVML sampling interval.")
@click.option("--threads", type=int, callback=_positive, default=None, help="CPU threads of the server.  [default: llama-server's]")
@_ngl_option(default=999, help_default="999: every layer")
@_build_options
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the full report here.")
def vram(model_spec, vram_target, allowance, n_ctx, prompt_tokens, n_predict, mode, ctk, ctv, ctkt, ctvt, gpu_index, interval_ms,
         threads, n_gpu_layers, build_dir, lib_dir, json_out) -> None:
    """Device memory stays within --vram-target + allowance through a long decode (NVIDIA GPUs only).

    Starts llama-server with --vram-target on the model, prefills --prompt-tokens and generates --n-predict
    tokens, and samples NVML every --interval-ms from the moment the process starts: the server process's
    memory (usedGpuMemory of its pid), or, where NVML does not report it, the growth of the device's used
    memory. Pass: the peak <= target + allowance.

    \b
    Exit status:
      0  pass
      1  the peak exceeded the limit (or an error)
      2  usage error
      3  no NVIDIA GPU found (no driver, no NVML, or no device), as `rollingkv probe pcie`;
         with --json the report is {"gate": "vram", "verdict": "no-gpu", "error": "no NVIDIA GPU found", ...}
    """
    from rollingkv_cli import gate_common, gate_vram, models
    from rollingkv_cli.console import RollingKVError, abort, console, esc, note, usage_error
    from rollingkv_cli.pcie import NO_GPU_MESSAGE

    if build_dir is not None and lib_dir is not None:
        raise click.UsageError("give --build or --lib-dir, not both")
    if prompt_tokens is not None and prompt_tokens + n_predict > n_ctx:
        usage_error(f"--prompt-tokens {prompt_tokens} + --n-predict {n_predict} exceed --ctx {n_ctx}", "raise --ctx or shorten the run")
    # the GPU first: without one nothing else matters (and the answer is the same as probe pcie's)
    try:
        nvml = gate_vram.nvml_module()
        handle, gpu_name, total = gate_vram.open_gpu(nvml, gpu_index)
    except (ImportError, gate_vram.NoGpu) as e:
        reason = f"nvidia-ml-py (pynvml) is not installed: {e}" if isinstance(e, ImportError) else str(e)
        if json_out is not None:
            gate_common.write_json(json_out, gate_vram.no_gpu_report(reason))
        raise RollingKVError(NO_GPU_MESSAGE, f"{reason}; gate vram needs an NVIDIA GPU and its driver", gate_common.EXIT_NO_GPU) from None
    except IndexError:
        abort(f"--gpu {gpu_index}: no such GPU", "see `rollingkv probe pcie` for the GPUs NVML lists")
    if vram_target * 2**20 > total:
        abort(f"--vram-target {vram_target} MiB is more than GPU {gpu_index} has ({total / 2**20:.0f} MiB)")
    model_path = models.resolve_model(model_spec, log=note)
    build = gate_common.resolve_build(build_dir, lib_dir)
    if not build.cuda:
        abort(f"the build {build.dir or build.lib_dir} is CPU-only: nothing would use the GPU", "build with `rollingkv build --cuda`, or give --build/--lib-dir of a CUDA build")
    cfg = gate_vram.VramConfig(model=model_path, build=build, vram_target=vram_target, allowance=allowance, n_ctx=n_ctx,
                               prompt_tokens=prompt_tokens, n_predict=n_predict, mode=mode, ctk=ctk, ctv=ctv, ctkt=ctkt, ctvt=ctvt,
                               gpu=gpu_index, interval_s=interval_ms / 1000, threads=threads, n_gpu_layers=n_gpu_layers)
    r = gate_vram.run(cfg, nvml, handle, gpu_name, console, gate_common.logs_dir())
    gate_vram.print_report(console, r)
    if json_out is not None:
        gate_common.write_json(json_out, r)
        note(f"report: {json_out}")
    if r["passed"]:
        console.print(f"[bold green]PASS[/] {esc(r['why'])}")
        return
    console.print(f"[bold red]FAIL[/] {esc(r['why'])}", soft_wrap=True)
    sys.exit(EXIT_FAIL)


# ====================================================================== matrix

@gate.command()
@click.option("--model", "model_spec", default="demo", show_default=True, metavar="PATH|demo", help="A GGUF file, or `demo`.")
@click.option("--tokens", "n_tokens", type=int, callback=_positive, default=1024, show_default=True,
              help="Synthetic tokens decoded teacher-forced per equivalence cell.")
@click.option("--splits", callback=_fraction_list, default="0.25,0.5,0.75", show_default=True,
              help="Window sizes as fractions of the sequence (the window holds the oldest positions).")
@click.option("--tail-types", callback=_type_list, default="f16,q8_0,q4_0", show_default=True, help="Tail K/V types (the window is f16).")
@click.option("--exact-split", type=float, default=0.5, show_default=True,
              help="Window fraction of the exactness cells (quantized window + same tail vs the resident quantized cache).")
@click.option("--needle/--no-needle", default=True, show_default=True, help="Also run the needle gate (f16 tail).")
@click.option("--needle-filler-tokens", type=int, callback=_positive, default=1536, show_default=True, help="The needle's filler length.")
@click.option("--needle-depths", callback=_fraction_list, default="0.5,0.85", show_default=True, help="The needle's placements.")
@click.option("--thresholds", "thresholds_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="YAML/JSON file overriding the default bounds (as for gate equiv).")
@click.option("--order-floor/--no-order-floor", default=None,
              help="Bounds relaxed to the resident run's own floating-point order floor (as gate equiv --order-floor).  "
                   "[default: on for the CUDA backend, off on the CPU, where the split is bit-identical]")
@click.option("--threads", type=int, callback=_positive, default=None, help="CPU threads per run.  [default: all cores]")
@click.option("--n-batch", type=int, callback=_positive, default=512, show_default=True, help="Tokens per llama_decode.")
@_ngl_option()
@_build_options
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("docs/gates"), show_default=True,
              help="Where NAME.json and NAME.md go.")
@click.option("--name", default=None, help="Report file name.  [default: <date>-<host>-<backend>]")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the reference logits are kept during the run.  [default: the temp dir]")
def matrix(model_spec, n_tokens, splits, tail_types, exact_split, needle, needle_filler_tokens, needle_depths, thresholds_file,
           order_floor, threads, n_batch, n_gpu_layers, build_dir, lib_dir, out_dir, name, work_dir) -> None:
    """The gates over tail types x split points: one JSON report and a markdown table.

    Per tail type T and split S: the f16-window + T-tail cache with a window of S x the sequence against
    the resident f16 cache (same-type bounds for f16; for a quantized T, the quantized bounds relative to
    the resident T cache, as `gate equiv --tail-baseline`); per quantized T, a T window + T tail against
    the resident T cache (must be exact); and the needle gate. Every cell reuses one reference decode.

    \b
    Exit status: 0 every cell passes, 1 one fails (or an error), 2 usage error,
    4 every cell passes but the needle is inconclusive (the model misses it even resident).
    """
    from rollingkv_cli import gate_common, gate_matrix, models
    from rollingkv_cli.console import abort, console, note, usage_error

    if build_dir is not None and lib_dir is not None:
        raise click.UsageError("give --build or --lib-dir, not both")
    if not 0 < exact_split < 1:
        raise click.BadParameter("must be a fraction strictly between 0 and 1", param_hint="'--exact-split'")
    if name is not None and (not name or "/" in name or name.startswith(".")):
        raise click.BadParameter("a plain file name (no '/')", param_hint="'--name'")
    if n_tokens < 16:
        usage_error(f"--tokens {n_tokens} is too short for windows at {', '.join(f'{s:g}' for s in splits)} of it", "use at least 16")
    model_path = models.resolve_model(model_spec, log=note)
    build = gate_common.resolve_build(build_dir, lib_dir)
    if needle:
        build.require_server()
    tmp_root = Path(work_dir) if work_dir else Path(tempfile.gettempdir())
    try:
        tmp_root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        abort(f"cannot use --work-dir {tmp_root}: {e.strerror or e}")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        abort(f"cannot create --out {out_dir}: {e.strerror or e}")
    cfg = gate_matrix.MatrixConfig(model=model_path, model_spec=model_spec, build=build, tokens=n_tokens, splits=tuple(splits),
                                   tail_types=tuple(tail_types), exact_split=exact_split, needle=needle,
                                   needle_filler_tokens=needle_filler_tokens, needle_depths=tuple(needle_depths),
                                   thresholds_file=thresholds_file,
                                   order_floor=build.on_gpu(n_gpu_layers) if order_floor is None else order_floor,
                                   threads=threads or os.cpu_count() or 1, n_batch=n_batch,
                                   n_gpu_layers=n_gpu_layers, argv=_argv_after("matrix"))
    r = gate_matrix.run(cfg, console, gate_common.logs_dir(), tmp_root)
    name = name or gate_matrix.default_name(r["backend"])
    jp, mp = gate_matrix.write_outputs(r, out_dir, name)
    _print_matrix(console, r)
    note(f"report: {jp}\ntable:  {mp}")
    if r["verdict"] == "pass":
        console.print("[bold green]PASS[/] every cell holds its bounds" + (" and the needle is retrieved exactly" if needle else ""))
        return
    if r["verdict"] == "inconclusive":
        console.print("[bold yellow]INCONCLUSIVE[/] every cell passes, but the model does not retrieve the needle even fully resident")
        sys.exit(EXIT_INCONCLUSIVE)
    what = list(r["failed_cells"]) + (["needle"] if r.get("needle") and r["needle"]["verdict"] == "fail" else [])
    console.print("[bold red]FAIL[/] " + ", ".join(what), soft_wrap=True)
    sys.exit(EXIT_FAIL)


def _argv_after(word: str) -> list[str]:
    argv = list(sys.argv[1:])
    return argv[argv.index(word) + 1:] if word in argv else []


def _print_matrix(console, r: dict) -> None:
    from rich.table import Table

    from rollingkv_cli.gate_matrix import _g

    t = Table(title=f"gate matrix: mean TV / real flips vs resident f16 ({r['tokens']['n']} tokens)", title_justify="left")
    t.add_column("tail")
    by = {(c["tail"], c["split"]): c for c in r["cells"]}
    for s in r["splits"]:
        w = next((c["window_cells"] for c in r["cells"] if c["split"] == s), "?")
        t.add_column(f"window {s:g} ({w})", justify="right")
    t.add_column("baseline (resident)", justify="right")
    for ty in r["tail_types"]:
        row = [ty]
        for s in r["splits"]:
            c = by.get((ty, s))
            if c is None:
                row.append("")
                continue
            m = c["metrics"]
            row.append(f"{'[green]✓[/]' if c['passed'] else '[bold red]✗[/]'} {_g(m['mean_tv'])} / {_g(m['real_frac'])}")
        bl = r["baselines"].get(ty)
        row.append(f"{_g(bl['metrics']['mean_tv'])} / {_g(bl['metrics']['real_frac'])}" if bl else "[dim]–[/]")
        t.add_row(*row)
    console.print(t)
    for c in r["exact"]:
        m = c["metrics"]
        console.print(f"{'[green]✓[/]' if c['passed'] else '[bold red]✗[/]'} {c['type']} window + {c['type']} tail vs resident {c['type']}: "
                      f"mean TV {_g(m['mean_tv'])}, {m.get('bitwise_equal_rows')}/{m['n']} rows bitwise identical")
    nd = r.get("needle")
    if nd:
        mark = {"pass": "[green]✓[/]", "fail": "[bold red]✗[/]", "inconclusive": "[yellow]?[/]"}[nd["verdict"]]
        console.print(f"{mark} needle: " + ", ".join(
            f"depth {p['depth']:g} ({p['number']}): {p['verdict']}" for p in nd["placements"]))
