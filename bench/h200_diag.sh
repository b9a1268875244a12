#!/usr/bin/env bash
# Issue 7, second call of the session on `nvidia-h200-x4`: keep the Prism
# captures' traces for study (--keep-runs), one run each: FSDP2 (never run
# before) and MoE on 2 GPUs, GPT tp2 dp2 on 1 GPU; the NCCL profile fitted in
# the first call (bench/results/nccl-h200x4-profile.toml) is reused.
#
#   bash bench/h200_diag.sh
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
OUT=${OUT:-/tmp/prism-out}
mkdir -p "$OUT/r/keep"
NET=bench/results/nccl-h200x4-profile.toml
run() {  # name timeout gpus config
  taskset -c 0-31 timeout "$2" python3 bench/nccl_accuracy.py --out-dir "$OUT/r/$1" --configs "$4" --capture-gpus "$3" \
    --runs 1 --steps 8 --warmup 3 --net "$NET" --keep-runs "$OUT/r/keep" 2>&1 | grep -v "^prism: captured\|^\[" \
    > "$OUT/r/$1.txt"
  grep -A3 "^config" "$OUT/r/$1.txt" | head -4; grep "FAILED\|Error" "$OUT/r/$1.txt" | head -3
}
run fsdp2 150 2 fsdp2
run gpt1 120 1 gpt-tp2-dp2
run moe2 140 2 moe-tp2-dp2-ep2
du -sh "$OUT/r/keep"
tar czf "$OUT/results.tgz" -C "$OUT" r
