"""`bench tail`'s report shown and checked: one line per finished cell, the tables and targets of a report
(`bench tail` at its end, `bench show`), and what in a report `bench show`/`bench plot` could not use. tail.py
writes the report.
"""

from __future__ import annotations

import os

from rollingkv_cli.bench.tail_grid import _pct
from rollingkv_cli.console import console, esc


def _cpu_cell(c: dict) -> str:
    """The CPU part of a cell: '-' (none), the fraction asked for, 'auto' with the chosen one where the bench reports it."""
    if c["kind"] != "hybrid":
        return "-"
    chosen = c.get("cpu_frac_chosen")
    if c.get("cpu_frac") == "auto":
        return "auto" + (f" {_pct(chosen)}" if isinstance(chosen, (int, float)) else "")
    return _pct(c["cpu_frac"]) if isinstance(c.get("cpu_frac"), (int, float)) else str(c.get("cpu_frac"))


def _mb(b: float | None) -> str:
    return "-" if b is None else f"{b / 1e6:.3g}"


def _num(v: float | None, fmt: str = ".3g") -> str:
    return "-" if v is None else format(v, fmt)


def cell_line(c: dict) -> str:
    """One cell as console markup (its label and error are escaped: stderr lines hold brackets)."""
    if c["status"] == "ok" and c.get("tail_type_chosen"):
        c = dict(c, label=f"{c['label']} (chose {c['tail_type_chosen']})")
    if c["status"] != "ok":
        return f"{esc(str(c['label']))} at d={c['depth']}: [red]{esc(str(c['status']))}[/]" + (f" ({esc(str(c.get('error')))})" if c.get("error") else "")
    s = f"{esc(str(c['label']))} at d={c['depth']}: [bold]{c['tokens_per_s']:.4g} tok/s[/] (±{c.get('stddev_ts', 0):.2g}), {c['ms_per_token']:.3g} ms/token"
    if c.get("tail_bytes_per_token"):
        s += f", tail {_mb(c['tail_bytes_per_token'])} MB/token"
    if c.get("ratio_floor") is not None:
        s += f", {c['ratio_floor']:.2f}x floor"
    if c.get("ratio_hybrid") is not None:
        s += f", {c['ratio_hybrid']:.2f}x hybrid floor"
    if c.get("ratio_hybrid_dependent") is not None:
        s += f", {c['ratio_hybrid_dependent']:.2f}x its floor after the query"
    return s + f" [dim]({c.get('wall_s', 0):.1f} s)[/]"


def report_console():
    """The console for wide tables: ours on a terminal or with $COLUMNS, else one 200 columns wide (a log file
    or a device call's captured output would otherwise squeeze 12 columns into 80)."""
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    from rich.console import Console

    return Console(width=200, highlight=False)


def print_report(doc: dict) -> None:
    from rich.table import Table

    out = report_console()

    for depth in doc["config"]["depths"]:
        cells = [c for c in doc["cells"] if c["depth"] == depth]
        dp = doc["depths"].get(str(depth), {})
        tb = Table(title=esc(f"decode at depth {depth} (kv_size {dp.get('kv_size')}, n_gen {doc['config']['n_gen']}), {doc['build']['backend']}"),
                   title_justify="left")
        for col, just in (("cell", "left"), ("window", "right"), ("tail", "right"), ("CPU", "right"), ("tail MB/tok", "right"),
                          ("tok/s", "right"), ("ms/tok", "right"), ("floor ms", "right"), ("x floor", "right"), ("stretch ms", "right"),
                          ("x stretch", "right"), ("hybrid ms", "right"), ("x hybrid", "right"), ("wall s", "right"), ("status", "left")):
            tb.add_column(col, justify=just)
        for c in cells:
            ok = c["status"] == "ok"
            tb.add_row(
                esc(str(c["label"]) + (f" (→{c['tail_type_chosen']})" if c.get("tail_type_chosen") else "")),
                f"h{c['device_heads']}" if c["kind"] == "head" else "-" if c.get("window_cells") is None else str(c["window_cells"]),
                _pct(c["tail_fraction"]) if c["kind"] in ("window", "hybrid", "head") else "-",
                _cpu_cell(c),
                _mb(c.get("tail_bytes_per_token")) if c["kind"] in ("window", "auto", "hybrid", "head") else "-",
                f"{c['tokens_per_s']:.4g}" if ok else "-",
                _num(c.get("ms_per_token")) if ok else "-",
                _num(c.get("floor_ms")), _num(c.get("ratio_floor"), ".2f"),
                _num(c.get("stretch_floor_ms")), _num(c.get("ratio_stretch"), ".2f"),
                _num(c.get("hybrid_floor_ms")), _num(c.get("ratio_hybrid"), ".2f"),
                _num(c.get("wall_s"), ".1f"),
                {"ok": "[green]ok[/]", "pending": "[dim]pending[/]"}.get(c["status"], f"[red]{esc(str(c['status']))}[/]"),
            )
        out.print(tb)
    bw = doc["bandwidth"]
    out.print(f"bandwidth: {bw['gbps']:.4g} GB/s ({bw['source']}; {bw['note']})" if bw.get("gbps") is not None
              else f"bandwidth: null ({bw['note']})", soft_wrap=True, markup=False)
    ca = doc.get("cpu_attn") or {}
    if isinstance(ca.get("gbps"), dict):
        figures = ", ".join(f"{t} {_num(v, '.4g')}" for t, v in ca["gbps"].items())
        split = ca.get("expected_auto_frac") or {}
        out.print(f"CPU attention: {figures} GB/s on {ca.get('n_threads')} threads ({ca.get('source')})"
                  + (f"; cpu / (cpu + link) = " + ", ".join(f"{t} {_pct(v)}" for t, v in split.items()) if split else ""),
                  soft_wrap=True, markup=False)
    elif any(c["kind"] == "hybrid" for c in doc["cells"]):
        out.print(f"CPU attention: null ({ca.get('error') or ca.get('note')})", soft_wrap=True, markup=False)
    tt = Table(title="issue 4 targets, and issue 16's for the hybrid cells (computed from the cells above)", title_justify="left")
    for col in ("target", "depth", "value", "need", "status", "detail"):
        tt.add_column(col)
    for t in doc["targets"]:
        style = {"met": "green", "not met": "red", "n/a": "dim", "info": "yellow"}[t["status"]]
        detail = "; ".join(x for x in (t.get("detail"), t.get("note")) if x)
        tt.add_row(esc(str(t["target"])), str(t["depth"]), _num(t["value"], ".3g"), esc(f"{t['op']} {t['threshold']:g}"), f"[{style}]{t['status']}[/]", esc(detail))
    out.print(tt)
    for n in doc.get("notes", []):
        out.print(f"[dim]note:[/] {esc(str(n))}", soft_wrap=True)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_CELL_OPTIONAL_NUMBERS = ("window_cells", "tail_fraction", "tail_bytes_per_token", "host_kv_bytes_per_token", "wall_s", "stddev_ts",
                          "ms_per_token", "n_gpu_layers", "cpu_frac_chosen")


def report_problem(doc) -> str | None:
    """The first part of a `bench tail` report that `bench show`/`bench plot` could not use, or None.

    A report is ours (its schema) but may be cut off, hand-edited or from a broken run: say what is wrong
    instead of failing somewhere in the tables."""
    if not isinstance(doc, dict):
        return f"the top level is a {type(doc).__name__}, not an object"
    for key, typ in (("config", dict), ("bandwidth", dict), ("cells", list), ("depths", dict), ("build", dict), ("model", dict)):
        if not isinstance(doc.get(key), typ):
            return f"'{key}' is missing or not {'an object' if typ is dict else 'a list'}"
    cfg = doc["config"]
    if not isinstance(cfg.get("depths"), list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in cfg["depths"]):
        return "'config.depths' is not a list of integers"
    if not isinstance(cfg.get("n_gen"), int) or not isinstance(cfg.get("window_type"), str):
        return "'config.n_gen' or 'config.window_type' is missing"
    if not isinstance(cfg.get("tail_types"), list) or not all(isinstance(t, str) for t in cfg["tail_types"]):
        return "'config.tail_types' is not a list of type names"
    gbps = doc["bandwidth"].get("gbps")
    if gbps is not None and not (_is_num(gbps) and gbps > 0):
        return f"'bandwidth.gbps' is {gbps!r}, not a positive number or null"
    ca = doc.get("cpu_attn", {})
    if not isinstance(ca, dict):
        return "'cpu_attn' is not an object"
    cg = ca.get("gbps")
    if cg is not None and not (isinstance(cg, dict) and all(v is None or (_is_num(v) and v > 0) for v in cg.values())):
        return f"'cpu_attn.gbps' is {cg!r}, not null or an object of positive numbers (or nulls) per tail type"
    if not isinstance(doc.get("notes", []), list):
        return "'notes' is not a list"
    if not isinstance(doc["model"].get("path", ""), str):
        return "'model.path' is not a string"
    for i, c in enumerate(doc["cells"]):
        where = f"cells[{i}]"
        if not isinstance(c, dict):
            return f"{where} is not an object"
        for key, typ in (("label", str), ("status", str), ("kind", str)):
            if not isinstance(c.get(key), typ):
                return f"{where}.{key} is missing or not a string"
        if not isinstance(c.get("depth"), int) or isinstance(c.get("depth"), bool):
            return f"{where}.depth is missing or not an integer"
        for key in _CELL_OPTIONAL_NUMBERS:
            if c.get(key) is not None and not _is_num(c[key]):
                return f"{where}.{key} is {c[key]!r}, not a number"
        if c["kind"] in ("window", "hybrid", "head") and not _is_num(c.get("tail_fraction")):
            return f"{where} is a {c['kind']} cell without a numeric tail_fraction"
        if c["kind"] == "hybrid" and not (c.get("cpu_frac") == "auto" or _is_num(c.get("cpu_frac"))):
            return f"{where}.cpu_frac is {c.get('cpu_frac')!r}, not auto or a number"
        if c["status"] == "ok" and not (_is_num(c.get("tokens_per_s")) and c["tokens_per_s"] > 0 and _is_num(c.get("ms_per_token"))):
            return f"{where} is 'ok' without positive tokens_per_s and ms_per_token"
        if not isinstance(c.get("fractions", []), list) or not all(_is_num(f) for f in c.get("fractions", [])):
            return f"{where}.fractions is not a list of numbers"
    return None

