"""`gate equiv`'s runs: one runner child per decode, compared on the fly; shared by `gate matrix`.

An EquivSession holds what every decode of one token sequence shares (model, tokens, context, batch,
threads, GPU layers, the work directory); `decode()` runs one child: a reference that saves its logits, a
candidate that compares against saved logits, or both at once (a baseline that is compared and is itself
the reference of later runs).
"""

from __future__ import annotations

import json
import math
import subprocess
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path


def runner_cmd(args: list[str]) -> list[str]:
    from rollingkv_cli.lib.child import python_command

    return python_command("rollingkv_cli.gate.runner", *args)


def positions_path(json_out: Path) -> Path:
    """The per-position file beside a report: OUT.positions.npz, without OUT's .json (`--json jj/run.v1` and `run.v2`
    both wrote run.positions.npz, so the first report named the second's data)."""
    stem = json_out.name[:-5] if json_out.name.lower().endswith(".json") else json_out.name
    return json_out.with_name(stem + ".positions.npz")


def mem_available() -> int | None:
    """The host's MemAvailable (/proc/meminfo), bytes; None where it is not known."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_room(model: Path, n_tokens: int, n_ctx: int, ctk: str, ctv: str, work_root: Path, logits_copies: int, what: str,
               kv_on_host: bool) -> None:
    """Refuse, before anything is tokenized, a run the host cannot hold (--synthetic-tokens 100000000: 50 s of silence,
    then std::bad_alloc in the tokenize child): the reference logits (n_tokens x n_vocab x 4 bytes, per copy) against
    the work folder's free disk, and, on the CPU, the cache of n_ctx cells at -ctk/-ctv against MemAvailable. The sizes
    come from the GGUF header; what a header does not say is not counted. `what` names the setting to lower."""
    import shutil

    from rollingkv_cli.console import abort
    from rollingkv_cli.lib.gguf_header import read_header
    from rollingkv_cli.lib.units import human_bytes

    h = read_header(model)
    arch = h.get("general.architecture")
    vocab = h.get("tokenizer.ggml.tokens")
    n_vocab = len(vocab) if isinstance(vocab, list) else h.get(f"{arch}.vocab_size")
    if isinstance(n_vocab, int) and n_vocab > 0:
        need = n_tokens * n_vocab * 4 * logits_copies
        try:
            free = shutil.disk_usage(work_root).free
        except OSError:
            free = None
        if free is not None and need > free - (64 << 20):
            abort(f"{what}: the reference logits alone would be {human_bytes(need)} ({n_tokens} tokens x {n_vocab} vocabulary x 4 bytes"
                  f"{f' x {logits_copies}' if logits_copies > 1 else ''}), and {work_root} has {human_bytes(free)} free",
                  "decode fewer tokens, or point --work-dir at a larger disk")
    if not kv_on_host:
        return
    try:
        from rollingkv_cli.bench.gguf import read_model

        kv = read_model(model).kv.row_bytes(ctk, ctv) * n_ctx
    except Exception:  # a shape the header does not give whole (the runner says what is wrong): not counted
        return
    avail = mem_available()
    if avail is not None and kv > avail:
        abort(f"{what}: the KV cache of {n_ctx} cells ({ctk}/{ctv}) alone would take {human_bytes(kv)} of memory, and the host "
              f"has {human_bytes(avail)} available", "decode fewer tokens")


def progress(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("[dim]{task.fields[stage]}[/]"), TimeElapsedColumn(), console=console, transient=False)


def run_child(role: str, cmd: list[str], log_path: Path, result_path: Path, progress=None, label: str = "", total: int = 0) -> dict:
    """Run one runner child: stdout is the protocol, stderr (llama.cpp's log) goes to log_path."""
    from rollingkv_cli.console import abort, console, log_panel
    from rollingkv_cli.lib import child
    from rollingkv_cli.lib.procs import exit_parts

    task = progress.add_task(label, total=total or None, stage="starting") if progress is not None else None
    error: dict | None = None
    tail: deque[str] = deque(maxlen=20)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = child.spawn(cmd, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
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
        message = str(error.get("message"))
        if message.startswith("llama.cpp could not load the model"):  # its reason is in the log: said here, as serve says it
            from rollingkv_cli.serve.server import model_error_in_log

            try:
                reason = model_error_in_log(log_path.read_text(errors="replace").splitlines())
            except OSError:
                reason = None
            if reason:
                message = f"{message}: {reason.split(': ', 1)[1]}"
                hint = "the file is corrupt or not a model this build runs"
        abort(f"{role} run: {message}", f"{hint} (llama.cpp's log: {log_path})" if hint else f"llama.cpp's log: {log_path}")
    if rc != 0 or not result_path.is_file():
        from rollingkv_cli.lib.builder import log_tail

        log_panel(log_tail(log_path, 15).rstrip() or "\n".join(tail), f"last lines of {log_path}", console)
        what, advice = exit_parts(rc)
        abort(f"the {role} run failed ({what})", f"{advice}; full log: {log_path}" if advice else f"full log: {log_path}")
    return json.loads(result_path.read_text())


def _kill(proc: subprocess.Popen) -> None:
    from rollingkv_cli.lib.procs import stop_group

    stop_group(proc)


@dataclass
class EquivSession:
    model: Path
    wd: Path  # temporary: tokens and logits
    logs: Path
    threads: int
    n_batch: int = 512
    n_seq: int = 1  # sequences decoded side by side in every batch (one unified KV cache)
    n_gpu_layers: int | None = None
    n_ctx: int | None = None
    tokens: Path | None = None
    n_tokens: int = 0
    n_vocab: int = 0
    token_info: dict = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)

    def tokenize(self, lib_dir: Path, prompt_file: Path | None, synthetic_tokens: int | None, progress=None) -> dict:
        """The runner's tokenize child; with a rich Progress (progress()), a "tokens" bar as the decode phases have."""
        from rollingkv_cli.gate import equiv as me

        args = ["--lib-dir", str(lib_dir), "--model", str(self.model), "--tokens-out", str(self.wd / "tokens.npy"),
                "--out", str(self.wd / "tokenize.json")]
        args += ["--tokenize", str(prompt_file)] if prompt_file is not None else ["--synthetic", str(synthetic_tokens)]
        self.commands["tokenize"] = runner_cmd(args)
        tok = me.run_child("tokenize", self.commands["tokenize"], self.logs / "tokenize.log", self.wd / "tokenize.json", progress,
                           "tokens", synthetic_tokens or 0)
        self.tokens = self.wd / "tokens.npy"
        self.n_tokens = int(tok["n_tokens"]) // self.n_seq * self.n_seq  # the runner decodes n_seq equal sequences
        self.n_vocab = int(tok["n_vocab"])
        self.token_info = tok
        return tok

    def logits_bytes(self) -> int:
        return self.n_tokens * self.n_vocab * 4

    def decode(self, role: str, lib_dir: Path, ctk: str, ctv: str, residency: dict | None, *, save: Path | None = None,
               reference: Path | None = None, real_margin_nats: float = 0.5, positions_out: Path | None = None,
               progress=None, label: str = "", n_batch: int | None = None) -> dict:
        """One child run. residency None: plain llama_init_from_model (any library); else our residency API."""
        from rollingkv_cli.gate import equiv as me

        assert self.tokens is not None and self.n_ctx is not None
        assert save is not None or reference is not None
        args = ["--lib-dir", str(lib_dir), "--model", str(self.model), "--tokens", str(self.tokens), "--ctx", str(self.n_ctx),
                "--n-batch", str(n_batch or self.n_batch), "--n-seq", str(self.n_seq), "--threads", str(self.threads), "-ctk", ctk, "-ctv", ctv]
        if self.n_gpu_layers is not None:
            args += ["--n-gpu-layers", str(self.n_gpu_layers)]
        if residency is not None:
            args += ["--residency", json.dumps(residency)]
        if save is not None:
            args += ["--save-logits", str(save)]
        if reference is not None:
            args += ["--reference-logits", str(reference), "--real-margin-nats", str(real_margin_nats)]
        if positions_out is not None:
            args += ["--positions-out", str(positions_out)]
        out = self.wd / f"{role}.json"
        args += ["--out", str(out)]
        self.commands[role] = runner_cmd(args)
        return me.run_child(role, self.commands[role], self.logs / f"{role}.log", out, progress, label or role, self.n_tokens)


# ------------------------------------------------------------------ tail positions, the control

def split_summary(result: dict, rows: dict, n_seq: int, n_batch: int, real_margin_nats: float) -> tuple[dict, "object"]:
    """A compared run's summary with where its positions read: window_cells (None: not split), tail_positions (rows
    whose query attended a tail cell, from the plan's window and the cells the tokens went to: metrics.tail_rows),
    tail and window (the summaries over those rows and the others). Returns (summary, the per-row tail mask)."""
    from rollingkv_cli.gate import metrics

    plan = result.get("plan") or {}
    head = plan.get("split") and plan.get("mode_chosen") == "head"
    wc = plan.get("window_cells") if plan.get("split") and not head else None
    mask = metrics.tail_rows(len(rows["pos"]), n_seq, n_batch, wc)
    if head:
        mask[:] = True  # a head split streams its host heads of every cell: every position reads the tail
    out = dict(result["summary"])
    out["window_cells"] = wc
    out["head_split"] = head_split_of(plan)
    out["tail_positions"] = int(mask.sum())
    out["tail"] = metrics.subset_summary(rows, mask, real_margin_nats)
    w = metrics.subset_summary(rows, ~mask, real_margin_nats)
    out["window"] = {k: w.get(k) for k in ("n", "mean_tv", "max_tv", "bitwise_equal_rows")}
    return out, mask


def head_split_of(plan: dict | None) -> dict | None:
    """A head-split plan's device KV heads per layer (per_layer), their common count (uniform; None when they differ)
    and the summary; None for any other plan."""
    plan = plan or {}
    heads = plan.get("heads")
    if not plan.get("split") or plan.get("mode_chosen") != "head" or not isinstance(heads, dict):
        return None
    per_layer = list(heads.get("per_layer") or [])
    return {"per_layer": per_layer, "uniform": per_layer[0] if per_layer and len(set(per_layer)) == 1 else None,
            "summary": heads.get("summary"), "device": heads.get("device"), "host": heads.get("host")}


def control_thresholds(thresholds_file: Path | None, exact_bits: bool, tolerance: float | None) -> dict:
    """The --tail-baseline control (window and tail both of the tail's type against the resident cache of that type):
    the same-type bounds, bit-identity on the CPU (or --tolerance), and a used tail."""
    from rollingkv_cli.gate import metrics

    th = metrics.load_thresholds(thresholds_file, "same_type")
    th["require_bitwise"] = exact_bits
    th["require_tail"] = True
    if tolerance is not None:
        th["max_mean_tv"] = tolerance
    return th


# ------------------------------------------------------------------ auto tail types: the heads, the needle, the report

NEEDLE_N_PREDICT = 12  # the answer's number and a little after it
NEEDLE_MIN_TAIL = 96  # filler tokens the tail must hold for the needle to lie in it with room on both sides


def check_auto_tail_heads(model: Path, ctk: str, ctv: str, ctkt: str | None, ctvt: str | None) -> None:
    """A requested head split with auto tail types whose host heads cannot take the compressed types auto would choose:
    a usage error before any run (the library refuses it too, when it plans)."""
    from rollingkv_cli.bench.gguf import read_model
    from rollingkv_cli.console import usage_error
    from rollingkv_cli.serve.launch import auto_tail_head_refusal

    info = read_model(model)
    why = auto_tail_head_refusal(info.head_dim_k, info.head_dim_v, ctkt == "auto", ctvt == "auto", ctk, ctv)
    if why:
        usage_error(f"{model.name}: {why}", "give -ctkt/-ctvt a type that divides the heads (f16, bf16, f32), or split by window")


def needle_depths(plan: dict | None, filler_tokens: int) -> tuple[float, ...] | None:
    """Where the needle goes so that it lies in the candidate's tail: a third and two thirds of the way through the
    filler's tail part (a window's cells [0, wc) hold the oldest positions); a head split streams every position. None when
    the tail holds fewer than NEEDLE_MIN_TAIL filler tokens."""
    plan = plan or {}
    if plan.get("mode_chosen") == "head":
        return (0.5, 0.85)
    wc = int(plan.get("window_cells") or 0)
    if not plan.get("split") or filler_tokens - wc < NEEDLE_MIN_TAIL:
        return None
    return tuple(round((wc + k * (filler_tokens - wc) / 3) / filler_tokens, 4) for k in (1, 2))


def auto_needle(model: Path, build, cand_plan: dict | None, *, n_ctx: int, mode: str, window_cells: int | None,
                vram_target: int | None, device_heads: int | None, ctk: str, ctv: str, ctkt: str | None, ctvt: str | None,
                threads: int, n_gpu_layers: int | None, console, logs: Path) -> dict:
    """gate needle's run with the candidate's residency request at the gate's context (so that the server plans as the
    candidate did), the needle in the tail, compared through the number (a lossy tail may word what follows it otherwise).
    The report, or {"verdict": "skipped", "why": ...} when the tail is too short to hold it."""
    from rollingkv_cli.gate import needle as needle_runs

    filler = int((n_ctx - 96 - NEEDLE_N_PREDICT - 64) / 1.05)  # NeedleConfig.default_ctx's room, inverted
    depths = needle_depths(cand_plan, filler)
    if depths is None:
        why = (f"the candidate's tail holds fewer than {NEEDLE_MIN_TAIL} of the needle's {filler} filler tokens (window "
               f"{(cand_plan or {}).get('window_cells')} of {n_ctx} cells)")
        return {"verdict": "skipped", "passed": None, "why": why}
    cfg = needle_runs.NeedleConfig(model=model, build=build, filler_tokens=filler, depths=depths, n_ctx=n_ctx, window_cells=window_cells,
                                   device_heads=device_heads, vram_target=vram_target, ctk=ctk, ctv=ctv, ctkt=ctkt, ctvt=ctvt,
                                   n_predict=NEEDLE_N_PREDICT, threads=threads, n_gpu_layers=n_gpu_layers, mode=mode, match="answer")
    console.print(f"[dim]needle: {filler} filler tokens, depths {', '.join(f'{d:g}' for d in depths)}, the candidate's residency[/]")
    r = needle_runs.run(cfg, console, logs)
    tt = (r.get("plan") or {}).get("tail_types") or {}
    want = (cand_plan or {}).get("tail_types") or {}
    r["tail_types"] = {"k": tt.get("k"), "v": tt.get("v")}
    if (tt.get("k"), tt.get("v")) != (want.get("k"), want.get("v")):
        r["note"] = (f"the needle's server chose K {tt.get('k')}, V {tt.get('v')} (the gate's candidate K {want.get('k')}, "
                     f"V {want.get('v')}): its plan differs")
    return r


def print_needle(console, r: dict) -> None:
    from rollingkv_cli.console import esc

    if r["verdict"] == "skipped":
        console.print(f"[yellow]needle: not run[/]: {esc(r['why'])}")
        return
    mark = {"pass": "[green]✓[/]", "fail": "[bold red]✗[/]", "inconclusive": "[yellow]?[/]"}[r["verdict"]]
    places = ", ".join(f"{p['number']} at {p['needle_start']} ({'retrieved' if p['candidate_retrieved'] else 'missed'}"
                       f"{'' if p['reference_retrieved'] else ', missed resident too'})" for p in r["placements"])
    tt = r.get("tail_types") or {}
    console.print(f"{mark} needle in the tail (K {tt.get('k')}, V {tt.get('v')}): {r['verdict']} — {places}", soft_wrap=True)
    if r.get("note"):
        console.print(f"[yellow]{esc(r['note'])}[/]")


def auto_tail_report(plan: dict | None, summary: dict, thresholds: dict, v, needle: dict | None) -> dict:
    """What gate equiv reports of auto tail types: the planner's choice and why, the loss over the positions that read the
    tail with its bounds, and the needle."""
    tt = (plan or {}).get("tail_types") or {}
    tail = summary.get("tail") or {}
    bounds = {k: thresholds.get(k) for k in ("max_mean_tv", "max_p99_tv", "min_top1_agreement", "max_real_frac") if thresholds.get(k) is not None}
    return {
        "requested": {"k": tt.get("requested_k"), "v": tt.get("requested_v")},
        "chosen": {"k": tt.get("k"), "v": tt.get("v")},
        "reason": tt.get("reason"),
        "loss": {"positions": summary.get("tail_positions"), **{k: tail.get(k) for k in ("mean_tv", "p99_tv", "max_tv", "top1_agreement",
                                                                                           "real_frac", "mean_kl")}},
        "bounds": bounds,
        "loss_passed": v.passed,
        "needle": None if needle is None else {
            "verdict": needle["verdict"], "why": needle.get("why"), "note": needle.get("note"), "tail_types": needle.get("tail_types"),
            "placements": [{k: p.get(k) for k in ("depth", "number", "needle_start", "n_tokens", "reference_retrieved",
                                                  "candidate_retrieved", "verdict")} for p in needle.get("placements", [])]},
    }


# ------------------------------------------------------------------ display

def fmt(v) -> str:
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


def short_path(p: Path | None) -> str:
    s = str(p)
    return s if len(s) <= 40 else "…" + s[-39:]


def order_floor_batch(n_batch: int, n_seq: int = 1) -> int:
    """The order-floor run's batch: half the gate's (another tiling of the same math); twice it where half would not hold
    a token of each of the n_seq sequences side by side (a batch of 1, or of n_seq: decode-sized batches)."""
    return n_batch // 2 if n_batch // 2 >= max(1, n_seq) else 2 * n_batch


def tail_desc(mode: str, ctkt: str | None, ctvt: str | None) -> str:
    if mode == "off" or (ctkt is None and ctvt is None):
        return ""
    return f", tail {ctkt or '='}/{ctvt or '='}"


def print_table(console, s: dict, th: dict, v, profile: str, title: str | None = None) -> None:
    from rich.table import Table

    by_metric = {c.metric: c for c in v.checks}
    tail_only = th.get("positions") == "tail"
    src = (s.get("tail") or {}) if tail_only else s
    t = Table(title=title or f"equivalence gate ({profile.replace('_', '-')} bounds)", title_justify="left")
    t.add_column("metric")
    t.add_column("value" if not tail_only else "value (tail positions)", justify="right")
    t.add_column("bound", justify="right")
    t.add_column("", justify="center")
    rows = [
        ("positions", "n"),
        ("mean total variation", "mean_tv"),
        ("max total variation", "max_tv"),
        ("99th-percentile total variation", "p99_tv"),
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
            bound = ("≤ " if c.kind == "max" else "≥ ") + fmt(b)
            mark = "[green]✓[/]" if c.ok else "[bold red]✗[/]"
        t.add_row(label, fmt((s if key in ("n", "nonfinite") else src).get(key)), bound, mark)
    for label, key in (("positions that read the tail", "tail_positions"), ("bitwise-identical rows", "bitwise_equal_rows")):
        c = by_metric.get(key)
        if c is not None:
            t.add_row(label, fmt(s.get(key)), "≥ " + fmt(int(c.bound)), "[green]✓[/]" if c.ok else "[bold red]✗[/]")
    of = s.get("over_floor")
    if of is not None:
        c = by_metric.get("frac_over_floor")
        label = (f"tail TV > {of['factor']:g}× floor p{100 * of['quantile']:g}"
                 + ("" if of["bound_tv"] is None else f" = {fmt(of['bound_tv'])}"))
        value = f"{of['n_over']}/{of['n']}" + ("" if of["frac_over"] is None else f" ({fmt(of['frac_over'])})")
        if c is None:
            t.add_row(f"[dim]{label}[/]", f"[dim]{value}[/]", "", "")
        else:
            t.add_row(label, value, "≤ " + fmt(c.bound), "[green]✓[/]" if c.ok else "[bold red]✗[/]")
    if "bitwise_equal_rows" not in by_metric:
        t.add_row("[dim]bitwise-identical rows[/]", f"[dim]{s.get('bitwise_equal_rows')}/{s.get('n')}[/]", "", "")
    if "tail_positions" not in by_metric and s.get("tail_positions") is not None:
        t.add_row("[dim]positions that read the tail[/]", f"[dim]{s['tail_positions']}[/]", "", "")
    t.add_row("[dim]max |Δ logit|[/]", f"[dim]{fmt(s.get('max_abs_logit_diff'))}[/]", "", "")
    console.print(t)
    worst = s.get("worst", [])[:3]
    if worst and s.get("max_tv"):
        console.print("[dim]worst positions: " + ", ".join(
            f"{w['pos']} (tv {w['tv']:.2e}, top-1 {w['top1_ref']}→{w['top1_cand']}, margin {w['ref_margin']:.2f})" for w in worst) + "[/]")


def print_plan(console, plan) -> None:
    if not plan:
        return
    keys = [k for k in ("mode_requested", "mode", "reason", "window_cells", "tail_cells") if k in plan]
    if plan.get("mode_chosen") == "head":
        keys = [k for k in keys if k not in ("window_cells", "tail_cells")]
    if keys:
        console.print("plan: " + ", ".join(f"{k}={plan[k]}" for k in keys), style="dim", markup=False)
