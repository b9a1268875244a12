"""Synthetic Megatron-style runs for tests and benchmarks (sans-IO).

``MegatronSpec`` describes a tp x pp x dp (optionally EP) training job laid out
as Megatron-LM lays it out (``rank = tp + TP * (dp + DP * pp)``, see
docs/DESIGN.md). Per iteration every rank runs a 1F1B pipeline schedule over
``micro_batches`` micro-batches; each layer's forward and backward have two
tensor-parallel all_reduces (attention, MLP), optionally wrapped around an
expert-parallel all_to_all pair; stages exchange activations and gradients
with blocking sends and receives; the iteration ends with ``dp_buckets`` async
data-parallel gradient all_reduces overlapped with the last compute, their
waits, the optimizer step and the iteration mark.

Two builders produce the *same* run (a test checks it node by node):

``megatron_events(spec)``  PrismTrace event lists per rank (``GroupCreated``,
    ``Compute``, ``Collective``, ``P2P``, ``Iteration``), so the trace loader
    (``ExecutionGraph.from_events``) is exercised. Python objects, one per
    event: fine up to a few hundred thousand events.
``megatron_graph(spec)``   the ``ExecutionGraph`` built directly from numpy
    columns (one template per pipeline stage, tiled over the stage's ranks).
    Used for the 8,192-rank benchmark, where building ~10 million event
    objects would take longer than replaying them.

Durations are synthetic (``fwd_ns`` per layer half, backward twice that, plus
seeded per-rank jitter), not measurements of any model. Recorded timestamps
follow a simple local clock: a compute segment takes its duration, every call,
wait and iteration mark takes 1 ns, and an async op's record is written at
its wait point (as a real writer does on completion).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prism.core.graph import (
    COLL,
    COMPUTE,
    ITER,
    OP_CODE,
    OPS,
    RECV,
    SEND,
    WAIT,
    ExecutionGraph,
    Group,
    NodeColumns,
)
from prism.core.trace import P2P, Collective, Compute, Event, GroupCreated, Iteration


@dataclass(frozen=True, slots=True)
class MegatronSpec:
    """A synthetic tp x pp x dp (x ep) job; sizes in elements of ``dtype`` (bf16)."""

    tp: int = 2
    pp: int = 2
    dp: int = 2
    ep: int = 1
    micro_batches: int = 4
    layers_per_stage: int = 2
    iterations: int = 2
    dp_buckets: int = 2
    hidden: int = 1024
    seq_len: int = 512
    micro_batch_size: int = 1
    fwd_ns: int = 200_000
    #: Relative spread of compute durations (uniform in [1-jitter, 1+jitter]).
    jitter: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep", "micro_batches", "layers_per_stage", "iterations", "dp_buckets"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"MegatronSpec.{name} must be a positive int, got {v!r}")
        if self.dp % self.ep:
            raise ValueError(f"MegatronSpec: dp ({self.dp}) must be a multiple of ep ({self.ep}), as docs/DESIGN.md's layout requires")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"MegatronSpec.jitter must be in [0, 1), got {self.jitter!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, t: int, d: int, p: int) -> int:
        return t + self.tp * (d + self.dp * p)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)


# Template row: (kind, dur_units, async, group_kind, seq, op, nbytes, peer_delta, wait_of, step)
# dur_units are multiples of fwd_ns; group_kind in "tp", "dp", "pp", "ep" or "".
_BF16 = 2


def _stage_template(spec: MegatronSpec, p: int) -> list[tuple]:
    rows: list[tuple] = []
    seqs = {"tp": 0, "dp": 0, "ep": 0}
    act = spec.micro_batch_size * spec.seq_len * spec.hidden * _BF16
    params_per_layer = 12 * spec.hidden * spec.hidden // spec.tp
    grad_bytes = spec.layers_per_stage * params_per_layer * _BF16
    bucket = grad_bytes // spec.dp_buckets

    def comp(units: float, step: int) -> None:
        rows.append((COMPUTE, units, False, "", 0, -1, 0, 0, -1, step))

    def coll(gk: str, op: str, nbytes: int, step: int, is_async: bool = False) -> int:
        rows.append((COLL, 0, is_async, gk, seqs[gk], OP_CODE[op], nbytes, 0, -1, step))
        seqs[gk] += 1
        return len(rows) - 1

    # pseq counts per (src, dst, tag): one stream per (direction, peer) of the stage
    streams: dict[tuple[str, int], int] = {}

    def p2p(op: str, delta: int, step: int) -> None:
        pseq = streams.get((op, delta), 0)
        streams[(op, delta)] = pseq + 1
        rows.append((SEND if op == "send" else RECV, 0, False, "pp", pseq, OP_CODE[op], act // spec.tp, delta, -1, step))

    def layer(step: int, backward: bool) -> None:
        units = 2.0 if backward else 1.0
        comp(units, step)
        coll("tp", "all_reduce", act, step)
        if spec.ep > 1:
            coll("ep", "all_to_all_single", act // spec.ep, step)
            comp(units, step)
            coll("ep", "all_to_all_single", act // spec.ep, step)
        comp(units, step)
        coll("tp", "all_reduce", act, step)

    def forward(step: int) -> None:
        if p > 0:
            p2p("recv", -1, step)
        for _ in range(spec.layers_per_stage):
            layer(step, False)
        comp(0.25, step)
        if p < spec.pp - 1:
            p2p("send", +1, step)

    def backward(step: int) -> None:
        if p < spec.pp - 1:
            p2p("recv", +1, step)
        for _ in range(spec.layers_per_stage):
            layer(step, True)
        comp(0.25, step)
        if p > 0:
            p2p("send", -1, step)

    m = spec.micro_batches
    warm = min(spec.pp - p - 1, m)
    for step in range(spec.iterations):
        comp(0.5, step)  # data loading, embedding
        for _ in range(warm):
            forward(step)
        for _ in range(m - warm):
            forward(step)
            backward(step)
        for _ in range(warm):
            backward(step)
        issued = []
        for _ in range(spec.dp_buckets):
            issued.append(coll("dp", "all_reduce", bucket, step, is_async=True))
            comp(0.1, step)  # the remaining backward work the bucket overlaps
        for idx in issued:
            rows.append((WAIT, 0, False, "", 0, -1, 0, 0, idx, step))
        comp(1.0, step)  # optimizer
        rows.append((ITER, 0, False, "", 0, -1, 0, 0, -1, step))
    return rows


def _groups(spec: MegatronSpec) -> tuple[list[Group], dict[tuple, int]]:
    """All groups, sorted as ``from_events`` sorts them, and (kind, key) -> index."""
    tp, pp, dp, ep = spec.tp, spec.pp, spec.dp, spec.ep
    made: dict[tuple, tuple[str, tuple[int, ...]]] = {}
    for p in range(pp):
        for d in range(dp):
            made[("tp", d, p)] = (f"tp/d{d}/p{p}", tuple(spec.rank(t, d, p) for t in range(tp)))
        for t in range(tp):
            made[("dp", t, p)] = (f"dp/t{t}/p{p}", tuple(spec.rank(t, d, p) for d in range(dp)))
            if ep > 1:
                for e0 in range(0, dp, ep):
                    made[("ep", t, p, e0 // ep)] = (
                        f"ep/t{t}/p{p}/e{e0 // ep}", tuple(spec.rank(t, d, p) for d in range(e0, e0 + ep)))
    for d in range(dp):
        for t in range(tp):
            made[("pp", t, d)] = (f"pp/t{t}/d{d}", tuple(spec.rank(t, d, p) for p in range(pp)))
    world = spec.world_size
    # from_events' order: full-world groups first, then by gid
    keys = sorted(made, key=lambda k: (len(made[k][1]) != world, made[k][0]))
    groups = [Group(made[k][0], made[k][1]) for k in keys]
    index = {k: i for i, k in enumerate(keys)}
    return groups, index


def _group_key(spec: MegatronSpec, gk: str, rank: int) -> tuple:
    t, d, p = spec.coords(rank)
    if gk == "tp":
        return ("tp", d, p)
    if gk == "dp":
        return ("dp", t, p)
    if gk == "ep":
        return ("ep", t, p, d // spec.ep)
    return ("pp", t, d)


def _durations(spec: MegatronSpec, rank: int, units: np.ndarray) -> np.ndarray:
    u = np.random.default_rng([spec.seed, rank]).random(len(units))
    scale = 1.0 + spec.jitter * (2.0 * u - 1.0)
    return np.rint(units * spec.fwd_ns * scale).astype(np.int64)


def megatron_events(spec: MegatronSpec) -> dict[int, list[Event]]:
    """Per-rank PrismTrace event lists of the synthetic job (see module doc)."""
    groups, gindex = _groups(spec)
    templates = [_stage_template(spec, p) for p in range(spec.pp)]
    out: dict[int, list[Event]] = {}
    for r in range(spec.world_size):
        t, d, p = spec.coords(r)
        rows = templates[p]
        durs = _durations(spec, r, np.array([row[1] for row in rows], dtype=np.float64))
        evs: list[Event] = [GroupCreated(g.gid, g.ranks, k, g.gid, 0) for k, g in enumerate(groups) if r in g.ranks]
        clock = 0
        pending: dict[int, tuple] = {}  # template index of an async op -> (issue_ns, row)
        for i, row in enumerate(rows):
            kind, _, is_async, gk, seq, op, nbytes, delta, wait_of, step = row
            if kind == COMPUTE:
                dur = int(durs[i])
                evs.append(Compute(clock, clock + dur, step))
                clock += dur
            elif kind == ITER:
                evs.append(Iteration(step, clock))
                clock += 1
            elif kind == WAIT:
                issue, orow = pending.pop(wait_of)
                evs.append(_record(spec, r, gindex, groups, orow, issue, clock, clock + 1))
                clock += 1
            elif is_async:
                pending[i] = (clock, row)
                clock += 1
            else:
                evs.append(_record(spec, r, gindex, groups, row, clock, clock, clock + 1))
                clock += 1
        out[r] = evs
    return out


def _record(spec, r, gindex, groups, row, issue, wait, end) -> Event:
    kind, _, is_async, gk, seq, op, nbytes, delta, _, step = row
    gid = groups[gindex[_group_key(spec, gk, r)]].gid
    if kind == COLL:
        n = len(groups[gindex[_group_key(spec, gk, r)]].ranks)
        shape = (nbytes // _BF16,)
        if OPS[op] == "all_to_all_single":
            splits = tuple([nbytes // _BF16 // n] * n)
            return Collective(gid, seq, OPS[op], "", "bfloat16", (shape,), (shape,), nbytes, in_splits=splits,
                              out_splits=splits, async_op=is_async, issue_ns=issue, wait_ns=wait, end_ns=end, step=step)
        return Collective(gid, seq, OPS[op], "SUM", "bfloat16", (shape,), (shape,), nbytes, async_op=is_async,
                          issue_ns=issue, wait_ns=wait, end_ns=end, step=step)
    peer = r + delta * spec.tp * spec.dp
    return P2P(OPS[op], gid, peer, 0, seq, "bfloat16", (nbytes // _BF16,), nbytes, async_op=is_async,
               issue_ns=issue, wait_ns=wait, end_ns=end, step=step)


def megatron_graph(spec: MegatronSpec) -> ExecutionGraph:
    """The synthetic job's ``ExecutionGraph``, built from numpy columns directly."""
    groups, gindex = _groups(spec)
    world = spec.world_size
    per_rank = []
    sig_table = (("SUM", "bfloat16", None), ("", "bfloat16", None))
    for p in range(spec.pp):
        rows = _stage_template(spec, p)
        L = len(rows)
        cols = list(zip(*rows))
        kind = np.array(cols[0], np.int8)
        units = np.array(cols[1], np.float64)
        is_async = np.array(cols[2], bool)
        gk = np.array([{"": 0, "tp": 1, "dp": 2, "ep": 3, "pp": 4}[g] for g in cols[3]], np.int8)
        seq = np.array(cols[4], np.int64)
        op = np.array(cols[5], np.int16)
        nbytes = np.array(cols[6], np.int64)
        delta = np.array(cols[7], np.int64)
        wait_of = np.array(cols[8], np.int64)
        step = np.array(cols[9], np.int32)
        ranks = np.array([spec.rank(t, d, p) for d in range(spec.dp) for t in range(spec.tp)], np.int64)
        per_rank.append((p, ranks, L, kind, units, is_async, gk, seq, op, nbytes, delta, wait_of, step))
    # rows of rank r are template p(r); ranks ascend within and across stages
    stage_of = np.array([spec.coords(r)[2] for r in range(world)])
    lens = np.array([per_rank[p][2] for p in stage_of], np.int64)
    rank_ptr = np.append(0, np.cumsum(lens))
    n = int(rank_ptr[-1])
    out = {name: np.zeros(n, dt) for name, dt in (
        ("kind", np.int8), ("dur", np.int64), ("is_async", bool), ("group", np.int32), ("seq", np.int64),
        ("op", np.int16), ("sig", np.int32), ("peer", np.int32), ("tag", np.int64), ("nbytes", np.int64),
        ("wait_of", np.int64), ("step", np.int32), ("rec_start", np.int64), ("rec_end", np.int64))}
    rank_col = np.repeat(np.arange(world, dtype=np.int32), lens)
    for p, ranks, L, kind, units, is_async, gk, seq, op, nbytes, delta, wait_of, step in per_rank:
        R = len(ranks)
        base = rank_ptr[ranks]  # (R,)
        idx = (base[:, None] + np.arange(L)[None, :]).ravel()
        out["kind"][idx] = np.tile(kind, R)
        dur = np.stack([_durations(spec, int(r), units) for r in ranks]) * (kind == COMPUTE)[None, :]
        out["dur"][idx] = dur.ravel()
        out["is_async"][idx] = np.tile(is_async, R)
        out["seq"][idx] = np.tile(seq, R)
        out["op"][idx] = np.tile(op, R)
        out["nbytes"][idx] = np.tile(nbytes, R)
        out["step"][idx] = np.tile(step, R)
        out["wait_of"][idx] = np.where(np.tile(wait_of, R) >= 0,
                                       np.tile(wait_of, R) + np.repeat(base, L), -1)
        is_p2p = (kind == SEND) | (kind == RECV)
        out["peer"][idx] = np.where(np.tile(is_p2p, R),
                                    np.repeat(ranks, L) + np.tile(delta, R) * spec.tp * spec.dp, -1)
        is_a2a = op == OP_CODE["all_to_all_single"]
        out["sig"][idx] = np.tile(np.where(kind == COLL, np.where(is_a2a, 1, 0), -1), R)
        # group index per (rank, group kind)
        gmat = np.full((R, 5), -1, np.int32)
        for j, r in enumerate(ranks.tolist()):
            for code, name in ((1, "tp"), (2, "dp"), (3, "ep"), (4, "pp")):
                if name == "ep" and spec.ep == 1:
                    continue
                gmat[j, code] = gindex[_group_key(spec, name, r)]
        out["group"][idx] = gmat[np.arange(R)[:, None], np.tile(gk, (R, 1))].ravel()
        # recorded clock: compute advances by its duration, everything else by 1 ns
        adv = np.where(kind[None, :] == COMPUTE, dur, 1)
        start = np.cumsum(adv, axis=1) - adv
        end = start + adv
        wait_rows = np.flatnonzero(kind == WAIT)
        end[:, wait_of[wait_rows]] = end[:, wait_rows]
        end[:, kind == ITER] = start[:, kind == ITER]
        out["rec_start"][idx] = start.ravel()
        out["rec_end"][idx] = end.ravel()
    cols = NodeColumns(rank=rank_col, sig_table=sig_table, **out)
    return ExecutionGraph.from_columns(world, groups, cols)
