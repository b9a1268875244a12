"""``python -m prism trace ...``: inspect a PrismTrace run (a thin shell over
``prism.core.trace``).

Exit status: 0 on success; ``validate`` exits 1 when the run breaks a rule;
both exit 2 when the directory cannot be read as a run at all (no manifest,
unknown major version).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable

from prism.core import trace as T


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_command", metavar="SUBCOMMAND", required=True)
    s = sub.add_parser("summary", help="per-rank and per-group counts of a run")
    s.add_argument("run", help="run directory")
    s.set_defaults(func=_summary)
    v = sub.add_parser("validate", help="check every record of a run; exit 1 on errors")
    v.add_argument("run", help="run directory")
    v.set_defaults(func=_validate)


def _read(path: str) -> T.Run | None:
    try:
        return T.read_run(path)
    except (T.TraceFormatError, OSError) as e:
        print(f"prism trace: cannot read run {path}: {e}", file=sys.stderr)
        return None


def compact_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 8, 10, 11]`` -> ``"0-3,8,10-11"`` (in the given order)."""
    parts: list[str] = []
    run: list[int] = []
    for r in ranks:
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [r]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)


def _summary(args: argparse.Namespace) -> int:
    run = _read(args.run)
    if run is None:
        return 2
    m = run.manifest
    print(
        f"run {run.path}: {m.run_id}, world_size {m.world_size}, PrismTrace {m.version}.{m.version_minor}, "
        f"{m.device_kind}, command: {' '.join(m.command)}"
    )
    header = ("rank", "events", "compute", "collectives", "p2p", "steps", "last_step", "end")
    rows = []
    groups: dict[str, T.GroupCreated] = {}
    instances: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    for rank, events in run.ranks.items():
        kinds = Counter(type(ev) for ev in events)
        iters = [ev.step for ev in events if type(ev) is T.Iteration]
        end = next((ev.status for ev in events if type(ev) is T.RankEnd), "(none)")
        rows.append(
            (
                rank,
                len(events),
                kinds[T.Compute],
                kinds[T.Collective],
                kinds[T.P2P],
                len(iters),
                max(iters) if iters else "-",
                end,
            )
        )
        for ev in events:
            if type(ev) is T.GroupCreated:
                groups.setdefault(ev.gid, ev)
            elif type(ev) is T.Collective:
                # An instance is (gid, seq); count each once, whichever members recorded it.
                instances[ev.gid][ev.op].add(ev.seq)
    _table(header, rows, left=frozenset({0, 7}))
    print()
    print("collectives per group (instances by op):")
    gheader = ("group", "index", "size", "ranks", "collectives", "by op")
    grows = []
    for gid in sorted(set(groups) | set(instances), key=lambda g: (groups[g].index if g in groups else -1, g)):
        g = groups.get(gid)
        by_op = instances.get(gid, {})
        grows.append(
            (
                gid,
                g.index if g else "?",
                len(g.ranks) if g else "?",
                compact_ranks(g.ranks) if g else "(undeclared)",
                sum(len(s) for s in by_op.values()),
                " ".join(f"{op}={len(s)}" for op, s in sorted(by_op.items())) or "-",
            )
        )
    _table(gheader, grows, left=frozenset({0, 3, 5}))
    _gpu_timing(run)
    if run.warnings:
        print()
        print(f"{len(run.warnings)} warning(s):")
        for w in run.warnings:
            print(f"  {w}")
    return 0


def _gpu_timing(run: T.Run) -> None:
    """Two-clock segments of GPU ranks (docs/GPU-TIMING.md), per rank: mean
    per step (step 0 left out) of the segments' wall time, CPU share and free
    finish (PrismTrace 1.2) on uncalibrated steps, their GPU busy time on
    calibration steps, joins, and the rank's measured cold start (1.2)."""
    rows = []
    for rank, events in run.ranks.items():
        segs = [ev for ev in events if type(ev) is T.Compute and ev.cpu_ns >= 0 and ev.step > 0]
        if not segs:
            continue
        by_step: dict[int, list[T.Compute]] = defaultdict(list)
        for ev in segs:
            by_step[ev.step].append(ev)
        calib = sorted(st for st, evs in by_step.items() if any(ev.gpu_ns != -1 for ev in evs))
        plain = [evs for st, evs in by_step.items() if st not in calib]
        cal = [by_step[st] for st in calib]

        def per_step(groups: list[list[T.Compute]], f) -> str:
            return f"{sum(f(ev) for evs in groups for ev in evs) / len(groups) / 1e6:.2f}" if groups else "-"

        rows.append((
            rank,
            per_step(plain, lambda ev: ev.end_ns - ev.start_ns),
            per_step(plain, lambda ev: ev.cpu_ns),
            per_step(plain, lambda ev: max(ev.free_ns, 0)) if any(ev.free_ns >= 0 for ev in segs) else "-",
            per_step(cal, lambda ev: max(ev.gpu_ns, 0)),
            f"{sum(len(evs) for evs in by_step.values()) / len(by_step):.0f}",
            f"{sum(ev.join for ev in segs) / len(by_step):.0f}",
            f"{max(ev.cold_ns for ev in segs) / 1e3:.0f}",
            ",".join(map(str, calib)) or "-",
            sum(ev.gpu_ns == -2 for ev in segs),
        ))
    if not rows:
        return
    print()
    print("GPU timing (two clocks; ms per step, step 0 left out; docs/GPU-TIMING.md):")
    _table(("rank", "wall", "cpu", "free", "gpu (calibrated)", "segments", "joins", "cold us",
            "calibration steps", "discarded"), rows, left=frozenset({8}))


def _table(header: tuple[str, ...], rows: list[tuple[object, ...]], left: frozenset[int]) -> None:
    """Print aligned columns: those in ``left`` left-aligned, numbers right-aligned."""
    cells = [tuple(map(str, header))] + [tuple(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())


def _validate(args: argparse.Namespace) -> int:
    run = _read(args.run)
    if run is None:
        return 2
    problems = T.validate_run(run)
    for p in problems:
        print(p)
    for w in run.warnings:
        print(f"{w.file}:{w.line} warning: {w.message}")
    print(f"{len(problems)} problem(s), {len(run.warnings)} warning(s) in {run.path}")
    return 1 if problems else 0
