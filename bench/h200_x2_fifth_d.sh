#!/usr/bin/env bash
# Issue 7 on `nvidia-h200-x2`, fifth session, last call (~8 min): the GPU test
# of the calibration's stream coverage (its first version asserted too much),
# the drain effect with a segment whose GPU time is below its CPU issue time,
# and more interleaved runs (GPT pp2 x2, GPT tp2, MoE dp2 ep2, FSDP2) with the
# profile of GPU times and issue costs; traces kept.
#
#   bash bench/h200_x2_fifth_d.sh
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT/r"
timeout 40 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gputime.py 2>&1 | tail -6 \
  > "$OUT/r/gpu-tests-d.txt"
tail -2 "$OUT/r/gpu-tests-d.txt"
timeout 30 python3 bench/drain_effect.py --ops 100 --size 128 --json "$OUT/r/drain_effect-small.json" \
  > "$OUT/r/drain_effect-small.txt" 2>&1
cat "$OUT/r/drain_effect-small.txt"
export NET=bench/results/nccl-h200x2-issue-profile.toml SKIP_GPU_TESTS=1
RUNS=2 KEEP_RUNS="pp2 100 1,2 gpt-pp2" bash bench/h200_final.sh
RUNS=1 KEEP_RUNS="gpt 80 1,2 gpt-tp2" bash bench/h200_final.sh
RUNS=1 KEEP_RUNS="moe 125 1,2 moe-dp2-ep2" bash bench/h200_final.sh
RUNS=1 KEEP_RUNS="fsdp2 140 1,2 fsdp2" bash bench/h200_final.sh
tar czf "$OUT/results.tgz" -C "$OUT" r
