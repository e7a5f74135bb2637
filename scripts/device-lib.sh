# Sourced by the gpu_*.sh device-call scripts, which run ON the GPU machine (through the device tool):
# - the environment the carried tree needs (cache in /tmp, offline, the packed llama_cpp bindings and gguf-py);
# - $OUT, with everything the script prints also in $OUT/log.txt, and step() for section headers;
# - the committed patch series (.device/series/series.tgz, made from HEAD) in place of the working copy's
#   native/ and patches/, so uncommitted work in progress never reaches a device build;
# - the demo model, which travels in two halves over two back-to-back calls: the first half is kept in /tmp,
#   the model is joined when the second half arrives.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/rkv-out}"; mkdir -p "$OUT"
export ROLLINGKV_CACHE_DIR="${ROLLINGKV_CACHE_DIR:-/tmp/rkv-cache}" ROLLINGKV_OFFLINE=1 PYTHONUNBUFFERED=1 COLUMNS="${COLUMNS:-160}"
export PYTHONPATH="$PWD:/tmp/rkv-pylib:/tmp/rkv-src/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
exec > >(tee -a "$OUT/log.txt") 2>&1
step() { echo "== $1 ($(date +%T))"; }
if [ -f .device/series/series.tgz ]; then
  rm -rf native patches && tar -xzf .device/series/series.tgz && echo "series from $(cat .device/series/commit 2>/dev/null)"
fi
[ -f .device/model1/demo.part1 ] && bash scripts/device-run.sh stash-model-part1
if [ ! -f /tmp/rkv-cache/models/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ -f .device/model2/demo.part2 ] && [ -f /tmp/rkv-model.part1 ]; then
  bash scripts/device-run.sh join-model
fi

# build the committed series for CUDA (sm_90) in this machine's /tmp cache; sets B (the build dir) and ROLLINGKV_BUILD
build_cuda() {
  step build
  bash scripts/device-run.sh build --cuda --cuda-arch 90 -q > /tmp/build.txt 2>&1 || { tail -40 /tmp/build.txt; exit 1; }
  B="$(python3 -m rollingkv_cli build --cuda --cuda-arch 90 --source /tmp/rkv-src --print-dir)"; export ROLLINGKV_BUILD="$B"
}

# the whole op test on CUDA0, with a device tail and then a pinned-host tail through the scheduler: failures, totals,
# and the cases the double-precision reference decided; full logs to $OUT/optest-cuda0{,-tail-host}.txt
op_tests_cuda() {
  local host
  for host in "" "--tail-host"; do
    "$B/build/bin/test-rolling-kv-ops" -b CUDA0 $host > "/tmp/optest$host.txt" 2>&1; echo "op test -b CUDA0 $host: exit $?"
    grep -E "FAIL|passed" "/tmp/optest$host.txt" | cut -c1-260 | tail -20
    grep -h "exact:" "/tmp/optest$host.txt" | sed 's/.*exact: op \([^,]*\), stock \([^ ]*\).*/\1 \2/' | \
      awk '{r=$1/$2; if (r>m) m=r; n++} END {print n+0 " cases decided by the double-precision reference; worst op/stock NMSE ratio " m+0}'
  done
  cp /tmp/optest.txt "$OUT/optest-cuda0.txt"; cp /tmp/optest--tail-host.txt "$OUT/optest-cuda0-tail-host.txt"
}

# `rollingkv serve MODEL -c 65536 --vram-target 9000` without -ngl: the GPU-layers note, the plan, the offload log
serve_without_ngl() {
  local model=$1 pid log
  python3 -m rollingkv_cli serve "$model" -c 65536 --vram-target 9000 --port 18081 -q > /tmp/serve-nongl.txt 2>&1 &
  pid=$!
  for i in $(seq 1 240); do curl -sf localhost:18081/health >/dev/null && break; sleep 0.5; done
  curl -s localhost:18081/props | python3 -c "import json,sys; p=json.load(sys.stdin).get('rolling_kv') or {}; print({k: p.get(k) for k in ('mode_chosen','window_cells','tail_cells','reason')})"
  kill -TERM $pid; wait $pid; echo "serve exit $?"
  grep -E "GPU layers|residency" /tmp/serve-nongl.txt | head -3
  log=$(grep -o "log: [^ ]*" /tmp/serve-nongl.txt | head -1 | cut -d' ' -f2); [ -f "$log" ] && grep -m2 -E "offloaded [0-9]+/[0-9]+ layers" "$log"
}

# the CUDA build cross-built on the dev VM (scripts/cross-build-cuda.sh; carry .device/prebuilt, .device/src) with the
# packed gguf-py and llama_cpp bindings; sets and exports B and ROLLINGKV_BUILD. Always unpacked (a warm machine may
# hold an older build at the same path), at the path it was built in: its RUNPATHs are absolute.
use_prebuilt() {
  mkdir -p /tmp/rkv-src /tmp/rkv-pylib
  [ -d /tmp/rkv-src/gguf-py ] || { tar -C /tmp/rkv-src -xzf .device/src/llama.cpp.tgz && tar -C /tmp/rkv-pylib -xzf .device/src/pylib.tgz; }
  B="$(cat .device/prebuilt/dir)"; tar -C / -xzf .device/prebuilt/cuda-build.tgz
  export B ROLLINGKV_BUILD="$B"
  echo "prebuilt build of $(cat .device/prebuilt/commit 2>/dev/null) in $B"
}

# the synthetic 28-layer model of anchors.md, written once per machine; sets SYNTH
synth_model() {
  SYNTH=/tmp/synth28.gguf
  [ -f $SYNTH ] || python3 -m rollingkv_cli model synth $SYNTH --ctx 131072 --force | tail -1
}
