#!/usr/bin/env bash
# The GPU runs issues 5, 6 and 7 ask for, in one device call on a machine that already built the series (the
# call right after gpu_stream.sh or gpu_exactness_ab.sh, while warm; this call carries .device/model2 and the
# earlier one stashed model1, so the real demo model is here). At most 8 files under $OUT:
#   log.txt            everything printed
#   matrix.{json,md}   `gate matrix` on the GPU (-ngl 99), demo model                      (issue 7)
#   vram-T.json        `gate vram` (auto mode) on the synthetic 28-layer model at targets T: resident, and two that
#                      force a tail (issues 5, 7)
#   serve.jsonl        `rollingkv serve` demo: window vs resident vs auto answers, plan, CUDA graph reuse, NVML (issue 6)
. "$(dirname "$0")/device-lib.sh"
NGL="${NGL:-99}"
if [ -z "${ROLLINGKV_BUILD:-}" ]; then
  B="$(python3 -m rollingkv_cli build --cuda --cuda-arch 90 --source /tmp/rkv-src --print-dir)" || { echo "no CUDA build on this machine"; exit 3; }
  export ROLLINGKV_BUILD="$B"
fi
SYNTH="${SYNTH:-/tmp/synth28.gguf}"
[ -f "$SYNTH" ] || python3 -m rollingkv_cli model synth "$SYNTH" --ctx 131072 --force | tail -1

step "issue 7: gate matrix on the GPU (demo model)"
timeout "${MATRIX_TIMEOUT:-240}" python3 -m rollingkv_cli gate matrix --model demo -ngl "$NGL" --out "$OUT" --name matrix 2>&1 | tail -24
echo "matrix exit ${PIPESTATUS[0]}"

step "issue 5/7: gate vram (auto mode, NVML peak), synthetic 28-layer model, 32768 context (3.5 GiB f16 KV), several targets"
for target in ${VRAM_TARGETS:-20000 7500 6800}; do
  timeout "${VRAM_TIMEOUT:-150}" python3 -m rollingkv_cli gate vram --model "$SYNTH" --vram-target "$target" --ctx 32768 \
    --n-predict 256 --json "$OUT/vram-$target.json" 2>&1 | grep -E "target|peak|plan|tail|speed|PASS|FAIL" | cut -c1-200
  echo "vram $target exit ${PIPESTATUS[0]}"
done

step "issue 6: rollingkv serve demo on the GPU, window 1024 of 8192 vs resident"
serve_once() {  # label, flags...
  local label=$1; shift
  python3 -m rollingkv_cli serve demo -c 8192 --port 18080 -q "$@" -- -ngl "$NGL" -v > "/tmp/serve-$label.txt" 2>&1 &
  local pid=$!
  for i in $(seq 1 240); do curl -sf localhost:18080/health >/dev/null && break; sleep 0.5; done
  python3 - "$label" "$OUT/serve.jsonl" <<'PY'
import json, sys, urllib.request
label, out = sys.argv[1], sys.argv[2]
def post(path, body):
    req = urllib.request.Request("http://127.0.0.1:18080" + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))
props = json.load(urllib.request.urlopen("http://127.0.0.1:18080/props", timeout=30))
facts = " ".join(f"Record {i}: the courier from city {i % 17} delivered {i * 7 % 13} parcels." for i in range(260))
r = post("/completion", {"prompt": facts + " Question: how many parcels did the courier of record 3 deliver? Answer:", "n_predict": 48, "temperature": 0, "seed": 0, "cache_prompt": False})
c = post("/v1/chat/completions", {"messages": [{"role": "user", "content": facts[:6000] + " Which city did record 5's courier come from?"}], "max_tokens": 32, "temperature": 0, "seed": 0})
try:
    import pynvml
    pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
    procs = {p.pid: p.usedGpuMemory // 2**20 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
except Exception as e:
    procs = f"no NVML: {e}"
rec = {"label": label, "plan": props.get("rolling_kv"), "tokens_evaluated": r.get("tokens_evaluated"), "timings": r.get("timings"),
       "completion": r.get("content"), "chat": c["choices"][0]["message"]["content"], "nvml_proc_mib": procs}
open(out, "a").write(json.dumps(rec) + "\n")
print(json.dumps({k: rec[k] for k in ("label", "tokens_evaluated", "completion", "chat", "nvml_proc_mib")})[:600])
PY
  kill -TERM $pid; wait $pid; echo "serve exit $? ($label)"
  local log; log=$(grep -o "log: [^ ]*" "/tmp/serve-$label.txt" | head -1 | cut -d' ' -f2)
  if [ -n "$log" ] && [ -f "$log" ]; then
    echo "CUDA graphs reused: $(grep -c 'CUDA Graph id .* reused' "$log"), warmups: $(grep -c 'CUDA graph warmup complete' "$log")"
    grep -m3 "rolling KV" "$log"
  fi
  grep -E "plan|window|resident" "/tmp/serve-$label.txt" | head -4
}
serve_once window --kv-residency-mode window --kv-window-cells 1024
serve_once resident --kv-residency-mode off
serve_once auto --kv-residency-mode auto
python3 - "$OUT/serve.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
if len(rows) >= 3:
    a, b = rows[-3], rows[-2]
    print("same /completion answer:", a["completion"] == b["completion"], "| same chat answer:", a["chat"] == b["chat"])
PY
step done

step "issue 5/6: rollingkv serve without -ngl on a KV that does not fit: all layers stay on the GPU, auto splits the KV"
serve_without_ngl "$SYNTH"

step "the GPU tests (pytest -m gpu): op on CUDA0, pinned-host tail, probe pcie, gate equiv on the demo model"
timeout 400 python3 -m pytest -q -m gpu tests/test_gpu.py -rs -p no:cacheprovider 2>&1 | tail -15
step "done (gpu tests)"
