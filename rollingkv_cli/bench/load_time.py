"""Where a `bench load` cell's time went, from the server's own counters: llama_rolling_kv_stats_json's "evals" (API
10), the context's evaluations (llama-server: one batch of its loop, first decode to synchronized) by kind, decode (every
sequence one token), prefill (a prompt's chunks alone) and mixed (busy slots' decode tokens beside a new prompt's
chunk), with the tail bytes each kind attended and streamed. A decode evaluation of a split cell is set against its
floor: the resident cell's decode evaluation of the same run, plus its own tail bytes over the link and the CPU part's
attention, which overlap."""

from __future__ import annotations

KINDS = ("decode", "prefill", "mixed")
GB = 1e9


FIELDS = ("evals", "prompt_tokens", "decode_tokens", "ms", "steps", "tail_bytes", "streamed_bytes", "move_ms")


def eval_totals(sample: dict) -> dict:
    """A stats sample's evaluation counters by kind, and the decode ones by sequences under "decode_by_seqs" ({} from a
    server without them: API < 10)."""
    ev = sample.get("evals")
    if not isinstance(ev, dict):
        return {}
    out = {k: dict(ev[k]) for k in KINDS if isinstance(ev.get(k), dict)}
    if isinstance(ev.get("decode_by_seqs"), list):
        out["decode_by_seqs"] = [dict(b) for b in ev["decode_by_seqs"]]
    return out


def _delta(a: dict, b: dict) -> dict:
    d = {f: (b.get(f) or 0) - (a.get(f) or 0) for f in FIELDS}
    n = d["evals"]
    return {**d, "ms_mean": d["ms"] / n if n else None,
            "tail_gb_mean": d["tail_bytes"] / n / GB if n else None,
            "streamed_gb_mean": d["streamed_bytes"] / n / GB if n else None,
            "prompt_tps": d["prompt_tokens"] / (d["ms"] / 1000) if d["prompt_tokens"] and d["ms"] else None}


def summarize_time(samples: list[dict], wall_s: float | None) -> dict | None:
    """The run's evaluations by kind, and its decode evaluations by sequences (index i: i + 1 sequences, the last 8 or
    more): the last sample's counters less the first's (the first is taken before the first request, so the server's
    warm-up stays out). None without counters."""
    if not samples:
        return None
    first, last = eval_totals(samples[0]), eval_totals(samples[-1])
    if not last:
        return None
    kinds = {k: _delta(first.get(k, {}), last.get(k, {})) for k in KINDS}
    by_seqs = [_delta(a, b) for a, b in zip(first.get("decode_by_seqs") or [{}] * 8, last.get("decode_by_seqs") or [])]
    busy_ms = sum(k["ms"] for k in kinds.values())
    return {"kinds": kinds, "decode_by_seqs": by_seqs, "busy_s": busy_ms / 1000, "wall_s": wall_s,
            "idle_s": wall_s - busy_ms / 1000 if wall_s is not None else None}


def _floor(dec: dict, res_ms: float | None, link: float | None, cpu: float | None) -> dict | None:
    if not dec.get("evals") or not res_ms or not link or link <= 0:
        return None
    n = dec["evals"]
    link_ms = dec["streamed_bytes"] / n / (link * GB) * 1000
    cpu_bytes = max(0, dec["tail_bytes"] - dec["streamed_bytes"]) / n
    cpu_ms = cpu_bytes / (cpu * GB) * 1000 if cpu and cpu > 0 else (None if cpu_bytes else 0.0)
    if cpu_ms is None:
        return None
    floor = res_ms + max(link_ms, cpu_ms)
    # issue 35's floor: every tail byte over the link and the CPU attention together, at the best share
    best = res_ms + dec["tail_bytes"] / n / ((link + (cpu or 0)) * GB) * 1000
    return {"evals": n, "t_res_ms": res_ms, "link_ms": link_ms, "cpu_ms": cpu_ms, "floor_ms": floor,
            "ms_mean": dec["ms_mean"], "over_floor": dec["ms_mean"] / floor, "link_gbps": link, "cpu_gbps": cpu,
            "best_share_floor_ms": best, "over_best_share_floor": dec["ms_mean"] / best}


def decode_floor(cell: dict, resident: dict | None) -> dict | None:
    """A split cell's mean decode evaluation against its floor: the resident cell's mean decode evaluation (t_res) plus
    the larger of its streamed bytes over the link and the CPU part's bytes over the CPU attention's bandwidth (the
    plan's measured figures); the same for each count of sequences the resident cell ran too ("by_seqs"). None where a
    term is missing."""
    t, rt = cell.get("time") or {}, (resident or {}).get("time") or {}
    plan = cell.get("plan") or {}
    link = (plan.get("link") or {}).get("link_bw_gbps")
    cpu = (plan.get("tail_cpu") or {}).get("cpu_attn_gbps") or plan.get("cpu_attn_gbps")
    res = ((rt.get("kinds") or {}).get("decode") or {}).get("ms_mean")
    out = _floor((t.get("kinds") or {}).get("decode") or {}, res, link, cpu)
    if out is None:
        return None
    rb = rt.get("decode_by_seqs") or []
    out["by_seqs"] = [_floor(b, rb[i].get("ms_mean") if i < len(rb) else None, link, cpu)
                      for i, b in enumerate(t.get("decode_by_seqs") or [])]
    return out


def add_floors(doc: dict) -> None:
    """Each split cell's decode floor against the run's resident cell (default-resident for the default cells)."""
    cells = {c["name"]: c for c in doc.get("cells", [])}
    for c in doc.get("cells", []):
        if not (c.get("stats") or {}).get("split"):
            continue
        res = cells.get("default-resident" if c["name"].startswith("default") else "resident") \
            or cells.get("resident") or cells.get("default-resident")
        fl = decode_floor(c, res)
        if fl and c.get("time") is not None:
            c["time"]["decode_floor"] = fl


def print_time(doc: dict) -> None:
    from rich.table import Table

    from rollingkv_cli.console import console

    cells = [c for c in doc.get("cells", []) if c.get("time")]
    if not cells:
        return
    t = Table(title="where the time went (the server's evaluations: n x mean ms; tail GB each, attended (streamed); "
                    "prompt tok/s)")
    t.add_column("evaluations")
    for c in cells:
        t.add_column(c["name"], justify="right")

    def kind_row(k: str, fn) -> list[str]:
        return [fn(c["time"]["kinds"].get(k) or {}, bool((c.get("stats") or {}).get("split"))) for c in cells]

    def n_ms(d: dict, split: bool) -> str:
        return "-" if not d.get("evals") else f"{d['evals']} x {d['ms_mean']:.1f} ms"

    def gb(d: dict, split: bool) -> str:
        return "-" if not split or d.get("tail_gb_mean") is None else \
            f"{d['tail_gb_mean']:.2f} ({d['streamed_gb_mean']:.2f})"

    def tps(d: dict, split: bool) -> str:
        return "-" if d.get("prompt_tps") is None else f"{d['prompt_tps']:.0f}"

    for k in KINDS:
        t.add_row(k, *kind_row(k, n_ms))
        t.add_row(f"  {k}: tail GB", *kind_row(k, gb))
        if k != "decode":
            t.add_row(f"  {k}: prompt tok/s", *kind_row(k, tps))
        else:
            decode_rows(t, cells)
    t.add_row("busy / idle s", *[f"{c['time']['busy_s']:.1f} / "
                                 + ("-" if c["time"]["idle_s"] is None else f"{c['time']['idle_s']:.1f}") for c in cells])

    def floor(c: dict) -> str:
        fl = c["time"].get("decode_floor")
        return "-" if not fl else (f"{fl['floor_ms']:.1f} ({fl['t_res_ms']:.1f} + max({fl['link_ms']:.1f}, "
                                   f"{fl['cpu_ms']:.1f})): {fl['over_floor']:.2f}x")
    t.add_row("decode floor ms (t_res + max(link, cpu)): measured/floor", *[floor(c) for c in cells])

    def best(c: dict) -> str:
        fl = c["time"].get("decode_floor")
        return "-" if not fl else f"{fl['best_share_floor_ms']:.1f}: {fl['over_best_share_floor']:.2f}x"
    t.add_row("  at the best share (t_res + tail/(link + cpu)): measured/floor", *[best(c) for c in cells])
    console.print(t)


def decode_rows(t, cells: list[dict]) -> None:
    """The decode evaluations by sequences, each against its floor at the best share."""
    n_buckets = max((len(c["time"].get("decode_by_seqs") or []) for c in cells), default=0)
    for i in range(n_buckets):
        def bucket(c: dict, i=i) -> str:
            b = (c["time"].get("decode_by_seqs") or [])[i:i + 1]
            if not b or not b[0].get("evals"):
                return "-"
            fl = ((c["time"].get("decode_floor") or {}).get("by_seqs") or [None] * 8)[i]
            return f"{b[0]['evals']} x {b[0]['ms_mean']:.1f} ms" + (f" ({fl['over_best_share_floor']:.2f}x)" if fl else "")
        if any(bucket(c) != "-" for c in cells):
            t.add_row(f"  decode, {i + 1}{'+' if i == 7 else ''} sequences (/ best-share floor)", *[bucket(c) for c in cells])
