#!/usr/bin/env bash
# Device call on the prebuilt CUDA build (carry .device/prebuilt, .device/src, .device/series): does decode with a
# streamed tail replay CUDA graphs, and what does eager evaluation cost? llama-bench -v at depth 16384 on the
# synthetic 28-layer model, counting ggml-cuda's graph log lines (warmup complete / reset, graph reused, captures),
# plus resident and 50%-tail timings with GGML_CUDA_DISABLE_GRAPHS=1. Results: $OUT/log.txt, $OUT/graphs.jsonl.
. "$(dirname "$0")/device-lib.sh"
use_prebuilt
synth_model
D=16384; N=32
run() {  # label, env..., -- llama-bench residency args: timing and graph log counts of one run
  local label=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 120 "$B/build/bin/llama-bench" -m $SYNTH -fa 1 -p 0 -n $N -d $D -r 1 -ngl 99 -o json -v "$@" \
    > /tmp/gp.json 2> /tmp/gp.err
  python3 - "$label" <<'PY' | tee -a "$OUT/graphs.jsonl"
import json, re, sys
err = open('/tmp/gp.err', errors='replace').read()
try:
    r = json.load(open('/tmp/gp.json'))[0]; ms = 1000 / r['avg_ts']
except Exception as e:
    ms = None
count = lambda p: len(re.findall(p, err))
print(json.dumps({'label': sys.argv[1], 'ms': ms, 'warmup_complete': count(r'CUDA graph warmup complete'),
                  'warmup_reset': count(r'CUDA graph warmup reset'), 'graph_id_reused': count(r'CUDA Graph id \d+ reused'),
                  'update_failed': count(r'CUDA graph update failed'), 'disabling': count(r'disabling CUDA graphs'),
                  'rkv_ring': count(r'tail slot ring'), 'stderr_lines': err.count('\n')}))
PY
  cp /tmp/gp.err "/tmp/gp-${label// /_}.err"
}
step "llama-bench -v -d $D -n $N"
run resident X=1 -- --kv-residency-mode off
run "window 8192" X=1 -- --kv-residency-mode window --kv-window-cells 8192
run "window 8192 skip-both" GGML_RKV_DEBUG_SKIP_COPY=1 GGML_RKV_DEBUG_SKIP_TAIL_ATTN=1 -- --kv-residency-mode window --kv-window-cells 8192
run "resident graphs off" GGML_CUDA_DISABLE_GRAPHS=1 -- --kv-residency-mode off
run "window 8192 skip-both graphs off" GGML_CUDA_DISABLE_GRAPHS=1 GGML_RKV_DEBUG_SKIP_COPY=1 GGML_RKV_DEBUG_SKIP_TAIL_ATTN=1 -- --kv-residency-mode window --kv-window-cells 8192
grep -E "CUDA graph|CUDA Graph|rolling|residency|graph" /tmp/gp-window_8192.err | sed "s/id [0-9]*/id N/"  | sort | uniq -c | sort -rn | head -20
step done
