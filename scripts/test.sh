#!/usr/bin/env bash
# From a fresh clone: set up, build the CPU variant the tests use (and the CUDA one when the machine
# has nvcc and a GPU, for the GPU tests), then run the test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
# shellcheck disable=SC1091
. "${ROLLINGKV_VENV:-.venv}/bin/activate"
rollingkv build --no-cuda
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  rollingkv build --cuda
fi
rollingkv model demo
python -m pytest -ra "$@"
