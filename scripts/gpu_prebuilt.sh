#!/usr/bin/env bash
# Device call that needs no build: the CUDA build of the committed series cross-built on the dev VM
# (scripts/cross-build-cuda.sh; carry .device/prebuilt, .device/src, .device/series). Runs the GPU tests
# (pytest -m gpu, including four parallel spilled sequences) and `rollingkv serve` without -ngl on a KV that does
# not fit. Results: $OUT/log.txt.
. "$(dirname "$0")/device-lib.sh"
step "unpack (gguf-py, bindings, the prebuilt build of $(cat .device/prebuilt/commit 2>/dev/null))"
mkdir -p /tmp/rkv-src /tmp/rkv-pylib
tar -C /tmp/rkv-src -xzf .device/src/llama.cpp.tgz && tar -C /tmp/rkv-pylib -xzf .device/src/pylib.tgz
tar -C / -xzf .device/prebuilt/cuda-build.tgz   # at the path it was built in: its RUNPATHs are absolute
B="$(cat .device/prebuilt/dir)"; export ROLLINGKV_BUILD="$B" B
ldd "$B/build/bin/libggml-cuda.so" | grep -E "libcuda|cublas|cudart|not found"

step "GPU tests (pytest -m gpu)"
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py -rs -p no:cacheprovider 2>&1 | tail -14

step "rollingkv serve without -ngl on a KV that does not fit the target: all layers on the GPU, auto splits the KV"
SYNTH=/tmp/synth28.gguf
[ -f $SYNTH ] || python3 -m rollingkv_cli model synth $SYNTH --ctx 131072 --force | tail -1
python3 -m rollingkv_cli serve $SYNTH -c 65536 --vram-target 9000 --port 18081 -q > /tmp/serve-nongl.txt 2>&1 &
pid=$!
for i in $(seq 1 240); do curl -sf localhost:18081/health >/dev/null && break; sleep 0.5; done
curl -s localhost:18081/props | python3 -c "import json,sys; p=json.load(sys.stdin).get('rolling_kv') or {}; print({k: p.get(k) for k in ('mode_chosen','window_cells','tail_cells','reason')})"
kill -TERM $pid; wait $pid; echo "serve exit $?"
grep -E "GPU layers|residency" /tmp/serve-nongl.txt | head -3
log=$(grep -o "log: [^ ]*" /tmp/serve-nongl.txt | head -1 | cut -d' ' -f2); [ -f "$log" ] && grep -m2 -E "offloaded [0-9]+/[0-9]+ layers" "$log"
step done
