#!/usr/bin/env bash
# Pack what the GPU machine cannot download into .device/ (git-ignored), to be named in the device
# tool's `carry`: the pinned llama.cpp tree (trimmed: no other GPU backends, docs, models), the
# pure-Python llama_cpp bindings and their pure-Python deps, and optionally the demo model in
# parts below the per-call transfer limit.
#   scripts/device-pack.sh            -> .device/src  (llama.cpp.tgz + pylib.tgz)
#   scripts/device-pack.sh --model    -> also .device/model1 and .device/model2 (demo GGUF halves)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. "${ROLLINGKV_VENV:-.venv}/bin/activate"
tree="$(python -c 'from rollingkv_cli import upstream; print(upstream.pristine_tree(log=lambda m: None))')"
mkdir -p .device/src
tar -C "$tree" -czf .device/src/llama.cpp.tgz \
  --exclude='ggml/src/ggml-vulkan' --exclude='ggml/src/ggml-sycl' --exclude='ggml/src/ggml-cann' \
  --exclude='ggml/src/ggml-opencl' --exclude='ggml/src/ggml-webgpu' --exclude='ggml/src/ggml-hexagon' \
  --exclude='ggml/src/ggml-openvino' --exclude='ggml/src/ggml-zdnn' --exclude='ggml/src/ggml-zendnn' \
  --exclude='ggml/src/ggml-virtgpu' --exclude='ggml/src/ggml-metal' --exclude='ggml/src/ggml-musa' \
  --exclude='ggml/src/ggml-et' --exclude='tools/server/tests' --exclude='tools/server/webui' \
  --exclude='benches' --exclude='examples' --exclude='pocs' --exclude='conversion' .
site="$(python -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent.parent)')"
tar -C "$site" -czf .device/src/pylib.tgz --exclude='__pycache__' llama_cpp diskcache
if [ "${1:-}" = "--model" ]; then
  model="$(rollingkv model demo --print-path)"
  mkdir -p .device/model1 .device/model2
  half=$(( ($(stat -c %s "$model") + 1) / 2 ))
  head -c "$half" "$model" > .device/model1/demo.part1
  tail -c +$((half + 1)) "$model" > .device/model2/demo.part2
fi
du -sh .device/* | sed 's/^/packed: /'
