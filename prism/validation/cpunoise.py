"""Why a CPU-bound truth moves between runs: the pieces ``bench/cpu_noise.py``
measures with.

- ``topology`` and ``pick_cpus``: the CPUs this process may use, their SMT
  siblings and cores, and a pair of siblings and a pair of distinct cores;
- ``draws``: FSDP2's per-step data draw (two ``torch.randn`` of ROWS x DIM
  with a generator, one thread) timed in several processes at once, each
  pinned with ``taskset`` or not; ``sample`` the same draw every few seconds
  until killed (a probe of the CPU's single-thread speed);
- ``truth_runs``: plain runs of a command under the step clock with its
  scheduler lines (``PRISM_STEPCLOCK_SCHED=1``): per rank the step times, the
  main thread's CPU time and run-queue wait, and the CPUs it ran on;
- ``profiled``: from a step's Chrome trace, the CPU time of ``aten::randn``
  and the GPU's kernel time.

torch is imported only by the draw processes and ``sample``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

DRAW = r"""
import json, sys, time, torch
torch.set_num_threads(1)
reps, rows, dim = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
out = []
for i in range(reps):
    g = torch.Generator().manual_seed(i)
    t = time.perf_counter_ns()
    x = torch.randn(rows, dim, generator=g)
    y = torch.randn(rows, dim, generator=g)
    out.append(time.perf_counter_ns() - t)
print(json.dumps(out))
"""


def topology() -> dict:
    cpus = sorted(int(p.name[3:]) for p in pathlib.Path("/sys/devices/system/cpu").glob("cpu[0-9]*"))
    sib, core = {}, {}
    for c in cpus:
        t = pathlib.Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            sib[c] = (t / "thread_siblings_list").read_text().strip()
            core[c] = (int((t / "physical_package_id").read_text()), int((t / "core_id").read_text()))
        except OSError:
            pass
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": cpus, "siblings": sib, "core": {c: list(v) for c, v in core.items()}, "model": model,
            "affinity": sorted(os.sched_getaffinity(0))}


def steal_ticks(proc: str = "/proc") -> int:
    """The hypervisor's steal ticks so far (``/proc/stat``), -1 where not counted."""
    with open(os.path.join(proc, "stat")) as f:
        parts = f.readline().split()
    return int(parts[8]) if len(parts) > 8 else -1


def host_pressure(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> dict[str, int | str | None]:
    """A snapshot of what takes CPU time from this host's processes, for
    ``pressure_delta`` around a run: the hypervisor's steal ticks
    (``/proc/stat``), this cgroup's CPU quota (``cpu.max``, "max 100000": none)
    and how often and how long it was throttled to it (``cpu.stat``), and the
    time some runnable task waited for a CPU (PSI, ``/proc/pressure/cpu``).
    A figure this machine does not expose is None."""
    snap: dict[str, int | str | None] = {"steal_ticks": None, "cpu_max": None, "nr_periods": None,
                                         "nr_throttled": None, "throttled_usec": None, "psi_some_us": None}
    try:
        steal = steal_ticks(proc)
        snap["steal_ticks"] = steal if steal >= 0 else None
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(cgroup, "cpu.max")) as f:
            snap["cpu_max"] = f.read().strip()
    except OSError:
        pass
    try:
        with open(os.path.join(cgroup, "cpu.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in ("nr_periods", "nr_throttled", "throttled_usec"):
                    snap[key] = int(value)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(proc, "pressure", "cpu")) as f:
            for line in f:
                if line.startswith("some "):
                    snap["psi_some_us"] = int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        pass
    return snap


def pressure_delta(before: dict, after: dict) -> dict[str, int | str | None]:
    """What ``host_pressure`` counted between two snapshots (a count None on
    either side stays None); ``cpu_max`` as it was after."""
    out: dict[str, int | str | None] = {"cpu_max": after.get("cpu_max")}
    for key, value in after.items():
        if key != "cpu_max":
            prev = before.get(key)
            out[key] = value - prev if isinstance(value, int) and isinstance(prev, int) else None
    return out


def draws(placements: list[str | None], reps: int, rows: int, dim: int) -> list[list[int]]:
    """Run the draw in len(placements) processes at once; each pinned with taskset if given."""
    procs = []
    for cpus in placements:
        cmd = [sys.executable, "-c", DRAW, str(reps), str(rows), str(dim)]
        if cpus is not None:
            cmd = ["taskset", "-c", cpus, *cmd]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"draw process {p.args} failed with {p.returncode}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def pick_cpus(topo: dict) -> tuple[int, int, int]:
    """(a, its SMT sibling or -1, a CPU on another core) among the allowed CPUs."""
    allowed = topo["affinity"]
    a = allowed[min(2, len(allowed) - 1)]
    sibs = [int(x) for part in topo["siblings"].get(a, str(a)).split(",") for x in expand_cpus(part)]
    sib = next((c for c in sibs if c != a and c in allowed), -1)
    other = next((c for c in allowed if tuple(topo["core"].get(c, (0, c))) != tuple(topo["core"].get(a, (0, a)))
                  and c not in sibs), -1)
    return a, sib, other


def expand_cpus(part: str) -> list[int]:
    if "-" in part:
        lo, hi = part.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(part)]


def profiled(path: pathlib.Path) -> dict:
    """From a step's Chrome trace: the CPU time of ``aten::randn`` (what
    FSDP2's step draws its batch with) and the GPU's kernel time (NCCL's
    included), in ms; {} when the file is missing or torn."""
    try:
        evs = json.loads(path.read_text()).get("traceEvents", [])
    except (OSError, ValueError):
        return {}
    randn = sum(e.get("dur", 0) for e in evs if e.get("ph") == "X" and e.get("name") == "aten::randn") / 1e3
    kernels = sum(e.get("dur", 0) for e in evs if e.get("ph") == "X" and e.get("cat") == "kernel") / 1e3
    return {"randn_ms": randn, "kernel_ms": kernels}


def truth_runs(k: int, world: int, cmd: list[str], timeout: float, profile_step: int = -1) -> list[dict]:
    """``k`` plain runs of ``cmd`` on ``world`` ranks with the step clock's scheduler lines: per run the
    wall time, the host's steal ticks and per rank the step times, the main thread's CPU time and
    run-queue wait per step, the CPUs it ran on (and, with ``profile_step``, ``profiled``'s times)."""
    from prism.validation.truthrun import launch_truth

    runs = []
    for i in range(k):
        d = pathlib.Path(tempfile.mkdtemp(prefix="cpu-noise-truth-"))
        s0, t0 = steal_ticks(), time.monotonic()
        env = {"PRISM_STEPCLOCK_SCHED": "1"}
        if profile_step >= 0:
            env.update(PRISM_STEPCLOCK_PROFILE_STEP=str(profile_step), PRISM_STEPCLOCK_PROFILE_CPU="1")
        launch_truth(world, cmd, d, timeout, env=env)
        wall, steal = time.monotonic() - t0, steal_ticks() - s0
        ranks = []
        for r in range(world):
            ends, sched = [], []
            for line in (d / f"rank-{r}.txt").read_text().splitlines():
                p = line.split()
                if p and p[0].isdigit():
                    ends.append(int(p[1]))
                elif p and p[0] == "sched":
                    sched.append([int(x) for x in p[1:]])
            steps = [(b - a) / 1e6 for a, b in zip(ends, ends[1:])]
            run_ms = [(b[2] - a[2]) / 1e6 for a, b in zip(sched, sched[1:])]
            wait_ms = [(b[3] - a[3]) / 1e6 for a, b in zip(sched, sched[1:])]
            if profile_step >= 0:  # the profiled step's own time is inflated: leave it out
                steps = [x for i, x in enumerate(steps) if i + 1 != profile_step]
            ranks.append({"step_ms": steps, "run_ms": run_ms, "runqueue_ms": wait_ms,
                          "cpus": [s[1] for s in sched], **profiled(d / f"profile-rank-{r}.json")})
        shutil.rmtree(d, ignore_errors=True)
        runs.append({"wall_s": wall, "steal_ticks": steal, "ranks": ranks})
        print(f"truth run {i}: " + "; ".join(
            f"rank {r}: step {statistics.mean(x['step_ms'][2:]):.1f} ms, main thread on CPU "
            f"{statistics.mean(x['run_ms'][2:]):.1f} ms, waiting {statistics.mean(x['runqueue_ms'][2:]):.2f} ms, "
            f"CPUs {sorted(set(x['cpus']))}"
            + (f", randn {x['randn_ms']:.1f} ms, kernels {x['kernel_ms']:.1f} ms (step {profile_step})"
               if "randn_ms" in x else "") for r, x in enumerate(ranks) if len(x["step_ms"]) > 2)
              + f"; steal {steal} ticks", flush=True)
    return runs


def sample(log: str, interval: float, rows: int, dim: int) -> None:
    """The draw every ``interval`` s, one line per draw, until killed."""
    import torch

    torch.set_num_threads(1)
    with open(log, "a", buffering=1) as f:
        i = 0
        while True:
            g = torch.Generator().manual_seed(i)
            t = time.perf_counter_ns()
            torch.randn(rows, dim, generator=g)
            torch.randn(rows, dim, generator=g)
            f.write(f"{time.monotonic_ns()} {time.perf_counter_ns() - t}\n")
            i += 1
            time.sleep(interval)
