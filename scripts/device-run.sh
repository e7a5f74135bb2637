#!/usr/bin/env bash
# Runs ON the GPU machine (through the device tool), from the repository root:
#   scripts/device-run.sh build [rollingkv build flags...]   unpack the carried tree, build into /tmp/rkv-cache
#   scripts/device-run.sh env                               print the exports the other steps use
#   scripts/device-run.sh join-model                        join the carried demo model halves
# Build output lives outside the repo (/tmp), so it survives between calls while the machine is warm.
set -euo pipefail
cd "$(dirname "$0")/.."
export ROLLINGKV_CACHE_DIR=/tmp/rkv-cache ROLLINGKV_OFFLINE=1
export PYTHONPATH="$PWD:/tmp/rkv-pylib${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step="${1:-build}"; shift || true
case "$step" in
  build)
    if [ ! -d /tmp/rkv-src ]; then
      mkdir -p /tmp/rkv-src /tmp/rkv-pylib
      tar -C /tmp/rkv-src -xzf .device/src/llama.cpp.tgz
      tar -C /tmp/rkv-pylib -xzf .device/src/pylib.tgz
    fi
    python3 -m rollingkv_cli build --source /tmp/rkv-src "$@"
    ;;
  join-model)
    mkdir -p /tmp/rkv-cache/models
    cat /tmp/rkv-model.part1 .device/model2/demo.part2 > /tmp/rkv-cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
    sha256sum /tmp/rkv-cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
    ;;
  stash-model-part1)
    cp .device/model1/demo.part1 /tmp/rkv-model.part1
    ;;
  env)
    echo "export ROLLINGKV_CACHE_DIR=$ROLLINGKV_CACHE_DIR ROLLINGKV_OFFLINE=1 PYTHONPATH=$PYTHONPATH"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
