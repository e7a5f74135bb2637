#!/usr/bin/env bash
# The gate matrix (`rollingkv gate matrix`): gate equiv over tail types x split points, the quantized parts'
# exactness, and gate needle; writes docs/gates/<date>-<host>-<backend>.json and .md (or --out DIR).
# Run from anywhere; every argument goes to `rollingkv gate matrix` (see its --help). Examples:
#   scripts/gate-matrix.sh                                      CPU, the demo model, the active build
#   scripts/gate-matrix.sh --tokens 384 --needle-filler-tokens 640   CI sizes (tests/gate/test_matrix.py)
#   scripts/gate-matrix.sh --build "$(rollingkv build --cuda --print-dir)" -ngl 99 --tokens 2048   on a GPU
#   scripts/gate-matrix.sh --lib-dir /path/llama.cpp/build/bin -ngl 99                 a bare build/bin
# The machine needs Python >= 3.10 with click, rich, numpy, pyyaml and the llama_cpp bindings importable
# (installed, or on PYTHONPATH); $PYTHON picks the interpreter (default: .venv's, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PYTHON" -m rollingkv_cli gate matrix "$@"
