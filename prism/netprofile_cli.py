"""``python -m prism netprofile``: measure the local gloo or NCCL backend and fit a cost profile.

``--backend gloo`` (default) times CPU tensors over gloo, one process per
core; ``--backend nccl`` times CUDA tensors over NCCL, one process per GPU
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

Runs one real process per rank (``OMP_NUM_THREADS=1``, at most one rank per
core, so ranks do not steal each other's time), times each op at each
message size on groups of each size (the slowest rank's time per call, the
median over trials), fits the alpha-beta parameters of
``prism.core.costmodel`` (base latency, per-step latency, bandwidth) by
non-negative least squares on the *relative* error (sizes span four orders
of magnitude; plain least squares would fit only the largest messages), and
writes a TOML profile that ``parse_profile`` reads, with every measured point
in its comments. It prints each point's measured and fitted time and the
fit's relative error (median and max).

Where profiles live: ``--out`` if given, else ``fitted_profile_path("gloo",
HOST)``: ``$PRISM_PROFILE_DIR/gloo-HOST.toml`` when that variable is set,
otherwise ``~/.cache/prism/profiles/gloo-HOST.toml``. ``prism predict`` looks
there first (backend from the run's device kind, HOST from its manifest), so
a run is predicted with the profile of the machine it was captured on.

The worker side (``python -m prism.netprofile_cli --worker ...``) is an
ordinary ``torch.distributed`` program started by
``prism.workloads.harness.run_world``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prism.core.costmodel import CostModel, Link, parse_profile

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


@dataclass(frozen=True, slots=True)
class Point:
    """One measurement: ``op`` on ``n`` ranks, ``nbytes`` per rank, ``seconds`` per call."""

    op: str
    n: int
    nbytes: int
    seconds: float
    #: CPU seconds one call costs its caller (NCCL); None where not measured
    issue_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Fit:
    """Fitted alpha-beta parameters (seconds, seconds per step, bytes per second)."""

    base_latency: float
    latency: float
    bandwidth: float

    def model(self, name: str = "fit", ranks_per_node: int = 1 << 20) -> CostModel:
        link = Link(self.bandwidth, self.latency)
        return CostModel(name, ranks_per_node, link, link, self.base_latency, source="fit")


def _features(points: Sequence[Point]) -> np.ndarray:
    """Columns (1, alpha steps, bytes over the link) of each point under the cost model's formulas."""
    big = 1 << 40  # every rank on one node: the intra link
    steps_m = CostModel("steps", big, Link(math.inf, 1.0), Link(math.inf, 1.0))
    bytes_m = CostModel("bytes", big, Link(1e9, 0.0), Link(1e9, 0.0))
    rows = []
    for p in points:
        ranks = list(range(p.n))
        if p.op == "send":
            steps, moved = steps_m.p2p_ns(p.nbytes, 0, 1) / 1e9, bytes_m.p2p_ns(p.nbytes, 0, 1)
        else:
            steps, moved = steps_m.collective_ns(p.op, p.nbytes, ranks) / 1e9, bytes_m.collective_ns(p.op, p.nbytes, ranks)
        rows.append((1.0, steps, float(moved)))
    return np.array(rows, dtype=np.float64)


def fit_points(points: Sequence[Point]) -> Fit:
    """Non-negative least squares on relative error over (base, latency, 1/bandwidth).

    Three unknowns, so every subset of them being zero is tried and the best
    feasible solution kept (an exact NNLS for this size).
    """
    if len(points) < 3:
        raise ValueError(f"need at least 3 measured points to fit 3 parameters, got {len(points)}")
    X = _features(points)
    y = np.array([p.seconds for p in points], dtype=np.float64)
    if np.any(y <= 0):
        raise ValueError("measured times must be positive")
    A = X / y[:, None]
    b = np.ones(len(y))
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 8):
        cols = [i for i in range(3) if mask >> i & 1]
        sol, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
        if np.any(sol < 0):
            continue
        x = np.zeros(3)
        x[cols] = sol
        err = float(np.sum((A @ x - b) ** 2))
        if best is None or err < best[0]:
            best = (err, x)
    assert best is not None  # a single non-negative column always fits: y > 0 and features >= 0
    base, lat, inv_bw = best[1]
    # A bandwidth the data cannot resolve (no byte term) is written as very large, not infinite.
    return Fit(float(base), float(lat), 1.0 / inv_bw if inv_bw > 1e-15 else 1e15)


def fit_per_op(points: Sequence[Point]) -> dict[str, Fit]:
    """One fit per op that has at least 3 points (gloo's and NCCL's algorithms
    differ per op, so one set of parameters for all fits them badly)."""
    by_op: dict[str, list[Point]] = {}
    for p in points:
        by_op.setdefault(p.op, []).append(p)
    return {op: fit_points(pts) for op, pts in by_op.items() if len(pts) >= 3}


def predict_seconds(fit: Fit, points: Sequence[Point], per_op: dict[str, Fit] | None = None) -> np.ndarray:
    """Seconds per point: each op's own fit where ``per_op`` has one, else ``fit``."""
    X = _features(points)
    params = np.array([[f.base_latency, f.latency, 1.0 / f.bandwidth]
                       for f in ((per_op or {}).get(p.op, fit) for p in points)]).reshape(len(points), 3)
    return np.sum(X * params, axis=1)


def relative_errors(fit: Fit, points: Sequence[Point], per_op: dict[str, Fit] | None = None) -> np.ndarray:
    y = np.array([p.seconds for p in points])
    return np.abs(predict_seconds(fit, points, per_op) - y) / y


def profile_toml(fit: Fit, points: Sequence[Point], *, host: str, backend: str, ranks_per_node: int,
                 command: str, per_op: dict[str, Fit] | None = None) -> str:
    """The fitted profile as TOML (``parse_profile`` format), measured points in
    comments; ``per_op`` fits become ``[ops.NAME]`` tables."""
    err = relative_errors(fit, points, per_op)
    one = relative_errors(fit, points)
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    pred = predict_seconds(fit, points, per_op)
    lines = [
        f"# Cost profile fitted by `prism netprofile` on {host}, {date}.",
        f"# Command: {command}",
        f"# {backend}, one process per rank ({'one GPU each' if backend == 'nccl' else 'OMP_NUM_THREADS=1'}), "
        "all ranks on this host: the",
        "# inter-node link was NOT measured; it is set equal to the intra-node one.",
        f"# Fit: non-negative least squares on relative error over {len(points)} points;",
        f"# relative error median {np.median(err):.1%}, max {np.max(err):.1%}"
        + (f" with per-op parameters ({', '.join(sorted(per_op))}); one set for all ops: median "
           f"{np.median(one):.1%}, max {np.max(one):.1%}." if per_op else "."),
        "# Measured points (op, ranks, bytes per rank, measured us, fitted us):",
    ]
    issues = issue_per_op(points)
    if issues:
        lines[-1:-1] = ["# Times are GPU times per call (back to back, the CPU ahead); issue_us: CPU time per call",
                        "# on the calling thread (median over sizes; added to GPU ranks' CPU clocks by the replay)."]
    for p, t in zip(points, pred):
        lines.append(f"#   {p.op:<24} {p.n:>3} {p.nbytes:>10} {p.seconds * 1e6:>12.1f} {t * 1e6:>12.1f}"
                     + (f"   issue {p.issue_seconds * 1e6:.1f}" if p.issue_seconds is not None else ""))
    desc = (f"{backend} on {host}, measured {date[:10]} by prism netprofile; fit error median "
            f"{np.median(err):.0%}, max {np.max(err):.0%}")
    bw = fit.bandwidth / 1e9
    lines += [
        "",
        f'name = "{backend}-{host}"',
        f'description = "{desc}"',
        f"ranks_per_node = {ranks_per_node}",
        f"base_latency_us = {fit.base_latency * 1e6:.6g}",
        *([f"issue_us = {statistics.median(x for x in (p.issue_seconds for p in points) if x is not None) * 1e6:.6g}"]
          if issues else []),
        "",
        "[intra]",
        f"bandwidth_GBps = {bw:.6g}",
        f"latency_us = {fit.latency * 1e6:.6g}",
        "",
        "[inter]",
        "# not measured (one host); equal to [intra]",
        f"bandwidth_GBps = {bw:.6g}",
        f"latency_us = {fit.latency * 1e6:.6g}",
        "",
    ]
    for op, f in sorted((per_op or {}).items()):
        lines += [
            f"[ops.{op}]",
            f"base_latency_us = {f.base_latency * 1e6:.6g}",
            f"latency_us = {f.latency * 1e6:.6g}",
            f"bandwidth_GBps = {f.bandwidth / 1e9:.6g}",
            # a ping-pong's time already holds both sides' CPU
            *([f"issue_us = {issues[op] * 1e6:.6g}"] if op in issues else ["issue_us = 0"] if issues else []),
            "",
        ]
    return "\n".join(lines)


def issue_per_op(points: Sequence[Point]) -> dict[str, float]:
    """op -> median CPU issue seconds per call over its measured points."""
    by: dict[str, list[float]] = {}
    for p in points:
        if p.issue_seconds is not None:
            by.setdefault(p.op, []).append(p.issue_seconds)
    return {op: statistics.median(v) for op, v in by.items()}


# ------------------------------------------------------------------------ worker
def _worker(argv: Sequence[str]) -> None:
    """One rank of the measurement world (run under ``run_world``)."""
    import torch
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--group-sizes", required=True)
    ap.add_argument("--ops", required=True)
    ap.add_argument("--backend", default="gloo", choices=BACKENDS)
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
    rank = dist.get_rank()
    groups = {n: dist.new_group(list(range(n))) for n in gsizes}
    for n in gsizes:
        g = groups[n]
        if rank >= n:
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
                else:
                    rec = {"op": op, "n": n, "nbytes": nbytes, "seconds": _time_op(torch, dist, fn, g, device)}
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
        peer = 1 - rank

        def pingpong():
            if rank == 0:
                dist.send(x, peer, group=g)
                dist.recv(x, peer, group=g)
            else:
                dist.recv(x, peer, group=g)
                dist.send(x, peer, group=g)
        return pingpong
    raise ValueError(f"netprofile: unknown op {op!r}; known: {', '.join(DEFAULT_OPS)}")


def _time_op(torch, dist, fn, g, device) -> float:
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
    per_call = []
    for _ in range(TRIALS):
        dist.barrier(group=g)
        sync()
        t = time.perf_counter()
        for _ in range(k):
            fn()
        sync()
        per_call.append(agree((time.perf_counter() - t) / k))
    secs = statistics.median(per_call)
    return secs  # a ping-pong's half is taken by the caller


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


# ------------------------------------------------------------------------ shell
def measure(sizes: Sequence[int], group_sizes: Sequence[int], ops: Sequence[str], *,
            timeout: float = 600.0, backend: str = "gloo") -> list[Point]:
    """Run the measurement world (``max(group_sizes)`` processes) and return its points."""
    from prism.workloads.harness import run_world

    world = max(group_sizes)
    argv = ["-m", "prism.netprofile_cli", "--worker", "--sizes", ",".join(map(str, sizes)),
            "--group-sizes", ",".join(map(str, group_sizes)), "--ops", ",".join(ops), "--backend", backend]
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    env = {"OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    results = run_world(argv, world, timeout=timeout, env=env)
    points = []
    for line in results[0].stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            secs = d["seconds"] / 2 if d["op"] == "send" else d["seconds"]
            points.append(Point(d["op"], d["n"], d["nbytes"], secs, d.get("issue_seconds")))
    return points


def _size(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in ("K", "M", "G") else t
    if not num.isdigit() or int(num) < 1:
        raise argparse.ArgumentTypeError(f"--sizes takes byte counts like 1K,64K,4M; got {text!r}")
    return int(num) * mult


def _list(parse):
    def run(text: str) -> list:
        return [parse(x) for x in text.split(",") if x.strip()]
    return run


def gpu_count() -> int:
    """GPUs torch sees here (0 without CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    cores = usable_cores()
    p.add_argument("--backend", choices=BACKENDS, default="gloo",
                   help="gloo: CPU tensors, one process per core (default); nccl: CUDA tensors, one process per GPU "
                        "(each call's GPU time and its CPU issue cost, measured apart)")
    p.add_argument("--out", default=None, metavar="FILE.toml",
                   help="where to write the profile (default: ~/.cache/prism/profiles/BACKEND-HOST.toml, "
                        "or $PRISM_PROFILE_DIR/BACKEND-HOST.toml; `prism predict` looks there)")
    p.add_argument("--sizes", type=_list(_size), default=None,
                   help="bytes per rank, e.g. 1K,16K,1M (default gloo: 1K,16K,128K,1M,4M,16M; nccl: up to 256M)")
    p.add_argument("--group-sizes", type=_list(int), default=None,
                   help=f"group sizes to measure, each at most the core count ({cores}; nccl: the GPU count) "
                        "(default: powers of 2 up to it)")
    p.add_argument("--ops", type=_list(str), default=list(DEFAULT_OPS),
                   help=f"ops to measure (default: {','.join(DEFAULT_OPS)}; send is a ping-pong between 2 ranks)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the points and fit as JSON")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    backend = args.backend
    if backend == "nccl":
        cores = gpu_count()
        if cores < 2:
            print(f"prism netprofile: --backend nccl needs at least 2 GPUs (one process per GPU); torch sees "
                  f"{cores} here. Run it on a multi-GPU machine, or profile gloo", file=sys.stderr)
            return 2
        unit = "GPU count"
    else:
        cores, unit = usable_cores(), "core count"
    sizes = args.sizes or list(NCCL_SIZES if backend == "nccl" else DEFAULT_SIZES)
    gsizes = args.group_sizes or [n for n in (2, 4, 8, 16, 32, 64, 128) if n <= cores] or [2]
    bad = [n for n in gsizes if n < 2 or n > max(cores, 2)]
    if bad:
        print(f"prism netprofile: group size {bad[0]} must be in 2..{max(cores, 2)} (the {unit}: more ranks "
              f"than {'GPUs' if backend == 'nccl' else 'cores'} would time the scheduler, not the backend)",
              file=sys.stderr)
        return 2
    unknown = [o for o in args.ops if o not in DEFAULT_OPS]
    if unknown:
        print(f"prism netprofile: unknown op {unknown[0]!r}; known: {', '.join(DEFAULT_OPS)}", file=sys.stderr)
        return 2
    host = socket.gethostname()
    out = pathlib.Path(args.out) if args.out else fitted_profile_path(backend, host)
    t0 = time.monotonic()
    print(f"prism netprofile: {backend}, {max(gsizes)} processes, group sizes {gsizes}, ops {','.join(args.ops)}, "
          f"sizes {','.join(map(str, sizes))} bytes", file=sys.stderr)
    points = measure(sizes, gsizes, args.ops, backend=backend)
    fit = fit_points(points)
    per_op = fit_per_op(points)
    one = relative_errors(fit, points)
    err = relative_errors(fit, points, per_op)
    pred = predict_seconds(fit, points, per_op)
    print(f"{'op':<24} {'ranks':>5} {'bytes':>10} {'measured us':>12} {'per-op fit':>12} {'rel err':>8}")
    for p, t, e in zip(points, pred, err):
        print(f"{p.op:<24} {p.n:>5} {p.nbytes:>10} {p.seconds * 1e6:>12.1f} {t * 1e6:>12.1f} {e:>8.1%}")
    print(f"one fit for all ops: base latency {fit.base_latency * 1e6:.2f} us, per-step latency "
          f"{fit.latency * 1e6:.2f} us, bandwidth {fit.bandwidth / 1e9:.3f} GB/s; relative error median "
          f"{np.median(one):.1%}, max {np.max(one):.1%} over {len(points)} points ({time.monotonic() - t0:.0f} s)")
    for op, f in sorted(per_op.items()):
        e = [x for p, x in zip(points, err) if p.op == op]
        print(f"  {op:<24} base {f.base_latency * 1e6:8.2f} us, step {f.latency * 1e6:8.2f} us, "
              f"{f.bandwidth / 1e9:9.3f} GB/s; error median {np.median(e):.1%}, max {np.max(e):.1%}")
    print(f"per-op fits (written as [ops.*], used by predict): relative error median {np.median(err):.1%}, "
          f"max {np.max(err):.1%}")
    for op, v in sorted(issue_per_op(points).items()):
        print(f"  {op:<24} CPU issue {v * 1e6:8.2f} us per call (median over sizes)")
    command = (f"python -m prism netprofile --backend {backend} --sizes {','.join(map(str, sizes))} "
               f"--group-sizes {','.join(map(str, gsizes))} --ops {','.join(args.ops)}")
    text = profile_toml(fit, points, host=host, backend=backend, ranks_per_node=cores, command=command,
                        per_op=per_op)
    parse_profile(text, str(out))  # never write what predict cannot read
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "host": host, "backend": backend, "command": command, "points": [dataclasses.asdict(p) for p in points],
            "fit": {"base_latency_s": fit.base_latency, "latency_s": fit.latency, "bandwidth_Bps": fit.bandwidth},
            "per_op": {op: dataclasses.asdict(f) for op, f in per_op.items()},
            "relative_error": {"median": float(np.median(one)), "max": float(np.max(one))},
            "relative_error_per_op_fits": {"median": float(np.median(err)), "max": float(np.max(err))}}, indent=2))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2:])
    else:
        sys.exit("run `python -m prism netprofile` (this module's main is the measurement worker)")
