#!/usr/bin/env bash
# Device call that needs no build: the CUDA build of the committed series cross-built on the dev VM
# (scripts/cross-build-cuda.sh; carry .device/prebuilt, .device/src, .device/series). Runs the GPU tests
# (pytest -m gpu, including four parallel spilled sequences) and `rollingkv serve` without -ngl on a KV that does
# not fit. Results: $OUT/log.txt.
. "$(dirname "$0")/device-lib.sh"
step "unpack (gguf-py, bindings, the prebuilt build)"
use_prebuilt
ldd "$B/build/bin/libggml-cuda.so" | grep -E "libcuda|cublas|cudart|not found"

step "GPU tests (pytest -m gpu)"
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py -rs -p no:cacheprovider 2>&1 | tail -14

step "rollingkv serve without -ngl on a KV that does not fit the target: all layers on the GPU, auto splits the KV"
synth_model
serve_without_ngl "$SYNTH"
step done
