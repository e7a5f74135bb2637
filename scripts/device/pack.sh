#!/usr/bin/env bash
# Run HERE (with .venv, scripts/bootstrap.sh): pack what the GPU machine cannot download into .device/ (git-ignored),
# to be named in the device tool's `carry` (64 MiB in all). docs/device.md is the workflow.
#   scripts/device/pack.sh             .device/src: the pinned llama.cpp tree, trimmed (no other GPU backends, docs,
#                                      models; ~8 MiB), and the pure-Python llama_cpp bindings with their pure-Python
#                                      deps; made again only when the pin changed
#   scripts/device/pack.sh --series    also .device/series: native/, native-lab/ and patches/ as committed at HEAD, which the
#                                      device scripts put in place of the working copy's (uncommitted edits stay here)
#   scripts/device/pack.sh --model     also .device/model1 and .device/model2: the demo GGUF in two halves (~47 MiB
#                                      each), one per call, under the per-call transfer limit
# The prebuilt CUDA build (.device/prebuilt) comes from scripts/cross-build-cuda.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
series=0 model=0
for a in "$@"; do
  case "$a" in
    --series) series=1 ;;
    --model) model=1 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "usage: $0 [--series] [--model]" >&2; exit 2 ;;
  esac
done
# shellcheck disable=SC1091
. "${ROLLINGKV_VENV:-.venv}/bin/activate"
pin="$(python -c 'from rollingkv_cli.lib import upstream; print(upstream.PIN.llama_cpp_commit)')"
if [ "$(cat .device/src/pin 2>/dev/null)" != "$pin" ] || [ ! -f .device/src/llama.cpp.tgz ] || [ ! -f .device/src/pylib.tgz ]; then
  tree="$(python -c 'from rollingkv_cli.lib import upstream; print(upstream.pristine_tree(log=lambda m: None))')"
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
  echo "$pin" > .device/src/pin
fi
if [ $series = 1 ]; then
  mkdir -p .device/series
  git archive --format=tar.gz -o .device/series/series.tgz HEAD native native-lab patches
  git rev-parse --short HEAD > .device/series/commit
  if ! git diff --quiet HEAD -- native native-lab patches; then
    echo "note: native/, native-lab/ or patches/ have uncommitted changes; .device/series holds HEAD ($(cat .device/series/commit))"
  fi
fi
if [ $model = 1 ]; then
  m="$(rollingkv model demo --print-path)"
  mkdir -p .device/model1 .device/model2
  half=$(( ($(stat -c %s "$m") + 1) / 2 ))
  head -c "$half" "$m" > .device/model1/demo.part1
  tail -c +$((half + 1)) "$m" > .device/model2/demo.part2
fi
du -sh .device/* | sed 's/^/packed: /'
