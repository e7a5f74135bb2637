"""`gate matrix`: the equivalence gate over tail types x split points, the quantized parts' exactness, and
the needle gate, with one JSON report and one markdown table.

For one synthetic token sequence (decoded teacher-forced, runner children as in `gate equiv`):

- ``reference``         the resident cache of the window's type (f16), logits saved;
- ``baseline-T``        for each quantized tail type T: the resident cache of type T against the reference
                        (the loss of T itself), logits saved: the reference of T's exactness cell;
- ``cell-T-S``          window = S x the sequence (cells [0, wc)), f16 window + T tail, against the f16
                        reference: same-type bounds for an f16 tail, the quantized bounds relative to
                        baseline-T (metrics.relative_thresholds) otherwise;
- ``exact-T``           T window + T tail against the resident T cache: the split must be exact on
                        quantized parts too (same-type bounds);
- ``cell-auto-S``       the auto row: f16 window, the tail's type the planner's (-ctkt/-ctvt auto), against the f16
                        reference over the positions that read the tail with the auto bounds (metrics.PROFILES["auto"]);
- the needle gate (needle.py) with an f16 tail.

One reference serves every cell, so the matrix costs (1 + #quantized types x 2 + #types x #splits)
decodes plus the needle's two servers.
"""

from __future__ import annotations

import platform
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollingkv_cli.gate import metrics

WINDOW_TYPE = "f16"


@dataclass
class MatrixConfig:
    model: Path
    model_spec: str
    build: object  # common.GateBuild
    tokens: int = 1024
    splits: tuple[float, ...] = (0.25, 0.5, 0.75)
    tail_types: tuple[str, ...] = ("f16", "q8_0", "q4_0", "auto")
    exact_split: float = 0.5
    needle: bool = True
    needle_filler_tokens: int = 1536
    needle_depths: tuple[float, ...] = (0.5, 0.85)
    needle_seed: int = 0
    needle_n_predict: int = 12  # " 48213." is 7 tokens for the demo model; enough to see the answer diverge after it
    thresholds_file: Path | None = None
    order_floor: bool = False  # bounds relaxed to the order floor (gate equiv --order-floor): the GPU backend
    tolerance: float | None = None  # same-type cells on the CPU: a mean-TV bound instead of bit-identity
    threads: int = 1
    n_batch: int = 512
    n_gpu_layers: int | None = None
    argv: list[str] = field(default_factory=list)


def window_for(split: float, n_tokens: int) -> int:
    return max(1, min(n_tokens - 1, round(split * n_tokens)))


def needle_window(filler_tokens: int) -> int:
    """A quarter of the needle's filler, in whole 64-cell steps: both default depths (0.5, 0.85) lie in the tail."""
    return max(64, filler_tokens // 4 // 64 * 64)


def is_quantized(t: str) -> bool:
    return metrics.profile_for((WINDOW_TYPE, WINDOW_TYPE), (t, t)) == "quantized"


def backend_label(build, n_gpu_layers: int | None) -> str:
    return "cuda" if build.on_gpu(n_gpu_layers) else "cpu"


def default_name(backend: str) -> str:
    host = socket.gethostname().split(".")[0] or "host"
    return f"{time.strftime('%Y-%m-%d')}-{host}-{backend}"


def report_place(out_dir: Path | None, name: str | None, backend: str, force: bool = False) -> tuple[Path, str]:
    """Where the reports go, before the run. Default: the checkout's docs/gates when run inside the rollingkv repository
    (the records live there), else the current directory with a name that says what it is (gate matrix wrote
    ./docs/gates/ into whatever directory it ran in). A report is never overwritten silently: a default name that is
    taken gets -2, -3, ...; an explicit --name that is taken is refused unless --force. The place is checked as any
    output (userinput.check_output_dir / check_output_file)."""
    from rollingkv_cli.console import abort
    from rollingkv_cli.lib import paths
    from rollingkv_cli.userinput import check_output_dir, check_output_file

    repo_gates = paths.REPO_ROOT / "docs" / "gates"
    in_repo = (paths.REPO_ROOT / "pyproject.toml").is_file() and repo_gates.is_dir() and Path.cwd().resolve().is_relative_to(paths.REPO_ROOT)
    if out_dir is None:
        out_dir = repo_gates if in_repo else Path.cwd()
    check_output_dir(out_dir, "--out")
    taken = lambda n: (out_dir / f"{n}.json").exists() or (out_dir / f"{n}.md").exists()  # noqa: E731
    if name is None:
        base = default_name(backend) if out_dir.resolve() == repo_gates.resolve() else f"gate-matrix-{default_name(backend)}"
        name, k = base, 1
        while taken(name):
            k += 1
            name = f"{base}-{k}"
    elif taken(name) and not force:
        abort(f"{out_dir / name}.json or .md exists: gate matrix does not overwrite a report", "pass --force to replace it, or give another --name")
    for suffix in (".json", ".md"):
        check_output_file(out_dir / f"{name}{suffix}", "report")
    return out_dir, name


def equiv_command(cfg: MatrixConfig, n_ctx: int, window: int, tail: str, ctk: str = WINDOW_TYPE, baseline: bool = False) -> str:
    parts = ["rollingkv", "gate", "equiv", cfg.model_spec, "--synthetic-tokens", str(cfg.tokens), "-c", str(n_ctx),
             "--kv-window-cells", str(window)]
    if ctk != WINDOW_TYPE:
        parts += ["-ctk", ctk, "-ctv", ctk]
    if tail != ctk:
        parts += ["-ctkt", tail, "-ctvt", tail]
    if tail == "auto":
        parts.append("--no-needle")  # the matrix runs the needle once, with an f16 tail
    if baseline:
        parts.append("--tail-baseline")
    if cfg.order_floor:
        parts.append("--order-floor")
    if cfg.tolerance is not None:
        parts += ["--tolerance", f"{cfg.tolerance:g}"]
    if cfg.n_gpu_layers is not None:
        parts += ["-ngl", str(cfg.n_gpu_layers)]
    if cfg.thresholds_file:
        parts += ["--thresholds", str(cfg.thresholds_file)]
    return " ".join(parts)


_SUMMARY_KEYS = ("n", "mean_tv", "max_tv", "p99_tv", "mean_kl", "max_kl", "top1_agreement", "real_frac", "frac_full_agree", "nonfinite",
                 "n_top1_disagree", "n_real", "bitwise_equal_rows", "bitwise_identical", "max_abs_logit_diff", "tail_positions")
_TAIL_KEYS = ("n", "mean_tv", "max_tv", "p99_tv", "mean_kl", "top1_agreement", "real_frac", "bitwise_equal_rows")


def _metrics(summary: dict) -> dict:
    out = {k: summary.get(k) for k in _SUMMARY_KEYS if k in summary}
    if summary.get("tail"):
        out["tail"] = {k: summary["tail"].get(k) for k in _TAIL_KEYS}
    if summary.get("over_floor") is not None:
        out["over_floor"] = summary["over_floor"]
    return out


def run(cfg: MatrixConfig, console, logs: Path, work_dir: Path) -> dict:
    """Every cell; the report. Raises RollingKVError on errors (a failed bound is a result, not an error)."""
    import shutil

    from rollingkv_cli.gate import equiv as equiv_runs
    from rollingkv_cli.console import abort, esc

    t_start = time.time()
    th_cache: dict[str, dict] = {}

    def thresholds(profile: str) -> dict:
        if profile not in th_cache:
            try:
                th_cache[profile] = metrics.load_thresholds(cfg.thresholds_file, profile)
            except metrics.ThresholdsError as e:
                abort(str(e), e.hint or "keys: " + ", ".join(sorted(set(metrics.CHECKS) | metrics.PARAM_KEYS)))
        return dict(th_cache[profile])

    exact_bits = not cfg.build.on_gpu(cfg.n_gpu_layers) and cfg.tolerance is None

    def split_thresholds(profile: str) -> dict:
        th = thresholds(profile)
        th["require_tail"] = True
        if profile == "same_type":
            th["require_bitwise"] = exact_bits  # every same-type cell has a tail of the window's own type
            if cfg.tolerance is not None:
                th["max_mean_tv"] = cfg.tolerance
        return th

    thresholds("same_type")
    if any(is_quantized(t) for t in cfg.tail_types):
        thresholds("quantized")
    if "auto" in cfg.tail_types:
        thresholds("auto")
    lib = cfg.build.lib_dir
    n_ctx = -(-cfg.tokens // 256) * 256 + 256
    quantized = [t for t in cfg.tail_types if is_quantized(t)]
    cells: list[dict] = []
    exact: list[dict] = []
    baselines: dict[str, dict] = {}
    base_rows: dict[str, dict] = {}
    floors: dict[str, dict] = {}
    floor_rows: dict[str, dict] = {}
    from rollingkv_cli.gate.common import work_dir as gate_work_dir

    with gate_work_dir(work_dir, "rollingkv-matrix-") as td:
        wd = Path(td)
        sess = equiv_runs.EquivSession(model=cfg.model, wd=wd, logs=logs, threads=cfg.threads, n_batch=cfg.n_batch,
                                       n_gpu_layers=cfg.n_gpu_layers, n_ctx=n_ctx)
        with equiv_runs.progress(console) as prog:  # a bar with counts, as the decode phases below
            tok = sess.tokenize(lib, None, cfg.tokens, progress=prog)
        if not tok.get("has_residency"):
            abort("this build has no KV residency API; rebuild", f"{lib} lacks llama_init_from_model_rolling_kv: run `rollingkv build`")
        need = sess.logits_bytes() * (1 + len(quantized))
        free = shutil.disk_usage(wd).free
        if need > free - (64 << 20):
            abort(f"the reference logits need {need / 2**20:.0f} MiB in {work_dir}, {free / 2**20:.0f} MiB are free",
                  "point --work-dir at a larger disk, or lower --tokens")
        n = sess.n_tokens
        console.print(f"[dim]{esc(cfg.model.name)}: {n} tokens, ctx {n_ctx}, batch {cfg.n_batch}, {cfg.threads} threads"
                      f"{'' if cfg.n_gpu_layers is None else f', -ngl {cfg.n_gpu_layers}'}; window {WINDOW_TYPE}, tails "
                      f"{', '.join(cfg.tail_types)} at {', '.join(f'{s:g}' for s in cfg.splits)} of the sequence[/]")
        ref = {WINDOW_TYPE: wd / f"ref-{WINDOW_TYPE}.npy"}
        with equiv_runs.progress(console) as prog:
            r = sess.decode("reference", lib, WINDOW_TYPE, WINDOW_TYPE, {"mode": "off"}, save=ref[WINDOW_TYPE], progress=prog,
                            label=f"reference (resident {WINDOW_TYPE})")
            ref_timing = r.get("timings")
            for t in quantized:
                ref[t] = wd / f"ref-{t}.npy"
                r = sess.decode(f"baseline-{t}", lib, t, t, {"mode": "off"}, save=ref[t], reference=ref[WINDOW_TYPE],
                                positions_out=wd / f"baseline-{t}.npz", real_margin_nats=thresholds("quantized")["real_margin_nats"],
                                progress=prog, label=f"baseline (resident {t} vs {WINDOW_TYPE})")
                baselines[t] = {"metrics": _metrics(r["summary"]), "timings": r.get("timings")}
                base_rows[t] = metrics.load_positions(wd / f"baseline-{t}.npz")
            if cfg.order_floor:
                fb = equiv_runs.order_floor_batch(cfg.n_batch)
                for t in [WINDOW_TYPE, *quantized]:
                    r = sess.decode(f"order-floor-{t}", lib, t, t, {"mode": "off"}, reference=ref[t], n_batch=fb,
                                    real_margin_nats=thresholds("same_type")["real_margin_nats"], positions_out=wd / f"order-floor-{t}.npz",
                                    progress=prog, label=f"order floor (resident {t}, batch {fb})")
                    floors[t] = {"n_batch": fb, "metrics": _metrics(r["summary"]), "timings": r.get("timings")}
                    floor_rows[t] = metrics.load_positions(wd / f"order-floor-{t}.npz")

            def floor_relaxed(th: dict, ref_type: str, summary: dict, rows: dict, mask) -> tuple[dict, dict | None]:
                """The bounds relaxed to the floor of ref_type; with same-type bounds, summary["over_floor"] too."""
                if ref_type not in floors:
                    return th, None
                th, how = metrics.order_floor_thresholds(th, floors[ref_type]["metrics"])
                if th.get("max_frac_over_floor") is not None:
                    summary["over_floor"] = metrics.over_floor(rows, floor_rows[ref_type], mask, th["order_factor"])
                return th, how
            for t in cfg.tail_types:
                for s in cfg.splits:
                    w = window_for(s, n)
                    profile = "auto" if t == "auto" else "quantized" if is_quantized(t) else "same_type"
                    th = split_thresholds(profile)
                    if profile == "auto":
                        th = metrics.auto_thresholds(th)  # over the positions that read the tail
                    res = {"mode": "window", "window_cells": w}
                    if t != WINDOW_TYPE:
                        res.update(type_k_tail=t, type_v_tail=t)
                    role = f"cell-{t}-{round(s * 100)}"
                    r = sess.decode(role, lib, WINDOW_TYPE, WINDOW_TYPE, res, reference=ref[WINDOW_TYPE], real_margin_nats=th["real_margin_nats"],
                                    positions_out=wd / f"{role}.npz", progress=prog, label=f"{t} tail, window {w} ({s:g})")
                    rows = metrics.load_positions(wd / f"{role}.npz")
                    summary, mask = equiv_runs.split_summary(r, rows, 1, cfg.n_batch, th["real_margin_nats"])
                    if profile == "auto":  # the bounds of the types the plan chose
                        ch = _chosen(r.get("plan")) or {}
                        th = metrics.auto_thresholds(th, (ch.get("k"), ch.get("v")))
                    how = None
                    if profile == "quantized":
                        base_tail = metrics.subset_summary(base_rows[t], mask, th["real_margin_nats"])
                        th, how = metrics.relative_thresholds(th, base_tail, t)
                        how["baseline_tail"] = {k: base_tail.get(k) for k in _TAIL_KEYS}
                    th, floor_how = floor_relaxed(th, WINDOW_TYPE, summary, rows, mask)
                    v = metrics.verdict(summary, th)
                    cells.append({"kind": "split", "tail": t, "split": s, "window_cells": w, "profile": profile, "thresholds": th,
                                  "relative_to_baseline": how, "relative_to_order_floor": floor_how, "metrics": _metrics(summary), "worst": r["summary"].get("worst", [])[:5],
                                  "checks": v.to_dict()["checks"], "passed": v.passed, "failed_checks": [c.name for c in v.failed],
                                  "plan": _plan_brief(r.get("plan")), "timings": r.get("timings"),
                                  "tail_types_chosen": _chosen(r.get("plan")) if profile == "auto" else None,
                                  "command": equiv_command(cfg, n_ctx, w, t, baseline=profile == "quantized")})
            for t in quantized:
                w = window_for(cfg.exact_split, n)
                th = split_thresholds("same_type")
                r = sess.decode(f"exact-{t}", lib, t, t, {"mode": "window", "window_cells": w}, reference=ref[t],
                                positions_out=wd / f"exact-{t}.npz", real_margin_nats=th["real_margin_nats"], progress=prog,
                                label=f"{t} window + {t} tail vs resident {t}")
                rows = metrics.load_positions(wd / f"exact-{t}.npz")
                summary, mask = equiv_runs.split_summary(r, rows, 1, cfg.n_batch, th["real_margin_nats"])
                th, floor_how = floor_relaxed(th, t, summary, rows, mask)
                v = metrics.verdict(summary, th)
                exact.append({"kind": "exact", "type": t, "split": cfg.exact_split, "window_cells": w, "profile": "same_type",
                              "thresholds": th, "relative_to_order_floor": floor_how, "metrics": _metrics(summary), "checks": v.to_dict()["checks"], "passed": v.passed,
                              "failed_checks": [c.name for c in v.failed], "plan": _plan_brief(r.get("plan")), "timings": r.get("timings"),
                              "command": equiv_command(cfg, n_ctx, w, t, ctk=t)})
        commands = dict(sess.commands)

    needle = None
    if cfg.needle:
        from rollingkv_cli.gate import needle as needle_runs

        ncfg = needle_runs.NeedleConfig(model=cfg.model, build=cfg.build, filler_tokens=cfg.needle_filler_tokens,
                                        depths=tuple(cfg.needle_depths), seed=cfg.needle_seed,
                                        window_cells=needle_window(cfg.needle_filler_tokens), threads=cfg.threads,
                                        n_gpu_layers=cfg.n_gpu_layers, n_predict=cfg.needle_n_predict,
                                        match="answer" if cfg.order_floor else "tokens")
        console.print(f"[dim]needle: {cfg.needle_filler_tokens} filler tokens, window {ncfg.window_cells}, depths "
                      f"{', '.join(f'{d:g}' for d in ncfg.depths)}[/]")
        needle = needle_runs.run(ncfg, console, logs)
        needle["command"] = (f"rollingkv gate needle {cfg.model_spec} --filler-tokens {cfg.needle_filler_tokens} "
                             f"--kv-window-cells {ncfg.window_cells} " + " ".join(f"--depth {d:g}" for d in ncfg.depths)
                             + f" --seed {cfg.needle_seed} --n-predict {cfg.needle_n_predict}" + ("" if cfg.n_gpu_layers is None else f" -ngl {cfg.n_gpu_layers}"))

    all_cells = cells + exact
    failed = [c for c in all_cells if not c["passed"]]
    if failed or (needle is not None and needle["verdict"] == "fail"):
        verdict = "fail"
    elif needle is not None and needle["verdict"] == "inconclusive":
        verdict = "inconclusive"
    else:
        verdict = "pass"
    from rollingkv_cli import __version__

    return {
        "gate": "matrix",
        "rollingkv": __version__,
        "verdict": verdict,
        "passed": verdict == "pass",
        "failed_cells": [_cell_name(c) for c in failed],
        "model": str(cfg.model),
        "tokens": {"n": sess.n_tokens, "n_vocab": sess.n_vocab, "kind": "synthetic", "seed": 0},
        "n_ctx": n_ctx,
        "n_batch": cfg.n_batch,
        "threads": cfg.threads,
        "n_gpu_layers": cfg.n_gpu_layers,
        "window_type": WINDOW_TYPE,
        "splits": list(cfg.splits),
        "tail_types": list(cfg.tail_types),
        "thresholds_file": str(cfg.thresholds_file) if cfg.thresholds_file else None,
        "reference_timings": ref_timing,
        "baselines": baselines,
        "order_floors": floors,
        "cells": cells,
        "exact": exact,
        "needle": needle,
        "build": cfg.build.describe(),
        "backend": backend_label(cfg.build, cfg.n_gpu_layers),
        "host": {"name": socket.gethostname(), "machine": platform.machine(), "cpu": _cpu_model(), "python": sys.version.split()[0]},
        "argv": cfg.argv,
        "runner_commands": commands,
        "wall_s": round(time.time() - t_start, 2),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _over_floor_text(m: dict) -> str:
    """', over floor N/M (TV > bound)' for a cell with the order floor's per-position count, else ''."""
    of = m.get("over_floor")
    if not of or of.get("bound_tv") is None:
        return ""
    return f", over floor {of['n_over']}/{of['n']} (TV > {_g(of['bound_tv'])})"


def _plan_brief(plan: dict | None) -> dict | None:
    if not plan:
        return None
    return {k: plan.get(k) for k in ("mode_chosen", "split", "window_cells", "tail_cells", "type_k_tail", "type_v_tail", "reason",
                                     "tail_types") if k in plan}


def _chosen(plan: dict | None) -> dict | None:
    """The tail types an auto cell's plan chose, and why."""
    tt = (plan or {}).get("tail_types")
    return None if not isinstance(tt, dict) else {"k": tt.get("k"), "v": tt.get("v"), "reason": tt.get("reason")}


def _cell_name(c: dict) -> str:
    if c["kind"] == "exact":
        return f"exact-{c['type']}"
    return f"{c['tail']}@{c['split']:g}"


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


# ------------------------------------------------------------------ markdown

def _g(v, digits: int = 3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if v == 0:
        return "0"
    return f"{v:.{digits}g}" if abs(v) < 1e-3 or abs(v) >= 1e4 else f"{v:.{digits + 1}f}".rstrip("0").rstrip(".")


def markdown(r: dict) -> str:
    mark = {True: "✓", False: "✗"}
    b = r["build"]
    lines = [f"# Gate matrix: {r['verdict'].upper()}", ""]
    lines.append(f"{r['finished_at']}, host `{r['host']['name']}` ({r['host'].get('cpu') or r['host']['machine']}), backend "
                 f"**{r['backend']}**, build series `{(b.get('series_hash') or '?')[:12]}` ({b.get('dir') or b.get('lib_dir')}), "
                 f"model `{Path(r['model']).name}`, {r['tokens']['n']} synthetic tokens (teacher-forced), ctx {r['n_ctx']}, "
                 f"batch {r['n_batch']}, {r['threads']} threads"
                 + ("" if r["n_gpu_layers"] is None else f", -ngl {r['n_gpu_layers']}") + f"; wall {r['wall_s']:.0f} s.")
    lines += ["", "Command: `" + " ".join(["rollingkv", "gate", "matrix", *r.get("argv", [])]) + "`", ""]
    lines += ["## Split vs resident: f16 window + tail of each type, against the resident f16 cache", ""]
    lines += ["Each cell: mean total variation (over the positions that read the tail, for quantized tails), top-1 agreement,",
              "real disagreements (top-1 flips where the reference's margin exceeds 0.5 nats), bitwise-identical rows, positions",
              "that read the tail; ✓ when every bound holds. f16 tails get the same-type bounds (bit-identical rows on the CPU,",
              "mean TV ≤ 1e-4, top-1 ≥ 0.999, no real flip); quantized tails: over the positions that read the tail, mean TV",
              "≤ factor × the resident cache of their own type at the same positions (`--tail-baseline`); `auto`: the type the",
              "planner chose (→), its loss over the positions that read the tail against the auto bounds. A cell whose tail no",
              "position read fails.", ""]
    splits = r["splits"]
    by = {(c["tail"], c["split"]): c for c in r["cells"]}
    w_of = {s: next((c["window_cells"] for c in r["cells"] if c["split"] == s), None) for s in splits}
    lines.append("| tail | " + " | ".join(f"window {s:g} ({w_of[s]} cells)" for s in splits) + " | bounds |")
    lines.append("| --- | " + " | ".join("---" for _ in splits) + " | --- |")
    for t in r["tail_types"]:
        row = [f"`{t}`"]
        bounds = ""
        for s in splits:
            c = by.get((t, s))
            if c is None:
                row.append("")
                continue
            m = c["metrics"]
            tail_tv = f" (tail {_g(m['tail']['mean_tv'])})" if c["profile"] == "quantized" and m.get("tail") else ""
            if c["profile"] == "auto":
                ch, tm = c.get("tail_types_chosen") or {}, m.get("tail") or {}
                row.append(f"{mark[c['passed']]} → `{ch.get('k')}`/`{ch.get('v')}`: tail TV {_g(tm.get('mean_tv'))}, p99 "
                           f"{_g(tm.get('p99_tv'))}, top-1 {_g(tm.get('top1_agreement'), 4)}, tail read by {m.get('tail_positions')}")
                th = c["thresholds"]
                bounds = (f"over the tail positions: TV ≤ {_g(th.get('max_mean_tv'))}, p99 ≤ {_g(th.get('max_p99_tv'))}, "
                          f"top-1 ≥ {_g(th.get('min_top1_agreement'), 4)} (auto)")
                continue
            cell = (f"{mark[c['passed']]} TV {_g(m['mean_tv'])}{tail_tv}, top-1 {_g(m['top1_agreement'], 4)}, real {_g(m['real_frac'])}, "
                    f"bitwise {m.get('bitwise_equal_rows')}/{m['n']}, tail read by {m.get('tail_positions')}{_over_floor_text(m)}")
            row.append(cell)
            th = c["thresholds"]
            how = c.get("relative_to_baseline") or {}
            floor_how = c.get("relative_to_order_floor") or {}

            def src(key: str) -> str:
                # the floor is applied last: its bound is final when it loosened the one it was given
                f = floor_how.get(key)
                if f and f["bound"] != f["absolute"]:
                    return f" ({_g(f['factor'])}× order floor)"
                h = how.get(key)
                if not h:
                    return " (absolute)" if f else ""
                if h.get("bound") is None:
                    return ""
                return f" ({_g(h['factor'])}× baseline over the tail positions)"

            bounds = f"TV ≤ {_g(th.get('max_mean_tv'))}{src('max_mean_tv')}"
            bounds += f", real ≤ {_g(th['max_real_frac'])}{src('max_real_frac')}" if th.get("max_real_frac") is not None else ", real flips not bounded"
            if th.get("min_top1_agreement") is not None:
                bounds += f", top-1 ≥ {_g(th['min_top1_agreement'], 4)}{src('min_top1_agreement')}"
            if th.get("require_bitwise"):
                bounds += ", bit-identical"
            of = m.get("over_floor")
            if th.get("order_floor") and th.get("max_frac_over_floor") is not None and of:
                bounds += (f", ≤ {_g(th['max_frac_over_floor'])} of the tail positions over {_g(of['factor'])}× the floor's "
                           f"p{_g(100 * of['quantile'])}")
        row.append(bounds)
        lines.append("| " + " | ".join(row) + " |")
    if r["baselines"]:
        lines += ["", "## Baselines: the whole cache in the tail's type (resident) against the resident f16 cache", "",
                  "| type | mean TV | max TV | mean KL | top-1 | real |", "| --- | --- | --- | --- | --- | --- |"]
        for t, bl in r["baselines"].items():
            m = bl["metrics"]
            lines.append(f"| `{t}` | {_g(m['mean_tv'])} | {_g(m['max_tv'])} | {_g(m['mean_kl'])} | {_g(m['top1_agreement'], 4)} | {_g(m['real_frac'])} |")
    if r.get("order_floors"):
        lines += ["", "## Order floors: the resident cache with half the batch against the resident cache (same type)", "",
                  "GPU attention kernels tile and split the KV range by shape, so the resident run is reproducible only up to the",
                  "floating-point order of its sums; every bound is the looser of the absolute one and "
                  f"{_g(metrics.DEFAULT_ORDER_FACTOR)}× this floor (`--order-floor`), and in same-type cells at most a",
                  "fraction of the positions that read the tail may have a TV above that factor × the floor's 99th-percentile TV",
                  "over the same positions (`over floor` in a cell: those positions, of all that read the tail).", "",
                  "| type | batch | mean TV | max TV | top-1 | real | bitwise rows |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for t, fl in r["order_floors"].items():
            m = fl["metrics"]
            lines.append(f"| `{t}` | {fl['n_batch']} | {_g(m['mean_tv'])} | {_g(m['max_tv'])} | {_g(m['top1_agreement'], 4)} | "
                         f"{_g(m['real_frac'])} | {m.get('bitwise_equal_rows')}/{m['n']} |")
    if r["exact"]:
        lines += ["", "## Quantized parts are exact: window and tail of the same quantized type against the resident cache of that type", "",
                  "| type | window | mean TV | max TV | top-1 | bitwise rows | |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for c in r["exact"]:
            m = c["metrics"]
            lines.append(f"| `{c['type']}` | {c['window_cells']} | {_g(m['mean_tv'])} | {_g(m['max_tv'])} | {_g(m['top1_agreement'], 4)} | "
                         f"{m.get('bitwise_equal_rows')}/{m['n']}{_over_floor_text(m)} | {mark[c['passed']]} |")
    nd = r.get("needle")
    if nd:
        plan = nd.get("plan") or {}
        lines += ["", f"## Needle: {nd['verdict'].upper()}", "",
                  f"A seeded 5-digit number in number-free filler prose, asked for at the end ({nd['format']} prompt); the resident",
                  f"server and the split server (window {plan.get('window_cells')} + tail {plan.get('tail_cells')} cells, f16 tail)",
                  "answer greedily; pass = identical answer tokens and the reference retrieved the number.", "",
                  "| depth | prompt tokens | needle at | number | resident answer | split answer | |", "| --- | --- | --- | --- | --- | --- | --- |"]
        vm = {"pass": "✓", "fail": "✗", "inconclusive": "? (not retrieved even resident)"}
        for p in nd["placements"]:
            ra = p["reference"]["text"].strip().replace("\n", "⏎").replace("|", "\\|")[:32]
            ca = "identical tokens" if p["identical"] else "differs at token %s" % p["first_difference"]
            lines.append(f"| {p['depth']:g} | {p['n_tokens']} | {p['needle_start']}–{p['needle_end'] - 1} | {p['number']} | `{ra}` | {ca} | {vm[p['verdict']]} |")
        lines += ["", f"`{nd.get('command', '')}`"]
    lines += ["", "## Cells as single gates", ""]
    for c in r["cells"] + r["exact"]:
        lines.append(f"- {_cell_name(c)}: `{c['command']}`")
    lines.append("")
    return "\n".join(lines)


def write_outputs(r: dict, out_dir: Path, name: str) -> tuple[Path, Path]:
    from rollingkv_cli.gate.common import write_json

    jp = out_dir / f"{name}.json"
    mp = out_dir / f"{name}.md"
    write_json(jp, r)
    try:
        mp.write_text(markdown(r))
    except OSError as e:
        from rollingkv_cli.console import abort

        abort(f"cannot write {mp}: {e.strerror or e}")
    return jp, mp


def load_report(path: Path) -> dict:
    from rollingkv_cli.userinput import read_json

    return read_json(path, "gate matrix report")
