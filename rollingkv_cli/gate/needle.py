"""`gate needle`: a fact placed in the host tail is retrieved in window mode exactly as in the resident run.

A seeded random number ("The secret number is 48213.") is put at a fraction of the way (``depth``) into
filler text of a given length, followed by a question. The window holds the OLDEST positions (cells
``[0, wc)``), so the fact lies in the tail when its first token's position is ``>= wc``. Two llama-server
processes answer the same token ids greedily: the reference (residency off, the plain resident cache) and
the candidate (the split cache). Verdict per placement:

- ``pass``          the candidate's answer tokens are identical to the reference's, and the reference's
                     answer contains the number;
- ``fail``          the answer tokens differ (whatever the reference answered);
- ``inconclusive``  identical answers, but the reference itself does not retrieve the number: the model
                     cannot do this task, so the gate proves nothing about the tail.

``match="answer"`` (the default on the GPU) compares the answers only through the number: pass when both
retrieve it and the texts agree up to its end. GPU kernels reproduce the resident run only up to the
floating-point order of their sums (``gate equiv --order-floor``), which can flip a near tie in what the
model says after the answer (on the H200, the resident demo model ended " 93494." where the split one
went on " 93494.\n\nThe answer is"); what the tail must deliver is the fact.

The whole gate fails when any placement fails, is inconclusive when none fails and one is inconclusive.
This module holds the prompt construction and the verdict (pure, tested without a model) and the runs.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rollingkv_cli.console import RollingKVError, abort, usage_error
from rollingkv_cli.lib.text import filler_prose

FORMATS = ("plain", "chat")
QUESTION = "What is the secret number?"
MARK = "\x00NEEDLE\x00"  # where the needle goes in the (templated) text; never a real token


def needle_number(seed: int, index: int) -> str:
    """A 5-digit number no model can know: drawn from (seed, placement index)."""
    return str(random.Random(f"rollingkv-needle/{seed}/{index}").randint(10000, 99999))


def needle_sentence(number: str) -> str:
    return f" The secret number is {number}."


def sentence_cut(text: str, frac: float) -> int:
    """The character index of the sentence boundary nearest to frac * len(text) (after '. ' or a newline)."""
    target = int(len(text) * frac)
    best = None
    for i, ch in enumerate(text):
        if ch in ".\n" and (i + 1 == len(text) or text[i + 1] in " \n"):
            cut = i + 1
            if best is None or abs(cut - target) < abs(best - target):
                best = cut
            if cut > target:
                break
    if best is None:
        return max(0, min(len(text), target))
    return best


def build_text(filler: str, depth: float, number: str, fmt: str) -> tuple[str, str]:
    """(document with MARK where the needle goes, the needle sentence). The caller applies the chat template
    (fmt chat) or uses the text as is (plain: a completion prompt that ends where the answer starts)."""
    cut = sentence_cut(filler, depth)
    doc = filler[:cut].rstrip(" ") + MARK + " " + filler[cut:].lstrip(" ")
    if fmt == "plain":
        return doc + f"\n\nQuestion: {QUESTION}\nAnswer: The secret number is", needle_sentence(number)
    return doc + f"\n\n{QUESTION}", needle_sentence(number)


@dataclass
class Placement:
    index: int
    depth: float
    number: str
    tokens: list[int] = field(default_factory=list)
    needle_start: int = 0  # position of the needle's first token
    needle_end: int = 0  # one past its last token

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class Answer:
    tokens: list[int]
    text: str
    prompt_tokens: int | None = None
    seconds: float | None = None


def retrieved(answer_text: str, number: str) -> bool:
    return number in answer_text


MATCHES = ("tokens", "answer")


def placement_verdict(ref: Answer, cand: Answer, number: str, match: str = "tokens") -> str:
    if match == "answer":
        if not retrieved(ref.text, number):
            return "inconclusive" if ref.tokens == cand.tokens or not retrieved(cand.text, number) else "fail"
        end = ref.text.index(number) + len(number)
        return "pass" if cand.text[:end] == ref.text[:end] else "fail"
    if ref.tokens != cand.tokens:
        return "fail"
    if not retrieved(ref.text, number):
        return "inconclusive"
    return "pass"


def overall_verdict(verdicts: list[str]) -> str:
    if not verdicts:
        return "fail"
    if "fail" in verdicts:
        return "fail"
    if "inconclusive" in verdicts:
        return "inconclusive"
    return "pass"


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ------------------------------------------------------------------ filler (its prose: lib/text.py)

def make_filler(tokenize, n_tokens: int, seed: int, source_text: str | None = None, on_stage=None) -> str:
    """About n_tokens tokens of filler (within 2 %): filler_prose or the given text, cut at a sentence boundary.
    `tokenize(text) -> list[int]` counts with the model's vocabulary; on_stage(str), if given, hears each count."""
    say = on_stage or (lambda _: None)
    text = source_text if source_text is not None else filler_prose(max(256, n_tokens * 6), seed)
    say(f"tokenizing the filler ({len(text)} characters)")
    n_all = len(tokenize(text))
    say(f"the filler: {min(n_all, n_tokens)} of {n_tokens} tokens")
    if source_text is None:
        while n_all < n_tokens:
            text = filler_prose(len(text) * 2, seed)
            n_all = len(tokenize(text))
            say(f"the filler: {min(n_all, n_tokens)} of {n_tokens} tokens")
    if n_all <= n_tokens:
        return text
    # cut proportionally, then correct: tokens per character barely vary in the filler
    frac = n_tokens / n_all
    cut = len(text)
    for _ in range(4):
        cut = sentence_cut(text, min(frac, 1.0))
        say(f"cutting the filler to {n_tokens} tokens")
        n = len(tokenize(text[:cut]))
        if abs(n - n_tokens) <= max(8, n_tokens // 50):
            break
        frac *= n_tokens / max(n, 1)
    return text[:cut]


# ------------------------------------------------------------------ server side

class ServerSide:
    """The tokenizer and the greedy answers of one running llama-server."""

    def __init__(self, srv):
        self.srv = srv

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        from rollingkv_cli.gate.common import request

        return list(request(self.srv, "/tokenize", {"content": text, "add_special": add_special, "parse_special": True},
                            timeout=120)["tokens"])

    def apply_template(self, user_content: str) -> str:
        from rollingkv_cli.gate.common import request

        r = request(self.srv, "/apply-template", {"messages": [{"role": "user", "content": user_content}]}, timeout=60)
        if "prompt" not in r:
            raise RollingKVError("llama-server's /apply-template returned no prompt", "does the model carry a chat template? try --format plain")
        return r["prompt"]

    def answer(self, tokens: list[int], n_predict: int, on_progress=None, every: float = 0.5) -> Answer:
        """The greedy answer to the prompt `tokens`. on_progress(tokens done) is called about every `every` seconds
        meanwhile (the prompt's tokens processed plus those generated, from /slots): a long prompt on a CPU takes minutes.
        The request itself is the same either way."""
        import threading

        from rollingkv_cli.gate.common import request

        t0 = time.perf_counter()
        payload = {"prompt": tokens, "n_predict": n_predict, "temperature": 0, "top_k": 1, "seed": 0, "cache_prompt": False,
                   "return_tokens": True, "samplers": ["top_k"]}
        if on_progress is None:
            r = request(self.srv, "/completion", payload)
        else:
            got: dict = {}

            def ask():
                try:
                    got["r"] = request(self.srv, "/completion", payload)
                except BaseException as e:  # noqa: BLE001  (raised again in the caller's thread)
                    got["e"] = e

            worker = threading.Thread(target=ask, daemon=True)  # daemon: an interrupt stops the server, not this wait
            worker.start()
            while worker.is_alive():
                worker.join(every)
                done = self.tokens_done() if worker.is_alive() else None
                if done is not None:
                    on_progress(done)
            if "e" in got:
                raise got["e"]
            r = got["r"]
        return Answer(tokens=[int(t) for t in r.get("tokens") or []], text=r.get("content", ""),
                      prompt_tokens=r.get("tokens_evaluated"), seconds=round(time.perf_counter() - t0, 3))

    def tokens_done(self) -> int | None:
        """The running request's prompt tokens processed plus tokens generated (llama-server's /slots), None when not
        known (no slot busy, /slots off or slow to answer: it waits for the batch being computed)."""
        try:
            slots = self.srv.request("/slots", None, timeout=5)
        except Exception:  # noqa: BLE001  (progress is a nicety: never a failure of the gate)
            return None
        for slot in slots if isinstance(slots, list) else []:
            if isinstance(slot, dict) and slot.get("is_processing"):
                nt = slot.get("next_token")
                decoded = nt[0].get("n_decoded", 0) if isinstance(nt, list) and nt and isinstance(nt[0], dict) else 0
                return int(slot.get("n_prompt_tokens_processed") or 0) + int(decoded or 0)
        return None


def build_placements(side: ServerSide, filler: str, depths: list[float], seed: int, fmt: str, on_stage=None) -> list[Placement]:
    """Token ids of each placement's prompt, with the needle's exact token span (the pieces are tokenized
    separately and concatenated, so the span never depends on how BPE merges across the boundary). on_stage(str), if
    given, hears which prompt is being tokenized."""
    out = []
    for i, d in enumerate(depths):
        if on_stage is not None:
            on_stage(f"tokenizing prompt {i + 1} of {len(depths)} (depth {d:g})")
        number = needle_number(seed, i)
        text, needle = build_text(filler, d, number, fmt)
        if fmt == "chat":
            text = side.apply_template(text)
        before, sep, after = text.partition(MARK)
        if not sep:
            raise RollingKVError("the chat template lost the needle marker", "use --format plain")
        head = side.tokenize(before, add_special=True)
        mid = side.tokenize(needle)
        tail = side.tokenize(after)
        out.append(Placement(i, d, number, head + mid + tail, len(head), len(head) + len(mid)))
    return out


def placement_dict(p: Placement, window_cells: int | None) -> dict:
    d = asdict(p)
    d.pop("tokens")
    d["n_tokens"] = p.n_tokens
    d["needle_in_tail"] = None if window_cells is None else p.needle_start >= window_cells
    return d


def tail_positions(n_tokens: int, n_answer: int, window_cells: int | None) -> int:
    """Decoded positions whose key range reaches past the window: the prompt's [wc, n) and the answer's (its last
    token is sampled, never decoded); one sequence, so position p sits in cell p. None: no split (no position); 0: a
    head split (every position)."""
    if window_cells is None:
        return 0
    return max(0, n_tokens + max(0, n_answer - 1) - window_cells)


def check_in_tail(placements: list[Placement], window_cells: int, where: str, n_predict: int = 0) -> None:
    from rollingkv_cli.gate.metrics import TAIL_NEVER_USED

    longest = max((p.n_tokens for p in placements), default=0)
    if tail_positions(longest, n_predict, window_cells) == 0:
        abort(TAIL_NEVER_USED, f"the window [0, {window_cells}) {where} holds every prompt ({longest} tokens at most) and its answer: "
                               "lower --kv-window-cells or raise --filler-tokens")
    inside = [p for p in placements if p.needle_start < window_cells]
    if inside:
        p = inside[0]
        abort(f"the needle at depth {p.depth:g} starts at position {p.needle_start}, inside the window [0, {window_cells}) {where}",
              "the window holds the oldest positions: use a later --depth, more --filler-tokens, or a smaller window")


# ------------------------------------------------------------------ the run

@dataclass
class NeedleConfig:
    model: Path
    build: "object"  # common.GateBuild
    filler_tokens: int = 1536
    depths: tuple[float, ...] = (0.5, 0.9)
    seed: int = 0
    fmt: str = "plain"
    n_ctx: int | None = None
    window_cells: int | None = None
    device_heads: int | None = None
    vram_target: int | None = None
    ctk: str = "f16"
    ctv: str = "f16"
    ctkt: str | None = None
    ctvt: str | None = None
    n_predict: int = 16
    threads: int | None = None
    n_gpu_layers: int | None = None
    filler_file: Path | None = None
    mode: str = "window"
    match: str = "tokens"  # or "answer": through the number only (the GPU's order floor, see the module doc)

    def residency(self) -> dict:
        r: dict = {"mode": self.mode}
        if self.window_cells:
            r["window_cells"] = self.window_cells
        if self.device_heads:
            r["device_heads"] = self.device_heads
        if self.vram_target:
            r["vram_target_mib"] = self.vram_target
        if self.ctkt:
            r["type_k_tail"] = self.ctkt
        if self.ctvt:
            r["type_v_tail"] = self.ctvt
        return r

    def default_ctx(self) -> int:
        # filler (cut within ~2 %), the question and a chat template's framing, the answer; whole 256-cell steps
        need = int(self.filler_tokens * 1.05) + 96 + self.n_predict
        return -(-need // 256) * 256 + 256


def run(cfg: NeedleConfig, console, logs: Path) -> dict:
    """Both servers, every placement; the report (verdicts included). Raises RollingKVError on errors."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from rollingkv_cli.gate import common as gc

    t_start = time.time()
    binary = cfg.build.require_server()
    n_ctx = cfg.n_ctx or cfg.default_ctx()
    if cfg.window_cells is not None and cfg.window_cells >= n_ctx:
        # the context is --ctx or follows from --filler-tokens: a usage error either way
        usage_error(f"--kv-window-cells {cfg.window_cells} must be smaller than the context ({n_ctx})", "lower it, or raise --ctx")
    if not cfg.build.on_gpu(cfg.n_gpu_layers):  # the whole cache in host memory: one that cannot fit is said now
        from rollingkv_cli.bench import gguf as model_shape

        try:
            info = model_shape.read_model(cfg.model)
        except RollingKVError:  # a shape this reader does not know: llama-server says what it thinks
            info = None
        if info is not None:
            model_shape.check_host_kv(info, n_ctx, [(cfg.ctk, cfg.ctv), (cfg.ctkt or cfg.ctk, cfg.ctvt or cfg.ctv)],
                                      f"a context of {n_ctx} cells", "lower --filler-tokens (or -c/--ctx-size)")
    filler_src = None
    if cfg.filler_file is not None:
        from rollingkv_cli.userinput import read_text

        filler_src = read_text(cfg.filler_file, "filler file")
        if not filler_src.strip():
            abort(f"{cfg.filler_file} is empty")
    ref_res = {"mode": "off"}
    cand_res = cfg.residency()
    ref_args = gc.server_args(cfg.model, n_ctx, cfg.threads, cfg.n_gpu_layers, cfg.ctk, cfg.ctv, ref_res)
    cand_args = gc.server_args(cfg.model, n_ctx, cfg.threads, cfg.n_gpu_layers, cfg.ctk, cfg.ctv, cand_res)
    sides: dict[str, dict] = {}
    answers: dict[str, list[Answer]] = {"reference": [], "candidate": []}
    placements: list[Placement] = []
    plan = None
    # the bar counts tokens (each prompt's, then its answer's), not placements: a side is two long prompts on a CPU
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                        TextColumn("[dim]{task.fields[stage]}[/]"), TimeElapsedColumn(), console=console, transient=False)
    with progress:
        for role, args in (("reference", ref_args), ("candidate", cand_args)):
            label = "reference (resident)" if role == "reference" else f"candidate ({cfg.mode})"
            task = progress.add_task(label, total=None, stage="starting llama-server")
            log_path = logs / f"needle-{role}.log"
            t0 = time.perf_counter()
            srv = gc.start_server(binary, args, log_path)
            try:
                side = ServerSide(srv)
                load_s = time.perf_counter() - t0
                p = gc.plan_of(srv)
                if role == "reference":
                    def stage(text: str, task=task) -> None:  # the prompts' tokenization, with its counts
                        progress.update(task, stage=text)

                    filler = make_filler(side.tokenize, cfg.filler_tokens, cfg.seed, filler_src, on_stage=stage)
                    placements = build_placements(side, filler, list(cfg.depths), cfg.seed, cfg.fmt, on_stage=stage)
                    longest = max(pl.n_tokens for pl in placements)
                    if longest + cfg.n_predict > n_ctx:
                        abort(f"the longest prompt is {longest} tokens: with {cfg.n_predict} answer tokens it does not fit the context ({n_ctx})",
                              "raise --ctx or lower --filler-tokens")
                    if cfg.window_cells:
                        check_in_tail(placements, cfg.window_cells, "(--kv-window-cells)", cfg.n_predict)
                else:
                    plan = p
                    if not p or not p.get("split"):
                        why = (p or {}).get("reason", "this build reports no residency plan")
                        abort(f"the candidate's cache was not split ({why}): there is no tail to retrieve from",
                              "give --kv-window-cells N smaller than the prompt (or a --vram-target that forces a window)")
                    if p.get("mode_chosen") != "head":  # a head split streams its host heads of every position
                        check_in_tail(placements, int(p.get("window_cells") or 0), f"(the candidate's plan: {p.get('reason')})",
                                      cfg.n_predict)
                progress.update(task, total=sum(pl.n_tokens + cfg.n_predict for pl in placements), completed=0)
                before = 0
                for pl in placements:
                    progress.update(task, stage=f"depth {pl.depth:g}: {pl.n_tokens}-token prompt")
                    ans = side.answer(pl.tokens, cfg.n_predict,
                                      on_progress=lambda n, b=before: progress.update(task, completed=b + n))
                    answers[role].append(ans)
                    before += pl.n_tokens + cfg.n_predict  # an answer that stops early still counts as its whole share
                    progress.update(task, completed=before)
                progress.update(task, stage="done")
                sides[role] = {"command": srv.command, "log": str(log_path), "load_s": round(load_s, 2), "plan": p}
            finally:
                srv.stop()

    results = []
    # where the tail begins: a window's end, or 0 for a head split (its host heads of every position are streamed)
    tail_from = 0 if (plan or {}).get("mode_chosen") == "head" else (plan or {}).get("window_cells")
    for pl, ra, ca in zip(placements, answers["reference"], answers["candidate"]):
        v = placement_verdict(ra, ca, pl.number, cfg.match)
        results.append({**placement_dict(pl, tail_from), "verdict": v,
                        "tail_positions": tail_positions(pl.n_tokens, len(ca.tokens), tail_from),
                        "reference_retrieved": retrieved(ra.text, pl.number),
                        "candidate_retrieved": retrieved(ca.text, pl.number),
                        "identical": ra.tokens == ca.tokens, "first_difference": first_difference(ra.tokens, ca.tokens),
                        "reference": asdict(ra), "candidate": asdict(ca)})
    verdict = overall_verdict([r["verdict"] for r in results])
    n_tail = sum(r["tail_positions"] for r in results)
    if n_tail == 0:
        verdict = "fail"  # nothing read the tail: identical answers prove nothing (check_in_tail refuses this up front)
    return {
        "gate": "needle",
        "verdict": verdict,
        "passed": verdict == "pass",
        "match": cfg.match,
        "model": str(cfg.model),
        "format": cfg.fmt,
        "seed": cfg.seed,
        "filler": {"tokens_requested": cfg.filler_tokens, "file": str(cfg.filler_file) if cfg.filler_file else None},
        "n_ctx": n_ctx,
        "n_predict": cfg.n_predict,
        "cache_types": {"k": cfg.ctk, "v": cfg.ctv, "k_tail": cfg.ctkt or cfg.ctk, "v_tail": cfg.ctvt or cfg.ctv},
        "candidate_residency": cand_res,
        "plan": plan,
        "tail_positions": n_tail,
        "placements": results,
        "servers": sides,
        "build": cfg.build.describe(),
        "wall_s": round(time.time() - t_start, 2),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def print_report(console, r: dict) -> None:
    from rich.table import Table

    from rollingkv_cli.console import esc

    plan = r.get("plan") or {}
    split = (f"head split, {(plan.get('heads') or {}).get('summary', '?')}" if plan.get("mode_chosen") == "head" else
             f"window {plan.get('window_cells', '?')} + tail {plan.get('tail_cells', '?')} cells")
    t = Table(title=f"needle gate: {split}, {r['format']} prompt", title_justify="left")
    for col, just in (("depth", "right"), ("prompt", "right"), ("needle at", "right"), ("number", "left"),
                      ("reference answer", "left"), ("candidate", "left"), ("", "center")):
        t.add_column(col, justify=just)
    for p in r["placements"]:
        ref_text = p["reference"]["text"].strip().replace("\n", "⏎")[:40]
        if p["identical"]:
            cand = "identical tokens"
        else:
            cand = f"differs at token {p['first_difference']}: " + p["candidate"]["text"].strip().replace("\n", "⏎")[:30]
        mark = {"pass": "[green]✓[/]", "fail": "[bold red]✗[/]", "inconclusive": "[yellow]?[/]"}[p["verdict"]]
        t.add_row(f"{p['depth']:g}", str(p["n_tokens"]), f"{p['needle_start']}–{p['needle_end'] - 1}", p["number"],
                  ("" if p["reference_retrieved"] else "[yellow](not retrieved)[/] ") + esc(ref_text), esc(cand), mark)  # model text
    console.print(t)
    if r.get("tail_positions") is not None:
        console.print(f"[dim]positions that read the tail: {r['tail_positions']} (over {len(r['placements'])} placements, window "
                      f"{plan.get('window_cells', '?')} cells)[/]")
