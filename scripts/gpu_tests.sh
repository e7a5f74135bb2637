#!/usr/bin/env bash
# Device call (GPU machine, .device/src + .device/series carried): build the CUDA series, run the whole op test on
# CUDA0 (device tail, then pinned-host tail through the scheduler) and the GPU test suite (pytest -m gpu).
# Results: $OUT/log.txt, $OUT/optest-*.txt.
. "$(dirname "$0")/device-lib.sh"
build_cuda
step "op test on CUDA0, whole matrix"
op_tests_cuda
step "GPU tests (pytest -m gpu)"
timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py -rs -p no:cacheprovider 2>&1 | tail -15
step done
