#!/usr/bin/env bash
# Issue 7 on `nvidia-h200-x2`, fifth session, third call (~8.5 min): after the
# calibration's fix for scripts with streams of their own (FSDP2), FSDP2 again
# (2 runs, 1 and 2 GPUs), and second runs of MoE dp2 ep2 and GPT pp2; all
# predicted with the profile fitted on this kind of host with GPU times and
# issue costs (bench/results/nccl-h200x2-issue-profile.toml); traces kept.
#
#   bash bench/h200_x2_fifth_c.sh
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT/r"
timeout 40 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gputime.py 2>&1 | tail -6 \
  > "$OUT/r/gpu-tests-c.txt"
tail -3 "$OUT/r/gpu-tests-c.txt"
export NET=bench/results/nccl-h200x2-issue-profile.toml SKIP_GPU_TESTS=1
RUNS=2 KEEP_RUNS="fsdp2 290 1,2 fsdp2" bash bench/h200_final.sh
RUNS=1 KEEP_RUNS="moe 125 1,2 moe-dp2-ep2" bash bench/h200_final.sh
RUNS=1 KEEP_RUNS="pp2 55 1,2 gpt-pp2" bash bench/h200_final.sh
tar czf "$OUT/results.tgz" -C "$OUT" r
