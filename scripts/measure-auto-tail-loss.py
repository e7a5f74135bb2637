#!/usr/bin/env python3
"""Measure what a q8_0 and a q4_0 tail chosen by auto (-ctkt/-ctvt auto) lose against the resident cache, and what a
perturbed merge (ROLLINGKV_DEBUG_PERTURB_TAIL=x: every tail score x (1 + x)) loses on top: the figures that the auto
bounds in rollingkv_cli/gate/metrics.py (PROFILES["auto"], AUTO_8BIT) are set from (docs/design/auto-tail-types.md).

Each cell is one `rollingkv gate equiv --no-needle` over the positions that read the tail (the loss the gate bounds), on
the demo model by default. q4_0 is forced the way a slow link forces it (ROLLINGKV_PCIE_BW_GBPS=0.01: the tail's link
time then exceeds the resident time at any length); q8_0 is the floor auto takes for these short tails.

    python scripts/measure-auto-tail-loss.py --out /tmp/auto-loss.jsonl          # 3 texts x 3 lengths x 2 types x 3 x
    python scripts/measure-auto-tail-loss.py --seeds 0 --lengths 512:256 --x 0    # one cell

Prints one line per cell and, per type and x, the worst value of each bounded metric.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def cell(model: str, text: Path, window: int, tail: str, x: float, threads: int, work: Path) -> dict:
    out = work / f"r-{text.stem}-{window}-{tail}-{x}.json"
    env = {**os.environ}
    env.pop("ROLLINGKV_DEBUG_PERTURB_TAIL", None)
    env.pop("ROLLINGKV_PCIE_BW_GBPS", None)
    if tail == "q4_0":
        env["ROLLINGKV_PCIE_BW_GBPS"] = "0.01"
    if x:
        env["ROLLINGKV_DEBUG_PERTURB_TAIL"] = repr(x)
    cmd = [sys.executable, "-m", "rollingkv_cli", "gate", "equiv", "--model", model, "--prompt-file", str(text),
           "--kv-window-cells", str(window), "-ctkt", "auto", "-ctvt", "auto", "--no-needle", "--threads", str(threads),
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE)
    if not out.is_file():
        raise SystemExit(f"gate equiv failed to report ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    r = json.loads(out.read_text())
    a = r["auto_tail"]
    chosen = f"{a['chosen']['k']}/{a['chosen']['v']}"
    if chosen != f"{tail}/{tail}":
        raise SystemExit(f"auto chose {chosen}, wanted {tail}: {a['reason']}")
    return {"text": text.stem, "tokens": r["tokens"]["n"], "window": window, "tail": tail, "x": x, **a["loss"],
            "passed": a["loss_passed"], "bounds": a["bounds"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--seeds", default="0,1,2", help="synthetic_text seeds, one text each")
    ap.add_argument("--lengths", default="512:256,1024:256,2048:512", help="tokens:window pairs")
    ap.add_argument("--types", default="q8_0,q4_0")
    ap.add_argument("--x", default="0,0.1,0.25", help="perturbations of the tail scores (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="append one JSON line per cell")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from rollingkv_cli.gate.runner import synthetic_text

    rows = []
    with tempfile.TemporaryDirectory() as td:
        work = Path(td)
        for seed in [int(s) for s in args.seeds.split(",")]:
            for pair in args.lengths.split(","):
                n_tok, window = (int(v) for v in pair.split(":"))
                # ~4.2 characters a token for this prose and the demo vocabulary; the gate reports the exact count
                text = work / f"s{seed}-n{n_tok}.txt"
                text.write_text(synthetic_text(int(n_tok * 4.2), seed=seed))
                for tail in args.types.split(","):
                    for x in [float(v) for v in args.x.split(",")]:
                        row = cell(args.model, text, window, tail, x, args.threads, work)
                        rows.append(row)
                        print(f"seed {seed} tokens {row['tokens']:5d} window {window:4d} {tail} x={x:<5g} positions {row['positions']:5d} "
                              f"mean TV {row['mean_tv']:.4f} p99 {row['p99_tv']:.3f} top-1 {row['top1_agreement']:.3f} "
                              f"{'pass' if row['passed'] else 'FAIL'}", flush=True)
                        if args.out:
                            with args.out.open("a") as f:
                                f.write(json.dumps(row) + "\n")
    print("\nworst per type and x (mean TV max, p99 TV max, top-1 min):")
    for tail in args.types.split(","):
        for x in sorted({r["x"] for r in rows}):
            sel = [r for r in rows if r["tail"] == tail and r["x"] == x]
            if sel:
                print(f"  {tail} x={x:g}: mean TV {max(r['mean_tv'] for r in sel):.4f}, p99 {max(r['p99_tv'] for r in sel):.3f}, "
                      f"top-1 {min(r['top1_agreement'] for r in sel):.3f}  (best: {min(r['mean_tv'] for r in sel):.4f}, "
                      f"{min(r['p99_tv'] for r in sel):.3f}, {max(r['top1_agreement'] for r in sel):.3f}; {len(sel)} cells)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
