#!/usr/bin/env bash
# The instruction-set paths this CI runner must exercise (tests/isa.py's names), printed comma-separated; each known
# path left out is named on stderr with the reason. Always: scalar and AVX2 (every x86-64 runner we use) and NEON with
# and without the dot-product extension (under qemu). Beyond them, the runner's own CPU decides: AVX-512 (F/BW/VL/DQ),
# AVX-512 VNNI and AMX (amx_tile + amx_int8) are demanded wherever its flags list them, so a test that wrongly finds a
# path absent fails, and they are not demanded where the CPU lacks them (CI runners differ: an AMX Xeon, an AMD EPYC
# without AMX). The flags are read from $1 (default /proc/cpuinfo), the same source the tests' own checks use.
set -euo pipefail
cpuinfo="${1:-/proc/cpuinfo}"
flags=" $( (grep -m1 -E '^(flags|Features)[[:space:]]*:' "$cpuinfo" || true) | cut -d: -f2- | tr -s '[:space:]' ' ') "
has() { local f; for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
list="scalar,avx2"
avx512=(avx512f avx512bw avx512vl avx512dq)
if has "${avx512[@]}"; then list+=",avx512"; else echo "ci: not on this runner: avx512 (the CPU lacks one of ${avx512[*]})" >&2; fi
if has "${avx512[@]}" avx512_vnni; then list+=",avx512vnni"; else echo "ci: not on this runner: avx512vnni (the CPU lacks one of ${avx512[*]} avx512_vnni)" >&2; fi
if has amx_tile amx_int8; then list+=",amx"; else echo "ci: not on this runner: amx (the CPU lacks amx_tile or amx_int8)" >&2; fi
echo "$list,neon,neon-dotprod"
