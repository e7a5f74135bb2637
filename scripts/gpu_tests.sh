#!/usr/bin/env bash
# Device call (GPU machine, .device/src + .device/series carried): build the CUDA series, run the whole op test on
# CUDA0 (device tail, then pinned-host tail through the scheduler) and the GPU test suite (pytest -m gpu).
# Results: $OUT/log.txt, $OUT/optest-*.txt.
. "$(dirname "$0")/device-lib.sh"
step build
bash scripts/device-run.sh build --cuda --cuda-arch 90 -q > /tmp/build.txt 2>&1 || { tail -40 /tmp/build.txt; exit 1; }
B="$(python3 -m rollingkv_cli build --cuda --cuda-arch 90 --source /tmp/rkv-src --print-dir)"; export ROLLINGKV_BUILD="$B"
step "op test on CUDA0, whole matrix"
for host in "" "--tail-host"; do
  "$B/build/bin/test-rolling-kv-ops" -b CUDA0 $host > "/tmp/optest$host.txt" 2>&1; echo "op test -b CUDA0 $host: exit $?"
  grep -E "FAIL|passed" "/tmp/optest$host.txt" | cut -c1-260 | tail -20
  grep -h "exact:" "/tmp/optest$host.txt" | sed 's/.*exact: op \([^,]*\), stock \([^ ]*\).*/\1 \2/' | \
    awk '{r=$1/$2; if (r>m) m=r; n++} END {print n+0 " cases decided by the double-precision reference; worst op/stock NMSE ratio " m+0}'
done
cp /tmp/optest.txt "$OUT/optest-cuda0.txt"; cp /tmp/optest--tail-host.txt "$OUT/optest-cuda0-tail-host.txt"
step "GPU tests (pytest -m gpu)"
timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py -rs -p no:cacheprovider 2>&1 | tail -15
step done
