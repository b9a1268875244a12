#!/usr/bin/env bash
# What issue 6 still needs on the H200 machine, in one device call (about 9
# minutes; `nvidia-h200-x2` or `nvidia-h200`), from the repo root, wheels from
# ../shared/tools/device-wheels in .whl/ and $OUT set:
#
#   bash bench/h200_next.sh
#
# 1. GPU 0: MoE world 8 with 6 of 8 resident (gang tp), both steps (the last
#    run was killed at 250 s after step 0; swaps are now streamed to
#    RUN/telemetry/swaps.jsonl, so even a killed run reports them).
# 2. GPU 0 after it: GPT world 16 (tp2 pp2 dp4), --resident 8, gang tpxpp vs tp
#    (two pipelines fit, the case tpxpp is for).
# 3. CPU, cores 8-15 plus what is free: the bundled GPT at 1,024 ranks, 16 slots
#    (fork server now pre-imports torch._dynamo: 4x faster, 4x less host memory
#    per rank at world 64 on the development VM).
# Outputs are bundled into $OUT/results.tgz (the device tool returns few files).
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT/r/moe" "$OUT/r/gang16" "$OUT/r/cpu"
( CUDA_VISIBLE_DEVICES= taskset -c 8-31 timeout 520 python3 bench/gpu_capture.py --out-dir "$OUT/r/cpu" \
    --only cpu_scale --cpu-worlds 1024 --cpu-slots 16 --cpu-timeout 500 --runs-dir /tmp/cs > "$OUT/r/cpu/log.txt" 2>&1 ) &
taskset -c 0-7 timeout 330 python3 bench/gpu_capture.py --out-dir "$OUT/r/moe" --only moe8 --skip-all-resident \
  --resident 6 --gpus 0 --swap-timeout 320 --runs-dir /tmp/gm > "$OUT/r/moe/log.txt" 2>&1
cp /tmp/gm/moe8-r6-tp/telemetry/swaps.json* "$OUT/r/moe/" 2>/dev/null
grep -h "^step" /tmp/gm/moe8-r6-tp/logs/*.log > "$OUT/r/moe/losses.txt" 2>/dev/null
for g in tp tpxpp; do
  rm -rf /tmp/g16-$g
  taskset -c 0-7 timeout 100 python3 -m prism capture -n 16 --resident 8 --gang $g --gpus 0 --out /tmp/g16-$g \
    --progress off --show-ranks none -- -m prism.workloads.gpt --tp 2 --pp 2 --dp 4 --steps 2 --device cuda \
    > "$OUT/r/gang16/$g.txt" 2>&1
  echo "exit $?" >> "$OUT/r/gang16/$g.txt"
  cp /tmp/g16-$g/telemetry/swaps.json* "$OUT/r/gang16/" 2>/dev/null
  for f in "$OUT"/r/gang16/swaps.json*; do [ -e "$f" ] && mv "$f" "${f/swaps/$g-swaps}"; done
done
wait
tar czf "$OUT/results.tgz" -C "$OUT" r
tail -5 "$OUT/r/moe/log.txt"; tail -3 "$OUT"/r/gang16/*.txt; tail -4 "$OUT/r/cpu/log.txt"
