#!/usr/bin/env bash
# Device call on the prebuilt CUDA build: pre-launch tail copies on and off (GGML_RKV_PRELAUNCH), alternated twice, on
# the q4_0 50% and f16 ~100% tails at depth 16384 (llama-bench -r 3, synthetic 28-layer model). Results: $OUT/log.txt.
. "$(dirname "$0")/device-lib.sh"
use_prebuilt
synth_model
for args in "--kv-window-cells 8192 -ctkt q4_0 -ctvt q4_0" "--kv-window-cells 256"; do
  for pre in 1 0 1 0; do
    # shellcheck disable=SC2086
    GGML_RKV_PRELAUNCH=$pre timeout 60 "$B/build/bin/llama-bench" -m $SYNTH -fa 1 -p 0 -n 32 -d 16384 -r 3 -ngl 99 -o json \
      --kv-residency-mode window $args 2>/dev/null | python3 -c "import json,sys; r=json.load(sys.stdin)[0]; \
print('%-45s prelaunch $pre %7.2f ms  samples %s' % ('$args', 1000/r['avg_ts'], [round(1000/x, 2) for x in r['samples_ts']]))"
  done
done
