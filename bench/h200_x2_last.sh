#!/usr/bin/env bash
# Issue 7, last call of the session on `nvidia-h200-x2` (~8.5 min):
# 1. FSDP2 at world 2, which gave no output in 170 s (and in 100 s at world 4
#    earlier): the truth alone (torchrun), then Prism on 2 GPUs and on 1 GPU,
#    each with a time limit; ranks still running 10 s before it get SIGABRT
#    with PYTHONFAULTHANDLER=1, so their logs show where every thread was.
# 2. GPT tp2 and MoE dp2 ep2 again, 2 interleaved runs each (noise, CI).
#
#   bash bench/h200_x2_last.sh
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT/r/fsdp2"
F=prism/workloads/frameworks/fsdp2.py
ARGS="--dim 1024 --hidden 4096 --layers 4 --batch 2048 --steps 4"
export PYTHONFAULTHANDLER=1
( time timeout -s ABRT 60 python3 -m torch.distributed.run --standalone --nproc-per-node 2 $F $ARGS ) > "$OUT/r/fsdp2/truth.txt" 2>&1
echo "exit $?" >> "$OUT/r/fsdp2/truth.txt"
for g in 0,1 0; do
  n=${g/,/-}
  rm -rf /tmp/f$n
  ( sleep 50; pkill -ABRT -f prism.rank.forkserver ) & k=$!
  ( time timeout 60 python3 -m prism capture -n 2 --nproc-per-node 2 --gpus $g --out /tmp/f$n --progress on \
      --show-ranks all --quiet-period 45 -- $F $ARGS ) > "$OUT/r/fsdp2/prism-gpus-$n.txt" 2>&1
  echo "exit $?" >> "$OUT/r/fsdp2/prism-gpus-$n.txt"
  kill $k 2>/dev/null
  cp -r /tmp/f$n/logs "$OUT/r/fsdp2/logs-$n" 2>/dev/null
done
tail -n 4 "$OUT"/r/fsdp2/*.txt
RUNS=2 KEEP_RUNS="gpt 150 1,2 gpt-tp2;moe 200 1,2 moe-dp2-ep2" bash bench/h200_final.sh
tar czf "$OUT/results.tgz" -C "$OUT" r
