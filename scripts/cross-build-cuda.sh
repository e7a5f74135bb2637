#!/usr/bin/env bash
# Cross-build this checkout's series for CUDA (sm_90) on a machine with nvcc but no NVIDIA driver (the dev VM), and
# pack it for device calls that then need no build (scripts/device/*.sh --prebuilt): .device/prebuilt/cuda-build.tar.xz
# (xz: the build and .device/src must fit the 64 MiB a call carries).
# No libcuda here: ggml-cuda links against an empty stub with the driver's SONAME (libcuda.so.1), and its cu*
# symbols resolve at load time on the GPU machine (--no-as-needed keeps libcuda.so.1 in its DT_NEEDED). CPU code is built for AVX2/FMA/F16C, not -march=native.
# usage: scripts/cross-build-cuda.sh [BUILD_DIR]   (default /tmp/rkv-cross-cuda; ~35 min on 2 cores the first time, then
# minutes: a changed series rebuilds only the files it changed)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. .venv/bin/activate
B="${1:-/tmp/rkv-cross-cuda}"
mkdir -p "$B" /tmp/cudastub
[ -f /tmp/cudastub/libcuda.so ] || echo "" | gcc -shared -x c - -o /tmp/cudastub/libcuda.so -Wl,-soname,libcuda.so.1
# ggml-cuda links cuBLAS, which a bare toolkit (nvcc from pip wheels) lacks: fetch the wheel of the toolkit's major version
# and copy its headers and libraries into the toolkit (a fresh dev VM has none; the GPU machine has its own)
cuda_root="$(readlink -f "$(cd /tmp && echo 'int main(){}' > rkv-nvcc-probe.cu && nvcc --dryrun rkv-nvcc-probe.cu 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)")"
if [ ! -e "$cuda_root/lib64/libcublas.so" ] && [ ! -e "$cuda_root/targets/x86_64-linux/lib/libcublas.so" ]; then
  major="$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')"
  echo "==> cuBLAS is missing from $cuda_root: installing nvidia-cublas==$major.* into it (~420 MB download)"
  rm -rf /tmp/rkv-cublas && mkdir -p /tmp/rkv-cublas
  python -m pip download -q --no-deps -d /tmp/rkv-cublas "nvidia-cublas==$major.*" ||
    { echo "error: cannot download nvidia-cublas==$major.*: install cuBLAS into $cuda_root by hand" >&2; exit 1; }
  (cd /tmp/rkv-cublas && python -m zipfile -e nvidia_cublas-*.whl x)
  d="$(dirname "$(find /tmp/rkv-cublas/x -name cublas_v2.h | head -1)")/.."
  cp "$d"/include/*.h "$cuda_root/include/" && cp -P "$d"/lib/lib*.so* "$cuda_root/lib64/"
  for l in "$cuda_root"/lib64/libcublas*.so.*; do ln -sf "$(basename "$l")" "${l%%.so.*}.so"; done
fi
PIN=$(python -c "from rollingkv_cli.lib import upstream; print(upstream.PIN.llama_cpp_commit)")
SER=$(python -c "from rollingkv_cli.lib import patchset; print(patchset.load_series().hash)")
# the targets `rollingkv build` builds for the op and its tests (builder.py), bar the backends libllama pulls in
TARGETS=$(python -c "from rollingkv_cli.lib import builder as b
print(' '.join((*b.BASE_TARGETS, b.OP_TEST_TARGET, b.CPU_DECODE_TEST_TARGET, b.BACKEND_OPS_TEST_TARGET)))")
# the pinned tree with this checkout's series applied. A tree of another series is updated in place, file by file:
# a file whose bytes did not change keeps its timestamp, so ninja rebuilds only what the series changed (a fresh tree
# rebuilds everything: ~35 min on 2 cores, ccache or not)
if [ "$(cat "$B/series" 2>/dev/null)" != "$SER" ]; then
  rm -rf "$B/src.new"
  rollingkv patches checkout "$B/src.new"
  if [ -d "$B/src" ]; then
    python - "$B/src.new" "$B/src" <<'PY'
import filecmp, os, shutil, sys
new, old = sys.argv[1:]
changed = 0
for root, dirs, files in os.walk(new):
    rel = os.path.relpath(root, new)
    dst_root = os.path.join(old, rel)
    os.makedirs(dst_root, exist_ok=True)
    for f in files:
        s, d = os.path.join(root, f), os.path.join(dst_root, f)
        if os.path.islink(s) or os.path.islink(d) or not os.path.isfile(d) or not filecmp.cmp(s, d, shallow=False):
            if os.path.lexists(d):
                os.remove(d)
            shutil.copy2(s, d, follow_symlinks=False)  # the new checkout's timestamp: newer than the objects built before
            changed += 1
for root, dirs, files in os.walk(old, topdown=False):
    rel = os.path.relpath(root, old)
    for f in files:
        if not os.path.lexists(os.path.join(new, rel, f)):
            os.remove(os.path.join(root, f))
            changed += 1
    if not os.path.isdir(os.path.join(new, rel)):
        os.rmdir(root)
print(f"==> the tree of the new series: {changed} files changed")
PY
    rm -rf "$B/src.new"
  else
    mv "$B/src.new" "$B/src"
  fi
  echo "$SER" > "$B/series"
fi
ccache_flag=-DGGML_CCACHE=OFF
command -v ccache >/dev/null && ccache_flag=-DGGML_CCACHE=ON  # its launcher covers nvcc too
cmake -S "$B/src" -B "$B/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF $ccache_flag \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DCUDA_cuda_driver_LIBRARY=/tmp/cudastub/libcuda.so -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined \
  "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--allow-shlib-undefined -Wl,--no-as-needed" -DROLLINGKV_PIN="$PIN" -DROLLINGKV_SERIES="${SER:0:16}" > "$B/configure.log"
# shellcheck disable=SC2086
ninja -C "$B/build" -j "$(nproc)" $TARGETS
python - "$B" "$PIN" "$SER" $TARGETS <<'PY'
import json, sys, time
from rollingkv_cli.lib import builder
b, pin, ser, *targets = sys.argv[1:]
json.dump({"pin": pin, "series_hash": ser, "source": "cross-built on the dev VM (scripts/cross-build-cuda.sh)",
           "options": {"cuda": True, "cuda_arch": "90", "backend_dl": False, "toolchain": "gcc", "source": None,
                       "pinned": True, "unpatched": False},
           "artifacts": builder.artifacts_for(targets), "cuda_arch": "90",
           "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, open(f"{b}/manifest.json", "w"), indent=2)
PY
mkdir -p .device/prebuilt
# the build tree's RUNPATHs are absolute: unpack at the same path (tar -C / on the device)
rm -f .device/prebuilt/cuda-build.tgz && tar -C / -cf - "${B#/}/manifest.json" "${B#/}/build/bin" | xz -T0 -6 > .device/prebuilt/cuda-build.tar.xz
echo "$B" > .device/prebuilt/dir
git rev-parse --short HEAD > .device/prebuilt/commit
ls -la .device/prebuilt
