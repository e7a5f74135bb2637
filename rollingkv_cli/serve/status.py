"""What the running server says: a /metrics page parsed (for others' reads: serve itself never reads /metrics, see
LiveStatus), the plan it chose (in words, for the start-up lines and the gates), the slots at work, and the live status
line serve shows while it runs."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from rollingkv_cli.console import esc


def parse_metrics(text: str) -> dict[str, float]:
    """The unlabeled llamacpp:NAME VALUE lines of a /metrics page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^llamacpp:(\w+)\s+([-+0-9.eE]+|nan|inf)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def residency_line(text: str) -> str | None:
    """residency_from_stats of a /metrics page's llamacpp:rolling_kv_* lines (the same figures as /props'
    rolling_kv_stats); None when not split."""
    slots: dict[int, dict[str, int]] = {}
    for line in text.splitlines():
        m = re.match(r'^llamacpp:rolling_kv_slot_(device|tail|window)_cells\{slot="(\d+)"\}\s+([0-9.eE+]+)$', line)
        if m:
            slots.setdefault(int(m.group(2)), {"stream": int(m.group(2))})[f"{m.group(1)}_cells"] = int(float(m.group(3)))
    flat = {k: v for k, v in parse_metrics(text).items() if k.startswith("rolling_kv_")}
    if not slots and not flat:
        return None
    return residency_from_stats({
        "split": True, "slots": list(slots.values()),
        "last": {k: flat.get(f"rolling_kv_last_{k}", 0) for k in ("tail_bytes", "occupied_bytes", "streamed_bytes")},
        "moves": {k: flat.get(f"rolling_kv_{k}_total", 0) for k in ("promoted_cells", "demoted_cells")},
    })


def residency_from_stats(stats: dict | None) -> str | None:
    """The split cache's live figures from rolling_kv_stats (GET /props; reading it resets nothing): each slot's cells on
    the device and in host memory (and its window, when elastic windows moved it off the static one), the tail the last
    step attended against what its streams occupy, and the cells elastic windows moved so far; None when not split."""
    if not isinstance(stats, dict) or not stats.get("split"):
        return None
    slots = {int(d.get("stream", i)): d for i, d in enumerate(stats.get("slots") or []) if isinstance(d, dict)}
    windows = {d.get("window_cells") for d in slots.values() if "window_cells" in d}
    moved = len(windows) > 1  # elastic windows that followed the load: each slot's window says where its cells are

    def slot(i: int, d: dict) -> str:
        return (f"{i}: {int(d.get('device_cells', 0))}+{int(d.get('tail_cells', 0))}"
                + (f" (window {int(d['window_cells'])})" if moved and "window_cells" in d else ""))

    cells = ", ".join(slot(i, d) for i, d in sorted(slots.items()) if d.get("device_cells") or d.get("tail_cells"))
    seqs = [d for d in stats.get("seqs") or [] if isinstance(d, dict) and "seq" in d]
    if len(slots) <= 1 and seqs:  # one unified cache (llama-server's default): each slot's sequence in it
        cells = ", ".join(f"{int(d['seq'])}: {int(d.get('device_cells', 0))}+{int(d.get('tail_cells', 0))}" for d in seqs)
    mib = 1024 * 1024
    last = stats.get("last") if isinstance(stats.get("last"), dict) else {}
    moves = stats.get("moves") if isinstance(stats.get("moves"), dict) else {}
    runs = int(last.get("tail_runs") or 0)
    text = (f"last step attended {(last.get('tail_bytes') or 0) / mib:.0f} MiB of tail"
            + (f" in {runs} run{'s' if runs > 1 else ''} of its sequences' blocks" if runs else "")
            + f" ({(last.get('occupied_bytes') or 0) / mib:.0f} MiB occupied, {(last.get('streamed_bytes') or 0) / mib:.0f} MiB streamed")
    plan = stats.get("plan_streamed") if isinstance(stats.get("plan_streamed"), dict) else None
    if plan and plan.get("last_bytes") is not None:  # a GPU build: what the copy plan itself issued
        text += f", {(plan.get('last_bytes') or 0) / mib:.0f} MiB issued by the copy plan"
    text += ")"
    promoted, demoted = moves.get("promoted_cells") or 0, moves.get("demoted_cells") or 0
    moved_text = ""
    if (promoted or demoted) and stats.get("windows") == "blocks":  # a unified cache's 256-cell blocks
        moved_text = f"; blocks moved {int(promoted) // 256} to the device, {int(demoted) // 256} to the tail"
    elif promoted or demoted:
        moved_text = f"; windows moved {int(promoted)} cells to the device, {int(demoted)} to the tail"
    return f"slot cells device+tail {cells or 'none in use'}; {text}{moved_text}"


def describe_steps(stats: dict | None) -> str | None:
    """Where the server's time went so far (rolling_kv_stats.evals, API 10: its batches, timed by the library): decode
    steps (every slot one token), prompt chunks beside decode tokens (mixed) and prompt chunks alone, each as a count and
    a mean; None before any (or from a library without them)."""
    ev = stats.get("evals") if isinstance(stats, dict) else None
    if not isinstance(ev, dict):
        return None
    parts = []
    for kind, label in (("decode", "decode"), ("mixed", "prompt beside decode"), ("prefill", "prompt alone")):
        k = ev.get(kind) if isinstance(ev.get(kind), dict) else {}
        n = int(k.get("evals") or 0)
        if n:
            ms = (k.get("ms") or 0.0) / n
            tail = (k.get("tail_bytes") or 0) / n / 1e9
            parts.append(f"{label} {n} x {ms:.1f} ms" + (f" ({tail:.2f} GB of tail each)" if tail else ""))
    return ", ".join(parts) or None


def vram_mib() -> list[tuple[int, int]]:
    try:
        import pynvml

        pynvml.nvmlInit()
        res = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i))
            res.append((mem.used // 2**20, mem.total // 2**20))
        return res
    except Exception:
        return []


def _plural(n, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def plan_reason(plan: dict, chosen: str) -> str:
    """The plan's reason without what the line around it says already: the mode's name in front ("window: explicit
    window of 256 cells" -> "explicit window of 256 cells"), a "...: resident (why)" tail (-> "...: why"), and with
    singulars where the count is 1 (the library writes "1 device KV heads")."""
    r = str(plan.get("reason") or "").strip()
    for prefix in {f"mode {chosen}: ", f"{chosen}: ", f"mode {plan.get('mode_requested')}: ", f"{plan.get('mode_requested')}: "}:
        if r.startswith(prefix):
            r = r[len(prefix):]
    r = re.sub(rf":\s*{re.escape(chosen)}\s*\((.*)\)$", r": \1", r)
    r = re.sub(rf"^{re.escape(chosen)}\s*\((.*)\)$", r"\1", r)
    if r == chosen or r == f"{chosen} cache":
        return ""
    return re.sub(r"\b1 (device KV head|KV head|thread|cell|layer)s\b", r"1 \1", r)


def describe_plan(plan: dict | None, gpu: bool = True) -> str:
    """One line: the mode chosen, why (once), the split, the bytes ("on device" / "on host" on a GPU build; a CPU build
    holds them all in host memory)."""
    if not plan:
        return "residency plan: not reported by this build"
    chosen = plan.get("mode_chosen") or plan.get("mode") or "?"
    head = f"residency: {chosen}"
    reason = plan_reason(plan, chosen)
    if reason:
        head += f" — {reason}"
    parts = [head]
    heads = plan.get("heads") if isinstance(plan.get("heads"), dict) else {}
    if chosen == "head" and heads.get("summary"):
        # the library's reason ends with the summary in brackets, which the next part says already
        parts[0] = parts[0].removesuffix(f" ({heads['summary']})")
        per_layer = heads.get("per_layer") or []
        shown = ",".join(str(h) for h in per_layer[:12]) + (",..." if len(per_layer) > 12 else "")
        parts.append(f"{heads['summary']} (per layer {shown})")
    elif plan.get("window_cells") is not None and plan.get("split", True):
        parts.append(f"window {plan.get('window_cells')} / tail {plan.get('tail_cells', 0)} cells")
    if gpu:
        for k, label in (("device_bytes", "on device"), ("host_bytes", "on host")):
            if plan.get(k) is not None:
                parts.append(f"{plan[k] / 2**20:.1f} MiB {label}")
    else:
        total = sum(plan.get(k) or 0 for k in ("device_bytes", "host_bytes"))
        if total:
            parts.append(f"{total / 2**20:.1f} MiB in host memory (CPU build)")
    return "; ".join(parts)


def describe_plan_details(plan: dict | None) -> list[str]:
    """The planner's budget terms, a hybrid model's layers (which split, the recurrent state whole), its link model and
    (split plans only) its CPU part of the tail, one line each (nothing for builds that do not report them)."""
    if not plan:
        return []
    lines = []
    budget = plan.get("budget")
    if isinstance(budget, dict) and budget.get("devices"):
        mib = lambda b: f"{(b or 0) / 2**20:.0f}"  # noqa: E731
        for d in budget["devices"]:
            head = (f"target {budget['vram_target_mib']} MiB" if budget.get("vram_target_mib")
                    else f"{_free_memory(d, mib)} - reserve {mib(budget.get('reserve_bytes'))} MiB")
            recr = f" (recurrent state {mib(d['recurrent_bytes'])})" if d.get("recurrent_bytes") else ""
            lines.append(f"budget on {d.get('name', '?')}: {head}; weights {mib(d.get('weights_bytes'))} + compute ~{mib(d.get('compute_bytes'))}"
                         f" + other KV {mib(d.get('other_kv_bytes'))}{recr} + streaming ring {mib(d.get('ring_bytes'))} MiB;"
                         f" whole KV {mib(d.get('kv_resident_bytes'))} MiB; minimum target {d.get('min_target_mib', '?')} MiB")
    recurrent = plan.get("recurrent")
    if isinstance(recurrent, dict):  # a hybrid model: only its attention layers' cache may split
        layers = recurrent.get("layers") or []
        attn = [layer.get("il") for layer in plan.get("layers") or []]
        lines.append(f"hybrid model: the attention layers' cache ({len(attn)} layers) {'splits' if plan.get('split') else 'stays whole'}; "
                     f"the recurrent state ({len(layers)} layers, {(recurrent.get('bytes') or 0) / 2**20:.1f} MiB) stays whole")
    link = plan.get("link") or {}
    est = plan.get("estimate") or {}
    if est.get("ms_per_token") is not None:
        # the link's source last, after a dash: it has brackets of its own ("host memory bandwidth (the tail is ...)")
        lines.append(f"expected {est['ms_per_token']:.2f} ms/token at full context: {est['t_resident_ms']:.2f} ms resident"
                     f" ({link.get('mem_bw_gbps', 0):.0f} GB/s measured) + {est['t_tail_ms']:.2f} ms tail"
                     f" at {link.get('link_bw_gbps', 0):.1f} GB/s — {link.get('link_bw_source', '?')}")
    elif plan.get("split") and link:
        lines.append(f"no ms/token estimate: memory bandwidth {link.get('mem_bw_gbps')} GB/s, link {link.get('link_bw_gbps')} GB/s"
                     f" — {link.get('link_bw_source', '?')}")
    auto = plan.get("auto")
    if isinstance(auto, dict) and auto.get("reason"):  # auto weighed the window against the head split
        lines.append(auto["reason"])
    line = describe_tail_types(plan)
    if line:
        lines.append(line)
    line = describe_tail_cpu(plan) if plan.get("split") else None  # the CPU part only where the tail is split
    if line:
        lines.append(line)
    return lines


def _free_memory(d: dict, mib) -> str:
    """A budgeted device's free memory as a phrase. Host memory (a CPU build's device): the kernel's MemAvailable, named so,
    read now: ggml's CPU device reports MemTotal as its free memory (24105 MiB where 21927 were available)."""
    if d.get("host_memory"):
        from rollingkv_cli.hw.hostinfo import mem_available_bytes

        avail = mem_available_bytes()
        if avail is not None:
            return f"MemAvailable {mib(avail)} MiB"
        return f"MemTotal {mib(d.get('free_bytes'))} MiB (MemAvailable unknown)"
    return f"free {mib(d.get('free_bytes'))} MiB"


def describe_tail_types(plan: dict | None) -> str | None:
    """The tail types the planner chose for auto (-ctkt/-ctvt auto) and why; None when no axis was auto or the build does
    not report it."""
    tt = (plan or {}).get("tail_types")
    if not isinstance(tt, dict) or not tt.get("auto"):
        return None
    asked = "/".join(str(tt.get(k) or "=") for k in ("requested_k", "requested_v"))
    return f"tail types (asked {asked}): K {tt.get('k')}, V {tt.get('v')} — {tt.get('reason') or '?'}"


def describe_tail_cpu(plan: dict | None) -> str | None:
    """The hybrid tail's split from the plan's tail_cpu (None for builds that do not report one)."""
    tc = (plan or {}).get("tail_cpu")
    if not isinstance(tc, dict):
        return None
    frac = tc.get("frac") or 0
    req = tc.get("requested")
    head = (f"CPU part of the tail: {frac * 100:.0f}% of each split layer's host tail attended on the CPU" if frac
            else "CPU part of the tail: none")
    parts = [f"requested {req}" if req is not None else None]
    if tc.get("cpu_attn_gbps") is not None:  # its source last: it has commas and brackets of its own
        parts.append(f"CPU attention {tc['cpu_attn_gbps']:.3g} GB/s")
    if tc.get("n_threads"):
        parts.append(_plural(tc["n_threads"], "thread"))
    hybrid = ((plan or {}).get("link") or {}).get("t_token_hybrid_ms")
    if hybrid is None:
        hybrid = ((plan or {}).get("estimate") or {}).get("t_token_hybrid_ms")
    if isinstance(hybrid, (int, float)):
        parts.append(f"expected {hybrid:.2f} ms/token with it")
    text = head + " (" + ", ".join(p for p in parts if p) + ")"
    text += f": {tc['reason']}" if tc.get("reason") else ""
    if tc.get("cpu_attn_gbps") is not None and tc.get("cpu_attn_source"):
        text += f"; CPU attention {tc['cpu_attn_source']}"
    return text


def _slots(srv) -> list[dict] | None:
    """llama-server's /slots (each slot's task: its prompt tokens processed and tokens generated so far, kept after it
    ends until the slot's next task), None where it does not answer (`--no-slots`)."""
    data = _get_json(srv, "/slots")
    return data if isinstance(data, list) else None


def _props(srv) -> dict:
    """/props (its rolling_kv_stats is a snapshot), {} where it does not answer."""
    data = _get_json(srv, "/props")
    return data if isinstance(data, dict) else {}


def _dict_or_none(value) -> dict | None:
    return value if isinstance(value, dict) else None


def describe_sharing(sharing: dict | None) -> str | None:
    """/props' rolling_kv_prefix_sharing: how many prompt tokens requests took from other slots' cells (--kv-share-prefix)
    instead of prefilling and storing them again; None where sharing is off (0, or a cache that is not unified)."""
    if not sharing or not sharing.get("min_tokens"):
        return None
    tasks, tokens = int(sharing.get("tasks") or 0), int(sharing.get("tokens") or 0)
    return (f"{tokens} prompt tokens taken from other slots by {_plural(tasks, 'request')} "
            f"(prefixes of at least {int(sharing['min_tokens'])} tokens)")


def _get_json(srv, path: str):
    import json

    try:
        with urllib.request.urlopen(srv.http_request(path), timeout=2) as r:
            return json.loads(r.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _slot_task(slot: dict) -> tuple[int, int, int] | None:
    """(task id, tokens generated, prompt tokens processed) of the slot's running task; None when it runs none (a slot
    clears its counts when its task ends)."""
    if not isinstance(slot, dict) or not slot.get("is_processing") or not isinstance(slot.get("id_task"), int):
        return None
    nt = slot.get("next_token")
    gen = nt[0].get("n_decoded") if isinstance(nt, list) and nt and isinstance(nt[0], dict) else 0
    return slot["id_task"], int(gen or 0), int(slot.get("n_prompt_tokens_processed") or 0)


_TIMING = re.compile(r"print_timing: id +\d+ \| task (\d+) \| +(prompt eval|eval) time = +[0-9.]+ ms / +(\d+) tokens")


class TaskLog:
    """The requests that ended, from llama-server's own log (its `print_timing` lines: the prompt tokens each processed
    and the tokens it generated, exact), read on from where the last read stopped. Reading a file of ours resets
    nothing, unlike /metrics."""

    def __init__(self, path: Path | None):
        self.path, self.offset, self.partial = path, 0, b""

    def read(self) -> dict[int, list[int]]:
        """{task id: [prompt tokens, tokens generated]} of the lines written since the last read."""
        out: dict[int, list[int]] = {}
        if self.path is None:
            return out
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(16 << 20)
        except OSError:
            return out
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()  # a line still being written
        for line in lines:
            m = _TIMING.search(line.decode(errors="replace"))
            if m:
                out.setdefault(int(m.group(1)), [0, 0])[0 if m.group(2) == "prompt eval" else 1] = int(m.group(3))
        return out


FETCH = object()  # LiveStatus.sample: read it from the server


class LiveStatus:
    """What serve's live status shows, sampled about once a second: rows() is a list of (label, text), one function per
    row (rows_* below), so that more rows (e.g. per-slot residency counters) are one more entry in ROWS.

    It reads only what changes nothing for other readers: /slots (the running requests' tokens so far), llama-server's
    log (each ended request's tokens: TaskLog) and, for a split cache, /props' rolling_kv_stats. Never /metrics:
    llama-server resets its per-interval gauges (predicted_tokens_seconds, prompt_tokens_seconds) on every read of it,
    so a poll of ours would show an outside scraper 0 (issue 39). The totals and rates are serve's own; a request whose
    end the log does not show (a log level that hides it) counts with the tokens a sample last saw. The rates are over
    the last WINDOW_S seconds."""

    WINDOW_S = 5.0
    GRACE_S = 5.0  # how long an ended request's line may take to reach the log before the last sample's count stands
    ROWS = ("uptime", "requests", "decode", "prompt", "vram", "kv", "kv_now", "steps", "shared")

    def __init__(self, srv, started: float, plan: dict | None, gpu: bool = True, vram=None):
        from collections import deque

        self.srv, self.started, self.plan, self.gpu = srv, started, plan, gpu
        self.vram = vram_mib if vram is None else vram
        self.log = TaskLog(getattr(srv, "log_path", None))
        self.slots: list[dict] | None = None
        self.stats: dict | None = None
        self.sharing: dict | None = None  # /props' rolling_kv_prefix_sharing
        self.running: dict[int, list] = {}  # task id -> [prompt, generated, last seen running at]: the largest seen
        self.guessed: dict[int, list[int]] = {}  # ended tasks counted with what a sample saw (the log had not said)
        self.done_gen = self.done_prompt = 0  # the requests that ended
        self.history: deque = deque()  # (time, tokens generated, prompt tokens read) over the last WINDOW_S seconds

    def sample(self, now: float | None = None, slots=FETCH, stats=FETCH, ended=FETCH, sharing=FETCH) -> None:
        """One sample: /slots, the log's ended requests, /props' rolling_kv_stats and rolling_kv_prefix_sharing (each
        given instead by the tests; None where the server did not answer)."""
        now = time.monotonic() if now is None else now
        self.slots = _slots(self.srv) if slots is FETCH else slots
        split = bool(self.plan and self.plan.get("split"))
        props = _props(self.srv) if FETCH in (stats, sharing) else {}
        self.stats = (_dict_or_none(props.get("rolling_kv_stats")) if split else None) if stats is FETCH else stats
        self.sharing = _dict_or_none(props.get("rolling_kv_prefix_sharing")) if sharing is FETCH else sharing
        for slot in self.slots or []:
            task = _slot_task(slot)
            if task is not None and task[0] not in self.guessed:
                seen = self.running.setdefault(task[0], [0, 0, now])
                seen[:] = [max(seen[0], task[2]), max(seen[1], task[1]), now]
        for task_id, (prompt, gen) in (self.log.read() if ended is FETCH else ended or {}).items():  # after /slots: never early
            counted = self.running.pop(task_id, None) or self.guessed.pop(task_id, None)
            if counted is not None and len(counted) == 2:  # counted already with what a sample saw: the log's instead
                prompt, gen = prompt - counted[0], gen - counted[1]
            self.done_prompt += prompt
            self.done_gen += gen
        if self.slots is not None:  # /slots answered (it does not during a long prefill: nothing is known then)
            for task_id, (prompt, gen, last) in list(self.running.items()):
                if now - last > self.GRACE_S:  # it ended a while ago and the log did not say: what a sample saw
                    del self.running[task_id]
                    self.guessed[task_id] = [prompt, gen]
                    while len(self.guessed) > 1024:
                        del self.guessed[next(iter(self.guessed))]
                    self.done_prompt += prompt
                    self.done_gen += gen
        self.history.append((now, self.tokens_generated(), self.prompt_tokens()))
        while len(self.history) > 2 and now - self.history[1][0] >= self.WINDOW_S:
            self.history.popleft()

    def tokens_generated(self) -> int:
        return self.done_gen + sum(t[1] for t in self.running.values())

    def prompt_tokens(self) -> int:
        return self.done_prompt + sum(t[0] for t in self.running.values())

    def _rate(self, k: int) -> float | None:
        if len(self.history) < 2:
            return None
        first, last = self.history[0], self.history[-1]
        return max(0.0, (last[k] - first[k]) / (last[0] - first[0])) if last[0] > first[0] else None

    def decode_rate(self) -> float | None:
        """Tokens generated per second over the window; None before two samples."""
        return self._rate(1)

    def prompt_rate(self) -> float | None:
        """Prompt tokens read per second over the window; None before two samples."""
        return self._rate(2)

    def in_flight(self) -> int:
        return sum(1 for slot in self.slots or [] if isinstance(slot, dict) and slot.get("is_processing"))

    def rows_uptime(self):
        return [("uptime", f"{time.time() - self.started:.0f} s")]

    def rows_requests(self):
        slots = f" of {_plural(len(self.slots), 'slot')}" if self.slots is not None else " (/slots does not answer)"
        return [("requests", f"{self.in_flight()} in flight{slots}")]

    def rows_decode(self):
        rate = self.decode_rate()
        shown = "…" if rate is None else f"{rate:.1f}"
        return [("decode", f"{shown} tok/s over the last {self.WINDOW_S:g} s, {self.tokens_generated()} tokens generated")]

    def rows_prompt(self):
        rate = self.prompt_rate()
        shown = "…" if rate is None else f"{rate:.1f}"
        return [("prompt", f"{shown} tok/s over the last {self.WINDOW_S:g} s, {self.prompt_tokens()} tokens read")]

    def rows_vram(self):
        vram = self.vram()
        return [("VRAM", ", ".join(f"GPU{i} {u}/{tot} MiB" for i, (u, tot) in enumerate(vram)))] if vram else []

    def rows_kv(self):
        return [("KV", describe_plan(self.plan, gpu=self.gpu))]

    def rows_kv_now(self):
        live = residency_from_stats(self.stats) if self.plan and self.plan.get("split") else None
        return [("KV now", live)] if live else []

    def rows_steps(self):
        steps = describe_steps(self.stats)
        return [("steps", steps)] if steps else []

    def rows_shared(self):
        shared = describe_sharing(self.sharing)
        return [("shared", shared)] if shared else []

    def rows(self) -> list[tuple[str, str]]:
        return [row for name in self.ROWS for row in getattr(self, f"rows_{name}")()]

    def table(self):
        from rich.table import Table

        t = Table(show_header=False, box=None, title=f"llama-server {esc(self.srv.url)}", title_justify="left")
        t.add_column(style="bold")
        t.add_column()
        for label, value in self.rows():
            t.add_row(esc(label), esc(value))
        return t

    def line(self) -> str:
        """The plain status line (not a terminal)."""
        rate = self.decode_rate()
        return (f"in flight {self.in_flight()}, generated {self.tokens_generated()} tokens"
                + ("" if rate is None else f", {rate:.1f} tok/s over the last {self.WINDOW_S:g} s"))
