# one-off: where the hybrid tail's CPU part loses its speed inside a decode (2026-12-03)
source scripts/device/lib.sh
use_prebuilt
step "host"
nproc; lscpu | grep -E 'Model name|Socket|Core|Thread|NUMA|MHz|L3' ; cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag; grep -i huge /proc/meminfo
numactl -H 2>/dev/null | head -5; nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current,clocks.sm --format=csv
step "cpu-decode bench: memory kinds, with copies beside"
timeout 240 "$B/build/bin/test-rolling-kv-cpu-decode" --bench -t 15 --layers 28 --cells 16384 --alloc cpu,cudahost,thp,tail --beside-copy --reps 3 2>&1 | tee "$OUT/cpu-decode-bench.txt"
synth_model
cell() { # label, env..., -- llama-bench args
  local label=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 200 "$B/build/bin/llama-bench" -m "$SYNTH" -fa 1 -p 0 -n 16 -d 16384 -r 2 -ngl 99 -o json "$@" > /tmp/cell.json 2> /tmp/cell.err
  local rc=$?
  python3 -c "
import json, sys
r = json.load(open('/tmp/cell.json'))[0]
print(json.dumps({'label': sys.argv[1], 'ms': round(1000 / r['avg_ts'], 3), 'samples_ms': [round(1000 / x, 2) for x in r['samples_ts']]}))" "$label" | tee -a "$OUT/decode.jsonl" || { echo "$label: rc $rc"; tail -5 /tmp/cell.err; }
  grep -h "rolling KV: CPU part" /tmp/cell.err | sed "s/^/  [$label] /" | tee -a "$OUT/cpu-part-stats.txt"
}
step "decode cells, depth 16384"
W="--kv-residency-mode window --kv-window-cells 256"
cell "w256 cpu0 hugepages" -- $W
cell "w256 cpu0 cudahost" ROLLINGKV_TAIL_HOST_MEMORY=cuda -- $W
cell "w256 cpu1 cudahost" ROLLINGKV_TAIL_HOST_MEMORY=cuda ROLLINGKV_CPU_PART_STATS=1 -- $W --kv-tail-cpu-frac 1
cell "w256 cpu1 hugepages" ROLLINGKV_CPU_PART_STATS=1 -- $W --kv-tail-cpu-frac 1
cell "w256 cpu0.5 hugepages" ROLLINGKV_CPU_PART_STATS=1 -- $W --kv-tail-cpu-frac 0.5
cell "w8192 cpu0 hugepages" -- --kv-residency-mode window --kv-window-cells 8192
cell "w8192 cpu0.4 hugepages" ROLLINGKV_CPU_PART_STATS=1 -- --kv-residency-mode window --kv-window-cells 8192 --kv-tail-cpu-frac 0.4
cell "resident" -- --kv-residency-mode off
