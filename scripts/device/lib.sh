# shellcheck shell=bash
# Sourced by the scripts/device/*.sh entry points, which run ON the GPU machine: the device tool copies the working
# tree there and runs one bash command in the repository root, with no network. docs/device.md is the workflow.
# Sourcing it:
# - cds to the repository root; everything printed also goes to $OUT/log.txt ($OUT: the tool's folder of files that
#   come back; /tmp/rkv-out elsewhere); step() prints a section header;
# - exports the environment the carried tree needs: the cache in /tmp/rkv-cache (kept while the machine is warm),
#   offline, the packed llama_cpp bindings and the tree's gguf-py on PYTHONPATH;
# - with .device/series carried (pack.sh --series): runs in /tmp/rkv-tree, a copy of the tree with native/, native-lab/ and patches/
#   as committed at HEAD, so uncommitted work in progress never reaches a device build (the tree itself is unchanged);
# - with .device/model1, then .device/model2 carried in two back-to-back calls (pack.sh --model): the demo model's
#   halves, kept in /tmp and joined into the cache when the second arrives.
# Builds: build_cpu, build_cuda, use_prebuilt, or pick_build MODE; each sets and exports B and ROLLINGKV_BUILD.
# Checks (each returns its status): op_tests_cpu, op_tests_cuda, hybrid_op_tests, cpu_decode_bench, gpu_tests, run_pytest,
# decode_cell, decode_cells, serve_without_ngl, gate_matrix_run, gate_vram_targets, probe_pcie, smoke.
set -u
RKV_CHECKOUT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEV="$RKV_CHECKOUT/.device"
OUT="${OUT:-/tmp/rkv-out}"; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
RKV_ROOT="$RKV_CHECKOUT"
if [ -f "$DEV/series/series.tgz" ]; then
  RKV_ROOT=/tmp/rkv-tree
  rm -rf "$RKV_ROOT" && mkdir -p "$RKV_ROOT" || exit 1
  tar -C "$RKV_CHECKOUT" --exclude=./.device --exclude=./.git --exclude=./.venv -cf - . | tar -C "$RKV_ROOT" -xf - || exit 1
  rm -rf "$RKV_ROOT/native" "$RKV_ROOT/native-lab" "$RKV_ROOT/patches" && tar -C "$RKV_ROOT" -xzf "$DEV/series/series.tgz" || exit 1
  echo "series of commit $(cat "$DEV/series/commit" 2>/dev/null): running in $RKV_ROOT"
fi
cd "$RKV_ROOT" || exit 1
RKV_SRC=/tmp/rkv-src RKV_PYLIB=/tmp/rkv-pylib
DEMO_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
export ROLLINGKV_CACHE_DIR="${ROLLINGKV_CACHE_DIR:-/tmp/rkv-cache}" ROLLINGKV_OFFLINE=1 PYTHONUNBUFFERED=1 COLUMNS="${COLUMNS:-160}"
export PYTHONPATH="$RKV_ROOT:$RKV_PYLIB:$RKV_SRC/gguf-py${PYTHONPATH:+:$PYTHONPATH}"

step() { echo "== $1 ($(date +%T))"; }
rkv() { python3 -m rollingkv_cli "$@"; }

if [ -f "$DEV/model1/demo.part1" ]; then
  cp "$DEV/model1/demo.part1" /tmp/rkv-model.part1
fi
if [ ! -f "$ROLLINGKV_CACHE_DIR/models/$DEMO_GGUF" ] && [ -f "$DEV/model2/demo.part2" ] && [ -f /tmp/rkv-model.part1 ]; then
  mkdir -p "$ROLLINGKV_CACHE_DIR/models"
  cat /tmp/rkv-model.part1 "$DEV/model2/demo.part2" > "$ROLLINGKV_CACHE_DIR/models/$DEMO_GGUF"
  sha256sum "$ROLLINGKV_CACHE_DIR/models/$DEMO_GGUF"
fi

# Unpack .device/src once per machine: the pinned llama.cpp tree into /tmp/rkv-src, the bindings into /tmp/rkv-pylib.
# The tree also becomes the cache's pristine tree of the pin, so `rollingkv build` without --source, and the tests'
# build fixtures (conftest.py's cpu_build, unpatched_build), work offline.
unpack_src() {
  [ -f "$DEV/src/llama.cpp.tgz" ] || { echo "no .device/src: run scripts/device/pack.sh and carry .device/src"; return 1; }
  if [ ! -f "$RKV_SRC/.rkv-unpacked" ]; then
    rm -rf "$RKV_SRC" "$RKV_PYLIB" && mkdir -p "$RKV_SRC" "$RKV_PYLIB"
    tar -C "$RKV_SRC" -xzf "$DEV/src/llama.cpp.tgz" && tar -C "$RKV_PYLIB" -xzf "$DEV/src/pylib.tgz" || return 1
    touch "$RKV_SRC/.rkv-unpacked"
  fi
  local pristine
  pristine="$(python3 -c 'from rollingkv_cli.lib import paths, upstream; print(paths.upstream_dir() / upstream.PIN.short)')" || return 1
  if [ ! -f "$pristine/.rollingkv-extracted" ]; then
    rm -rf "$pristine" && mkdir -p "$(dirname "$pristine")" && cp -a "$RKV_SRC" "$pristine" && rm -f "$pristine/.rkv-unpacked"
    python3 -c 'from rollingkv_cli.lib import upstream; print(upstream.PIN.llama_cpp_commit)' > "$pristine/.rollingkv-extracted"
  fi
}

# build_cpu [rollingkv build args...]: `rollingkv build --no-cuda` of the series from the carried tree (a minute or
# two on 16 cores), e.g. for a CPU test on the device host's CPU (Intel Xeon with AMX).
build_cpu() {
  _build "CPU" --no-cuda "$@"
}

# build_cuda [rollingkv build args...]: `rollingkv build --cuda --cuda-arch 90` from the carried tree (~260 s cold).
build_cuda() {
  _build "CUDA sm_90" --cuda --cuda-arch 90 "$@"
}

_build() {
  local kind=$1 t0=$SECONDS; shift
  unpack_src || exit 1
  step "build ($kind)"
  rkv build -q "$@" > /tmp/rkv-build.txt 2>&1 || { tail -40 /tmp/rkv-build.txt; exit 1; }
  B="$(rkv build "$@" --print-dir)" || exit 1
  export B ROLLINGKV_BUILD="$B"
  echo "$kind build in $B ($((SECONDS - t0)) s)"
}

# use_prebuilt: the CUDA build cross-built here by scripts/cross-build-cuda.sh (carry .device/prebuilt and .device/src).
# Always unpacked (a warm machine may hold an older build at the same path), at the path it was built in: its
# RUNPATHs are absolute.
use_prebuilt() {
  unpack_src || exit 1
  [ -f "$DEV/prebuilt/cuda-build.tar.xz" ] || { echo "no .device/prebuilt: run scripts/cross-build-cuda.sh and carry .device/prebuilt"; exit 1; }
  B="$(cat "$DEV/prebuilt/dir")"; tar -C / -xJf "$DEV/prebuilt/cuda-build.tar.xz" || exit 1
  export B ROLLINGKV_BUILD="$B"
  echo "prebuilt CUDA build of commit $(cat "$DEV/prebuilt/commit" 2>/dev/null) in $B"
}

# pick_build cpu|cuda|prebuilt|auto [rollingkv build args...]; auto: the prebuilt when carried, else a CUDA build.
# Sets BUILD_KIND to the one chosen.
pick_build() {
  BUILD_KIND=$1; shift
  if [ "$BUILD_KIND" = auto ]; then
    if [ -f "$DEV/prebuilt/cuda-build.tar.xz" ]; then BUILD_KIND=prebuilt; else BUILD_KIND=cuda; fi
  fi
  case "$BUILD_KIND" in
    cpu) build_cpu "$@" ;;
    cuda) build_cuda "$@" ;;
    prebuilt) use_prebuilt ;;
    *) echo "unknown build '$BUILD_KIND' (cpu, cuda, prebuilt, auto)"; exit 2 ;;
  esac
}

# the synthetic 28-layer model of anchors.md (`rollingkv model synth` defaults), written once per machine; sets SYNTH
synth_model() {
  SYNTH=/tmp/synth28.gguf
  [ -f "$SYNTH" ] || rkv model synth "$SYNTH" --ctx 131072 --force | tail -1
}

# the demo model, when its two halves arrived (see above); sets DEMO
demo_model() {
  DEMO="$ROLLINGKV_CACHE_DIR/models/$DEMO_GGUF"
  [ -f "$DEMO" ] || { echo "no demo model: carry .device/model1, then .device/model2 in the next call (pack.sh --model)"; return 1; }
}

# op_tests_cpu [test-rolling-kv-ops args...]: the op test on the CPU backend (full log: $OUT/optest-cpu.txt)
op_tests_cpu() {
  local rc
  timeout 600 "$B/build/bin/test-rolling-kv-ops" -b CPU "$@" > "$OUT/optest-cpu.txt" 2>&1; rc=$?
  echo "op test -b CPU $*: exit $rc"; grep -E "FAIL|passed" "$OUT/optest-cpu.txt" | cut -c1-260 | tail -20
  return $rc
}

# op_tests_cuda: the whole op test on CUDA0, with a device tail and then a pinned-host tail through the scheduler:
# failures, totals, and the cases the double-precision reference decided; full logs $OUT/optest-cuda0{,-tail-host}.txt
op_tests_cuda() {
  local host rc=0 r log
  for host in "" "--tail-host"; do
    log="$OUT/optest-cuda0${host:+-tail-host}.txt"
    timeout 300 "$B/build/bin/test-rolling-kv-ops" -b CUDA0 ${host:+"$host"} > "$log" 2>&1; r=$?; [ $r = 0 ] || rc=$r
    echo "op test -b CUDA0${host:+ $host}: exit $r"
    grep -E "FAIL|passed" "$log" | cut -c1-260 | tail -20
    grep -h "exact:" "$log" | sed 's/.*exact: op \([^,]*\), stock \([^ ]*\).*/\1 \2/' | \
      awk '{r=$1/$2; if (r>m) m=r; n++} END {print n+0 " cases decided by the double-precision reference; worst op/stock NMSE ratio " m+0}'
  done
  return $rc
}

# run_pytest ARGS...: pytest on the active build (B), e.g. run_pytest tests/test_rolling_kv.py -k 'shares'
run_pytest() {
  timeout "${PYTEST_TIMEOUT:-540}" python3 -m pytest -q -rs -p no:cacheprovider "$@"
}

# gpu_tests: every gpu-marked test of the repo (pytest -m gpu tests/: tests/test_gpu.py's op on CUDA0, the pinned-host
# tail, both perturbed (exactly the live-tail cases fail), probe pcie, gate equiv within the order floor and failing on a
# perturbed tail, four parallel sequences; tests/test_hybrid_tail.py's probe of the CPU attention; any gpu test added
# anywhere under tests/: tests/test_device_scripts.py fails when this command misses one). Prints how many ran, passed,
# failed and skipped, and writes them to $OUT/gpu-tests.json (the per-test record: $OUT/gpu-tests.xml).
gpu_tests() {
  local rc
  rm -f "$OUT/gpu-tests.xml" "$OUT/gpu-tests.json"
  timeout 480 python3 -m pytest -q -m gpu tests/ -rs -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -25
  rc=${PIPESTATUS[0]}
  python3 - "$OUT/gpu-tests.xml" "$OUT/gpu-tests.json" <<'PY' || rc=1
import json, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as e:
    print(f"gpu tests: no JUnit record ({e}): nothing counted"); sys.exit(1)
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
c = {"collected": n["tests"], "ran": n["tests"] - n["skipped"], "passed": n["tests"] - n["skipped"] - n["failures"] - n["errors"],
     "failed": n["failures"], "errors": n["errors"], "skipped": n["skipped"],
     "modules": sorted({tc.get("classname", "") for s in suites for tc in s.iter("testcase")})}
json.dump(c, open(sys.argv[2], "w"), indent=1)
print(f"gpu tests: {c['ran']} ran, {c['passed']} passed, {c['failed']} failed, {c['errors']} errors, {c['skipped']} skipped "
      f"(of {c['collected']} selected, from {', '.join(c['modules'])})")
PY
  return "$rc"
}

# decode_cell LABEL [ENV=VALUE...] -- [llama-bench args...]: decode speed of one cell on the synthetic model,
# llama-bench -fa 1 -p 0 -n $N -d $D -r $R -ngl 99 (N 32, D 16384, R 3 unless set); one JSON line, also in
# $OUT/decode.jsonl. E.g. decode_cell "q4_0 50%, 4 slots" ROLLINGKV_SLOTS=4 -- --kv-residency-mode window \
#   --kv-window-cells 8192 -ctkt q4_0 -ctvt q4_0
# (the lab switches, e.g. ROLLINGKV_DEBUG_NO_PRELAUNCH or ROLLINGKV_DEBUG_PROFILE, exist only in lab builds:
#  `pick_build cuda --lab`, i.e. `rollingkv build --lab`, which applies patches/lab/ and native-lab/)
decode_cell() {
  local label=$1 envs=(ROLLINGKV_CPU_PART_STATS=1) err; shift
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  synth_model
  err=$(mktemp)
  env "${envs[@]}" timeout 300 "$B/build/bin/llama-bench" -m "$SYNTH" -fa 1 -p 0 -n "${N:-32}" -d "${D:-16384}" -r "${R:-3}" \
    -ngl 99 -o json "$@" 2>"$err" | python3 -c "
import json, re, sys
r = json.load(sys.stdin)[0]
stats = [l.strip() for l in open(sys.argv[2], errors='replace') if l.startswith('rolling KV: CPU part:')]
runs = next((int(m.group(1)) for m in (re.match(r'rolling KV: CPU part: (\\d+) runs', l) for l in stats) if m), 0)
gap = next((float(m.group(1)) for m in (re.search(r'next one.s start [0-9.]+ us \\(p50 ([0-9.]+)\\)', l) for l in stats) if m), None)
# with -v: the planner's lines (its per-layer terms, measured or assumed, and the share it chose)
plan = [l.strip().split('rolling KV: ', 1)[1] for l in open(sys.argv[2], errors='replace')
        if 'rolling KV: per layer' in l or 'rolling KV: CPU part of the tail' in l]
chosen = r.get('kv_tail_cpu_frac_chosen')
rec = {'label': sys.argv[1], 'ms': round(1000 / r['avg_ts'], 3), 'tok_s': r['avg_ts'], 'sd_ts': r['stddev_ts'],
       'samples_ms': [round(1000 / x, 2) for x in r['samples_ts']], 'cpu_frac_chosen': chosen, 'cpu_part_runs': runs,
       'gap_p50_us': gap, 'cpu_part_stats': stats, 'plan': plan}
print(json.dumps(rec))
# the path ran: a cell whose plan gave the CPU a share and that ran no CPU part timed the GPU-only stream
if chosen not in (None, '') and float(chosen) > 0 and runs == 0:
    print(f'FAILED: {sys.argv[1]}: the plan gave the CPU {float(chosen):.0%} of the tail, no CPU part ran', file=sys.stderr)
    sys.exit(1)" "$label" "$err" | tee -a "$OUT/decode.jsonl"
  local rc=$(( PIPESTATUS[0] | PIPESTATUS[1] ))
  rm -f "$err"
  return $rc
}

# decode_cells: the closing check's three cells at depth 16384: resident, 50% f16 tail, 50% q4_0 tail
decode_cells() {
  local rc=0
  decode_cell resident -- --kv-residency-mode off || rc=1
  decode_cell "f16 50% tail" -- --kv-residency-mode window --kv-window-cells 8192 || rc=1
  decode_cell "q4_0 50% tail" -- --kv-residency-mode window --kv-window-cells 8192 -ctkt q4_0 -ctvt q4_0 || rc=1
  return $rc
}

# hybrid_op_tests: the op test on CUDA0 with a pinned-host tail whose far end the CPU attends (--tail-cpu-frac 0.5 and 1:
# the decode-sized cases say cpu-part=N), and the perturbation reaching the CPU part (x = 1, the whole tail on the CPU:
# every case with a live tail must fail); logs $OUT/optest-cuda0-hybrid-*.txt
hybrid_op_tests() {
  local f r n rc=0 log
  for f in 0.5 1; do
    log="$OUT/optest-cuda0-hybrid-$f.txt"
    timeout 150 "$B/build/bin/test-rolling-kv-ops" -b CUDA0 --tail-host --tail-cpu-frac "$f" > "$log" 2>&1; r=$?; [ $r = 0 ] || rc=$r
    n=$(grep -c 'cpu-part=' "$log")
    echo "op test -b CUDA0 --tail-host --tail-cpu-frac $f: exit $r, $n cases with a CPU part"
    # the path ran: a build whose CPU part never runs passes every case on the streamed tail alone
    [ "$n" -gt 0 ] || { echo "FAILED: no case ran a CPU part"; rc=1; }
    grep -E "FAIL|passed|skipped" "$log" | cut -c1-260 | tail -6
  done
  log="$OUT/optest-cuda0-hybrid-perturbed.txt"
  ROLLINGKV_DEBUG_PERTURB_TAIL=1 timeout 150 "$B/build/bin/test-rolling-kv-ops" -b CUDA0 --tail-host --tail-cpu-frac 1 --expect-perturbed \
    > "$log" 2>&1; r=$?; [ $r = 0 ] || rc=$r
  n=$(grep 'OK (fails: perturbed tail)' "$log" | grep -c 'cpu-part=')
  echo "perturbed x = 1, the whole tail on the CPU: exit $r; caught $(grep -c 'OK (fails: perturbed tail)' "$log")," \
    "of them with a CPU part $n"
  [ "$n" -gt 0 ] || { echo "FAILED: no perturbed case reached a CPU part"; rc=1; }
  grep -E "FAIL|passed" "$log" | cut -c1-260 | tail -6
  return $rc
}

# head_op_tests: the head split's op cases (--heads) on CUDA0, then perturbed (every case must fail);
# $OUT/optest-cuda0-heads{,-perturbed}.txt
head_op_tests() {
  local r rc=0 log="$OUT/optest-cuda0-heads.txt"
  timeout 150 "$B/build/bin/test-rolling-kv-ops" -b CUDA0 --heads > "$log" 2>&1; r=$?; [ $r = 0 ] || rc=$r
  echo "op test -b CUDA0 --heads: exit $r"
  grep -E "FAIL|passed" "$log" | cut -c1-260 | tail -6
  log="$OUT/optest-cuda0-heads-perturbed.txt"
  ROLLINGKV_DEBUG_PERTURB_TAIL=1 timeout 150 "$B/build/bin/test-rolling-kv-ops" -b CUDA0 --heads --expect-perturbed > "$log" 2>&1
  r=$?; [ $r = 0 ] || rc=$r
  echo "perturbed x = 1: exit $r; caught $(grep -c 'OK (fails: perturbed tail)' "$log")"
  grep -E "FAIL|passed" "$log" | cut -c1-260 | tail -6
  return $rc
}

# cpu_decode_bench: the CPU part's attention alone (test-rolling-kv-cpu-decode --bench: 28 layers x 16384 cells, 15
# threads, f16/q8_0/q4_0) against a read scan, a copy and ggml_flash_attn_ext on the same bytes; $OUT/cpu-decode-bench.txt
cpu_decode_bench() {
  local t rc=0
  for t in f16 q8_0 q4_0; do
    timeout 120 "$B/build/bin/test-rolling-kv-cpu-decode" --bench -t 15 --layers 28 --cells 16384 --type "$t" --reps 3 \
      2>&1 | tee -a "$OUT/cpu-decode-bench.txt" | tail -8; [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
  return $rc
}

# hybrid_cells: decode at depth $D (16384) with the 50% and ~100% f16 tail, the CPU part off, auto and at fixed shares
# (HYBRID_FRACS, default 0.25 0.4 0.5), on the synthetic model; $OUT/decode.jsonl
hybrid_cells() {
  local w f rc=0 kv=$(( ${D:-16384} + ${N:-32} ))
  for w in $(( kv / 2 / 256 * 256 )) 256; do
    decode_cell "w$w cpu 0" -- --kv-residency-mode window --kv-window-cells "$w" --kv-tail-cpu-frac 0 || rc=1
    decode_cell "w$w cpu auto" -- --kv-residency-mode window --kv-window-cells "$w" --kv-tail-cpu-frac auto || rc=1
    for f in ${HYBRID_FRACS:-0.25 0.4 0.5}; do
      decode_cell "w$w cpu $f" -- --kv-residency-mode window --kv-window-cells "$w" --kv-tail-cpu-frac "$f" || rc=1
    done
  done
  return $rc
}

# calib_cells: the planner's per-layer terms measured on this device (issue 26, 4): auto at a 50% f16 tail and at a full
# spill (-v: the plan's lines), beside the resident decode whose time beyond its bytes the layer probe estimates
calib_cells() {
  local rc=0 kv=$(( ${D:-16384} + ${N:-32} ))
  decode_cell "resident" -- --kv-residency-mode off -v || rc=1
  decode_cell "w$(( kv / 2 / 256 * 256 )) cpu auto" -- --kv-residency-mode window --kv-window-cells $(( kv / 2 / 256 * 256 )) \
    --kv-tail-cpu-frac auto -v || rc=1
  decode_cell "w256 cpu auto" -- --kv-residency-mode window --kv-window-cells 256 --kv-tail-cpu-frac auto -v || rc=1
  return $rc
}

# slow_link_cells: a host with a slower link (ROLLINGKV_SIMULATE_LINK_SLOWDOWN: 2.2 = PCIe 4.0 x16 at 25 GB/s, 8.5 = 3.0 x8
# at 6.5 GB/s of a 55 GB/s link; --pcie-bw-gbps tells the planner): a 50% f16 tail at fixed CPU shares and auto
slow_link_cells() {
  local pair x link f rc=0 kv=$(( ${D:-16384} + ${N:-32} ))
  local w=$(( kv / 2 / 256 * 256 ))
  for pair in ${SLOW_LINKS:-2.2:25 8.5:6.5}; do
    x=${pair%%:*} link=${pair##*:}
    for f in ${SLOW_FRACS:-0 0.25 0.5 0.75 auto}; do
      R=${R:-2} decode_cell "link $link w$w cpu $f" ROLLINGKV_SIMULATE_LINK_SLOWDOWN="$x" -- --kv-residency-mode window \
        --kv-window-cells "$w" --kv-tail-cpu-frac "$f" --pcie-bw-gbps "$link" -v || rc=1
    done
  done
  return $rc
}

# batched_cells: 4 sequences of 16384 tokens decoding together (llama-batched-bench, 4 streams), each with a 50% f16 tail:
# the CPU part (0.5, auto) against GPU only, and the resident decode; $OUT/batched.jsonl
batched_cells() {
  local cell rc=0 npp=${NPP:-16384} npl=${NPL:-4}
  local ctx=$(( (npp + 64) * npl )) w=$(( (npp + 64) / 2 / 256 * 256 ))
  synth_model
  for cell in "resident:--kv-residency-mode off" "cpu 0:--kv-residency-mode window --kv-window-cells $w --kv-tail-cpu-frac 0" \
              "cpu 0.5:--kv-residency-mode window --kv-window-cells $w --kv-tail-cpu-frac 0.5" \
              "cpu auto:--kv-residency-mode window --kv-window-cells $w --kv-tail-cpu-frac auto"; do
    # shellcheck disable=SC2086
    ROLLINGKV_CPU_PART_STATS=1 timeout 300 "$B/build/bin/llama-batched-bench" -m "$SYNTH" -fa on -ngl 99 -c "$ctx" -b 2048 -ub 512 \
      -npp "$npp" -ntg 32 -npl "$npl" --output-format jsonl -v ${cell#*:} > /tmp/bb.out 2>/tmp/bb.err || rc=1
    python3 - "${cell%%:*}" > /tmp/bb.rec <<'PY' || rc=1
import json, re, sys
rows = [json.loads(l) for l in open('/tmp/bb.out') if l.startswith('{')]
err = open('/tmp/bb.err', errors='replace').read()
runs = next((int(m.group(1)) for m in [re.search(r'rolling KV: CPU part: (\d+) runs', err)] if m), 0)
rec = {'label': sys.argv[1], 'rows': rows, 'cpu_part_runs': runs,
       'cpu_part_stats': [l.strip() for l in err.splitlines() if l.startswith('rolling KV: CPU part:')],
       'plan': [l.split('rolling KV: ', 1)[1] for l in err.splitlines()
                if 'rolling KV: CPU part of the tail' in l or 'rolling KV: per layer' in l or 'rolling KV: split' in l]}
print(json.dumps(rec))
if not rows:
    print('FAILED: no rows; stderr tail: ' + err[-1500:], file=sys.stderr); sys.exit(1)
if sys.argv[1] == 'cpu 0.5' and runs == 0:
    print('FAILED: cpu 0.5 ran no CPU part', file=sys.stderr); sys.exit(1)
PY
    tee -a "$OUT/batched.jsonl" < /tmp/bb.rec
  done
  return $rc
}

# deep_cells: the hybrid tail at depth $DEEP_D (65536): a 50% f16 tail and a full spill, CPU part auto, with the resident
# cell of the same depth for the floors (R=2 unless set)
deep_cells() {
  local rc=0 d=${DEEP_D:-65536}
  local kv=$(( d + ${N:-32} ))
  D=$d R=${R:-2} decode_cell "d$d resident" -- --kv-residency-mode off || rc=1
  D=$d R=${R:-2} decode_cell "d$d w$(( kv / 2 / 256 * 256 )) cpu auto" -- --kv-residency-mode window \
    --kv-window-cells $(( kv / 2 / 256 * 256 )) --kv-tail-cpu-frac auto -v || rc=1
  D=$d R=${R:-2} decode_cell "d$d w256 cpu auto" -- --kv-residency-mode window --kv-window-cells 256 --kv-tail-cpu-frac auto -v || rc=1
  return $rc
}

# resident_pool_cells: a cache that fits (65536 cells), auto (resident, the CPU part's machinery present) against off, twice
# in alternation (issue 26: auto when it fits measured 0.955x of vanilla once)
resident_pool_cells() {
  local rc=0 i
  for i in 1 2; do
    D=${POOL_D:-65536} decode_cell "off $i" -- --kv-residency-mode off || rc=1
    D=${POOL_D:-65536} decode_cell "auto $i" -- --kv-residency-mode auto -v || rc=1
  done
  return $rc
}

# handoff_cells: the CPU part's hand-off to the host, host function (the first design) against the flag in mapped memory
# (the default), each at 50% f16 tail with the CPU part at auto and at 0.5, and the full spill at 0.5, in one run
handoff_cells() {
  local h rc=0 kv=$(( ${D:-16384} + ${N:-32} ))
  for h in host flag; do
    decode_cell "w$(( kv / 2 / 256 * 256 )) cpu auto $h" ROLLINGKV_CPU_PART_HANDOFF=$h -- --kv-residency-mode window \
      --kv-window-cells $(( kv / 2 / 256 * 256 )) --kv-tail-cpu-frac auto || rc=1
    decode_cell "w$(( kv / 2 / 256 * 256 )) cpu 0.5 $h" ROLLINGKV_CPU_PART_HANDOFF=$h -- --kv-residency-mode window \
      --kv-window-cells $(( kv / 2 / 256 * 256 )) --kv-tail-cpu-frac 0.5 || rc=1
    decode_cell "w256 cpu 0.5 $h" ROLLINGKV_CPU_PART_HANDOFF=$h -- --kv-residency-mode window --kv-window-cells 256 \
      --kv-tail-cpu-frac 0.5 || rc=1
  done
  return $rc
}

# bench_load: `rollingkv bench load` on the synthetic model, $LOAD_ARGS (default: the table mix of issue 25: -np 4,
# 25600 cells per slot, a 24000+400 request beside three 1500+160 ones, window 4096), into $OUT/bench-load.json
bench_load() {
  synth_model
  # shellcheck disable=SC2086
  timeout "${LOAD_TIMEOUT:-560}" python3 -m rollingkv_cli bench load "$SYNTH" ${LOAD_ARGS:--np 4 --ctx-per-slot 25600 --window-cells 4096} \
    --json "$OUT/bench-load.json" --request-timeout 300 2>&1 | tail -40
  return "${PIPESTATUS[0]}"
}

# serve_without_ngl MODEL: `rollingkv serve MODEL -c 65536 --vram-target 9000` without -ngl: the GPU-layers note,
# the plan, the offload log
serve_without_ngl() {
  local model=$1 pid log rc
  python3 -m rollingkv_cli serve "$model" -c 65536 --vram-target 9000 --port 18081 -q > /tmp/serve-nongl.txt 2>&1 &
  pid=$!
  for _ in $(seq 1 240); do curl -sf localhost:18081/health >/dev/null && break; sleep 0.5; done
  curl -s localhost:18081/props | python3 -c "import json,sys; p=json.load(sys.stdin).get('rolling_kv') or {}; print({k: p.get(k) for k in ('mode_chosen','window_cells','tail_cells','reason')})"
  kill -TERM $pid; wait $pid; rc=$?; echo "serve exit $rc"
  grep -E "GPU layers|residency" /tmp/serve-nongl.txt | head -3
  log=$(grep -o "log: [^ ]*" /tmp/serve-nongl.txt | head -1 | cut -d' ' -f2)
  [ -n "$log" ] && [ -f "$log" ] && grep -m2 -E "offloaded [0-9]+/[0-9]+ layers" "$log"
  return $rc
}

# gate_matrix_run [gate matrix args...]: `rollingkv gate matrix` on the demo model (-ngl 99 on a CUDA build) into
# $OUT/matrix.{json,md}; copy them to docs/gates/<date>-<host>-<backend>.{json,md} here
gate_matrix_run() {
  local ngl=()
  demo_model || return 1
  [ "${BUILD_KIND:-}" != cpu ] && ngl=(-ngl 99)
  timeout "${MATRIX_TIMEOUT:-300}" python3 -m rollingkv_cli gate matrix --model demo "${ngl[@]}" --out "$OUT" --name matrix "$@" 2>&1 | tail -24
  return "${PIPESTATUS[0]}"
}

# gate_vram_targets: `rollingkv gate vram` (auto mode, NVML peak) on the synthetic model, 32768 context, at each of
# $VRAM_TARGETS MiB (default 20000 7500 6800: resident, and two that force a tail); reports $OUT/vram-T.json
gate_vram_targets() {
  local target rc=0
  synth_model
  for target in ${VRAM_TARGETS:-20000 7500 6800}; do
    timeout "${VRAM_TIMEOUT:-150}" python3 -m rollingkv_cli gate vram --model "$SYNTH" --vram-target "$target" --ctx 32768 \
      --n-predict 256 --json "$OUT/vram-$target.json" 2>&1 | grep -E "target|peak|plan|tail|speed|PASS|FAIL" | cut -c1-200
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
  return $rc
}

# gate_vram_layouts: `rollingkv gate vram` with the KV spilled (synthetic model, -c 102400, --vram-target 9000 unless
# VRAM_TARGET) in every layout: one slot, -np 4, -np 8 (a cache per slot) and -np 4 -kvu (llama-server's default), each
# slot decoding a request of its own at once; reports $OUT/vram-<layout>.json, each with the server log's buffer sizes
gate_vram_layouts() {
  local layout rc=0 name log target=${VRAM_TARGET:-9000}
  synth_model
  for layout in "1" "4" "8" "4 -kvu"; do
    name="np${layout// /}"
    # shellcheck disable=SC2086
    timeout "${VRAM_TIMEOUT:-150}" python3 -m rollingkv_cli gate vram "$SYNTH" --vram-target "$target" --ctx 102400 \
      -np $layout --n-predict "${VRAM_N_PREDICT:-128}" --json "$OUT/vram-$name.json" 2>&1 | grep -E "layout|peak|plan|PASS|FAIL" | cut -c1-200
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    log=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["server"]["log"])' "$OUT/vram-$name.json" 2>/dev/null)
    [ -n "$log" ] && grep -hE "buffer size|rolling KV" "$log" | sed 's/^/  /' | head -16
  done
  return $rc
}

# probe_pcie: `rollingkv probe pcie --refresh --json`, measured now, into $OUT/probe.json
probe_pcie() {
  timeout 60 python3 -m rollingkv_cli probe pcie --refresh --json > "$OUT/probe.json"
}

# smoke: llama-server with the demo model fully offloaded answers, and llama_cpp (ctypes) sees the GPU ($OUT/smoke.json)
smoke() {
  demo_model || return 1
  timeout 300 python3 scripts/device/smoke.py --model "$DEMO" --out "$OUT/smoke.json"
}
