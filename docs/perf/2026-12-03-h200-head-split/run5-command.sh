# after LLAMA_RKV_LAYER_DECODE_MS: auto's share for the 50 % q4_0 and f16 tails at 16384 against the GPU alone, in one run
source scripts/device/lib.sh
use_prebuilt
synth_model
for a in "q4_0 0" "q4_0 auto" "f16 0" "f16 auto" "f16 0.375"; do
  set -- $a
  timeout 60 "$B/build/bin/llama-bench" -m "$SYNTH" -fa 1 -p 0 -n 32 -d 16384 -r 3 -ngl 99 -o jsonl --kv-residency-mode window \
    --kv-window-cells 8192 -ctkt "$1" -ctvt "$1" --kv-tail-cpu-frac "$2" 2> /tmp/c.err | tee -a "$OUT/cells.jsonl" | \
    python3 -c "import json,sys; r=json.loads(sys.stdin.readline()); print('window 8192 $1 cpu $2:', round(1000/r['avg_ts'],2), 'ms/token, chosen', r.get('kv_tail_cpu_frac_chosen'), 'samples', [round(1000/x,2) for x in r['samples_ts']])"
  grep -h "CPU part of the tail" /tmp/c.err | head -1
done
