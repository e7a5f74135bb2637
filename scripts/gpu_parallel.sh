#!/usr/bin/env bash
# Device call on the prebuilt CUDA build (as gpu_prebuilt.sh): four spilled sequences in parallel. (1) the
# teacher-forced gate with --n-seq 4 (interleaved cells in one unified cache) against its order floor; (2) llama-server
# with -np 4 and a 512-cell window under 4 concurrent clients x 2 requests of ~1500 prompt tokens each: every
# request completes, and each answer is compared with the same request sent alone. Results: $OUT/log.txt, $OUT/*.json.
. "$(dirname "$0")/device-lib.sh"
use_prebuilt
M=/tmp/synth-4L.gguf
[ -f $M ] || python3 -m rollingkv_cli model synth $M --layers 4 --embd 1024 --heads 8 --kv-heads 2 --ff 2816 --vocab 32000 --ctx 16384 --force | tail -1
step "gate equiv --n-seq 4, window 256, 2048 tokens, -ngl 99 (order floor on)"
python3 -m rollingkv_cli gate equiv --model $M --synthetic-tokens 2048 --n-seq 4 --n-batch 128 --kv-window-cells 256 -ngl 99 \
  --json "$OUT/nseq4.json" 2>&1 | grep -E "mean total|top-1 agree|non-finite|order floor|PASS|FAIL" | tr -s ' '
step "llama-server -np 4, window 512 of 8192: 4 concurrent clients x 2 requests vs each request alone"
python3 - "$M" "$OUT/parallel.json" <<'PY'
import json, sys, threading, urllib.request
from pathlib import Path
from rollingkv_cli import builder, server
model, out = sys.argv[1], sys.argv[2]
b = builder.active_build()
srv = server.ServerProcess(b.artifact("llama-server"), ["-m", model, "-c", "8192", "-np", "4", "-ngl", "99", "-fa", "on",
      "--kv-residency-mode", "window", "--kv-window-cells", "512"], log_path=Path("/tmp/parallel-server.log"))
def post(body):
    req = urllib.request.Request(srv.url + "/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))
reqs = [{"prompt": [(17 * i + 31 * k) % 31000 + 100 for k in range(1500 + 37 * i)], "n_predict": 32, "temperature": 0,
         "cache_prompt": False, "seed": 0} for i in range(8)]
res = {"concurrent": [None] * 8, "alone": [None] * 8, "errors": []}
try:
    srv.start(); srv.wait_healthy(timeout=240)
    plan = json.load(urllib.request.urlopen(srv.url + "/props", timeout=30)).get("rolling_kv")
    for r in reqs:  # the answers' token ids (falls back to the text)
        r["return_tokens"] = True
    def run(i, key):
        try:
            r = post(reqs[i])
            res[key][i] = r.get("tokens") or r.get("content")
        except Exception as e:
            res["errors"].append(f"{key} {i}: {type(e).__name__}: {e}")
    th = [threading.Thread(target=lambda c=c: [run(i, "concurrent") for i in (c, c + 4)]) for c in range(4)]
    [t.start() for t in th]; [t.join() for t in th]
    for i in range(8):
        run(i, "alone")
    same = [res["concurrent"][i] == res["alone"][i] for i in range(8)]
    prefix = [next((k for k, (a, b) in enumerate(zip(res["concurrent"][i] or [], res["alone"][i] or [])) if a != b), 32) for i in range(8)]
    summary = {"plan": {k: (plan or {}).get(k) for k in ("mode_chosen", "window_cells", "tail_cells", "n_stream")},
               "completed": sum(r is not None for r in res["concurrent"]), "errors": res["errors"],
               "identical_to_alone": sum(same), "first_difference": prefix}
except Exception as e:
    summary = {"error": f"{type(e).__name__}: {e}"}
finally:
    srv.stop()
json.dump({**summary, "answers": res}, open(out, "w"), indent=1)
print(json.dumps(summary))
PY
grep -c "CUDA Graph id .* reused" /tmp/parallel-server.log | sed 's/^/CUDA graphs reused: /'
step done
