#!/usr/bin/env bash
# Device entry point (runs ON the GPU machine; docs/device.md): `rollingkv bench tail` on the synthetic 28-layer model
# of anchors.md (written once per machine), the link measured in the same run; every other argument goes to bench tail.
#   bash scripts/device/bench.sh [--prebuilt|--cuda] [bench tail args...]
#   e.g. bash scripts/device/bench.sh -d 16384 -n 32 -r 3 --vanilla-reps 1 --cell-timeout 150 --time-budget 420
# --prebuilt / --cuda as in gpu-tests.sh (default: the prebuilt when carried). The report goes to
# $OUT/bench-tail.json unless --json is given; draw it here with `rollingkv bench plot`. Keep --time-budget below the
# device tool's 600 s per command, less the build.
mode=auto
case "${1:-}" in
  --prebuilt|--cuda) mode=${1#--}; shift ;;
esac
# shellcheck source=SCRIPTDIR/lib.sh
. "$(dirname "$0")/lib.sh"
pick_build "$mode"
synth_model
json=(--json "$OUT/bench-tail.json")
for a in "$@"; do [ "$a" = --json ] && json=(); done
step "bench tail $*"
bash scripts/bench-tail.sh "$SYNTH" --no-plot "${json[@]}" "$@"
rc=$?
step "done (exit $rc)"
exit $rc
