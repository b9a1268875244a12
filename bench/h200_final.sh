#!/usr/bin/env bash
# Issue 7, third call of the session on `nvidia-h200-x4`, after the fixes the
# kept traces of h200_diag.sh pointed at (calibration on steps 2-3 with the
# smallest measurement kept, ranks sharing a GPU take turns on it, FSDP2's
# device under logical devices). One run each, traces kept:
# GPT tp2 dp2 on 1 and 2 GPUs, FSDP2 and MoE on 2 GPUs. KEEP_RUNS picks other
# runs ("name timeout_s gpus config;..."; bench/h200_diag.sh is one such list).
#
#   bash bench/h200_final.sh
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT/r/keep"
NET=${NET:-bench/results/nccl-h200x4-profile.toml}
if [ -z "${SKIP_GPU_TESTS:-}" ]; then
  taskset -c 0-31 timeout 40 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gputime.py 2>&1 | tail -4 \
    > "$OUT/r/gpu-tests.txt"
  tail -2 "$OUT/r/gpu-tests.txt"
fi
# CPUS: the CPUs the runs may use (taskset list); ACCURACY_ARGS: more options
# for nccl_accuracy.py (e.g. a --variant).
run() {  # name timeout gpus config
  # shellcheck disable=SC2086 (ACCURACY_ARGS splits on purpose)
  taskset -c "${CPUS:-0-31}" timeout "$2" python3 bench/nccl_accuracy.py --out-dir "$OUT/r/$1" --configs "$4" --capture-gpus "$3" \
    --runs "${RUNS:-1}" --steps 8 --warmup 3 --net "$NET" --keep-runs "$OUT/r/keep" ${ACCURACY_ARGS:-} 2>&1 | grep -v "^prism: captured\|^\[" \
    > "$OUT/r/$1.txt"
  grep -A3 "^config" "$OUT/r/$1.txt" | head -4; grep "FAILED\|Error" "$OUT/r/$1.txt" | head -3
}
IFS=';' read -ra runs <<< "${KEEP_RUNS:-gpt 150 1,2 gpt-tp2-dp2;fsdp2 100 2 fsdp2;moe 140 2 moe-tp2-dp2-ep2}"
for spec in "${runs[@]}"; do
  # shellcheck disable=SC2086 (the fields split on purpose)
  run $spec
done
du -sh "$OUT/r/keep"
tar czf "$OUT/results.tgz" -C "$OUT" r
