"""Where a CPU prediction's error lies: communication or compute, per step.

    python bench/comm_share.py --world 8 --configs gpt-tp2-dp4 [--runs 2] [--steps 10] [--out FILE.json]

For each configuration of ``bench/accuracy.py`` (same model, same gloo
ground truth, one process per core): the truth runs under the step clock
with ``PRISM_STEPCLOCK_CALLS=1``, so every communication call's own duration
is logged (no profiler); a Prism capture of the same command is replayed
under the profiles ``bench/accuracy.py`` compares. Per rank and step both
sides are split into *communication* (the truth: the time its calls held the
caller; the replay: its collective, point-to-point and wait nodes) and
*the rest* (iteration time less communication: compute and Python), and
the rest is compared segment by segment (the time between two calls of one
rank, where both sides made the same calls in a step). Printed
per configuration: the mean over ranks and steps of each, truth beside each
profile's replay, so an iteration-time error shows whether the cost model
(communication) or the captured durations (the rest) carry it. Each run
also captures with ``PRISM_FRONT_END_IN_COMM=1`` (torch's Python dispatch
counted inside each call instead of in the compute around it:
``prism/rank/bootstrap.py::_front_end``), replayed under two profiles
(rows ``+fe``; ``cpu-clock+fe``: the concurrent profile over that capture's
segments cut to their main thread's CPU time). Where the truth's file has the calling thread's CPU clock
(``PRISM_STEPCLOCK_CALLS=1`` writes it since 2026-12-07), each segment also
gets its main thread's CPU time on both sides (the capture's
``Compute.thread_cpu_ns``): wall time above CPU time is time the thread was
descheduled (or waited for the GIL); CPU time above the truth's is work the
truth did not do there.

Each blocking collective instance's time in the call is also split, per
member, into *waiting* (the last member's entry less its own) and *cost*
(its own return less the last member's entry), on both sides (the truth's
step-clock entries and returns; the replay's node times): per step and rank,
summed, mean over ranks (``calls`` in the JSON, per op and group size too),
so a short communication half shows whether the calls' cost or the members'
skew is missing; beside them, how far each instance's last member returns
after its median member (``late_return_us``: the spread of completions, which
a replay, whose members return together, does not have). Row
``concurrent+late`` is a diagnostic, not a prediction: the concurrent
profile with each collective lengthened by the truth's own mean late return
for its op and group size (``LateReturn``). Row ``concurrent-gap``: the
replay under a concurrent profile measured with ``--gap-us`` (500) of each
caller's own work before every call (``prism.app.netprofile``'s gapped
timing), where the other profiles time calls back to back, with the
backend's threads hot.

Each truth run also records what took CPU time from the host meanwhile
(``host`` in the JSON, printed before its line: steal ticks, a cgroup CPU
quota's throttling, CPU pressure stall time; ``prism.validation.cpunoise.host_pressure``).

Ground truth needs one core per rank, as in ``bench/accuracy.py``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# bench/ is on sys.path
from accuracy import (CONFIGS, CPU_CLOCK, command, cpu_clock_graph, ensure_profile, fitted_toml,  # noqa: E402
                      job_step_ends, parsed_model)
from _results import result_path, write_json  # noqa: E402
from prism.app.capture import capture_run  # noqa: E402
from prism.app.netprofile import usable_cores  # noqa: E402
from prism.core.graph import COLL, RECV, SEND, WAIT, ExecutionGraph, program_order  # noqa: E402
from prism.core.trace import P2P, Collective, Compute  # noqa: E402
from prism.core.replay import replay_batch  # noqa: E402
from prism.shell.launcher import launch_ranks  # noqa: E402
from prism.rank.bootstrap import FRONT_END_ENV  # noqa: E402
from prism.shell.runfolder import read_run  # noqa: E402
from prism.validation import stepclock  # noqa: E402
from prism.validation.cpunoise import host_pressure, pressure_delta  # noqa: E402
from prism.validation.truthrun import STEPCLOCK  # noqa: E402


def truth_texts(world: int, cmd: list[str], tmp: pathlib.Path, timeout: float) -> list[str]:
    """Run the plain job under the step clock with every call timed
    (``PRISM_STEPCLOCK_CALLS=1``); each rank's step-clock file."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="truth-", dir=tmp))
    h = launch_ranks(world, None, d, [STEPCLOCK, *cmd], show_ranks=(),
                     env={"PRISM_STEPCLOCK_DIR": str(d), "OMP_NUM_THREADS": "1", "PRISM_STEPCLOCK_CALLS": "1"})
    try:
        codes = h.wait(timeout=timeout)
    finally:
        h.close()
    if any(c != 0 for c in codes):
        raise RuntimeError(f"ground-truth run failed (exit codes {codes}); logs in {d / 'logs'}")
    texts = [(d / f"rank-{r}.txt").read_text() for r in range(world)]
    shutil.rmtree(d, ignore_errors=True)
    return texts


def truth_split(world: int, cmd: list[str], tmp: pathlib.Path, warmup: int, timeout: float) -> dict:
    """Per rank: mean iteration, communication and rest per step (ms), over steps after ``warmup``."""
    texts = truth_texts(world, cmd, tmp, timeout)
    ends = job_step_ends([stepclock.parse(t)[0] for t in texts])
    iters = np.diff(ends)[warmup - 1:] / 1e6  # step k's time: end(k) - end(k-1), k >= warmup
    comm = []
    for t in texts:
        per_step: dict[int, int] = {}
        for step, _op, _n, _b, t0, t1, is_async in stepclock.parse_calls(t):
            if not is_async:
                per_step[step] = per_step.get(step, 0) + (t1 - t0)
        comm.append([per_step.get(k, 0) / 1e6 for k in range(warmup, len(ends))])
    c = float(np.mean(comm))
    per_rank_ends = [stepclock.parse(t)[0] for t in texts]
    segs = [truth_segments(stepclock.parse_calls(t), e, warmup, stepclock.call_cpu(t))
            for t, e in zip(texts, per_rank_ends)]
    return {"iteration_ms": float(iters.mean()), "comm_ms": c, "rest_ms": float(iters.mean()) - c,
            "segments": segs, "calls": truth_call_split(texts, warmup, len(ends) - warmup)}


def _split_rows(members: list[tuple[str, list[tuple[int, int]]]], world: int, steps: int) -> dict:
    """``members``: per blocking collective instance, its "op/group size" and
    each member's (entry, return) in ns. Per step and rank, the mean (over
    ranks and steps) of the waiting and the cost summed over the instances,
    ms: in all and per "op/group size"; and ``late_return_us``, the mean
    over instances of how far the last member's return lies past the median
    member's (a replay's members all return at once: 0; in the real job the
    last one sets when the next call can start)."""
    acc: dict[str, list[float]] = {}
    for key, ms in members:
        last = max(t0 for t0, _ in ms)
        w = sum(last - t0 for t0, _ in ms)
        c = sum(max(t1 - last, 0) for _, t1 in ms)
        ends = sorted(t1 for _, t1 in ms)
        late = ends[-1] - statistics.median(ends)  # the last member's return past the median member's
        for k in ("all", key):
            a = acc.setdefault(k, [0.0, 0.0, 0, 0.0])
            a[0] += w
            a[1] += c
            a[2] += 1
            a[3] += late
    per = world * max(steps, 1) * 1e6
    return {k: {"wait_ms": w / per, "cost_ms": c / per, "instances": n, "late_return_us": late / max(n, 1) / 1e3}
            for k, (w, c, n, late) in sorted(acc.items())}


def paired_blocking_calls(texts: list[str]) -> list[tuple[tuple[int, ...], tuple]]:
    """The real job's blocking calls (each rank's step-clock file in
    ``texts``), paired across their group's members by order: per instance,
    (group, the members' ``stepclock.parse_calls`` tuples in group order).
    ``RuntimeError`` where they do not pair up (a file with no groups beyond
    world 2, members with different call counts or ops at one position)."""
    world = len(texts)
    per_group: dict[tuple[int, ...], dict[int, list]] = {}  # group -> rank -> its blocking calls there, in order
    for r, t in enumerate(texts):
        for c, g in zip(stepclock.parse_calls(t), stepclock.parse_call_groups(t)):
            if c[6]:
                continue
            if g is None:
                if world != 2:
                    raise RuntimeError("the step clock logged no group for a call (an older stepclock?); "
                                       "only world 2 pairs calls without them")
                g = (0, 1)
            per_group.setdefault(g, {}).setdefault(r, []).append(c)
    out = []
    for g, by_rank in per_group.items():
        seqs = [by_rank.get(r, []) for r in g]
        if len({len(x) for x in seqs}) != 1:
            raise RuntimeError(f"group {g}: its members made {[len(x) for x in seqs]} blocking calls; they do not "
                               "pair up by order")
        for calls in zip(*seqs):
            if len({c[1] for c in calls}) != 1:
                raise RuntimeError(f"group {g}: calls {[c[1] for c in calls]} at one position; they do not pair up")
            out.append((g, calls))
    return out


def truth_call_split(texts: list[str], warmup: int, steps: int) -> dict:
    """The real job's blocking collectives split into waiting and cost
    (``_split_rows``); {} where its calls do not pair up
    (``paired_blocking_calls``)."""
    try:
        pairs = paired_blocking_calls(texts)
    except RuntimeError:
        return {}
    members = [(f"{calls[0][1]}/{len(g)}", [(c[4], c[5]) for c in calls]) for g, calls in pairs
               if calls[0][0] >= warmup]
    return _split_rows(members, len(texts), steps)


def replay_call_split(graph: ExecutionGraph, res, warmup: int, world: int) -> dict:
    """The replay's blocking collectives split as ``truth_call_split`` splits
    the real job's: each member node's start and end in ``res``."""
    from prism.core.graph import OPS as C_OPS

    last = int(graph.step.max())
    members = []
    for i in range(len(graph.inst_group)):
        nodes = graph.inst_nodes[graph.inst_ptr[i]:graph.inst_ptr[i + 1]]
        first = nodes[0]
        if graph.kind[first] != COLL or graph.is_async[first] or not warmup <= graph.step[first] <= last:
            continue
        key = f"{C_OPS[int(graph.inst_op[i])]}/{int(graph.group_size[graph.inst_group[i]])}"
        members.append((key, [(int(res.start[n]), int(res.end[n])) for n in nodes]))
    return _split_rows(members, world, last - warmup + 1)


def truth_segments(calls: list, ends: list[int], warmup: int, cpu=None) -> dict[int, list]:
    """Per step from ``warmup``: [(gap_ns, op_after, cpu_ns)]: the time between
    one call's return and the next call (the first from the previous step's
    end, the last one's op ``"end"`` up to the step's end) of one rank: its
    compute and Python between calls, as the capture's COMPUTE segments are;
    ``cpu_ns`` the main thread's CPU time in it (``cpu``: ``stepclock.call_cpu``
    of the rank's file; -1 without it)."""
    ccalls, csteps = cpu if cpu is not None else (None, None)
    out: dict[int, list] = {}
    for k in range(max(warmup, 1), len(ends)):
        mine = [(i, c) for i, c in enumerate(calls) if c[0] == k]
        t, segs = ends[k - 1], []
        tc = csteps[k - 1] if csteps is not None else -1
        for i, (_step, op, _n, _b, t0, t1, _a) in mine:
            c0, c1 = ccalls[i] if ccalls is not None else (-1, -1)
            segs.append((t0 - t, op, c0 - tc if tc >= 0 else -1))
            t, tc = t1, c1
        segs.append((ends[k] - t, "end", csteps[k] - tc if csteps is not None and tc >= 0 else -1))
        out[k] = segs
    return out


def capture_segments(ranks: dict, warmup: int) -> list[dict[int, list]]:
    """The capture's side of ``truth_segments``: per rank, per step, the
    COMPUTE time between its communication calls (collectives, sends and
    receives; waits are not calls and stay inside a segment), with the op
    that follows and the main thread's CPU time in it
    (``Compute.thread_cpu_ns``; -1 where a segment has none). Walks each
    rank in program order (an async call's record is written when it
    completes, after the compute that overlapped it)."""
    out = []
    for r in sorted(ranks):
        per: dict[int, list] = {}
        acc: dict[int, list] = {}
        for _, sub, ev in program_order(ranks[r]):
            if sub:  # an async call's wait: not a call
                continue
            k = getattr(ev, "step", None)
            if k is None or k < warmup:
                continue
            if isinstance(ev, Compute):
                a = acc.setdefault(k, [0, 0])
                a[0] += ev.end_ns - ev.start_ns
                a[1] = a[1] + ev.thread_cpu_ns if a[1] >= 0 and ev.thread_cpu_ns >= 0 else -1
            elif isinstance(ev, (Collective, P2P)):
                w, c = acc.pop(k, (0, 0))
                per.setdefault(k, []).append((w, ev.op, c))
        for k in set(per) | set(acc):
            w, c = acc.get(k, (0, 0))
            per.setdefault(k, []).append((w, "end", c))
        out.append(per)
    return out


def compare_segments(truth: list[dict[int, list]], cap: list[dict[int, list]]) -> dict:
    """Segment by segment where both sides made the same number of calls in a
    step: the mean over ranks and steps of each segment's truth and captured
    time (ms), and of their main threads' CPU time in it where both sides have
    it (None else), keyed by its position in the step and the op after it."""
    sums: dict[int, list] = {}
    aligned = unaligned = 0
    for tr, cr in zip(truth, cap):
        for k, ts in tr.items():
            cs = cr.get(k)
            if cs is None or len(cs) != len(ts):
                unaligned += 1
                continue
            aligned += 1
            for i, ((tg, op, tc), (cg, _, cc)) in enumerate(zip(ts, cs)):
                acc = sums.setdefault(i, [op, 0.0, 0.0, 0, 0.0, 0.0, 0])
                acc[1] += tg / 1e6
                acc[2] += cg / 1e6
                acc[3] += 1
                if tc >= 0 and cc >= 0:
                    acc[4] += tc / 1e6
                    acc[5] += cc / 1e6
                    acc[6] += 1
    rows = [{"index": i, "op_after": op, "truth_ms": t / n, "capture_ms": c / n, "n": n,
             "truth_cpu_ms": tc / nc if nc else None, "capture_cpu_ms": cc / nc if nc else None}
            for i, (op, t, c, n, tc, cc, nc) in sorted(sums.items())]
    return {"aligned_rank_steps": aligned, "unaligned_rank_steps": unaligned, "rows": rows}


class LateReturn:
    """A diagnostic cost model (not a prediction: it borrows the truth's
    figures): ``base``'s, with each collective instance lengthened by the
    real job's mean late return (``late_return_us``) for its "op/group size"
    (``late``, us), so that every member returns when the real job's last
    member did. Whether that closes the communication half's gap says
    whether the completions' spread is what the replay misses."""

    def __init__(self, base, late: dict[str, float]) -> None:
        self.base, self.late = base, late
        self.name, self.source = f"{base.name}+late", base.source
        self.description = "diagnostic: the truth's late returns added"

    def instance_costs(self, graph: ExecutionGraph) -> np.ndarray:
        from prism.core.graph import OPS as C_OPS

        out = self.base.instance_costs(graph).copy()
        if not len(out):
            return out
        pairs = np.stack([graph.inst_op.astype(np.int64), graph.group_size[graph.inst_group].astype(np.int64)])
        kinds, which = np.unique(pairs, axis=1, return_inverse=True)
        add = np.array([int(self.late.get(f"{C_OPS[op]}/{n}", 0.0) * 1e3) for op, n in kinds.T.tolist()], np.int64)
        return out + add[which.reshape(-1)]

    def message_costs(self, graph: ExecutionGraph) -> np.ndarray:
        return self.base.message_costs(graph)

    def issue_costs(self, graph: ExecutionGraph) -> np.ndarray:
        return self.base.issue_costs(graph)


def late_returns(truth: dict) -> dict[str, float]:
    """"op/group size" -> the truth's mean late return (us), from its call split."""
    return {k: v["late_return_us"] for k, v in truth.get("calls", {}).items() if k != "all"}


GAPPED = "concurrent-gap"


def gapped_profile(world: int, gap_us: float, tmp: pathlib.Path) -> tuple[object, list[dict]]:
    """The concurrent profile measured with ``gap_us`` of each caller's own
    work before every call (``prism.app.netprofile._time_op_gapped``): the
    calls find the backend's threads idle, as a step's calls do after its
    compute, where the default measurement runs them back to back. Its
    cost model and the measured points."""
    import dataclasses

    from prism.app.netprofile import DEFAULT_OPS, DEFAULT_SIZES
    from prism.app.netprofile import measure as measure_points

    gs = [n for n in (2, 4, 8, 16) if n <= world and world % n == 0]
    print(f"measuring gloo on this host (concurrent {world}, {gap_us:g} us of work before each call)", flush=True)
    points = measure_points(DEFAULT_SIZES, gs, DEFAULT_OPS, concurrent=world if world > 2 else None, gap_us=gap_us)
    text = fitted_toml(points, f"bench/comm_share.py (concurrent {world}, --gap-us {gap_us:g})", concurrent=world)
    return parsed_model(text, tmp / f"profile-{GAPPED}.toml"), [dataclasses.asdict(p) for p in points]


def prism_split(world: int, cmd: list[str], tmp: pathlib.Path, models: dict, warmup: int,
                front_end: bool = False) -> dict:
    d = pathlib.Path(tempfile.mkdtemp(prefix="prism-", dir=tmp)) / "run"
    old = os.environ.get(FRONT_END_ENV)
    os.environ[FRONT_END_ENV] = "1" if front_end else "0"  # the ranks inherit it
    try:
        status = capture_run(d, world, cmd, slots=usable_cores(), show_ranks=(), progress="off").exit_code
    finally:
        if old is None:
            os.environ.pop(FRONT_END_ENV, None)
        else:
            os.environ[FRONT_END_ENV] = old
    if status != 0:
        raise RuntimeError(f"prism capture failed with status {status}; logs in {d / 'logs'}")
    ranks = read_run(d).ranks
    graph = ExecutionGraph.from_events(ranks)
    shutil.rmtree(d.parent, ignore_errors=True)
    segments = capture_segments(ranks, warmup)
    comm_kind = np.isin(graph.kind, (COLL, SEND, RECV, WAIT))
    out = {}
    for name, model in models.items():
        # ``cpu-clock``: the same profile over segments cut to their main thread's CPU time
        g = cpu_clock_graph(ranks) if name == CPU_CLOCK else graph
        res = replay_batch(g, cost_model=model)
        span = (res.end - res.start).astype(np.float64)
        steps = graph.step
        last = int(steps.max())
        sel = comm_kind & (steps >= warmup) & (steps <= last)
        comm = float(span[sel].sum()) / world / (last - warmup + 1) / 1e6
        it = res.mean_iteration_time(warmup) / 1e6
        out[name] = {"iteration_ms": it, "comm_ms": comm, "rest_ms": it - comm,
                     "calls": replay_call_split(g, res, warmup, world)}
    out["_segments"] = segments
    return out


def print_segments(name: str, runs: list[dict], top: int = 8) -> None:
    """The segments whose captured time departs most from the truth's, over the runs."""
    rows: dict[int, list] = {}
    for r in runs:
        for row in r["segments"]["rows"]:
            rows.setdefault(row["index"], []).append(row)
    def mean(rs, key):
        vals = [x[key] for x in rs if x.get(key) is not None]
        return statistics.mean(vals) if vals else None
    merged = [(i, rs[0]["op_after"], mean(rs, "truth_ms"), mean(rs, "capture_ms"), mean(rs, "truth_cpu_ms"),
               mean(rs, "capture_cpu_ms")) for i, rs in rows.items()]
    al = sum(r["segments"]["aligned_rank_steps"] for r in runs)
    un = sum(r["segments"]["unaligned_rank_steps"] for r in runs)
    tt, ct = sum(m[2] for m in merged), sum(m[3] for m in merged)
    cpu = all(m[4] is not None and m[5] is not None for m in merged)
    tcpu = f" (main thread on a CPU {sum(m[4] for m in merged):.2f})" if cpu else ""
    ccpu = f" (on a CPU {sum(m[5] for m in merged):.2f})" if cpu else ""
    print(f"{name}: segments between calls, mean per rank and step ({al} rank-steps aligned, {un} not): "
          f"truth {tt:.2f} ms{tcpu}, capture {ct:.2f} ms{ccpu} in all; the {top} that differ most:")
    for i, op, t, c, tc, cc in sorted(merged, key=lambda m: -abs(m[3] - m[2]))[:top]:
        on = f"   on a CPU {tc:7.3f} / {cc:7.3f} ms ({cc - tc:+.3f})" if tc is not None and cc is not None else ""
        print(f"  #{i:<4} before {op:<24} truth {t:8.3f} ms  capture {c:8.3f} ms  ({c - t:+.3f}){on}")


def print_calls(name: str, runs: list[dict], profile: str = "concurrent") -> None:
    """The blocking collectives' waiting and cost per step, truth beside the
    replay under ``profile``, mean over the runs (ms per rank and step)."""
    def mean(get) -> float | None:
        vals = [v for v in (get(r) for r in runs) if v is not None]
        return statistics.mean(vals) if vals else None
    keys = sorted({k for r in runs for k in r["truth"].get("calls", {})} |
                  {k for r in runs for k in r["prism"][profile].get("calls", {})})
    if not keys:
        return
    print(f"{name}: blocking collectives, ms per rank and step, truth / replay ({profile}): waiting, cost")
    for k in keys:
        def cell(side_get, what):
            return mean(lambda r: (side_get(r).get("calls", {}).get(k) or {}).get(what))
        tw, tc = cell(lambda r: r["truth"], "wait_ms"), cell(lambda r: r["truth"], "cost_ms")
        pw, pc = cell(lambda r: r["prism"][profile], "wait_ms"), cell(lambda r: r["prism"][profile], "cost_ms")
        tl, pl = cell(lambda r: r["truth"], "late_return_us"), cell(lambda r: r["prism"][profile], "late_return_us")
        f = lambda v: f"{v:7.2f}" if v is not None else "      -"  # noqa: E731
        g = lambda v: f"{v:6.0f}" if v is not None else "     -"  # noqa: E731
        print(f"  {k:<26} waiting {f(tw)} / {f(pw)}   cost {f(tc)} / {f(pc)}   last return past the median "
              f"member's, us per call {g(tl)} / {g(pl)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--configs", default=None)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--gap-us", type=float, default=500.0,
                    help="also replay under a concurrent profile measured with this much work before each call "
                         f"(row {GAPPED}; 0: not)")
    ap.add_argument("--out", default=str(result_path("comm_share")))
    a = ap.parse_args()
    if a.world > usable_cores():
        sys.exit(f"--world {a.world} exceeds the {usable_cores()} cores: the ground truth would be unfair")
    if a.world not in CONFIGS:
        sys.exit(f"--world must be one of {sorted(CONFIGS)}")
    names = a.configs.split(",") if a.configs else list(CONFIGS[a.world])
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="prism-comm-share-"))
    models, _, points = ensure_profile(None, tmp, a.world)
    gapped_points = []
    if a.gap_us > 0:
        models[GAPPED], gapped_points = gapped_profile(a.world, a.gap_us, tmp)
    import torch

    res = {"benchmark": "comm_share", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "python " + " ".join(sys.argv), "versions": {"python": platform.python_version(),
                                                                  "torch": torch.__version__},
           "cpus": usable_cores(), "configs": [], "points": {**points, GAPPED: gapped_points}}
    try:
        for name in names:
            cmd = command(CONFIGS[a.world][name], a.steps)
            runs = []
            for i in range(a.runs):
                h0 = host_pressure()
                t = truth_split(a.world, cmd, tmp, a.warmup, a.timeout)
                # steal, a CPU quota's throttling, CPU pressure (PSI) over the truth run: a noisy host shows here
                t["host"] = pressure_delta(h0, host_pressure())
                # ``concurrent+late``: a diagnostic row, the truth's late returns added (LateReturn)
                p = prism_split(a.world, cmd, tmp, {**models, "concurrent+late": LateReturn(
                    models["concurrent"], late_returns(t))}, a.warmup)
                # the same with torch's front end counted inside each call (PRISM_FRONT_END_IN_COMM=1)
                f = prism_split(a.world, cmd, tmp, {**{k: models[k] for k in ("concurrent", "one-fit")},
                                                    CPU_CLOCK: models["concurrent"]}, a.warmup, front_end=True)
                fseg = f.pop("_segments")
                p.update({f"{k}+fe": v for k, v in f.items()})
                tseg = t.pop("segments")
                seg = compare_segments(tseg, p.pop("_segments"))
                runs.append({"truth": t, "prism": p, "segments": seg, "segments_fe": compare_segments(tseg, fseg)})
                # each finished run is kept at once: a device call cut by its time bound keeps what it measured
                res["in_progress"] = {"config": name, "runs": runs}
                write_json(a.out, res, say=False)
                hp = t["host"]
                print(f"{name} run {i}: host during the truth: steal {hp['steal_ticks']} ticks, throttled "
                      f"{hp['nr_throttled']} times for {hp['throttled_usec']} us (quota {hp['cpu_max']}), "
                      f"CPU pressure {hp['psi_some_us']} us", flush=True)
                print(f"{name} run {i}: truth {t['iteration_ms']:.1f} ms = comm {t['comm_ms']:.1f} + rest "
                      f"{t['rest_ms']:.1f}; " + "; ".join(f"{k} {v['iteration_ms']:.1f} = {v['comm_ms']:.1f} + "
                                                          f"{v['rest_ms']:.1f}" for k, v in p.items()), flush=True)
            res["configs"].append({"config": name, "runs": runs})
            res.pop("in_progress", None)
            print_segments(name, runs)
            print_segments(f"{name}+fe", [{"segments": r["segments_fe"]} for r in runs])
            print_calls(name, runs)
            write_json(a.out, res, say=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{'config':<18} {'side':<16} {'iteration ms':>13} {'comm ms':>9} {'rest ms':>9}")
    for c in res["configs"]:
        def mean(side, key, prof=None):
            return statistics.mean(r["truth"][key] if prof is None else r["prism"][prof][key] for r in c["runs"])
        print(f"{c['config']:<18} {'truth':<16} {mean('t', 'iteration_ms'):>13.1f} {mean('t', 'comm_ms'):>9.1f} "
              f"{mean('t', 'rest_ms'):>9.1f}")
        for prof in c["runs"][0]["prism"]:
            print(f"{'':<18} {prof:<16} {mean('p', 'iteration_ms', prof):>13.1f} {mean('p', 'comm_ms', prof):>9.1f} "
                  f"{mean('p', 'rest_ms', prof):>9.1f}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
