"""What the running server says: its metrics, the plan it chose (in words, for the start-up lines and the gates), the slots
at work, and the live status line serve shows while it runs."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request

from rollingkv_cli.console import esc


def _metrics_text(srv) -> str:
    """llama-server's /metrics page ("" where it does not answer)."""
    try:
        with urllib.request.urlopen(srv.http_request("/metrics"), timeout=2) as r:
            return r.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return ""


def parse_metrics(text: str) -> dict[str, float]:
    """The unlabeled llamacpp:NAME VALUE lines of a /metrics page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^llamacpp:(\w+)\s+([-+0-9.eE]+|nan|inf)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _metrics(srv) -> dict[str, float]:
    return parse_metrics(_metrics_text(srv))


def residency_line(text: str) -> str | None:
    """The split cache's live figures from /metrics text (llamacpp:rolling_kv_*): each slot's cells on the device and
    in host memory (and its window, when elastic windows moved it off the static one), the tail the last step attended
    against what its streams occupy, and the cells elastic windows moved so far; None when not split."""
    slots: dict[int, dict[str, int]] = {}
    for line in text.splitlines():
        m = re.match(r'^llamacpp:rolling_kv_slot_(device|tail|window)_cells\{slot="(\d+)"\}\s+([0-9.eE+]+)$', line)
        if m:
            slots.setdefault(int(m.group(2)), {})[m.group(1)] = int(float(m.group(3)))
    flat = {k: v for k, v in parse_metrics(text).items() if k.startswith("rolling_kv_")}
    if not slots and not flat:
        return None
    windows = {d.get("window") for d in slots.values() if "window" in d}
    moved = len(windows) > 1  # elastic windows that followed the load: each slot's window says where its cells are

    def slot(i: int, d: dict) -> str:
        return f"{i}: {d.get('device', 0)}+{d.get('tail', 0)}" + (f" (window {d['window']})" if moved and "window" in d else "")

    cells = ", ".join(slot(i, d) for i, d in sorted(slots.items()) if d.get("device") or d.get("tail"))
    mib = 1024 * 1024
    last = (f"last step attended {flat.get('rolling_kv_last_tail_bytes', 0) / mib:.0f} MiB of tail "
            f"({flat.get('rolling_kv_last_occupied_bytes', 0) / mib:.0f} MiB occupied, "
            f"{flat.get('rolling_kv_last_streamed_bytes', 0) / mib:.0f} MiB streamed)")
    promoted, demoted = flat.get("rolling_kv_promoted_cells_total", 0), flat.get("rolling_kv_demoted_cells_total", 0)
    moves = f"; windows moved {int(promoted)} cells to the device, {int(demoted)} to the tail" if promoted or demoted else ""
    return f"slot cells device+tail {cells or 'none in use'}; {last}{moves}"


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
    """llama-server's /slots (each slot's tokens decoded so far), None where it does not answer (`--no-slots`)."""
    import json

    try:
        with urllib.request.urlopen(srv.http_request("/slots"), timeout=2) as r:
            data = json.loads(r.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return data if isinstance(data, list) else None


def _decoding_now(slots: list[dict] | None) -> int:
    """Tokens generated so far by the requests still running (llama-server counts a request's tokens in /metrics'
    tokens_predicted_total only when it ends)."""
    n = 0
    for slot in slots or []:
        nt = slot.get("next_token")
        if slot.get("is_processing") and isinstance(nt, list) and nt and isinstance(nt[0], dict):
            n += int(nt[0].get("n_decoded") or 0)
    return n


class LiveStatus:
    """What serve's live status shows, sampled about once a second: rows() is a list of (label, text), one function per
    row (rows_* below), so that more rows (e.g. per-slot residency counters) are one more entry in ROWS.

    The decode rate is the tokens generated over the last WINDOW_S seconds: /metrics' tokens_predicted_total (finished
    requests) plus the running requests' tokens so far (/slots). llama-server's own predicted_tokens_seconds is a mean
    over the requests that ended since its last poll: 0.0 while two requests decode."""

    WINDOW_S = 5.0
    ROWS = ("uptime", "requests", "decode", "prompt", "vram", "kv", "kv_now")

    def __init__(self, srv, started: float, plan: dict | None, gpu: bool = True, vram=None):
        from collections import deque

        self.srv, self.started, self.plan, self.gpu = srv, started, plan, gpu
        self.vram = vram_mib if vram is None else vram
        self.metrics: dict[str, float] = {}
        self.metrics_text = ""
        self.slots: list[dict] | None = None
        self.history: deque = deque()  # (time, tokens generated in all) over the last WINDOW_S seconds

    def sample(self, now: float | None = None, metrics: dict | None = None, slots: list[dict] | None = None) -> None:
        now = time.monotonic() if now is None else now
        # one /metrics read a sample: its counters, and its text for the split cache's per-slot lines
        self.metrics_text = _metrics_text(self.srv) if metrics is None else ""
        self.metrics = parse_metrics(self.metrics_text) if metrics is None else metrics
        self.slots = _slots(self.srv) if slots is None else slots
        self.history.append((now, self.tokens_generated()))
        while len(self.history) > 2 and now - self.history[1][0] >= self.WINDOW_S:
            self.history.popleft()

    def tokens_generated(self) -> int:
        return int(self.metrics.get("tokens_predicted_total", 0)) + _decoding_now(self.slots)

    def decode_rate(self) -> float | None:
        """Tokens per second over the window; None before two samples."""
        if len(self.history) < 2:
            return None
        (t0, n0), (t1, n1) = self.history[0], self.history[-1]
        return max(0.0, (n1 - n0) / (t1 - t0)) if t1 > t0 else None

    def in_flight(self) -> int:
        return int(self.metrics.get("requests_processing", 0))

    def rows_uptime(self):
        return [("uptime", f"{time.time() - self.started:.0f} s")]

    def rows_requests(self):
        return [("requests", f"{self.in_flight()} in flight, {self.metrics.get('requests_deferred', 0):.0f} waiting")]

    def rows_decode(self):
        rate = self.decode_rate()
        shown = "…" if rate is None else f"{rate:.1f}"
        return [("decode", f"{shown} tok/s over the last {self.WINDOW_S:g} s, {self.tokens_generated()} tokens generated")]

    def rows_prompt(self):
        m = self.metrics
        return [("prompt", f"{m.get('prompt_tokens_total', 0):.0f} tokens read, {m.get('prompt_tokens_seconds', 0):.1f} tok/s "
                           "(llama-server's mean of the requests ended)")]

    def rows_vram(self):
        vram = self.vram()
        return [("VRAM", ", ".join(f"GPU{i} {u}/{tot} MiB" for i, (u, tot) in enumerate(vram)))] if vram else []

    def rows_kv(self):
        return [("KV", describe_plan(self.plan, gpu=self.gpu))]

    def rows_kv_now(self):
        live = residency_line(self.metrics_text) if self.plan and self.plan.get("split") else None
        return [("KV now", live)] if live else []

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


