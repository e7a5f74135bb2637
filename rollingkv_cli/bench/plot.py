"""The PNG of a `bench tail` report: tokens/s against tail bytes per token, one series per tail type, the
serialized and overlapped PCIe floors as lines, the resident and vanilla runs as points; the hybrid cells (part of the
tail attended on the CPU) as one series per tail type and CPU fraction, with the third floor, the tail over the link
and the CPU attention together (overlapped and serial), for each tail type the run measured a CPU figure of; one panel
per depth. matplotlib is optional (`pip install 'rollingkv[plot]'`): the report JSON holds everything, and
`rollingkv bench plot RUN.json` draws it later on a machine that has it."""

from __future__ import annotations

from pathlib import Path

from rollingkv_cli.bench import arithmetic as bm

_VANILLA = {
    "resident": ("resident (off)", "*", "black"),
    "auto": ("auto", "P", "tab:gray"),
    "vanilla_resident": ("vanilla resident", "*", "tab:brown"),
    "vanilla_ngl": ("vanilla -ngl (same VRAM)", "s", "tab:red"),
    "vanilla_nkvo": ("vanilla -nkvo 1", "X", "tab:purple"),
}


_TYPE_COLORS = {"f16": "tab:blue", "q8_0": "tab:orange", "q4_0": "tab:cyan", "f32": "tab:pink", "bf16": "tab:olive",
                "q4_1": "tab:gray", "q5_0": "tab:brown", "q5_1": "tab:purple"}


_FIXED_STYLES = ["v:", "s:", "D:", "<:", ">:"]  # hybrid series at fixed CPU fractions; "^--" is auto


def _cpu_name(frac) -> str:
    return "auto" if frac == "auto" else f"{frac * 100:.0f}%"


def have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def render(doc: dict, out: Path) -> Path:
    """Draw the report into out (PNG); ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    depths = doc["config"]["depths"]
    gbps = doc["bandwidth"].get("gbps")
    cpu_gbps = (doc.get("cpu_attn") or {}).get("gbps") or {}
    fig, axes = plt.subplots(1, len(depths), figsize=(6.4 * len(depths), 4.8), squeeze=False)
    for ax, depth in zip(axes[0], depths):
        cells = [c for c in doc["cells"] if c["depth"] == depth and c.get("status") == "ok" and c.get("tokens_per_s")]
        xmax = max([c.get("tail_bytes_per_token") or 0 for c in cells] + [c.get("host_kv_bytes_per_token") or 0 for c in cells] + [1.0])
        for t in doc["config"]["tail_types"]:
            series = sorted((c for c in cells if c["kind"] == "window" and c.get("tail_type") == t), key=lambda c: c["tail_bytes_per_token"])
            if series:
                ax.plot([c["tail_bytes_per_token"] / 1e6 for c in series], [c["tokens_per_s"] for c in series], "o-", label=f"tail {t}",
                        color=_TYPE_COLORS.get(t))
            hybrid = [c for c in cells if c["kind"] == "hybrid" and c.get("tail_type") == t]
            fracs = list(dict.fromkeys(c.get("cpu_frac") for c in hybrid))
            fixed = iter(_FIXED_STYLES * 4)
            for frac in fracs:
                pts = sorted((c for c in hybrid if c.get("cpu_frac") == frac), key=lambda c: c["tail_bytes_per_token"])
                ax.plot([c["tail_bytes_per_token"] / 1e6 for c in pts], [c["tokens_per_s"] for c in pts],
                        "^--" if frac == "auto" else next(fixed), label=f"hybrid {t}, CPU {_cpu_name(frac)}", color=_TYPE_COLORS.get(t))
            head = sorted((c for c in cells if c["kind"] == "head" and c.get("tail_type") == t), key=lambda c: c["tail_bytes_per_token"])
            if head:  # the head split at the same VRAM as the window cells: its tail bytes are its host heads of every cell
                ax.plot([c["tail_bytes_per_token"] / 1e6 for c in head], [c["tokens_per_s"] for c in head], "x-.", markersize=8,
                        label=f"head split {t}", color=_TYPE_COLORS.get(t))
        for kind, (label, marker, color) in _VANILLA.items():
            pts = [c for c in cells if c["kind"] == kind]
            if not pts:
                continue
            x = [(c.get("tail_bytes_per_token") if kind in ("resident", "auto") else c.get("host_kv_bytes_per_token")) or 0 for c in pts]
            lab = label if kind != "vanilla_ngl" else f"vanilla -ngl {pts[0].get('n_gpu_layers')} (same VRAM)"
            ax.scatter([v / 1e6 for v in x], [c["tokens_per_s"] for c in pts], marker=marker, s=70, color=color, label=lab, zorder=3)
        res = next((c for c in cells if c["kind"] == "resident"), None)
        if gbps and res:
            t_res = 1.0 / res["tokens_per_s"]
            xs = [xmax * i / 200 for i in range(201)]
            serial = [1.0 / bm.floors(t_res, x, gbps * 1e9)[0] for x in xs]
            stretch = [1.0 / bm.floors(t_res, x, gbps * 1e9)[1] for x in xs]
            ax.plot([x / 1e6 for x in xs], serial, "--", color="tab:green", label=f"floor t_res + bytes/{gbps:.3g} GB/s")
            ax.plot([x / 1e6 for x in xs], stretch, ":", color="tab:olive", label="stretch max(t_res, bytes/bw)")
            for t in doc["config"]["tail_types"]:
                cpu = cpu_gbps.get(t)
                if not (isinstance(cpu, (int, float)) and cpu > 0) or not any(c["kind"] == "hybrid" and c.get("tail_type") == t for c in cells):
                    continue
                over = [1.0 / bm.hybrid_floors(t_res, x, gbps * 1e9, cpu * 1e9)[1] for x in xs]
                serial_h = [1.0 / bm.hybrid_floors(t_res, x, gbps * 1e9, cpu * 1e9)[0] for x in xs]
                ax.plot([x / 1e6 for x in xs], over, "-.", color=_TYPE_COLORS.get(t), alpha=0.7,
                        label=f"hybrid floor {t}: max(t_res, bytes/(bw + {cpu:.3g} GB/s CPU))")
                ax.plot([x / 1e6 for x in xs], serial_h, linestyle=(0, (1, 3)), color=_TYPE_COLORS.get(t), alpha=0.7,
                        label=f"hybrid serial {t}: t_res + bytes/(bw + cpu)")
        elif not gbps:
            ax.text(0.02, 0.02, "no PCIe link measured: floors not drawn", transform=ax.transAxes, fontsize=8, color="gray")
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.set_xlabel("bytes per token from host memory (MB)  [tail; vanilla: host KV]")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"depth {depth}, {doc['build'].get('backend')}, {Path(doc['model']['path']).name}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
