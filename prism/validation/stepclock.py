"""Run a training command unmodified and log when each optimizer step returns.

The ground-truth runs of ``bench/accuracy.py`` and ``bench/nccl_accuracy.py``
(plain torch.distributed, no Prism) and the captures beside them run their
command under it, as a script: ``prism/validation/stepclock.py -m MODULE
ARGS...`` or ``prism/validation/stepclock.py SCRIPT ARGS...``
(``prism.validation.truthrun.STEPCLOCK`` is its path). Importing it needs only the
standard library (running it needs torch); ``parse`` reads what it wrote.
A global optimizer step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``)
appends ``STEP MONOTONIC_NS`` to ``$PRISM_STEPCLOCK_DIR/rank-R.txt``; the step
is counted per rank from 0. CLOCK_MONOTONIC is one clock for the whole host
on Linux, so the ranks' times compare.

With ``PRISM_STEPCLOCK_SYNC=1`` the hook first waits for the rank's CUDA
device (``torch.cuda.synchronize``), so a GPU step ends when its kernels end,
not when the CPU queued them. On CUDA ranks it also writes memory lines:
``mem-step STEP NVML_PROCESS_BYTES RESERVED ALLOCATED`` once, after step
``PRISM_STEPCLOCK_MEM_STEP`` (default 2; NCCL's buffers exist by then), and
``mem-peak STEP MAX_ALLOCATED MAX_RESERVED`` after every step (the last one
counts: the launcher's ranks leave through ``os._exit``, so nothing can be
written at exit). Under Prism the peak statistics are reset at each step
boundary, so there the trace's Memory events give the run's peak.

With ``PRISM_STEPCLOCK_PROFILE_STEP=K`` the torch profiler (CPU, and CUDA
where the rank uses it) records exactly step K, from step K-1's end to step
K's end, into ``profile-rank-R.json`` (Chrome trace) beside the step file:
``prism.validation.truthcut.cut_profile`` cuts it into the segments a capture records.
``PRISM_STEPCLOCK_PROFILE_CPU=0`` records the GPU's activity and the CUDA
calls only (far less CPU overhead than operator records):
``prism.validation.truthcut.timeline`` reads those.

With ``PRISM_STEPCLOCK_CALLS=1`` every communication call made through
``torch.distributed``'s Python functions (``all_reduce``, ``broadcast``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``,
``send``, ``recv``, ``isend``, ``irecv``, ...) writes ``call STEP OP GROUP_SIZE
BYTES T0_NS T1_NS ASYNC CPU0_NS CPU1_NS``: how long the call held its caller (for
an async call only its issue), bytes of its first tensor, and the calling
thread's CPU clock at both ends, then the group's global ranks (``0,1``; ``-``
where unknown), so calls of one group pair up across ranks by their order
(``parse_call_groups``); each step line then also carries the main
thread's CPU clock (``STEP T_NS CPU_NS``), so the compute between two calls has
its CPU time beside its wall time, as a capture's segments do
(``Compute.thread_cpu_ns``). Calls C++ makes by itself (DDP's reducer) are not
seen. No profiler: the times are the calls' own, give or take a microsecond
(``prism.validation.stepclock.parse_calls`` and ``call_cpu`` read them).

With ``PRISM_STEPCLOCK_SCHED=1`` every step also writes
``sched STEP CPU RUN_NS RUNQUEUE_NS`` for the rank's main thread: the CPU it
last ran on and its cumulative time on a CPU and waiting for one
(``/proc/thread-self/schedstat``), so a slow step shows whether its thread ran
slower or waited (``prism.validation.cpunoise``).
"""

import os
import runpy
import sys
import time


def _nvml_process_bytes() -> int:
    """GPU memory NVML charges to this process (context, allocator, NCCL, cuBLAS); -1 if unknown."""
    try:
        import pynvml

        pynvml.nvmlInit()
        pid, total = os.getpid(), 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            total += sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                         if p.pid == pid)
        return total
    except Exception:
        return -1


def sched_line(step: int) -> str:
    """``sched STEP CPU RUN_NS RUNQUEUE_NS`` of the calling thread (Linux)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
        with open("/proc/thread-self/stat") as f:
            cpu = f.read().rsplit(")", 1)[1].split()[36]  # field 39, counted after the command name
        return f"sched {step} {cpu} {run_ns} {wait_ns}\n"
    except OSError:
        return ""


def main() -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    out_dir = os.environ["PRISM_STEPCLOCK_DIR"]
    rank = int(os.environ["RANK"])
    log = open(os.path.join(out_dir, f"rank-{rank}.txt"), "w", buffering=1)
    count = [0]
    sync = os.environ.get("PRISM_STEPCLOCK_SYNC") == "1"
    mem_step = int(os.environ.get("PRISM_STEPCLOCK_MEM_STEP", "2"))
    profile_step = int(os.environ.get("PRISM_STEPCLOCK_PROFILE_STEP", "-1"))
    sched = os.environ.get("PRISM_STEPCLOCK_SCHED") == "1"
    calls = os.environ.get("PRISM_STEPCLOCK_CALLS") == "1"
    prof = [None]

    def hook(optimizer, args, kwargs) -> None:
        cuda = torch.cuda.is_initialized()
        if sync and cuda:
            torch.cuda.synchronize()
        if prof[0] is not None and count[0] == profile_step:
            prof[0].stop()
            prof[0].export_chrome_trace(os.path.join(out_dir, f"profile-rank-{rank}.json"))
            prof[0] = None
        if calls:
            log.write(f"{count[0]} {time.monotonic_ns()} {time.thread_time_ns()}\n")
        else:
            log.write(f"{count[0]} {time.monotonic_ns()}\n")
        if sched:
            log.write(sched_line(count[0]))
        if cuda and count[0] == mem_step:
            log.write(f"mem-step {count[0]} {_nvml_process_bytes()} {torch.cuda.memory_reserved()} "
                      f"{torch.cuda.memory_allocated()}\n")
        if cuda:
            log.write(f"mem-peak {count[0]} {torch.cuda.max_memory_allocated()} {torch.cuda.max_memory_reserved()}\n")
        count[0] += 1
        if count[0] == profile_step:
            from torch.profiler import ProfilerActivity, profile

            # PRISM_STEPCLOCK_PROFILE_CPU=0: the GPU's activity and the CUDA
            # calls only (no operator records: far less overhead on the CPU)
            cpu_ops = os.environ.get("PRISM_STEPCLOCK_PROFILE_CPU", "1") != "0" or not cuda
            acts = ([ProfilerActivity.CPU] if cpu_ops else []) + ([ProfilerActivity.CUDA] if cuda else [])
            prof[0] = profile(activities=acts)
            prof[0].start()

    register_optimizer_step_post_hook(hook)
    if calls:
        _time_calls(log, count)
    if os.environ.get("PRISM_STEPCLOCK_MODE") == "1":
        # Measures the logical-device mode's cost inside a real (non-Prism)
        # run. The mode maps every index to in-process device 0, so each rank
        # must see only its own GPU, as under Prism (CUDA is not initialised yet).
        from prism.rank.devices import LogicalDeviceMode

        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("LOCAL_RANK", "0")

        LogicalDeviceMode().__enter__()
    cmd = sys.argv[1:]
    if cmd[0] == "-m":
        sys.argv = [cmd[1], *cmd[2:]]
        runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = cmd
        runpy.run_path(cmd[0], run_name="__main__")


#: The torch.distributed functions ``PRISM_STEPCLOCK_CALLS=1`` times.
TIMED_CALLS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "send", "recv", "isend",
               "irecv", "batch_isend_irecv")


def _time_calls(log, count) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def nbytes(args, kwargs) -> int:
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                return a.numel() * a.element_size()
            if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                return sum(t.numel() * t.element_size() for t in a)
        return 0

    def wrap(name, fn):
        def timed(*args, **kwargs):
            c0 = time.thread_time_ns()
            t0 = time.monotonic_ns()
            out = fn(*args, **kwargs)
            t1 = time.monotonic_ns()
            c1 = time.thread_time_ns()
            group = kwargs.get("group")
            try:
                n = dist.get_world_size(group) if group is not None else dist.get_world_size()
            except Exception:  # noqa: BLE001 (a non-member's call)
                n = -1
            is_async = bool(kwargs.get("async_op")) or name in ("isend", "irecv", "batch_isend_irecv")
            try:
                members = ",".join(map(str, c10d.get_process_group_ranks(group if group is not None
                                                                         else c10d.GroupMember.WORLD)))
            except Exception:  # noqa: BLE001 (a non-member's call, or an older torch)
                members = "-"
            log.write(f"call {count[0]} {name} {n} {nbytes(args, kwargs)} {t0} {t1} {int(is_async)} {c0} {c1} "
                      f"{members}\n")
            return out
        timed.__wrapped__ = fn
        return timed

    for name in TIMED_CALLS:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        w = wrap(name, fn)
        setattr(c10d, name, w)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, w)


def parse_calls(text: str) -> list[tuple[int, str, int, int, int, int, bool]]:
    """The ``call`` lines of one rank's file: (step, op, group size, bytes, t0, t1, async)."""
    out = []
    for line in text.splitlines():
        if line.startswith("call "):
            _, step, op, n, b, t0, t1, a = line.split()[:8]
            out.append((int(step), op, int(n), int(b), int(t0), int(t1), a == "1"))
    return out


def parse_call_groups(text: str) -> list[tuple[int, ...] | None]:
    """The group (its global ranks) of each ``call`` line, in ``parse_calls``'s
    order; None where the line has none (files written before they were
    logged, or a call whose group was unknown)."""
    out: list[tuple[int, ...] | None] = []
    for line in text.splitlines():
        if line.startswith("call "):
            parts = line.split()
            out.append(tuple(int(r) for r in parts[10].split(",")) if len(parts) > 10 and parts[10] != "-"
                       else None)
    return out


def call_cpu(text: str) -> tuple[list[tuple[int, int]], list[int]] | None:
    """The calling thread's CPU clock (ns) at each ``call`` line's ends, in
    ``parse_calls``'s order, and at each step line (the main thread's);
    None for a file written without them (before they were logged)."""
    calls: list[tuple[int, int]] = []
    steps: list[int] = []
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "call":
            if len(parts) < 10:
                return None
            calls.append((int(parts[8]), int(parts[9])))
        elif parts[0][0].isdigit():
            if len(parts) < 3:
                return None
            steps.append(int(parts[2]))
    return calls, steps


def parse(text: str) -> tuple[list[int], dict[str, list[int]]]:
    """(step end times in ns, {"mem-step": [...], "mem-peak": [...]}) of one rank's file."""
    ends: list[int] = []
    mem: dict[str, list[int]] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0].startswith("mem-"):
            mem[parts[0]] = [int(x) for x in parts[1:]]
        elif parts[0] in ("sched", "call"):
            continue
        else:
            ends.append(int(parts[1]))
    return ends, mem


if __name__ == "__main__":
    main()

