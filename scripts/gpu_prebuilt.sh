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
serve_without_ngl "$SYNTH"
step done
