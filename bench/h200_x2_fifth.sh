#!/usr/bin/env bash
# Issue 7 on `nvidia-h200-x2`, fifth session, first call (~9.5 min): confirm
# or refute live what the kept captures suggested offline (CPU shares by their
# minimum, bench/cpu_share_choice.py), and check the reference-cycle fix of the
# backend (Prism's peak memory 176-192 MiB above the truth at world 2).
# 1. GPT tp2 and MoE dp2 ep2 at world 2: truth vs Prism on 1 and 2 GPUs, two
#    interleaved runs of GPT, one of MoE (time), traces kept (re-predicted offline with any profile);
# 2. the GPU tests of the paths touched since the last GPU run (identity
#    devices' set_device, calibration);
# 3. bench/drain_effect.py (CPU issue right after a drain vs ahead);
# 4. the NCCL profile fitted on this host (world 2), for the offline replays.
#
#   bash bench/h200_x2_fifth.sh
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT/r"
RUNS=2 KEEP_RUNS="gpt 150 1,2 gpt-tp2" bash bench/h200_final.sh
mv "$OUT/r/gpt.txt" "$OUT/r/gpt-runs2.txt"
SKIP_GPU_TESTS=1 RUNS=1 KEEP_RUNS="moe 170 1,2 moe-dp2-ep2" bash bench/h200_final.sh
# (h200_final.sh ran the calibration's GPU test; these are the device tests)
timeout 50 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_devices.py tests/test_backend.py 2>&1 | tail -4 \
  > "$OUT/r/gpu-tests-devices.txt"
tail -2 "$OUT/r/gpu-tests-devices.txt"
timeout 40 python3 bench/drain_effect.py --json "$OUT/r/drain_effect.json" > "$OUT/r/drain_effect.txt" 2>&1
cat "$OUT/r/drain_effect.txt"
timeout 70 python3 -m prism netprofile --backend nccl --group-sizes 2 \
  --sizes 1K,16K,128K,1M,4M,16M,64M,256M --out "$OUT/r/nccl-h200x2-fifth-profile.toml" \
  --json "$OUT/r/netprofile-nccl-h200x2-fifth.json" > "$OUT/r/netprofile.txt" 2>&1
tail -3 "$OUT/r/netprofile.txt"
tar czf "$OUT/results.tgz" -C "$OUT" r
