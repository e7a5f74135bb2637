#!/usr/bin/env bash
# Device entry point (runs ON the GPU machine; docs/device.md): make a build of the series and print where it is.
#   bash scripts/device/build.sh --cpu [rollingkv build args...]    `rollingkv build --no-cuda` from the carried tree
#   bash scripts/device/build.sh --cuda [rollingkv build args...]   `rollingkv build --cuda --cuda-arch 90` (~260 s cold)
#   bash scripts/device/build.sh --prebuilt                         unpack the cross-built CUDA build (.device/prebuilt)
# Carry .device/src (and .device/prebuilt for --prebuilt; .device/series to build HEAD's series). The build lives in
# /tmp/rkv-cache while the machine stays warm. Writes $OUT/log.txt and $OUT/info.json (`rollingkv info --json`).
case "${1:-}" in
  --cpu|--cuda|--prebuilt) mode=${1#--}; shift ;;
  *) echo "usage: $0 --cpu|--cuda|--prebuilt [rollingkv build args...]" >&2; exit 2 ;;
esac
# shellcheck source=SCRIPTDIR/lib.sh
. "$(dirname "$0")/lib.sh"
pick_build "$mode" "$@"
rkv info --json > "$OUT/info.json"; echo "rollingkv info: exit $?"
echo "$B"
