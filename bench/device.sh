#!/usr/bin/env bash
# The device runner: runs named benchmark suites on a GPU machine, from the
# repository root there, each step bounded by a timeout so a suite fits one
# device call (10 minutes).
#
#   bash bench/device.sh SUITE [SUITE...]      # e.g. bash bench/device.sh nccl-accuracy
#   DRY=1 bash bench/device.sh SUITE           # print the commands, run nothing
#   bash bench/device.sh list                  # the suites
#
# Every suite writes under $OUT/r (default $OUT=/tmp/prism-out) and the runner
# bundles it into $OUT/results.tgz at the end, then removes $OUT/r (KEEP_R=1:
# not): the device returns only a handful of loose files from $OUT, and a call
# that deleted the tarball lost its call logs (2026-12-07). Do not delete
# results.tgz. Copy what is worth keeping to bench/results/ under the names
# bench/README.md gives.
#
# The device machine lacks some wheels (trio, pyzmq, orjson, pytest-trio):
# carry them in .whl/ (from ../shared/tools/device-wheels); the runner
# installs them into /tmp/site and puts them and this checkout on PYTHONPATH.
#
# Knobs (environment):
#   H200_SUITES, OTHER_SUITES  by-card: the suites to run on an H200, and on any other card (a call for
#            nvidia-h200 may get an H100), e.g. H200_SUITES=gpu-sandbox OTHER_SUITES=comm-share OTHER_CPU=1;
#            H200_ENV, OTHER_ENV: each card's own knobs, ';'-separated, e.g. H200_ENV="REPS=1;WL=gpt-tp2 moe"
#            (OTHER_CPU=1: the other card's suites run with CUDA_VISIBLE_DEVICES= set, for CPU truths,
#            after host-check)
#   CPUS     the CPUs the steps may use (taskset list; default all)
#   RUNS     interleaved truth/Prism runs per workload (nccl-accuracy*: default 1)
#   SPECS    nccl-accuracy's workloads: "name timeout_s capture_gpus config;..."
#            (config: a bench/nccl_accuracy.py --configs name)
#   NET      the cost profile the captures are predicted with
#            (default bench/results/netprofile-2026-11-29-h200x2-nccl-issue.toml)
#   ACCURACY_ARGS  more options for bench/nccl_accuracy.py (e.g. --variant ...)
#   GROUP_SIZES    netprofile's group sizes (default 2)
#   SEGS     truth-segments / truth-timeline workloads (gpt-tp2, pp2, moe, fsdp2)
#   SMI=0    do not sample the GPUs' clocks into $OUT/r/smi.csv (nccl-accuracy*)
#   PROBE=1  nccl-accuracy*: sample the CPU's single-thread speed beside the runs
#   TESTS    gpu-tests: the test files (run with -m gpu); TG its bound in s (default 200)
#   INSITU=1 emulate-accuracy*: after each capture `prism commtime` times its calls for real (bench/accuracy.py
#            --in-situ): an in-situ prediction column, and the emulation's virtual ranks take those times
#   KEEP=1   emulate-accuracy*, calibration: keep each capture's graph under $R/keep-* (no payloads;
#            bench/accuracy.py --keep-runs), for replaying the CPU captures offline against their truths
set -u
OUT=${OUT:-/tmp/prism-out}
R=$OUT/r
CPUS=${CPUS:-0-$(($(nproc) - 1))}
NET=${NET:-bench/results/netprofile-2026-11-29-h200x2-nccl-issue.toml}
export PYTHONUNBUFFERED=1 PRISM_PROFILE_DIR=$OUT/r/profiles

# The accuracy bench's world-2 GPU commands (as bench/nccl_accuracy.py runs them), by name.
GPT="-m prism.workloads.gpt --hidden 1024 --layers 4 --heads 16 --seq-len 512 --batch 8 --micro-batches 2
     --vocab 4096 --device cuda --steps 8"
FSDP2="prism/workloads/frameworks/fsdp2.py --dim 512 --hidden 2048 --layers 4 --batch 4096 --steps 8"
STEPCLOCK=prism/validation/stepclock.py
workload_args() {
  case $1 in
    gpt-tp2) echo "$GPT --tp 2 --pp 1 --dp 1" ;;
    pp2) echo "$GPT --tp 1 --pp 2 --dp 1" ;;
    moe) echo "$GPT --tp 1 --pp 1 --dp 2 --ep 2 --experts 4" ;;
    fsdp2) echo "$FSDP2" ;;
    *) echo "unknown workload $1 (gpt-tp2, pp2, moe, fsdp2)" >&2; return 2 ;;
  esac
}

x() {  # LOG TIMEOUT CMD...: CMD on $CPUS, bounded by TIMEOUT s, its output in LOG
  local log=$1 t=$2; shift 2
  if [ -n "${DRY:-}" ]; then
    printf 'taskset -c %s timeout %s' "$CPUS" "$t"; printf ' %q' "$@"; printf ' > %s 2>&1\n' "$log"
    return 0
  fi
  taskset -c "$CPUS" timeout "$t" "$@" > "$log" 2>&1
  echo "exit $?" >> "$log"
  grep -v "^prism: captured\|^\[" "$log" | tail -n "${TAIL:-8}"
}

bg() {  # CMD...: start CMD in the background (DRY: print it); its pid in $BG
  if [ -n "${DRY:-}" ]; then printf '(background)'; printf ' %q' "$@"; printf '\n'; BG=; return 0; fi
  "$@" & BG=$!
}

stop() { [ -n "${1:-}" ] && kill "$1" 2>/dev/null; return 0; }

versions() {
  [ -n "${DRY:-}" ] && { echo "(versions into $R/versions.txt)"; return 0; }
  { date -u; nproc; nvidia-smi -L; nvidia-smi topo -m
    lscpu; grep MHz /proc/cpuinfo
    # a CPU quota and its throttling, CPU pressure: why CPU truths may swing (comm_share records them per truth run)
    echo "cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>&1)"; cat /sys/fs/cgroup/cpu.stat /proc/pressure/cpu
    python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__)"
    python3 -c "import torch; print('nccl', torch.cuda.nccl.version())"
  } > "$R/versions.txt" 2>&1
}

smi_start() {
  SMI_PID=
  [ "${SMI:-1}" = 0 ] && return 0
  bg nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader -lms 100 --filename="$R/smi.csv"
  SMI_PID=$BG
}

# --- suites (the comment after each name is what `list` prints) ---------------

suite_nccl_accuracy() {  # NCCL ground truth (one process per GPU) vs Prism on 1 and 2 GPUs, traces kept
  local spec name t gpus config probe=
  [ -n "${DRY:-}" ] || mkdir -p "$R/keep"
  smi_start
  if [ "${PROBE:-0}" = 1 ]; then
    bg python3 bench/cpu_noise.py --json /dev/null --sample "$R/cpu_noise-probe.log" --interval 0.5
    probe=$BG
  fi
  IFS=';' read -ra specs <<< "${SPECS:-gpt 110 1,2 gpt-tp2;pp2 120 1,2 gpt-pp2;moe 190 1,2 moe-dp2-ep2}"
  for spec in "${specs[@]}"; do
    read -r name t gpus config <<< "$spec"
    # shellcheck disable=SC2086 (ACCURACY_ARGS splits on purpose)
    x "$R/nccl_accuracy-$name.txt" "$t" python3 bench/nccl_accuracy.py --out-dir "$R/$name" --configs "$config" \
      --capture-gpus "$gpus" --runs "${RUNS:-1}" --steps 8 --warmup 3 --net "$NET" --keep-runs "$R/keep" ${ACCURACY_ARGS:-}
  done
  stop "$probe"; stop "$SMI_PID"
}

suite_nccl_accuracy_calibrated() {  # the same, each run also captured with every step's GPU time measured
  RUNS=${RUNS:-2} SPECS=${SPECS:-"moe 330 1,2 moe-dp2-ep2"} \
    ACCURACY_ARGS="--variant cal:PRISM_GPU_CALIBRATE=2-7 ${ACCURACY_ARGS:-}" suite_nccl_accuracy
}

suite_netprofile() {  # NCCL collectives on this machine's GPUs, fitted into a cost profile
  x "$R/netprofile-nccl.txt" 120 python3 -m prism netprofile --backend nccl --group-sizes "${GROUP_SIZES:-2}" \
    --sizes 1K,16K,128K,1M,4M,16M,64M,256M --out "$R/netprofile-nccl.toml" --json "$R/netprofile-nccl.json"
}

suite_gpu_tests() {  # the tests marked gpu
  # shellcheck disable=SC2086 (TESTS splits on purpose)
  x "$R/gpu-tests.txt" "${TG:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu \
    ${TESTS:-tests/integration/test_gputime.py tests/integration/test_devices.py tests/integration/test_backend.py tests/unit/test_netprofile.py tests/integration/test_swap.py}
}

suite_frameworks() {  # framework coverage on this machine's torch (CPU tensors)
  x "$R/frameworks.txt" 500 env CUDA_VISIBLE_DEVICES= python3 -m pytest -q -p no:cacheprovider tests/integration/test_frameworks.py
}

suite_cpu_accuracy() {  # gloo on the host's cores: profile, truth vs Prism at world 8, transport and coordinator costs
  x "$R/netprofile-gloo.txt" 60 python3 -m prism netprofile --group-sizes 2,4,8 --out "$R/netprofile-gloo.toml"
  x "$R/accuracy-world8.txt" 260 python3 bench/accuracy.py --world 8 --runs 3 --steps 10 --out "$R/accuracy-world8.json"
  x "$R/transport_throughput.txt" 60 python3 bench/transport_throughput.py --out "$R/transport_throughput.json"
  x "$R/coordinator.txt" 90 python3 bench/coordinator.py --worlds 16,64 --iters 30 --out "$R/coordinator.json"
}

suite_emulate_accuracy() {  # gloo on the host's cores: truth vs predicted (three profiles) vs emulated, world 8
  x "$R/accuracy-world8.txt" ${T8:-540} python3 bench/accuracy.py --world 8 --runs ${RUNS:-3} --steps 10 \
    ${CONFIGS8:+--configs $CONFIGS8} ${KEEP:+--keep-runs "$R/keep-accuracy8"} ${INSITU:+--in-situ} --out "$R/accuracy-world8.json"
}

suite_emulate_accuracy_16() {  # the same at world 16 (GPT in two layouts, the MoE)
  x "$R/accuracy-world16.txt" ${T16:-540} python3 bench/accuracy.py --world 16 --runs ${RUNS:-3} --steps 10 \
    --configs ${CONFIGS16:-gpt-tp2-pp2-dp4,moe-tp2-dp8-ep2} ${KEEP:+--keep-runs "$R/keep-accuracy16"} ${INSITU:+--in-situ} \
    --out "$R/accuracy-world16.json"
}

suite_calibration() {  # slice calibration vs truth on the host's cores: bare, calibrated, packed, symmetric; W=8 16; POLLUTED=1 (PLAIN=0: only that; CALCONFIGS: --configs)
  # Time per pair on a 16-core host (2026-12-06): truth + capture ~15 s; calibrated 30-35 s (world 8) and
  # 35-60 s (world 16), symmetric 9-17 s, packed 8-12 s; each config runs RUNS pairs within TW seconds, so
  # world 16 with the default variants needs TW=450 for RUNS=2 (a cut run keeps its finished pairs).
  # NETP: a profile file, or measured / per-op / one-fit / concurrent: gloo points measured on this host
  # first (bench/accuracy.py's profiles; adds 30-60 s per step).
  local netp=${NETP:-bench/results/netprofile-2026-12-02-h200cpu-gloo.toml} w prof
  case $netp in measured|per-op|one-fit|concurrent) prof=(--profile "$netp") ;; *) prof=(--net "$netp") ;; esac
  for w in ${W:-8}; do
    [ "${PLAIN:-1}" != 0 ] && x "$R/calibration-world$w.txt" ${TW:-280} python3 bench/calibration.py --world "$w" \
      --runs ${RUNS:-3} "${prof[@]}" --variants ${VARIANTS:-calibrated,packed,symmetric} ${CALCONFIGS:+--configs $CALCONFIGS} \
      ${KEEP:+--keep-runs "$R/keep-calibration$w"} --out "$R/calibration-world$w.json"
    if [ -n "${POLLUTED:-}" ]; then  # a capture of every rank at once on a quarter of the cores
      x "$R/calibration-world$w-polluted.txt" ${TW:-280} python3 bench/calibration.py --world "$w" --runs ${RUNS:-3} \
        --capture-cores $((w / 4)) --capture-slots "$w" "${prof[@]}" --variants ${VARIANTS:-calibrated,packed,symmetric} \
        ${CALCONFIGS:+--configs $CALCONFIGS} ${KEEP:+--keep-runs "$R/keep-calibration$w-polluted"} \
        --out "$R/calibration-world$w-polluted.json"
    fi
  done
}

suite_gpu_sandbox() {  # cuda_ext (build, GPU tests, bench), then WL (default gpt-tp2) emulated with a GPU sandbox, both paths
  # WL: workloads of workload_args (gpt-tp2 pp2 moe); HOST=0 skips the host path; KERNELS=0 skips the
  # GPU tests and kernel bench; REC=1 records rank 0 in the capture (the device path then delivers the
  # recording from its prefetch pool), COMP=1 adds a device-path run without it; OOM=GIB adds a capture
  # and a device-path emulation of the first workload under --memory-limit GIB; POOL=MIB sets the device-path
  # runs' --prefetch-pool; SWITCH=US the sandboxes' PRISM_SWITCH_INTERVAL_US (the GIL's switch interval);
  # CALLLOG=1 writes each device-path emulation's call log (PRISM_DEVICE_CALL_LOG) to $R/calls-WL-NAME-rRANK.jsonl.
  # PROFILE="moe ...": for those workloads, the recorded run again with its sandbox profiled
  # (PRISM_PROFILE_RANK: $R/prof-WL/rank-0.prof; a diagnostic run apart, cProfile slows it).
  # HCAB="moe ...": for those workloads, the compensated run again with PRISM_DEVICE_HOST_CHARGE=0 (device-comp-hc0).
  # REPS=N: the device (and COMP) emulations N times each on the one capture (device, device-2, ...), interleaved.
  # CAPS=N: N captures of each workload (cap-WL, cap-WL-c2, ...), each with its REPS emulations (call logs: the first's);
  # PROFILE, HCAB, HOST and OOM use the first capture.
  export PRISM_CUDA_EXT_DIR=${PRISM_CUDA_EXT_DIR:-/tmp/cuext}
  x "$R/cuda_ext-build.txt" 200 python3 -c "import cuda_ext; print(cuda_ext.info())"
  if [ "${KERNELS:-1}" != 0 ]; then
    x "$R/cuda_ext-tests.txt" 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_cuda_ext_gpu.py \
      tests/unit/test_devicepath_gpu.py
    x "$R/cuda_kernels.txt" 120 python3 bench/cuda_kernels.py --out "$R/cuda_kernels.json"
  fi
  local w rec=() first= pool=()
  [ "${REC:-0}" = 1 ] && rec=(--record 0)
  [ -n "${POOL:-}" ] && pool=(--prefetch-pool "$POOL")
  local sw=(PRISM_STACK_DUMP_S=20)  # the emulations' environment (not the captures')
  [ -n "${SWITCH:-}" ] && sw+=(PRISM_SWITCH_INTERVAL_US="$SWITCH")
  local w0 c
  for w0 in ${WL:-gpt-tp2}; do
   first=${first:-$w0}
   for c in $(seq 1 "${CAPS:-1}"); do  # CAPS=N: N captures of each workload (cap-WL, cap-WL-c2, ...)
    w=$w0; [ "$c" -gt 1 ] && w=$w0-c$c
    # shellcheck disable=SC2046 (the words split on purpose)
    x "$R/capture-$w.txt" 120 python3 -m prism capture -n 2 --gpus 0 "${rec[@]}" --out "$R/cap-$w" --progress off -- \
      $(workload_args "$w0")
    local cl=() clc=()
    [ "${CALLLOG:-0}" = 1 ] && [ "$c" = 1 ] && cl=(PRISM_DEVICE_CALL_LOG="$R/calls-$w-device-r{rank}.jsonl") \
      && clc=(PRISM_DEVICE_CALL_LOG="$R/calls-$w-device-comp-r{rank}.jsonl")
    local k sfx
    for k in $(seq 1 "${REPS:-1}"); do  # REPS=N: each emulation N times on the one capture (its own spread)
      sfx=; [ "$k" -gt 1 ] && sfx=-$k && cl=() && clc=()  # the call logs of the first only
      x "$R/emulate-$w-device$sfx.txt" 120 env "${sw[@]}" "${cl[@]}" python3 -m prism emulate "$R/cap-$w" --sandbox 0 \
        --device-path "${pool[@]}" --net "$NET" --warmup 3 --name "device$sfx" --quiet 25 --progress off
      [ "${COMP:-0}" = 1 ] && x "$R/emulate-$w-device-comp$sfx.txt" 120 env "${sw[@]}" "${clc[@]}" python3 -m prism \
        emulate "$R/cap-$w" --sandbox 0 --device-path --no-recording --net "$NET" --warmup 3 --name "device-comp$sfx" \
        --quiet 25 --progress off
    done
   done
   w=$w0
    case " ${PROFILE:-} " in  # a diagnostic run apart (cProfile slows the sandbox): the recorded run profiled
      *" $w "*) x "$R/emulate-$w-device-prof.txt" 120 env "${sw[@]}" PRISM_PROFILE_RANK="$R/prof-$w" python3 -m prism \
        emulate "$R/cap-$w" --sandbox 0 --device-path --net "$NET" --warmup 3 --name device-prof --quiet 25 \
        --progress off ;;
    esac
    case " ${HCAB:-} " in  # the host charge's paired baseline: the compensated run again with the charge off
      *" $w "*) x "$R/emulate-$w-device-comp-hc0.txt" 120 env "${sw[@]}" PRISM_DEVICE_HOST_CHARGE=0 python3 -m prism \
        emulate "$R/cap-$w" --sandbox 0 --device-path --no-recording --net "$NET" --warmup 3 --name device-comp-hc0 \
        --quiet 25 --progress off ;;
    esac
    [ "${HOST:-1}" = 0 ] || x "$R/emulate-$w-host.txt" 200 python3 -m prism emulate "$R/cap-$w" --sandbox 0 \
      --net "$NET" --warmup 3 --name host --progress off
  done
  if [ -n "${OOM:-}" ] && [ -n "$first" ]; then
    # shellcheck disable=SC2046
    x "$R/capture-$first-oom.txt" 120 python3 -m prism capture -n 2 --gpus 0 --memory-limit "$OOM" \
      --out "$R/cap-$first-oom" --progress off -- $(workload_args "$first")
    x "$R/emulate-$first-oom.txt" 120 python3 -m prism emulate "$R/cap-$first" --sandbox 0 --device-path \
      --memory-limit "$OOM" --net "$NET" --name device-oom --quiet 25 --progress off
  fi
  [ -n "${DRY:-}" ] || find "$R" \( -name '*.bin' -o -name timeline.json \) -delete  # the bundle stays small
}

suite_sandbox_ab() {  # one capture per WL, then VARIANTS of its device-path emulation interleaved REPS times
  # VARIANTS (default "rec rec-carrymin comp comp-carrymin"): rec = with the recording, comp =
  # --no-recording, each with Prism's defaults and these suffixes: -early = PRISM_EARLY_RELEASE=1 (a
  # collective released before its reach where the engine knows its completion); -drained =
  # PRISM_DEVICE_HOST_CHARGE=drained (the host charge's rule before 2026-12-06); -carrymin / -carryall / -carrystep =
  # PRISM_DEVICE_LATE_CARRY=min / all / step (the default: excess); -pollN = PRISM_DEVICE_POLL_US=N (the reach
  # watcher's poll period, default 20 us); -pypoll = PRISM_DEVICE_POLL_NATIVE=0 (the watcher polls in Python,
  # taking the GIL at each look, as before 2026-12-07); -torchpool = PRISM_POOL_NATIVE=0 (the prefetch pool's
  # copies and events through torch's Python API, as before 2026-12-07); -swN = PRISM_SWITCH_INTERVAL_US=N (the
  # sandbox's GIL switch interval, us; Python's default 5,000); -shm = PRISM_DEVICE_SHARED_RELEASE=1 (the coordinator
  # releases through shared memory, protocol 11); -holdgil = PRISM_CUDA_EXT_HOLD_GIL=1 (cuda_ext's stream calls keep the
  # GIL: with -shm, e.g. rec-shm-holdgil); -deliv = PRISM_DEVICE_CARRY_DELIVERY=1 (the outputs' forming after the
  # wait counts as the call's lateness); -atreach = PRISM_DEVICE_ARRIVE_AT_REACH=1 (protocol 12: a device-path call's
  # arrival at its reach, with it; -atissue = ...=0, the default). CALLLOG=1: the first round's call logs.
  # REUSE=1: each WL's last capture in /tmp (a warm machine's) instead of a new one.
  # One line a run in $R/sandbox_ab.txt (with a call log, bench/late_carry.py's line for it: what each
  # carry rule would have given), each run's summary JSON in $R/ab-WL-VARIANT-K.json.
  export PRISM_CUDA_EXT_DIR=${PRISM_CUDA_EXT_DIR:-/tmp/cuext}
  local w v k env cap
  for w in ${WL:-gpt-tp2}; do
    # a fresh capture per run of the suite (a warm machine keeps /tmp); REUSE=1: the last one there, if any
    cap=; [ "${REUSE:-0}" = 1 ] && cap=$(ls -td /tmp/ab-cap-$w-* 2>/dev/null | head -1)
    if [ -n "$cap" ]; then
      echo "sandbox-ab: $w reuses the capture $cap" | tee -a "$R/sandbox_ab.txt"
    else
      cap=/tmp/ab-cap-$w-$$; rm -rf "$cap"
      # shellcheck disable=SC2046 (the words split on purpose)
      x "$R/capture-$w.txt" 150 python3 -m prism capture -n 2 --gpus 0 --record 0 --out "$cap" --progress off -- \
        $(workload_args "$w")
    fi
    for k in $(seq 1 "${REPS:-1}"); do
      for v in ${VARIANTS:-rec rec-carrymin comp comp-carrymin}; do
        env=(PRISM_STACK_DUMP_S=20)
        case $v in *-early*) env+=(PRISM_EARLY_RELEASE=1) ;; esac
        case $v in *-drained*) env+=(PRISM_DEVICE_HOST_CHARGE=drained) ;; esac
        case $v in *-carryall*) env+=(PRISM_DEVICE_LATE_CARRY=all) ;; *-carrymin*) env+=(PRISM_DEVICE_LATE_CARRY=min) ;;
          *-carrystep*) env+=(PRISM_DEVICE_LATE_CARRY=step) ;; esac
        case $v in *-poll[0-9]*) local pu=${v##*-poll}; env+=(PRISM_DEVICE_POLL_US="${pu%%-*}") ;; esac
        case $v in *-pypoll*) env+=(PRISM_DEVICE_POLL_NATIVE=0) ;; esac
        case $v in *-torchpool*) env+=(PRISM_POOL_NATIVE=0) ;; esac
        case $v in *-sw[0-9]*) local swu=${v##*-sw}; env+=(PRISM_SWITCH_INTERVAL_US="${swu%%-*}") ;; esac
        case $v in *-shm*) env+=(PRISM_DEVICE_SHARED_RELEASE=1) ;; esac
        case $v in *-holdgil*) env+=(PRISM_CUDA_EXT_HOLD_GIL=1) ;; esac
        case $v in *-deliv*) env+=(PRISM_DEVICE_CARRY_DELIVERY=1) ;; esac
        case $v in *-atissue*) env+=(PRISM_DEVICE_ARRIVE_AT_REACH=0) ;; *-atreach*) env+=(PRISM_DEVICE_ARRIVE_AT_REACH=1) ;; esac
        [ "${CALLLOG:-0}" = 1 ] && [ "$k" = 1 ] && env+=(PRISM_DEVICE_CALL_LOG="$R/calls-$w-$v-r{rank}.jsonl")
        local rec=(); case $v in comp*) rec=(--no-recording) ;; esac
        local name="$v-$k"; [ -d "$cap/emulation/$name" ] && name="$v-$k-$$"  # a reused capture has run it before
        x "$R/emulate-$w-$v-$k.txt" 120 env "${env[@]}" python3 -m prism emulate "$cap" --sandbox 0 --device-path \
          "${rec[@]}" --net "$NET" --warmup 3 --name "$name" --quiet 25 --progress off
        [ -n "${DRY:-}" ] && continue
        cp "$cap/emulation/$name/summary.json" "$R/ab-$w-$v-$k.json" 2>/dev/null
        echo "$w $v $k: $(grep -E 'emulated vs predicted' "$R/emulate-$w-$v-$k.txt") $(grep -oE '[0-9,]+ of them released before' "$R/emulate-$w-$v-$k.txt")" >> "$R/sandbox_ab.txt"
        local ran=excess; case $v in *-carrymin*) ran=min ;; *-carryall*) ran=all ;; esac
        [ -f "$R/calls-$w-$v-r0.jsonl" ] && [ "$k" = 1 ] && python3 bench/late_carry.py "$R/calls-$w-$v-r0.jsonl" \
          "$R/ab-$w-$v-$k.json" --ran "$ran" 2>&1 | tail -1 | sed "s/^/  late_carry: /" >> "$R/sandbox_ab.txt"
      done
    done
  done
}

suite_feed_check() {  # the prefetch pool's native path: build, cuda_ext's and the device path's GPU tests, bench/recorded_feed.py (native vs torch, with and without a GIL-taking thread)
  export PRISM_CUDA_EXT_DIR=${PRISM_CUDA_EXT_DIR:-/tmp/cuext}
  x "$R/cuda_ext-build.txt" 200 python3 -c "import cuda_ext; print(cuda_ext.info())"
  x "$R/feed-tests.txt" 180 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_cuda_ext_gpu.py \
    tests/unit/test_devicepath_gpu.py
  x "$R/recorded_feed.txt" 120 python3 bench/recorded_feed.py --out "$R/recorded_feed.json"
}

suite_scale_gpu() {  # bench/scale.py with the GPT captured on GPU 0 and its sandbox on GPU 0 (device path; HOSTPATH=1: host)
  local hp=()
  [ "${HOSTPATH:-0}" = 1 ] && hp=(--host-path)
  x "$R/scale-gpu.txt" ${TS:-300} python3 bench/scale.py --device cuda "${hp[@]}" --worlds ${WORLDS:-512,2048,8192} \
    --json "$R/scale-gpu.json"
}

suite_cpu_pin() {  # issue 19's migration lead on the host's cores: the compute probe unpinned and pinned, accuracy pinned
  x "$R/compute_probe.txt" ${TP:-150} python3 bench/compute_probe.py --world 8 --runs ${RUNS:-3} \
    --out "$R/compute_probe.json"
  x "$R/compute_probe-pin.txt" ${TP:-150} python3 bench/compute_probe.py --world 8 --runs ${RUNS:-3} --pin \
    --out "$R/compute_probe-pin.json"
  x "$R/accuracy-world8-pin.txt" ${T8:-300} python3 bench/accuracy.py --world 8 --runs ${ARUNS:-2} --steps 10 --pin \
    --out "$R/accuracy-world8-pin.json"
}

suite_host_check() {  # is this host quiet enough for CPU truths? spin at 1/half/all cores, quota throttling, PSI, gloo twice (~30 s)
  x "$R/host_check.txt" 90 python3 bench/host_check.py --out "$R/host_check.json"
}

suite_comm_share() {  # CPU truth vs replay split into communication and the rest, world 8 (CONFIGS8) and 16 (T16=0: not)
  x "$R/comm_share-world8.txt" ${T8:-320} python3 bench/comm_share.py --world 8 --runs ${RUNS:-2} --steps 10 \
    ${CONFIGS8:+--configs $CONFIGS8} --out "$R/comm_share-world8.json"
  [ "${T16:-250}" = 0 ] && return 0  # T16=0: world 8 only
  x "$R/comm_share-world16.txt" ${T16:-250} python3 bench/comm_share.py --world 16 --runs ${RUNS:-2} --steps 10 \
    --configs ${CONFIGS16:-gpt-tp2-pp2-dp4,moe-tp2-dp8-ep2} --out "$R/comm_share-world16.json"
}

suite_insitu_check() {  # per blocking collective: the real job's cost beside the skeleton's (prism commtime) and the profile's, world 16 and 8
  x "$R/insitu_check-world16.txt" ${T16:-250} python3 bench/insitu_check.py --world 16 --runs ${RUNS:-1} --steps 10 \
    --configs ${CONFIGS16:-gpt-tp2-pp2-dp4,moe-tp2-dp8-ep2} --out "$R/insitu_check-world16.json"
  x "$R/insitu_check-world8.txt" ${T8:-250} python3 bench/insitu_check.py --world 8 --runs ${RUNS:-1} --steps 10 \
    ${CONFIGS8:+--configs $CONFIGS8} --out "$R/insitu_check-world8.json"
}

suite_truth_segments() {  # a truth step under the profiler, cut at its calls, beside a capture's
  local s
  for s in ${SEGS:-pp2 fsdp2}; do
    # shellcheck disable=SC2046 (the words split on purpose)
    x "$R/capture-$s.txt" 120 env PRISM_STEPCLOCK_DIR="$R/clk-$s" PRISM_STEPCLOCK_SYNC=1 python3 -m prism capture -n 2 \
      --nproc-per-node 2 --gpus 0,1 --out "$R/cap-$s" --progress off -- $STEPCLOCK $(workload_args "$s")
    # shellcheck disable=SC2046
    x "$R/truth_segments-$s.txt" 120 python3 bench/truth_segments.py --world 2 --step 5 --capture "$R/cap-$s" \
      --out "$R/truth-$s" --json "$R/truth_segments-$s.json" -- $(workload_args "$s")
  done
}

suite_truth_timeline() {  # a truth step's GPU timeline, cut at its NCCL kernels, beside a capture's
  local s
  for s in ${SEGS:-gpt-tp2 pp2}; do
    # shellcheck disable=SC2046 (the words split on purpose)
    x "$R/capture-$s.txt" 150 env PRISM_STEPCLOCK_DIR="$R/clk-$s" PRISM_STEPCLOCK_SYNC=1 PRISM_STEPCLOCK_PROFILE_STEP=5 \
      PRISM_STEPCLOCK_PROFILE_CPU=0 python3 -m prism capture -n 2 --nproc-per-node 2 --gpus 0,1 --out "$R/cap-$s" \
      --progress off -- $STEPCLOCK $(workload_args "$s")
    # shellcheck disable=SC2046
    x "$R/truth_timeline-$s.txt" 150 python3 bench/truth_timeline.py --world 2 --step 5 --capture "$R/cap-$s" \
      --out "$R/truth-$s" --json "$R/truth_timeline-$s.json" -- $(workload_args "$s")
  done
}

suite_cpu_noise() {  # FSDP2's CPU draw alone / on SMT siblings / on distinct cores, plain runs' scheduler data
  # shellcheck disable=SC2046 (the words split on purpose)
  x "$R/cpu_noise.txt" 200 python3 bench/cpu_noise.py --json "$R/cpu_noise.json" --truth 4 --world 2 \
    -- $(workload_args fsdp2)
  # shellcheck disable=SC2046
  x "$R/cpu_noise-profiled.txt" 150 python3 bench/cpu_noise.py --json "$R/cpu_noise-profiled.json" --no-draws \
    --truth 5 --profile-step 5 --world 2 -- $(workload_args fsdp2)
}

suite_drain_effect() {  # CPU issue cost right after a GPU drain vs with the GPU ahead
  x "$R/drain_effect.txt" 60 python3 bench/drain_effect.py --json "$R/drain_effect.json"
  x "$R/drain_effect-small.txt" 60 python3 bench/drain_effect.py --ops 100 --size 128 --json "$R/drain_effect-small.json"
}

suite_gpu_capture() {  # logical devices, raw checkpoint/restore, world 2 and GPT world 8 on one GPU
  x "$R/gpu_capture.txt" 330 python3 bench/gpu_capture.py --out-dir "$R/gpu_capture"
}

suite_swap_gangs() {  # GPT world 8 on one GPU with 4 resident, by gang; the same swaps simulated on CPU
  local g sims= cmd=
  for g in tpxpp tp 1; do
    cmd+="CUDA_VISIBLE_DEVICES= timeout 120 python3 -m prism capture -n 8 --resident 4 --gang $g --simulate-swaps"
    cmd+=" --out /tmp/sim-$g --progress off --show-ranks none -- -m prism.workloads.gpt --tp 2 --pp 2 --dp 2"
    cmd+=" --steps 2 > $R/sim-$g.txt 2>&1; cp /tmp/sim-$g/telemetry/swaps.json $R/sim-$g-swaps.json; "
  done
  bg bash -c "$cmd"
  sims=$BG
  x "$R/gpt8-gangs.txt" 500 python3 bench/gpu_capture.py --out-dir "$R/gangs" --only gpt8 --gangs tpxpp,tp,1 \
    --gpus 0 --resident 4 --swap-timeout 150 --runs-dir /tmp/g8
  [ -n "$sims" ] && wait "$sims"
  return 0
}

suite_cpu_scale() {  # CPU capture of the bundled GPT at 1,024 ranks, 16 slots
  x "$R/cpu_scale.txt" 520 env CUDA_VISIBLE_DEVICES= python3 bench/gpu_capture.py --out-dir "$R/cpu_scale" \
    --only cpu_scale --cpu-worlds 1024 --cpu-slots 16 --cpu-timeout 500 --runs-dir /tmp/cs
}

suite_campaigns() {  # the GPU example campaigns (bench/campaigns: dp_oom, moe_ep), tables and plots
  local c
  for c in ${CAMPAIGNS:-dp_oom moe_ep}; do
    x "$R/campaign-$c.txt" ${TC:-280} python3 -m prism campaign "bench/campaigns/$c.toml" --out "$R/campaign-$c"
  done
}

suite_by_card() {  # the suites of whichever card came: H200_SUITES on an H200, else OTHER_SUITES (lent kinds may give either)
  local card suites s
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  echo "card: ${card:-none}"
  [ -n "${DRY:-}" ] || echo "${card:-none}" > "$R/card.txt"
  local kv envs
  case $card in
    *H200*) suites=${H200_SUITES:-}; envs=${H200_ENV:-} ;;
    *) suites=${OTHER_SUITES:-}; envs=${OTHER_ENV:-}
       # CPU suites (the gloo truths) must not see the GPU: the bundled workloads would take it; and
       # host-check goes first, so the call says whether the host was quiet enough for CPU truths
       if [ "${OTHER_CPU:-}" = 1 ]; then
         export CUDA_VISIBLE_DEVICES=
         case " $suites " in *" host-check "*) ;; *) suites="host-check $suites" ;; esac
       fi ;;
  esac
  [ -n "$suites" ] || { echo "by-card: give H200_SUITES and OTHER_SUITES (suite names)" >&2; return 2; }
  # H200_ENV / OTHER_ENV: that card's knobs, ';'-separated assignments (values may hold spaces)
  local IFS_=$IFS; IFS=';'
  for kv in $envs; do
    kv=${kv#"${kv%%[![:space:]]*}"}
    [ -n "$kv" ] || continue
    case $kv in [A-Za-z_]*=*) export "$kv"; echo "by-card: $kv" ;; *) IFS=$IFS_; echo "by-card: not an assignment: $kv" >&2; return 2 ;; esac
  done
  IFS=$IFS_
  for s in $suites; do
    case " $(echo $SUITES) " in *" $s "*) ;; *) echo "by-card: unknown suite $s" >&2; return 2 ;; esac
    [ "$s" = by-card ] && { echo "by-card: cannot run itself" >&2; return 2; }
    echo "== $s (by card)"
    "suite_${s//-/_}"
  done
}

SUITES="by-card nccl-accuracy nccl-accuracy-calibrated netprofile gpu-tests frameworks cpu-accuracy emulate-accuracy
emulate-accuracy-16 host-check comm-share insitu-check calibration gpu-sandbox sandbox-ab feed-check truth-segments
truth-timeline cpu-noise drain-effect gpu-capture swap-gangs cpu-scale campaigns scale-gpu cpu-pin"

if [ $# -eq 0 ] || [ "$1" = list ]; then
  for s in $SUITES; do
    printf '%-26s %s\n' "$s" "$(grep "^suite_${s//-/_}()" "$0" | sed 's/.*{  *# *//')"
  done
  [ $# -eq 0 ] && exit 2
  exit 0
fi
for s in "$@"; do
  case " $(echo $SUITES) " in
    *" $s "*) ;;
    *) echo "unknown suite $s (bash bench/device.sh list)" >&2; exit 2 ;;
  esac
done

[ -n "${DRY:-}" ] || mkdir -p "$R"
if [ -z "${DRY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
versions
for s in "$@"; do
  echo "== $s"
  "suite_${s//-/_}"
done
# one tarball comes back whole; the device returns only a handful of loose files (KEEP_R=1 keeps $OUT/r too)
if [ -z "${DRY:-}" ] && tar czf "$OUT/results.tgz" -C "$OUT" r; then
  [ "${KEEP_R:-0}" = 1 ] || rm -rf "$R"  # only once the tarball holds it
fi
