#!/usr/bin/env bash
# Device call on the prebuilt CUDA build (carry .device/prebuilt, .device/src, .device/series): the GPU timeline of a
# decode token (GGML_RKV_PROFILE=1, CUDA graphs off, see native/ggml/src/ggml-cuda/rolling-kv-profile.cuh) at depth
# 16384 on the synthetic 28-layer model: resident, 25% and 50% f16 tails, a 50% q4_0 tail, and the 50% tail without
# copies, the scheduler's split inputs, then the GPU tests. Results: $OUT/log.txt, $OUT/profile-*.txt.
. "$(dirname "$0")/device-lib.sh"
use_prebuilt
synth_model
D=${D:-16384}; N=16
prof() {  # label, env..., -- llama-bench residency args (graphs on unless the env says otherwise)
  local label=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  step "$label"
  env GGML_RKV_PROFILE=1 GGML_RKV_PROFILE_HOLD_US=80000 "${envs[@]}" timeout 150 "$B/build/bin/llama-bench" -m $SYNTH -fa 1 -p 0 \
    -n $N -d $D -r 1 -ngl 99 -o json "$@" > /tmp/prof.json 2> /tmp/prof.err
  python3 -c "import json; r=json.load(open('/tmp/prof.json'))[0]; print('llama-bench: %.3f ms/token' % (1000/r['avg_ts']))"
  grep "rkv profile" /tmp/prof.err > "$OUT/profile-${label// /_}.txt"
  awk '/rkv profile \[/ {show = ($0 ~ / ubatch 1:/)} show' /tmp/prof.err | grep "rkv profile" | head -24
}
for w in off 12288 8192; do
  a="--kv-residency-mode window --kv-window-cells $w"; [ $w = off ] && a="--kv-residency-mode off"
  prof "graphs $w" X=1 -- $a
done
prof "graphs 8192 q4_0" X=1 -- --kv-residency-mode window --kv-window-cells 8192 -ctkt q4_0 -ctvt q4_0
step "scheduler split inputs of a spilled decode graph, window 512 of 1024 (GGML_SCHED_DEBUG=2)"
GGML_SCHED_DEBUG=2 timeout 60 "$B/build/bin/llama-bench" -m $SYNTH -fa 1 -p 0 -n 2 -d 1024 -r 1 -ngl 99 -v \
  --kv-residency-mode window --kv-window-cells 512 > /dev/null 2> /tmp/sched.err
grep -o "## SPLIT #[0-9]*: [A-Za-z0-9]* # [0-9]* inputs" /tmp/sched.err | sort | uniq -c
grep -o "## SPLIT #1: CUDA0 # [0-9]* inputs: .*" /tmp/sched.err | tail -1 | cut -c1-400
if [ "${GPU_TESTS:-1}" = 1 ]; then
  step "GPU tests (pytest -m gpu) on this build"
  timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py -rs -p no:cacheprovider 2>&1 | tail -8
fi
step done
