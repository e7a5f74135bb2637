#!/usr/bin/env bash
# Device entry point (runs ON the GPU machine; docs/device.md): the GPU checks of a series. The whole op test on CUDA0
# with a device tail, then with a pinned-host tail through the scheduler, and the GPU test suite (pytest -m gpu).
#   bash scripts/device/gpu-tests.sh [--prebuilt|--cuda]
# --prebuilt: the cross-built CUDA build (carry .device/prebuilt, .device/src); --cuda: build it here from the carried
# tree (carry .device/src, optionally .device/series); default: --prebuilt when .device/prebuilt is carried.
# Results: $OUT/log.txt, $OUT/optest-cuda0.txt, $OUT/optest-cuda0-tail-host.txt. Exit 1 when a check failed.
mode=auto
case "${1:-}" in
  --prebuilt|--cuda) mode=${1#--}; shift ;;
  "") ;;
  *) echo "usage: $0 [--prebuilt|--cuda]" >&2; exit 2 ;;
esac
# shellcheck source=SCRIPTDIR/lib.sh
. "$(dirname "$0")/lib.sh"
pick_build "$mode"
rc=0
step "op test on CUDA0, whole matrix"
op_tests_cuda || rc=1
step "GPU tests (pytest -m gpu)"
gpu_tests || rc=1
step "done (exit $rc)"
exit $rc
