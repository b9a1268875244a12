#!/usr/bin/env bash
# Issue 7 on a 4-GPU H200 machine (`nvidia-h200-x4`), one device call (about
# 9 minutes), from the repo root, wheels from ../shared/tools/device-wheels in
# .whl/ and $OUT set:
#
#   bash bench/h200_x4_suite.sh
#
# 1. GPU unit tests of the two-clock timing (tests/test_gputime.py) and CUDA
#    tensors through the backend.
# 2. `prism netprofile --backend nccl` on the 4 GPUs (group sizes 2 and 4).
# 3. bench/nccl_accuracy.py at world 4 (NCCL ground truth one process per GPU,
#    runs interleaved): GPT tp2 dp2, MoE tp2 dp2 ep2 and FSDP2 captured on 2
#    GPUs (2 runs each), then GPT tp2 dp2 captured on 1 GPU (1 run).
# Everything is also bundled into $OUT/results.tgz.
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT/r"
export PRISM_PROFILE_DIR=$OUT/r/profiles
{ date -u; nproc; nvidia-smi -L; nvidia-smi topo -m;
  python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
} > "$OUT/r/versions.txt" 2>&1
taskset -c 0-31 timeout 45 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gputime.py tests/test_backend.py \
  2>&1 | tail -15 > "$OUT/r/gpu-tests.txt"
tail -3 "$OUT/r/gpu-tests.txt"
taskset -c 0-31 timeout 60 python3 -m prism netprofile --backend nccl --json "$OUT/r/netprofile-nccl.json" \
  > "$OUT/r/netprofile-nccl.txt" 2>&1
tail -6 "$OUT/r/netprofile-nccl.txt"
taskset -c 0-31 timeout "${A_TIMEOUT:-330}" python3 bench/nccl_accuracy.py --out-dir "$OUT/r/a" \
  --configs gpt-tp2-dp2,moe-tp2-dp2-ep2,fsdp2 --capture-gpus 2 --runs 2 --steps 8 --warmup 3 \
  --budget "${A_BUDGET:-250}" 2>&1 | grep -v "^prism: captured\|^\[" > "$OUT/r/nccl_accuracy-a.txt"
tail -14 "$OUT/r/nccl_accuracy-a.txt"
taskset -c 0-31 timeout "${C_TIMEOUT:-110}" python3 bench/nccl_accuracy.py --out-dir "$OUT/r/c" --configs gpt-tp2-dp2 \
  --capture-gpus 1 --runs 1 --steps 8 --warmup 3 2>&1 | grep -v "^prism: captured\|^\[" > "$OUT/r/nccl_accuracy-c.txt"
tail -8 "$OUT/r/nccl_accuracy-c.txt"
tar czf "$OUT/results.tgz" -C "$OUT" r
