# bench tail at 16384: window cells 25/50/75/100% f16 and 50% q8_0/q4_0, each again with the CPU part at auto and 0.5,
# head cells at 25/50/75% (6/4/2 of 8 KV heads on the device) for f16/q8_0/q4_0, auto, vanilla -ngl and -nkvo; then head
# cells with the CPU part (auto, 0.5) through llama-bench directly
source scripts/device/lib.sh
use_prebuilt
synth_model
step "bench tail 16384"
bash scripts/bench-tail.sh "$SYNTH" --no-plot --json "$OUT/bench-tail-16384.json" -d 16384 -n 32 -r 3 --vanilla-reps 1 \
  --fractions 0.25,0.5,0.75,1 --mixed-fractions 0.5 --head-fractions 0.25,0.5,0.75 --cpu-fracs auto,0.5 \
  --cell-timeout 100 --time-budget 440 2>&1 | grep -v "^\s*$" | tail -45
step "head cells with the CPU part"
for a in "4 auto" "4 0.5" "2 auto" "2 0.5"; do
  set -- $a
  ROLLINGKV_CPU_PART_STATS=1 timeout 60 "$B/build/bin/llama-bench" -m "$SYNTH" -fa 1 -p 0 -n 32 -d 16384 -r 2 -ngl 99 -o jsonl \
    --kv-residency-mode head --kv-device-heads "$1" --kv-tail-cpu-frac "$2" 2> /tmp/h.err | tee -a "$OUT/head-cpu-part.jsonl" | \
    python3 -c "import json,sys; r=json.loads(sys.stdin.readline()); print('head h$1 cpu $2:', round(1000/r['avg_ts'],2), 'ms/token, chosen', r.get('kv_tail_cpu_frac_chosen'))"
  grep -h "rolling KV: CPU part" /tmp/h.err | sed "s/^/  [h$1 cpu $2] /" | tee -a "$OUT/head-cpu-part-stats.txt" | head -3
done
