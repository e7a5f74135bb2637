#!/usr/bin/env bash
# Device call on the prebuilt CUDA build (carry .device/prebuilt, .device/src, .device/series): the closing check of a
# series. The whole op test on CUDA0 (device tail, then pinned-host tail), the GPU tests, and decode at depth 16384 for
# the 50% f16 and q4_0 tails next to resident (llama-bench -r 3, synthetic 28-layer model); with BENCH_ARGS also
# `bench tail -d 16384 $BENCH_ARGS`. Results: $OUT/log.txt, $OUT/optest-*.txt, $OUT/bench-tail-16384.json.
. "$(dirname "$0")/device-lib.sh"
use_prebuilt
step "op tests"
op_tests_cuda
step "op test --tail-host --quick: many 256-cell chunks in two slots; pre-launch copies off"
for v in "GGML_RKV_CHUNK_CELLS=256 GGML_RKV_SLOTS=2" "GGML_RKV_PRELAUNCH=0" "GGML_RKV_PRELAUNCH=0 GGML_RKV_CHUNK_CELLS=256 GGML_RKV_SLOTS=2"; do
  # shellcheck disable=SC2086
  env $v timeout 200 "$B/build/bin/test-rolling-kv-ops" -b CUDA0 --tail-host --quick > /tmp/optest-v.txt 2>&1
  echo "$v: exit $? $(grep -E "passed" /tmp/optest-v.txt | tail -1)"; grep FAIL /tmp/optest-v.txt | head -3
done
step "GPU tests (pytest -m gpu)"
timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py -rs -p no:cacheprovider 2>&1 | tail -3
synth_model
step "llama-bench -d 16384 -n 32 -r 3"
for args in "--kv-residency-mode off" "--kv-residency-mode window --kv-window-cells 8192" \
            "--kv-residency-mode window --kv-window-cells 8192 -ctkt q4_0 -ctvt q4_0"; do
  for pre in 1 0; do
    # shellcheck disable=SC2086
    GGML_RKV_PRELAUNCH=$pre timeout 120 "$B/build/bin/llama-bench" -m $SYNTH -fa 1 -p 0 -n 32 -d 16384 -r 3 -ngl 99 -o json $args 2>/dev/null | \
      python3 -c "import json,sys; r=json.load(sys.stdin)[0]; print('%-70s prelaunch $pre %7.2f tok/s (sd %.2f) %6.2f ms' % ('$args', r['avg_ts'], r['stddev_ts'], 1000/r['avg_ts']))"
    [[ "$args" == *off ]] && break
  done
done
if [ -n "${BENCH_ARGS:-}" ]; then
  step "bench tail -d 16384"
  # shellcheck disable=SC2086
  bash scripts/bench-tail.sh --synth /tmp/synth28.gguf -d 16384 --json "$OUT/bench-tail-16384.json" --no-plot $BENCH_ARGS 2>&1 | tail -32
fi
step done
