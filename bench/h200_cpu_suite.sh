#!/usr/bin/env bash
# The CPU-side measurements Prism takes on the H200 machine (16 cores, Python
# 3.12, torch 2.11), in one device call. Run from the repo root there, with the
# wheels from ../shared/tools/device-wheels carried in .whl/ and $OUT set:
#
#   bash bench/h200_cpu_suite.sh
#
# Each step is bounded so the whole stays inside one 10-minute call; each
# writes its output under $OUT.
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT"
export PRISM_PROFILE_DIR=$OUT/profiles
{ date -u; nproc; python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__)"; } \
  2>&1 | tee "$OUT/versions.txt"

# Framework coverage on torch 2.11 (CPU tensors; the point is the torch version).
if [ -f tests/test_frameworks.py ] && [ -z "${SKIP_FRAMEWORKS:-}" ]; then
  timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_frameworks.py 2>&1 | tail -25 \
    | tee "$OUT/frameworks-torch2.11.txt"
fi

[ -n "${ONLY_FRAMEWORKS:-}" ] && exit 0

# Fit gloo on these cores, then ground truth vs Prism at world 8.
timeout 60 python3 -m prism netprofile --group-sizes 2,4,8 2>&1 | tail -8 | tee "$OUT/netprofile.txt"
timeout 260 python3 bench/accuracy.py --world 8 --runs 3 --steps 10 --out "$OUT/accuracy-w8.json" 2>&1 \
  | tail -20 | tee "$OUT/accuracy-w8.txt"

# Transport and coordinator overheads on idle cores.
timeout 60 python3 bench/transport.py --out "$OUT/transport.json" 2>&1 | tail -20 | tee "$OUT/transport.txt"
timeout 90 python3 bench/coordinator.py --worlds 16,64 --iters 30 --out "$OUT/coordinator.json" 2>&1 \
  | tail -6 | tee "$OUT/coordinator.txt"
