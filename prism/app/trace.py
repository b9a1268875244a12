"""Inspect a PrismTrace run: read it, summarise it, validate it.

``read(path)`` reads a run directory (``UsageError`` when it cannot be read
as a run at all); ``summary_text(run)`` is what ``prism trace summary``
prints; ``validate(run)`` is every problem and warning of the run
(``prism trace validate``).
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from prism.app.errors import UsageError
from prism.core import trace as T
from prism.shell import runfolder

__all__ = ["read", "summary_text", "validate", "Validation", "compact_ranks"]


def read(path: str | os.PathLike[str]) -> T.Run:
    """The run at ``path``; raises ``UsageError`` when it is no readable run."""
    try:
        return runfolder.read_run(path)
    except (T.TraceFormatError, OSError) as e:
        raise UsageError(f"cannot read run {path}: {e}") from None


@dataclass(frozen=True)
class Validation:
    run: T.Run
    problems: list[T.Problem]

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        """One line per problem and warning (``file:line rank field: problem``), then a count."""
        lines = [str(p) for p in self.problems]
        lines += [f"{w.file}:{w.line} warning: {w.message}" for w in self.run.warnings]
        lines.append(f"{len(self.problems)} problem(s), {len(self.run.warnings)} warning(s) in {self.run.path}")
        return "\n".join(lines)


def validate(run: T.Run) -> Validation:
    return Validation(run, T.validate_run(run))


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


def summary_text(run: T.Run) -> str:
    """Per-rank and per-group counts of ``run`` (``prism trace summary``)."""
    out: list[str] = []
    m = run.manifest
    out.append(
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
    out += _table(header, rows, left=frozenset({0, 7}))
    out.append("")
    out.append("collectives per group (instances by op):")
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
    out += _table(gheader, grows, left=frozenset({0, 3, 5}))
    out += _gpu_timing(run)
    out += _cpu_share(run)
    if run.payloads:
        out.append("")
        out.append("recorded payloads (--record):")
        prow = []
        for rank, records in sorted(run.payloads.items()):
            recv = [p for p in records if p.role == "recv"]
            steps = sorted({p.step for p in records})
            prow.append((rank, len(recv), sum(p.nbytes for p in recv), len(records) - len(recv),
                         compact_ranks(steps) or "-"))
        out += _table(("rank", "received", "bytes", "sent digests", "steps"), prow, left=frozenset({4}))
    ooms = [(rank, ev.message.split("\n\n", 1)[0]) for rank, events in run.ranks.items() for ev in events
            if type(ev) is T.RankEnd and ev.status == "oom"]
    if ooms:
        out.append("")
        out.append("out of GPU memory:")
        out += [f"  {text}" for _, text in ooms]
    if run.warnings:
        out.append("")
        out.append(f"{len(run.warnings)} warning(s):")
        for w in run.warnings:
            out.append(f"  {w}")
    return "\n".join(out)


def _cpu_share(run: T.Run) -> list[str]:
    """CPU ranks (PrismTrace 1.4): how much of their compute segments' wall
    time the main thread spent on a CPU, and how many segments ran clean
    (``prism.core.calibration.cpu_share``): a low share means the capture's
    timing is polluted (ranks descheduled by context switching or waiting for
    the GIL) and ``prism calibrate`` has something to fix."""
    from prism.core.calibration import CLEAN_SHARE, cpu_share

    got = cpu_share(run.ranks)
    if got is None:
        return []
    share, worst, worst_rank, n, clean = got
    return ["", f"compute segments on a CPU (PrismTrace 1.4): the main threads used {share:.1%} of their wall "
                f"time (lowest: rank {worst_rank}, {worst:.1%}); {clean:,} of {n:,} segments clean (on a CPU for "
                f"{CLEAN_SHARE:.0%} or more: `prism calibrate` keeps those)"]


def _gpu_timing(run: T.Run) -> list[str]:
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
        return []
    return ["", "GPU timing (two clocks; ms per step, step 0 left out; docs/GPU-TIMING.md):"] + _table(("rank", "wall", "cpu", "free", "gpu (calibrated)", "segments", "joins", "cold us",
            "calibration steps", "discarded"), rows, left=frozenset({8}))


def _table(header: tuple[str, ...], rows: list[tuple[object, ...]], left: frozenset[int]) -> list[str]:
    """Aligned columns: those in ``left`` left-aligned, numbers right-aligned."""
    cells = [tuple(map(str, header))] + [tuple(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
            for row in cells]
