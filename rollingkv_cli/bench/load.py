"""`rollingkv bench load`: a server under a mixed load. Real llama-server processes (loopback only), one per cell (the
split cache, the same with one op over all streams, the resident cache, vanilla -ngl at the split's VRAM), each given
the same schedule of requests from concurrent clients; per request the decode speed and the time to first token, per
cell the tail bytes each step attended against the tail bytes its streams occupied (the server's rolling_kv_stats),
peak VRAM (NVML) and peak host memory."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rollingkv_cli.bench import load_time

SCHEMA = "rollingkv-bench-load/1"
MIB = 1024 * 1024


@dataclass(frozen=True)
class Req:
    name: str        # "long", "short-1", ...
    kind: str        # "long" or "short" (what a target compares)
    phase: str       # the part of the schedule it belongs to
    prompt: int      # prompt tokens
    gen: int         # tokens generated (ignore_eos: exactly this many)
    seed: int
    at_s: float = 0.0  # a stage of arrivals: when it starts, seconds after the stage's start
    prefix: int = 0    # of the prompt, tokens of a document other requests share (drawn from prefix_seed)
    prefix_seed: int = 0


@dataclass
class Stage:
    """Requests started together (after `delay_s`, or once the request named `after_first_token` streams its first
    token); the stage ends when all of its requests are done."""

    name: str
    reqs: list[Req]
    after_first_token: str | None = None  # a request of the same stage started first
    arrivals: bool = False                # each request starts at its own at_s (a random-arrival mix)
    # erase every slot's cached prompt when the stage ends (POST /slots/N?action=erase): the next stage starts on an
    # empty cache, its cells from the first one (the window's, in a split cache) and nothing of this stage stored beside
    clear_after: bool = False


@dataclass
class Mix:
    name: str
    n_slots: int
    ctx_per_slot: int
    stages: list[Stage] = field(default_factory=list)
    seed: int | None = None  # what drew a random mix (the report keeps it: the same seed, the same schedule)

    def to_json(self) -> dict:
        return {"name": self.name, "n_slots": self.n_slots, "ctx_per_slot": self.ctx_per_slot, "seed": self.seed,
                "stages": [{"name": s.name, "after_first_token": s.after_first_token, "arrivals": s.arrivals,
                            "clear_after": s.clear_after, "requests": [r.__dict__ for r in s.reqs]} for s in self.stages]}


def table_mix(long_prompt: int, long_gen: int, short_prompt: int, short_gen: int, n_short: int, n_slots: int,
              ctx_per_slot: int) -> Mix:
    """The issue's mix: the long request alone, the short ones alone, then the short ones beside the long one (started
    once it decodes; they generate long_gen tokens more, so that they outlive it: their tokens before its end are
    "beside", those from the third after it "after long", where a split promotes them), then short ones again after it
    ended."""
    def shorts(phase: str, seed0: int, gen: int) -> list[Req]:
        return [Req(f"short-{i + 1}", "short", phase, short_prompt, gen, seed0 + i) for i in range(n_short)]

    long = Req("long", "long", "beside", long_prompt, long_gen, 100)
    return Mix("table", n_slots, ctx_per_slot, [
        Stage("long alone", [Req("long", "long", "long alone", long_prompt, long_gen, 100)]),
        Stage("short alone", shorts("short alone", 1, short_gen)),
        Stage("beside", [long, *shorts("beside", 11, short_gen + long_gen)], after_first_token="long"),
        Stage("after", shorts("after", 21, short_gen)),
    ])


def ramp_mix(levels: list[int], prompt: int, gen: int, n_slots: int, ctx_per_slot: int, seed: int = 0) -> Mix:
    """Clients 1 -> max -> 1: a stage per level, that many requests at once (prompt and gen drawn +-25% around the
    given sizes)."""
    rng = random.Random(seed)
    stages = []
    for i, k in enumerate(levels):
        reqs = [Req(f"c{i}-{j}", "client", f"{k} clients", max(16, int(prompt * rng.uniform(0.75, 1.25))),
                    max(4, int(gen * rng.uniform(0.75, 1.25))), 1000 * i + j) for j in range(k)]
        stages.append(Stage(f"{k} clients", reqs))
    return Mix("ramp", n_slots, ctx_per_slot, stages)


def random_mix(n_req: int, mean_gap_s: float, prompt_range: tuple[int, int], gen_range: tuple[int, int], n_slots: int,
               ctx_per_slot: int, seed: int) -> Mix:
    """Requests arriving at random (a Poisson process: exponential gaps of mean mean_gap_s), prompts and generated
    lengths uniform in their ranges, all drawn from `seed`; a request whose slot is busy waits in the server's queue,
    as a real client's would."""
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for i in range(n_req):
        if i:
            t += rng.expovariate(1.0 / mean_gap_s)
        reqs.append(Req(f"r{i:02d}", "client", "random", rng.randint(*prompt_range), rng.randint(*gen_range), 5000 + i,
                        at_s=round(t, 3)))
    return Mix("random", n_slots, ctx_per_slot, [Stage("random arrivals", reqs, arrivals=True)], seed=seed)


def shared_mix(n_clients: int, prefix: int, suffix: int, gen: int, n_slots: int, ctx_per_slot: int) -> Mix:
    """Many users, one long document: one client alone on another document of the same size (the pace a client has by
    itself; the slots are erased after it), then the first client on the shared document and, once it streams its first
    token (it is decoding), the others on the same document with their own questions (each prompt: the document, then
    its suffix)."""
    def client(name: str, kind: str, phase: str, seed: int, doc_seed: int) -> Req:
        return Req(name, kind, phase, prefix + suffix, gen, seed, prefix=prefix, prefix_seed=doc_seed)

    clients = [client(f"c{i + 1}", "first" if i == 0 else "sharer", "shared", 7100 + i, 7000) for i in range(n_clients)]
    return Mix("shared", n_slots, ctx_per_slot, [
        Stage("alone", [client("alone", "alone", "alone", 7099, 7001)], clear_after=True),
        Stage("shared", clients, after_first_token="c1"),
    ])


# ------------------------------------------------------------------------------------------ one request


def prompt_tokens(url: str, n: int, seed: int) -> list[int]:
    """n tokens of deterministic text, as the server's tokenizer cuts them."""
    from rollingkv_cli.lib.text import synthetic_text

    text = synthetic_text(n * 6 + 64, seed=seed)
    req = urllib.request.Request(url + "/tokenize", data=json.dumps({"content": text}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        toks = json.loads(r.read())["tokens"]
    if len(toks) < n:
        raise RuntimeError(f"the tokenizer gave {len(toks)} tokens for {n} wanted")
    return toks[:n]


def request_tokens(url: str, r: Req, cache: dict | None = None) -> list[int]:
    """The request's prompt: a shared document, then its own text (r.prefix), or text of its own; each text tokenized
    once per cache."""
    cache = {} if cache is None else cache

    def text(n: int, seed: int) -> list[int]:
        if (n, seed) not in cache:
            cache[(n, seed)] = prompt_tokens(url, n, seed)
        return cache[(n, seed)]

    if r.prefix:
        return text(r.prefix, r.prefix_seed) + text(r.prompt - r.prefix, r.seed)
    return text(r.prompt, r.seed)


def run_request(url: str, r: Req, timeout: float, started: threading.Event | None = None,
                tokens: list[int] | None = None) -> dict:
    # cached prompts on where a document is shared (the server shares from them)
    toks = tokens if tokens is not None else request_tokens(url, r)
    payload = {"prompt": toks, "n_predict": r.gen, "ignore_eos": True, "temperature": 0, "seed": 0,
               "cache_prompt": bool(r.prefix)}
    t0 = time.monotonic()
    out = {"name": r.name, "kind": r.kind, "phase": r.phase, "prompt": r.prompt, "gen": r.gen, "t_start": t0}

    def on_first():
        if started is not None:
            started.set()

    try:
        # streamed: the time to the first token, and the event a stage waits on to start the others beside it
        data = json.dumps({**payload, "stream": True}).encode()
        req = urllib.request.Request(url + "/completion", data=data, headers={"Content-Type": "application/json"})
        first, final = None, {}
        token_t: list[float] = []  # when each streamed token arrived (monotonic)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                msg = json.loads(line[5:].strip())
                if msg.get("content") is not None and not msg.get("stop"):
                    token_t.append(time.monotonic())
                    if first is None:
                        first = time.monotonic() - t0
                        on_first()
                if msg.get("stop"):
                    final = msg
        tm = final.get("timings", {})
        out.update(status="ok", ttft_s=first, e2e_s=time.monotonic() - t0,
                   predicted_n=tm.get("predicted_n"), decode_tps=tm.get("predicted_per_second"),
                   prompt_ms=tm.get("prompt_ms"), prompt_n=tm.get("prompt_n"), shared_n=tm.get("shared_n", 0),
                   t_end=time.monotonic(), token_t=token_t,
                   slot=final.get("id_slot"))  # the server picks the slot: windows per slot are read by it
    except Exception as e:  # recorded, the run goes on
        out.update(status="error", error=f"{type(e).__name__}: {e}", t_end=time.monotonic())
        on_first()
    return out


# ------------------------------------------------------------------------------------------ one cell


class StatsPoller:
    """Samples the server's rolling_kv_stats (GET /props) until stopped."""

    def __init__(self, url: str, interval_s: float = 0.2):
        self.url, self.interval_s = url, interval_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True, name="rollingkv-load-stats")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(self.url + "/props", timeout=5) as r:
                    st = json.loads(r.read()).get("rolling_kv_stats")
                if isinstance(st, dict):
                    self.samples.append({"t": time.monotonic(), **st})
            except Exception:
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(timeout=10)


def clear_slots(url: str) -> int:
    """Erase every slot's cached prompt (the server runs with --slot-save-path); the tokens erased."""
    with urllib.request.urlopen(url + "/slots", timeout=30) as r:
        slots = json.loads(r.read())
    n = 0
    for sl in slots:
        req = urllib.request.Request(f"{url}/slots/{int(sl['id'])}?action=erase", data=b"{}",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            n += int(json.loads(r.read()).get("n_erased") or 0)
    return n


def run_schedule(url: str, mix: Mix, timeout: float, on_done=None, stage_times: dict | None = None) -> list[dict]:
    """Every stage's requests, in order; each stage's start and end (time.monotonic) into stage_times."""
    results: list[dict] = []
    for st in mix.stages:
        # every prompt of the stage tokenized before it starts: the server's tokenizer beside a decode being measured
        # slowed it (a 20000-token document for three clients took ~3 s of the host's cores on the H100 machine, the
        # first client's decode fell from 48 to 17 tok/s meanwhile, and the others arrived 3.3 s after its first token)
        cache: dict = {}
        tokens: dict[str, list[int] | None] = {}
        for r in st.reqs:
            try:
                tokens[r.name] = request_tokens(url, r, cache)
            except Exception:  # the request tokenizes again and records the failure itself
                tokens[r.name] = None
        t_stage = time.monotonic()
        threads: list[threading.Thread] = []
        got: list[dict] = []
        lock = threading.Lock()

        def go(r: Req, ev: threading.Event | None = None):
            res = run_request(url, r, timeout, ev, tokens.get(r.name))
            res["stage"] = st.name
            with lock:
                got.append(res)
            if on_done:
                on_done(res)

        first = [r for r in st.reqs if r.name == st.after_first_token]
        rest = [r for r in st.reqs if r.name != st.after_first_token]
        if st.arrivals:
            t0 = time.monotonic()
            for r in sorted(st.reqs, key=lambda q: q.at_s):
                time.sleep(max(0.0, t0 + r.at_s - time.monotonic()))
                t = threading.Thread(target=go, args=(r,), daemon=True)
                t.start()
                threads.append(t)
            rest = []
        if first:
            ev = threading.Event()
            t = threading.Thread(target=go, args=(first[0], ev), daemon=True)
            t.start()
            threads.append(t)
            ev.wait(timeout)
        for r in rest:
            t = threading.Thread(target=go, args=(r,), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(timeout)
        results.extend(got)
        if stage_times is not None:
            stage_times[st.name] = (t_stage, time.monotonic())
        if st.clear_after:
            clear_slots(url)
    return results


def host_peak_bytes(pid: int) -> int | None:
    """The process's peak resident memory (VmHWM), pinned host tails included once touched."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def summarize_stats(samples: list[dict], stage_times: dict | None = None) -> dict:
    """Totals at the end of the run and the worst sampled step: the tail bytes attended against the tail bytes the
    step's streams occupied, in blocks of 256 cells per layer and stream. With stage_times (name: (start, end)), also
    the stored cells' peak within each stage."""
    if not samples or not samples[-1].get("split"):
        return {"split": False}
    last = samples[-1]
    block = max(1, int(last.get("block_bytes") or 1))
    worst = worst_own = None
    for s in samples:
        lt = s.get("last") or {}
        if not lt.get("tail_bytes"):
            continue
        excess = (lt["tail_bytes"] - lt["occupied_bytes"]) / block / max(1, lt.get("streams", 1))
        if worst is None or excess > worst["excess_blocks_per_stream"]:
            worst = {"excess_blocks_per_stream": excess, **lt}
        if lt.get("own_bytes") is not None:  # API 11: beyond the ubatch's own sequences' cells (issue 35's bound)
            own = (lt["tail_bytes"] - lt["own_bytes"]) / block
            if worst_own is None or own > worst_own["beyond_own_blocks"]:
                worst_own = {"beyond_own_blocks": own, **lt}
    occ = last.get("occupied_bytes_total") or 0
    # the cells the split cache stores (each once, however many sequences read it) and the most a step streamed
    stored = [sum((sl.get("device_cells") or 0) + (sl.get("tail_cells") or 0) for sl in s.get("slots") or []) for s in samples]
    tail_cells = [sum(sl.get("tail_cells") or 0 for sl in s.get("slots") or []) for s in samples]
    streamed_step = [(s.get("last") or {}).get("streamed_bytes") or 0 for s in samples]
    # the windows each slot held over the run (elastic windows: they follow the load)
    windows = [[sl.get("window_cells") for sl in s.get("slots") or []] for s in samples]
    by_stage = {name: max((n for n, s in zip(stored, samples) if t0 <= s.get("t", t0 - 1) <= t1), default=0)
                for name, (t0, t1) in (stage_times or {}).items()}
    return {"split": True, "steps": last.get("steps"), "tail_bytes_total": last.get("tail_bytes_total"),
            "streamed_bytes_total": last.get("streamed_bytes_total"), "occupied_bytes_total": occ,
            "attended_over_occupied": (last.get("tail_bytes_total") or 0) / occ if occ else None,
            "block_bytes": block, "worst_step": worst, "worst_step_own": worst_own,
            "beyond_own_blocks_max": last["beyond_own_bytes_max"] / block if last.get("beyond_own_bytes_max") is not None else None,
            "n_samples": len(samples),
            "windows": last.get("windows"), "pool_cells": last.get("pool_cells"), "moves": last.get("moves"),
            "window_cells_max": [max((w[i] or 0 for w in windows if i < len(w)), default=0) for i in range(max(map(len, windows), default=0))],
            "slots_last": last.get("slots"), "stored_cells_peak": max(stored, default=0),
            "stored_cells_peak_by_stage": by_stage,
            "tail_cells_peak": max(tail_cells, default=0), "streamed_bytes_step_max": max(streamed_step, default=0),
            "streamed_bytes_step_mean": (last.get("streamed_bytes_total") or 0) / last["steps"] if last.get("steps") else None}


@dataclass
class Cell:
    name: str            # "split", "one-op", "resident", "vanilla", "default", "default-blocks", "default-resident"
    args: list[str]      # llama-server flags beyond the model, context and slots
    env: dict = field(default_factory=dict)
    what: str = ""
    slots_flag: bool = True  # pass -np (False: llama-server's default, 4 slots on one unified cache)


def run_cell(cell: Cell, binary: Path, model: Path, mix: Mix, log_dir: Path, timeout: float, gpu=None,
             extra: list[str] | None = None, on_done=None) -> dict:
    """Start the cell's llama-server, run the schedule, stop it; the cell's record."""
    import os

    from rollingkv_cli.serve.server import ServerProcess

    slots = ["-np", str(mix.n_slots)] if cell.slots_flag else []
    # a stage that clears the slots after it needs the slot actions, which llama-server offers with a save path
    save = []
    if any(st.clear_after for st in mix.stages):
        (log_dir / f"{cell.name}-slots").mkdir(parents=True, exist_ok=True)
        save = ["--slot-save-path", str(log_dir / f"{cell.name}-slots")]
    args = ["-m", str(model), "-c", str(mix.n_slots * mix.ctx_per_slot), *slots, "-fa", "on",
            "--no-webui", *save, *cell.args, *(extra or [])]
    rec: dict = {"name": cell.name, "what": cell.what, "args": args, "env": cell.env}
    from rollingkv_cli.gate.common import SCRATCH_SERVER_STOP_GRACE

    # stopped mid-prefill (Ctrl-C, SIGTERM), a cell's server finished its batch first: 2 s, then SIGKILL
    srv = ServerProcess(binary, args, log_path=log_dir / f"{cell.name}.log", env={**os.environ, **cell.env},
                        stop_grace=SCRATCH_SERVER_STOP_GRACE)
    sampler = None
    t0 = time.monotonic()
    try:
        srv.start()
        srv.wait_healthy(timeout=600)
        rec["plan"] = srv.request("/props").get("rolling_kv")
        if gpu is not None:
            from rollingkv_cli.gate import vram

            sampler = vram.NvmlSampler(gpu[0], gpu[1], {srv.proc.pid}).start()
        stage_times: dict = {}
        # the counters before the first request and after the last one (the poller's samples lie between)
        before = srv.request("/props").get("rolling_kv_stats") or {}
        with StatsPoller(srv.url) as poller:
            rec["requests"] = run_schedule(srv.url, mix, timeout, on_done, stage_times)
        after = srv.request("/props").get("rolling_kv_stats") or {}
        rec["host_peak_mib"] = (host_peak_bytes(srv.proc.pid) or 0) / MIB or None
        samples = [s for s in ({"t": t0, **before}, *poller.samples, {"t": time.monotonic(), **after}) if len(s) > 1]
        rec["stats"] = summarize_stats(samples, stage_times)
        rec["time"] = load_time.summarize_time(samples, sum(t1 - ts for ts, t1 in stage_times.values()))
        rec["status"] = "ok" if all(r.get("status") == "ok" for r in rec["requests"]) else "errors"
    except Exception as e:
        from rollingkv_cli.console import RollingKVError

        rec["status"] = "failed"
        if isinstance(e, RollingKVError):  # ours: its message and what to do, as the command would print them
            rec["error"] = e.message
            if e.hint:
                rec["hint"] = e.hint
        else:
            rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if sampler is not None:
            st = sampler.stop()
            rec["vram_peak_mib"] = st.peak_bytes / MIB if st.peak_bytes else None
        srv.stop()
    rec["seconds"] = time.monotonic() - t0
    reqs = rec.get("requests") or []
    rec["phases"] = phase_summary(reqs)
    rec["percentiles"] = request_percentiles(reqs)
    rec["aggregate_tps"] = aggregate_tps(reqs)
    rec["requests"] = strip_token_times(reqs)
    return rec


# ------------------------------------------------------------------------------------------ report


def rate(times: list[float]) -> float | None:
    """Tokens per second over consecutive token arrival times."""
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 and times[-1] > times[0] else None


SKIP_AFTER_END = 2  # tokens of a short request after the long one ended that the promotion may take (the issue: 2 steps)


def split_beside(requests: list[dict]) -> list[dict]:
    """A short request of the beside stage that outlived the long one decodes at two speeds: its tokens before the long
    one's last ("beside", its decode_tps here) and those from the third after it ("after long")."""
    long = next((r for r in requests if r.get("phase") == "beside" and r.get("kind") == "long" and r.get("status") == "ok"), None)
    if not long or not long.get("token_t"):
        return requests
    t_end = long["token_t"][-1]
    out = []
    for r in requests:
        if r.get("phase") == "beside" and r.get("kind") == "short" and r.get("status") == "ok" and r.get("token_t"):
            before = [t for t in r["token_t"] if t <= t_end]
            after = [t for t in r["token_t"] if t > t_end][SKIP_AFTER_END:]
            out.append({**r, "decode_tps": rate(before) or r.get("decode_tps")})
            if len(after) > 2:
                out.append({**r, "phase": "after long", "decode_tps": rate(after), "ttft_s": None})
            continue
        out.append(r)
    return out


def phase_summary(requests: list[dict]) -> dict:
    """Per (phase, kind): decode tok/s min/mean/max and the median time to first token."""
    out: dict[str, dict] = {}
    for r in split_beside(requests):
        key = f"{r['phase']}/{r['kind']}"
        d = out.setdefault(key, {"n": 0, "errors": 0, "tps": [], "ttft": []})
        d["n"] += 1
        if r.get("status") != "ok":
            d["errors"] += 1
            continue
        if r.get("decode_tps"):
            d["tps"].append(r["decode_tps"])
        if r.get("ttft_s") is not None:
            d["ttft"].append(r["ttft_s"])
    for d in out.values():
        tps, tt = d.pop("tps"), sorted(d.pop("ttft"))
        d["tps_min"] = min(tps) if tps else None
        d["tps_mean"] = sum(tps) / len(tps) if tps else None
        d["tps_max"] = max(tps) if tps else None
        d["ttft_p50_s"] = tt[len(tt) // 2] if tt else None
    return out


def percentile(xs: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of xs by linear interpolation between closest ranks; None for no values."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def request_percentiles(requests: list[dict]) -> dict:
    """Over the cell's finished requests: time to first token p50/p90 and each request's decode speed p10/p50 (its
    tokens after the first, from their arrival times)."""
    ok = [r for r in requests if r.get("status") == "ok"]
    ttft = [r.get("ttft_s") for r in ok]
    tps = [rate(r.get("token_t") or []) for r in ok]
    return {"n": len(ok), "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
            "decode_tps_p10": percentile(tps, 0.1), "decode_tps_p50": percentile(tps, 0.5)}


def strip_token_times(requests: list[dict]) -> list[dict]:
    """The report keeps per request what the summaries took from the token times, not the times themselves."""
    return [{k: v for k, v in r.items() if k != "token_t"} for r in requests]


def aggregate_tps(requests: list[dict]) -> float | None:
    """Tokens generated over the span from the first start to the last end."""
    ok = [r for r in requests if r.get("status") == "ok" and r.get("predicted_n")]
    if not ok:
        return None
    span = max(r["t_end"] for r in ok) - min(r["t_start"] for r in ok)
    return sum(r["predicted_n"] for r in ok) / span if span > 0 else None


def _get(cell: dict | None, key: str):
    return None if not cell else (cell.get("phases") or {}).get(key) or {}


def evaluate_targets(doc: dict) -> list[dict]:
    """The issue's targets on the table mix, from the cells of this run (None where a cell is missing)."""
    cells = {c["name"]: c for c in doc["cells"] if c.get("status") == "ok"}
    split = cells.get("split")
    out: list[dict] = []

    def add(name, value, op, thr, what):
        verdict = "n/a" if value is None else ("met" if (value >= thr if op == ">=" else value <= thr) else "missed")
        out.append({"target": name, "value": value, "op": op, "threshold": thr, "verdict": verdict, "what": what})

    def tps(cell, key, stat="tps_min"):
        v = _get(cell, key)
        return v.get(stat) if v else None

    if doc["mix"]["name"] == "table" and split:
        long_beside = tps(split, "beside/long", "tps_mean")
        short_beside = tps(split, "beside/short")
        long_alone = tps(split, "long alone/long", "tps_mean")
        add("short_beside_vs_long", short_beside / long_beside if short_beside and long_beside else None, ">=", 0.9,
            "slowest short request beside the long one / the long one's decode speed (split cell)")
        add("long_beside_vs_alone", long_beside / long_alone if long_beside and long_alone else None, ">=", 0.9,
            "the long request beside the short ones / alone (split cell)")
        one = cells.get("one-op")
        if one and short_beside:
            ref = tps(one, "beside/short")
            add("short_beside_vs_one_op", short_beside / ref if ref else None, ">=", 4.0,
                "slowest short request beside the long one: split / one op over all streams (the layout before)")
        van = cells.get("vanilla")
        if van:
            worst = None
            for key in ("beside/short", "beside/long", "short alone/short", "long alone/long", "after/short"):
                a, b = tps(split, key), tps(van, key)
                if a and b:
                    worst = a / b if worst is None else min(worst, a / b)
            add("vs_vanilla", worst, ">=", 3.0, "every request class: split / vanilla -ngl at the split's VRAM (worst)")
        res = cells.get("resident")
        if res:
            a, b = tps(split, "after long/short"), tps(res, "after long/short", "tps_mean")
            add("promoted_vs_resident", a / b if a and b else None, ">=", 0.95,
                f"short requests that outlived the long one, from their {SKIP_AFTER_END + 1}rd token after its end: "
                "slowest split / resident (promotion)")
            a, b = tps(split, "after/short", "tps_mean"), tps(res, "after/short", "tps_mean")
            add("after_vs_resident", a / b if a and b else None, ">=", 0.95,
                "new short requests after the long one ended: split / resident")
        static = cells.get("static")
        if static:
            a, b = tps(split, "beside/long", "tps_mean"), tps(static, "beside/long", "tps_mean")
            add("long_beside_vs_static", a / b if a and b else None, ">=", 1.0,
                "the long request beside the short ones: elastic / static windows (report)")
            a, b = tps(split, "long alone/long", "tps_mean"), tps(static, "long alone/long", "tps_mean")
            add("long_alone_vs_static", a / b if a and b else None, ">=", 1.0,
                "the long request alone: elastic (the whole pool) / static windows (report)")
    if doc["mix"]["name"] == "ramp" and split:
        static = cells.get("static")
        if static and split.get("aggregate_tps") and static.get("aggregate_tps"):
            add("ramp_aggregate_vs_static", split["aggregate_tps"] / static["aggregate_tps"], ">=", 1.0,
                "aggregate tok/s over the ramp: elastic / static windows (report)")
        n_req = sum(len(st["requests"]) for st in doc["mix"]["stages"])
        done = sum(1 for r in split.get("requests") or [] if r.get("status") == "ok")
        add("ramp_all_complete", done / n_req if n_req else None, ">=", 1.0, "requests of the ramp completed (split cell)")
    default = cells.get("default")
    if doc["mix"]["name"] == "random" and default:
        pd = default.get("percentiles") or {}
        res = cells.get("default-resident") or cells.get("resident")
        pr = (res or {}).get("percentiles") or {}
        if res:
            a, b = pd.get("ttft_p50_s"), pr.get("ttft_p50_s")
            add("default_ttft_vs_resident", a / b if a and b else None, "<=", 1.3,
                f"time to first token p50: the default server (unified cache, split) / {res['name']}")
        blk = cells.get("default-blocks")
        if blk:
            a, b = ((blk.get("percentiles") or {}).get("ttft_p50_s")), pd.get("ttft_p50_s")
            add("blocks_ttft_vs_default", a / b if a and b else None, "<=", 1.0,
                "time to first token p50: the default server with block residency / with its window static (report)")
        if split and default.get("aggregate_tps") and split.get("aggregate_tps"):
            add("default_aggregate_vs_np", default["aggregate_tps"] / split["aggregate_tps"], ">=", 1.0,
                "aggregate tok/s: the default server / -np slots with elastic windows")
        n_req = sum(len(st["requests"]) for st in doc["mix"]["stages"])
        add("default_all_complete", pd.get("n", 0) / n_req if n_req else None, ">=", 1.0,
            "requests of the mix completed (default cell)")
    if doc["mix"]["name"] == "shared" and default:
        shared_targets(doc, cells, add)
    for cell, name in ((split, "vram_within_target"), (default, "vram_within_target (default)")):
        if cell and doc.get("vram_target_mib") and cell.get("vram_peak_mib"):
            add(name, cell["vram_peak_mib"] - doc["vram_target_mib"], "<=", 200.0,
                f"the {cell['name']} cell's NVML peak - --vram-target, MiB")
    if default and default.get("stats", {}).get("worst_step"):
        add("excess_blocks (default)", default["stats"]["worst_step"]["excess_blocks_per_stream"], "<=", 1.0,
            "default cell, worst sampled step: (tail bytes attended - occupied), in blocks of 256 cells of every layer")
    if default and default.get("stats", {}).get("beyond_own_blocks_max") is not None:
        add("beyond_own_blocks (default)", default["stats"]["beyond_own_blocks_max"], "<=", 1.0,
            "default cell, every step (the server's own maximum): tail bytes attended - the ubatch's own sequences' tail "
            "bytes, in blocks of 256 cells of every layer (issue 35: streamed <= its sequences' host bytes + one block)")
    if split and split.get("stats", {}).get("worst_step"):
        add("excess_blocks", split["stats"]["worst_step"]["excess_blocks_per_stream"], "<=", 1.0,
            "worst sampled step: (tail bytes attended - occupied) per stream, in blocks of 256 cells of every layer")
    return out


def shared_targets(doc: dict, cells: dict, add) -> None:
    """Issue 37's targets on the shared-prefix mix: the default cell (sharing on) against itself (one client alone, the
    first client) and against the same mix with sharing off."""
    default = cells["default"]
    reqs = {r["name"]: r for r in default.get("requests") or [] if r.get("status") == "ok"}
    first, alone = reqs.get("c1"), reqs.get("alone")
    sharers = [r for r in reqs.values() if r.get("kind") == "sharer"]
    if first and sharers and first.get("ttft_s"):
        add("sharer_ttft_vs_first", max(r["ttft_s"] for r in sharers) / first["ttft_s"], "<=", 0.2,
            "slowest time to first token of clients 2.. / the first client's (they prefill only their suffix)")
    if alone and alone.get("decode_tps") and all(r and r.get("decode_tps") for r in sharers + [first]):
        add("decode_vs_alone", min(r["decode_tps"] for r in sharers + [first]) / alone["decode_tps"], ">=", 0.8,
            "slowest client's decode on the shared document / one client alone (same server)")
    st = default.get("stats") or {}
    stage = next(s for s in doc["mix"]["stages"] if s["name"] == "shared")
    one = stage["requests"][0]
    one_cells = one["prompt"] + one["gen"]
    stored = (st.get("stored_cells_peak_by_stage") or {}).get("shared") or st.get("stored_cells_peak")
    if st.get("split") and stored:
        add("stored_cells_vs_one", stored / one_cells, "<=", 1.25,
            "KV cells the cache stored at its peak on the shared document (shared ones once) / one request's")
        window = (default.get("plan") or {}).get("window_cells") or 0
        one_tail = max(0, one_cells - window) * (st.get("block_bytes") or 0) / 256
        if one_tail:
            add("streamed_step_vs_one", st["streamed_bytes_step_max"] / one_tail, "<=", 1.25,
                "bytes streamed by the busiest sampled step / one request's tail (its cells past the window)")
    off = cells.get("default-noshare")
    if off:
        offr = {r["name"]: r for r in off.get("requests") or [] if r.get("status") == "ok"}
        a = [r.get("decode_tps") for r in [first, *sharers] if r]
        b = [offr[r["name"]].get("decode_tps") for r in [first, *sharers] if r and r["name"] in offr]
        if a and b and all(a) and all(b):
            add("decode_vs_noshare", (sum(a) / len(a)) / (sum(b) / len(b)), ">=", 4.0,
                "mean client decode on the shared document: sharing on / off (same mix)")


def fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_report(doc: dict) -> None:
    from rich.table import Table

    from rollingkv_cli.console import console

    keys: list[str] = []
    for c in doc["cells"]:
        for k in (c.get("phases") or {}):
            if k not in keys:
                keys.append(k)
    t = Table(title=f"bench load: {doc['mix']['name']} mix, -np {doc['mix']['n_slots']}, decode tok/s min-max (TTFT p50 s)")
    t.add_column("request class")
    for c in doc["cells"]:
        t.add_column(c["name"], justify="right")
    for k in keys:
        row = [k]
        for c in doc["cells"]:
            p = (c.get("phases") or {}).get(k)
            row.append("-" if not p else f"{fmt(p['tps_min'])}-{fmt(p['tps_max'])} ({fmt(p['ttft_p50_s'], '.2f')})"
                       + (f" {p['errors']} err" if p["errors"] else ""))
        t.add_row(*row)
    pct = lambda c, k, spec=".2f": fmt((c.get("percentiles") or {}).get(k), spec)  # noqa: E731
    for label, fn in (("aggregate tok/s", lambda c: fmt(c.get("aggregate_tps"))),
                      ("TTFT p50 / p90 s", lambda c: f"{pct(c, 'ttft_p50_s')} / {pct(c, 'ttft_p90_s')}"),
                      ("decode tok/s p10 / p50", lambda c: f"{pct(c, 'decode_tps_p10', '.1f')} / {pct(c, 'decode_tps_p50', '.1f')}"),
                      ("peak VRAM MiB", lambda c: fmt(c.get("vram_peak_mib"), ".0f")),
                      ("peak host MiB", lambda c: fmt(c.get("host_peak_mib"), ".0f")),
                      ("tail attended / occupied", lambda c: fmt((c.get("stats") or {}).get("attended_over_occupied"), ".2f")),
                      ("cells promoted / demoted", lambda c: "-" if not (c.get("stats") or {}).get("moves") else
                       f"{c['stats']['moves']['promoted_cells']} / {c['stats']['moves']['demoted_cells']}"),
                      ("status", lambda c: c.get("status", "-"))):
        t.add_row(label, *[fn(c) for c in doc["cells"]])
    console.print(t)
    load_time.print_time(doc)
    for tg in doc.get("targets", []):
        console.print(f"  {tg['target']}: {fmt(tg['value'], '.3g')} {tg['op']} {tg['threshold']}: {tg['verdict']}  ({tg['what']})",
                      soft_wrap=True)
