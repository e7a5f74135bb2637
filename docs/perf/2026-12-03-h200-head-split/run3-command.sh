# bench tail at 65536: window 50%/100% f16, CPU part auto and 0.5, head cells 25/50/75% f16, auto, vanilla -ngl / -nkvo
source scripts/device/lib.sh
use_prebuilt
synth_model
step "bench tail 65536"
bash scripts/bench-tail.sh "$SYNTH" --no-plot --json "$OUT/bench-tail-65536.json" -d 65536 -n 16 -r 2 --vanilla-reps 1 \
  --tail-types f16 --fractions 0.5,1 --head-fractions 0.25,0.5,0.75 --cpu-fracs auto,0.5 --cell-timeout 150 --time-budget 520 \
  2>&1 | grep -v "^\s*$" | tail -30
