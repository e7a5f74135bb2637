#!/usr/bin/env bash
# One device call that builds and checks everything GPU-side (run ON the GPU machine from the repo root,
# with .device/src carried; results under $OUT):
#   CUDA build of the series, the op tests on CUDA0, the PCIe probe, a synthetic model, the equivalence
#   gate (split vs resident, on the GPU), and `rollingkv serve` in window and resident mode with the plan
#   it printed and NVML memory while serving.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/rkv-out}"; mkdir -p "$OUT"
export ROLLINGKV_CACHE_DIR=/tmp/rkv-cache ROLLINGKV_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:/tmp/rkv-pylib:/tmp/rkv-src/gguf-py"
rkv() { python3 -m rollingkv_cli "$@"; }
step() { echo "== $1 ($(date +%T))"; }

step "build (CUDA sm_90)"
t0=$(date +%s)
bash scripts/device-run.sh build --cuda --cuda-arch 90 -q > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
echo "build wall: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/build.txt"
B="$(rkv build --cuda --cuda-arch 90 --source /tmp/rkv-src --print-dir)"
rkv info --json > "$OUT/info.json"

step "op tests on CUDA0"
timeout 120 "$B/build/bin/test-rolling-kv-ops" -b CUDA0 > "$OUT/optests-cuda.txt" 2>&1; echo "exit $?" >> "$OUT/optests-cuda.txt"
tail -2 "$OUT/optests-cuda.txt"
timeout 60 "$B/build/bin/test-rolling-kv-ops" -b CPU --quick > "$OUT/optests-cpu.txt" 2>&1; tail -1 "$OUT/optests-cpu.txt"

step "probe pcie"
timeout 60 python3 -m rollingkv_cli probe pcie --json > "$OUT/probe.json" 2>&1; echo "probe exit $?"

step "synthetic model"
M=/tmp/synth-8L.gguf
timeout 120 python3 -m rollingkv_cli model synth "$M" --layers 8 --embd 2048 --heads 16 --kv-heads 4 --ff 5632 --vocab 32000 --ctx 32768 --force

step "gate equiv on the GPU (synthetic, 2048 tokens, window 512)"
timeout 240 python3 -m rollingkv_cli gate equiv --model "$M" --synthetic-tokens 2048 --kv-window-cells 512 --json "$OUT/gate-synth-w512.json" > "$OUT/gate.txt" 2>&1
echo "gate exit $?" | tee -a "$OUT/gate.txt"; tail -20 "$OUT/gate.txt"

serve_once() {  # mode label extra...
  local label=$1; shift
  python3 -m rollingkv_cli serve "$M" -c 16384 --port 18080 "$@" > "$OUT/serve-$label.txt" 2>&1 &
  local pid=$!
  for i in $(seq 1 120); do curl -sf localhost:18080/health >/dev/null && break; sleep 0.5; done
  sleep 1
  curl -s localhost:18080/props | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin).get("rolling_kv"), indent=1))' > "$OUT/plan-$label.json"
  python3 - "$label" >> "$OUT/serve-$label.txt" <<'PY'
import json, sys, urllib.request
prompt = " ".join(f"item {i} is {i*7 % 13}." for i in range(220))
req = urllib.request.Request("http://127.0.0.1:18080/completion", data=json.dumps({"prompt": prompt, "n_predict": 64, "temperature": 0, "seed": 0, "ignore_eos": True}).encode(), headers={"Content-Type": "application/json"})
r = json.load(urllib.request.urlopen(req, timeout=300))
try:
    import pynvml
    pynvml.nvmlInit(); used = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used // 2**20
except Exception as e:
    used = f"no NVML: {e}"
print(json.dumps({"label": sys.argv[1], "tokens_evaluated": r["tokens_evaluated"], "timings": r["timings"], "nvml_used_mib": used, "content_head": r["content"][:80]}))
PY
  kill -TERM $pid; wait $pid; echo "serve exit $?" >> "$OUT/serve-$label.txt"
}
step "serve: window 1024 of 16384"
serve_once window --kv-residency-mode window --kv-window-cells 1024
step "serve: resident"
serve_once resident --kv-residency-mode off
tail -3 "$OUT/serve-window.txt" "$OUT/serve-resident.txt"
step done
