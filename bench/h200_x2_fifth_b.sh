#!/usr/bin/env bash
# Issue 7 on `nvidia-h200-x2`, fifth session, second call (~8.5 min):
# 1. GPU tests of this session's changes: the NCCL profile's GPU/issue split
#    (test_netprofile), no second CUDA context on another rank's GPU
#    (test_devices, 2 GPUs), CUDA tensors through the backend;
# 2. the NCCL profile fitted on this host with GPU times and issue costs;
# 3. FSDP2 (dim 512, hidden 2048, 4 layers; never measured before) and GPT
#    pp2 (a third layout) at world 2, truth vs Prism on 1 and 2 GPUs,
#    predicted with that profile; traces kept.
#
#   bash bench/h200_x2_fifth_b.sh
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT/r"
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_netprofile.py tests/test_devices.py \
  tests/test_backend.py 2>&1 | tail -8 > "$OUT/r/gpu-tests-b.txt"
tail -3 "$OUT/r/gpu-tests-b.txt"
P="$OUT/r/nccl-h200x2-issue-profile.toml"
timeout 100 python3 -m prism netprofile --backend nccl --group-sizes 2 \
  --sizes 1K,16K,128K,1M,4M,16M,64M,256M --out "$P" --json "$OUT/r/netprofile-nccl-h200x2-issue.json" \
  > "$OUT/r/netprofile-issue.txt" 2>&1
tail -12 "$OUT/r/netprofile-issue.txt"
[ -f "$P" ] || P=bench/results/nccl-h200x4-profile.toml
NET="$P" SKIP_GPU_TESTS=1 RUNS=2 KEEP_RUNS="fsdp2 210 1,2 fsdp2" bash bench/h200_final.sh
NET="$P" SKIP_GPU_TESTS=1 RUNS=1 KEEP_RUNS="pp2 110 1,2 gpt-pp2" bash bench/h200_final.sh
tar czf "$OUT/results.tgz" -C "$OUT" r
