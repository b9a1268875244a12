"""Discrete-event replay of an execution graph (sans-IO; time is an argument).

Given an ``ExecutionGraph``, a duration per compute node (default: the
recorded ``end - start``) and a communication ``CostModel``, replay computes
the start and end of every node on every rank. One semantics, three engines:

* a rank runs its nodes in program order, starting at time 0;
* ``COMPUTE`` takes its duration; on GPU ranks (two-clock nodes, see
  docs/GPU-TIMING.md) the rank's time is its GPU stream and the rank also
  has a CPU clock ``c``: a node with CPU share ``cpu``, GPU time ``gpu``
  and free finish ``free`` (its finish from an idle GPU, -1: unknown)
  started at ``t`` ends at ``max(max(t, c) + gpu, c + cpu, c + free)`` and
  moves the CPU clock to ``c + cpu``, or to the node's end when it ends in a join
  (the script waited for the GPU); a one-clock node moves the CPU clock to
  its end too. Communication runs on the GPU stream and never holds the CPU
  clock, as with NCCL;
* ``COLL``: the rank *arrives* at its start; the instance completes at the
  latest member arrival plus the modelled time, and every member's
  participation ends then. A blocking call holds the rank until then; an async
  call lets it continue at once, and its ``WAIT`` holds it until completion;
* ``SEND`` is eager: the sender's part ends at issue + modelled p2p time
  whether or not the receiver has arrived (NCCL and gloo buffer small
  messages; for large ones this underestimates the sender's wait, the
  receiver's side is exact). A blocking send holds the rank that long;
* ``RECV`` ends at max(its issue, the send's issue + modelled p2p time);
* ``WAIT`` ends at max(its start, the end of the op it waits for);
* ``ITER`` takes no time; where it is reached is the rank's step end.

Engines (``tests/unit/test_replay.py`` proves they give identical timelines):

``replay_reference(graph, ...)``
    a plain heapq discrete-event loop over Python lists: the yardstick.
``SteppableReplay(graph, ...)``
    the same event loop, resumable, for real-time pacing: ``next_event_time()``
    says when the next event is due, ``step(now)`` / ``advance(now)`` process
    what is due at ``now`` (which the caller reads from its clock; this module
    never does). Ties break by (time, priority, sequence), so runs are
    deterministic. Per-node state lives in compact ``array('q')`` buffers,
    not Python objects; a real-time shell should still call ``gc.freeze()``
    after building the graph and engine so the collector never walks them.
``replay_batch(graph, ...)``
    the same timeline computed with numpy, wave by wave (``graph.waves``):
    within a segment between two blocking points a rank's node times are an
    offset from the segment's start, so only blocking points and collective
    completions are evaluated per wave, each wave as a handful of array ops.
"""

from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from prism.core.costmodel import ZERO, CostModel
from prism.core.graph import (
    COLL,
    COMPUTE,
    ITER,
    RECV,
    SEND,
    WAIT,
    ExecutionGraph,
    _range_gather,
)

#: Tie-break priorities: a rank woken by a completion runs before a rank that
#: merely continues at the same instant (SimPy's URGENT / NORMAL).
URGENT, NORMAL = 0, 1
#: Default number of warm-up steps dropped from the mean iteration time (docs/DESIGN.md).
DEFAULT_WARMUP = 2


class ReplayError(RuntimeError):
    """Replay could not finish (a graph that slipped past its checks: a Prism bug)."""


@dataclass(frozen=True, slots=True)
class Costs:
    """Per-node compute durations and modelled communication times (int64 ns)."""

    dur: np.ndarray  # per node (used for COMPUTE)
    inst: np.ndarray  # per collective instance
    msg: np.ndarray  # per p2p message
    model: CostModel
    #: Two-clock compute (GPU ranks; docs/GPU-TIMING.md): per node the CPU
    #: share (-1: a one-clock node, which takes ``dur``), the GPU busy time and
    #: whether the CPU joins the GPU at its end. None: every node is one-clock.
    cpu: np.ndarray | None = None
    gpu: np.ndarray | None = None
    join: np.ndarray | None = None
    #: Two-clock nodes: the finish from the segment's start with nothing
    #: queued ahead of it (-1: unknown), a floor under its end.
    free: np.ndarray | None = None

    @property
    def two_clock(self) -> bool:
        return self.cpu is not None

    @classmethod
    def of(cls, graph: ExecutionGraph, durations: np.ndarray | None = None,
           cost_model: CostModel = ZERO) -> Costs:
        """Resolve defaults: recorded durations, costs from ``cost_model``.

        A graph with two-clock compute nodes replays them with two clocks
        unless ``durations`` is given, which replaces every compute node's
        time by one duration (what-if studies scale those)."""
        if durations is None:
            dur = graph.dur
            if graph.cpu is not None:
                cpu = _with_issue(graph, graph.cpu, cost_model.issue_costs(graph))
                free = graph.free if graph.free is not None else np.full(graph.n_nodes, -1, np.int64)
                return cls(dur, cost_model.instance_costs(graph), cost_model.message_costs(graph), cost_model,
                           cpu, graph.gpu, graph.join, free)
        else:
            dur = np.asarray(durations)
            if dur.shape != (graph.n_nodes,):
                raise ValueError(f"durations must have one entry per node ({graph.n_nodes}), got shape {dur.shape}")
            if not np.issubdtype(dur.dtype, np.integer):
                raise ValueError(f"durations must be integer nanoseconds, got dtype {dur.dtype}")
            neg = np.flatnonzero((dur < 0) & (graph.kind == COMPUTE))
            if len(neg):
                raise ValueError(f"durations[{neg[0]}] = {dur[neg[0]]} is negative ({graph.describe(int(neg[0]))})")
            dur = dur.astype(np.int64)
        return cls(dur, cost_model.instance_costs(graph), cost_model.message_costs(graph), cost_model)


def _with_issue(graph: ExecutionGraph, cpu: np.ndarray, issue: np.ndarray) -> np.ndarray:
    """CPU shares with each communication call's issue cost (``CostModel.issue_costs``)
    added to the two-clock compute node before it on its rank.

    The capture leaves the call itself out of the CPU shares (Prism's own call
    is not the real backend's); with NCCL the real call costs its thread this
    much and then lets it go on, so it lengthens the CPU side of the segment
    that made it (several calls in a row all land on the segment before
    them; where that segment ends in a join, the cost is taken before the
    join, slightly early).
    """
    nz = np.flatnonzero(issue)
    if not len(nz):
        return cpu
    idx = np.arange(graph.n_nodes)
    last = np.maximum.accumulate(np.where((graph.kind == COMPUTE) & (cpu >= 0), idx, -1))
    prev = last[nz]
    ok = prev >= graph.rank_ptr[graph.rank[nz]]
    out = cpu.copy()
    np.add.at(out, prev[ok], issue[nz[ok]])
    return out


def _advance_after(graph: ExecutionGraph) -> np.ndarray:
    """True where a rank continues at the node's end (else at its start: async issue)."""
    k = graph.kind
    return (k == COMPUTE) | (k == WAIT) | (((k == COLL) | (k == SEND) | (k == RECV)) & ~graph.is_async)


# --------------------------------------------------------------------- result
@dataclass(frozen=True, slots=True)
class GroupTime:
    """Communication on one group, summed over its instances and members."""

    gid: str
    size: int
    calls: int  # collective instances plus p2p messages
    modelled_ns: int  # sum of modelled times of its instances / messages
    blocked_ns: int  # time members were held by its ops (transfer + waiting for peers)
    waiting_ns: int  # of which waiting for peers to arrive


@dataclass(frozen=True, slots=True)
class PathStep:
    """One stretch of the critical path: ``node`` bound the time ``[t0, t1]``."""

    node: int
    rank: int
    what: str  # "compute", "coll", "send", "recv"
    t0: int
    t1: int


class ReplayResult:
    """Timelines of a replay and what follows from them.

    ``start`` / ``end``: int64 ns per node (``graph.nodes_of(r)`` slices one
    rank's; ``rank_start(r)`` / ``rank_end(r)`` return them). Everything else
    is derived on demand.
    """

    __slots__ = ("graph", "costs", "start", "end", "__dict__")

    def __init__(self, graph: ExecutionGraph, costs: Costs, start: np.ndarray, end: np.ndarray) -> None:
        self.graph = graph
        self.costs = costs
        self.start = start
        self.end = end

    def rank_start(self, rank: int) -> np.ndarray:
        return self.start[self.graph.nodes_of(rank)]

    def rank_end(self, rank: int) -> np.ndarray:
        return self.end[self.graph.nodes_of(rank)]

    @property
    def makespan_ns(self) -> int:
        return int(self.end.max()) if len(self.end) else 0

    # -- iterations (docs/DESIGN.md: job step k ends when the last rank's step k ends)
    @cached_property
    def steps(self) -> np.ndarray:
        """The step numbers that have end-of-step marks, ascending."""
        g = self.graph
        return np.unique(g.step[g.kind == ITER])

    @cached_property
    def iteration_end(self) -> np.ndarray:
        """``[i, rank]``: when each rank reached the end of step ``steps[i]`` (-1: never)."""
        g = self.graph
        it = np.flatnonzero(g.kind == ITER)
        out = np.full((len(self.steps), g.world_size), -1, np.int64)
        out[np.searchsorted(self.steps, g.step[it]), g.rank[it]] = self.start[it]
        return out

    @cached_property
    def job_iteration_end(self) -> np.ndarray:
        """Per step, when the last rank finished it."""
        ie = self.iteration_end
        missing = np.argwhere(ie < 0)
        if len(missing):
            i, r = missing[0]
            raise ReplayError(f"rank {r} has no end-of-step mark for step {self.steps[i]}; iteration times need every rank's "
                              "step marks (the trace's iteration records are incomplete)")
        return ie.max(axis=1)

    @cached_property
    def iteration_times(self) -> np.ndarray:
        """Per recorded step: its job end minus the previous step's (the first from time 0)."""
        e = self.job_iteration_end
        return np.diff(e, prepend=0)

    def mean_iteration_time(self, warmup: int = DEFAULT_WARMUP) -> float:
        """Mean iteration time (ns) after dropping ``warmup`` steps."""
        t = self.iteration_times
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        if len(t) <= warmup:
            raise ValueError(f"the run has {len(t)} step(s); cannot drop {warmup} warm-up step(s) and keep any "
                             "(record more iterations, or pass a smaller warmup)")
        return float(t[warmup:].mean())

    # -- per-rank breakdown
    @cached_property
    def _blocked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per node: time the rank was held, of which transfer (modelled), of which waiting."""
        g, c = self.graph, self.costs
        k = g.kind
        held = np.where(_advance_after(g) & (k != COMPUTE), self.end - self.start, 0)
        target = np.where(k == WAIT, g.wait_of, np.arange(g.n_nodes))
        kt = k[target]
        ref = g.ref[target]
        w0 = np.zeros(g.n_nodes, np.int64)
        w1 = np.zeros(g.n_nodes, np.int64)
        m = kt == COLL
        w1[m] = self.end[target[m]]
        w0[m] = w1[m] - c.inst[ref[m]]
        m = (kt == SEND) | (kt == RECV)
        send = g.msg_send[ref[m]]
        w0[m] = self.start[send]
        w1[m] = w0[m] + c.msg[ref[m]]
        comm = np.clip(np.minimum(self.end, w1) - np.maximum(self.start, w0), 0, None)
        comm = np.where(held > 0, np.minimum(comm, held), 0)
        return held, comm, held - comm

    def breakdown(self) -> dict[str, np.ndarray]:
        """Per rank (int64 ns): ``compute``, ``communication`` (modelled
        transfer the rank was held for), ``waiting`` (held while peers had not
        arrived or data was in flight from a late sender) and ``total``
        (when the rank finished; the three parts add up to it)."""
        g = self.graph
        held, comm, wait = self._blocked
        compute = np.where(g.kind == COMPUTE, self.end - self.start, 0)

        def per_rank(x: np.ndarray) -> np.ndarray:
            out = np.zeros(g.world_size, np.int64)
            np.add.at(out, g.rank, x)
            return out

        last = np.where(_advance_after(g), self.end, self.start)
        total = np.zeros(g.world_size, np.int64)
        np.maximum.at(total, g.rank, last)
        return {"compute": per_rank(compute), "communication": per_rank(comm), "waiting": per_rank(wait),
                "total": total}

    # -- groups
    def group_ranking(self) -> list[GroupTime]:
        """Groups by time their members were held in their communication, largest first."""
        g, c = self.graph, self.costs
        held, _, wait = self._blocked
        target = np.where(g.kind == WAIT, g.wait_of, np.arange(g.n_nodes))
        grp = g.group[target]
        on = (grp >= 0) & (held > 0)
        ng = len(g.groups)
        blocked = np.zeros(ng, np.int64)
        waiting = np.zeros(ng, np.int64)
        np.add.at(blocked, grp[on], held[on])
        np.add.at(waiting, grp[on], wait[on])
        modelled = np.zeros(ng, np.int64)
        np.add.at(modelled, g.inst_group, c.inst)
        np.add.at(modelled, g.msg_group, c.msg)
        calls = np.bincount(g.inst_group, minlength=ng) + np.bincount(g.msg_group, minlength=ng)
        out = [GroupTime(gr.gid, len(gr.ranks), int(calls[i]), int(modelled[i]), int(blocked[i]), int(waiting[i]))
               for i, gr in enumerate(g.groups) if calls[i]]
        out.sort(key=lambda x: (-x.blocked_ns, -x.modelled_ns, x.gid))
        return out

    # -- critical path
    def critical_path(self) -> list[PathStep]:
        """The chain of nodes that bound the makespan, first to last.

        Walks back from the latest end: a compute binds its own time, a
        collective binds [last arrival, completion] and then the last-arriving
        member's rank, a receive whose data arrived after it was posted binds
        the transfer and then the sender's rank; a wait follows the op it waited
        for. The steps' lengths add up to the makespan.
        """
        g = self.graph
        if g.n_nodes == 0:
            return []
        start, end, kind, ref = self.start, self.end, g.kind, g.ref
        after = _advance_after(g)
        rank_first = g.rank_ptr[g.rank]
        n = int(np.argmax(end))  # first node with the latest end
        explain_end = True
        steps: list[PathStep] = []
        while True:
            k = int(kind[n])
            if explain_end:
                if k == COMPUTE:
                    steps.append(PathStep(n, int(g.rank[n]), "compute", int(start[n]), int(end[n])))
                elif k == COLL:
                    i = int(ref[n])
                    members = g.inst_nodes[g.inst_ptr[i]:g.inst_ptr[i + 1]]
                    last = int(members[np.argmax(start[members])])
                    steps.append(PathStep(n, int(g.rank[n]), "coll", int(start[last]), int(end[n])))
                    n = last
                elif k == SEND:
                    steps.append(PathStep(n, int(g.rank[n]), "send", int(start[n]), int(end[n])))
                elif k == RECV and end[n] > start[n]:
                    s = int(g.msg_send[ref[n]])
                    steps.append(PathStep(n, int(g.rank[n]), "recv", int(start[s]), int(end[n])))
                    n = s
                elif k == WAIT and end[n] > start[n]:
                    n = int(g.wait_of[n])
                    continue
                explain_end = False
                continue
            # explain the start of n: its predecessor on the rank
            if n == rank_first[n]:
                break
            n -= 1
            explain_end = bool(after[n])
        steps.reverse()
        return steps

    def summary(self, warmup: int = DEFAULT_WARMUP) -> dict:
        """Plain-data summary (for ``--json`` and reports)."""
        b = self.breakdown()
        path = self.critical_path()
        on_path = {"compute": 0, "communication": 0}
        for s in path:
            on_path["compute" if s.what == "compute" else "communication"] += s.t1 - s.t0
        times = self.iteration_times
        out = {
            "world_size": self.graph.world_size,
            "steps": len(times),
            "warmup": warmup,
            "iteration_times_ns": times.tolist(),
            "mean_iteration_time_ns": self.mean_iteration_time(warmup) if len(times) > warmup else None,
            "makespan_ns": self.makespan_ns,
            "two_clock": self.costs.two_clock,
            "cost_model": {"name": self.costs.model.name, "source": self.costs.model.source,
                           "description": self.costs.model.description},
            "breakdown_ns": {key: {"mean": float(v.mean()), "min": int(v.min()), "max": int(v.max()),
                                   "max_rank": int(v.argmax())} for key, v in b.items()},
            "critical_path": {"steps": len(path), "compute_ns": on_path["compute"],
                              "communication_ns": on_path["communication"],
                              "ranks": sorted({s.rank for s in path})[:64]},
            "groups": [{"gid": x.gid, "size": x.size, "calls": x.calls, "modelled_ns": x.modelled_ns,
                        "blocked_ns": x.blocked_ns, "waiting_ns": x.waiting_ns} for x in self.group_ranking()[:20]],
        }
        return out


# ------------------------------------------------------------ reference loop
def replay_reference(graph: ExecutionGraph, durations: np.ndarray | None = None,
                     cost_model: CostModel = ZERO) -> ReplayResult:
    """A plain heapq discrete-event loop over Python lists (the yardstick)."""
    costs = Costs.of(graph, durations, cost_model)
    kind = graph.kind.tolist()
    rank_of = graph.rank.tolist()
    is_async = graph.is_async.tolist()
    ref = graph.ref.tolist()
    wait_of = graph.wait_of.tolist()
    dur = costs.dur.tolist()
    two = costs.two_clock
    if two:
        cpu_of, gpu_of, join_of = costs.cpu.tolist(), costs.gpu.tolist(), costs.join.tolist()
        free_of = costs.free.tolist()
    clk = [0] * graph.world_size  # per rank: the CPU clock (two-clock nodes only)
    icost = costs.inst.tolist()
    mcost = costs.msg.tolist()
    msg_send = graph.msg_send.tolist()
    msg_recv = graph.msg_recv.tolist()
    size = graph.group_size[graph.inst_group].tolist()
    inst_ptr = graph.inst_ptr.tolist()
    inst_nodes = graph.inst_nodes.tolist()
    ptr = graph.rank_ptr.tolist()
    n = graph.n_nodes
    start = [-1] * n
    end = [-1] * n
    arrived = [0] * graph.n_instances
    amax = [0] * graph.n_instances
    waiter: dict[int, int] = {}  # async op node -> WAIT node blocked on it
    pos = ptr[:-1]
    heap = [(0, NORMAL, r, r) for r in range(graph.world_size) if ptr[r] < ptr[r + 1]]
    heapq.heapify(heap)
    seq = graph.world_size
    push = heapq.heappush
    pop = heapq.heappop
    while heap:
        t, _, _, r = pop(heap)
        nd = pos[r]
        pos[r] = nd + 1
        more = nd + 1 < ptr[r + 1]
        k = kind[nd]
        start[nd] = t
        wake: list[tuple[int, int]] = []  # (time, node whose rank resumes)
        cont = -1  # when this rank continues (-1: blocked)
        if k == 0:  # COMPUTE
            if two and cpu_of[nd] >= 0:
                # t is the rank's GPU stream; clk[r] its CPU, which issued the work
                s = clk[r]
                e = (t if t > s else s) + gpu_of[nd]
                ca = s + cpu_of[nd]
                if ca > e:
                    e = ca
                if s + free_of[nd] > e:  # -1: unknown, never above
                    e = s + free_of[nd]
                clk[r] = e if join_of[nd] else ca
                end[nd] = cont = e
            else:
                end[nd] = cont = t + dur[nd]
                if clk[r] < cont:  # a one-clock node holds both clocks
                    clk[r] = cont
        elif k == 5:  # ITER
            end[nd] = cont = t
        elif k == 1:  # COLL
            i = ref[nd]
            arrived[i] += 1
            if t > amax[i]:
                amax[i] = t
            if is_async[nd]:
                cont = t
            if arrived[i] == size[i]:
                c = amax[i] + icost[i]
                for m in inst_nodes[inst_ptr[i]:inst_ptr[i + 1]]:
                    end[m] = c
                    if not is_async[m]:
                        wake.append((c, m))
                    elif m in waiter:
                        w = waiter.pop(m)
                        end[w] = max(start[w], c)
                        wake.append((end[w], w))
        elif k == 2:  # SEND
            j = ref[nd]
            e = t + mcost[j]
            end[nd] = e
            cont = t if is_async[nd] else e
            rv = msg_recv[j]
            if start[rv] >= 0 and end[rv] < 0:
                end[rv] = max(start[rv], e)
                if not is_async[rv]:
                    wake.append((end[rv], rv))
                elif rv in waiter:
                    w = waiter.pop(rv)
                    end[w] = max(start[w], end[rv])
                    wake.append((end[w], w))
        elif k == 3:  # RECV
            j = ref[nd]
            s = msg_send[j]
            if start[s] >= 0:
                end[nd] = max(t, start[s] + mcost[j])
                cont = t if is_async[nd] else end[nd]
            elif is_async[nd]:
                cont = t
        else:  # WAIT
            o = wait_of[nd]
            if end[o] >= 0:
                end[nd] = cont = max(t, end[o])
            else:
                waiter[o] = nd
        for tw, m in wake:
            if m == nd:
                cont = tw
                continue
            rm = rank_of[m]
            if pos[rm] < ptr[rm + 1]:
                push(heap, (tw, URGENT, seq, rm))
                seq += 1
        if cont >= 0 and more:
            push(heap, (cont, NORMAL, seq, r))
            seq += 1
    stuck = [r for r in range(graph.world_size) if pos[r] < ptr[r + 1] or (ptr[r] < ptr[r + 1] and end[pos[r] - 1] < 0)]
    if stuck:
        raise ReplayError(f"replay stopped with ranks {stuck[:16]} blocked (a graph that passed its deadlock check; "
                          "a Prism bug: please report it)")
    return ReplayResult(graph, costs, np.array(start, np.int64), np.array(end, np.int64))


# ---------------------------------------------------------- steppable engine
class SteppableReplay:
    """The replay as a resumable event loop paced by the caller's clock.

    ``next_event_time()`` is the simulated time (ns) of the next event, or
    ``None`` when done. ``step(now)`` processes that one event if it is due
    (its time <= ``now``) and returns ``(event_time, node)``, else ``None``;
    ``advance(now)`` processes every due event and returns how many. Timelines
    use event times, never ``now``, so pacing does not change the result;
    ``lag_ns`` tells a real-time shell how far behind ``now`` the last
    processed event was due (say so loudly when it grows).
    """

    def __init__(self, graph: ExecutionGraph, durations: np.ndarray | None = None,
                 cost_model: CostModel = ZERO) -> None:
        self._setup(graph, Costs.of(graph, durations, cost_model))

    def _setup(self, graph: ExecutionGraph, costs: Costs) -> None:
        self.graph = graph
        self.costs = costs
        n = graph.n_nodes
        q = lambda a: array("q", np.ascontiguousarray(a, dtype=np.int64).tobytes())  # noqa: E731
        self._kind = array("b", graph.kind.tobytes())
        self._rank = q(graph.rank)
        self._async = array("b", graph.is_async.astype(np.int8).tobytes())
        self._ref = q(graph.ref)
        self._wait_of = q(graph.wait_of)
        self._dur = q(self.costs.dur)
        self._two = self.costs.two_clock
        if self._two:
            self._cpu = q(self.costs.cpu)
            self._gpu = q(self.costs.gpu)
            self._join = array("b", self.costs.join.astype(np.int8).tobytes())
            self._free = q(self.costs.free)
        self._clk = array("q", bytes(8 * graph.world_size))
        self._icost = q(self.costs.inst)
        self._mcost = q(self.costs.msg)
        self._msg_send = q(graph.msg_send)
        self._msg_recv = q(graph.msg_recv)
        self._size = q(graph.group_size[graph.inst_group])
        self._inst_ptr = q(graph.inst_ptr)
        self._inst_nodes = q(graph.inst_nodes)
        self._ptr = q(graph.rank_ptr)
        self._start = array("q", bytes(8 * n))
        self._end = array("q", bytes(8 * n))
        for a in (self._start, self._end):
            a[:] = array("q", np.full(n, -1, np.int64).tobytes())
        self._arrived = array("q", bytes(8 * graph.n_instances))
        self._amax = array("q", bytes(8 * graph.n_instances))
        self._waiter: dict[int, int] = {}
        self._pos = q(graph.rank_ptr[:-1])
        self._heap = [(0, NORMAL, r, r) for r in range(graph.world_size) if graph.rank_ptr[r] < graph.rank_ptr[r + 1]]
        heapq.heapify(self._heap)
        self._seq = graph.world_size
        self.events = 0
        self.lag_ns = 0

    def next_event_time(self) -> int | None:
        return self._heap[0][0] if self._heap else None

    @property
    def done(self) -> bool:
        return not self._heap

    def step(self, now: int) -> tuple[int, int] | None:
        """Process the next event if it is due at ``now``; return (time, node)."""
        if not self._heap or self._heap[0][0] > now:
            return None
        t, node = self._process()
        self.lag_ns = now - t
        return t, node

    def advance(self, now: int) -> int:
        """Process every event due at or before ``now``; return how many."""
        heap = self._heap
        count = 0
        t = now
        while heap and heap[0][0] <= now:
            t, _ = self._process()
            count += 1
        if count:
            self.lag_ns = now - t
        return count

    def run(self) -> ReplayResult:
        """Process everything as fast as possible and return the result."""
        heap = self._heap
        process = self._process
        while heap:
            process()
        return self.result()

    def result(self) -> ReplayResult:
        if self._heap:
            raise ReplayError(f"the replay is not finished: next event at {self._heap[0][0]} ns; "
                              "keep calling advance(now) until next_event_time() is None")
        g = self.graph
        ptr, pos, end = self._ptr, self._pos, self._end
        stuck = [r for r in range(g.world_size) if pos[r] < ptr[r + 1] or (ptr[r] < ptr[r + 1] and end[pos[r] - 1] < 0)]
        if stuck:
            raise ReplayError(f"replay stopped with ranks {stuck[:16]} blocked (a graph that passed its deadlock "
                              "check; a Prism bug: please report it)")
        return ReplayResult(g, self.costs, np.frombuffer(self._start, np.int64).copy(),
                            np.frombuffer(self._end, np.int64).copy())

    def _push(self, t: int, prio: int, r: int) -> None:
        heapq.heappush(self._heap, (t, prio, self._seq, r))
        self._seq += 1

    def _process(self) -> tuple[int, int]:
        t, _, _, r = heapq.heappop(self._heap)
        return self._handle(t, r)

    def _handle(self, t: int, r: int) -> tuple[int, int]:
        """Rank ``r``'s queued event at ``t``, taken off the queue: process its next node."""
        self.events += 1
        pos, ptr, start, end = self._pos, self._ptr, self._start, self._end
        is_async, waiter = self._async, self._waiter
        nd = pos[r]
        pos[r] = nd + 1
        more = nd + 1 < ptr[r + 1]
        k = self._kind[nd]
        start[nd] = t
        cont = -1
        if k == COMPUTE:
            if self._two and self._cpu[nd] >= 0:
                s = self._clk[r]
                e = (t if t > s else s) + self._gpu[nd]
                ca = s + self._cpu[nd]
                if ca > e:
                    e = ca
                if s + self._free[nd] > e:  # -1: unknown, never above
                    e = s + self._free[nd]
                self._clk[r] = e if self._join[nd] else ca
                end[nd] = cont = e
            else:
                end[nd] = cont = t + self._dur[nd]
                if self._clk[r] < cont:  # a one-clock node holds both clocks
                    self._clk[r] = cont
        elif k == ITER:
            end[nd] = cont = t
        elif k == COLL:
            i = self._ref[nd]
            self._arrived[i] += 1
            if t > self._amax[i]:
                self._amax[i] = t
            if is_async[nd]:
                cont = t
            if self._arrived[i] == self._size[i]:
                c = self._amax[i] + self._icost[i]
                rank_of = self._rank
                for m in self._inst_nodes[self._inst_ptr[i]:self._inst_ptr[i + 1]]:
                    end[m] = c
                    if not is_async[m]:
                        if m == nd:
                            cont = c
                        else:  # _wake, inlined: it runs for every member of every completed instance
                            rm = rank_of[m]
                            if pos[rm] < ptr[rm + 1]:
                                self._push(c, URGENT, rm)
                    elif m in waiter:
                        w = waiter.pop(m)
                        end[w] = max(start[w], c)
                        self._wake(end[w], w)
        elif k == SEND:
            j = self._ref[nd]
            e = t + self._mcost[j]
            end[nd] = e
            cont = t if is_async[nd] else e
            rv = self._msg_recv[j]
            if start[rv] >= 0 and end[rv] < 0:
                end[rv] = max(start[rv], e)
                if not is_async[rv]:
                    self._wake(end[rv], rv)
                elif rv in waiter:
                    w = waiter.pop(rv)
                    end[w] = max(start[w], end[rv])
                    self._wake(end[w], w)
        elif k == RECV:
            j = self._ref[nd]
            s = self._msg_send[j]
            if start[s] >= 0:
                end[nd] = max(t, start[s] + self._mcost[j])
                cont = t if is_async[nd] else end[nd]
            elif is_async[nd]:
                cont = t
        else:  # WAIT
            o = self._wait_of[nd]
            if end[o] >= 0:
                end[nd] = cont = max(t, end[o])
            else:
                waiter[o] = nd
        if cont >= 0 and more:
            self._push(cont, NORMAL, r)
        return t, nd

    def _wake(self, t: int, node: int) -> None:
        r = self._rank[node]
        if self._pos[r] < self._ptr[r + 1]:
            self._push(t, URGENT, r)


# ------------------------------------------------------------- batch engine
@dataclass(frozen=True, slots=True)
class _BatchPlan:
    """Static, cost-independent arrays for replay_batch (cached per graph).

    Per entry of ``waves.bars``: the barrier's slot, the node whose end it
    waits for (itself unless a WAIT) and that node's kind, reference and
    slot, and for p2p the send node and its slot. Per entry of
    ``waves.insts``: the member nodes, concatenated, and their slots.
    """

    first_node_of_slot: np.ndarray
    bslot: np.ndarray
    target: np.ndarray
    tslot: np.ndarray
    t_coll: np.ndarray  # bool
    t_send: np.ndarray  # bool
    t_inst: np.ndarray  # instance of a COLL target, else 0
    t_msg: np.ndarray  # message of a SEND/RECV target, else -1
    snode: np.ndarray  # send node of a p2p target, else the target
    sslot: np.ndarray
    members: np.ndarray
    mslot: np.ndarray
    member_ptr: np.ndarray


def _plan(graph: ExecutionGraph) -> _BatchPlan:
    plan = getattr(graph, "_batch_plan", None)
    if plan is not None:
        return plan
    w = graph.waves
    first = np.empty(graph.n_slots, np.int64)
    first[graph.slot_base] = graph.rank_ptr[:-1]
    first[graph.slot[graph.bars] + 1] = graph.bars + 1
    target = np.where(graph.kind[w.bars] == WAIT, graph.wait_of[w.bars], w.bars)
    tk = graph.kind[target]
    tref = graph.ref[target]
    t_coll = tk == COLL
    t_p2p = ~t_coll
    t_msg = np.where(t_p2p, tref, -1)
    snode = target.copy()
    snode[t_p2p] = graph.msg_send[tref[t_p2p]]
    st = graph.inst_ptr[w.insts]
    ln = graph.inst_ptr[w.insts + 1] - st
    members = graph.inst_nodes[_range_gather(st, ln)]
    plan = _BatchPlan(first, graph.slot[w.bars], target, graph.slot[target], t_coll, tk == SEND,
                      np.where(t_coll, tref, 0), t_msg, snode, graph.slot[snode], members, graph.slot[members],
                      np.append(0, np.cumsum(ln)))
    graph._batch_plan = plan
    return plan


def replay_batch(graph: ExecutionGraph, durations: np.ndarray | None = None,
                 cost_model: CostModel = ZERO) -> ReplayResult:
    """The replay computed with numpy, one wave of blocking points at a time.

    Gives exactly the timelines of ``replay_reference`` and ``SteppableReplay``.
    The first call on a graph builds a small static plan (cached on the graph).
    A graph with two-clock compute nodes (GPU captures) is replayed by the
    event loop instead: a node's end then depends on its rank's CPU clock as
    well as on its start, so segments are no longer offsets from their start.
    """
    costs = Costs.of(graph, durations, cost_model)
    if costs.two_clock:
        eng = SteppableReplay.__new__(SteppableReplay)
        eng._setup(graph, costs)
        return eng.run()
    p = _plan(graph)
    g, w = graph, graph.waves
    kind, ref, slot = g.kind, g.ref, g.slot
    # local advance: compute durations and blocking sends' p2p time; a node's
    # start is its segment's start plus the advances before it in the segment
    inc = np.where(kind == COMPUTE, costs.dur, 0)
    bs = (kind == SEND) & ~g.is_async
    inc[bs] = costs.msg[ref[bs]]
    cex = np.zeros(g.n_nodes + 1, np.int64)
    np.cumsum(inc, out=cex[1:])
    offset = cex[:-1] - cex[p.first_node_of_slot[slot]]
    # everything per wave that does not depend on earlier waves, computed once
    off_b, off_t, off_s = offset[w.bars], offset[p.target], offset[p.snode]
    mc = np.where(p.t_msg >= 0, costs.msg[np.maximum(p.t_msg, 0)] if g.n_messages else 0, 0)
    moff = offset[p.members]
    mptr = p.member_ptr
    seg = np.zeros(g.n_slots, np.int64)  # segment start times (origins stay 0)
    C = np.zeros(max(g.n_instances, 1), np.int64)
    icost = costs.inst
    bptr, iptr = w.bar_ptr.tolist(), w.inst_ptr.tolist()
    bslot, tslot, sslot, t_coll, t_send, t_inst = p.bslot, p.tslot, p.sslot, p.t_coll, p.t_send, p.t_inst
    insts, mslot = w.insts, p.mslot
    maximum, where, maxreduce = np.maximum, np.where, np.maximum.reduceat
    for k in range(w.count):
        b0, b1 = bptr[k], bptr[k + 1]
        if b1 > b0:
            R = seg[bslot[b0:b1]] + off_b[b0:b1]
            ts = seg[tslot[b0:b1]] + off_t[b0:b1]
            arrive = seg[sslot[b0:b1]] + off_s[b0:b1] + mc[b0:b1]
            oend = where(t_coll[b0:b1], C[t_inst[b0:b1]],
                         where(t_send[b0:b1], arrive, maximum(ts, arrive)))
            seg[bslot[b0:b1] + 1] = maximum(R, oend)
        i0, i1 = iptr[k], iptr[k + 1]
        if i1 > i0:
            m0, m1 = mptr[i0], mptr[i1]
            ci = insts[i0:i1]
            C[ci] = maxreduce(seg[mslot[m0:m1]] + moff[m0:m1], mptr[i0:i1] - m0) + icost[ci]
    start = seg[slot] + offset
    end = start.copy()
    m = kind == COMPUTE
    end[m] += costs.dur[m]
    m = kind == SEND
    end[m] += costs.msg[ref[m]]
    m = kind == RECV
    end[m] = np.maximum(start[m], start[g.msg_send[ref[m]]] + costs.msg[ref[m]])
    m = kind == COLL
    end[m] = C[ref[m]]
    m = kind == WAIT
    end[m] = seg[slot[m] + 1]
    return ReplayResult(g, costs, start, end)


def describe_step(graph: ExecutionGraph, step: PathStep) -> str:
    """Human line for a critical-path step."""
    return f"{step.t0:>14,} .. {step.t1:>14,} ns  {step.t1 - step.t0:>12,} ns  {graph.describe(step.node)}"
