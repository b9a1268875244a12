#!/usr/bin/env bash
# Issue 7 on `nvidia-h200-x2`, seventh session (2026-11-30): the sixth
# session's model (free finish, cold start, alignment with the largest
# calibrated time the wall allows), unchanged, against new interleaved truths:
# the out-of-sample check of choices made on the 47 kept captures. World 2,
# captures on 1 and 2 GPUs, traces kept.
#   PART=a: GPT tp2 x2, GPT pp2 x2, MoE x1 (~7 min)
#   PART=b: FSDP2 x1, then FSDP2's truth timeline beside a capture's
#           (bench/h200_x2_timeline.sh) (~6 min)
#   PART=c: bench/cpu_noise.py (CPU topology, FSDP2's draw alone / paired on
#           SMT siblings / on distinct cores, 4 plain FSDP2 runs with the main
#           threads' CPU time, run-queue wait and CPUs), then MoE x1 (~5 min)
#   PART=d: a probe of the CPU's single-thread speed (bench/cpu_noise.py
#           --sample, every 0.5 s) beside FSDP2 x2 and MoE x1 (~7.5 min)
#   PART=e: 5 plain FSDP2 runs, step 5 profiled with operators (its
#           aten::randn time beside the run's step time), then MoE x1 (~4 min)
# Every part samples the GPUs' SM clock, power and throttle reasons every
# 100 ms into smi.csv (does a truth that moves between calls move with the
# clock?).
#
#   PART=a bash bench/h200_x2_seventh.sh
set -u
. bench/device_env.sh || exit 1
mkdir -p "$OUT/r"
export NET=bench/results/nccl-h200x2-issue-profile.toml SKIP_GPU_TESTS=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$OUT/r/smi-before.txt" 2>&1
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 100 > "$OUT/smi.csv" 2>&1 &
smi=$!
if [ "${PART:-a}" = a ]; then
  RUNS=2 KEEP_RUNS="gpt 110 1,2 gpt-tp2;pp2 120 1,2 gpt-pp2" bash bench/h200_final.sh
  RUNS=1 KEEP_RUNS="moe 190 1,2 moe-dp2-ep2" bash bench/h200_final.sh
elif [ "${PART}" = c ]; then
  . bench/workloads.sh
  # shellcheck disable=SC2046 (the words split on purpose)
  taskset -c 0-31 timeout 200 python3 bench/cpu_noise.py --json "$OUT/r/cpu_noise.json" --truth 4 --world 2 \
    -- $(workload_args fsdp2) 2>&1 | tee "$OUT/r/cpu_noise.txt"
  RUNS=1 KEEP_RUNS="moe 190 1,2 moe-dp2-ep2" bash bench/h200_final.sh
elif [ "${PART}" = d ]; then
  python3 bench/cpu_noise.py --json /dev/null --sample "$OUT/r/cpu_probe.log" --interval 0.5 &
  probe=$!
  RUNS=2 KEEP_RUNS="fsdp2 380 1,2 fsdp2;moe 170 1,2 moe-dp2-ep2" bash bench/h200_final.sh
  kill $probe
elif [ "${PART}" = e ]; then
  . bench/workloads.sh
  # shellcheck disable=SC2046 (the words split on purpose)
  taskset -c 0-31 timeout 150 python3 bench/cpu_noise.py --json "$OUT/r/cpu_noise_e.json" --no-draws --truth 5 \
    --profile-step 5 --world 2 -- $(workload_args fsdp2) 2>&1 | tee "$OUT/r/cpu_noise_e.txt"
  RUNS=1 KEEP_RUNS="moe 130 1,2 moe-dp2-ep2" bash bench/h200_final.sh
else
  RUNS=1 KEEP_RUNS="fsdp2 200 1,2 fsdp2" bash bench/h200_final.sh
  mv "$OUT/results.tgz" "$OUT/accuracy.tgz"
  cp -r "$OUT/r" /tmp/r-accuracy
  SEGS=fsdp2 bash bench/h200_x2_timeline.sh
  mv "$OUT/results.tgz" "$OUT/timeline.tgz"
  rm -rf "$OUT/r"; mv /tmp/r-accuracy "$OUT/r"
fi
kill $smi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$OUT/r/smi-after.txt" 2>&1
tar czf "$OUT/results.tgz" -C "$OUT" r
