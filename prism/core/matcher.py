"""Matching collective and point-to-point calls across ranks (sans-IO).

The phase-1 coordinator feeds a ``Matcher`` what the ranks say and forwards
what it returns. The matcher pairs the members of each collective instance
``(gid, seq)``, computes the outputs with ``collectives.run_collective`` when
the last member arrives, pairs each send with its receive by
``(src, dst, tag, pseq)``, notices the script's mistakes as early as they can
be seen (a member calling a different collective, a receive of the wrong
shape, a group with different members on different ranks), knows what each
rank waits for, and writes the rank-by-rank report of a deadlock.

Every event method takes the protocol message (or any object with the same
fields) and ``now`` (integer ns on the coordinator's clock) and returns a list
of outcomes for the shell to deliver:

``CollectiveDone``
    send ``protocol.CollectiveResult(gid, seq, payloads=outputs[r])`` to every
    rank ``r`` in ``outputs`` (all members; an empty tuple means "leave your
    tensors as they are", see ``collectives``; skip members that have died
    or finished since they arrived).
``P2PDone``
    send ``protocol.P2PData(src, dst, tag, pseq, payloads)`` to ``dst``.
``Failure`` (``CollectiveMismatch``, ``P2PMismatch``, ``GroupMismatch``,
``InvalidCall``, ``PeerFailed``, ``NeverCompletes``)
    send ``protocol.Error(code, message, rank=r, gid, seq)`` to each ``r`` in
    ``ranks``. A failed collective instance stays failed: members arriving
    later get the same failure at once. Codes: "mismatch" (the script calls
    different things on different ranks), "invalid" (a call torch would
    refuse, or a backend bug the message names), "peer_failed" (a rank it
    needs died), "deadlock" (a rank it needs finished without taking part).

Public API
----------
``Matcher(world_size)`` with
    ``group_create(msg, now) -> list[Outcome]``  (``protocol.GroupCreate``)
    ``arrive(msg, now) -> list[Outcome]``        (``protocol.CollectiveArrive``)
    ``send(msg, now) -> list[Outcome]``          (``protocol.Send``)
    ``recv_post(msg, now) -> list[Outcome]``     (``protocol.RecvPost``)
    ``wait(msg, now) -> list[Outcome]``          (``protocol.Wait``)
    ``rank_finished(rank, now) -> list[Outcome]``
    ``rank_failed(rank, reason, now) -> list[Outcome]``
    ``deadlock_report(live_ranks, now, blocked=()) -> DeadlockReport | None``
    ``waiting_for(rank) -> str | None``, ``groups``, ``last_progress_ns``
``wait_key_coll(gid, seq)``, ``wait_key_p2p(src, dst, tag, pseq)``: the
``Wait.what`` strings. ``DEFAULT_DEADLOCK_QUIET_NS`` (30 s).

What a rank waits for: a blocking collective (``async_op=False``) from its
arrival; anything else (async collectives, receives, blocking ``recv``
included) from the ``protocol.Wait`` that names it, until it completes.
``Wait.what`` may be ``wait_key_coll``/``wait_key_p2p`` or the rank backend's
descriptions ("all_reduce on group G (seq 3)", "recv from rank 4 tag 0 (pseq
1)"); other texts are ignored. Ranks the shell knows are blocked without such
a Wait (the backend's stall monitor releasing the slot) are passed to
``deadlock_report`` as ``blocked``, e.g. the ranks whose
``scheduler.Scheduler.state`` is ``RankState.BLOCKED``. Sends are eager (the payload
travels with the send), so a sender never waits. ``deadlock_report`` returns
a report when every live rank waits; the shell calls it after a quiet period
(``now - last_progress_ns``, default 30 s, is the shell's choice).
"""

from __future__ import annotations

import math

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from . import collectives as C
from .protocol import Buffer

#: How long nothing may happen, while every live rank waits, before the shell
#: reports a deadlock (``--quiet-period``'s default; docs/DESIGN.md, "Failures").
DEFAULT_DEADLOCK_QUIET_NS = 30 * 10**9

# --- outcomes ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CollectiveDone:
    """Collective instance ``(gid, seq)`` completed; ``outputs[rank]`` are the
    payloads of that member's ``CollectiveResult``."""

    gid: str
    seq: int
    op: str
    #: Global ranks of the members in group-rank order.
    ranks: tuple[int, ...]
    outputs: Mapping[int, tuple[bytes, ...]] = field(compare=False)


@dataclass(frozen=True, slots=True)
class P2PDone:
    """A send met its receive: deliver ``payloads`` to ``dst``."""

    src: int
    dst: int
    tag: int
    pseq: int
    gid: str
    payloads: tuple[Buffer, ...] = field(compare=False)


@dataclass(frozen=True, slots=True)
class Failure:
    """Something that can never complete; tell each of ``ranks``.

    ``code`` is the ``protocol.Error`` code to send."""

    CODE: ClassVar[str] = "internal"
    message: str
    ranks: tuple[int, ...]
    gid: str = ""
    seq: int = -1

    @property
    def code(self) -> str:
        return self.CODE


@dataclass(frozen=True, slots=True)
class CollectiveMismatch(Failure):
    """Members called different collectives at the same ``(gid, seq)`` (the
    user script's fault)."""

    CODE: ClassVar[str] = "mismatch"


@dataclass(frozen=True, slots=True)
class P2PMismatch(Failure):
    """A send and its receive disagree on dtype or shape (the script's fault)."""

    CODE: ClassVar[str] = "mismatch"


@dataclass(frozen=True, slots=True)
class GroupMismatch(Failure):
    """One group id with different members on different ranks (the script's fault)."""

    CODE: ClassVar[str] = "mismatch"


@dataclass(frozen=True, slots=True)
class InvalidCall(Failure):
    """A call torch would reject (the script's fault) or that the rank's
    backend got wrong (a Prism bug: the message says so)."""

    CODE: ClassVar[str] = "invalid"


@dataclass(frozen=True, slots=True)
class PeerFailed(Failure):
    """A rank this operation needs died."""

    CODE: ClassVar[str] = "peer_failed"


@dataclass(frozen=True, slots=True)
class NeverCompletes(Failure):
    """A rank this operation needs finished without taking part (the script
    calls it on some ranks only)."""

    CODE: ClassVar[str] = "deadlock"


Outcome = CollectiveDone | P2PDone | Failure


# --- what the matcher reads from messages -------------------------------------


class _GroupCreateLike(Protocol):
    rank: int
    gid: str
    index: int
    ranks: tuple[int, ...]


class _SendLike(Protocol):
    rank: int
    gid: str
    dst: int
    tag: int
    pseq: int
    dtype: str
    shape: tuple[int, ...]
    payloads: tuple[Buffer, ...]


class _RecvLike(Protocol):
    rank: int
    gid: str
    src: int
    tag: int
    pseq: int
    dtype: str
    shape: tuple[int, ...]


class _WaitLike(Protocol):
    rank: int
    what: str


def wait_key_coll(gid: str, seq: int) -> str:
    """``Wait.what`` for waiting on collective ``(gid, seq)``."""
    return f"coll:{gid}:{seq}"


def wait_key_p2p(src: int, dst: int, tag: int, pseq: int) -> str:
    """``Wait.what`` for waiting on the transfer ``(src, dst, tag, pseq)``."""
    return f"p2p:{src}:{dst}:{tag}:{pseq}"


_COLL_TEXT = re.compile(r"^\w+ on group (\S+) \(seq (\d+)\)$")
_RECV_TEXT = re.compile(r"^recv from rank (\d+) tag (-?\d+) \(pseq (\d+)\)$")


def _parse_wait(rank: int, what: str) -> tuple | None:
    """The operation a ``Wait.what`` names: ``wait_key_*`` strings, or the
    rank backend's descriptions ("all_reduce on group G (seq 3)", "recv from
    rank 4 tag 0 (pseq 1)"); None for anything else."""
    kind, _, rest = what.partition(":")
    try:
        if kind == "coll":
            gid, _, seq = rest.rpartition(":")
            return ("coll", gid, int(seq)) if gid else None
        if kind == "p2p":
            src, dst, tag, pseq = (int(x) for x in rest.split(":"))
            return ("p2p", src, dst, tag, pseq)
    except ValueError:
        return None
    if m := _COLL_TEXT.match(what):
        return ("coll", m[1], int(m[2]))
    if m := _RECV_TEXT.match(what):
        return ("p2p", int(m[1]), rank, int(m[2]), int(m[3]))
    return None


# --- deadlock report -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankWait:
    """What one rank waits for, for the deadlock report."""

    rank: int
    #: "coll" or "recv"
    kind: str
    gid: str
    op: str = ""
    seq: int = -1
    group_ranks: tuple[int, ...] = ()
    #: Members that have not arrived (collectives).
    missing: tuple[int, ...] = ()
    src: int = -1
    tag: int = -1
    pseq: int = -1


@dataclass(frozen=True, slots=True)
class DeadlockReport:
    """Every live rank waits and nothing can complete. ``text`` is printed."""

    waits: tuple[RankWait, ...]
    #: Sends nobody received: (src, dst, tag, pseq).
    unmatched_sends: tuple[tuple[int, int, int, int], ...]
    quiet_ns: int
    text: str

    def __str__(self) -> str:
        return self.text


# --- the matcher ------------------------------------------------------------------


@dataclass(slots=True)
class _Instance:
    gid: str
    seq: int
    ranks: tuple[int, ...]
    calls: dict[int, C.CallLike] = field(default_factory=dict)  # group rank -> call
    inputs: dict[int, list[np.ndarray]] = field(default_factory=dict)
    failure: Failure | None = None


@dataclass(slots=True)
class _PendingSend:
    msg: _SendLike
    payloads: tuple[Buffer, ...]


class Matcher:
    """Pairs the ranks' communication calls; see the module docstring."""

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        #: gid -> member ranks (group-rank order), as first announced.
        self.groups: dict[str, tuple[int, ...]] = {}
        self._group_origin: dict[str, int] = {}
        self._index: dict[str, dict[int, int]] = {}
        self._instances: dict[tuple[str, int], _Instance] = {}
        self._sends: dict[tuple[int, int, int, int], _PendingSend] = {}
        self._recvs: dict[tuple[int, int, int, int], _RecvLike] = {}
        self._waits: dict[int, tuple] = {}
        self._finished: set[int] = set()
        self._failed: dict[int, str] = {}
        #: When the matcher last saw anything happen (ns, the shell's clock).
        self.last_progress_ns = 0

    # -- groups --------------------------------------------------------------

    def group_create(self, msg: _GroupCreateLike, now: int) -> list[Outcome]:
        """Rank ``msg.rank`` created group ``msg.gid`` with members ``msg.ranks``."""
        self.last_progress_ns = now
        ranks = tuple(msg.ranks)
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad or len(set(ranks)) != len(ranks) or not ranks:
            return [InvalidCall(
                f"rank {msg.rank} created group {msg.gid} with ranks {list(ranks)}; members must be "
                f"distinct ranks in [0, {self.world_size})", (msg.rank,), msg.gid)]
        known = self.groups.get(msg.gid)
        if known is None:
            self.groups[msg.gid] = ranks
            self._group_origin[msg.gid] = msg.rank
            self._index[msg.gid] = {r: i for i, r in enumerate(ranks)}
            return []
        if known != ranks:
            first = self._group_origin[msg.gid]
            return [GroupMismatch(
                f"group {msg.gid} (creation index {msg.index}) has ranks {list(known)} on rank "
                f"{first} but {list(ranks)} on rank {msg.rank}; the script creates groups with "
                "different members on different ranks (every rank must call new_group with the "
                "same ranks, in the same order)", (first, msg.rank), msg.gid)]
        return []

    # -- collectives ---------------------------------------------------------

    def arrive(self, msg: C.CallLike, now: int) -> list[Outcome]:
        """Rank ``msg.rank`` reached collective ``(msg.gid, msg.seq)``."""
        self.last_progress_ns = now
        rank, gid, seq = msg.rank, msg.gid, msg.seq
        ranks = self.groups.get(gid)
        if ranks is None:
            return [InvalidCall(
                f"rank {rank} called {C.describe(msg)} on group {gid} at sequence {seq} before "
                "announcing the group; this is a Prism bug, please report it", (rank,), gid, seq)]
        index = self._index[gid]
        if rank not in index:
            return [InvalidCall(
                f"rank {rank} called {C.describe(msg)} on group {gid} (ranks {list(ranks)}) at "
                f"sequence {seq}, but it is not a member; the script passes a group the rank is "
                "not in", (rank,), gid, seq)]
        key = (gid, seq)
        inst = self._instances.get(key)
        if inst is None:
            inst = self._instances[key] = _Instance(gid, seq, ranks)
        if inst.failure is not None:
            return [_again(inst.failure, rank)]
        if not getattr(msg, "async_op", False):
            self._waits[rank] = ("coll", gid, seq)
        me = index[rank]
        if me in inst.calls:
            return [InvalidCall(
                f"rank {rank} arrived twice at {C.describe(msg)} on group {gid} at sequence {seq}; "
                "this is a Prism bug, please report it", (rank,), gid, seq)]
        if inst.calls:
            first_i = min(inst.calls)
            first = inst.calls[first_i]
            if C.signature(first) != C.signature(msg):
                return [self._fail(inst, CollectiveMismatch(
                    f"collective mismatch on group {gid} (ranks {list(ranks)}) at sequence {seq}: "
                    f"rank {ranks[first_i]} called {C.describe(first)} but rank {rank} called "
                    f"{C.describe(msg)}; the script calls different collectives on different ranks",
                    (), gid, seq), extra=(rank,))]
        if msg.op != "barrier" and msg.dtype not in C.DTYPES:
            return [self._fail(inst, InvalidCall(
                f"rank {rank} called {C.describe(msg)} on group {gid} at sequence {seq}; Prism's "
                f"collectives support {sorted(C.DTYPES)}, not {msg.dtype}", (), gid, seq), extra=(rank,))]
        try:
            arrays = self._arrays(msg, me)
        except ValueError as e:
            return [self._fail(inst, InvalidCall(
                f"rank {rank} sent a malformed {C.describe(msg)} on group {gid} at sequence {seq} "
                f"({e}); this is a Prism bug, please report it", (), gid, seq), extra=(rank,))]
        inst.calls[me] = msg
        inst.inputs[me] = arrays
        gone = self._gone_members(inst)
        if gone:
            return [self._fail(inst, gone)]
        if len(inst.calls) < len(ranks):
            return []
        return [self._complete(inst)]

    def _arrays(self, msg: C.CallLike, me: int) -> list[np.ndarray]:
        shapes = C.payload_shapes(msg, me)
        payloads = tuple(getattr(msg, "payloads", ()))
        if len(payloads) != len(shapes):
            raise ValueError(f"{len(payloads)} payloads for {len(shapes)} input tensors")
        return [C.to_array(p, msg.dtype, s) for p, s in zip(payloads, shapes)]

    def _complete(self, inst: _Instance) -> Outcome:
        calls = [inst.calls[i] for i in range(len(inst.ranks))]
        inputs = [inst.inputs[i] for i in range(len(inst.ranks))]
        try:
            outs = C.run_collective(calls, inputs, gid=inst.gid, seq=inst.seq, ranks=inst.ranks)
        except C.CollectiveError as e:
            return self._fail(inst, InvalidCall(f"{e}; the script's call is at fault", (), inst.gid, inst.seq))
        del self._instances[(inst.gid, inst.seq)]
        self._clear_waits(("coll", inst.gid, inst.seq))
        # Members often get the same array (all_reduce, all_gather): encode each once.
        encoded: dict[int, bytes] = {}

        def enc(a: np.ndarray) -> bytes:
            if id(a) not in encoded:
                encoded[id(a)] = C.from_array(a)
            return encoded[id(a)]

        outputs = {r: tuple(enc(a) for a in outs[i]) for i, r in enumerate(inst.ranks)}
        return CollectiveDone(inst.gid, inst.seq, calls[0].op, inst.ranks, outputs)

    def _fail(self, inst: _Instance, failure: Failure, extra: tuple[int, ...] = ()) -> Failure:
        """Mark ``inst`` failed; tell every member that arrived (and ``extra``)."""
        arrived = tuple(inst.ranks[i] for i in sorted(inst.calls))
        told = tuple(sorted(set(arrived) | set(extra)))
        inst.failure = _again(failure, *told)
        self._clear_waits(("coll", inst.gid, inst.seq))
        inst.calls.clear()
        inst.inputs.clear()
        return inst.failure

    def _gone_members(self, inst: _Instance) -> Failure | None:
        arrived = {inst.ranks[i] for i in inst.calls}
        desc = C.describe(inst.calls[min(inst.calls)]) if inst.calls else "a collective"
        for r in inst.ranks:
            if r in arrived:
                continue
            if r in self._failed:
                return PeerFailed(
                    f"rank {r} failed ({self._failed[r]}) before reaching {desc} on group {inst.gid} "
                    f"(ranks {list(inst.ranks)}) at sequence {inst.seq}; this collective can never "
                    "complete", (), inst.gid, inst.seq)
            if r in self._finished:
                return NeverCompletes(
                    f"rank {r} finished without reaching {desc} on group {inst.gid} "
                    f"(ranks {list(inst.ranks)}) at sequence {inst.seq}; the script calls this "
                    "collective on some ranks only", (), inst.gid, inst.seq)
        return None

    # -- point to point ------------------------------------------------------

    def send(self, msg: _SendLike, now: int) -> list[Outcome]:
        """Rank ``msg.rank`` sent to ``msg.dst`` (the payload travels with it)."""
        self.last_progress_ns = now
        src = msg.rank
        key = (src, msg.dst, msg.tag, msg.pseq)
        payloads = tuple(msg.payloads)
        bad = self._check_p2p(src, msg.dst, msg.dtype, msg.shape, "send to", msg.dst, msg.tag)
        if bad is None:
            size = sum(memoryview(p).nbytes for p in payloads)
            want = C.nbytes(msg.dtype, msg.shape)
            if size != want:
                bad = (f"rank {src} sent {size} bytes to rank {msg.dst} (tag {msg.tag}) for a "
                       f"{msg.dtype} tensor of shape {tuple(msg.shape)} ({want} bytes); this is a "
                       "Prism bug, please report it")
        if bad is not None:
            return [InvalidCall(bad, (src,), msg.gid)]
        if key in self._sends:
            return [InvalidCall(
                f"rank {src} sent twice to rank {msg.dst} with tag {msg.tag} and pseq {msg.pseq}; "
                "this is a Prism bug, please report it", (src,), msg.gid)]
        recv = self._recvs.pop(key, None)
        if recv is None:
            self._sends[key] = _PendingSend(msg, payloads)
            return []
        return [self._pair(msg, payloads, recv)]

    def recv_post(self, msg: _RecvLike, now: int) -> list[Outcome]:
        """Rank ``msg.rank`` posted a receive from ``msg.src``."""
        self.last_progress_ns = now
        dst = msg.rank
        key = (msg.src, dst, msg.tag, msg.pseq)
        bad = self._check_p2p(dst, msg.src, msg.dtype, msg.shape, "receive from", msg.src, msg.tag)
        if bad is not None:
            return [InvalidCall(bad, (dst,), msg.gid)]
        if key in self._recvs:
            return [InvalidCall(
                f"rank {dst} posted two receives from rank {msg.src} with tag {msg.tag} and pseq "
                f"{msg.pseq}; this is a Prism bug, please report it", (dst,), msg.gid)]
        pending = self._sends.pop(key, None)
        if pending is None:
            gone = self._gone_peer(msg.src, f"sending to rank {dst} with tag {msg.tag}")
            if gone is not None:
                return [_again(gone, dst)]
            self._recvs[key] = msg
            return []
        return [self._pair(pending.msg, pending.payloads, msg)]

    def _check_p2p(self, rank, peer, dtype, shape, verb, peer_rank, tag) -> str | None:
        if not 0 <= peer < self.world_size:
            return (f"rank {rank} tried to {verb} rank {peer_rank} (tag {tag}); ranks are in "
                    f"[0, {self.world_size}): the script passes a wrong peer")
        if peer == rank:
            return f"rank {rank} tried to {verb} itself (tag {tag}); torch does not allow this"
        if dtype not in C.DTYPES:
            return f"rank {rank} tried to {verb} rank {peer_rank} a {dtype} tensor; Prism supports {sorted(C.DTYPES)}"
        return None

    def _pair(self, send: _SendLike, payloads: tuple[Buffer, ...], recv: _RecvLike) -> Outcome:
        src, dst = send.rank, recv.rank
        key = (src, dst, send.tag, send.pseq)
        # As gloo and NCCL: dtype and element count must agree, shapes need
        # not (torch.distributed.pipelining sends a 0-d loss into a (1,) buffer).
        if send.dtype != recv.dtype or math.prod(send.shape) != math.prod(recv.shape):
            self._clear_waits(("p2p", *key))
            return P2PMismatch(
                f"send/recv mismatch: rank {src} sends a {send.dtype} tensor of shape "
                f"{tuple(send.shape)} to rank {dst} with tag {send.tag} but rank {dst} receives a "
                f"{recv.dtype} tensor of shape {tuple(recv.shape)} from rank {src} with tag "
                f"{recv.tag}; the script sends and receives tensors of different sizes or dtypes",
                (src, dst), send.gid)
        self._clear_waits(("p2p", *key))
        return P2PDone(src, dst, send.tag, send.pseq, send.gid, payloads)

    def _gone_peer(self, peer: int, doing: str) -> Failure | None:
        if peer in self._failed:
            return PeerFailed(f"rank {peer} failed ({self._failed[peer]}) before {doing}; "
                              "this receive can never complete", ())
        if peer in self._finished:
            return NeverCompletes(f"rank {peer} finished without {doing}; this receive can "
                                  "never complete (a recv has no matching send)", ())
        return None

    # -- waiting and rank lifetimes -------------------------------------------

    def wait(self, msg: _WaitLike, now: int) -> list[Outcome]:
        """Rank ``msg.rank`` started to wait for ``msg.what`` (see ``_parse_wait``)."""
        self.last_progress_ns = now
        key = _parse_wait(msg.rank, msg.what)
        if key is None:
            # Waits on sends (eager, already complete) and on things Prism does
            # not stage; deadlock_report's ``blocked`` covers the latter.
            return []
        if key[0] == "coll":
            inst = self._instances.get(key[1:])
            if inst is None:
                return []  # completed already (or not yet arrived: a backend bug we cannot see here)
            self._waits[msg.rank] = key
            return [_again(inst.failure, msg.rank)] if inst.failure else []
        _, src, dst, tag, pseq = key
        if msg.rank == dst and (src, dst, tag, pseq) in self._recvs:
            self._waits[msg.rank] = key
        return []

    def rank_finished(self, rank: int, now: int) -> list[Outcome]:
        """Rank ``rank`` ended normally; operations still needing it fail."""
        self.last_progress_ns = now
        self._finished.add(rank)
        self._waits.pop(rank, None)
        return self._orphaned(rank)

    def rank_failed(self, rank: int, reason: str, now: int) -> list[Outcome]:
        """Rank ``rank`` died (``reason`` is shown); returns a ``PeerFailed``
        for every pending operation that needed it, naming who to tell."""
        self.last_progress_ns = now
        self._failed[rank] = reason
        self._waits.pop(rank, None)
        return self._orphaned(rank)

    def _orphaned(self, rank: int) -> list[Outcome]:
        out: list[Outcome] = []
        for inst in sorted(self._instances.values(), key=lambda i: (i.gid, i.seq)):
            if inst.failure is None and inst.calls and rank in self._index[inst.gid]:
                if self._index[inst.gid][rank] not in inst.calls:
                    failure = self._gone_members(inst)
                    if failure is not None:
                        out.append(self._fail(inst, failure))
        for key in sorted(k for k in self._recvs if k[0] == rank):
            recv = self._recvs.pop(key)
            failure = self._gone_peer(rank, f"sending to rank {recv.rank} with tag {recv.tag}")
            if failure is not None:
                self._clear_waits(("p2p", *key))
                out.append(_again(failure, recv.rank))
        for key in [k for k in self._recvs if k[1] == rank]:
            del self._recvs[key]
        return out

    def _clear_waits(self, key: tuple) -> None:
        for r in [r for r, k in self._waits.items() if k == key]:
            del self._waits[r]

    def waiting_for(self, rank: int) -> str | None:
        """What ``rank`` waits for, as a report line without the rank, or None."""
        w = self._rank_wait(rank)
        return None if w is None else _wait_text(w, self._finished, self._failed, self._sends)

    def _rank_wait(self, rank: int) -> RankWait | None:
        key = self._waits.get(rank)
        if key is None:
            return None
        if key[0] == "coll":
            inst = self._instances.get(key[1:])
            if inst is None:
                return None
            arrived = {inst.ranks[i] for i in inst.calls}
            op = inst.calls[min(inst.calls)].op if inst.calls else "a failed collective"
            return RankWait(rank, "coll", inst.gid, op, inst.seq, inst.ranks,
                            tuple(r for r in inst.ranks if r not in arrived))
        _, src, dst, tag, pseq = key
        recv = self._recvs.get((src, dst, tag, pseq))
        if recv is None:
            return None
        return RankWait(rank, "recv", recv.gid, "recv", src=src, tag=tag, pseq=pseq)

    def _pending_of(self, rank: int) -> list[RankWait]:
        """Every incomplete operation ``rank`` has started, oldest first."""
        out = []
        for inst in self._instances.values():  # dicts keep arrival order
            me = self._index[inst.gid].get(rank)
            if inst.failure is None and me is not None and me in inst.calls:
                arrived = {inst.ranks[i] for i in inst.calls}
                out.append(RankWait(rank, "coll", inst.gid, inst.calls[me].op, inst.seq, inst.ranks,
                                    tuple(r for r in inst.ranks if r not in arrived)))
        for (src, dst, tag, pseq), recv in self._recvs.items():
            if dst == rank:
                out.append(RankWait(rank, "recv", recv.gid, "recv", src=src, tag=tag, pseq=pseq))
        return out

    def deadlock_report(
        self, live_ranks: Iterable[int], now: int, blocked: Iterable[int] = ()
    ) -> DeadlockReport | None:
        """The report when every rank in ``live_ranks`` (started, not finished)
        waits for a communication operation, else None. The shell calls this
        once ``now - last_progress_ns`` exceeds its quiet period.

        A rank waits if it waits for a known operation (a blocking collective,
        or a ``Wait`` naming one), or if it is in ``blocked`` (the shell knows
        it blocked, e.g. it released its slot, without a ``Wait`` Prism could
        read) and has incomplete operations: then all of them are listed."""
        live = sorted(set(live_ranks) - self._finished - set(self._failed))
        if not live:
            return None
        blocked = set(blocked)
        waits: list[RankWait] = []
        for r in live:
            w = self._rank_wait(r)
            if w is not None:
                waits.append(w)
                continue
            pending = self._pending_of(r) if r in blocked else []
            if not pending:
                return None
            waits += pending
        unmatched = tuple(sorted(self._sends))
        quiet = now - self.last_progress_ns
        lines = [f"deadlock: all {len(live)} running ranks wait and none can proceed "
                 f"(nothing happened for {quiet / 1e9:.1f} s):"]
        lines += [f"rank {w.rank}: {_wait_text(w, self._finished, self._failed, self._sends)}" for w in waits]
        for src, dst, tag, pseq in unmatched:
            lines.append(f"rank {src} sent to rank {dst} with tag {tag} (pseq {pseq}); never received")
        lines.append("the script calls collectives in a different order on different ranks, skips "
                     "one on some ranks, or posts a recv that no send matches")
        return DeadlockReport(tuple(waits), unmatched, quiet, "\n".join(lines))


def _wait_text(w: RankWait, finished, failed, sends) -> str:
    if w.kind == "coll":
        def who(r: int) -> str:
            if r in failed:
                return f"{r} (failed)"
            if r in finished:
                return f"{r} (finished)"
            return str(r)
        missing = ", ".join(who(r) for r in w.missing)
        plural = "ranks" if len(w.missing) > 1 else "rank"
        return (f"waits in {w.op} on group {w.gid} (ranks {list(w.group_ranks)}) seq {w.seq}; "
                f"missing: {plural} {missing}")
    other = sorted((tag, pseq) for (s, d, tag, pseq) in sends if s == w.src and d == w.rank)
    if other:
        sent = "; rank {} sent it {}".format(
            w.src, ", ".join(f"tag {t} (pseq {p})" for t, p in other))
    else:
        sent = ""
    return f"waits in recv from rank {w.src} tag {w.tag} (no matching send{sent})"


def _again(failure: Failure, *ranks: int) -> Failure:
    """``failure`` addressed to ``ranks`` instead."""
    return type(failure)(failure.message, tuple(ranks), failure.gid, failure.seq)
