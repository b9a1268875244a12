"""The hybrid replay: real sandbox ranks against the graph's virtual ranks (sans-IO).

``HybridReplay(graph, sandbox=[0, 5])`` is the steppable replay
(``prism.core.replay.SteppableReplay``) with the sandbox ranks' time taken
from outside. Every other rank is a virtual rank: a cursor into the graph with
its two clocks, a few machine words each, stepped by the same event loop.

A sandbox rank is computing from the moment its previous call was released
until it calls again; the shell feeds that call as it happens,
``arrive(rank, call, now)``. The engine then closes the rank's compute
segments up to ``now`` (the recorded durations of all but the first, which
absorbs the difference, so a sandbox that runs as recorded reproduces the
recorded timeline) and processes the call at ``now`` like any other: a
collective completes at its last arrival (sandbox arrivals as measured,
virtual ones from the graph) plus the cost model's time. When the emulated
job would release the sandbox's call, the engine emits ``Released`` with that
time; the shell gives the sandbox its result then, not earlier. Meanwhile it
lets the engine work ahead (``work_ahead``: queued events whatever their time,
which is exact) rather than process each event only when its time comes, or
sleeps until ``next_due()``. A call other than what the graph has at that
point is a ``Mismatch`` (the rank, what it called, what the graph expected).

Dormant virtual ranks (members of no group with a sandbox) are either
simulated like the live ones (``dormant="simulate"``, exact: a slower sandbox
delays everything downstream of it) or resolved offline from the batch
replay (``dormant="offline"``: only the sandbox and live ranks are stepped;
what the sandbox's own timing would change downstream of a dormant rank is
lost, and ``bench/hybrid.py`` measures that error).

Folded virtual ranks (``fold={follower: representative}``) are never
stepped: a follower's timeline is its representative's, node for node. That
holds for the DP replicas a scale-out copies (``ScalePlan.fold``): two
replicas with one source and no sandbox rank compute the same durations and
meet the rest of the world only in collectives on widened groups, which
complete at one time for all their members. A collective instance then waits
only for its unfolded members (the followers arrive when their
representatives do); ``fill_folded`` copies the representatives' times onto
the followers at the end. So the stepped ranks stay a few whatever the DP
degree, and the result is the unfolded engine's exactly.

Time enters as ``now`` (integer nanoseconds on the shell's clock, aligned so
that the replay's 0 is the sandbox's first arrival or whatever the shell
chooses). The engine never reads a clock.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from prism.core.costmodel import ZERO, CostModel
from prism.core.graph import COLL, COMPUTE, ITER, KIND_NAMES, OPS, RECV, SEND, WAIT, ExecutionGraph
from prism.core.replay import NORMAL, Costs, ReplayResult, SteppableReplay

__all__ = ["Call", "Released", "Mismatch", "HybridError", "HybridReplay"]

_COMM = (COLL, SEND, RECV, WAIT)
#: The urgency of a node no sandbox rank waits on (``HybridReplay._urgency``).
_NEVER = np.iinfo(np.int64).max


class HybridError(RuntimeError):
    """The shell drove the engine out of order (its bug, not the script's)."""


@dataclass(frozen=True, slots=True)
class Call:
    """What a sandbox rank called: ``kind`` is "coll", "send", "recv" or "wait";
    ``op`` the collective's name; ``gid``/``seq`` the collective instance;
    ``peer``/``tag`` a point-to-point call's other rank and tag."""

    kind: str
    op: str = ""
    gid: str = ""
    seq: int = -1
    peer: int = -1
    tag: int = 0


@dataclass(frozen=True, slots=True)
class Released:
    """Sandbox rank ``rank``'s call (graph node ``node``) returns at ``t_ns`` in the emulated job."""

    rank: int
    node: int
    call: Call
    t_ns: int


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A sandbox rank called something other than what the graph has there."""

    rank: int
    got: Call
    expected: str

    @property
    def message(self) -> str:
        got = self.got
        what = (f"{got.op or got.kind} on group {got.gid} at sequence {got.seq}" if got.kind == "coll"
                else f"{got.kind} with rank {got.peer} tag {got.tag}" if got.kind in ("send", "recv") else got.kind)
        return (f"sandbox rank {self.rank} called {what}, but the captured graph has {self.expected} at this point "
                "(the script took another path, or its arguments changed since the capture)")


class HybridReplay(SteppableReplay):
    def __init__(self, graph: ExecutionGraph, sandbox: Iterable[int], durations: np.ndarray | None = None,
                 cost_model: CostModel = ZERO, *, dormant: str = "simulate",
                 fold: Mapping[int, int] | None = None, batch: ReplayResult | None = None) -> None:
        if dormant not in ("simulate", "offline"):
            raise ValueError(f"dormant={dormant!r}: expected 'simulate' (every virtual rank stepped) or 'offline' "
                             "(dormant ranks at their batch-replay times)")
        self.sandbox = frozenset(int(r) for r in sandbox)
        bad = sorted(r for r in self.sandbox if not 0 <= r < graph.world_size)
        if bad:
            raise ValueError(f"sandbox rank(s) {bad} outside the graph's world of {graph.world_size}")
        self._setup(graph, Costs.of(graph, durations, cost_model))
        #: Virtual ranks sharing a group that has collectives with a sandbox rank, and the
        #: sandboxes' p2p peers; the others are dormant. (A group without collectives, such
        #: as a WORLD that only created the others, ties nobody's timing to anybody's.)
        self.live = self._live_of(graph) - self.sandbox
        self.dormant_mode = dormant
        self.dormant = frozenset(range(graph.world_size)) - self.sandbox - self.live
        #: follower -> representative: virtual ranks never stepped (see the module doc);
        #: offline, only live ones (dormant ones take their batch-replay times anyway)
        self.folded: dict[int, int] = self._check_fold(fold or {}, dormant)
        if self.folded:
            self._fold()
        #: offline: the queue ``work_ahead`` takes from, by urgency (``_urgency``);
        #: None: it takes the time queue's head (simulate, where no forecast is at hand)
        self._ahead: list[tuple[int, int, int, int, int]] | None = None
        if dormant == "offline":
            self._resolve_offline(durations, cost_model, batch)
        #: sandbox rank -> (first node of the segment it is computing, when it started)
        self.computing: dict[int, tuple[int, int]] = {}
        #: sandbox rank -> the comm node its arrival cleared for processing
        self._armed: dict[int, int] = {}
        #: releases computed since the shell last took them (``take_released``)
        self.released: list[Released] = []

    @property
    def stepped(self) -> frozenset[int]:
        """The ranks the event loop steps: the sandbox and every virtual rank neither folded nor (offline) dormant."""
        every = self.sandbox | self.live if self.dormant_mode == "offline" else frozenset(range(self.graph.world_size))
        return every - self.folded.keys()

    def _live_of(self, graph: ExecutionGraph) -> frozenset[int]:
        used = np.zeros(len(graph.groups), bool)
        used[np.unique(graph.inst_group)] = True
        live = {r for i, grp in enumerate(graph.groups) if used[i] and self.sandbox & set(grp.ranks) for r in grp.ranks}
        nodes = self._nodes_of(sorted(self.sandbox), graph)
        peers = graph.peer[nodes]
        live.update(np.unique(peers[peers >= 0]).tolist())
        return frozenset(live)

    def _check_fold(self, fold: Mapping[int, int], dormant: str) -> dict[int, int]:
        g = self.graph
        ptr = g.rank_ptr
        out = {}
        for f, p in fold.items():
            f, p = int(f), int(p)
            if dormant == "offline" and f in self.dormant:
                continue
            if f in self.sandbox or p in self.sandbox or p in fold or f == p:
                raise ValueError(f"fold {f} -> {p}: a follower and its representative must be distinct virtual "
                                 "ranks, the representative not itself folded")
            if dormant == "offline" and p in self.dormant:
                raise ValueError(f"fold {f} -> {p}: live rank {f} cannot follow dormant rank {p}")
            if ptr[f + 1] - ptr[f] != ptr[p + 1] - ptr[p]:
                raise ValueError(f"fold {f} -> {p}: the ranks have {ptr[f + 1] - ptr[f]} and {ptr[p + 1] - ptr[p]} "
                                 "nodes; a follower must be a copy of its representative")
            out[f] = p
        return out

    def _fold(self) -> None:
        """Followers never run, and no instance waits for them."""
        g = self.graph
        ptr = g.rank_ptr
        for f in self.folded:
            self._pos[f] = ptr[f + 1]
        self._heap = [e for e in self._heap if e[3] not in self.folded]
        heapq.heapify(self._heap)
        nodes = self._nodes_of(sorted(self.folded))
        coll = nodes[g.kind[nodes] == COLL]
        size = np.frombuffer(self._size, np.int64)
        np.subtract.at(size, g.ref[coll], 1)

    def _nodes_of(self, ranks: Iterable[int], graph: ExecutionGraph | None = None) -> np.ndarray:
        ptr = (graph or self.graph).rank_ptr
        parts = [np.arange(ptr[r], ptr[r + 1]) for r in ranks]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def fill_folded(self) -> None:
        """Give every follower its representative's node times (call once the sandboxes are done)."""
        if not self.folded:
            return
        f = sorted(self.folded)
        src = self._nodes_of([self.folded[r] for r in f])
        dst = self._nodes_of(f)
        for a in (self._start, self._end):
            v = np.frombuffer(a, np.int64)
            v[dst] = v[src]

    def result(self) -> ReplayResult:
        self.fill_folded()
        return super().result()

    def _resolve_offline(self, durations: np.ndarray | None, cost_model: CostModel,
                         batch: ReplayResult | None = None) -> None:
        """Dormant ranks take their batch-replay times and are never stepped:
        their arrivals at collectives and their sends are known in advance,
        so only the sandbox and live ranks are in the event loop. What a
        sandbox running off its recording would change downstream of a dormant
        rank is lost: the shortcut's error (``bench/hybrid.py`` measures it).
        The same batch replay orders ``work_ahead`` (``_urgency``); ``batch``
        is that replay if the caller has it already (same durations and costs)."""
        from prism.core.replay import replay_batch

        g = self.graph
        if batch is None:
            batch = replay_batch(g, durations=durations, cost_model=cost_model)
        dormant = np.zeros(g.world_size, bool)
        dormant[list(self.dormant)] = True
        nodes = np.flatnonzero(dormant[g.rank])
        np.frombuffer(self._start, np.int64)[nodes] = batch.start[nodes]
        np.frombuffer(self._end, np.int64)[nodes] = batch.end[nodes]
        coll = nodes[g.kind[nodes] == COLL]
        np.add.at(np.frombuffer(self._arrived, np.int64), g.ref[coll], 1)
        np.maximum.at(np.frombuffer(self._amax, np.int64), g.ref[coll], batch.start[coll])
        ptr = g.rank_ptr
        d = np.flatnonzero(dormant)
        np.frombuffer(self._pos, np.int64)[d] = ptr[d + 1]
        np.frombuffer(self._clk, np.int64)[d] = np.where(ptr[d + 1] > ptr[d], batch.end[np.maximum(ptr[d + 1] - 1, 0)], 0)
        self._heap = [e for e in self._heap if e[3] not in self.dormant]
        heapq.heapify(self._heap)
        self._need, self._need_off = self._urgency(batch)
        #: rank -> the sequence number of its queued event (-1: none). A rank has
        #: at most one; an entry of either queue with another number was taken
        #: from the other queue and is dropped when it reaches the head.
        self._queued = array("q", bytes(8 * g.world_size))
        self._queued[:] = array("q", np.full(g.world_size, -1, np.int64).tobytes())
        for _, _, seq, r in self._heap:
            self._queued[r] = seq
        self._ahead = [(self._need[self._pos[r] - self._need_off[r]], t, prio, seq, r) for t, prio, seq, r in self._heap]
        heapq.heapify(self._ahead)
        #: while work_ahead runs a virtual rank in place: the rank, the most
        #: urgent need queued (it stops there) and the time of its next event
        self._running, self._limit, self._cont = -1, _NEVER, -1

    def _urgency(self, batch: ReplayResult) -> tuple[array, array]:
        """Per node of a stepped rank, the earliest batch-replay time at which
        a sandbox rank waits on that node being processed (int64 max: none
        does); the order in which ``work_ahead`` works through the stepped
        ranks' future. Node ``n`` of rank ``r`` is entry ``n - off[r]`` of the
        first array, ``off`` the second (the stepped ranks' nodes only: a
        sliver of the graph).

        A sandbox node is needed at its start; any node as early as the next
        node of its rank, a collective arrival as early as any member of its
        instance, a send as early as its receive: iterated over the stepped
        ranks until nothing changes (each round carries a need one hop further
        across ranks). The times are the recording's, a forecast good enough to
        order work by; the order never changes a result (``work_ahead``)."""
        g = self.graph
        ptr = g.rank_ptr
        need = np.full(g.n_nodes, _NEVER, np.int64)
        for r in self.sandbox:
            need[ptr[r]:ptr[r + 1]] = batch.start[ptr[r]:ptr[r + 1]]
        stepped = sorted((self.sandbox | self.live) - self.folded.keys())
        nodes = self._nodes_of(stepped)
        coll = nodes[g.kind[nodes] == COLL]
        send = nodes[g.kind[nodes] == SEND]
        inst, recv = g.ref[coll], g.msg_recv[g.ref[send]]
        first = np.empty(g.n_instances, np.int64)
        while True:
            before = need[nodes]
            for r in stepped:
                seg = need[ptr[r]:ptr[r + 1]][::-1]
                np.minimum.accumulate(seg, out=seg)
            first.fill(_NEVER)
            np.minimum.at(first, inst, need[coll])
            need[coll] = first[inst]
            need[send] = np.minimum(need[send], need[recv])
            if np.array_equal(before, need[nodes]):
                break
        off = np.zeros(g.world_size, np.int64)
        lens = ptr[np.asarray(stepped) + 1] - ptr[stepped]
        off[stepped] = ptr[stepped] - (np.cumsum(lens) - lens)
        return array("q", need[nodes].tobytes()), array("q", off.tobytes())

    # --- the shell's side ---------------------------------------------------------

    def next_due(self) -> int | None:
        """When the engine next has something to do (None: it waits for sandbox arrivals or is done)."""
        return self.next_event_time()

    def arrive(self, rank: int, call: Call, now: int) -> Mismatch | None:
        """Sandbox ``rank`` reached ``call`` at ``now``; None, or the mismatch
        (then the engine is left as it was)."""
        start = self._computing_since(rank, now)
        nd, _ = self.computing[rank]
        cn = self.next_call_node(rank, nd)
        if cn == self._ptr[rank + 1]:
            return Mismatch(rank, call, "no further communication call (the rank's part of the graph ends)")
        expected = self._expected(cn)
        if not self._matches(cn, call):
            return Mismatch(rank, call, expected)
        self._close_segments(rank, nd, cn, start, now)
        self._pos[rank] = cn
        self._armed[rank] = cn
        self._push(now, NORMAL, rank)
        return None

    def finish(self, rank: int, now: int) -> None:
        """Sandbox ``rank``'s script ended at ``now`` (after its last call)."""
        start = self._computing_since(rank, now)
        nd, _ = self.computing[rank]
        end = self._ptr[rank + 1]
        for n in range(nd, end):
            if self._kind[n] in _COMM:
                raise HybridError(f"sandbox rank {rank} ended, but the graph still has its {self._expected(n)}")
        self._close_segments(rank, nd, end, start, now)
        self._pos[rank] = end

    def known_completion(self, rank: int, call: Call) -> tuple[int, int, int] | None:
        """Sandbox ``rank``, computing, will call the collective ``call`` next:
        ``(after, cost, node)`` where every other member of that instance has
        arrived already, so that the call completes at ``max(after, its
        arrival) + cost`` whatever its arrival (``after``: the latest other
        arrival, or the rank's compute start, whichever is later; the rank
        cannot arrive before it). None otherwise: a member still to come, the
        rank not computing, or ``call`` not what the graph has next (``arrive``
        reports that). Nothing changes; a shell can release the call before it
        knows the arrival (a GPU sandbox's stream times itself from there)."""
        seg = self.computing.get(rank)
        if seg is None or call.kind != "coll":
            return None
        nd, start = seg
        cn = self.next_call_node(rank, nd)
        if cn >= self._ptr[rank + 1] or self._kind[cn] != COLL or not self._matches(cn, call):
            return None
        i = self._ref[cn]
        if self._arrived[i] != self._size[i] - 1:
            return None
        return max(self._amax[i], start), int(self._icost[i]), cn

    def members(self, node: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The group ranks of a collective node's group that are sandbox ranks
        and those that are virtual: what the shell needs to compute what each
        sandbox member receives (``prism.core.compensation.reduce_with_virtual``
        over the sandbox inputs, the virtual ones recorded or compensated)."""
        g = self.graph
        if self._kind[node] != COLL:
            raise HybridError(f"node {node} is a {KIND_NAMES[self._kind[node]]}, not a collective")
        ranks = g.groups[g.group[node]].ranks
        sandbox = tuple(i for i, r in enumerate(ranks) if r in self.sandbox)
        return sandbox, tuple(i for i in range(len(ranks)) if i not in sandbox)

    def next_call_node(self, rank: int, node: int) -> int:
        """The first communication node of ``rank`` at or after ``node`` (the
        rank's end when none is left): where a sandbox computing from ``node``
        calls next."""
        end = self._ptr[rank + 1]
        while node < end and self._kind[node] not in _COMM:
            node += 1
        return node

    def work_ahead(self, budget: int) -> int | None:
        """Process up to ``budget`` queued events whatever their time, those a
        sandbox rank waits on soonest first (offline; simulate: the earliest
        first); return the time of the last one (None: nothing is queued).

        Exact: a rank is queued only once the time of its next node is final
        (a rank blocked on a sandbox rank is not queued), and the event rules
        give the same times in any processing order: a collective completes
        at its latest arrival plus its cost, a receive at max(its posting, the
        send's issue plus the transfer) and a wait at max(its start, the op's
        end), whichever side is processed first (the batch replay, which has
        no event order, gives the same timeline). So the shell can work through
        the virtual ranks' future while the sandbox computes instead of
        catching up when their time comes; a ``Released`` then comes out as
        soon as it is known, possibly before its time, and the shell holds it
        until then.

        A virtual rank keeps running in place, its next event not queued,
        while nothing queued is needed sooner: the two queues' pushes and pops
        were most of an event's cost."""
        last = None
        if self._ahead is None:
            while budget > 0 and self._heap:
                last, _ = self._process()
                budget -= 1
            return last
        ahead, queued = self._ahead, self._queued
        while budget > 0 and ahead:
            _, t, _, _, r = heapq.heappop(ahead)
            queued[r] = -1
            if r not in self.sandbox:
                self._running = r
                self._limit = ahead[0][0] if ahead else _NEVER
            while True:
                self._cont = -1
                last = t
                self._handle(t, r)
                budget -= 1
                t = self._cont
                if t < 0:
                    break
                if budget == 0:
                    self._running = -1
                    self._push(t, NORMAL, r)
                    break
            self._running = -1
            self._drop_stale()
        return last

    def take_released(self) -> list[Released]:
        out, self.released = self.released, []
        return out

    # --- inside ---------------------------------------------------------------------

    def _computing_since(self, rank: int, now: int) -> int:
        if rank not in self.sandbox:
            raise HybridError(f"rank {rank} is not a sandbox rank (sandbox: {sorted(self.sandbox)})")
        if rank not in self.computing:
            raise HybridError(f"sandbox rank {rank} arrived while its previous call is not released yet "
                              "(advance the engine to the release time first)")
        _, start = self.computing[rank]
        if now < start:
            raise HybridError(f"sandbox rank {rank} arrived at {now} ns, before its release at {start} ns")
        return start

    def _close_segments(self, rank: int, first: int, stop: int, start: int, now: int) -> None:
        """Nodes ``first .. stop-1`` (compute and step marks) end by ``now``: the
        first absorbs the difference, the others keep their recorded durations.
        A sandbox faster than its recording here (``now - start`` shorter than
        the others' recorded durations) has them all shrunk in proportion, so
        that every node, a step mark above all, ends within ``[start, now]``:
        a mark past ``now`` would put that step's end after the next call's
        arrival (a step too long, the next one negative; seen on a GPU
        sandbox whose stream reached the next call early)."""
        del self.computing[rank]
        if stop == first:
            return
        dur = self._dur
        rest = sum(dur[n] for n in range(first + 1, stop) if self._kind[n] == COMPUTE)
        span = max(0, now - start)
        scale = 1.0 if rest <= span else span / rest
        t = start
        for n in range(first, stop):
            self._start[n] = t
            if self._kind[n] == ITER:
                e = t
            elif n == first:
                e = max(t, now - rest)
            elif scale == 1.0:
                e = t + dur[n]
            else:
                e = min(now, t + int(dur[n] * scale))
            self._end[n] = e
            t = e
        self._clk[rank] = now
        self.events += stop - first

    def call_of(self, node: int) -> Call:
        """The call the graph has at ``node``."""
        g = self.graph
        k = self._kind[node]
        gid = g.groups[g.group[node]].gid if g.group[node] >= 0 else ""
        op = OPS[g.op[node]] if g.op[node] >= 0 else ""
        return Call(KIND_NAMES[k], op, gid, int(g.seq[node]), int(g.peer[node]), int(g.tag[node]))

    def _expected(self, node: int) -> str:
        c = self.call_of(node)
        if c.kind == "coll":
            return f"{c.op} on group {c.gid} at sequence {c.seq}"
        if c.kind in ("send", "recv"):
            return f"{c.kind} with rank {c.peer} tag {c.tag}"
        return f"a wait for its {self._expected(int(self._wait_of[node]))}"

    def _matches(self, node: int, call: Call) -> bool:
        want = self.call_of(node)
        if want.kind != call.kind:
            return False
        if call.kind == "coll":
            return (want.op, want.gid, want.seq) == (call.op, call.gid, call.seq)
        if call.kind in ("send", "recv"):
            return (want.peer, want.tag) == (call.peer, call.tag)
        return True

    def _process(self) -> tuple[int, int]:
        t, _, _, r = heapq.heappop(self._heap)
        return self._take(t, r) if self._ahead is not None else self._handle(t, r)

    def _take(self, t: int, r: int) -> tuple[int, int]:
        """Handle rank ``r``'s event taken off the time queue (its entry in the other goes stale)."""
        self._queued[r] = -1
        out = self._handle(t, r)
        self._drop_stale()
        return out

    def _drop_stale(self) -> None:
        """Leave neither queue with a stale head (what ``next_due``, ``step`` and ``work_ahead`` read)."""
        queued = self._queued
        for q in (self._heap, self._ahead):
            while q and queued[q[0][-1]] != q[0][-2]:
                heapq.heappop(q)

    def _handle(self, t: int, r: int) -> tuple[int, int]:
        if r in self.sandbox:
            nd = self._pos[r]
            if self._armed.get(r) != nd:
                # The sandbox computes from here until it calls again: its time is the shell's.
                self.computing[r] = (nd, t)
                return t, nd
            del self._armed[r]
        return super()._handle(t, r)

    def _push(self, t: int, prio: int, r: int) -> None:
        if r in self.sandbox and self._armed.get(r) != self._pos[r]:
            prev = self._pos[r] - 1
            if prev >= self._ptr[r] and self._kind[prev] in _COMM:
                self.released.append(Released(r, prev, self.call_of(prev), t))
        if self._ahead is not None:
            need = self._need[self._pos[r] - self._need_off[r]]
            if r == self._running:
                if need <= self._limit:  # work_ahead goes on with this rank
                    self._cont = t
                    return
                self._running = -1
            elif need < self._limit:
                self._limit = need
            self._queued[r] = self._seq
            heapq.heappush(self._ahead, (need, t, prio, self._seq, r))
        super()._push(t, prio, r)
