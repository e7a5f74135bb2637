"""`rollingkv gate`: prove that the split KV cache reproduces the fully resident run.

`gate equiv` decodes one token sequence teacher-forced twice, each in its own process (llama_cpp binds
one library per process): a reference (our build with residency off, or another build's libllama) and a
candidate (our build with the residency parameters), and compares every position's next-token
distribution (gate_math). The candidate compares its logits against the reference's on the fly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import click

# keep in step with llama_ext.GGML_TYPES (not imported here: registering commands stays cheap)
CACHE_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
MODES = ["window", "auto", "off"]


@click.group()
def gate() -> None:
    """Check the split KV cache against the fully resident run."""


def _positive(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter("must be at least 1")
    return value


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
@click.option("-ctk", "--cache-type-k", "ctk", type=click.Choice(CACHE_TYPES), default="f16", show_default=True, help="Type of K (the window's, and the reference's).")
@click.option("-ctv", "--cache-type-v", "ctv", type=click.Choice(CACHE_TYPES), default="f16", show_default=True, help="Type of V (the window's, and the reference's).")
@click.option("-ctkt", "--cache-type-k-tail", "ctkt", type=click.Choice(CACHE_TYPES), default=None, help="Type of K in the host tail. Default: -ctk.")
@click.option("-ctvt", "--cache-type-v-tail", "ctvt", type=click.Choice(CACHE_TYPES), default=None, help="Type of V in the host tail. Default: -ctv.")
@click.option("--kv-residency-mode", "mode", type=click.Choice(MODES), default="window", show_default=True,
              help="The candidate's residency mode (off: the plain resident cache, a sanity run).")
@click.option("--reference", "reference", default="resident", show_default=True, metavar="resident|lib:PATH",
              help="resident: the active build with residency off; lib:PATH: the libllama in PATH (a directory or the file) of another build, e.g. an unpatched one.")
@click.option("--thresholds", "thresholds_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="YAML/JSON file overriding the default bounds (flat keys, or per profile: same_type/quantized).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the full report here.")
@click.option("--threads", type=int, callback=_positive, default=None, help="CPU threads per run.  [default: all cores]")
@click.option("--n-batch", type=int, callback=_positive, default=512, show_default=True, help="Tokens per llama_decode (and per ubatch), the same for both runs.")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the reference logits (n_tokens x n_vocab x 4 bytes) are kept during the run.  [default: the temp dir]")
def equiv(model_spec, prompt_file, synthetic_tokens, n_ctx, kv_window_cells, vram_target, ctk, ctv, ctkt, ctvt, mode,
          reference, thresholds_file, json_out, threads, n_batch, work_dir) -> None:
    """Decode one sequence with the reference and the candidate and compare every position's distribution.

    Exit status: 0 when every bound holds, 1 when one does not (or on an error), 2 on a usage error.
    """
    from rollingkv_cli import __version__, builder, gate_math, models, paths
    from rollingkv_cli.console import abort, console, warn

    t_start = time.time()
    # ---------------------------------------------------------------- input checks, cheapest first
    if prompt_file is not None and synthetic_tokens is not None:
        raise click.UsageError("give --prompt-file or --synthetic-tokens, not both")
    if kv_window_cells is not None and vram_target is not None:
        raise click.UsageError("give --kv-window-cells or --vram-target, not both")
    if prompt_file is None and synthetic_tokens is None:
        synthetic_tokens = 2048
    if n_ctx is not None and kv_window_cells is not None and kv_window_cells >= n_ctx:
        abort(f"--kv-window-cells {kv_window_cells} must be smaller than --ctx {n_ctx}",
              "the window holds cells [0, window); a window as large as the context leaves no tail to check")
    if n_ctx is not None and synthetic_tokens is not None and synthetic_tokens > n_ctx:
        abort(f"{synthetic_tokens} tokens do not fit --ctx {n_ctx}", "raise --ctx or lower --synthetic-tokens")
    if mode == "off" and (kv_window_cells or vram_target or ctkt or ctvt):
        warn("--kv-residency-mode off ignores --kv-window-cells, --vram-target and the tail types")
    profile = gate_math.profile_for((ctk, ctv), (None, None) if mode == "off" else (ctkt, ctvt))
    try:
        thresholds = gate_math.load_thresholds(thresholds_file, profile)
    except gate_math.ThresholdsError as e:
        abort(str(e), "keys: " + ", ".join(sorted(set(gate_math.CHECKS) | gate_math.PARAM_KEYS)))
    ref_kind, ref_lib = _parse_reference(reference)
    threads = threads or os.cpu_count() or 1

    model_path = models.resolve_model(model_spec, log=lambda m: console.print(f"[dim]{m}[/]"))
    build = builder.active_build(required=True)
    assert build is not None
    cand_lib = build.lib_dir
    if not (cand_lib / "libllama.so").is_file():
        abort(f"the active build {build.dir} has no libllama.so", "run `rollingkv build`")
    if ref_kind == "resident":
        ref_lib = cand_lib

    residency = None
    if mode != "off":
        residency = {"mode": mode, "window_cells": kv_window_cells or 0, "vram_target_mib": vram_target or 0,
                     "type_k_tail": ctkt, "type_v_tail": ctvt}
        pcie = os.environ.get(paths.ENV_PCIE_BW)
        if pcie:
            try:
                residency["pcie_bw_gbps"] = float(pcie)
            except ValueError:
                abort(f"{paths.ENV_PCIE_BW}={pcie!r} is not a number")
    cand_residency = residency or {"mode": "off"}
    ref_residency = {"mode": "off"} if ref_kind == "resident" else None

    tmp_root = Path(work_dir) if work_dir else Path(tempfile.gettempdir())
    try:
        tmp_root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        abort(f"cannot use --work-dir {tmp_root}: {e.strerror or e}")
    logs_dir = _logs_dir()
    commands: dict[str, list[str]] = {}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rollingkv-gate-", dir=tmp_root) as td:
        wd = Path(td)
        # ------------------------------------------------------------ tokens (with the candidate's library)
        tok_args = ["--lib-dir", str(cand_lib), "--model", str(model_path), "--tokens-out", str(wd / "tokens.npy"),
                    "--out", str(wd / "tokenize.json")]
        tok_args += ["--tokenize", str(prompt_file)] if prompt_file is not None else ["--synthetic", str(synthetic_tokens)]
        commands["tokenize"] = _runner_cmd(tok_args)
        with console.status("tokenizing"):
            tok = _run_child("tokenize", commands["tokenize"], logs_dir / "tokenize.log", wd / "tokenize.json")
        n_tokens = int(tok["n_tokens"])
        n_vocab = int(tok["n_vocab"])
        if n_tokens == 0:
            abort(f"{prompt_file} holds no tokens")
        if mode != "off" and not tok.get("has_residency"):
            abort("this build has no KV residency API; rebuild",
                  f"{build.dir} lacks llama_init_from_model_rolling_kv: run `rollingkv build`, or check with --kv-residency-mode off")
        if n_ctx is None:
            n_ctx = -(-n_tokens // 256) * 256 + 256
        elif n_tokens > n_ctx:
            abort(f"{prompt_file or 'the text'} is {n_tokens} tokens and does not fit --ctx {n_ctx}", "raise --ctx or shorten the prompt")
        if kv_window_cells is not None and kv_window_cells >= n_ctx:
            abort(f"--kv-window-cells {kv_window_cells} must be smaller than the context ({n_ctx})", "lower it, or raise --ctx")
        if mode != "off" and kv_window_cells is not None and kv_window_cells >= n_tokens:
            warn(f"the window ({kv_window_cells} cells) holds all {n_tokens} tokens: the tail is never read")
        need = n_tokens * n_vocab * 4
        free = shutil.disk_usage(wd).free
        if need > free - (64 << 20):
            abort(f"the reference logits need {need / 2**20:.0f} MiB in {tmp_root}, {free / 2**20:.0f} MiB are free",
                  "point --work-dir at a larger disk, or decode fewer tokens")

        common = ["--model", str(model_path), "--tokens", str(wd / "tokens.npy"), "--ctx", str(n_ctx),
                  "--n-batch", str(n_batch), "--threads", str(threads), "-ctk", ctk, "-ctv", ctv]
        ref_args = ["--lib-dir", str(ref_lib), *common, "--save-logits", str(wd / "ref.npy"), "--out", str(wd / "ref.json")]
        if ref_residency is not None:
            ref_args += ["--residency", json.dumps(ref_residency)]
        cand_args = ["--lib-dir", str(cand_lib), *common, "--residency", json.dumps(cand_residency),
                     "--reference-logits", str(wd / "ref.npy"), "--out", str(wd / "cand.json"),
                     "--real-margin-nats", str(thresholds["real_margin_nats"]), "--positions-out", str(wd / "positions.npz")]
        commands["reference"] = _runner_cmd(ref_args)
        commands["candidate"] = _runner_cmd(cand_args)

        ref_label = "reference (resident)" if ref_kind == "resident" else f"reference ({_short_path(ref_lib)})"
        cand_label = f"candidate ({mode})"
        console.print(f"[dim]{model_path.name}: {n_tokens} tokens, ctx {n_ctx}, batch {n_batch}, {threads} threads, "
                      f"K/V {ctk}/{ctv}{_tail_desc(mode, ctkt, ctvt)}[/]")
        with _progress(console) as progress:
            results["reference"] = _run_child("reference", commands["reference"], logs_dir / "reference.log", wd / "ref.json",
                                              progress, ref_label, n_tokens)
            results["candidate"] = _run_child("candidate", commands["candidate"], logs_dir / "candidate.log", wd / "cand.json",
                                              progress, cand_label, n_tokens)
        positions_file = None
        if json_out is not None:
            positions_file = json_out.with_suffix(".positions.npz")
            try:
                shutil.copyfile(wd / "positions.npz", positions_file)
            except OSError:
                positions_file = None

    summary = results["candidate"]["summary"]
    v = gate_math.verdict(summary, thresholds)
    _print_table(console, summary, thresholds, v, profile)
    ref_r, cand_r = results["reference"], results["candidate"]
    _print_plan(console, cand_r.get("plan"))
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
        "threads": threads,
        "cache_types": {"k": ctk, "v": ctv, "k_tail": ctkt or ctk, "v_tail": ctvt or ctv},
        "reference": {"spec": reference, "lib": ref_r.get("lib"), "build_info": ref_r.get("build_info"),
                      "rollingkv_lib": ref_r.get("rollingkv"), "residency": ref_residency, "context_via": ref_r.get("context_via"),
                      "plan": ref_r.get("plan"), "n_ctx": ref_r.get("n_ctx"), "timings": ref_r.get("timings")},
        "candidate": {"lib": cand_r.get("lib"), "build_info": cand_r.get("build_info"), "residency": cand_residency,
                      "context_via": cand_r.get("context_via"), "plan": cand_r.get("plan"), "n_ctx": cand_r.get("n_ctx"),
                      "timings": cand_r.get("timings")},
        "build": {"dir": str(build.dir), "pin": build.manifest.get("pin"), "series_hash": build.manifest.get("series_hash"),
                  "options": build.manifest.get("options")},
        "positions_file": str(positions_file) if positions_file else None,
        "commands": commands,
        "logs": str(logs_dir),
        "wall_s": round(time.time() - t_start, 2),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if json_out is not None:
        try:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
        except OSError as e:
            abort(f"cannot write {json_out}: {e.strerror or e}")
        console.print(f"[dim]report: {json_out}[/]")
    if v.passed:
        console.print("[bold green]PASS[/] the candidate reproduces the reference within every bound")
        return
    console.print("[bold red]FAIL[/] " + "; ".join(c.describe() for c in v.failed), soft_wrap=True)
    # SystemExit, not click's Exit: with standalone_mode=False click turns Exit into a return value
    sys.exit(1)


# ------------------------------------------------------------------ helpers

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


def _runner_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "rollingkv_cli.gate_runner", *args]


def _logs_dir() -> Path:
    from rollingkv_cli import paths

    d = paths.cache_dir() / "gate"
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        d = Path(tempfile.mkdtemp(prefix="rollingkv-gate-logs-"))
    return d


def _short_path(p: Path | None) -> str:
    s = str(p)
    return s if len(s) <= 40 else "…" + s[-39:]


def _tail_desc(mode: str, ctkt: str | None, ctvt: str | None) -> str:
    if mode == "off" or (ctkt is None and ctvt is None):
        return ""
    return f", tail {ctkt or '='}/{ctvt or '='}"


def _progress(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("[dim]{task.fields[stage]}[/]"), TimeElapsedColumn(), console=console, transient=False)


def _run_child(role: str, cmd: list[str], log_path: Path, result_path: Path, progress=None, label: str = "", total: int = 0) -> dict:
    """Run one gate_runner child: stdout is the protocol, stderr (llama.cpp's log) goes to log_path."""
    from rollingkv_cli.console import abort, console

    env = dict(os.environ)
    env.pop("LLAMA_CPP_LIB_PATH", None)  # the child sets it for the library it was given
    env["PYTHONUNBUFFERED"] = "1"
    task = progress.add_task(label, total=total or None, stage="starting") if progress is not None else None
    error: dict | None = None
    tail: deque[str] = deque(maxlen=20)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1, env=env, start_new_session=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                kind, _, rest = line.rstrip("\n").partition(" ")
                if kind == "PROGRESS" and progress is not None:
                    done, _, tot = rest.partition(" ")
                    progress.update(task, completed=int(done), total=int(tot))
                elif kind == "STAGE" and progress is not None:
                    progress.update(task, stage=rest)
                elif kind == "ERROR":
                    try:
                        error = json.loads(rest)
                    except json.JSONDecodeError:
                        error = {"message": rest}
                elif kind != "RESULT":
                    tail.append(line.rstrip("\n"))
            rc = proc.wait()
        except BaseException:
            _kill(proc)
            raise
    if progress is not None:
        progress.update(task, stage="done" if rc == 0 else "failed")
    if error is not None:
        hint = error.get("hint")
        abort(f"{role} run: {error.get('message')}", f"{hint} (llama.cpp's log: {log_path})" if hint else f"llama.cpp's log: {log_path}")
    if rc != 0 or not result_path.is_file():
        from rich.panel import Panel

        from rollingkv_cli.builder import log_tail

        console.print(Panel(log_tail(log_path, 15).rstrip() or "\n".join(tail), title=f"last lines of {log_path}", border_style="red"))
        why = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
        abort(f"the {role} run failed ({why})", f"full log: {log_path}")
    return json.loads(result_path.read_text())


def _kill(proc: subprocess.Popen) -> None:
    from rollingkv_cli.procs import stop_group

    stop_group(proc)


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.6f}" if 1e-3 <= abs(v) < 1e4 else f"{v:.3e}"


def _print_table(console, s: dict, th: dict, v, profile: str) -> None:
    from rich.table import Table

    by_metric = {c.metric: c for c in v.checks}
    t = Table(title=f"equivalence gate ({profile.replace('_', '-')} bounds)", title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("bound", justify="right")
    t.add_column("", justify="center")
    rows = [
        ("positions", "n"),
        ("mean total variation", "mean_tv"),
        ("max total variation", "max_tv"),
        ("mean KL(ref‖cand), nats", "mean_kl"),
        ("max KL(ref‖cand), nats", "max_kl"),
        ("top-1 agreement", "top1_agreement"),
        (f"real disagreements (margin > {s.get('real_margin_nats', th.get('real_margin_nats'))} nats)", "real_frac"),
        (f"top-{s.get('topk', 5)} order agreement", "frac_full_agree"),
        ("non-finite rows", "nonfinite"),
    ]
    for label, key in rows:
        c = by_metric.get(key)
        if c is None:
            bound, mark = "", "[dim]–[/]"
        else:
            b = int(c.bound) if c.metric in ("n", "nonfinite") else c.bound
            bound = ("≤ " if c.kind == "max" else "≥ ") + _fmt(b)
            mark = "[green]✓[/]" if c.ok else "[bold red]✗[/]"
        t.add_row(label, _fmt(s.get(key)), bound, mark)
    t.add_row("[dim]bitwise-identical rows[/]", f"[dim]{s.get('bitwise_equal_rows')}/{s.get('n')}[/]", "", "")
    t.add_row("[dim]max |Δ logit|[/]", f"[dim]{_fmt(s.get('max_abs_logit_diff'))}[/]", "", "")
    console.print(t)
    worst = s.get("worst", [])[:3]
    if worst and s.get("max_tv"):
        console.print("[dim]worst positions: " + ", ".join(
            f"{w['pos']} (tv {w['tv']:.2e}, top-1 {w['top1_ref']}→{w['top1_cand']}, margin {w['ref_margin']:.2f})" for w in worst) + "[/]")


def _print_plan(console, plan) -> None:
    if not plan:
        return
    keys = [k for k in ("mode_requested", "mode", "reason", "window_cells", "tail_cells") if k in plan]
    if keys:
        console.print("[dim]plan: " + ", ".join(f"{k}={plan[k]}" for k in keys) + "[/]")
