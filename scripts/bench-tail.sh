#!/usr/bin/env bash
# `rollingkv bench tail` from a checkout, with or without its venv (issue 4's speed benchmark):
#   scripts/bench-tail.sh MODEL [bench tail options...]
#   scripts/bench-tail.sh --synth OUT.gguf [bench tail options...]   write the 28-layer synthetic model
#                                                                     of anchors.md first (when missing)
# With .venv (made by scripts/bootstrap.sh) it runs from there; without it (the GPU machine) it runs
# python3 -m rollingkv_cli from this tree, with a llama.cpp tree's gguf-py on PYTHONPATH when no gguf
# package is installed. Point it at a build with ROLLINGKV_BUILD=<build dir>, e.g.
#   ROLLINGKV_BUILD=/tmp/rkv-cache/builds/<key> scripts/bench-tail.sh --synth /tmp/synth28.gguf \
#       -d 16384 --json "$OUT/bench-tail.json" --time-budget 540
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if [ -f "$root/${ROLLINGKV_VENV:-.venv}/bin/activate" ]; then
  # shellcheck disable=SC1090
  . "$root/${ROLLINGKV_VENV:-.venv}/bin/activate"
fi
py="$(command -v python || command -v python3)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$py" -c 'import gguf' >/dev/null 2>&1; then
  for d in "${ROLLINGKV_BUILD:-}/src/gguf-py" "${ROLLINGKV_LLAMA_CPP_SOURCE:-}/gguf-py" /tmp/rkv-src/gguf-py; do
    if [ -f "$d/gguf/__init__.py" ]; then export PYTHONPATH="$PYTHONPATH:$d"; break; fi
  done
fi
rkv() { "$py" -m rollingkv_cli "$@"; }

if [ "${1:-}" = "--synth" ]; then
  [ $# -ge 2 ] || { echo "usage: $0 --synth OUT.gguf [bench tail options...]" >&2; exit 2; }
  model="$2"; shift 2
  if [ ! -f "$model" ]; then
    # anchors.md's model: 28 layers, n_embd 3072, 24 heads, 8 KV heads of 128, ffn 8192, vocab 32000, f16
    rkv model synth "$model" --layers 28 --embd 3072 --heads 24 --kv-heads 8 --ff 8192 --vocab 32000 --type f16 --ctx 131072
  fi
  set -- "$model" "$@"
fi
[ $# -ge 1 ] || { echo "usage: $0 MODEL|--synth OUT.gguf [bench tail options...]  (see: rollingkv bench tail --help)" >&2; exit 2; }
exec "$py" -m rollingkv_cli bench tail "$@"
