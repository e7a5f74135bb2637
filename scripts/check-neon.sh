#!/usr/bin/env bash
# The hybrid tail's CPU decode attention on AArch64 (its NEON path), checked under emulation on an x86-64 Linux host:
# test-rolling-kv-cpu-decode cross-compiled standalone (RKV_CPU_DECODE_STANDALONE: the CPU part's sources of ggml-cpu,
# rolling-kv-cpu-decode.cpp and rolling-kv-cpu-part.cpp, compiled in; ggml-base cross-built as a static library; no
# backends, no --bench) for two targets:
#   armv8.2-a+dotprod+fp16   the quantized K's integer dot by vdotq_s32    (the path names itself "neon-dotprod")
#   armv8-a                  the same by vmull_s8 / vpadalq_s16            ("neon")
# each run with qemu-aarch64 against the test's double-precision reference: every case on that NEON path, and on the
# scalar path in the armv8-a build. Fails unless the kernel picked the NEON path of that target by itself
# (rkv_cpu_decode_isa, "default isa: ...") and every case passed. A run of one path takes about a minute under qemu.
#
# usage: scripts/check-neon.sh [WORK_DIR]   (default /tmp/rkv-check-neon: the patched tree and the cross-built ggml-base
#        are kept there for the series they were made for; about 2 minutes the first time on 2 cores, then the runs)
# needs: aarch64-linux-gnu-g++ and qemu-aarch64 (Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu qemu-user), cmake,
#        ninja, and the pinned llama.cpp source (`rollingkv build` fetches it). PYTHON: the interpreter that runs
#        rollingkv (default: .venv/bin/python, else python3).
# exit: 0 passed, 1 failed, 3 a tool is missing
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
W="${1:-/tmp/rkv-check-neon}"
PY="${PYTHON:-}"
[ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python || PY=python3; }
SYSROOT="${RKV_AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}"
for t in aarch64-linux-gnu-g++ aarch64-linux-gnu-gcc qemu-aarch64 cmake ninja; do
  command -v "$t" >/dev/null || { echo "error: $t not found (apt-get install g++-aarch64-linux-gnu qemu-user cmake ninja-build)" >&2; exit 3; }
done
rkv() { PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m rollingkv_cli "$@"; }

# the pinned tree with this checkout's series (a tree of another series is replaced)
SER="$(PYTHONPATH="$ROOT" "$PY" -c "from rollingkv_cli.lib import patchset; print(patchset.load_series().hash)")"
mkdir -p "$W"
if [ "$(cat "$W/series" 2>/dev/null)" != "$SER" ]; then
  rm -rf "$W/src" "$W/ggml-base"
  rkv patches checkout "$W/src" > "$W/checkout.log" 2>&1 || { cat "$W/checkout.log" >&2; exit 1; }
  echo "$SER" > "$W/series"
fi
T="$W/src"

# ggml-base for AArch64 (a static library: the quantization, f16 rows and type traits the test's reference uses, the
# ROLLINGKV_* knobs the pool reads); the CPU backend itself is not built
LIB="$( (find "$W/ggml-base" -name libggml-base.a 2>/dev/null || true) | head -1)"
if [ -z "$LIB" ]; then
  echo "==> ggml-base for aarch64"
  rm -rf "$W/ggml-base"
  # configured from the tree's root (ggml/ alone is not a complete project in llama.cpp), built for ggml-base only
  cmake -S "$T" -B "$W/ggml-base" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_SYSTEM_NAME=Linux \
    -DCMAKE_SYSTEM_PROCESSOR=aarch64 -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ \
    -DBUILD_SHARED_LIBS=OFF -DGGML_CPU=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_COMMON=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_OPENSSL=OFF -DROLLINGKV_BUILD_OP_TESTS=OFF > "$W/configure.log" 2>&1 || { tail -20 "$W/configure.log" >&2; exit 1; }
  ninja -C "$W/ggml-base" ggml-base > "$W/ggml-base.log" 2>&1 || { tail -30 "$W/ggml-base.log" >&2; exit 1; }
  LIB="$(find "$W/ggml-base" -name libggml-base.a | head -1)"
  [ -n "$LIB" ] || { echo "error: no libggml-base.a under $W/ggml-base" >&2; exit 1; }
fi

fail=0
for target in "armv8.2-a+dotprod+fp16:neon-dotprod" "armv8-a:neon"; do
  march="${target%%:*}" want="${target##*:}"
  # the paths each build checks: its NEON path; the scalar one once (the same code in both builds)
  if [ "$want" = neon ]; then isas=("$want" scalar); args=(); else isas=("$want"); args=(--isa "$want"); fi
  bin="$W/test-rolling-kv-cpu-decode-${want}"
  echo "==> -march=$march: the $want path"
  aarch64-linux-gnu-g++ -std=c++17 -O2 -march="$march" -pthread -DRKV_CPU_DECODE_STANDALONE \
    -I"$T/ggml/include" -I"$T/ggml/src" -I"$T/ggml/src/ggml-cpu" \
    "$T/tests/test-rolling-kv-cpu-decode.cpp" "$T/ggml/src/ggml-cpu/rolling-kv-cpu-decode.cpp" \
    "$T/ggml/src/ggml-cpu/rolling-kv-cpu-part.cpp" "$LIB" -lm -o "$bin"
  out="$W/run-${want}.log"
  rc=0
  qemu-aarch64 -L "$SYSROOT" "$bin" ${args[@]+"${args[@]}"} > "$out" 2>&1 || rc=$?
  grep -E '^(default isa|isa |[0-9]+ passed)' "$out" || true
  ok=1
  [ "$rc" -eq 0 ] || { echo "FAIL: exit $rc"; ok=0; }
  grep -qx "default isa: $want" "$out" || { echo "FAIL: the kernel did not pick the $want path by itself"; ok=0; }
  for isa in "${isas[@]}"; do
    grep -qE "^isa $isa: 252 cases, 0 failed, worst relative error " "$out" || { echo "FAIL: the $isa path did not pass its 252 cases"; ok=0; }
  done
  [ "$(tail -1 "$out")" = "$((252 * ${#isas[@]})) passed, 0 failed" ] || { echo "FAIL: $(tail -1 "$out")"; ok=0; }
  if [ "$ok" -eq 1 ]; then echo "ok: $want"; else grep '^FAIL' "$out" | head -20; fail=1; fi
done
if [ "$fail" -ne 0 ]; then
  echo "check-neon: FAILED (logs in $W)"
  exit 1
fi
echo "check-neon: passed (the NEON paths with and without the dot-product extension, under qemu-aarch64)"
