#!/usr/bin/env bash
# Device call: rebuild (fresh machine), then isolate the CUDA op-test cases that abort and the gate
# runner's crash on GPU model load, with compute-sanitizer / cuda-gdb backtraces. Results under $OUT.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/rkv-out}"; mkdir -p "$OUT"
export ROLLINGKV_CACHE_DIR=/tmp/rkv-cache ROLLINGKV_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:/tmp/rkv-pylib:/tmp/rkv-src/gguf-py"
t0=$(date +%s)
bash scripts/device-run.sh build --cuda --cuda-arch 90 -q > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
echo "build wall $(( $(date +%s) - t0 )) s"
B="$(python3 -m rollingkv_cli build --cuda --cuda-arch 90 --source /tmp/rkv-src --print-dir)/build/bin"
{
for i in $(seq 850 862); do
  timeout 20 "$B/test-rolling-kv-ops" -b CUDA0 --only $i 2>&1 | grep -E "^\[|CUDA error|passed" | head -3
done
timeout 60 compute-sanitizer --tool memcheck --print-limit 5 "$B/test-rolling-kv-ops" -b CUDA0 --only 851 2>&1 | grep -vE "^\s*$" | head -40
} > "$OUT/optests.txt" 2>&1
tail -60 "$OUT/optests.txt"
python3 -m rollingkv_cli model synth /tmp/s.gguf --layers 2 --embd 512 --heads 8 --kv-heads 2 --ff 1024 --vocab 1000 --ctx 4096 --force > /dev/null
printf 'import sys, faulthandler\nfaulthandler.enable()\nfrom pathlib import Path\nfrom rollingkv_cli import gate_runner as g\nlc, ext = g.load_bindings(Path(sys.argv[1]))[:2]\nprint("bindings", flush=True)\nm = g.load_model(lc, Path(sys.argv[1]), Path("/tmp/s.gguf"))\nprint("model ok", flush=True)\n' > /tmp/gl.py
timeout 60 python3 -X faulthandler /tmp/gl.py "$B" > "$OUT/gate-load.txt" 2>&1; echo "exit $?" >> "$OUT/gate-load.txt"
grep -vE "llama_model_loader|create_tensor|print_info|^load" "$OUT/gate-load.txt" | tail -25
timeout 90 cuda-gdb -q -batch -ex run -ex bt --args python3 /tmp/gl.py "$B" 2>&1 | grep -E "^#|signal|SIG" | head -25 > "$OUT/gdb.txt"
cat "$OUT/gdb.txt"
