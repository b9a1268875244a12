#!/usr/bin/env bash
# Issue 6's last measurement, in one device call (`nvidia-h200`, about 9.5
# minutes), from the repo root, wheels from ../shared/tools/device-wheels in
# .whl/ and $OUT set:
#
#   bash bench/h200_gangs.sh
#
# 1. GPU 0: GPT world 8 (tp2 pp2 dp2), all resident, then --resident 4 with
#    gangs tpxpp, tp, 1 (the policy now holds a grant back rather than evict
#    a rank that just received data, pins a rank whose wait ended before its
#    release, and rescues only ranks that wait for nothing known).
# 2. Cores 8-15 meanwhile: the same three with --simulate-swaps on CPU (the
#    policy's swaps per iteration without a GPU), to compare with 1.
# 3. With GPU_TESTS=1, the GPU tests last (logical devices incl. the
#    current_device change for torch.distributed, swap, GPU timing).
# First call, 2026-11-29 22:10 UTC: every swapped capture hung after 3-6
# swaps (a checkpointed rank's completion thread held the GPU turn of
# prism.rank.gputime; turns are now off while swapping); the second call
# measures the same with that fixed.
# Outputs are bundled into $OUT/results.tgz.
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT/r"
( for g in tpxpp tp 1; do
    rm -rf /tmp/sim-$g
    CUDA_VISIBLE_DEVICES= taskset -c 8-15 timeout 120 python3 -m prism capture -n 8 --resident 4 --gang $g \
      --simulate-swaps --out /tmp/sim-$g --progress off --show-ranks none -- -m prism.workloads.gpt \
      --tp 2 --pp 2 --dp 2 --steps 2 > "$OUT/r/sim-$g.txt" 2>&1
    echo "exit $?" >> "$OUT/r/sim-$g.txt"
    cp /tmp/sim-$g/telemetry/swaps.json "$OUT/r/sim-$g-swaps.json" 2>/dev/null
  done ) &
taskset -c 0-7 timeout "${GPT8_TIMEOUT:-500}" python3 bench/gpu_capture.py --out-dir "$OUT/r" --only gpt8 \
  --gangs tpxpp,tp,1 --gpus 0 --resident 4 --swap-timeout "${SWAP_TIMEOUT:-150}" --runs-dir /tmp/g8 \
  > "$OUT/r/gpt8-log.txt" 2>&1
for g in tpxpp tp 1; do cp /tmp/g8/gpt8-r4-$g/telemetry/swaps.jsonl "$OUT/r/gpt8-$g-swaps.jsonl" 2>/dev/null; done
wait
if [ "${GPU_TESTS:-0}" = 1 ]; then
  taskset -c 0-7 timeout 100 python3 -m pytest -q -m gpu tests/test_devices.py tests/test_swap.py tests/test_gputime.py \
    > "$OUT/r/gpu-tests.txt" 2>&1
  echo "exit $?" >> "$OUT/r/gpu-tests.txt"
fi
tar czf "$OUT/results.tgz" -C "$OUT" r
tail -n 12 "$OUT/r/gpt8-log.txt"; tail -n 2 "$OUT"/r/sim-*.txt; tail -n 5 "$OUT/r/gpu-tests.txt" 2>/dev/null
