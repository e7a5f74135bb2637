# one-off: the balanced CPU part (chunks claimed by free threads, merged in order);'s own threads and the tail in 2 MiB-page registered memory (2026-12-03)
source scripts/device/lib.sh
use_prebuilt
T0=$SECONDS
synth_model
cell() { # depth, label, env..., -- llama-bench args
  local depth=$1 label=$2; shift 2; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  if [ $((SECONDS - T0)) -gt 100 ]; then echo "$label: skipped (time)"; return; fi
  env "${envs[@]}" timeout 120 "$B/build/bin/llama-bench" -m "$SYNTH" -fa 1 -p 0 -n 16 -d "$depth" -r 2 -ngl 99 -o json "$@" > /tmp/cell.json 2> /tmp/cell.err
  local rc=$?
  python3 -c "
import json, sys
r = json.load(open('/tmp/cell.json'))[0]
print(json.dumps({'depth': int(sys.argv[2]), 'label': sys.argv[1], 'ms': round(1000 / r['avg_ts'], 3), 'samples_ms': [round(1000 / x, 2) for x in r['samples_ts']],
                  'n_threads': r.get('n_threads'), 'frac': r.get('kv_tail_cpu_frac_chosen')}))" "$label" "$depth" | tee -a "$OUT/decode.jsonl" || { echo "$label: rc $rc"; tail -3 /tmp/cell.err; }
  grep -h "rolling KV: CPU part" /tmp/cell.err | sed "s/^/  [$depth $label] /" | tee -a "$OUT/cpu-part-stats.txt"
}
step "op tests with a CPU part (inputs staged by a kernel, the result read in place)"
hybrid_op_tests; echo "hybrid_op_tests rc=$?"
step "latency probe: a 256-cell tail, streamed or on the CPU"
S=ROLLINGKV_CPU_PART_STATS=1
W="--kv-residency-mode window --kv-window-cells"
cell 16384 resident -- --kv-residency-mode off
cell 16384 "w16128 cpu0" -- $W 16128 --kv-tail-cpu-frac 0
cell 16384 "w16128 cpu1" $S -- $W 16128 --kv-tail-cpu-frac 1
step "bench tail 16384"
bash scripts/bench-tail.sh "$SYNTH" --no-plot --json "$OUT/bench-tail-16384.json" -d 16384 -n 32 -r 3 --vanilla-reps 1 \
  --fractions 0.5,1 --mixed-fractions 0.5 --cpu-fracs auto,0.4,0.5 --cell-timeout 100 --time-budget 280 2>&1 | grep -v "^\s*$" | tail -40
step "bench tail 16384, a simulated 6.5 GB/s link for auto"
bash scripts/bench-tail.sh "$SYNTH" --no-plot --json "$OUT/bench-tail-16384-link6.5.json" -d 16384 -n 16 -r 2 --tail-types f16 \
  --fractions 0.5,1 --cpu-fracs auto --pcie-bw-gbps 6.5 --skip auto --skip ngl --skip nkvo --cell-timeout 80 --time-budget 100 2>&1 | grep -v "^\s*$" | tail -12
