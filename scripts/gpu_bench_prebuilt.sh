#!/usr/bin/env bash
# Device call on the prebuilt CUDA build (carry .device/prebuilt, .device/src, .device/series): `rollingkv bench tail`
# on the synthetic 28-layer model at one depth (DEPTH, default 16384; extra bench options in BENCH_ARGS), with the
# link measured in the same run. Results: $OUT/log.txt, $OUT/bench-tail-$DEPTH.json (plot it with `rollingkv bench plot`).
. "$(dirname "$0")/device-lib.sh"
use_prebuilt
DEPTH=${DEPTH:-16384}
step "bench tail -d $DEPTH"
# shellcheck disable=SC2086
bash scripts/bench-tail.sh --synth /tmp/synth28.gguf -d "$DEPTH" --json "$OUT/bench-tail-$DEPTH.json" --no-plot ${BENCH_ARGS:-} 2>&1 | tail -45
step done
