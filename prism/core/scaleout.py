"""Grow a captured run to a larger data-parallel degree (sans-IO).

A run captured at ``tp x pp x dp`` (optionally with EP inside DP) is turned
into the run the same script would produce at ``tp x pp x dp'`` by
replicating data-parallel replicas and widening the groups that span DP.
Ranks follow docs/DESIGN.md's layout, ``rank = tp + TP * (dp + DP * pp)``;
``ep_rank = dp_rank % EP``.

What happens to each captured group (members ``T x D x P`` in coordinates;
every group must be such a product, else ``ScaleOutError``):

``replicate``  ``D`` is one DP rank (TP and pipeline groups) or an aligned
    block of ``k`` consecutive DP ranks (EP groups): the new world holds one
    copy per block of ``dp'``.
``widen``      ``D`` is every DP rank (DP groups, WORLD) or every ``k``-th one
    starting below ``k`` (expert-DP groups, stride EP): the group grows to
    every DP rank (every ``k``-th) of ``dp'``.

New rank ``(t, d', p)`` copies the events of its *source* ``(t, d' mod dp,
p)``: compute durations, collective and p2p records (bytes, shapes, splits,
recorded times), small tensor values, memory samples and iteration marks.
Group ids are recomputed with ``group_id`` in a creation order that extends
the captured one: consecutive captured groups of one family (same plan, same
number of TP and PP members) form a loop; its loop nesting is read off the
captured order and replayed over the new blocks, so a script that creates
its groups in uniform nested loops (as ``prism.workloads.gpt`` and
Megatron-LM do) gets the very ids it would create at ``dp'``; otherwise the
order is still one every rank agrees on.

Assumptions (documented, not checked):

* DP replicas are statistically alike: a new replica computes as long as the
  captured one it copies (compute durations are copied, not modelled), and
  MoE routing in a new EP block repeats its source block's (all_to_all
  splits and token counts are copied).
* Per-rank bytes of collectives on widened groups do not change with DP:
  true of gradient all_reduce (the gradient's size is the model's) and of
  loss all_reduce / broadcast. Ops whose shapes depend on the group size
  (all_gather, reduce_scatter, all_to_all, gather, scatter: ZeRO / FSDP
  sharding) on a widened group are refused with ``ScaleOutError`` rather
  than guessed.
* P2P stays inside a replica (pipeline sends); a send to another DP replica
  is refused.

Requirements: the captured ``dp`` is at least 2, and when ``ep > 1`` at
least ``2 * ep`` (otherwise an EP block and the whole DP dimension, or an
expert-DP group and a single replica, cannot be told apart); ``dp'`` is a
multiple of the captured ``dp``.

Two paths give the same result (``tests/unit/test_scaleout.py`` checks it):
``scale_events`` builds PrismTrace event lists (feed ``ExecutionGraph.from_events``);
``scale_graph`` tiles the captured graph's node columns with numpy and calls
``ExecutionGraph.from_columns`` directly, for worlds of thousands of ranks.
``structure`` / ``compare_structure`` summarise a graph's communication
structure (groups, collective counts by group kind and op, p2p) so a scaled
run can be compared with a real capture at that size.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from prism.core.graph import _SHAPE_CHECKED, COLL, OPS, RECV, SEND, ExecutionGraph, Group, NodeColumns
from prism.core.trace import (
    P2P,
    Collective,
    Event,
    GroupCreated,
    Manifest,
    RankStart,
    TensorValue,
    group_id,
)

__all__ = [
    "Layout",
    "ScaleOutError",
    "ScalePlan",
    "Structure",
    "compare_structure",
    "plan_scale_out",
    "scale_events",
    "scale_graph",
    "scale_out",
    "structure",
]

#: Collective ops whose per-rank shapes do not depend on the group's size.
_SIZE_FREE_OPS = frozenset({"all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "barrier"})


class ScaleOutError(ValueError):
    """The run cannot be scaled as asked (the run's layout, or the request)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """A tp x pp x dp (x ep) layout with Megatron's rank order (see module doc)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ScaleOutError(f"layout: {name} must be a positive int, got {v!r}")
        if self.dp % self.ep:
            raise ScaleOutError(f"layout: dp ({self.dp}) must be a multiple of ep ({self.ep}); EP groups live inside DP")

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> Layout:
        """The layout recorded in a run's manifest (missing degrees are 1).

        Raises ``ScaleOutError`` when the degrees do not multiply to the
        run's world size (the capture did not record its layout as flags).
        """
        known = {k: v for k, v in manifest.layout if k in ("tp", "pp", "dp", "ep")}
        lay = cls(**known)
        if lay.world_size != manifest.world_size:
            raise ScaleOutError(
                f"the manifest's layout {dict(manifest.layout)} gives tp*pp*dp = {lay.world_size} ranks but the run "
                f"has {manifest.world_size}; Prism reads the layout from --tp/--pp/--dp/--ep flags of the captured "
                "command. Pass the layout explicitly (--layout tp=2,pp=2,dp=4)"
            )
        return lay

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, t: int, d: int, p: int) -> int:
        return t + self.tp * (d + self.dp * p)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def with_dp(self, dp: int) -> Layout:
        return dataclasses.replace(self, dp=dp)


@dataclass(frozen=True, slots=True)
class _GroupShape:
    """A captured group as T x D x P and how it grows."""

    index: int
    gid: str
    ts: tuple[int, ...]
    ds: tuple[int, ...]
    ps: tuple[int, ...]
    how: str  # "replicate" | "widen"
    k: int  # replicate: block size; widen: stride
    ranks: tuple[int, ...]

    @property
    def family(self) -> tuple:
        return (self.how, self.k, len(self.ts), len(self.ps))

    def key(self) -> tuple:
        """(T, block or offset, P): tells the groups of one family apart."""
        return (self.ts, self.ds[0] // self.k if self.how == "replicate" else self.ds[0], self.ps)


def _shape_group(lay: Layout, index: int, gid: str, ranks: Sequence[int]) -> _GroupShape:
    if list(ranks) != sorted(ranks):
        raise ScaleOutError(f"group {gid!r} (index {index}) lists ranks {list(ranks)[:16]} out of ascending order; "
                            "scale-out needs groups made as dist.new_group makes them (sorted ranks)")
    coords = [lay.coords(r) for r in ranks]
    ts, ds, ps = (tuple(sorted({c[i] for c in coords})) for i in range(3))
    if len(ranks) != len(ts) * len(ds) * len(ps) or any(r >= lay.world_size for r in ranks):
        raise ScaleOutError(
            f"group {gid!r} (index {index}, ranks {list(ranks)[:16]}) is not a product of TP x DP x PP coordinates "
            f"in layout {lay}; scale-out only handles groups along the layout's axes"
        )
    DP, n = lay.dp, len(ds)
    if ds == tuple(range(DP)):
        how, k = "widen", 1
    elif n == 1:
        how, k = "replicate", 1
    elif ds == tuple(range(ds[0], ds[0] + n)) and ds[0] % n == 0 and DP % n == 0:
        how, k = "replicate", n
    elif (n >= 2 and (step := ds[1] - ds[0]) > 1 and ds[0] < step and DP % step == 0 and n == DP // step
          and ds == tuple(range(ds[0], DP, step))):
        how, k = "widen", step
    else:
        raise ScaleOutError(
            f"group {gid!r} (index {index}) spans DP ranks {list(ds)} of {DP}: neither one replica, an aligned "
            "block (EP), all of DP nor every k-th DP rank (expert-DP); scale-out does not know how it grows"
        )
    return _GroupShape(index, gid, ts, ds, ps, how, k, tuple(ranks))


@dataclass(frozen=True, slots=True)
class ScalePlan:
    """How a captured run maps onto the larger world (see ``plan_scale_out``).

    ``groups`` are the new world's groups in creation order (index, ranks,
    gid); ``gid_map[(old_gid, block)]`` is the new gid of a captured group as
    seen by a new rank whose DP rank lies in ``block`` (``d' // k`` for a
    replicated group, 0 for a widened one).
    """

    old: Layout
    new: Layout
    groups: tuple[tuple[int, tuple[int, ...], str], ...]
    shapes: Mapping[str, _GroupShape]
    gid_map: Mapping[tuple[str, int], str]

    @property
    def world_size(self) -> int:
        return self.new.world_size

    def source(self, rank: int) -> int:
        """The captured rank whose events new ``rank`` copies."""
        t, d, p = self.new.coords(rank)
        return self.old.rank(t, d % self.old.dp, p)

    def new_gid(self, old_gid: str, rank: int) -> str:
        """The new id of captured group ``old_gid`` as new ``rank`` (a member) sees it."""
        sh = self.shapes[old_gid]
        d = self.new.coords(rank)[1]
        key = (old_gid, d // sh.k if sh.how == "replicate" else 0)
        if key not in self.gid_map:
            raise ScaleOutError(f"rank {rank} (a copy of rank {self.source(rank)}) needs a copy of group {old_gid!r} "
                                f"for DP block {key[1]}, which the captured groups do not define")
        return self.gid_map[key]

    def shift(self, old_rank: int, rank: int) -> int:
        """``old_rank`` moved into new ``rank``'s replica (a p2p peer, a replicated group's member)."""
        t, d, p = self.old.coords(old_rank)
        nd = self.new.coords(rank)[1]
        return self.new.rank(t, d + nd - nd % self.old.dp, p)

    def keep(self, old_rank: int) -> int:
        """``old_rank`` at the same coordinates in the new world (a widened group's member)."""
        return self.new.rank(*self.old.coords(old_rank))

    @property
    def block(self) -> int:
        """DP ranks per replica block: the widest replicated group's (an EP block), else 1."""
        b = 1
        for sh in self.shapes.values():
            if sh.how == "replicate":
                b = math.lcm(b, sh.k)
        return b

    def fold(self, sandbox: Sequence[int]) -> dict[int, int]:
        """Ranks whose timeline equals another's in the grown run: follower -> representative.

        The new world's DP ranks fall into blocks of ``block``; a block copies
        captured block ``j mod (dp / block)``. Two blocks with one source and
        no sandbox rank compute the same durations, and their ranks meet other
        blocks only in collectives on widened groups, which hold both and
        complete at one time for all members: so their timelines are equal,
        whatever the sandbox does. Each such class keeps its first block; the
        others' ranks follow it (``HybridReplay(fold=...)``).
        """
        new, B = self.new, self.block
        old_blocks, new_blocks = self.old.dp // B, new.dp // B
        special = {new.coords(int(r))[1] // B for r in sandbox}
        rep: dict[int, int] = {}
        for j in range(new_blocks):
            if j not in special:
                rep.setdefault(j % old_blocks, j)
        out: dict[int, int] = {}
        for j in range(new_blocks):
            if j in special or rep[j % old_blocks] == j:
                continue
            shift = (rep[j % old_blocks] - j) * B
            for p in range(new.pp):
                for d in range(j * B, (j + 1) * B):
                    for t in range(new.tp):
                        out[new.rank(t, d, p)] = new.rank(t, d + shift, p)
        return out


def plan_scale_out(layout: Layout, groups: Mapping[str, tuple[int, Sequence[int]]], dp: int) -> ScalePlan:
    """Plan the growth of a run with ``layout`` and ``groups`` (gid -> (index, ranks)) to ``dp``."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ScaleOutError(f"target dp must be a positive int, got {dp!r}")
    if layout.dp < 2:
        raise ScaleOutError(f"the captured run has dp {layout.dp}; capture with dp >= 2 so DP groups can be told "
                            "from replica-local ones, then scale that")
    if layout.ep > 1 and layout.dp < 2 * layout.ep:
        raise ScaleOutError(f"the captured run has dp {layout.dp} and ep {layout.ep}; capture with dp >= 2*ep "
                            f"({2 * layout.ep}) so EP blocks and expert-DP groups can be told from DP groups")
    if dp % layout.dp:
        raise ScaleOutError(f"target dp {dp} must be a multiple of the captured dp {layout.dp} "
                            "(new replicas copy whole captured replicas)")
    new = layout.with_dp(dp)
    shapes: dict[str, _GroupShape] = {}
    by_index: dict[int, str] = {}
    for gid, (index, ranks) in groups.items():
        if index in by_index:
            raise ScaleOutError(f"groups {by_index[index]!r} and {gid!r} share creation index {index}")
        by_index[index] = gid
        if index != 0 or tuple(ranks) != tuple(range(layout.world_size)):
            shapes[gid] = _shape_group(layout, index, gid, ranks)
    new_groups: list[tuple[int, tuple[int, ...], str]] = []
    gid_map: dict[tuple[str, int], str] = {}
    if 0 in by_index and by_index[0] not in shapes:  # WORLD
        w = by_index[0]
        shapes[w] = _GroupShape(0, w, tuple(range(layout.tp)), tuple(range(layout.dp)), tuple(range(layout.pp)),
                                "widen", 1, tuple(range(layout.world_size)))
        new_groups.append((0, tuple(range(new.world_size)), group_id(0, range(new.world_size))))
        gid_map[(w, 0)] = new_groups[0][2]
    ordered = [shapes[by_index[i]] for i in sorted(by_index) if (by_index[i], 0) not in gid_map]
    for run, perm in _runs(ordered):
        made: dict[tuple, tuple[_GroupShape, int, range]] = {}
        for sh in run:
            if sh.how == "widen":
                made[sh.key()] = (sh, 0, range(sh.ds[0], dp, sh.k))
                continue
            old_blocks = layout.dp // sh.k
            for b in range(sh.ds[0] // sh.k, dp // sh.k, old_blocks):
                made[(sh.ts, b, sh.ps)] = (sh, b, range(b * sh.k, (b + 1) * sh.k))
        for key in sorted(made, key=lambda k: tuple(k[i] for i in perm)):
            sh, b, ds = made[key]
            ranks = tuple(sorted(new.rank(t, d, p) for t in sh.ts for d in ds for p in sh.ps))
            index = len(new_groups) + (0 if 0 in by_index else 1)
            gid = group_id(index, ranks)
            new_groups.append((index, ranks, gid))
            gid_map[(sh.gid, b)] = gid
    return ScalePlan(layout, new, tuple(new_groups), shapes, gid_map)


#: Loop nestings tried, outermost first; the first that orders a run wins.
_PERMS = ((2, 1, 0), (2, 0, 1), (1, 2, 0), (1, 0, 2), (0, 2, 1), (0, 1, 2))


def _runs(ordered: list[_GroupShape]) -> list[tuple[list[_GroupShape], tuple[int, int, int]]]:
    """Split groups (in creation order) into loops: consecutive groups of one
    family whose keys increase under some loop nesting."""
    out: list[tuple[list[_GroupShape], tuple[int, int, int]]] = []
    run: list[_GroupShape] = []
    perms: list[tuple[int, int, int]] = []
    for sh in ordered:
        if run and sh.family == run[-1].family:
            prev = run[-1].key()
            ok = [pm for pm in perms if tuple(sh.key()[i] for i in pm) > tuple(prev[i] for i in pm)]
            if ok:
                run.append(sh)
                perms = ok
                continue
        if run:
            out.append((run, perms[0]))
        run, perms = [sh], list(_PERMS)
    if run:
        out.append((run, perms[0]))
    return out


def _groups_of(ranks: Mapping[int, Sequence[Event]]) -> dict[str, tuple[int, tuple[int, ...]]]:
    groups: dict[str, tuple[int, tuple[int, ...]]] = {}
    for r, events in ranks.items():
        for ev in events:
            if type(ev) is GroupCreated:
                prev = groups.setdefault(ev.gid, (ev.index, tuple(ev.ranks)))
                if prev != (ev.index, tuple(ev.ranks)):
                    raise ScaleOutError(f"group {ev.gid!r}: rank {r} records index {ev.index} ranks {list(ev.ranks)}, "
                                        f"another rank index {prev[0]} ranks {list(prev[1])}; the trace is inconsistent")
    return groups


def _check_world(ranks: Mapping[int, Sequence[Event]], layout: Layout) -> None:
    if sorted(ranks) != list(range(layout.world_size)):
        raise ScaleOutError(f"the run has ranks {sorted(ranks)[:8]}... but layout {layout} needs ranks "
                            f"0..{layout.world_size - 1}")


_COLL_REF = re.compile(r"coll:([^:]+):(\d+):(.+)")
_P2P_REF = re.compile(r"p2p:(\d+):(\d+):(-?\d+):(\d+)")


def scale_events(ranks: Mapping[int, Sequence[Event]], layout: Layout, dp: int,
                 plan: ScalePlan | None = None) -> dict[int, list[Event]]:
    """The per-rank events of the run grown to ``dp`` (see the module doc).

    ``ranks`` maps every captured rank to its events; the result maps every
    rank of the ``tp x pp x dp`` world to its events and loads with
    ``ExecutionGraph.from_events``.
    """
    _check_world(ranks, layout)
    plan = plan or plan_scale_out(layout, _groups_of(ranks), dp)
    new_world = plan.world_size
    by_gid = {gid: (idx, rk) for idx, rk, gid in plan.groups}
    out: dict[int, list[Event]] = {}
    for r in range(new_world):
        src = plan.source(r)
        evs: list[Event] = []
        gmap: dict[str, str] = {}

        def gid_of(old: str) -> str:
            g = gmap.get(old)
            if g is None:
                g = gmap[old] = plan.new_gid(old, r)
            return g

        for ev in ranks[src]:
            t = type(ev)
            if t is GroupCreated:
                g = gid_of(ev.gid)
                idx, members = by_gid[g]
                evs.append(dataclasses.replace(ev, gid=g, ranks=members, index=idx, name=str(idx)))
            elif t is Collective:
                evs.append(_scale_coll(plan, ev, r, gid_of(ev.gid), by_gid))
            elif t is P2P:
                if plan.old.coords(ev.peer)[1] != plan.old.coords(src)[1]:
                    raise ScaleOutError(f"rank {src}: {ev.op} with peer {ev.peer} on group {ev.gid!r} crosses DP "
                                        "replicas; scale-out assumes p2p stays inside a replica (pipeline)")
                evs.append(dataclasses.replace(ev, gid=gid_of(ev.gid), peer=plan.shift(ev.peer, r)))
            elif t is TensorValue:
                evs.append(dataclasses.replace(ev, ref=_scale_ref(plan, ev.ref, r, gid_of)))
            elif t is RankStart:
                evs.append(dataclasses.replace(ev, rank=r, world_size=new_world))
            else:
                evs.append(ev)
        out[r] = evs
    return out


def _refusal(plan: ScalePlan, sh: _GroupShape, op: str, seq: int | None = None) -> ScaleOutError:
    at = f" (first at sequence {seq})" if seq is not None else ""
    return ScaleOutError(
        f"group {sh.gid!r} (creation index {sh.index}, ranks {_short(sh.ranks)}) spans DP and would widen from "
        f"{len(sh.ds)} to {plan.new.dp // sh.k} DP ranks, but it carries {op}{at}, whose per-rank shapes depend on "
        "the group's size (FSDP or a ZeRO optimizer: each rank holds 1/size of the state); scale-out would have to "
        f"guess them, so it refuses to widen it (it widens groups that carry only {', '.join(sorted(_SIZE_FREE_OPS))})")


def _scale_coll(plan: ScalePlan, ev: Collective, r: int, gid: str, by_gid) -> Collective:
    sh = plan.shapes[ev.gid]
    widened = sh.how == "widen" and plan.new.dp != plan.old.dp
    if widened and ev.op not in _SIZE_FREE_OPS:
        raise _refusal(plan, sh, ev.op, ev.seq)
    if ev.root < 0:
        return dataclasses.replace(ev, gid=gid)
    root_old = sh.ranks[ev.root]
    root_new = plan.keep(root_old) if sh.how == "widen" else plan.shift(root_old, r)
    return dataclasses.replace(ev, gid=gid, root=by_gid[gid][1].index(root_new))


def _scale_ref(plan: ScalePlan, ref: str, r: int, gid_of) -> str:
    m = _COLL_REF.fullmatch(ref)
    if m:
        return f"coll:{gid_of(m.group(1))}:{m.group(2)}:{m.group(3)}"
    m = _P2P_REF.fullmatch(ref)
    if m:
        s, d = int(m.group(1)), int(m.group(2))
        return f"p2p:{plan.shift(s, r)}:{plan.shift(d, r)}:{m.group(3)}:{m.group(4)}"
    raise ScaleOutError(f"value ref {ref!r} is neither coll:GID:SEQ:ROLE nor p2p:SRC:DST:TAG:PSEQ")


# ------------------------------------------------------------------- array path
def _signatures(graph: ExecutionGraph, ranks: Mapping[int, Sequence[Event]]) -> tuple[np.ndarray, tuple, np.ndarray, tuple]:
    """Per-node collective and p2p signature codes, as ``from_events`` computes them."""
    coll: dict[tuple[int, str, int], Collective] = {}
    p2p: dict[tuple[int, str, int, int, int], P2P] = {}
    for r, evs in ranks.items():
        for ev in evs:
            if type(ev) is Collective:
                coll[(r, ev.gid, ev.seq)] = ev
            elif type(ev) is P2P:
                p2p[(r, ev.op, ev.peer, ev.tag, ev.pseq)] = ev
    n = graph.n_nodes
    sig = np.full(n, -1, np.int32)
    psig = np.full(n, -1, np.int64)
    sigs: dict[tuple, int] = {}
    psigs: dict[tuple, int] = {}
    gids = [g.gid for g in graph.groups]
    for node in np.flatnonzero(graph.kind == COLL).tolist():
        ev = coll[(int(graph.rank[node]), gids[graph.group[node]], int(graph.seq[node]))]
        side = _SHAPE_CHECKED.get(ev.op)
        shapes = None if side is None else (ev.in_shapes if side == "in" else ev.out_shapes)
        sig[node] = sigs.setdefault((ev.reduce_op, ev.dtype, shapes), len(sigs))
    for node in np.flatnonzero((graph.kind == SEND) | (graph.kind == RECV)).tolist():
        op = OPS[graph.op[node]]
        ev = p2p[(int(graph.rank[node]), op, int(graph.peer[node]), int(graph.tag[node]), int(graph.seq[node]))]
        psig[node] = psigs.setdefault((ev.dtype, tuple(ev.shape)), len(psigs))
    return sig, tuple(sorted(sigs, key=sigs.get)), psig, tuple(sorted(psigs, key=psigs.get))


def _short(ranks: Sequence[int]) -> str:
    return str(list(ranks)) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:4]))}, ... {ranks[-1]}]"


def scale_graph(ranks: Mapping[int, Sequence[Event]], layout: Layout, dp: int,
                graph: ExecutionGraph | None = None) -> ExecutionGraph:
    """The execution graph of the run grown to ``dp``, built with numpy.

    Equal to ``ExecutionGraph.from_events(scale_events(ranks, layout, dp))``
    but without one Python object per new event: the captured graph's node
    columns are tiled over the new ranks. ``graph`` is the captured run's
    graph if already built.
    """
    return scale_out(ranks, layout, dp, graph)[0]


def scale_out(ranks: Mapping[int, Sequence[Event]], layout: Layout, dp: int,
              graph: ExecutionGraph | None = None) -> tuple[ExecutionGraph, ScalePlan]:
    """``scale_graph`` and the plan it followed (its groups, ``fold``)."""
    _check_world(ranks, layout)
    plan = plan_scale_out(layout, _groups_of(ranks), dp)
    g = graph if graph is not None else ExecutionGraph.from_events(ranks)
    for gi in np.unique(g.inst_group).tolist():
        sh = plan.shapes[g.groups[gi].gid]
        if sh.how == "widen" and plan.new.dp != plan.old.dp:
            bad = set(np.unique(g.inst_op[g.inst_group == gi]).tolist()) - {OPS.index(o) for o in _SIZE_FREE_OPS}
            if bad:
                raise _refusal(plan, sh, OPS[min(bad)])
    sig, sig_table, psig, psig_table = _signatures(g, ranks)
    new, old = plan.new, plan.old
    W = new.world_size
    new_ranks = np.arange(W, dtype=np.int64)
    t_new = new_ranks % new.tp
    d_new = (new_ranks // new.tp) % new.dp
    p_new = new_ranks // (new.tp * new.dp)
    src = t_new + old.tp * (d_new % old.dp + old.dp * p_new)
    lens = np.diff(g.rank_ptr)[src]
    new_ptr = np.zeros(W + 1, np.int64)
    np.cumsum(lens, out=new_ptr[1:])
    rows = np.arange(int(new_ptr[-1]), dtype=np.int64)
    owner = np.repeat(new_ranks, lens)
    take = rows - new_ptr[owner] + g.rank_ptr[src][owner]  # source row of every new row
    # group index table: (old group, new dp rank) -> new group index
    order = sorted(range(len(plan.groups)), key=lambda i: (len(plan.groups[i][1]) != W, plan.groups[i][2]))
    new_groups = [Group(plan.groups[i][2], plan.groups[i][1]) for i in order]
    new_index = {grp.gid: k for k, grp in enumerate(new_groups)}
    table = np.full((len(g.groups), new.dp), -1, np.int32)
    for gi, grp in enumerate(g.groups):
        sh = plan.shapes[grp.gid]
        for d in range(new.dp):
            key = (grp.gid, d // sh.k if sh.how == "replicate" else 0)
            if key in plan.gid_map:
                table[gi, d] = new_index[plan.gid_map[key]]
    d_row = d_new[owner]
    group = _tiled_groups(g.group[take], table, d_row)
    peer = _tiled_peers(g.peer[take], d_row, old, new)
    del d_row, rows
    # a collective's root is not a column: roots only matter to the events path
    wait_of = _tiled_waits(g.wait_of[take], g.rank_ptr[src][owner], new_ptr[owner])
    cols = NodeColumns(
        rank=owner.astype(np.int32), kind=g.kind[take], dur=g.dur[take], is_async=g.is_async[take], group=group,
        seq=g.seq[take], op=g.op[take], sig=sig[take], peer=peer, tag=g.tag[take],
        nbytes=g.nbytes[take], wait_of=wait_of, step=g.step[take], rec_start=g.rec_start[take],
        rec_end=g.rec_end[take], sig_table=sig_table,
    )
    del group, peer, wait_of, owner  # the columns hold them; at 8,192 ranks each temporary is tens of MB
    p2p_sig = psig[take]
    del take
    return ExecutionGraph.from_columns(W, new_groups, cols, p2p_sig=p2p_sig, p2p_sig_table=psig_table), plan


def _tiled_groups(old_group: np.ndarray, table: np.ndarray, d_row: np.ndarray) -> np.ndarray:
    return np.where(old_group >= 0, table[np.maximum(old_group, 0), d_row], -1).astype(np.int32)


def _tiled_peers(old_peer: np.ndarray, d_row: np.ndarray, old: Layout, new: Layout) -> np.ndarray:
    """Peers move with their replica: d' - d' mod dp_old whole replicas up."""
    old_peer = old_peer.astype(np.int64)
    pt, pd, pp_ = old_peer % old.tp, (old_peer // old.tp) % old.dp, old_peer // (old.tp * old.dp)
    shift = d_row - d_row % old.dp
    return np.where(old_peer >= 0, pt + new.tp * (pd + shift + new.dp * pp_), -1).astype(np.int32)


def _tiled_waits(wait_of_old: np.ndarray, old_base: np.ndarray, new_base: np.ndarray) -> np.ndarray:
    return np.where(wait_of_old >= 0, wait_of_old - old_base + new_base, -1)


# ------------------------------------------------------------------- structure
@dataclass(frozen=True, slots=True)
class Structure:
    """A graph's communication structure, comparable across captures.

    ``group_kinds`` counts groups per kind (the layout axes they span: "tp",
    "dp", "pp", "dp-block2" for EP, "dp-stride2" for expert-DP, "tp+dp+pp"
    for WORLD, "single"); ``group_sizes`` counts groups per size;
    ``collectives`` counts collective instances per (kind, op);
    ``p2p`` counts messages per (kind of the group, bytes).
    """

    world_size: int
    groups: int
    group_kinds: tuple[tuple[str, int], ...]
    group_sizes: tuple[tuple[int, int], ...]
    collectives: tuple[tuple[tuple[str, str], int], ...]
    collective_bytes: tuple[tuple[tuple[str, str], int], ...]
    p2p: tuple[tuple[tuple[str, int], int], ...]


def _kind(lay: Layout, ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return "single"
    coords = [lay.coords(r) for r in ranks]
    parts = []
    for i, name in enumerate(("tp", "dp", "pp")):
        vals = sorted({c[i] for c in coords})
        if len(vals) == 1:
            continue
        n = {"tp": lay.tp, "dp": lay.dp, "pp": lay.pp}[name]
        if name != "dp" or len(vals) == n:
            parts.append(name)
        elif vals == list(range(vals[0], vals[0] + len(vals))):
            parts.append(f"dp-block{len(vals)}")
        else:
            parts.append(f"dp-stride{vals[1] - vals[0]}")
    return "+".join(parts)


def structure(graph: ExecutionGraph, layout: Layout) -> Structure:
    """Summarise ``graph``'s groups, collectives and p2p under ``layout``."""
    if graph.world_size != layout.world_size:
        raise ScaleOutError(f"the graph has {graph.world_size} ranks, layout {layout} {layout.world_size}")
    kinds = [_kind(layout, g.ranks) for g in graph.groups]
    ik = [kinds[i] for i in graph.inst_group.tolist()]
    iop = [OPS[o] for o in graph.inst_op.tolist()]
    coll = Counter(zip(ik, iop))
    cbytes: Counter = Counter()
    for k, o, b in zip(ik, iop, graph.inst_bytes.tolist()):
        cbytes[(k, o)] += b
    p2p = Counter(zip((kinds[i] for i in graph.msg_group.tolist()), graph.msg_bytes.tolist()))
    srt = lambda c: tuple(sorted(c.items()))  # noqa: E731
    return Structure(graph.world_size, len(graph.groups), srt(Counter(kinds)),
                     srt(Counter(len(g.ranks) for g in graph.groups)), srt(coll), srt(cbytes), srt(p2p))


def compare_structure(a: Structure, b: Structure) -> list[str]:
    """The differences between two structures, one line each (empty when equal)."""
    out = []
    for f in dataclasses.fields(Structure):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x == y:
            continue
        if isinstance(x, tuple):
            dx, dy = dict(x), dict(y)
            for key in sorted(set(dx) | set(dy), key=str):
                if dx.get(key) != dy.get(key):
                    out.append(f"{f.name}[{key}]: {dx.get(key)} vs {dy.get(key)}")
        else:
            out.append(f"{f.name}: {x} vs {y}")
    return out
