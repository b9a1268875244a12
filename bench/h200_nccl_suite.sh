#!/usr/bin/env bash
# Issue 7 (and issue 4's torch-2.11 check) in one device call on a 2-GPU H200
# machine (`nvidia-h200-x2`), from the repo root, wheels in .whl/ and $OUT set:
#
#   bash bench/h200_nccl_suite.sh
#
# Foreground, pinned to cores 0-15: NCCL netprofile, then bench/nccl_accuracy.py
# (NCCL ground truth, one process per GPU, vs Prism on 1 and 2 GPUs).
# Background, pinned to cores 16-31: tests/test_frameworks.py on CPU tensors
# (the machine's torch 2.11 is the point).
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT"
export PRISM_PROFILE_DIR=$OUT/profiles
{ date -u; nproc; nvidia-smi -L; nvidia-smi topo -m;
  python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  python3 -c "import torch.distributed as d; print('ReduceOp has factor:', hasattr(d.ReduceOp, 'factor'))"
} 2>&1 | tee "$OUT/versions.txt"

if [ -z "${SKIP_FRAMEWORKS:-}" ]; then
  ( CUDA_VISIBLE_DEVICES= taskset -c 16-31 timeout "${FW_TIMEOUT:-500}" python3 -m pytest -q -p no:cacheprovider \
      tests/test_frameworks.py > "$OUT/frameworks-torch2.11.txt" 2>&1;
    echo "exit $?" >> "$OUT/frameworks-torch2.11.txt" ) &
fi

taskset -c 0-15 timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_netprofile.py 2>&1 | tail -3 \
  | tee "$OUT/gpu-tests.txt"
taskset -c 0-15 timeout 90 python3 -m prism netprofile --backend nccl --json "$OUT/netprofile-nccl.json" 2>&1 \
  | tee "$OUT/netprofile-nccl.txt" | tail -12
taskset -c 0-15 timeout "${ACC_TIMEOUT:-420}" python3 bench/nccl_accuracy.py --out-dir "$OUT" --runs "${RUNS:-3}" \
  --steps 12 --warmup 3 --budget "${ACC_BUDGET:-300}" ${ACC_ARGS:-} 2>&1 | grep -v "^prism: captured\|^\[" \
  | tee "$OUT/nccl_accuracy.txt" | tail -40
wait
tail -30 "$OUT/frameworks-torch2.11.txt"
