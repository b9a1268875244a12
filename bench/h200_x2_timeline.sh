#!/usr/bin/env bash
# Issue 7 (2026-11-30): the ground truth's GPU timeline beside a capture's, on
# `nvidia-h200-x2`. Per workload: a Prism capture on 2 GPUs whose step 5 is
# also profiled (GPU activity and CUDA calls only: PRISM_STEPCLOCK_PROFILE_CPU=0,
# so each kernel's launch time on the CPU is known), then
# bench/truth_timeline.py: the truth's step 5, profiled the same way, cut at
# its NCCL kernels, beside the capture's stretches. The capture's profile lies
# in clk-NAME/profile-rank-R.json (its launches show where the capture's CPU
# is slower than the truth's).
#
#   [SEGS="gpt-tp2 pp2 moe fsdp2"] bash bench/h200_x2_timeline.sh
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT/r"
. bench/workloads.sh
tl() {  # name command...
  local name=$1; shift
  rm -rf "/tmp/cap-$name" "/tmp/clk-$name" "/tmp/truth-$name"; mkdir -p "/tmp/clk-$name"
  PRISM_STEPCLOCK_DIR="/tmp/clk-$name" PRISM_STEPCLOCK_SYNC=1 PRISM_STEPCLOCK_PROFILE_STEP=5 \
    PRISM_STEPCLOCK_PROFILE_CPU=0 timeout 150 python3 -m prism capture -n 2 \
    --nproc-per-node 2 --gpus 0,1 --out "/tmp/cap-$name" --progress off -- bench/_stepclock.py "$@" \
    > "$OUT/r/capture-$name.txt" 2>&1
  timeout 150 python3 bench/truth_timeline.py --world 2 --step 5 --capture "/tmp/cap-$name" \
    --out "/tmp/truth-$name" --json "$OUT/r/timeline-$name.json" -- "$@" > "$OUT/r/timeline-$name.txt" 2>&1
  head -30 "$OUT/r/timeline-$name.txt"
  cp -r "/tmp/truth-$name" "$OUT/r/truth-$name" 2>/dev/null
  cp -r "/tmp/cap-$name" "$OUT/r/cap-$name" 2>/dev/null
  cp -r "/tmp/clk-$name" "$OUT/r/clk-$name" 2>/dev/null
  rm -f "$OUT/r/cap-$name/prism.sock"
}
for s in ${SEGS:-gpt-tp2 pp2}; do
  args=$(workload_args "$s") || exit 2
  # shellcheck disable=SC2086 (the words split on purpose)
  tl "$s" $args
done
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$OUT/r"
