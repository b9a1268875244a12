#!/usr/bin/env bash
# Issue 7, for the next GPU session on `nvidia-h200-x2` (~4 min; written
# 2026-11-30, NOT yet run): where do GPT pp2 and FSDP2 lose 2-5% (section 7 of
# bench/results/nccl-2026-11-29.md)? For each, a Prism capture on 2 GPUs of the
# same command as the accuracy bench, then bench/truth_segments.py: step 5 of
# the truth under the torch profiler, cut at its communication calls, beside
# the capture's step 5 (GPU busy per stretch compares directly; the profiler
# inflates the truth's CPU spans).
#
#   [SEGS="pp2 fsdp2 gpt-tp2 moe"] [NO_DRAIN=1] bash bench/h200_x2_segments.sh
#
# Run 2026-11-30 01:21 UTC (pp2, fsdp2; the results in
# bench/results/nccl-2026-11-29.md, section 8).
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT/r"
. bench/workloads.sh
seg() {  # name command...
  local name=$1; shift
  rm -rf "/tmp/cap-$name" "/tmp/clk-$name"; mkdir -p "/tmp/clk-$name"
  PRISM_STEPCLOCK_DIR="/tmp/clk-$name" PRISM_STEPCLOCK_SYNC=1 timeout 120 python3 -m prism capture -n 2 \
    --nproc-per-node 2 --gpus 0,1 --out "/tmp/cap-$name" --progress off -- bench/_stepclock.py "$@" \
    > "$OUT/r/capture-$name.txt" 2>&1
  timeout 120 python3 bench/truth_segments.py --world 2 --step 5 --capture "/tmp/cap-$name" \
    --out "/tmp/truth-$name" --json "$OUT/r/segments-$name.json" -- "$@" > "$OUT/r/segments-$name.txt" 2>&1
  tail -25 "$OUT/r/segments-$name.txt"
  # the truth's folder (step clocks, logs, the profiled step) and the capture
  cp -r "/tmp/truth-$name" "$OUT/r/truth-$name" 2>/dev/null
  cp -r "/tmp/cap-$name" "$OUT/r/cap-$name" 2>/dev/null
  rm -f "$OUT/r/cap-$name/prism.sock"
}
# SEGS: which (default "pp2 fsdp2"); also gpt-tp2, moe
for s in ${SEGS:-pp2 fsdp2}; do
  args=$(workload_args "$s") || exit 2
  # shellcheck disable=SC2086 (the words split on purpose)
  seg "$s" $args
done
[ -n "${NO_DRAIN:-}" ] || timeout 90 python3 bench/drain_effect.py --json "$OUT/r/drain_effect.json" > "$OUT/r/drain_effect.txt" 2>&1
tail -8 "$OUT/r/drain_effect.txt"
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$OUT/r"
