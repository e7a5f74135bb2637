#!/usr/bin/env bash
# Device call on the prebuilt CUDA build (carry .device/prebuilt, .device/src, .device/series): an A/B of a tail-copy
# setting (AB_VAR, values AB_VALUES; default GGML_RKV_PRELAUNCH 1 0. Session 4 ran it on GGML_RKV_COPY_STREAMS and
# GGML_RKV_COPY_KIND, two experiments since reverted: docs/perf/2026-11-30-where-decode-time-goes.md). Exactness
# first: the op test with a pinned-host tail on CUDA0 for every value (quick set, plus the whole set at the default);
# then decode at depth 16384 (llama-bench -r 3, synthetic 28-layer model) per value, f16 25%/50% and q4_0 50% tails,
# and the host time of a CUDA graph launch per value (GGML_RKV_PROFILE=1). Results: $OUT/log.txt, $OUT/ab.jsonl.
. "$(dirname "$0")/device-lib.sh"
use_prebuilt
step "op test -b CUDA0 --tail-host"
optest() { # name, env..., -- args
  local name=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 240 "$B/build/bin/test-rolling-kv-ops" -b CUDA0 "$@" > "$OUT/optest-$name.txt" 2>&1
  echo "$name: exit $? $(grep -E "passed" "$OUT/optest-$name.txt" | tail -1)"; grep FAIL "$OUT/optest-$name.txt" | head -5
}
AB_VAR=${AB_VAR:-GGML_RKV_PRELAUNCH}; AB_VALUES=${AB_VALUES:-1 0}
optest tail-host X=1 -- --tail-host
for v in $AB_VALUES; do optest "tail-host-$v" "$AB_VAR=$v" -- --tail-host --quick; done
optest tail-host-chunks256-slots2 GGML_RKV_CHUNK_CELLS=256 GGML_RKV_SLOTS=2 -- --tail-host --quick
synth_model
step "llama-bench -d 16384 -n 32 -r 3 per $AB_VAR"
ab() {  # label, env..., -- llama-bench residency args
  local label=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 120 "$B/build/bin/llama-bench" -m $SYNTH -fa 1 -p 0 -n 32 -d 16384 -r 3 -ngl 99 -o json "$@" 2>/dev/null | \
    python3 -c "import json,sys; r=json.load(sys.stdin)[0]; print(json.dumps({'label': '$label', 'tok_s': r['avg_ts'], 'ms': 1000/r['avg_ts'], 'sd_ts': r['stddev_ts']}))" \
    | tee -a "$OUT/ab.jsonl"
}
for w in 12288 8192; do
  for v in $AB_VALUES; do ab "f16 window $w, $AB_VAR=$v" "$AB_VAR=$v" -- --kv-residency-mode window --kv-window-cells $w; done
done
for v in $AB_VALUES; do ab "q4_0 window 8192, $AB_VAR=$v" "$AB_VAR=$v" -- --kv-residency-mode window --kv-window-cells 8192 -ctkt q4_0 -ctvt q4_0; done
step "host time of a graph launch (GGML_RKV_PROFILE=1), f16 window 8192"
for v in $AB_VALUES; do
  env GGML_RKV_PROFILE=1 "$AB_VAR=$v" timeout 120 "$B/build/bin/llama-bench" -m $SYNTH -fa 1 -p 0 -n 16 -d 16384 -r 1 -ngl 99 \
    --kv-residency-mode window --kv-window-cells 8192 -o json 2>&1 >/dev/null | grep -E "ubatch 1: [0-9]+ CUDA graph|up to graph launch end" | head -2 | sed "s/^/$AB_VAR=$v: /"
done
if [ "${GPU_TESTS:-0}" = 1 ]; then
  step "GPU tests (pytest -m gpu)"
  timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py -rs -p no:cacheprovider 2>&1 | tail -4
fi
step done
