"""Assertions on a recorded run: who called what, in which order, with
which sizes, and how the capture ended.

``Trace`` wraps a run folder as read back (``prism.shell.runfolder.read_run``)
and lists its communication calls (``Call``: collectives and point-to-point,
in each rank's order). The ``assert_*`` helpers raise ``AssertionError``
with both sides written out, so a failing test says what differed.

A call pattern (in ``assert_calls``, ``assert_order``) is an op name
(``"all_reduce"``), or a tuple ``(op, group)`` or ``(op, group, nbytes)``:
``group`` is a gid (``"world"``), a ``Group`` from ``new_group`` or a tuple of
member ranks; ``nbytes`` is what the rank contributed (the trace's
``bytes``: for ``all_reduce`` of 1,024 float32, 4,096).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prism.core import trace as T
from prism.core.trace.validator import Problem, validate_run
from prism.shell.coordinator import CaptureResult

__all__ = ["Call", "Trace", "assert_calls", "assert_failed", "assert_ok", "assert_order"]


@dataclass(frozen=True, slots=True)
class Call:
    """One rank's communication call as its trace records it. ``peer`` and
    ``tag`` are set for send/recv (-1 otherwise); ``seq`` is the group
    sequence (a p2p call's ``pseq``)."""

    rank: int
    op: str
    group: str
    seq: int
    dtype: str
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    nbytes: int
    step: int
    issue_ns: int
    end_ns: int
    root: int = -1
    reduce_op: str = ""
    peer: int = -1
    tag: int = -1

    @property
    def shape(self) -> tuple[int, ...]:
        """The first input's shape (() for a barrier)."""
        return self.in_shapes[0] if self.in_shapes else ()

    def key(self, width: int = 3) -> tuple:
        """``(op, group, nbytes)`` cut to ``width`` (what patterns compare)."""
        return (self.op, self.group, self.nbytes)[:width]


def _gid(group: Any, trace: Trace | None = None) -> str:
    if isinstance(group, str):
        return group
    gid = getattr(group, "gid", None)
    if isinstance(gid, str):
        return gid
    if isinstance(group, (tuple, list)) and trace is not None:
        return trace.gid_of(tuple(group))
    raise ValueError(f"a group is a gid, a Group or a tuple of ranks, got {group!r}")


def _call(rank: int, ev: T.Event) -> Call | None:
    if isinstance(ev, T.Collective):
        return Call(rank, ev.op, ev.gid, ev.seq, ev.dtype, ev.in_shapes, ev.out_shapes, ev.bytes, ev.step,
                    ev.issue_ns, ev.end_ns, ev.root, ev.reduce_op)
    if isinstance(ev, T.P2P):
        return Call(rank, ev.op, ev.gid, ev.pseq, ev.dtype, (ev.shape,), (ev.shape,), ev.bytes, ev.step,
                    ev.issue_ns, ev.end_ns, peer=ev.peer, tag=ev.tag)
    return None


class Trace:
    """A run's trace, for assertions (see the module docstring)."""

    def __init__(self, run: T.Run) -> None:
        self.run = run
        self._calls = {r: [c for ev in evs if (c := _call(r, ev)) is not None] for r, evs in run.ranks.items()}

    @property
    def ranks(self) -> list[int]:
        """The ranks that have a trace file."""
        return sorted(self.run.ranks)

    def gid_of(self, ranks: tuple[int, ...]) -> str:
        """The gid of the group of these member ranks (``ValueError`` if none or several)."""
        gids = {ev.gid for evs in self.run.ranks.values() for ev in evs
                if isinstance(ev, T.GroupCreated) and ev.ranks == ranks}
        if len(gids) != 1:
            raise ValueError(f"{len(gids)} groups of ranks {list(ranks)} in the trace ({sorted(gids)}); "
                             "pass the Group or its gid")
        return gids.pop()

    def calls(self, rank: int | None = None, group: Any = None, op: str | None = None) -> list[Call]:
        """The calls of ``rank`` (None: every rank, ordered by issue time,
        then rank) on ``group``, of ``op``; each rank's in its own order."""
        gid = None if group is None else _gid(group, self)
        ranks = self.ranks if rank is None else [rank]
        out = [c for r in ranks for c in self._calls.get(r, [])
               if (gid is None or c.group == gid) and (op is None or c.op == op)]
        if rank is None:
            out.sort(key=lambda c: (c.issue_ns, c.rank))
        return out

    def end(self, rank: int) -> T.RankEnd | None:
        """The rank's ``rank_end`` record (status "ok", "error", "killed", ...)."""
        evs = self.run.ranks.get(rank, [])
        return evs[-1] if evs and isinstance(evs[-1], T.RankEnd) else None

    def steps(self, rank: int) -> int:
        """How many iterations the rank finished (``step()`` calls)."""
        return sum(isinstance(ev, T.Iteration) for ev in self.run.ranks.get(rank, []))

    def problems(self) -> list[Problem]:
        """What PrismTrace's validator finds wrong with the run ([] when valid)."""
        return validate_run(self.run)


def _pattern(p: Any, trace: Trace) -> tuple:
    if isinstance(p, str):
        return (p,)
    if isinstance(p, tuple) and 1 <= len(p) <= 3 and isinstance(p[0], str):
        if len(p) == 1:
            return p
        return (p[0], _gid(p[1], trace), *p[2:])
    raise ValueError(f"a call pattern is an op, (op, group) or (op, group, nbytes); got {p!r}")


def _ranks(trace: Trace, rank: int | Iterable[int] | None) -> list[int]:
    if rank is None:
        return trace.ranks
    return [rank] if isinstance(rank, int) else list(rank)


def assert_calls(trace: Trace, rank: int | Iterable[int] | None, expected: Sequence[Any], *,
                 group: Any = None) -> None:
    """Rank ``rank``'s calls (each of several ranks', None: every rank's), on
    ``group`` if given, are exactly ``expected`` (patterns, in order)."""
    want = [_pattern(p, trace) for p in expected]
    for r in _ranks(trace, rank):
        got = [c.key(len(w)) for c, w in zip(trace.calls(r, group=group), want)]
        full = [c.key(max((len(w) for w in want), default=3)) for c in trace.calls(r, group=group)]
        if len(full) != len(want) or got != want:
            at = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(full), len(want)))
            raise AssertionError(f"rank {r}'s calls differ from the expected at call {at}:\n"
                                 f"  expected: {want}\n  actual:   {full}")


def assert_order(trace: Trace, *patterns: Any, rank: int | Iterable[int] | None = None) -> None:
    """On each rank (or ``rank``), the first call matching each pattern
    comes after the first matching the one before it (and all occur)."""
    pats = [_pattern(p, trace) for p in patterns]
    if len(pats) < 2:
        raise ValueError("assert_order needs at least two patterns")
    for r in _ranks(trace, rank):
        calls = trace.calls(r)
        at = []
        for p in pats:
            i = next((i for i, c in enumerate(calls) if c.key(len(p)) == p), None)
            if i is None:
                raise AssertionError(f"rank {r} made no call {p}; its calls: {[c.key() for c in calls]}")
            at.append(i)
        for (p, i), (q, j) in zip(zip(pats, at), zip(pats[1:], at[1:])):
            if i >= j:
                raise AssertionError(f"rank {r} called {q} (call {j}) before {p} (call {i}); its calls: "
                                     f"{[c.key() for c in calls]}")


def assert_ok(result: CaptureResult) -> CaptureResult:
    """The capture ended well."""
    if result.status != "ok":
        raise AssertionError(f"the capture ended {result.status!r}, not ok: {result.message}")
    return result


_KINDS = {"mismatch": "mismatch", "deadlock": "deadlock", "died": "rank_failed", "error": "rank_failed",
          "oom": "oom", "invalid": "invalid"}


def assert_failed(result: CaptureResult, kind: str, *, rank: int | None = None,
                  match: str | None = None) -> CaptureResult:
    """The capture failed as ``kind``: "mismatch", "deadlock", "died" (the
    rank's process died without a goodbye), "error" (its script raised),
    "oom" or "invalid". ``rank``: the report names it (a dead or failed rank
    is among ``failed_ranks``). ``match``: a regular expression the message
    contains."""
    status = _KINDS.get(kind)
    if status is None:
        raise ValueError(f"assert_failed: kind must be one of {sorted(_KINDS)}, got {kind!r}")
    if result.status != status:
        raise AssertionError(f"the capture ended {result.status!r}, not {status!r} ({kind}): {result.message}")
    if rank is not None:
        if not re.search(rf"\brank {rank}\b", result.message):
            raise AssertionError(f"the {kind} report does not name rank {rank}: {result.message}")
        if kind in ("died", "error", "oom"):
            why = result.failed_ranks.get(rank)
            if why is None:
                raise AssertionError(f"rank {rank} is not among the failed ranks {sorted(result.failed_ranks)}")
            died = "killed by" in why or "without saying goodbye" in why
            if died != (kind == "died"):
                raise AssertionError(f"rank {rank} failed, but not as {kind!r}: {why}")
    if match is not None and not re.search(match, result.message):
        raise AssertionError(f"the {kind} report does not match {match!r}: {result.message}")
    return result
