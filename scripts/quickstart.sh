#!/usr/bin/env bash
# From a fresh clone: set up, build the patched llama.cpp (CUDA when nvcc and a GPU are present,
# else CPU), fetch the demo model, and answer a prompt with it through rollingkv.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
# shellcheck disable=SC1091
. "${ROLLINGKV_VENV:-.venv}/bin/activate"
rollingkv build
rollingkv model demo
rollingkv run demo -p "${1:-What is the capital of France? Answer in one sentence.}"
