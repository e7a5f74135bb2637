#!/usr/bin/env bash
# Device call on the prebuilt CUDA build (carry .device/prebuilt, .device/src, .device/series): the two copy streams
# (K rows, V rows) of the tail stream. Exactness first: the whole op test with a pinned-host tail on CUDA0, also with
# many small chunks and two slots (slot reuse, run-ahead), and with one copy stream; then decode speed at depth 16384
# with one and with two copy streams (llama-bench, synthetic 28-layer model), then the GPU tests.
# Results: $OUT/log.txt, $OUT/optest-*.txt, $OUT/ab.jsonl.
. "$(dirname "$0")/device-lib.sh"
mkdir -p /tmp/rkv-src /tmp/rkv-pylib
[ -d /tmp/rkv-src/gguf-py ] || { tar -C /tmp/rkv-src -xzf .device/src/llama.cpp.tgz && tar -C /tmp/rkv-pylib -xzf .device/src/pylib.tgz; }
B="$(cat .device/prebuilt/dir)"; tar -C / -xzf .device/prebuilt/cuda-build.tgz; export ROLLINGKV_BUILD="$B"
step "op test -b CUDA0 --tail-host (build of $(cat .device/prebuilt/commit))"
optest() { # name, env..., -- args
  local name=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 240 "$B/build/bin/test-rolling-kv-ops" -b CUDA0 "$@" > "$OUT/optest-$name.txt" 2>&1
  echo "$name: exit $? $(grep -E "passed" "$OUT/optest-$name.txt" | tail -1)"; grep FAIL "$OUT/optest-$name.txt" | head -5
}
optest tail-host X=1 -- --tail-host
optest tail-host-chunks256-slots2 GGML_RKV_CHUNK_CELLS=256 GGML_RKV_SLOTS=2 -- --tail-host --quick
optest tail-host-one-stream GGML_RKV_COPY_STREAMS=1 -- --tail-host --quick
SYNTH=/tmp/synth28.gguf
[ -f $SYNTH ] || python3 -m rollingkv_cli model synth $SYNTH --ctx 131072 --force | tail -1
step "llama-bench -d 16384 -n 32 -r 3: one vs two copy streams"
ab() {  # label, env..., -- llama-bench residency args
  local label=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 120 "$B/build/bin/llama-bench" -m $SYNTH -fa 1 -p 0 -n 32 -d 16384 -r 3 -ngl 99 -o json "$@" 2>/dev/null | \
    python3 -c "import json,sys; r=json.load(sys.stdin)[0]; print(json.dumps({'label': '$label', 'tok_s': r['avg_ts'], 'ms': 1000/r['avg_ts'], 'sd_ts': r['stddev_ts']}))" \
    | tee -a "$OUT/ab.jsonl"
}
for w in 12288 8192; do
  for c in 1 2; do ab "f16 window $w, $c copy streams" GGML_RKV_COPY_STREAMS=$c -- --kv-residency-mode window --kv-window-cells $w; done
done
for c in 1 2; do ab "q4_0 window 8192, $c copy streams" GGML_RKV_COPY_STREAMS=$c -- --kv-residency-mode window --kv-window-cells 8192 -ctkt q4_0 -ctvt q4_0; done
step "GPU tests (pytest -m gpu)"
timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py -rs -p no:cacheprovider 2>&1 | tail -4
step done
