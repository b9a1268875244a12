"""Recorded payloads (PrismTrace 1.3): what chosen ranks received and sent (sans-IO).

``prism capture --record RANKS`` keeps, for each chosen rank, every tensor it
*received* from communication (collective outputs, receives; object
collectives are collectives of byte tensors, so they are covered) and the
digest of every tensor it *sent*. An emulation gives a sandbox rank exactly
what the real job gave it, and ``first_divergence`` finds the first call
where the sandbox sent something else than the capture recorded.

``PayloadBook`` decides, per call, what is recorded and builds the
``trace.Payload`` records; the shell appends the bytes it hands back to the
rank's side file in the order given (the book counts the offsets) and writes
the records (``prism.shell.runfolder.PayloadWriter``). Recording is bounded:
``RecordPlan.limit_bytes`` caps the bytes kept over all ranks, and the first
tensor that would pass it stops the recording of every rank (digests too),
with a message naming the rank, the step, the call and what to do; what was
recorded before stays valid. ``RecordPlan.steps`` records only some steps.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prism.core.trace.records import DTYPE_ITEMSIZE, Payload

__all__ = ["digest", "StepSet", "RecordPlan", "PayloadBook", "Divergence", "first_divergence", "index",
           "coll_ref", "p2p_ref", "DEFAULT_RECORD_LIMIT"]

#: The default cap on the bytes ``--record`` keeps (all ranks together).
DEFAULT_RECORD_LIMIT = 4 << 30


def digest(data: bytes | memoryview) -> str:
    """BLAKE2b-128 of ``data``, in hex: the digest of a payload record."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def coll_ref(gid: str, seq: int, role: str, i: int, n: int) -> str:
    """The ref of tensor ``i`` of ``n`` in role "in" or "out" of collective ``(gid, seq)``."""
    return f"coll:{gid}:{seq}:{role if n == 1 else f'{role}{i}'}"


def p2p_ref(src: int, dst: int, tag: int, pseq: int) -> str:
    return f"p2p:{src}:{dst}:{tag}:{pseq}"


def _range(part: str, *, open_end: bool) -> tuple[int, int | None]:
    """``"N"`` -> (N, N), ``"N-M"`` -> (N, M), with ``open_end`` ``"N-"`` -> (N, None);
    ValueError for anything else."""
    first, dash, last = part.partition("-")
    if dash and not last and open_end:
        return int(first), None
    return (int(first), int(last)) if dash else (int(first), int(first))


@dataclass(frozen=True, slots=True)
class StepSet:
    """Iterations to record: ``ranges`` of ``(first, last)`` (``last`` None: no end)."""

    ranges: tuple[tuple[int, int | None], ...]

    @classmethod
    def parse(cls, text: str) -> StepSet:
        """``"2"``, ``"0-3"``, ``"1,4-5"``, ``"3-"`` (3 on). Raises ValueError naming the bad part."""
        ranges: list[tuple[int, int | None]] = []
        for part in text.split(","):
            part = part.strip()
            try:
                a, b = _range(part, open_end=True)
            except ValueError:
                raise ValueError(f"steps {text!r}: {part!r} is not a step (N), a range (N-M) or an open range "
                                 "(N-); write e.g. 0-2,5") from None
            if a < 0 or (b is not None and b < a):
                raise ValueError(f"steps {text!r}: {part!r} must name steps >= 0, first <= last")
            ranges.append((a, b))
        return cls(tuple(ranges))

    def __contains__(self, step: object) -> bool:
        return isinstance(step, int) and any(a <= step and (b is None or step <= b) for a, b in self.ranges)

    def __str__(self) -> str:
        return ",".join(str(a) if a == b else f"{a}-" if b is None else f"{a}-{b}" for a, b in self.ranges)


@dataclass(frozen=True, slots=True)
class RecordPlan:
    """What ``--record`` keeps: ``ranks``, in ``steps`` (None: all), at most ``limit_bytes``."""

    ranks: frozenset[int]
    steps: StepSet | None = None
    limit_bytes: int = DEFAULT_RECORD_LIMIT

    @classmethod
    def parse_ranks(cls, text: str, world_size: int) -> frozenset[int]:
        """``"0,5"``, ``"0-3"`` or ``"all"``; raises ValueError naming what is wrong."""
        if text.strip() == "all":
            return frozenset(range(world_size))
        ranks: set[int] = set()
        for part in text.split(","):
            part = part.strip()
            try:
                a, b = _range(part, open_end=False)
            except ValueError:
                raise ValueError(f"ranks {text!r}: {part!r} is not a rank (N) or a range (N-M); write e.g. 0,5 "
                                 "or 0-3 or all") from None
            if not 0 <= a <= b < world_size:
                raise ValueError(f"ranks {text!r}: {part!r} is outside the world of {world_size} ranks "
                                 f"(ranks 0-{world_size - 1})")
            ranks.update(range(a, b + 1))
        return frozenset(ranks)


def _ref(key: tuple, role: str, i: int, n: int) -> str:
    """The ref of tensor ``i`` of ``n`` of call ``key`` (a p2p call moves one tensor)."""
    if key[0] == "coll":
        return coll_ref(key[1], key[2], role, i, n)
    return p2p_ref(*key[1:])


def _shape_of(shapes: Sequence[tuple[int, ...]], i: int, nbytes: int, dtype: str) -> tuple[int, ...]:
    """The declared shape of payload ``i`` when it fits its bytes, else a flat one."""
    size = DTYPE_ITEMSIZE.get(dtype, 1)
    if i < len(shapes) and math.prod(shapes[i]) * size == nbytes:
        return tuple(shapes[i])
    return (nbytes // size,)


class PayloadBook:
    """The sans-IO side of ``--record``: which calls to keep, and their records.

    The shell reports each call of a recorded rank when it is *made*
    (``called``: the rank's step then, and its sent tensors' digests) and
    when its data are *delivered* (``delivered``: the tensors the rank
    receives); ``delivered`` returns ``(record, bytes)`` pairs to append to
    the rank's side file ``file_of(rank)`` in that order. ``stopped`` holds
    the message once the cap stopped the recording.
    """

    def __init__(self, plan: RecordPlan, file_of: Mapping[int, str]) -> None:
        self.plan = plan
        self._file_of = dict(file_of)
        #: Bytes appended to each rank's side file so far.
        self.offsets: dict[int, int] = dict.fromkeys(plan.ranks, 0)
        self.total_bytes = 0
        #: Records per rank, in the order made.
        self.counts: dict[int, int] = dict.fromkeys(plan.ranks, 0)
        self.stopped = ""
        #: (rank, key) -> (step, dtype, out_shapes) of calls made and not yet delivered.
        self._pending: dict[tuple[int, tuple], tuple[int, str, tuple]] = {}
        self.steps_seen: set[int] = set()

    def records(self, rank: int) -> bool:
        return rank in self.plan.ranks and not self.stopped

    def _keeps(self, rank: int, step: int) -> bool:
        return self.records(rank) and (self.plan.steps is None or step in self.plan.steps)

    def called(self, rank: int, key: tuple, step: int, dtype: str, shapes: Sequence[tuple[int, ...]],
               sent: Sequence[bytes | memoryview],
               out_shapes: Sequence[tuple[int, ...]] | None = None) -> list[Payload]:
        """Rank ``rank`` made call ``key`` (``("coll", gid, seq)`` or ``("p2p", src, dst, tag, pseq)``)
        in ``step``, sending ``sent`` (declared ``shapes``); it will receive
        tensors of ``out_shapes`` (None: nothing, as a send). Returns the
        records of the sent tensors' digests."""
        if not self._keeps(rank, step):
            return []
        if out_shapes is not None:
            self._pending[(rank, key)] = (step, dtype, tuple(out_shapes))
        self.steps_seen.add(step)
        views = [memoryview(d).cast("B") for d in sent]
        out = [Payload(ref=_ref(key, "in", i, len(views)), role="sent", dtype=dtype,
                       shape=_shape_of(shapes, i, len(v), dtype), nbytes=len(v), digest=digest(v), step=step)
               for i, v in enumerate(views)]
        self.counts[rank] += len(out)
        return out

    def delivered(self, rank: int, key: tuple, received: Sequence[bytes | memoryview],
                  what: str) -> list[tuple[Payload, memoryview]]:
        """Call ``key`` of ``rank`` completed and hands it ``received``; ``what``
        names the call in the cap's message. Returns ``(record, bytes)`` pairs
        for the rank's side file, in order (nothing for a call not recorded)."""
        pending = self._pending.pop((rank, key), None)
        if pending is None or self.stopped:
            return []
        step, dtype, shapes = pending
        views = [memoryview(d).cast("B") for d in received]
        size = sum(len(v) for v in views)
        if self.total_bytes + size > self.plan.limit_bytes:
            self.stopped = (
                f"--record stopped at rank {rank}, step {step}, {what}: its {size:,} bytes would take the "
                f"recording past --record-limit {self.plan.limit_bytes:,} bytes ({self.total_bytes:,} kept so "
                "far); nothing later was recorded, for any rank (digests neither). What was recorded before "
                "is kept. Raise --record-limit, record fewer ranks, or fewer steps with --record-steps")
            self._pending.clear()
            return []
        out = []
        for i, v in enumerate(views):
            out.append((Payload(ref=_ref(key, "out", i, len(views)), role="recv", dtype=dtype,
                                shape=_shape_of(shapes, i, len(v), dtype), nbytes=len(v), digest=digest(v),
                                step=step, file=self._file_of[rank], offset=self.offsets[rank]), v))
            self.offsets[rank] += len(v)
        self.total_bytes += size
        self.counts[rank] += len(out)
        return out

    def summary(self) -> dict:
        """What was recorded, for ``payloads/summary.json`` and the capture's last words."""
        return {
            "ranks": sorted(self.plan.ranks),
            "steps": str(self.plan.steps) if self.plan.steps is not None else "all",
            "limit_bytes": self.plan.limit_bytes,
            "bytes": self.total_bytes,
            "records": {str(r): n for r, n in sorted(self.counts.items())},
            "steps_recorded": sorted(self.steps_seen),
            "stopped": self.stopped,
        }


def index(records: Iterable[Payload]) -> dict[tuple[str, str], Payload]:
    """``(role, ref) -> record`` for one rank's records."""
    return {(p.role, p.ref): p for p in records}


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first recorded tensor that a run did not reproduce."""

    rank: int
    expected: Payload
    #: The digest the run produced ("" when it never made that call).
    got: str

    def message(self) -> str:
        p = self.expected
        verb = "sent" if p.role == "sent" else "received"
        seen = f"digest {self.got}" if self.got else "nothing (the call was never made)"
        return (f"rank {self.rank} diverges from the capture at step {p.step}: it {verb} {p.ref} ({p.dtype} "
                f"{list(p.shape)}) with {seen}, the capture recorded digest {p.digest}")


def first_divergence(rank: int, recorded: Sequence[Payload], observed: Mapping[tuple[str, str], str],
                     *, role: str = "sent") -> Divergence | None:
    """The first of ``recorded`` (in recording order, records of ``role``) whose
    digest differs from ``observed[(role, ref)]`` or is missing from it; None
    when the run reproduced every one. Only steps ``observed`` reached count: a
    run that stopped early does not diverge where it never went."""
    reached = max((p.step for p in recorded if (p.role, p.ref) in observed), default=-1)
    for p in recorded:
        if p.role != role or p.step > reached:
            continue
        got = observed.get((p.role, p.ref), "")
        if got != p.digest:
            return Divergence(rank, p, got)
    return None
