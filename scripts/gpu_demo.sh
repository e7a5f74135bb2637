#!/usr/bin/env bash
# Second device call of a session, on the still-warm machine that gpu_stream.sh built on (it stashed the first
# half of the demo model; this call carries the second half): GPU teacher-forced gates on the real demo model and
# a recorded `rollingkv serve` run (window vs resident answers, the plan it printed, CUDA graph reuse, NVML).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/rkv-out}"; mkdir -p "$OUT"
export ROLLINGKV_CACHE_DIR=/tmp/rkv-cache ROLLINGKV_OFFLINE=1 PYTHONUNBUFFERED=1 COLUMNS=160
export PYTHONPATH="$PWD:/tmp/rkv-pylib:/tmp/rkv-src/gguf-py"
exec > >(tee -a "$OUT/log.txt") 2>&1
step() { echo "== $1 ($(date +%T))"; }
[ -f .device/series/series.tgz ] && rm -rf native patches && tar -xzf .device/series/series.tgz
B="$(python3 -m rollingkv_cli build --cuda --cuda-arch 90 --source /tmp/rkv-src --print-dir)" || { echo "no build on this machine (cold?)"; exit 3; }
export ROLLINGKV_BUILD="$B"
bash scripts/device-run.sh join-model || exit 4
step "gate equiv, demo model on the GPU: 2048 tokens, window 512: f16 tail; q8_0 tail; f16 tail with run-ahead off"
timeout 60 python3 -m rollingkv_cli gate equiv --model demo --synthetic-tokens 2048 --kv-window-cells 512 --json "$OUT/gate-demo-f16.json" 2>&1 | tail -18; echo "gate exit ${PIPESTATUS[0]}"
timeout 60 python3 -m rollingkv_cli gate equiv --model demo --synthetic-tokens 2048 --kv-window-cells 512 -ctkt q8_0 -ctvt q8_0 --json "$OUT/gate-demo-q8tail.json" 2>&1 | tail -4; echo "gate exit ${PIPESTATUS[0]}"
GGML_RKV_RUNAHEAD=0 timeout 60 python3 -m rollingkv_cli gate equiv --model demo --synthetic-tokens 2048 --kv-window-cells 512 2>&1 | grep -E "mean total|top-1 agree|PASS|FAIL"; echo "gate exit ${PIPESTATUS[0]}"

serve_once() {  # label, flags...
  local label=$1; shift
  python3 -m rollingkv_cli serve demo -c 8192 --port 18080 -q "$@" -- -v > "$OUT/serve-$label.txt" 2>&1 &
  local pid=$!
  for i in $(seq 1 120); do curl -sf localhost:18080/health >/dev/null && break; sleep 0.5; done
  python3 - "$label" "$OUT/serve.jsonl" <<'PY'
import json, sys, urllib.request, re, glob, os
label, out = sys.argv[1], sys.argv[2]
def post(path, body):
    req = urllib.request.Request("http://127.0.0.1:18080" + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))
props = json.load(urllib.request.urlopen("http://127.0.0.1:18080/props", timeout=30))
facts = " ".join(f"Record {i}: the courier from city {i % 17} delivered {i * 7 % 13} parcels." for i in range(260))
prompt = facts + " Question: how many parcels did the courier of record 3 deliver? Answer:"
r = post("/completion", {"prompt": prompt, "n_predict": 48, "temperature": 0, "seed": 0, "cache_prompt": False})
c = post("/v1/chat/completions", {"messages": [{"role": "user", "content": facts[:6000] + " Which city did record 5's courier come from?"}], "max_tokens": 32, "temperature": 0, "seed": 0})
try:
    import pynvml
    pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
    procs = {p.pid: p.usedGpuMemory // 2**20 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
    used = pynvml.nvmlDeviceGetMemoryInfo(h).used // 2**20
except Exception as e:
    procs, used = f"no NVML: {e}", None
rec = {"label": label, "plan": props.get("rolling_kv"), "tokens_evaluated": r.get("tokens_evaluated"), "timings": r.get("timings"),
       "completion": r.get("content"), "chat": c["choices"][0]["message"]["content"], "nvml_proc_mib": procs, "nvml_used_mib": used}
open(out, "a").write(json.dumps(rec) + "\n")
print(json.dumps({k: rec[k] for k in ("label", "tokens_evaluated", "completion", "chat", "nvml_proc_mib")})[:600])
print("decode tok/s", (r.get("timings") or {}).get("predicted_per_second"), "prompt tok/s", (r.get("timings") or {}).get("prompt_per_second"))
PY
  kill -TERM $pid; wait $pid; echo "serve exit $? (label $label)"
  log=$(grep -o "log: [^ ]*" "$OUT/serve-$label.txt" | head -1 | cut -d' ' -f2)
  [ -n "$log" ] && [ -f "$log" ] && { echo "graphs reused: $(grep -c 'CUDA Graph id .* reused' "$log")  warmups: $(grep -c 'CUDA graph warmup complete' "$log")  ring: $(grep -m1 'slot ring' "$log")"; grep -m2 "rolling KV" "$log"; }
  head -c 3000 "$OUT/serve-$label.txt" | grep -E "plan|rolling|window|resident|log:" | head -6
}
step "rollingkv serve demo: window 1024 of 8192 (spilled), then resident"
serve_once window --kv-residency-mode window --kv-window-cells 1024
serve_once resident --kv-residency-mode off
python3 - "$OUT/serve.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
if len(rows) == 2:
    a, b = rows
    print("same /completion answer:", a["completion"] == b["completion"], "| same chat answer:", a["chat"] == b["chat"])
PY
step done
