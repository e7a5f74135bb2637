#!/usr/bin/env bash
# Device call on the prebuilt CUDA build (scripts/cross-build-cuda.sh; carry .device/prebuilt, .device/src,
# .device/series): where a decode token's time goes at depth 16384 (issue 4's stretch gap). llama-bench on the
# synthetic 28-layer model, resident and with 25% / 50% f16 tails, each also with the speed probes that make the
# outputs wrong: GGML_RKV_DEBUG_SKIP_COPY=1 (no tail copies: compute alone, chunked as usual) and
# GGML_RKV_DEBUG_SKIP_TAIL_ATTN=1 (the copies without the attention over them). Results: $OUT/log.txt, $OUT/probe.jsonl.
. "$(dirname "$0")/device-lib.sh"
use_prebuilt
synth_model
D=16384; N=32
bench() {  # label, env..., -- llama-bench residency args
  local label=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 120 "$B/build/bin/llama-bench" -m $SYNTH -fa 1 -p 0 -n $N -d $D -r 2 -ngl 99 -o json "$@" 2>/dev/null | \
    python3 -c "import json,sys; r=json.load(sys.stdin)[0]; print(json.dumps({'label': '$label', 'tok_s': r['avg_ts'], 'ms': 1000/r['avg_ts']}))" \
    | tee -a "$OUT/probe.jsonl"
}
step "pinned H2D bandwidth"
python3 -m rollingkv_cli probe pcie --json 2>&1 | tr -d "\n " | head -c 1200; echo
step "llama-bench -d $D -n $N, synthetic 28-layer model"
bench resident X=1 -- --kv-residency-mode off
bench "resident again" X=1 -- --kv-residency-mode off
for w in 12288 8192; do
  bench "window $w" X=1 -- --kv-residency-mode window --kv-window-cells $w
  bench "window $w skip-copy" GGML_RKV_DEBUG_SKIP_COPY=1 -- --kv-residency-mode window --kv-window-cells $w
  bench "window $w skip-tail-attn" GGML_RKV_DEBUG_SKIP_TAIL_ATTN=1 -- --kv-residency-mode window --kv-window-cells $w
  bench "window $w skip-both" GGML_RKV_DEBUG_SKIP_COPY=1 GGML_RKV_DEBUG_SKIP_TAIL_ATTN=1 -- --kv-residency-mode window --kv-window-cells $w
  bench "window $w runahead0" GGML_RKV_RUNAHEAD=0 -- --kv-residency-mode window --kv-window-cells $w
done
bench "window 8192 slot 8 MiB" GGML_RKV_SLOT_MIB=8 -- --kv-residency-mode window --kv-window-cells 8192
bench "window 8192 8 slots" GGML_RKV_SLOTS=8 -- --kv-residency-mode window --kv-window-cells 8192
bench "window 8192 graphs off" GGML_CUDA_DISABLE_GRAPHS=1 -- --kv-residency-mode window --kv-window-cells 8192
for t in q4_0; do
  bench "window 8192 $t" X=1 -- --kv-residency-mode window --kv-window-cells 8192 -ctkt $t -ctvt $t
  bench "window 8192 $t skip-copy" GGML_RKV_DEBUG_SKIP_COPY=1 -- --kv-residency-mode window --kv-window-cells 8192 -ctkt $t -ctvt $t
  bench "window 8192 $t skip-tail-attn" GGML_RKV_DEBUG_SKIP_TAIL_ATTN=1 -- --kv-residency-mode window --kv-window-cells 8192 -ctkt $t -ctvt $t
done
step done
