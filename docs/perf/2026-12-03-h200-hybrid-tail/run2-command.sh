# one-off: the hybrid tail with the CPU part's own threads and the tail in 2 MiB-page registered memory (2026-12-03)
source scripts/device/lib.sh
use_prebuilt
T0=$SECONDS
step "op tests on CUDA0 (device tail, pinned-host tail) and with a CPU part"
op_tests_cuda; echo "op_tests_cuda rc=$?"
hybrid_op_tests; echo "hybrid_op_tests rc=$?"
step "gpu tests"; gpu_tests; echo "gpu_tests rc=$?"
synth_model
cell() { # depth, label, env..., -- llama-bench args
  local depth=$1 label=$2; shift 2; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  if [ $((SECONDS - T0)) -gt 560 ]; then echo "$label: skipped (time)"; return; fi
  env "${envs[@]}" timeout 120 "$B/build/bin/llama-bench" -m "$SYNTH" -fa 1 -p 0 -n 16 -d "$depth" -r 2 -ngl 99 -o json "$@" > /tmp/cell.json 2> /tmp/cell.err
  local rc=$?
  python3 -c "
import json, sys
r = json.load(open('/tmp/cell.json'))[0]
print(json.dumps({'depth': int(sys.argv[2]), 'label': sys.argv[1], 'ms': round(1000 / r['avg_ts'], 3), 'samples_ms': [round(1000 / x, 2) for x in r['samples_ts']],
                  'n_threads': r.get('n_threads'), 'frac': r.get('kv_tail_cpu_frac_chosen')}))" "$label" "$depth" | tee -a "$OUT/decode.jsonl" || { echo "$label: rc $rc"; tail -3 /tmp/cell.err; }
  grep -h "rolling KV: CPU part" /tmp/cell.err | sed "s/^/  [$depth $label] /" | tee -a "$OUT/cpu-part-stats.txt"
}
step "decode cells"
S=ROLLINGKV_CPU_PART_STATS=1
W="--kv-residency-mode window --kv-window-cells"
cell 16384 resident -- --kv-residency-mode off
for f in 0 auto 0.35 0.45 0.55; do cell 16384 "w256 cpu$f" $S -- $W 256 --kv-tail-cpu-frac $f; done
for f in 0 auto 0.3 0.4 0.5; do cell 16384 "w8192 cpu$f" $S -- $W 8192 --kv-tail-cpu-frac $f; done
cell 16384 "w256 cpu1" $S -- $W 256 --kv-tail-cpu-frac 1
cell 65536 resident -- --kv-residency-mode off
for f in 0 0.45 0.55; do cell 65536 "w32768 cpu$f" $S -- $W 32768 --kv-tail-cpu-frac $f; done
for f in 0 0.5; do cell 65536 "w256 cpu$f" $S -- $W 256 --kv-tail-cpu-frac $f; done
