"""Measure the local gloo or NCCL backend and fit a communication cost profile.

``plan_netprofile(NetprofileConfig(...))`` checks the options against this
machine and resolves the defaults; ``run_netprofile(plan)`` runs the
measurement world, fits it (``prism.core.netfit``) and writes the profile
(and, if asked, the points as JSON); it returns everything it measured.
``python -m prism netprofile`` is the command over it.

``backend="gloo"`` (default) times CPU tensors over gloo, one process per
core; ``backend="nccl"`` times CUDA tensors over NCCL, one process per GPU
(``cuda:LOCAL_RANK``), and its profile is the one ``prism predict`` uses for
captures of CUDA runs.

With NCCL a call costs two different things, and the replay needs both: the
collective's time on the GPU (the cost model's time: the GPU stream is held
that long) and the CPU time of the call on the thread that makes it
(``issue_us``: the replay adds it to a GPU rank's CPU clock). Timing calls
back to back and synchronising measures neither: small calls come out at
the CPU's issue rate (~40-50 us each on an H200 machine). So each trial
first holds the GPU with a spin kernel (``torch.cuda._sleep``) long enough
for the CPU to queue all its calls, times the queuing on the CPU (issue per
call), and times the calls on the GPU with events from the spin's end to
the last call's end (GPU time per call, back to back). A trial whose spin
ended before the CPU had queued everything is repeated with a longer spin.
Send is a ping-pong timed as before (its half round trip includes both
sides' CPU).

One real process runs per rank (``OMP_NUM_THREADS=1``, at most one rank per
core, so ranks do not steal each other's time); each op is timed at each
message size on groups of each size (the slowest rank's time per call, the
median over trials). By default one group of each size runs alone, the other
ranks idle. ``concurrent=W`` (gloo) cuts W ranks into W // n groups of n and
times them all at once, the slowest group's time: a training layout's groups
of one kind (its TP pairs, its DP groups) communicate together and share the
host's cores, caches and memory bandwidth, which a lone group does not see.
With ``gap_us`` (gloo) each call comes after that long of the caller's own
work (a spin to a slot the members agreed on, one monotonic clock on one
host), as a training step's calls come after its compute, instead of back
to back: the backend's threads are idle when the call comes.
Each gloo point also carries the median member's time per call
(``Point.median_rank_seconds``; concurrently, a typical group's rather than
the worst one's); the profile is fitted to the slowest's, as before.

Where profiles live: ``out`` if given, else ``fitted_profile_path("gloo",
HOST)``: ``$PRISM_PROFILE_DIR/gloo-HOST.toml`` when that variable is set,
otherwise ``~/.cache/prism/profiles/gloo-HOST.toml``. ``prism predict`` looks
there first (backend from the run's device kind, HOST from its manifest), so
a run is predicted with the profile of the machine it was captured on.

The worker side (``python -m prism.app.netprofile --worker ...``) is an
ordinary ``torch.distributed`` program started by
``prism.workloads.harness.run_world``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prism.app.errors import UsageError
from prism.core.costmodel import parse_profile
from prism.core.netfit import (Fit, Point, fit_per_op, fit_points, predict_seconds, profile_toml,
                               relative_errors)

__all__ = ["NetprofileConfig", "NetprofilePlan", "NetprofileResult", "plan_netprofile", "run_netprofile",
           "measure", "fitted_profile_path", "backend_of", "usable_cores", "gpu_count", "Point", "Fit",
           "DEFAULT_OPS", "DEFAULT_SIZES", "NCCL_SIZES", "BACKENDS"]

#: Ops measured by default (torch.distributed names; "send" is a ping-pong, half a round trip).
DEFAULT_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "all_to_all_single", "send")
#: Bytes each rank contributes (float32 tensors).
DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24)
#: NVLink moves hundreds of GB/s: NCCL's bandwidth shows only in larger messages.
NCCL_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28)
BACKENDS = ("gloo", "nccl")
TRIALS = 5
#: Each trial runs back-to-back calls for about this long, so barrier skew amortises.
TRIAL_SECONDS = 0.02


def backend_of(device_kind: str) -> str:
    """The torch.distributed backend a run on ``device_kind`` uses for its ground truth."""
    return "nccl" if device_kind == "cuda" else "gloo"


def fitted_profile_path(backend: str, host: str) -> pathlib.Path:
    """Where ``netprofile`` writes (and ``predict`` looks for) the profile of ``backend`` on ``host``."""
    base = os.environ.get("PRISM_PROFILE_DIR")
    root = pathlib.Path(base) if base else pathlib.Path.home() / ".cache" / "prism" / "profiles"
    return root / f"{backend}-{host}.toml"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1



def gpu_count() -> int:
    """GPUs torch sees here (0 without CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --- the measurement world (one process per rank) ---------------------------
def _worker(argv: Sequence[str]) -> None:
    """One rank of the measurement world (run under ``run_world``)."""
    import torch
    import torch.distributed as dist

    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--group-sizes", required=True)
    ap.add_argument("--ops", required=True)
    ap.add_argument("--backend", default="gloo", choices=BACKENDS)
    ap.add_argument("--concurrent", action="store_true")
    ap.add_argument("--gap-us", type=float, default=0.0)
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    gsizes = [int(x) for x in a.group_sizes.split(",")]
    ops = a.ops.split(",")
    device = torch.device("cpu")
    if a.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # Isolated: one group [0, n) per size, the other ranks idle. Concurrent:
    # the world cut into world // n blocks of n consecutive ranks, every block
    # timing the same op at once (the traffic of a layout's groups of that size).
    groups = {}
    for n in gsizes:
        blocks = range(world // n) if a.concurrent else range(1)
        made = [dist.new_group(list(range(b * n, b * n + n))) for b in blocks]
        groups[n] = made[rank // n] if rank // n < len(made) else None
    world_group = dist.group.WORLD if a.concurrent else None
    for n in gsizes:
        g = groups[n]
        if g is None:
            continue
        for op in ops:
            if op == "send" and n != 2:
                continue
            for nbytes in sizes:
                fn = _op_call(torch, dist, op, n, nbytes, g, rank, device)
                if device.type == "cuda" and op != "send":
                    secs, issue, wall = _time_op_gpu(torch, dist, fn, g, device)
                    rec = {"op": op, "n": n, "nbytes": nbytes, "seconds": secs, "issue_seconds": issue,
                           "back_to_back_seconds": wall}
                elif a.gap_us > 0:
                    secs, median = _time_op_gapped(torch, dist, fn, world_group or g, a.gap_us * 1e-6)
                    rec = {"op": op, "n": n, "nbytes": nbytes, "seconds": secs, "median_rank_seconds": median}
                else:
                    secs, median = _time_op(torch, dist, fn, world_group or g, device, with_median=True)
                    rec = {"op": op, "n": n, "nbytes": nbytes, "seconds": secs, "median_rank_seconds": median}
                if rank == 0:
                    print(json.dumps(rec), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _op_call(torch, dist, op: str, n: int, nbytes: int, g, rank: int, device):
    elems = max(1, nbytes // 4)

    def ones(k: int):
        return torch.ones(k, device=device)

    def empty(k: int):
        return torch.empty(k, device=device)

    if op in ("all_gather_into_tensor",):
        x = ones(elems)
        out = empty(elems * n)
        return lambda: dist.all_gather_into_tensor(out, x, group=g)
    if op in ("reduce_scatter_tensor", "all_to_all_single"):
        elems = max(n, elems - elems % n)
        x = ones(elems)
        if op == "all_to_all_single":
            out = empty(elems)
            return lambda: dist.all_to_all_single(out, x, group=g)
        out = empty(elems // n)
        return lambda: dist.reduce_scatter_tensor(out, x, group=g)
    x = ones(elems)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=g)
    if op == "broadcast":
        return lambda: dist.broadcast(x, group_src=0, group=g)
    if op == "send":
        peer = rank ^ 1  # the other member of this block of 2 (a global rank)

        def pingpong():
            if rank % 2 == 0:
                dist.send(x, peer, group=g)
                dist.recv(x, peer, group=g)
            else:
                dist.recv(x, peer, group=g)
                dist.send(x, peer, group=g)
        return pingpong
    raise ValueError(f"netprofile: unknown op {op!r}; known: {', '.join(DEFAULT_OPS)}")


def _time_op(torch, dist, fn, g, device, with_median: bool = False) -> Any:
    """Seconds per call of ``fn``, the slowest member of ``g``'s (``g`` is the
    op's group, or the whole world when every block times at once: then the
    trials start together and the slowest block's time is taken). With
    ``with_median``: (that, the median member's), each the median over trials;
    concurrently, the median member's is a typical group's time where the
    slowest one's is the worst of ``world // n`` groups."""
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def agree(seconds: float) -> float:
        # The slowest rank's time; every rank must agree on the call count.
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
        return t.item()

    fn()
    fn()
    sync()
    dist.barrier(group=g)
    sync()
    t = time.perf_counter()
    fn()
    sync()
    one = agree(time.perf_counter() - t)
    k = int(min(50, max(1, TRIAL_SECONDS / max(one, 1e-7))))
    per_call, per_call_median = [], []
    for _ in range(TRIALS):
        dist.barrier(group=g)
        sync()
        t = time.perf_counter()
        for _ in range(k):
            fn()
        sync()
        mine = (time.perf_counter() - t) / k
        per_call.append(agree(mine))
        if with_median:
            per_call_median.append(_median_member(torch, dist, mine, g, device))
    secs = statistics.median(per_call)  # a ping-pong's half is taken by the caller
    return (secs, statistics.median(per_call_median)) if with_median else secs


def _time_op_gapped(torch, dist, fn, g, gap_s: float) -> tuple[float, float]:
    """Seconds per call of ``fn`` (CPU) when each call comes after ``gap_s``
    of the caller's own work, as a training step's calls come after its
    compute: the members (every process on one host, so one monotonic clock)
    agree on a start, then each spins until its next slot, ``gap_s`` plus
    room for the call apart, and calls; a member's time in a call is its return
    less the last member's entry (the members enter within the spin's
    precision of the slot, or later where a call before overran it). Back to
    back, a backend's threads stay hot and the members pace each other; here
    each call finds them idle. Returns (the slowest member's, the median
    member's), each the median over every call of every trial."""
    def gather(xs: list[float]):
        """Every member's ``xs`` (rows by member): one all_reduce."""
        t = torch.zeros(dist.get_world_size(g), len(xs), dtype=torch.float64)
        t[dist.get_rank(g)] = torch.tensor(xs, dtype=torch.float64)
        dist.all_reduce(t, group=g)
        return t

    fn()
    fn()
    dist.barrier(group=g)
    t = time.perf_counter()
    fn()
    one = float(gather([time.perf_counter() - t]).max())
    period = gap_s + max(4 * one, 200e-6)
    k = int(min(20, max(3, TRIAL_SECONDS / period)))
    slowest, median = [], []
    for _ in range(TRIALS):
        dist.barrier(group=g)
        t0 = float(gather([time.monotonic() + 0.002]).max())  # a start every member is still ahead of
        entries, returns = [], []
        for i in range(k):
            slot = t0 + i * period + gap_s
            while time.monotonic() < slot:
                pass
            entries.append(time.monotonic())
            fn()
            returns.append(time.monotonic())
        # a member late for its slot (a slow call before) counts from there
        back = gather(returns) - gather(entries).max(dim=0).values  # member x call
        slowest += back.max(dim=0).values.tolist()
        median += [statistics.median(col) for col in back.t().tolist()]
    return statistics.median(slowest), statistics.median(median)


def _median_member(torch, dist, seconds: float, g, device) -> float:
    """The median over ``g``'s members of their ``seconds``."""
    size = dist.get_world_size(g)
    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    every = torch.empty(size, dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(every, mine, group=g)
    return statistics.median(every.tolist())


def _time_op_gpu(torch, dist, fn, g, device) -> tuple[float, float, float]:
    """(GPU seconds per call, CPU issue seconds per call, back-to-back wall
    seconds per call) of ``fn`` on a CUDA device: see the module docstring."""
    wall = _time_op(torch, dist, fn, g, device)
    sync = torch.cuda.synchronize

    def agree(*values: float) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
        return t.tolist()

    ns_per_cycle = _sleep_clock(torch)
    # Enough calls that the skew between the members' spin ends is small
    # against their sum (the first call waits for the last member).
    k = int(min(200, max(10, TRIAL_SECONDS / max(wall, 1e-7))))
    spin_s = 2 * k * wall + 2e-3
    gpu, issue = [], []
    tries = 0
    while len(gpu) < TRIALS:
        tries += 1
        if tries > 4 * TRIALS:
            raise RuntimeError(f"netprofile: the CPU could not queue {k} calls within a {spin_s * 1e3:.1f} ms "
                               "spin of the GPU after several longer tries; is the machine overloaded?")
        dist.barrier(group=g)
        sync(device)
        a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        a.record()
        torch.cuda._sleep(max(int(spin_s * 1e9 / ns_per_cycle), 1))
        b.record()
        t = time.perf_counter()
        for _ in range(k):
            fn()
        queued = time.perf_counter() - t
        c.record()
        sync(device)
        spun = a.elapsed_time(b) / 1e3
        per_gpu, per_issue, late = agree(b.elapsed_time(c) / 1e3 / k, queued / k, float(queued > 0.8 * spun))
        if late:  # the GPU may have waited for the CPU: not a GPU time
            spin_s *= 2
            continue
        gpu.append(per_gpu)
        issue.append(per_issue)
    return statistics.median(gpu), statistics.median(issue), wall


def _sleep_clock(torch) -> float:
    """ns per ``torch.cuda._sleep`` cycle on the current GPU."""
    best = None
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(2_000_000)
        b.record()
        b.synchronize()
        ns = a.elapsed_time(b) * 1e6 / 2_000_000
        best = ns if best is None else min(best, ns)
    return max(best or 0.5, 0.05)


def measure(sizes: Sequence[int], group_sizes: Sequence[int], ops: Sequence[str], *,
            timeout: float = 600.0, backend: str = "gloo", concurrent: int | None = None,
            gap_us: float = 0.0) -> list[Point]:
    """Run the measurement world and return its points: ``max(group_sizes)``
    processes, one group of each size timed alone; or, with ``concurrent=W``,
    W processes, every size timed by all W // n groups of it at once (each
    size must divide W). ``gap_us`` (gloo): each call after that long of the
    caller's own work, not back to back (``_time_op_gapped``)."""
    if gap_us and backend != "gloo":
        raise ValueError("netprofile: a gap between calls is measured for gloo only")
    from prism.workloads.harness import run_world

    world = concurrent or max(group_sizes)
    if concurrent and any(world % n for n in group_sizes):
        raise ValueError(f"concurrent measurement: every group size must divide the world {world}; "
                         f"got {list(group_sizes)}")
    argv = ["-m", "prism.app.netprofile", "--worker", "--sizes", ",".join(map(str, sizes)),
            "--group-sizes", ",".join(map(str, group_sizes)), "--ops", ",".join(ops), "--backend", backend,
            *(["--concurrent"] if concurrent else []), *(["--gap-us", str(gap_us)] if gap_us else [])]
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {"OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    results = run_world(argv, world, timeout=timeout, env=env)
    points = []
    for line in results[0].stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            secs = d["seconds"] / 2 if d["op"] == "send" else d["seconds"]
            med = d.get("median_rank_seconds")
            if med is not None and d["op"] == "send":
                med /= 2
            points.append(Point(d["op"], d["n"], d["nbytes"], secs, d.get("issue_seconds"), med))
    return points


@dataclass(frozen=True)
class NetprofileConfig:
    """What ``prism netprofile`` measures; None means the default for the backend."""

    backend: str = "gloo"
    out: str | os.PathLike[str] | None = None
    sizes: Sequence[int] | None = None
    group_sizes: Sequence[int] | None = None
    ops: Sequence[str] = DEFAULT_OPS
    json_out: str | os.PathLike[str] | None = None
    #: Time each group size with all ``concurrent // n`` groups of it at once
    #: (on ``concurrent`` processes), as a layout's groups run in training;
    #: None times one group alone.
    concurrent: int | None = None
    #: gloo: each call after this long (us) of the caller's own work instead
    #: of back to back (``_time_op_gapped``); 0: back to back.
    gap_us: float = 0.0


@dataclass(frozen=True)
class NetprofilePlan:
    """A checked ``NetprofileConfig`` with its defaults resolved for this machine."""

    backend: str
    sizes: tuple[int, ...]
    group_sizes: tuple[int, ...]
    ops: tuple[str, ...]
    #: Ranks per node written into the profile: the cores (gloo) or GPUs (nccl) here.
    ranks_per_node: int
    host: str
    out: pathlib.Path
    json_out: pathlib.Path | None
    concurrent: int | None = None
    gap_us: float = 0.0

    @property
    def command(self) -> str:
        """The command that reproduces this measurement (written into the profile)."""
        return (f"python -m prism netprofile --backend {self.backend} --sizes {','.join(map(str, self.sizes))} "
                f"--group-sizes {','.join(map(str, self.group_sizes))} --ops {','.join(self.ops)}"
                + (f" --concurrent {self.concurrent}" if self.concurrent else "")
                + (f" --gap-us {self.gap_us:g}" if self.gap_us else ""))


@dataclass(frozen=True)
class NetprofileResult:
    plan: NetprofilePlan
    points: list[Point]
    #: One fit for all ops, and one per op (what predict uses).
    fit: Fit
    per_op: dict[str, Fit]
    #: Relative error per point of the single fit and of the per-op fits.
    errors_one: np.ndarray
    errors_per_op: np.ndarray
    #: Seconds per point under the per-op fits.
    predicted: np.ndarray
    wall_s: float
    profile_text: str = field(repr=False)


def plan_netprofile(config: NetprofileConfig) -> NetprofilePlan:
    """Check ``config`` against this machine; raises ``UsageError`` naming the bad value."""
    backend = config.backend
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend == "nccl":
        cores = gpu_count()
        if cores < 2:
            raise UsageError(f"--backend nccl needs at least 2 GPUs (one process per GPU); torch sees "
                             f"{cores} here. Run it on a multi-GPU machine, or profile gloo")
        unit = "GPU count"
    else:
        cores, unit = usable_cores(), "core count"
    sizes = tuple(config.sizes or (NCCL_SIZES if backend == "nccl" else DEFAULT_SIZES))
    gsizes = tuple(config.group_sizes or [n for n in (2, 4, 8, 16, 32, 64, 128) if n <= cores] or [2])
    bad = [n for n in gsizes if n < 2 or n > max(cores, 2)]
    if bad:
        raise UsageError(f"group size {bad[0]} must be in 2..{max(cores, 2)} (the {unit}: more ranks "
                         f"than {'GPUs' if backend == 'nccl' else 'cores'} would time the scheduler, not the backend)")
    unknown = [o for o in config.ops if o not in DEFAULT_OPS]
    if unknown:
        raise UsageError(f"unknown op {unknown[0]!r}; known: {', '.join(DEFAULT_OPS)}")
    conc = config.concurrent
    if conc is not None:
        if backend != "gloo":
            raise UsageError("--concurrent is for gloo (CPU ranks sharing this host's cores); NCCL's groups "
                             "each have their own GPUs: profile them one at a time")
        if conc < 2 or conc > cores:
            raise UsageError(f"--concurrent {conc} must be in 2..{cores} (the {unit})")
        if config.group_sizes is None:
            gsizes = tuple(n for n in gsizes if conc % n == 0)
        odd = [n for n in gsizes if conc % n]
        if odd:
            raise UsageError(f"--concurrent {conc}: group size {odd[0]} does not divide it (the world is cut "
                             f"into {conc} // n groups of each size n)")
    gap = float(config.gap_us or 0.0)
    if gap:
        if backend != "gloo":
            raise UsageError("--gap-us is for gloo (CPU ranks whose calls come after their compute); NCCL's "
                             "calls are timed on the GPU")
        if not 0 < gap <= 1e6:
            raise UsageError(f"--gap-us {config.gap_us:g} must be more than 0 and at most 1000000 (1 s)")
    host = socket.gethostname()
    out = pathlib.Path(config.out) if config.out else fitted_profile_path(backend, host)
    return NetprofilePlan(backend, sizes, gsizes, tuple(config.ops), cores, host, out,
                          pathlib.Path(config.json_out) if config.json_out else None, conc, gap)


def run_netprofile(plan: NetprofilePlan) -> NetprofileResult:
    """Measure, fit, and write the profile to ``plan.out`` (and JSON to ``plan.json_out``)."""
    t0 = time.monotonic()
    points = measure(plan.sizes, plan.group_sizes, plan.ops, backend=plan.backend, concurrent=plan.concurrent,
                     gap_us=plan.gap_us)
    fit = fit_points(points)
    per_op = fit_per_op(points)
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = profile_toml(fit, points, host=plan.host, backend=plan.backend, ranks_per_node=plan.ranks_per_node,
                        command=plan.command, date=date, per_op=per_op, concurrent=plan.concurrent)
    parse_profile(text, str(plan.out))  # never write what predict cannot read
    plan.out.parent.mkdir(parents=True, exist_ok=True)
    plan.out.write_text(text)
    one = relative_errors(fit, points)
    err = relative_errors(fit, points, per_op)
    result = NetprofileResult(plan, points, fit, per_op, one, err, predict_seconds(fit, points, per_op),
                              time.monotonic() - t0, text)
    if plan.json_out is not None:
        plan.json_out.write_text(json.dumps({
            "host": plan.host, "backend": plan.backend, "command": plan.command, "concurrent": plan.concurrent,
            "gap_us": plan.gap_us,
            "points": [dataclasses.asdict(p) for p in points],
            "fit": {"base_latency_s": fit.base_latency, "latency_s": fit.latency, "bandwidth_Bps": fit.bandwidth},
            "per_op": {op: dataclasses.asdict(f) for op, f in per_op.items()},
            "relative_error": {"median": float(np.median(one)), "max": float(np.max(one))},
            "relative_error_per_op_fits": {"median": float(np.median(err)), "max": float(np.max(err))}}, indent=2))
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2:])
    else:
        sys.exit("run `python -m prism netprofile` (this module's main is the measurement worker)")
