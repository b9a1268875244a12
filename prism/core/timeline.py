"""Timelines of an execution graph and their Chrome trace (sans-IO).

A ``Timeline`` puts every node of an ``ExecutionGraph`` on one clock: either
the *predicted* times of a replay (``predicted_timeline``) or the *recorded*
timestamps converted to the coordinator's clock with each rank's clock offset
(``recorded_timeline``). Times are int64 ns from the timeline's origin (the
replay's time 0, or the earliest recorded node).

From a timeline this module derives, without any I/O:

``segments(tl)``
    what each rank was doing when: compute, communication (the modelled
    transfer while the rank was held by a blocking op or a wait), waiting
    (held while peers had not arrived or data was late) and async
    communication in flight (not holding the rank). Used by the Gantt plot.
``chrome_trace(tl, memory=...)``
    the Chrome trace event format (JSON object form) that Perfetto and
    chrome://tracing load; see its docstring for the layout.

The comm / waiting split of a held node uses the modelled cost of the op it
waits for: the transfer is the last ``cost`` ns of the held stretch (a
collective completes at last arrival + cost, a receive at send + cost), the
rest is waiting. On predicted timelines this is exactly ``ReplayResult.
breakdown``'s split; on recorded ones it applies the same model to measured
times.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from prism.core.graph import COLL, COMPUTE, ITER, KIND_NAMES, OPS, RECV, SEND, WAIT, ExecutionGraph
from prism.core.replay import Costs, ReplayResult
from prism.core.trace import Memory

__all__ = [
    "CATEGORIES",
    "PID_BASE",
    "PREDICTED",
    "RECORDED",
    "Segments",
    "Timeline",
    "chrome_trace",
    "predicted_timeline",
    "recorded_timeline",
    "segments",
    "TID_BASE",
]

PREDICTED, RECORDED = "predicted", "recorded"
#: Chrome trace pid of rank 0, and tid of a rank's compute thread. Not 0: Perfetto treats pid 0 as
#: the kernel's swapper and its maintainers advise synthetic traces to start at 1 (google/perfetto#394),
#: and some Perfetto UI versions merged tid 0 with tid 1.
PID_BASE, TID_BASE = 1, 1


@dataclass(frozen=True, slots=True, eq=False)
class Timeline:
    """Start and end (int64 ns, per node) of every node of ``graph`` on one clock.

    ``source`` is ``"predicted"`` or ``"recorded"``; ``costs`` holds the
    modelled communication costs used to split held time into transfer and
    waiting; ``offsets`` maps a rank's own clock onto this timeline
    (``timeline_ns = rank_ns + offsets[rank]``) for recorded timelines, and
    is ``None`` for predicted ones (see ``map_rank_time``).
    """

    graph: ExecutionGraph
    start: np.ndarray
    end: np.ndarray
    costs: Costs
    source: str
    offsets: np.ndarray | None = None

    def map_rank_time(self, rank: int, t_ns: int) -> int:
        """Where an instant of ``rank``'s own recorded clock falls on this timeline.

        Recorded: shifted by the rank's offset. Predicted: anchored on the
        rank's nodes: the instant keeps its distance from the start of the
        last node that had started by then (recorded), clipped to that node's
        predicted length; before the first node it maps to that node's start.
        Used to place memory samples, which the graph does not hold.
        """
        if self.offsets is not None:
            return int(t_ns + self.offsets[rank])
        g = self.graph
        sl = g.nodes_of(rank)
        rec = g.rec_start[sl]
        if len(rec) == 0:
            return 0
        i = int(np.searchsorted(rec, t_ns, side="right")) - 1
        if i < 0:
            return int(self.start[sl][0])
        n = sl.start + i
        return int(self.start[n] + min(max(t_ns - int(g.rec_start[n]), 0), int(self.end[n] - self.start[n])))


def predicted_timeline(result: ReplayResult) -> Timeline:
    """The timeline a replay predicts (its start/end per node, time 0 = start)."""
    return Timeline(result.graph, result.start, result.end, result.costs, PREDICTED)


def recorded_timeline(graph: ExecutionGraph, clock_offsets_ns: Sequence[int], costs: Costs) -> Timeline:
    """The recorded timestamps of ``graph`` on the coordinator's clock.

    ``clock_offsets_ns[r]`` is rank ``r``'s ``RankStart.clock_offset_ns``
    (``coordinator_ns = rank_ns + offset``). The origin is the earliest
    recorded node start of any rank. ``costs`` (``Costs.of(graph, cost_model=...)``)
    only splits held time into transfer and waiting for ``segments``.
    """
    off = np.asarray(clock_offsets_ns, dtype=np.int64)
    if off.shape != (graph.world_size,):
        raise ValueError(f"clock_offsets_ns needs one offset per rank ({graph.world_size}), got shape {off.shape}")
    shift = off[graph.rank]
    start = graph.rec_start + shift
    end = graph.rec_end + shift
    t0 = int(start.min()) if len(start) else 0
    return Timeline(graph, start - t0, end - t0, costs, RECORDED, off - t0)


# ------------------------------------------------------------------ segments
#: Categories of ``Segments``, in drawing order.
CATEGORIES = ("compute", "communication", "waiting", "async")


@dataclass(frozen=True, slots=True, eq=False)
class Segments:
    """Per category, parallel arrays ``rank``, ``t0``, ``t1`` (ns) and ``node``.

    ``compute``: compute segments. ``communication``: the modelled transfer
    while a blocking op or a wait held the rank. ``waiting``: the rest of the
    held time. ``async``: async collectives and p2p from issue to completion
    (the rank kept running; these overlap the other categories).
    """

    by_category: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]

    def totals(self, world_size: int) -> dict[str, np.ndarray]:
        """Per rank, the summed length (ns) of each category."""
        out = {}
        for cat, (rank, t0, t1, _) in self.by_category.items():
            tot = np.zeros(world_size, np.int64)
            np.add.at(tot, rank, t1 - t0)
            out[cat] = tot
        return out


def _target_cost(tl: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """Per node: the op it waits for (itself unless a WAIT) and that op's modelled cost."""
    g = tl.graph
    target = np.where(g.kind == WAIT, g.wait_of, np.arange(g.n_nodes))
    kt, ref = g.kind[target], g.ref[target]
    cost = np.zeros(g.n_nodes, np.int64)
    m = kt == COLL
    cost[m] = tl.costs.inst[ref[m]]
    m = (kt == SEND) | (kt == RECV)
    cost[m] = tl.costs.msg[ref[m]]
    return target, cost


def segments(tl: Timeline) -> Segments:
    """Split every rank's timeline into compute, communication, waiting, async."""
    g = tl.graph
    k, start, end = g.kind, tl.start, tl.end
    _, cost = _target_cost(tl)
    comm_kind = (k == COLL) | (k == SEND) | (k == RECV)
    held = (comm_kind & ~g.is_async) | (k == WAIT)
    split = np.clip(end - cost, start, end)  # transfer is the last `cost` ns of the held stretch

    def pick(mask: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> tuple:
        m = mask & (t1 > t0)
        idx = np.flatnonzero(m)
        return g.rank[idx].astype(np.int64), t0[idx], t1[idx], idx

    return Segments({
        "compute": pick(k == COMPUTE, start, end),
        "communication": pick(held, split, end),
        "waiting": pick(held, start, split),
        "async": pick(comm_kind & g.is_async, start, end),
    })


# -------------------------------------------------------------- chrome trace
def _us(ns: int) -> float:
    # Chrome trace timestamps are microseconds; three decimals keep the ns.
    return round(ns / 1000.0, 3)


def _ranks_label(ranks: Sequence[int], limit: int = 8) -> str:
    rs = list(ranks)
    if len(rs) <= limit:
        return "[" + ", ".join(map(str, rs)) + "]"
    return "[" + ", ".join(map(str, rs[:limit])) + f", ... {len(rs)} ranks]"


def _lanes(items: list[tuple[int, int, int]]) -> dict[int, int]:
    """Greedy interval partitioning: node -> lane so that a lane's slices never overlap.

    ``items`` are (start, end, node). Slices that merely touch share a lane.
    """
    lane_end: list[int] = []
    out: dict[int, int] = {}
    for s, e, n in sorted(items):
        for i, le in enumerate(lane_end):
            if s >= le:
                lane_end[i] = e
                out[n] = i
                break
        else:
            out[n] = len(lane_end)
            lane_end.append(e)
    return out


def _node_name(g: ExecutionGraph, n: int) -> tuple[str, dict]:
    """Slice name and args of a node."""
    k = int(g.kind[n])
    step = int(g.step[n])
    if k == COMPUTE:
        return "compute", {"op": "compute", "step": step}
    t = int(g.wait_of[n]) if k == WAIT else n
    kt = int(g.kind[t])
    gid = g.groups[int(g.group[t])].gid
    args = {"op": OPS[int(g.op[t])], "gid": gid, "seq": int(g.seq[t]), "bytes": int(g.nbytes[t]), "step": step}
    if kt in (SEND, RECV):
        args["peer"] = int(g.peer[t])
        args["tag"] = int(g.tag[t])
        name = f"send to {g.peer[t]}" if kt == SEND else f"recv from {g.peer[t]}"
    else:
        name = OPS[int(g.op[t])]
    if k == WAIT:
        args["op"] = "wait"
        args["waits_for"] = OPS[int(g.op[t])]
        return f"wait {name}", args
    if g.is_async[n]:
        args["async"] = True
    return name, args


def chrome_trace(
    tl: Timeline,
    memory: Mapping[int, Sequence[Memory]] | None = None,
    *,
    metadata: Mapping[str, object] | None = None,
    ranks: Sequence[int] | None = None,
) -> dict:
    """The timeline as a Chrome trace (JSON object format), ready to serialise.

    Layout (timestamps in µs, floats with ns precision):

    * one process per rank: ``pid`` = rank + ``PID_BASE`` (1: Perfetto
      reserves pid 0 for the kernel's swapper), named ``rank N``, sorted by rank;
    * per rank, the first thread (``tid`` = ``TID_BASE``), ``compute``, holds
      compute segments and waits for async ops (both hold the rank), and the
      rank's end-of-step instants;
    * per group the rank communicates on, a thread named by the gid and its
      member ranks holds that group's collectives, sends and receives. Slices
      on one thread never overlap partially: when ops overlap (async ops in
      flight together, or a blocking op issued while an async one is in
      flight) the later ones go to further threads of the same group, named
      ``... (overlap k)``;
    * every node but the end-of-step marks is an ``X`` slice with ``args``
      op, gid, seq, bytes, step (compute: op and step);
    * flow arrows (``s`` / ``f`` pairs, ``f`` binding to its enclosing slice):
      each send to its receive, and for each collective instance one arrow
      from every member's participation to the participation of the *last
      arriver*, whose slice ends at the instance's completion (so the arrows
      show who the collective waited for). A flow event sits at its slice's
      midpoint (the finish no earlier than the start) so it binds to that
      slice unambiguously;
    * ``C`` counters ``memory (MiB)`` (allocated, reserved, peak allocated)
      per rank from ``memory`` (rank -> ``Memory`` samples on the rank's
      clock, placed with ``Timeline.map_rank_time``);
    * global instants at each job step end (when the last rank finished it).

    ``ranks`` keeps only those ranks' processes (for runs of thousands of
    ranks, whose full trace is too large for a viewer); flows are kept when
    both ends are kept, so a collective whose last arriver is left out shows
    no arrows. Timestamps and step ends are those of the whole run.
    """
    g = tl.graph
    start, end = tl.start, tl.end
    if ranks is None:
        keep_rank = np.ones(g.world_size, bool)
    else:
        keep_rank = np.zeros(g.world_size, bool)
        chosen = np.asarray(list(ranks), dtype=np.int64)
        bad = chosen[(chosen < 0) | (chosen >= g.world_size)]
        if len(bad):
            raise ValueError(f"ranks {bad[:8].tolist()} are outside the run's world of {g.world_size} ranks")
        keep_rank[chosen] = True
    keep = keep_rank[g.rank]
    ev: list[dict] = []
    # thread assignment: (rank, track) with track -1 = compute, else group index
    track = np.where((g.kind == COMPUTE) | (g.kind == WAIT) | (g.kind == ITER), -1, g.group)
    tid = np.zeros(g.n_nodes, np.int64)
    for r in np.flatnonzero(keep_rank).tolist():
        sl = g.nodes_of(r)
        by_track: dict[int, list[tuple[int, int, int]]] = {}
        for n in range(sl.start, sl.stop):
            if g.kind[n] != ITER:
                by_track.setdefault(int(track[n]), []).append((int(start[n]), int(end[n]), n))
        ev.append({"ph": "M", "name": "process_name", "pid": r + PID_BASE, "args": {"name": f"rank {r}"}})
        ev.append({"ph": "M", "name": "process_sort_index", "pid": r + PID_BASE, "args": {"sort_index": r}})
        by_track.setdefault(-1, [])  # the compute thread (the first) also carries the step marks
        next_tid = TID_BASE
        for tr in sorted(by_track, key=lambda x: (x >= 0, x)):
            lanes = _lanes(by_track[tr])
            if tr >= 0:
                gr = g.groups[tr]
                label = f"{gr.gid} {_ranks_label(gr.ranks)}"
            else:
                label = "compute"
            nl = max(lanes.values(), default=0) + 1
            for lane in range(nl):
                t = next_tid + lane
                name = label if lane == 0 else f"{label} (overlap {lane})"
                ev.append({"ph": "M", "name": "thread_name", "pid": r + PID_BASE, "tid": t, "args": {"name": name}})
                ev.append({"ph": "M", "name": "thread_sort_index", "pid": r + PID_BASE, "tid": t,
                           "args": {"sort_index": t}})
            for n, lane in lanes.items():
                tid[n] = next_tid + lane
            next_tid += nl
    # slices and step marks
    kinds = g.kind
    for n in np.flatnonzero(keep).tolist():
        k = int(kinds[n])
        r = int(g.rank[n])
        if k == ITER:
            ev.append({"ph": "i", "s": "t", "name": f"end of step {g.step[n]}", "cat": "iteration",
                       "pid": r + PID_BASE, "tid": TID_BASE, "ts": _us(int(start[n])), "args": {"step": int(g.step[n])}})
            continue
        name, args = _node_name(g, n)
        ev.append({"ph": "X", "name": name, "cat": KIND_NAMES[k], "pid": r + PID_BASE, "tid": int(tid[n]),
                   "ts": _us(int(start[n])), "dur": _us(int(end[n] - start[n])), "args": args})
    # flows
    mid = (start + end) // 2
    flow_id = 0

    def flow(src: int, dst: int, name: str) -> None:
        nonlocal flow_id
        if not (keep[src] and keep[dst]):
            return
        flow_id += 1
        ts_s = int(mid[src])
        ts_f = min(max(int(mid[dst]), ts_s), int(end[dst]))
        ev.append({"ph": "s", "id": flow_id, "name": name, "cat": "flow", "pid": int(g.rank[src]) + PID_BASE,
                   "tid": int(tid[src]), "ts": _us(ts_s)})
        ev.append({"ph": "f", "bp": "e", "id": flow_id, "name": name, "cat": "flow", "pid": int(g.rank[dst]) + PID_BASE,
                   "tid": int(tid[dst]), "ts": _us(ts_f)})

    for j in range(g.n_messages):
        flow(int(g.msg_send[j]), int(g.msg_recv[j]), "p2p")
    for i in range(g.n_instances):
        members = g.inst_nodes[g.inst_ptr[i]:g.inst_ptr[i + 1]]
        last = int(members[np.argmax(start[members])])
        for m in members.tolist():
            if m != last:
                flow(m, last, "collective")
    # memory counters
    for r, samples in sorted((memory or {}).items()):
        if not 0 <= r < g.world_size:
            raise ValueError(f"memory samples for rank {r}, outside the graph's world of {g.world_size} ranks")
        if not keep_rank[r]:
            continue
        for s in samples:
            ev.append({"ph": "C", "name": "memory (MiB)", "pid": r + PID_BASE,
                       "ts": _us(tl.map_rank_time(r, s.t_ns)),
                       "args": {"allocated": s.allocated / 2**20, "reserved": s.reserved / 2**20,
                                "peak_allocated": s.peak_allocated / 2**20}})
    # job step ends
    it = np.flatnonzero(kinds == ITER)
    if len(it) and keep_rank.any():
        # global-scope instants; the pid only has to name a process that exists
        host = int(np.flatnonzero(keep_rank)[0]) + PID_BASE
        steps = np.unique(g.step[it])
        for s in steps.tolist():
            t = int(start[it[g.step[it] == s]].max())
            ev.append({"ph": "i", "s": "g", "name": f"step {s} ends (last rank)", "cat": "iteration",
                       "pid": host, "tid": TID_BASE, "ts": _us(t), "args": {"step": s}})
    other = {"source": tl.source, "cost_model": tl.costs.model.name, "world_size": g.world_size,
             "ranks_shown": int(keep_rank.sum()), "flows": flow_id}
    other.update(metadata or {})
    return {"traceEvents": ev, "displayTimeUnit": "ns", "otherData": other}
