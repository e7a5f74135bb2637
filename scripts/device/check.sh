#!/usr/bin/env bash
# Device entry point (runs ON the GPU machine; docs/device.md): make one build, then run named checks on it, in order.
#   bash scripts/device/check.sh [--cpu|--cuda|--prebuilt] CHECK...
# --cpu (default): `rollingkv build --no-cuda` from the carried tree, e.g. for a CPU test on the device host's CPU
# (a 16-core Intel Xeon with AMX); --cuda: a CUDA build from the carried tree; --prebuilt: the cross-built CUDA build.
# Carry .device/src (plus .device/prebuilt, .device/series, or the demo model halves as the checks need). CHECK is:
#   op-tests            the op test on the build's backend (CPU: -b CPU; CUDA: the whole matrix, device + pinned-host tail)
#   hybrid-op-tests     the op test on CUDA0, pinned-host tail, its far end on the CPU (0.5, 1), and perturbed (CUDA builds)
#   head-op-tests       the op test's head split cases (--heads) on CUDA0, and perturbed (CUDA builds)
#   cpu-decode-bench    the CPU part's attention bench on 15 threads (f16, q8_0, q4_0) against a read scan and ggml's
#   hybrid-cells        llama-bench decode at 16384, 50% and ~100% f16 tail, CPU part 0 / auto / HYBRID_FRACS (synthetic model)
#   handoff-cells       llama-bench decode, the CPU part handed off by host function vs mapped flag (ROLLINGKV_CPU_PART_HANDOFF)
#   calib-cells         llama-bench -v decode: resident, auto at a 50% f16 tail and a full spill, with the planner's measured
#                       per-layer terms (its plan lines in $OUT/decode.jsonl)
#   slow-link-cells     a 50% f16 tail on a simulated 25 and 6.5 GB/s link (ROLLINGKV_SIMULATE_LINK_SLOWDOWN), CPU share
#                       0 / 0.25 / 0.5 / 0.75 / auto
#   batched-cells       llama-batched-bench, 4 sequences at 16384 with 50% tails: resident, CPU part 0 / 0.5 / auto
#   resident-pool-cells decode at 65536 (fits): off against auto, twice in alternation
#   deep-cells          decode at 65536: resident, a 50% f16 tail and a full spill with the CPU part at auto
#   gpu-tests           pytest -m gpu tests/ (every gpu-marked test); counts in $OUT/gpu-tests.json
#   decode-cells        llama-bench decode at 16384: resident, 50% f16 tail, 50% q4_0 tail (synthetic 28-layer model)
#   bench-load          rollingkv bench load on the synthetic model ($LOAD_ARGS; default the table mix) into $OUT/bench-load.json
#   serve-without-ngl   rollingkv serve on a KV that does not fit --vram-target 9000, without -ngl
#   gate-matrix         rollingkv gate matrix on the demo model (-ngl 99 on CUDA) into $OUT/matrix.{json,md}
#   gate-vram           rollingkv gate vram at $VRAM_TARGETS MiB (default 20000 7500 6800) on the synthetic model
#   gate-vram-layouts   rollingkv gate vram, -c 102400 --vram-target 9000, in one slot, -np 4, -np 8 and -np 4 -kvu
#   probe-pcie          rollingkv probe pcie --refresh --json into $OUT/probe.json
#   smoke               llama-server answers with the demo model on the GPU; llama_cpp sees GPU offload
#   tests/...           one pytest file or node id, e.g. tests/test_rolling_kv.py::test_every_layer_shares_one_index_view_per_region
#   pytest ARGS...      pytest with every remaining argument, e.g. pytest tests/test_ops.py -k 'q8_0 and not slow'
#   anything else       a pytest -k expression over tests/
# Prints a summary line per check; exit 1 when one failed.
mode=cpu
case "${1:-}" in
  --cpu|--cuda|--prebuilt) mode=${1#--}; shift ;;
esac
[ $# -gt 0 ] || { echo "usage: $0 [--cpu|--cuda|--prebuilt] CHECK...  (see the header of $0)" >&2; exit 2; }
# shellcheck source=SCRIPTDIR/lib.sh
. "$(dirname "$0")/lib.sh"
pick_build "$mode"

summary=() rc=0
record() {  # name, status
  summary+=("$(printf '%-40s %s' "$1" "$([ "$2" = 0 ] && echo ok || echo "FAILED (exit $2)")")")
  [ "$2" = 0 ] || rc=1
}
while [ $# -gt 0 ]; do
  name=$1; shift
  step "check: $name"
  # shellcheck disable=SC2119
  case "$name" in
    op-tests) if [ "$BUILD_KIND" = cpu ]; then op_tests_cpu; else op_tests_cuda; fi ;;
    hybrid-op-tests) hybrid_op_tests ;;
    head-op-tests) head_op_tests ;;
    cpu-decode-bench) cpu_decode_bench ;;
    hybrid-cells) hybrid_cells ;;
    handoff-cells) handoff_cells ;;
    calib-cells) calib_cells ;;
    slow-link-cells) slow_link_cells ;;
    batched-cells) batched_cells ;;
    resident-pool-cells) resident_pool_cells ;;
    deep-cells) deep_cells ;;
    gpu-tests) gpu_tests ;;
    decode-cells) decode_cells ;;
    bench-load) bench_load ;;
    serve-without-ngl) synth_model; serve_without_ngl "$SYNTH" ;;
    gate-matrix) gate_matrix_run ;;
    gate-vram) gate_vram_targets ;;
    gate-vram-layouts) gate_vram_layouts ;;
    probe-pcie) probe_pcie ;;
    smoke) smoke ;;
    pytest) name="pytest $*"; run_pytest "$@"; set -- ;;
    tests/*) run_pytest "$name" ;;
    *) run_pytest tests -k "$name" ;;
  esac
  record "$name" $?
done
step "summary (build: $BUILD_KIND, $B)"
printf '%s\n' "${summary[@]}"
exit $rc
