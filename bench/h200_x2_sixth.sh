#!/usr/bin/env bash
# Issue 7 on `nvidia-h200-x2`, sixth session (2026-11-30): the free finish and
# cold start (PrismTrace 1.2) against interleaved truths, world 2, captures on
# 1 and 2 GPUs, the profile of GPU times and issue costs; traces kept.
#   PART=a: the GPU tests of gputime, GPT tp2 x2, GPT pp2 x2, MoE x1 (~7 min)
#   PART=b: FSDP2 x1, MoE x1 (~6 min)
#   PART=c: MoE x1 (~2.5 min), after segments were aligned across steps
#
#   PART=a bash bench/h200_x2_sixth.sh
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT/r"
export NET=bench/results/nccl-h200x2-issue-profile.toml SKIP_GPU_TESTS=1
if [ "${PART:-a}" = a ]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gputime.py 2>&1 | tail -6 \
    > "$OUT/r/gpu-tests-sixth.txt"
  tail -3 "$OUT/r/gpu-tests-sixth.txt"
  RUNS=2 KEEP_RUNS="gpt 110 1,2 gpt-tp2;pp2 120 1,2 gpt-pp2" bash bench/h200_final.sh
  RUNS=1 KEEP_RUNS="moe 170 1,2 moe-dp2-ep2" bash bench/h200_final.sh
elif [ "${PART}" = b ]; then
  RUNS=1 KEEP_RUNS="fsdp2 200 1,2 fsdp2;moe 170 1,2 moe-dp2-ep2" bash bench/h200_final.sh
else
  RUNS=1 KEEP_RUNS="moe 190 1,2 moe-dp2-ep2" bash bench/h200_final.sh
fi
