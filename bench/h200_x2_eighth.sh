#!/usr/bin/env bash
# Issue 7 on `nvidia-h200-x2`, prepared in the eighth session (2026-11-30,
# which had no device time left): the two experiments sections 9-10 of
# bench/results/nccl-2026-11-29.md name as next. World 2, 8 steps, 3 warm-up,
# captures on 1 and 2 GPUs, traces kept; not yet run.
#   PART=a: MoE x2, each truth beside the default capture (GPU time measured
#           on steps 2-3) and a capture with PRISM_GPU_CALIBRATE=2-7 (every
#           step after the warm-up measured: do the uncalibrated steps'
#           borrowed expert times explain MoE's -4..+4%?) (~6 min)
#   PART=b: GPT tp2 and pp2 x1 with the same two captures: calibrating every
#           step must not cost the deterministic workloads (~5 min)
#   PART=c: FSDP2 x3 with truths and captures on 4 CPUs only (2-5): does a
#           CPU set held by the job alone keep its single-threaded
#           torch.randn at one speed (section 9: 40-50 or 65-80 ms)? (~7 min)
# Every part samples the GPUs' SM clock and throttle reasons into smi.csv.
# Afterwards: add the truths to a new table in bench/two_clock_check.py.
#
#   PART=a bash bench/h200_x2_eighth.sh
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT/r"
export NET=bench/results/nccl-h200x2-issue-profile.toml SKIP_GPU_TESTS=1
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 100 > "$OUT/smi.csv" 2>&1 &
smi=$!
CAL="--variant cal:PRISM_GPU_CALIBRATE=2-7"
case "${PART:-a}" in
  a) RUNS=2 ACCURACY_ARGS=$CAL KEEP_RUNS="moe 330 1,2 moe-dp2-ep2" bash bench/h200_final.sh ;;
  b) RUNS=1 ACCURACY_ARGS=$CAL KEEP_RUNS="gpt 130 1,2 gpt-tp2;pp2 140 1,2 gpt-pp2" bash bench/h200_final.sh ;;
  c) RUNS=3 CPUS=2-5 KEEP_RUNS="fsdp2 400 1,2 fsdp2" bash bench/h200_final.sh ;;
  *) echo "PART=$PART: expected a, b or c" >&2; kill $smi; exit 2 ;;
esac
kill $smi
tar czf "$OUT/results.tgz" -C "$OUT" r
