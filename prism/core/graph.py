"""The global execution graph of a captured run (sans-IO, numpy arrays).

A run's trace is one event list per logical rank. ``ExecutionGraph`` turns
those lists into a graph whose nodes are, per rank and in program order:

``COMPUTE``  a scheduling unit (what the rank did between communication calls)
``COLL``     the rank's participation in a collective instance ``(gid, seq)``
``SEND``     a send (eager: the sender's part ends after the modelled p2p time)
``RECV``     a receive, matched to its send by ``(src, dst, tag, pseq)``
``WAIT``     the point where the rank waits for an *async* collective or p2p
``ITER``     the rank's optimizer step for an iteration returned

Edges are implicit: program order within a rank, every member of a collective
instance to that instance, a send to its receive, an async op to its wait.

Everything is held in flat numpy arrays indexed by node id (nodes of rank
``r`` are ``rank_ptr[r] : rank_ptr[r+1]``) so that 8,192 ranks with hundreds
of events each stay a few arrays, not millions of Python objects.

Loading checks the trace and raises a ``GraphError`` subclass that names the
ranks, the group, the op and the sequence number: a collective instance with a
member missing (a truncated trace), members disagreeing on op / reduce op /
dtype / shape, a send or receive without its partner, and a dependency cycle
(ranks that would wait for each other forever). The cycle check walks the
graph in *waves* (every rank advances to its next blocking point when that
point's dependencies are met); the waves are kept (``ExecutionGraph.waves``)
because the batch replay evaluates exactly that order with array operations.

Program order is recovered from each rank's timestamps, not from record
order: an async op's record is written when it completes, after the compute
that overlapped it. Ties: a call (or wait, or step end) at instant t comes
before a compute segment that starts at t; otherwise record order decides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import math

import numpy as np

from prism.core.align import matched_pairs
from prism.core.trace import (
    COLLECTIVE_OPS,
    P2P,
    P2P_OPS,
    Collective,
    Compute,
    Event,
    GroupCreated,
    Iteration,
)

# Node kinds (values of ExecutionGraph.kind).
COMPUTE, COLL, SEND, RECV, WAIT, ITER = 0, 1, 2, 3, 4, 5
KIND_NAMES = ("compute", "coll", "send", "recv", "wait", "iter")

#: Op codes (values of ExecutionGraph.op): collectives, then "send", "recv".
OPS: tuple[str, ...] = COLLECTIVE_OPS + P2P_OPS
OP_CODE = {name: i for i, name in enumerate(OPS)}

#: Ops whose members must pass tensors of equal shapes; for the others
#: (all_to_all with uneven splits, gather/scatter roots) shapes legitimately
#: differ between members, so only op, reduce op and dtype are compared.
_SHAPE_CHECKED = {
    "all_reduce": "in",
    "all_reduce_coalesced": "in",
    "broadcast": "in",
    "reduce": "in",
    "all_gather": "in",
    "all_gather_into_tensor": "in",
    "reduce_scatter": "out",
    "reduce_scatter_tensor": "out",
}


class GraphError(ValueError):
    """The trace cannot form a consistent execution graph (the trace's fault)."""


class GroupError(GraphError):
    """Ranks disagree about a group, or a rank uses a group it never created."""


class TruncatedTraceError(GraphError):
    """A collective instance lacks some members' participation."""


class CollectiveMismatchError(GraphError):
    """Members of one collective instance called different ops/dtypes/shapes."""


class UnmatchedP2PError(GraphError):
    """A send without its receive or a receive without its send."""


class DeadlockError(GraphError):
    """The dependencies form a cycle: some ranks would wait for each other forever."""


@dataclass(frozen=True, slots=True)
class Group:
    """A communicator of the graph: its stable id and member ranks (group-rank order)."""

    gid: str
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NodeColumns:
    """One row per node, rows grouped by rank (rank 0 first) in program order.

    The low-level input of ``ExecutionGraph.from_columns``; ``from_events``
    and the synthetic array builder both produce it, so both go through the
    same matching and checks.
    """

    rank: np.ndarray  # int32
    kind: np.ndarray  # int8, one of COMPUTE .. ITER
    dur: np.ndarray  # int64 ns: recorded duration (COMPUTE), else 0
    is_async: np.ndarray  # bool (COLL, SEND, RECV)
    group: np.ndarray  # int32 index into groups (COLL, SEND, RECV), else -1
    seq: np.ndarray  # int64: collective seq, or p2p pseq
    op: np.ndarray  # int16 op code (OPS), else -1
    sig: np.ndarray  # int32 index into sig_table (COLL), else -1
    peer: np.ndarray  # int32 peer global rank (SEND, RECV), else -1
    tag: np.ndarray  # int64 (SEND, RECV)
    nbytes: np.ndarray  # int64 bytes this rank contributes / sends / receives
    wait_of: np.ndarray  # int64 node id of the async op a WAIT waits for, else -1
    step: np.ndarray  # int32 iteration index
    rec_start: np.ndarray  # int64 recorded start (issue for ops), rank clock
    rec_end: np.ndarray  # int64 recorded end
    #: Decoded signatures: (reduce_op, dtype, shapes or None when not compared).
    sig_table: tuple[tuple[str, str, tuple | None], ...]
    #: Two-clock timing of GPU ranks' COMPUTE rows (docs/GPU-TIMING.md), or
    #: None when no node has it: CPU share (int64 ns, -1: one-clock node), GPU
    #: busy time (int64 ns), and whether the segment ends in a CPU-GPU join.
    cpu: np.ndarray | None = None
    gpu: np.ndarray | None = None
    join: np.ndarray | None = None
    #: The finish of the segment's GPU work from its start when nothing is
    #: queued ahead (int64 ns, -1: unknown; PrismTrace 1.2's ``free_ns``).
    free: np.ndarray | None = None


def _range_gather(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s+l)`` for every (s, l), vectorised."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offs = np.cumsum(lens) - lens
    return np.arange(total, dtype=np.int64) + np.repeat(starts - offs, lens)


@dataclass(frozen=True, slots=True)
class Waves:
    """The order in which blocking points resolve, as flat arrays.

    Wave ``k`` resolves barriers ``bars[bar_ptr[k]:bar_ptr[k+1]]`` (blocking
    collectives, blocking receives, waits; at most one per rank) and then
    completes collective instances ``insts[inst_ptr[k]:inst_ptr[k+1]]`` whose
    last member was released by that wave. Wave 0 resolves no barrier: it
    completes what the ranks' first segments release.
    """

    bars: np.ndarray
    bar_ptr: np.ndarray
    insts: np.ndarray
    inst_ptr: np.ndarray

    @property
    def count(self) -> int:
        return len(self.bar_ptr) - 1


class ExecutionGraph:
    """Nodes and matched dependencies of a whole run, in numpy arrays.

    Build with ``from_events`` (trace event lists) or ``from_columns``.
    Attributes (all read-only by convention):

    ``world_size``, ``groups`` (tuple of ``Group``), ``rank_ptr``;
    per node: ``kind, rank, dur, is_async, group, seq, op, peer, tag, nbytes,
    wait_of, step, rec_start, rec_end``, ``ref`` (the collective instance of a
    COLL, the message of a SEND/RECV, -1 otherwise), ``is_barrier`` (a point
    where the rank blocks on others: blocking COLL or RECV, WAIT), ``slot``
    (the segment a node is reached in: global index of the last barrier
    before it on its rank, counted with one origin per rank; global slot ids
    run over ranks in order, each rank's origin first);
    per collective instance: ``inst_group, inst_seq, inst_op, inst_bytes``
    (largest member contribution), ``inst_ptr`` / ``inst_nodes`` (member nodes
    in group-rank order);
    per message: ``msg_send, msg_recv, msg_bytes, msg_group, msg_tag, msg_pseq``;
    ``waves`` (see ``Waves``); and the barrier bookkeeping behind it:
    ``bars`` (barrier node ids), ``bar_ptr_rank`` (per rank, into ``bars``),
    ``local_slot`` (a node's slot counted within its rank), ``slot_base``
    (global slot of each rank's origin), ``n_slots``.
    """

    def __init__(self) -> None:  # use from_events / from_columns
        raise TypeError("build an ExecutionGraph with ExecutionGraph.from_events(...) or .from_columns(...)")

    # ------------------------------------------------------------------ build
    @classmethod
    def from_events(cls, ranks: Mapping[int, Sequence[Event]], *, cpu_share: str = "min") -> ExecutionGraph:
        """Build the graph of a run from its per-rank trace event lists.

        ``ranks`` maps every logical rank ``0 .. N-1`` to its events (the
        records of ``RUN/rank-*.``). Events other than groups, compute,
        collectives, p2p and iterations are ignored here. ``cpu_share``: how
        GPU ranks' segments take their CPU shares (``two_clock_columns``).
        """
        world = len(ranks)
        if sorted(ranks) != list(range(world)):
            missing = sorted(set(range(max(ranks, default=-1) + 1)) - set(ranks))
            raise GraphError(
                f"the trace has ranks {sorted(ranks)[:8]}... but no events for ranks {missing[:16]}: "
                "every rank 0..N-1 needs its event list (a rank file is missing from the run)"
            )
        groups: dict[str, tuple[int, ...]] = {}
        group_seen_by: dict[str, int] = {}
        sigs: dict[tuple, int] = {}
        b = _ColumnBuilder()
        for r in range(world):
            known: set[str] = set()
            for ev in ranks[r]:
                if isinstance(ev, GroupCreated):
                    prev = groups.get(ev.gid)
                    if prev is not None and prev != tuple(ev.ranks):
                        raise GroupError(
                            f"group {ev.gid!r}: rank {group_seen_by[ev.gid]} recorded members {list(prev)} "
                            f"but rank {r} recorded {list(ev.ranks)}; the trace is inconsistent "
                            "(ranks created groups in a different order?)"
                        )
                    groups[ev.gid] = tuple(ev.ranks)
                    group_seen_by.setdefault(ev.gid, r)
                    known.add(ev.gid)
                elif isinstance(ev, (Collective, P2P)) and ev.gid not in known:
                    raise GroupError(
                        f"rank {r}: {ev.op} on group {ev.gid!r} (seq "
                        f"{ev.seq if isinstance(ev, Collective) else ev.pseq}) comes before any "
                        "group record for that gid on this rank; the trace is incomplete or corrupt"
                    )
            items = program_order(ranks[r])
            row_of_event: dict[int, int] = {}
            for i, sub, ev in items:
                if isinstance(ev, Compute):
                    b.add(r, COMPUTE, dur=ev.end_ns - ev.start_ns, step=ev.step,
                          rec_start=ev.start_ns, rec_end=ev.end_ns)
                    if ev.cpu_ns >= 0:
                        b.clocks[len(b.rows) - 1] = (ev.cpu_ns, ev.gpu_ns, ev.join, ev.free_ns, ev.cold_ns)
                elif sub == 1:
                    b.add(r, WAIT, wait_of=row_of_event[i], step=ev.step,
                          rec_start=ev.wait_ns, rec_end=ev.end_ns)
                elif isinstance(ev, Collective):
                    if ev.op not in OP_CODE or ev.op in P2P_OPS:
                        raise GraphError(f"rank {r}: collective on group {ev.gid!r} seq {ev.seq} has unknown op {ev.op!r}")
                    side = _SHAPE_CHECKED.get(ev.op)
                    shapes = None if side is None else (ev.in_shapes if side == "in" else ev.out_shapes)
                    key = (ev.reduce_op, ev.dtype, shapes)
                    sig = sigs.setdefault(key, len(sigs))
                    row_of_event[i] = b.add(
                        r, COLL, is_async=ev.async_op, group=ev.gid, seq=ev.seq, op=OP_CODE[ev.op], sig=sig,
                        nbytes=ev.bytes, step=ev.step, rec_start=ev.issue_ns, rec_end=ev.end_ns)
                elif isinstance(ev, P2P):
                    if ev.op not in P2P_OPS:
                        raise GraphError(f"rank {r}: p2p record with op {ev.op!r}; expected 'send' or 'recv'")
                    row_of_event[i] = b.add(
                        r, SEND if ev.op == "send" else RECV, is_async=ev.async_op, group=ev.gid, seq=ev.pseq,
                        op=OP_CODE[ev.op], peer=ev.peer, tag=ev.tag, nbytes=ev.bytes, step=ev.step,
                        rec_start=ev.issue_ns, rec_end=ev.end_ns, shape_sig=(ev.dtype, math.prod(ev.shape)))
                else:
                    b.add(r, ITER, step=ev.step, rec_start=ev.end_ns, rec_end=ev.end_ns)
        gids = sorted(groups, key=lambda g: (len(groups[g]) != world, g))
        gindex = {g: k for k, g in enumerate(gids)}
        cols, p2p_sig = b.finish(gindex, tuple(sorted(sigs, key=sigs.get)))
        if b.clocks:
            cpu, gpu, join, free = two_clock_columns(cols, b.clocks, cpu_share=cpu_share)
            cols = dataclasses.replace(cols, cpu=cpu, gpu=gpu, join=join, free=free)
        p2p_table = tuple(sorted(b.p2p_sigs, key=b.p2p_sigs.get))
        return cls.from_columns(world, tuple(Group(g, groups[g]) for g in gids), cols,
                                p2p_sig=p2p_sig, p2p_sig_table=p2p_table)

    @classmethod
    def from_columns(
        cls,
        world_size: int,
        groups: Sequence[Group],
        cols: NodeColumns,
        *,
        p2p_sig: np.ndarray | None = None,
        p2p_sig_table: Sequence[tuple] = (),
    ) -> ExecutionGraph:
        """Build from per-node columns (see ``NodeColumns``); runs every check.

        ``p2p_sig`` optionally gives each SEND/RECV row a code of its (dtype,
        shape) so that a send and its receive can be compared.
        """
        g = object.__new__(cls)
        g._init(world_size, tuple(groups), cols, p2p_sig, tuple(p2p_sig_table))
        return g

    def _init(self, world, groups, cols, p2p_sig, p2p_sig_table) -> None:
        self.world_size = world
        self.groups = groups
        self.sig_table = cols.sig_table
        n = len(cols.rank)
        rank = cols.rank.astype(np.int32, copy=False)
        if n and np.any(np.diff(rank) < 0):
            raise GraphError("node columns must be grouped by rank in ascending order (a Prism bug: please report it)")
        self.rank_ptr = np.searchsorted(rank, np.arange(world + 1)).astype(np.int64)
        self.rank = rank
        self.kind = cols.kind.astype(np.int8, copy=False)
        self.dur = cols.dur.astype(np.int64, copy=False)
        self.is_async = cols.is_async.astype(bool, copy=False)
        self.group = cols.group.astype(np.int32, copy=False)
        self.seq = cols.seq.astype(np.int64, copy=False)
        self.op = cols.op.astype(np.int16, copy=False)
        self.peer = cols.peer.astype(np.int32, copy=False)
        self.tag = cols.tag.astype(np.int64, copy=False)
        self.nbytes = cols.nbytes.astype(np.int64, copy=False)
        #: per node, its collective signature (index into ``sig_table``; -1: not a collective)
        self.sig = cols.sig.astype(np.int32, copy=False)
        self.wait_of = cols.wait_of.astype(np.int64, copy=False)
        self.step = cols.step.astype(np.int32, copy=False)
        self.rec_start = cols.rec_start.astype(np.int64, copy=False)
        self.rec_end = cols.rec_end.astype(np.int64, copy=False)
        self.cpu = self.gpu = self.join = self.free = None
        if cols.cpu is not None:
            self.cpu = np.asarray(cols.cpu, np.int64)
            self.gpu = np.asarray(cols.gpu, np.int64)
            self.join = np.asarray(cols.join, bool)
            self.free = (np.asarray(cols.free, np.int64) if cols.free is not None
                         else np.full(n, -1, np.int64))
            if not (self.cpu.shape == self.gpu.shape == self.join.shape == self.free.shape == (n,)):
                raise GraphError("cpu, gpu, join and free columns need one entry per node "
                                 "(a Prism bug: please report it)")
            two = (self.kind == COMPUTE) & (self.cpu >= 0)
            if not two.any():
                self.cpu = self.gpu = self.join = self.free = None
            elif np.any(two & (self.gpu < 0)):
                raise GraphError("a two-clock compute node has no GPU time (a Prism bug: please report it)")
        self.group_size = np.array([len(gr.ranks) for gr in groups], dtype=np.int64)
        self.ref = np.full(n, -1, dtype=np.int64)
        self._match_collectives(cols.sig)
        self._match_p2p(p2p_sig, p2p_sig_table)
        self._check_waits()
        k = self.kind
        self.is_barrier = ((k == COLL) | (k == RECV)) & ~self.is_async | (k == WAIT)
        # slot: per rank, 0 = origin, j = after the j-th barrier; made global
        # by adding the rank's base (number of barriers before it + rank).
        nbar_before = np.zeros(n + 1, np.int64)  # global count of barriers before each node (and the end)
        np.cumsum(self.is_barrier, out=nbar_before[1:])
        self.bar_ptr_rank = nbar_before[self.rank_ptr]
        bar_at_rank_start = self.bar_ptr_rank[:-1]
        nbar_before = nbar_before[:-1]
        self.slot_base = self.bar_ptr_rank[:-1] + np.arange(world)
        local = nbar_before - np.repeat(bar_at_rank_start, np.diff(self.rank_ptr))
        self.local_slot = local.astype(np.int64)
        self.slot = (self.local_slot + np.repeat(self.slot_base, np.diff(self.rank_ptr))).astype(np.int64)
        self.n_slots = int(self.bar_ptr_rank[-1]) + world
        self.bars = np.flatnonzero(self.is_barrier)
        self.waves = self._schedule()

    @property
    def n_nodes(self) -> int:
        return len(self.kind)

    @property
    def n_instances(self) -> int:
        return len(self.inst_group)

    @property
    def n_messages(self) -> int:
        return len(self.msg_send)

    # ------------------------------------------------------------- matching
    def _describe_inst(self, gidx: int, seq: int) -> str:
        gr = self.groups[gidx]
        return f"group {gr.gid!r} (ranks {_short(gr.ranks)}) seq {seq}"

    def _match_collectives(self, sig: np.ndarray) -> None:
        nodes = np.flatnonzero(self.kind == COLL)
        grp = self.group[nodes].astype(np.int64)
        if np.any(grp < 0) or np.any(grp >= len(self.groups)):
            bad = nodes[(grp < 0) | (grp >= len(self.groups))][0]
            raise GroupError(f"rank {self.rank[bad]}: collective on unknown group index {self.group[bad]} (a Prism bug)")
        rk = self.rank[nodes].astype(np.int64)
        # membership: (group, rank) pairs against the groups' member lists
        mem_g = np.repeat(np.arange(len(self.groups)), self.group_size)
        mem_r = np.concatenate([np.asarray(gr.ranks, dtype=np.int64) for gr in self.groups]) if self.groups else np.zeros(0, np.int64)
        W = self.world_size + 1
        mem_key = mem_g * W + mem_r
        grank_sorted = np.argsort(mem_key, kind="stable")
        pos = np.searchsorted(mem_key[grank_sorted], grp * W + rk)
        pos = np.minimum(pos, max(len(mem_key) - 1, 0))
        ok = (mem_key[grank_sorted][pos] == grp * W + rk) if len(mem_key) else np.zeros(len(nodes), bool)
        if not np.all(ok):
            bad = nodes[~ok][0]
            raise GroupError(
                f"rank {self.rank[bad]} took part in {OPS[self.op[bad]]} on {self._describe_inst(self.group[bad], self.seq[bad])} "
                "but is not a member of that group; the trace is inconsistent"
            )
        # group-rank of each participation (members are listed in group-rank order)
        grp_start = np.cumsum(self.group_size) - self.group_size
        grank = grank_sorted[pos] - grp_start[grp]
        seq = self.seq[nodes]
        order = np.lexsort((grank, seq, grp))
        nodes, grp, seq, grank = nodes[order], grp[order], seq[order], grank[order]
        if len(nodes):
            new = np.ones(len(nodes), bool)
            new[1:] = (grp[1:] != grp[:-1]) | (seq[1:] != seq[:-1])
        else:
            new = np.zeros(0, bool)
        starts = np.flatnonzero(new)
        counts = np.diff(np.append(starts, len(nodes)))
        dup = np.zeros(len(nodes), bool)
        dup[1:] = ~new[1:] & (grank[1:] == grank[:-1])
        if np.any(dup):
            bad = nodes[np.flatnonzero(dup)[0]]
            raise GraphError(
                f"rank {self.rank[bad]} recorded {OPS[self.op[bad]]} on {self._describe_inst(self.group[bad], self.seq[bad])} "
                "twice; sequence numbers must be unique per group on each rank (corrupt trace)"
            )
        inst_group = grp[starts]
        inst_seq = seq[starts]
        short = counts != self.group_size[inst_group]
        if np.any(short):
            i = np.flatnonzero(short)[0]
            present = sorted(int(self.rank[m]) for m in nodes[starts[i]:starts[i] + counts[i]])
            members = self.groups[inst_group[i]].ranks
            missing = sorted(set(members) - set(present))
            op = OPS[self.op[nodes[starts[i]]]]
            n_short = int(short.sum())
            raise TruncatedTraceError(
                f"{op} on {self._describe_inst(inst_group[i], inst_seq[i])}: ranks {_short(missing)} have no "
                f"record of it while ranks {_short(present)} do ({n_short} instance(s) incomplete). "
                "The trace is incomplete: a rank file was truncated or a rank stopped early; "
                "re-capture the run, or cut every rank's trace at the same step"
            )
        inst_id = np.cumsum(new) - 1
        self.ref[nodes] = inst_id
        self.inst_group = inst_group.astype(np.int32)
        self.inst_seq = inst_seq
        self.inst_ptr = np.append(starts, len(nodes)).astype(np.int64)
        self.inst_nodes = nodes
        self.inst_op = self.op[nodes[starts]] if len(nodes) else np.zeros(0, np.int16)
        self.inst_bytes = (np.maximum.reduceat(self.nbytes[nodes], starts) if len(nodes)
                           else np.zeros(0, np.int64))
        # every member must agree with the first member on op and signature
        for arr, what in ((self.op[nodes], "op"), (sig[nodes], "signature")):
            first = np.repeat(arr[starts], counts) if len(nodes) else arr
            diff = arr != first
            if np.any(diff):
                j = np.flatnonzero(diff)[0]
                i = inst_id[j]
                a, bnode = nodes[starts[i]], nodes[j]
                raise CollectiveMismatchError(
                    f"{self._describe_inst(inst_group[i], inst_seq[i])}: members disagree on the {what}: "
                    f"rank {self.rank[a]} called {self._call_repr(a, sig)} but rank {self.rank[bnode]} called "
                    f"{self._call_repr(bnode, sig)}. The traced program issued mismatched collectives at this "
                    "point (a bug in the training script), or the trace is corrupt"
                )

    def _call_repr(self, node: int, sig: np.ndarray) -> str:
        reduce_op, dtype, shapes = self.sig_table[sig[node]]
        parts = [x for x in (reduce_op, dtype) if x]
        if shapes is not None:
            parts.append(f"shapes={list(shapes)}")
        return f"{OPS[self.op[node]]}({', '.join(parts)})"

    def _match_p2p(self, p2p_sig: np.ndarray | None, p2p_sig_table: tuple) -> None:
        k = self.kind
        sends = np.flatnonzero(k == SEND)
        recvs = np.flatnonzero(k == RECV)
        nodes = np.concatenate([sends, recvs])
        bad = (self.peer[nodes] < 0) | (self.peer[nodes] >= self.world_size) | (self.peer[nodes] == self.rank[nodes])
        if np.any(bad):
            m = nodes[bad][0]
            raise GraphError(f"rank {self.rank[m]}: {OPS[self.op[m]]} with peer {self.peer[m]} (world size "
                             f"{self.world_size}); a peer must be another rank of the world (corrupt trace)")
        is_recv = np.concatenate([np.zeros(len(sends), np.int64), np.ones(len(recvs), np.int64)])
        src = np.where(is_recv == 1, self.peer[nodes], self.rank[nodes]).astype(np.int64)
        dst = np.where(is_recv == 1, self.rank[nodes], self.peer[nodes]).astype(np.int64)
        tag, pseq = self.tag[nodes], self.seq[nodes]
        order = np.lexsort((is_recv, pseq, tag, dst, src))
        nodes, is_recv, src, dst, tag, pseq = (a[order] for a in (nodes, is_recv, src, dst, tag, pseq))
        m = len(nodes)
        new = np.ones(m, bool)
        if m > 1:
            new[1:] = (src[1:] != src[:-1]) | (dst[1:] != dst[:-1]) | (tag[1:] != tag[:-1]) | (pseq[1:] != pseq[:-1])
        starts = np.flatnonzero(new)
        counts = np.diff(np.append(starts, m))
        second = np.minimum(starts + 1, max(m - 1, 0))
        ok = (counts == 2) & (is_recv[starts] == 0) & (is_recv[second] == 1)
        if not np.all(ok):
            j = starts[np.flatnonzero(~ok)[0]]
            node = nodes[j]
            what = "recv" if is_recv[j] else "send"
            other = "send" if is_recv[j] else "recv"
            who = src[j] if is_recv[j] else dst[j]
            gid = self.groups[self.group[node]].gid
            raise UnmatchedP2PError(
                f"{what} from rank {src[j]} to rank {dst[j]} (group {gid!r}, tag {tag[j]}, pseq {pseq[j]}, "
                f"step {self.step[node]}) has no matching {other} on rank {who} (or is recorded twice). "
                "The trace is incomplete (truncated rank file) or the traced program's sends and receives "
                "do not pair up"
            )
        s_nodes, r_nodes = nodes[starts], nodes[starts + 1]
        if p2p_sig is not None:
            diff = p2p_sig[s_nodes] != p2p_sig[r_nodes]
            if np.any(diff):
                j = np.flatnonzero(diff)[0]
                s, r = s_nodes[j], r_nodes[j]
                raise CollectiveMismatchError(
                    f"send from rank {self.rank[s]} to rank {self.rank[r]} (tag {self.tag[s]}, pseq {self.seq[s]}): "
                    f"sent {p2p_sig_table[p2p_sig[s]]} but received into {p2p_sig_table[p2p_sig[r]]} "
                    "(dtype, elements); the traced program's send and recv disagree, or the trace is corrupt"
                )
        ids = np.arange(len(s_nodes), dtype=np.int64)
        self.ref[s_nodes] = ids
        self.ref[r_nodes] = ids
        self.msg_send = s_nodes
        self.msg_recv = r_nodes
        self.msg_bytes = np.maximum(self.nbytes[s_nodes], self.nbytes[r_nodes])
        self.msg_group = self.group[s_nodes]
        self.msg_tag = self.tag[s_nodes]
        self.msg_pseq = self.seq[s_nodes]

    def _check_waits(self) -> None:
        waits = np.flatnonzero(self.kind == WAIT)
        t = self.wait_of[waits]
        ok = (t >= 0) & (t < waits)
        ok[ok] &= (self.rank[t[ok]] == self.rank[waits[ok]]) & self.is_async[t[ok]]
        if not np.all(ok):
            w = waits[~ok][0]
            raise GraphError(f"rank {self.rank[w]}: a wait (node {w}) does not refer to an earlier async op of the "
                             "same rank (a Prism bug: please report it)")

    # ------------------------------------------------------------- schedule
    def _schedule(self) -> Waves:
        """Resolve blocking points wave by wave; a stall is a deadlock."""
        world = self.world_size
        kind, ref, wait_of = self.kind, self.ref, self.wait_of
        pending = self.group_size[self.inst_group].copy() if self.n_instances else np.zeros(0, np.int64)
        cur = np.zeros(world, np.int64)  # local index of the next barrier; slots 0..cur released
        nbar = np.diff(self.bar_ptr_rank)
        # COLL nodes in node order are in global-slot order; per-slot ranges
        coll_nodes = np.flatnonzero(kind == COLL)
        coll_slot = self.slot[coll_nodes]
        slot_coll_start = np.searchsorted(coll_slot, np.arange(self.n_slots + 1))
        bars_out, bar_ptr, insts_out, inst_ptr = [], [0], [], [0]

        def release(slots: np.ndarray) -> np.ndarray:
            st = slot_coll_start[slots]
            items = coll_nodes[_range_gather(st, slot_coll_start[slots + 1] - st)]
            inst = ref[items]
            np.subtract.at(pending, inst, 1)
            done = np.unique(inst[pending[inst] == 0])
            return done

        send_rank = self.rank[self.msg_send].astype(np.int64)
        send_local = self.local_slot[self.msg_send]
        insts_out.append(release(self.slot_base))
        inst_ptr.append(inst_ptr[-1] + len(insts_out[-1]))
        bar_ptr.append(0)
        active = np.flatnonzero(nbar > 0)
        while len(active):
            b = self.bars[self.bar_ptr_rank[active] + cur[active]]
            kb = kind[b]
            target = np.where(kb == WAIT, wait_of[b], b)
            kt = kind[target]
            rt = ref[target]
            ready = np.ones(len(b), bool)
            c = kt == COLL
            ready[c] = pending[rt[c]] == 0
            rv = kt == RECV
            ready[rv] = send_local[rt[rv]] <= cur[send_rank[rt[rv]]]
            if not np.any(ready):
                raise DeadlockError(self._deadlock_message(active, b, pending, cur, send_rank, send_local))
            rs = active[ready]
            bars_out.append(b[ready])
            bar_ptr.append(bar_ptr[-1] + int(ready.sum()))
            cur[rs] += 1
            insts_out.append(release(self.slot_base[rs] + cur[rs]))
            inst_ptr.append(inst_ptr[-1] + len(insts_out[-1]))
            active = active[cur[active] < nbar[active]]
        cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)  # noqa: E731
        return Waves(cat(bars_out), np.asarray(bar_ptr, np.int64), cat(insts_out), np.asarray(inst_ptr, np.int64))

    def _deadlock_message(self, active, b, pending, cur, send_rank, send_local) -> str:
        lines = []
        for r, node in list(zip(active.tolist(), b.tolist()))[:8]:
            t = int(self.wait_of[node]) if self.kind[node] == WAIT else node
            how = "waits for" if self.kind[node] == WAIT else "waits in"
            if self.kind[t] == COLL:
                i = int(self.ref[t])
                members = self.inst_nodes[self.inst_ptr[i]:self.inst_ptr[i + 1]]
                late = [int(self.rank[m]) for m in members if self.local_slot[m] > cur[self.rank[m]]]
                lines.append(f"rank {r} {how} {OPS[self.op[t]]} on "
                             f"{self._describe_inst(self.inst_group[i], self.inst_seq[i])}, "
                             f"which ranks {_short(late)} never reach")
            else:
                j = int(self.ref[t])
                lines.append(f"rank {r} {how} recv from rank {send_rank[j]} (group "
                             f"{self.groups[self.msg_group[j]].gid!r}, tag {self.msg_tag[j]}, pseq {self.msg_pseq[j]}), "
                             "whose send is never reached")
        more = f" (and {len(active) - 8} more ranks)" if len(active) > 8 else ""
        return ("the trace's dependencies form a cycle (deadlock): " + "; ".join(lines) + more +
                ". The traced program would hang here (collectives issued in different orders on different "
                "ranks, or a receive before its matching send on both sides), or the trace is corrupt")

    # --------------------------------------------------------------- helpers
    def nodes_of(self, rank: int) -> slice:
        """Node ids of ``rank`` (a slice into the per-node arrays)."""
        return slice(int(self.rank_ptr[rank]), int(self.rank_ptr[rank + 1]))

    def describe(self, node: int) -> str:
        """A one-line human description of a node, for reports and errors."""
        k = int(self.kind[node])
        r = int(self.rank[node])
        if k == COLL:
            i = int(self.ref[node])
            return f"rank {r} {OPS[self.op[node]]} on {self._describe_inst(self.inst_group[i], self.inst_seq[i])}"
        if k in (SEND, RECV):
            j = int(self.ref[node])
            return (f"rank {r} {KIND_NAMES[k]} rank {self.rank[self.msg_send[j]]}->{self.rank[self.msg_recv[j]]} "
                    f"tag {self.msg_tag[j]} pseq {self.msg_pseq[j]}")
        if k == WAIT:
            return f"rank {r} wait for [{self.describe(int(self.wait_of[node]))}]"
        if k == ITER:
            return f"rank {r} end of step {self.step[node]}"
        return f"rank {r} compute ({self.dur[node]} ns, step {self.step[node]})"

    def __repr__(self) -> str:
        return (f"ExecutionGraph(world_size={self.world_size}, nodes={self.n_nodes}, groups={len(self.groups)}, "
                f"collective_instances={self.n_instances}, messages={self.n_messages}, waves={self.waves.count})")


def _short(xs: Iterable[int], limit: int = 16) -> str:
    xs = [int(x) for x in xs]
    if len(xs) <= limit:
        return str(xs)
    return str(xs[:limit])[:-1] + f", ... {len(xs) - limit} more]"


def program_order(events: Sequence[Event]) -> list[tuple[int, int, Event]]:
    """One rank's graph nodes in program order, as ``(record index, sub, event)``:
    a Compute, a Collective or P2P call (``sub`` 0) and, for an async one, its
    wait (``sub`` 1), an Iteration; other events are left out.

    The order comes from the timestamps (see the module doc): a call, wait or
    step end at instant t precedes the compute that starts at t; otherwise
    record order decides. ``from_events`` and calibration
    (``prism.core.calibration``) both walk a rank's nodes this way.
    """
    items = []
    for i, ev in enumerate(events):
        if isinstance(ev, Compute):
            items.append((ev.start_ns, 1, i, 0, ev))
        elif isinstance(ev, (Collective, P2P)):
            items.append((ev.issue_ns, 0, i, 0, ev))
            if ev.async_op:
                # a wait cannot precede its issue (a handle waited on at once records equal times)
                items.append((max(ev.wait_ns, ev.issue_ns), 0, i, 1, ev))
        elif isinstance(ev, Iteration):
            items.append((ev.end_ns, 0, i, 0, ev))
    items.sort(key=lambda it: it[:4])
    return [(i, sub, ev) for _, _, i, sub, ev in items]


class _ColumnBuilder:
    """Row-by-row accumulation of NodeColumns for ``from_events``."""

    __slots__ = ("rows", "p2p_sigs", "clocks")

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.p2p_sigs: dict[tuple, int] = {}
        #: row -> (cpu_ns, gpu_ns, join, free_ns, cold_ns) of GPU compute segments
        self.clocks: dict[int, tuple[int, int, bool, int, int]] = {}

    def add(self, rank, kind, *, dur=0, is_async=False, group="", seq=0, op=-1, sig=-1, peer=-1, tag=0,
            nbytes=0, wait_of=-1, step=0, rec_start=0, rec_end=0, shape_sig=None) -> int:
        psig = -1 if shape_sig is None else self.p2p_sigs.setdefault(shape_sig, len(self.p2p_sigs))
        self.rows.append((rank, kind, dur, is_async, group, seq, op, sig, peer, tag, nbytes, wait_of, step,
                          rec_start, rec_end, psig))
        return len(self.rows) - 1

    def finish(self, gindex: dict[str, int], sig_table: tuple) -> tuple[NodeColumns, np.ndarray]:
        rows = self.rows
        cols = list(zip(*rows)) if rows else [()] * 16
        arr = lambda i, dt: np.fromiter(cols[i], dtype=dt, count=len(rows))  # noqa: E731
        group = np.fromiter((gindex[g] if g else -1 for g in cols[4]), dtype=np.int32, count=len(rows))
        nc = NodeColumns(
            rank=arr(0, np.int32), kind=arr(1, np.int8), dur=arr(2, np.int64), is_async=arr(3, bool),
            group=group, seq=arr(5, np.int64), op=arr(6, np.int16), sig=arr(7, np.int32), peer=arr(8, np.int32),
            tag=arr(9, np.int64), nbytes=arr(10, np.int64), wait_of=arr(11, np.int64), step=arr(12, np.int32),
            rec_start=arr(13, np.int64), rec_end=arr(14, np.int64), sig_table=sig_table,
        )
        return nc, arr(15, np.int64)


#: How a segment's CPU share is estimated from its occurrences in the
#: uncalibrated steps (``two_clock_columns``).
CPU_SHARES = ("min", "median", "own")


def two_clock_columns(cols: NodeColumns, clocks: Mapping[int, tuple], *,
                      cpu_share: str = "min") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-node CPU share, GPU busy time, join flag and free finish for the
    replay's two clocks (docs/GPU-TIMING.md), from the recorded ``(cpu_ns,
    gpu_ns, join[, free_ns, cold_ns])`` of GPU compute segments.

    GPU time is measured on calibration steps only. A segment elsewhere takes
    the GPU time of its counterpart in the calibration steps of the same rank:
    a segment is known by what ended it (a join, or the next call's kind,
    group and op). Each step's sequence of such signatures is aligned with a
    reference step's (the rank's first calibration step; a longest common
    subsequence, ``prism.core.align``), and aligned segments match by their position
    in the reference; the others by how many segments of that kind came
    before them in their step, with the step's count of such segments, then
    without it, then by plain position (data-dependent steps, MoE, differ in
    their number of joins). Of several calibrated times a segment of an
    uncalibrated step takes the largest its own wall time allows (its GPU
    work ran inside that wall), else the smallest: the calibration steps may
    differ for real (MoE's routing changes the experts' loads) and the
    smallest of them then runs low (MoE at world 2, over 8 captures: -4..-7%
    with the smallest, -1..+5% with this rule; ``python
    bench/two_clock_check.py`` replays the kept captures against their truths); a
    calibration step's discarded measurement takes the smallest (what
    disturbs a measurement, another process's work on a shared GPU or clocks
    still rising, only adds time). A segment that the alignment did not pair
    is bounded by its own wall time. A calibration step's segment takes its CPU
    share from the other steps the same way (the calibration holds the GPU
    back, which inflates the wall time of segments that wait for it). A
    segment without any counterpart keeps its wall time as GPU time, which
    replays it as the one-clock model would.

    CPU shares (``cpu_share``): ``"min"`` (default), every segment takes the
    smallest share among its counterparts in the uncalibrated steps, itself
    included, for the same reason as the GPU time: what disturbs the CPU's
    issue in a capture (the other ranks' processes, the wait for the GPU
    before every segment) only adds time. ``python bench/cpu_share_choice.py``
    compares the three on kept GPU captures with measured truths: over 13 of
    them, a median error of 1.6% against 6.4% for ``"own"`` (each segment its own share; calibration steps the
    median of their counterparts) and 5.2% for
    ``"median"`` (all segments the median). The default was chosen on those
    captures, so new captures are its out-of-sample check.

    Free finish (PrismTrace 1.2): a segment takes the smallest ``free_ns``
    among its counterparts in the uncalibrated steps (the median under
    ``cpu_share="median"``; -1 when none has one):
    from its start to the end of its GPU work with nothing queued ahead, which
    the replay's ``max(cpu, gpu)`` leaves out when the issue is uneven (a
    pipeline stage's backward after the loss's ``.item()``: the first
    launches come slowly while the GPU waits for them). Cold start: a
    segment's ``cold_ns`` (what the capture's CPU lost to Prism's wait at the
    call before it, which the real job's CPU does not make) comes off its CPU
    share and free finish, at most half the share (a short segment cannot
    have lost more than it took).
    """
    if cpu_share not in CPU_SHARES:
        raise ValueError(f"cpu_share {cpu_share!r}: expected one of {', '.join(CPU_SHARES)}")
    n = len(cols.rank)
    cpu = np.full(n, -1, np.int64)
    gpu = np.full(n, -1, np.int64)
    join = np.zeros(n, bool)
    free = np.full(n, -1, np.int64)
    clocks = {row: (tuple(v) + (-1, 0))[:5] for row, v in clocks.items()}  # 1.1 callers: no free, no cold
    # (rank, step) -> rows of that step's two-clock segments, in order
    by_step: dict[tuple[int, int], list[int]] = {}
    for row in sorted(clocks):
        by_step.setdefault((int(cols.rank[row]), int(cols.step[row])), []).append(row)

    def keys(rows: list[int]) -> list[tuple]:
        sigs = []
        for row in rows:
            nxt = row + 1
            if nxt < n and cols.rank[nxt] == cols.rank[row]:
                sigs.append((clocks[row][2], int(cols.kind[nxt]), int(cols.group[nxt]), int(cols.op[nxt])))
            else:
                sigs.append((clocks[row][2], -1, -1, -1))
        total: dict[tuple, int] = {}
        for sg in sigs:
            total[sg] = total.get(sg, 0) + 1
        seen: dict[tuple, int] = {}
        out = []
        for i, sg in enumerate(sigs):
            k = seen.get(sg, 0)
            seen[sg] = k + 1
            out.append((("a", sg, k, total[sg]), ("b", sg, k), ("c", i)))
        return out

    step_keys = {key: keys(rows) for key, rows in by_step.items()}
    calibration = {key: any(clocks[row][1] != -1 for row in rows) for key, rows in by_step.items()}
    # Align each step's segments with a reference step of the same rank
    # (its first calibration step), by their signatures: data-dependent steps
    # (MoE: the token counts' .tolist()) insert or drop join segments, and a
    # count of segments "of this kind so far" then pairs a segment with
    # another program point's (one MoE capture: 15-19 ms of GPU time per step
    # more than the segments' own wall times). Aligned segments match by
    # their position in the reference first.
    # Steps equal to the reference (most, in a deterministic script) map one
    # to one; equal sequences are aligned once. (difflib's matching blocks
    # pair only 84 of 157 MoE segments where 4 were inserted, and take
    # 0.05-2 s a step: bench/align_cost.py measures both.)
    for r in sorted({r for r, _ in by_step}):
        steps = sorted(st for rr, st in by_step if rr == r)
        cal = [st for st in steps if calibration[r, st]]
        ref = cal[0] if cal else steps[min(1, len(steps) - 1)]
        ref_sigs = tuple(k[0][1] for k in step_keys[r, ref])
        aligned: dict[tuple, list[tuple[int, int]]] = {ref_sigs: [(i, i) for i in range(len(ref_sigs))]}
        for st in steps:
            ks = step_keys[r, st]
            mine = tuple(k[0][1] for k in ks)
            pairs = aligned.get(mine)
            if pairs is None:
                pairs = matched_pairs(ref_sigs, mine)
                aligned[mine] = pairs
            for a, b in pairs:
                ks[b] = (("p", a),) + ks[b]
    measured: dict[tuple, list[int]] = {}  # (rank, match key) -> GPU times from calibration steps
    plain: dict[tuple, list[int]] = {}  # (rank, match key) -> CPU shares from the other steps
    frees: dict[tuple, list[int]] = {}  # (rank, match key) -> free finishes from the other steps
    for (r, st), rows in by_step.items():
        for row, ks in zip(rows, step_keys[r, st]):
            c, g, _, f, _ = clocks[row]
            for k in ks:
                if g >= 0:
                    measured.setdefault((r, k), []).append(g)
                elif not calibration[r, st]:
                    plain.setdefault((r, k), []).append(c)
                    if f >= 0:
                        frees.setdefault((r, k), []).append(f)

    def first(table: dict[tuple, list[int]], r: int, ks: tuple) -> list[int] | None:
        for k in ks:
            vals = table.get((r, k))
            if vals:
                return vals
        return None

    for (r, st), rows in by_step.items():
        for row, ks in zip(rows, step_keys[r, st]):
            c, g, j, _, cold = clocks[row]
            join[row] = j
            if calibration[r, st] or cpu_share != "own":
                other = first(plain, r, ks)
                if other:
                    c = int(min(other)) if cpu_share == "min" else int(np.median(other))
            if g < 0:  # -1: not a calibration step; -2: its measurement was discarded
                vals = first(measured, r, ks)
                if not vals:
                    g = int(cols.dur[row])
                elif calibration[r, st]:
                    g = min(vals)
                else:
                    # the largest calibrated time its own wall time allows: the
                    # calibration steps may differ for real (MoE's routing), and
                    # the smallest of them then runs low
                    under = [v for v in vals if v <= int(cols.dur[row])]
                    g = max(under) if under else min(vals)
                if ks[0][0] != "p" and not calibration[r, st]:
                    # not aligned: matched by kind only, perhaps with another program
                    # point; its own wall time bounds its GPU time
                    g = min(g, int(cols.dur[row]))
            c = max(c, 0)
            pen = min(max(cold, 0), c // 2)
            cpu[row] = c - pen
            gpu[row] = max(g, 0)
            fs = first(frees, r, ks)
            if fs:
                f = min(fs) if cpu_share != "median" else np.median(fs)
                free[row] = max(int(f) - pen, 0)
    return cpu, gpu, join, free
