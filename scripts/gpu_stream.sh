#!/usr/bin/env bash
# One device call for the CUDA streaming path (run ON the GPU machine from the repo root, .device/src carried;
# at most 8 files under $OUT): CUDA build, op tests with device and pinned-host tails, the ctypes load check,
# teacher-forced equivalence on the GPU (demo + synthetic model), and a decode smoke benchmark with NVML peaks.
#   STAGES="build optest ctypes gate bench" (default: all)
. "$(dirname "$0")/device-lib.sh"
STAGES="${STAGES:-build optest ctypes gate bench}"
rkv() { python3 -m rollingkv_cli "$@"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

step "build (CUDA sm_90)"
t0=$(date +%s)
bash scripts/device-run.sh build --cuda --cuda-arch 90 -q > "$OUT/build.txt" 2>&1 || { tail -60 "$OUT/build.txt"; exit 1; }
echo "build wall: $(( $(date +%s) - t0 )) s"
B="$(rkv build --cuda --cuda-arch 90 --source /tmp/rkv-src --print-dir)"
BIN="$B/build/bin"
export ROLLINGKV_BUILD="$B"
nvidia-smi --query-gpu=name,memory.used,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader

if has optest; then
  step "op tests: CUDA0 device tail (quick), pinned-host tail (quick), pinned-host tail in 256-cell chunks (quick)"
  { timeout 100 "$BIN/test-rolling-kv-ops" -b CUDA0 --quick; echo "exit $?";
    timeout 100 "$BIN/test-rolling-kv-ops" -b CUDA0 --quick --tail-host; echo "exit $?";
    GGML_RKV_CHUNK_CELLS=256 GGML_RKV_SLOTS=2 timeout 100 "$BIN/test-rolling-kv-ops" -b CUDA0 --quick --tail-host; echo "exit $?";
    GGML_RKV_RUNAHEAD=0 GGML_RKV_CHUNK_CELLS=256 timeout 100 "$BIN/test-rolling-kv-ops" -b CUDA0 --quick --tail-host; echo "exit $?"; } > "$OUT/optests.txt" 2>&1
  grep -E "FAIL|passed|exit|skipped,|Assert|error" "$OUT/optests.txt" | grep -v " OK$" | cut -c1-400 | head -30
fi


if has ctypes; then
  step "ctypes: load the demo model through llama_cpp + our extension"
  nm -D --defined-only "$BIN/libggml-cuda.so"* 2>/dev/null | c++filt | grep -c "std::" | sed 's/^/libggml-cuda exported std:: symbols: /'
  cat > /tmp/load.py <<'PY'
import sys
from pathlib import Path
from rollingkv_cli import gate_runner, llama_ext, builder
b = builder.active_build()
llama_cpp = llama_ext.import_llama_cpp(b.lib_dir)
m = gate_runner.load_model(llama_cpp, b.lib_dir, Path(sys.argv[1]))
print("loaded", bool(m))
PY
  LM=/tmp/rkv-cache/models/SmolLM2-135M-Instruct.Q4_1.gguf; [ -f $LM ] || LM=/tmp/synth-8L.gguf
  [ -f $LM ] || timeout 120 python3 -m rollingkv_cli model synth $LM --layers 8 --embd 2048 --heads 16 --kv-heads 4 --ff 5632 --vocab 32000 --ctx 32768 --force | tail -1
  timeout 60 python3 /tmp/load.py $LM 2>&1 | tail -3; echo "load exit ${PIPESTATUS[0]}"
  LD_DEBUG=bindings timeout 60 python3 /tmp/load.py $LM 2>&1 | grep -m5 "_M_insert" ; true
  LD_PRELOAD="$(g++ -print-file-name=libstdc++.so.6)" timeout 60 python3 /tmp/load.py $LM 2>&1 | tail -1; echo "load with LD_PRELOAD libstdc++ exit ${PIPESTATUS[0]}"
fi

if has gate; then
  if [ -f /tmp/rkv-cache/models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then GM=demo; GL=demo; else
    GM=/tmp/synth-8L.gguf; GL=synth8L
    [ -f $GM ] || timeout 120 python3 -m rollingkv_cli model synth $GM --layers 8 --embd 2048 --heads 16 --kv-heads 4 --ff 5632 --vocab 32000 --ctx 32768 --force | tail -1
  fi
  step "gate equiv on the GPU: $GL, 2048 tokens, window 512: f16 tail, then q8_0 tail"
  timeout 150 python3 -m rollingkv_cli gate equiv --model $GM --synthetic-tokens 2048 --kv-window-cells 512 --json "$OUT/gate-$GL-f16.json" 2>&1 | tail -14; echo "gate exit ${PIPESTATUS[0]}"
  GGML_RKV_RUNAHEAD=0 timeout 150 python3 -m rollingkv_cli gate equiv --model $GM --synthetic-tokens 2048 --kv-window-cells 512 2>&1 | grep -E "mean total|top-1 agree|PASS|FAIL"; echo "gate (run-ahead off) exit ${PIPESTATUS[0]}"
  GGML_RKV_SLOT_MIB=1 timeout 150 python3 -m rollingkv_cli gate equiv --model $GM --synthetic-tokens 2048 --kv-window-cells 512 2>&1 | grep -E "mean total|top-1 agree|PASS|FAIL"; echo "gate (1 MiB slots: many chunks) exit ${PIPESTATUS[0]}"
fi

if has bench; then
  step "probe pcie (measured in this run)"
  timeout 60 python3 -m rollingkv_cli probe pcie --refresh --json > "$OUT/probe.json" 2>&1; echo "probe exit $?"; grep -m3 -E '"resolved|gbps' "$OUT/probe.json" | head -3
  M=/tmp/synth28.gguf
  [ -f $M ] || timeout 150 python3 -m rollingkv_cli model synth $M --ctx 131072 --force | tail -1
  D="${BENCH_DEPTH:-16384}"
  step "bench tail at depth $D (time-boxed)"
  COLUMNS=200 timeout ${BENCH_TIMEOUT:-260} python3 -m rollingkv_cli bench tail $M -d $D -n ${BENCH_N:-32} -r ${BENCH_R:-2} --vanilla-reps 1 --cell-timeout 120 \
    --time-budget ${BENCH_BUDGET:-190} --no-plot ${BENCH_ARGS:-} --json "$OUT/bench-tail-$D.json" 2>&1 | tail -34
  [ -n "${BENCH_ONLY:-}" ] && { step done; exit 0; }
  step "variants at 50% tail: run-ahead off, scheduler copy, CUDA graphs off"
  W="-ngl 99 --kv-residency-mode window --kv-window-cells"
  timeout 90 python3 scripts/gpu_stream_bench.py "$BIN/llama-bench" $M $D "$OUT/bench.jsonl" \
    "tail50=$W $((D/2))" \
    "tail50-runahead0=GGML_RKV_RUNAHEAD=0 $W $((D/2))" \
    "tail50-schedcopy=LLAMA_RKV_SCHED_COPY=1 $W $((D/2))" \
    "tail50-nographs=GGML_CUDA_DISABLE_GRAPHS=1 $W $((D/2))"
fi
step done
