#!/usr/bin/env bash
# The GPU runs issues 5, 6 and 7 ask for, in one device call on a machine that already built the series (the
# call right after gpu_stream.sh or gpu_exactness_ab.sh, while warm; this call carries .device/model2 and the
# earlier one stashed model1, so the real demo model is here). At most 8 files under $OUT:
#   log.txt            everything printed
#   matrix.{json,md}   `gate matrix` on the GPU (-ngl 99), demo model                      (issue 7)
#   vram.json          `gate vram` on the synthetic 28-layer model, a target that forces a tail (issue 5, 7)
#   serve.jsonl        `rollingkv serve` demo: window vs resident answers, plan, CUDA graph reuse, NVML (issue 6)
#   auto.jsonl         auto mode under several --vram-target values: the plan chosen and the NVML peak (issue 5)
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

step "issue 5/7: gate vram, synthetic 28-layer model, 32768 context (3.5 GiB f16 KV) under a 7500 MiB target"
timeout "${VRAM_TIMEOUT:-180}" python3 -m rollingkv_cli gate vram --model "$SYNTH" --vram-target "${VRAM_TARGET:-7500}" --ctx 32768 \
  --n-predict 256 --json "$OUT/vram.json" 2>&1 | tail -14
echo "vram exit ${PIPESTATUS[0]}"

step "issue 5: auto mode under several targets (plan chosen, NVML peak of llama-server)"
for target in ${AUTO_TARGETS:-20000 8000 7000}; do
  python3 - "$SYNTH" "$target" "$OUT/auto.jsonl" <<'PY'
import json, sys, threading, time, urllib.request
from pathlib import Path
from rollingkv_cli import builder, server
model, target, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
b = builder.active_build()
srv = server.ServerProcess(b.artifact("llama-server"), ["-m", model, "-c", "32768", "-ngl", "999", "-fa", "on",
      "--kv-residency-mode", "auto", "--vram-target", str(target)], log_path=Path(f"/tmp/auto-{target}.log"))
peak = {"proc": 0}
stop = threading.Event()
def sample(pid):
    try:
        import pynvml
        pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception as e:
        peak["error"] = str(e); return
    while not stop.is_set():
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == pid and p.usedGpuMemory:
                peak["proc"] = max(peak["proc"], p.usedGpuMemory)
        time.sleep(0.05)
rec = {"target_mib": target}
try:
    srv.start()
    th = threading.Thread(target=sample, args=(srv.proc.pid,), daemon=True); th.start()
    srv.wait_healthy(timeout=240)
    props = json.load(urllib.request.urlopen(srv.url + "/props", timeout=30))
    plan = props.get("rolling_kv") or {}
    body = {"prompt": "word " * int(__import__("os").environ.get("AUTO_PROMPT_WORDS", "16000")), "n_predict": int(__import__("os").environ.get("AUTO_N_PREDICT", "128")), "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(srv.url + "/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = json.load(urllib.request.urlopen(req, timeout=600))
    stop.set(); th.join(timeout=2)
    rec.update(mode_chosen=plan.get("mode_chosen"), window_cells=plan.get("window_cells"), tail_cells=plan.get("tail_cells"),
               reason=plan.get("reason"), budget=plan.get("budget"), estimate=plan.get("estimate"),
               peak_proc_mib=round(peak["proc"] / 2**20), decode_tok_s=(r.get("timings") or {}).get("predicted_per_second"),
               within_target_plus_200=peak["proc"] / 2**20 <= target + 200)
except Exception as e:
    rec["error"] = f"{type(e).__name__}: {e}"
finally:
    stop.set(); srv.stop()
open(out, "a").write(json.dumps(rec) + "\n")
print({k: rec.get(k) for k in ("target_mib", "mode_chosen", "window_cells", "tail_cells", "peak_proc_mib", "within_target_plus_200", "decode_tok_s", "error")})
PY
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
python3 - "$OUT/serve.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
if len(rows) >= 2:
    a, b = rows[-2], rows[-1]
    print("same /completion answer:", a["completion"] == b["completion"], "| same chat answer:", a["chat"] == b["chat"])
PY
step done
