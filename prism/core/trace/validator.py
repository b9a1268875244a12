"""PrismTrace's validator: every rule of ``docs/TRACE.md`` checked on a run in memory.

``validate_run`` takes a ``Run`` (as ``prism.shell.runfolder.read_run`` reads
it, or built in memory) and returns the ``Problem`` list; it reads nothing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from prism.core.trace.records import (
    COLLECTIVE_OPS,
    DTYPE_ITEMSIZE,
    P2P,
    P2P_OPS,
    REDUCE_OPS,
    REDUCING_OPS,
    ROOTED_OPS,
    Collective,
    Compute,
    Event,
    GroupCreated,
    Payload,
    RankEnd,
    RankStart,
    Run,
    TensorValue,
    group_id,
)

__all__ = ["Problem", "validate_run"]


@dataclass(frozen=True, slots=True)
class Problem:
    """A rule of PrismTrace that a run breaks (the writer's fault, or Prism's).

    ``line`` is 1-based, 0 for the whole file; ``rank`` is None for problems
    of the run as a whole; ``field`` is the offending field ("" if none).
    """

    file: str
    line: int
    rank: int | None
    field: str
    message: str

    def __str__(self) -> str:
        who = "-" if self.rank is None else str(self.rank)
        return f"{self.file}:{self.line} rank {who} {self.field or '-'}: {self.message}"


_COLL_REF = re.compile(r"coll:([^:]+):(\d+):((?:in|out)\d*)")
_P2P_REF = re.compile(r"p2p:(\d+):(\d+):(-?\d+):(\d+)")


def _rank_file(run: Run, rank: int) -> str:
    # The shell names every rank's file from the run directory's layout; a
    # run built in memory without names has only its ranks to go by.
    return run.rank_files.get(rank) or f"rank {rank}"


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


class _RankChecker:
    """The per-rank rules; one instance per rank file."""

    def __init__(self, run: Run, rank: int, out: list[Problem]) -> None:
        self.run, self.rank, self.out = run, rank, out
        self.file = _rank_file(run, rank)
        self.ws = run.manifest.world_size
        self.groups: dict[str, GroupCreated] = {}
        self.seqs: dict[str, dict[int, int]] = {}  # gid -> seq -> line
        self.pseqs: dict[tuple[str, int, int], dict[int, int]] = {}  # (op, peer, tag) -> pseq -> line
        self.last_step: tuple[int, int] | None = None  # (step, line)

    def bad(self, line: int, field: str, message: str) -> None:
        self.out.append(Problem(self.file, line, self.rank, field, message))

    def check(self, events: list[Event], lines: list[int]) -> None:
        if not 0 <= self.rank < self.ws:
            self.bad(0, "rank", f"rank file for rank {self.rank}, outside the world of {self.ws} ranks")
        if not events:
            self.bad(1, "k", "first record must be rank_start; the file has no records")
        ended_at: int | None = None
        for i, ev in enumerate(events):
            line = lines[i] if i < len(lines) else i + 1
            if ended_at is not None:
                self.bad(line, "k", f"{ev.KIND} record after rank_end (line {ended_at}); rank_end must be last")
            if i == 0:
                self.check_first(ev, line)
            elif type(ev) is RankStart:
                self.bad(line, "k", "rank_start again; it must be the first record only")
            if type(ev) is RankEnd and ended_at is None:
                ended_at = line
            step = getattr(ev, "step", None)
            if step is not None:
                self.check_step(step, line)
            method = self._BY_KIND.get(type(ev))
            if method is not None:
                method(self, ev, line)
        self.check_contiguous()

    def check_first(self, ev: Event, line: int) -> None:
        if type(ev) is not RankStart:
            self.bad(line, "k", f"first record must be rank_start, got {ev.KIND}")
            return
        if ev.rank != self.rank:
            self.bad(line, "rank", f"rank_start says rank {ev.rank} in the file of rank {self.rank}")
        if ev.world_size != self.ws:
            self.bad(line, "world_size", f"rank_start says world_size {ev.world_size}, the manifest {self.ws}")

    def check_step(self, step: int, line: int) -> None:
        if step < 0:
            self.bad(line, "step", f"step {step} is negative")
        if self.last_step is not None and step < self.last_step[0]:
            self.bad(
                line, "step", f"step went back from {self.last_step[0]} (line {self.last_step[1]}) to {step}"
            )
        if self.last_step is None or step > self.last_step[0]:
            self.last_step = (step, line)

    def check_times(self, ev: Collective | P2P, line: int, what: str) -> None:
        if not ev.issue_ns <= ev.wait_ns <= ev.end_ns:
            self.bad(
                line,
                "issue_ns" if ev.issue_ns > ev.wait_ns else "wait_ns",
                f"{what}: times must satisfy issue_ns <= wait_ns <= end_ns, got "
                f"{ev.issue_ns}, {ev.wait_ns}, {ev.end_ns}",
            )

    def check_dtype(self, dtype: str, line: int, what: str) -> int | None:
        size = DTYPE_ITEMSIZE.get(dtype)
        if size is None:
            self.bad(line, "dtype", f"{what}: unknown dtype {dtype!r} (known: {', '.join(DTYPE_ITEMSIZE)})")
        return size

    def member_group(self, gid: str, line: int, what: str) -> GroupCreated | None:
        g = self.groups.get(gid)
        if g is None:
            self.bad(line, "gid", f"{what}: group {gid!r} was not declared by a group record before this line")
            return None
        if self.rank not in g.ranks:
            self.bad(line, "gid", f"{what}: rank {self.rank} is not a member of {gid} (ranks {list(g.ranks)})")
        return g

    def check_group(self, ev: GroupCreated, line: int) -> None:
        try:
            expected = group_id(ev.index, ev.ranks)
        except ValueError as e:
            self.bad(line, "ranks", f"group {ev.gid!r}: {e}")
            return
        if ev.gid != expected:
            self.bad(
                line, "gid", f"group gid {ev.gid!r} should be {expected!r} (index {ev.index}, ranks {list(ev.ranks)})"
            )
        if ev.index == 0 and ev.ranks != tuple(range(self.ws)):
            self.bad(line, "ranks", f"world group (index 0) must hold ranks 0..{self.ws - 1}, got {list(ev.ranks)}")
        outside = [r for r in ev.ranks if r >= self.ws]
        if outside or len(set(ev.ranks)) != len(ev.ranks):
            self.bad(
                line, "ranks", f"group {ev.gid}: ranks {list(ev.ranks)} repeat or fall outside the world of {self.ws}"
            )
        old = self.groups.get(ev.gid)
        if old is not None and (old.ranks, old.index) != (ev.ranks, ev.index):
            self.bad(line, "gid", f"group {ev.gid} declared again with other members or index")
        self.groups.setdefault(ev.gid, ev)

    def check_compute(self, ev: Compute, line: int) -> None:
        if ev.start_ns > ev.end_ns:
            self.bad(line, "end_ns", f"compute ends ({ev.end_ns}) before it starts ({ev.start_ns})")

    def check_coll(self, ev: Collective, line: int) -> None:
        what = f"{ev.op} on {ev.gid} seq {ev.seq}"
        self.seqs.setdefault(ev.gid, {})
        if ev.seq < 0:
            self.bad(line, "seq", f"{what}: seq must be >= 0")
        elif ev.seq in self.seqs[ev.gid]:
            self.bad(line, "seq", f"{what}: seq {ev.seq} already used on line {self.seqs[ev.gid][ev.seq]}")
        else:
            self.seqs[ev.gid][ev.seq] = line
        self.check_times(ev, line, what)
        g = self.member_group(ev.gid, line, what)
        if ev.op not in COLLECTIVE_OPS:
            self.bad(line, "op", f"{what}: unknown collective op {ev.op!r} (known: {', '.join(COLLECTIVE_OPS)})")
            return
        if ev.op in REDUCING_OPS:
            if ev.reduce_op not in REDUCE_OPS:
                allowed = ", ".join(REDUCE_OPS)
                self.bad(line, "reduce_op", f"{what}: reduce_op must be one of {allowed}, got {ev.reduce_op!r}")
        elif ev.reduce_op != "":
            self.bad(line, "reduce_op", f"{what}: a non-reducing op must have reduce_op \"\", got {ev.reduce_op!r}")
        if ev.premul is not None and ev.reduce_op != "PREMUL_SUM":
            self.bad(line, "premul", f"{what}: premul {ev.premul} is only meaningful with PREMUL_SUM")
        if any(d < 0 for s in (*ev.in_shapes, *ev.out_shapes) for d in s):
            self.bad(line, "in_shapes", f"{what}: negative dimension in shapes {ev.in_shapes} -> {ev.out_shapes}")
        size = self.check_dtype(ev.dtype, line, what)
        if ev.bytes < 0:
            self.bad(line, "bytes", f"{what}: bytes must be >= 0, got {ev.bytes}")
        elif size is not None:
            expected = size * sum(_numel(s) for s in ev.in_shapes)
            if ev.bytes != expected:
                self.bad(
                    line,
                    "bytes",
                    f"{what}: bytes {ev.bytes} != {expected}, the size of in_shapes {list(ev.in_shapes)} in {ev.dtype}",
                )
        if g is None:
            return
        n = len(g.ranks)
        if ev.op in ROOTED_OPS:
            if not 0 <= ev.root < n:
                self.bad(line, "root", f"{what}: root {ev.root} is not a group rank of {ev.gid} (size {n})")
        elif ev.root != -1:
            self.bad(line, "root", f"{what}: root must be -1 for {ev.op}, got {ev.root}")
        if ev.op == "all_to_all_single":
            self.check_splits(line, what, n, "in_splits", ev.in_splits, ev.in_shapes)
            self.check_splits(line, what, n, "out_splits", ev.out_splits, ev.out_shapes)
        elif ev.op != "all_to_all" and (ev.in_splits or ev.out_splits):
            self.bad(
                line, "in_splits", f"{what}: only all_to_all ops have splits, got {ev.in_splits} / {ev.out_splits}"
            )

    def check_splits(
        self, line: int, what: str, n: int, name: str, splits: tuple[int, ...], shapes: tuple[tuple[int, ...], ...]
    ) -> None:
        if len(shapes) != 1 or not shapes[0]:
            self.bad(line, name, f"{what}: all_to_all_single needs one tensor of rank >= 1, got shapes {list(shapes)}")
            return
        rows = shapes[0][0]
        if not splits:
            if rows % n:
                self.bad(line, name, f"{what}: no {name}, so dim 0 ({rows}) must divide evenly among {n} ranks")
        elif len(splits) != n or any(x < 0 for x in splits) or sum(splits) != rows:
            self.bad(
                line, name, f"{what}: {name} {list(splits)} must be {n} sizes >= 0 summing to dim 0 of {list(shapes[0])}"
            )

    def check_p2p(self, ev: P2P, line: int) -> None:
        what = f"{ev.op} with peer {ev.peer} tag {ev.tag} pseq {ev.pseq}"
        key = (ev.op, ev.peer, ev.tag)
        seen = self.pseqs.setdefault(key, {})
        if ev.pseq < 0:
            self.bad(line, "pseq", f"{what}: pseq must be >= 0")
        elif ev.pseq in seen:
            self.bad(line, "pseq", f"{what}: pseq {ev.pseq} already used on line {seen[ev.pseq]}")
        else:
            seen[ev.pseq] = line
        if ev.op not in P2P_OPS:
            self.bad(line, "op", f"{what}: p2p op must be one of {', '.join(P2P_OPS)}, got {ev.op!r}")
        self.check_times(ev, line, what)
        g = self.member_group(ev.gid, line, what)
        if g is not None and (ev.peer == self.rank or ev.peer not in g.ranks):
            self.bad(line, "peer", f"{what}: peer {ev.peer} must be another member of {ev.gid} (ranks {list(g.ranks)})")
        size = self.check_dtype(ev.dtype, line, what)
        if ev.bytes < 0 or (size is not None and ev.bytes != size * _numel(ev.shape)):
            self.bad(line, "bytes", f"{what}: bytes {ev.bytes} does not match shape {list(ev.shape)} in {ev.dtype}")

    def check_value(self, ev: TensorValue, line: int) -> None:
        what = f"value {ev.ref}"
        if not (_COLL_REF.fullmatch(ev.ref) or _P2P_REF.fullmatch(ev.ref)):
            self.bad(line, "ref", f"{what}: ref must be coll:GID:SEQ:ROLE or p2p:SRC:DST:TAG:PSEQ")
        size = self.check_dtype(ev.dtype, line, what)
        if size is not None and len(ev.data) != size * _numel(ev.shape):
            need = size * _numel(ev.shape)
            got = len(ev.data)
            self.bad(line, "data", f"{what}: {got} bytes of data, but shape {list(ev.shape)} in {ev.dtype} needs {need}")
        limit = self.run.manifest.small_tensor_limit
        if len(ev.data) > limit:
            self.bad(line, "data", f"{what}: {len(ev.data)} bytes exceed the manifest's small_tensor_limit {limit}")

    _BY_KIND: ClassVar[dict[type, Callable[..., None]]] = {
        GroupCreated: check_group,
        Compute: check_compute,
        Collective: check_coll,
        P2P: check_p2p,
        TensorValue: check_value,
    }

    def check_contiguous(self) -> None:
        for gid, seqs in self.seqs.items():
            self.check_gaps(seqs, "seq", f"collectives on {gid}")
        for (op, peer, tag), pseqs in self.pseqs.items():
            self.check_gaps(pseqs, "pseq", f"{op}s with peer {peer} tag {tag}")

    def check_gaps(self, seqs: dict[int, int], field: str, what: str) -> None:
        for expected, got in enumerate(sorted(seqs)):
            if got != expected:
                self.bad(
                    seqs[got], field, f"{what}: {field} {expected} is missing (numbers must run 0, 1, 2, ...; next is {got})"
                )
                return


def _check_payloads(run: Run, rank: int, records: list[Payload], out: list[Problem]) -> None:
    """A recorded rank's payload records: legal fields, bytes laid end to end
    in its data file, and every ref naming a call of the rank's trace (the
    trace may stop earlier than the records when the rank died mid-call)."""
    file = run.payload_files.get(rank) or f"payloads of rank {rank}"
    events = run.ranks.get(rank, [])
    colls = {(ev.gid, ev.seq): ev for ev in events if type(ev) is Collective}
    p2ps = {(rank, ev.peer, ev.tag, ev.pseq) if ev.op == "send" else (ev.peer, rank, ev.tag, ev.pseq): ev
            for ev in events if type(ev) is P2P}
    ended = any(type(ev) is RankEnd and ev.status == "ok" for ev in events)
    end = 0
    for i, p in enumerate(records):
        line = i + 1

        def bad(field: str, message: str) -> None:
            out.append(Problem(file, line, rank, field, f"payload {p.ref}: {message}"))

        if p.role not in ("recv", "sent"):
            bad("role", f"role must be recv or sent, got {p.role!r}")
            continue
        size = DTYPE_ITEMSIZE.get(p.dtype)
        if size is None:
            bad("dtype", f"unknown dtype {p.dtype!r}")
        elif p.nbytes != size * _numel(p.shape):
            bad("nbytes", f"nbytes {p.nbytes} does not match shape {list(p.shape)} in {p.dtype}")
        if not re.fullmatch(r"[0-9a-f]{32}", p.digest):
            bad("digest", f"digest must be 32 hex digits (BLAKE2b-128), got {p.digest!r}")
        if p.role == "recv":
            if p.offset != end:
                bad("offset", f"offset {p.offset}, but the bytes before it end at {end}: the data file's tensors "
                              "lie end to end in record order")
            end = p.offset + p.nbytes
        elif p.file or p.offset != -1:
            bad("file", "a sent payload keeps only its digest: file must be \"\" and offset -1")
        m = _COLL_REF.fullmatch(p.ref)
        q = _P2P_REF.fullmatch(p.ref)
        if m:
            found = (m.group(1), int(m.group(2))) in colls
        elif q:
            src, dst, tag, pseq = (int(x) for x in q.groups())
            found = (src, dst, tag, pseq) in p2ps
            if rank not in (src, dst) or (p.role == "sent") != (src == rank):
                bad("ref", f"rank {rank} is not the {'sender' if p.role == 'sent' else 'receiver'} of this p2p")
        else:
            bad("ref", "ref must be coll:GID:SEQ:ROLE or p2p:SRC:DST:TAG:PSEQ")
            continue
        if not found and ended:
            bad("ref", "names no call in the rank's trace")


def validate_run(run: Run) -> list[Problem]:
    """Check every rule of PrismTrace on a run; an empty list means valid.

    Per rank: the first record is ``rank_start`` for the file's rank; nothing
    follows ``rank_end``; ``issue_ns <= wait_ns <= end_ns`` and compute
    ``start_ns <= end_ns``; collective fields are legal (op, reduce_op, root,
    premul, bytes against in_shapes and dtype, all_to_all_single splits
    against shapes and group size); per-group ``seq`` and per-(op, peer, tag)
    ``pseq`` run 0, 1, 2, ... without gaps or repeats; every gid used was
    declared earlier by a group record (with the id ``group_id`` gives) and
    holds the rank; values' sizes match dtype and shape and fit the small-
    tensor limit; steps never decrease. Across ranks: one gid means the same
    members and index everywhere; every rank of the world has a file.
    Payload records (1.3): legal fields, bytes end to end, refs naming calls
    of the rank's trace. Collective matching across ranks is the graph's job,
    not this one's.
    """
    out: list[Problem] = []
    m = run.manifest
    mfile = run.manifest_file or "manifest"
    if m.world_size < 1:
        out.append(Problem(mfile, 0, None, "world_size", f"world_size must be >= 1, got {m.world_size}"))
    if m.small_tensor_limit < 0:
        out.append(Problem(mfile, 0, None, "small_tensor_limit", f"must be >= 0, got {m.small_tensor_limit}"))
    for r in range(m.world_size):
        if r not in run.ranks:
            missing = f"no rank file for rank {r} (world_size {m.world_size})"
            out.append(Problem(_rank_file(run, r), 0, r, "", missing))
    for rank, records in run.payloads.items():
        _check_payloads(run, rank, records, out)
    seen: dict[str, tuple[GroupCreated, int, str, int]] = {}
    for rank, events in run.ranks.items():
        checker = _RankChecker(run, rank, out)
        lines = run.lines.get(rank, [])
        checker.check(events, lines)
        for i, ev in enumerate(events):
            if type(ev) is not GroupCreated:
                continue
            line = lines[i] if i < len(lines) else i + 1
            first = seen.setdefault(ev.gid, (ev, rank, checker.file, line))
            g0, r0, f0, l0 = first
            if (g0.ranks, g0.index) != (ev.ranks, ev.index):
                out.append(
                    Problem(
                        checker.file,
                        line,
                        rank,
                        "ranks",
                        f"group {ev.gid} has index {ev.index} ranks {list(ev.ranks)} here but index {g0.index} "
                        f"ranks {list(g0.ranks)} on rank {r0} ({f0}:{l0})",
                    )
                )
    return out
