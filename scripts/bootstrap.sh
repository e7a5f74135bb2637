#!/usr/bin/env bash
# Make or reuse the project venv and install rollingkv into it (editable), with llama-cpp-python as
# Python bindings only: CMAKE_ARGS stops its sdist from compiling a second, unpatched llama.cpp.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${ROLLINGKV_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
stamp="$venv/.rollingkv-install-stamp"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "==> installing rollingkv into $venv"
  python -m pip install -q --disable-pip-version-check --upgrade pip
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" python -m pip install -q --disable-pip-version-check -e ".[test]"
  echo "$want" > "$stamp"
fi
