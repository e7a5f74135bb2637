#!/usr/bin/env bash
# Device call (GPU machine, repo root, .device/src + .device/series carried) that isolates the open GPU exactness
# bug (docs/perf/2026-11-30-cuda-streaming.md): the split cache on the GPU differs from the resident run from the
# first position that reads the tail, with or without run-ahead. Build, the model-shaped op-test cases, the
# resident run's own order floor (--order-floor: the resident cache with half the batch; is the difference just
# the GPU kernels' floating-point order?), then the same gate under switches that each remove one suspect.
# Results: $OUT/log.txt, $OUT/synth8L-floor*.json, $OUT/optest-*.txt. The suspect switches (AB_VARIANTS=1) all gave
# the same distance on the H200 (docs/perf/2026-11-30-gpu-exactness.md): the difference is the floor, not a bug.
. "$(dirname "$0")/device-lib.sh"
build_cuda
step "op test on CUDA0 (model-shaped cases: permuted Q, GQA 3/4, prefill 512 over a 512 window, long decode)"
op_tests_cuda
M=/tmp/synth-8L.gguf
[ -f $M ] || python3 -m rollingkv_cli model synth $M --layers 8 --embd 2048 --heads 16 --kv-heads 4 --ff 5632 --vocab 32000 --ctx 32768 --force | tail -1
gate() {  # label, env..., then -- gate args
  local label=$1; shift
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 90 python3 -m rollingkv_cli gate equiv --model $M --synthetic-tokens 2048 --kv-window-cells 512 "$@" \
    2>&1 | grep -E "mean total|top-1 agree|bitwise|order floor|PASS|FAIL" | tr -s ' ' | tr '\n' ' '; echo " <- $label"
}
step "teacher-forced gate, synth 8L, window 512 of 2048, f16: the resident run's own order floor (batch 256 vs 512), then one suspect removed per run"
gate floor X=1 -- --order-floor --json "$OUT/synth8L-floor.json"
gate floor-window256 X=1 -- --order-floor --kv-window-cells 256 --json "$OUT/synth8L-floor-w256.json"
[ -n "${AB_VARIANTS:-}" ] && {
gate sched-copy LLAMA_RKV_SCHED_COPY=1 --
gate no-graphs GGML_CUDA_DISABLE_GRAPHS=1 --
gate no-fusion GGML_CUDA_DISABLE_FUSION=1 --
gate runahead0 GGML_RKV_RUNAHEAD=0 --
gate nbatch32 X=1 -- --n-batch 32
gate cpu-op X=1 -- -ngl 0
}
gate q8_0-tail X=1 -- -ctkt q8_0 -ctvt q8_0 --tail-baseline --order-floor
step done
