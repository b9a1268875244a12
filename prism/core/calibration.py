"""Slice calibration (phase 1, step 3): which ranks run together, and what their run measured.

The bare graph's compute durations come from a context-switched capture, in
which ranks that share cores or devices pollute each other's timing. A
*slice* is a set of ranks that fits the machine without swapping (a TP
group, a pipeline, a gang, a pair); each slice runs for real as sandbox
ranks against the bare graph (``prism emulate``), one slice after the other.
This module holds the decisions, without I/O:

- ``plan_slices``: the slices of a run, from its layout (``tp``, ``pp``,
  ``gang``, ``pairs``, ``auto``) or given explicitly (``"0,1;2,3"``);
- ``symmetry_classes`` and ``symmetric_plan``: ranks at the same position in
  the layout (same TP rank, PP stage and EP rank; only the DP replica
  differs) are equivalent, and the fewest slices holding one representative
  of each class are enough;
- ``measured_durations``: a sandbox rank's compute durations from its
  emulation trace, matched call by call to its nodes in the bare graph;
- ``apply_calibration``: a run's events with the calibrated durations.

Inter-slice alignment: each slice measures only its own ranks' compute
segments; the communication between slices and their relative timing are
not taken from the slices' clocks but from the graph. The calibrated
durations of all slices go into one graph and its replay puts them on one
timeline through the graph's dependencies (every collective instance waits
for its last member, every receive for its send), which is the alignment.

Rule for GPU captures: a segment the capture timed with two clocks
(``Compute.cpu_ns >= 0``, docs/GPU-TIMING.md) keeps its capture timing; only
one-clock (CPU-timed) segments take the slice's measurement.

Rule for CPU captures (PrismTrace 1.4): a one-clock segment whose main thread
was on a CPU for ``CLEAN_SHARE`` of its wall time or more
(``Compute.thread_cpu_ns``) was measured undisturbed and keeps its capture
timing too; only polluted ones (the rank descheduled by context switching, or
waiting for the GIL) take the slice's. ``keep_clean=False`` replaces every
one-clock segment (the rule before 1.4, and for traces without the field).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from prism.core.graph import program_order
from prism.core.scaleout import Layout
from prism.core.trace import P2P, Collective, Compute, Event, Iteration

__all__ = ["CLEAN_SHARE", "POLLUTED_SHARE", "cpu_share", "CalibrationError", "SLICE_MODES", "plan_slices", "pack_slices", "node_rounds", "symmetry_classes", "symmetric_plan",
           "Measured", "measured_durations", "expand_classes", "apply_calibration"]

#: Named ways to cut a run into slices (besides explicit ``"0,1;2,3"``).
SLICE_MODES = ("auto", "tp", "pp", "gang", "pairs")


class CalibrationError(ValueError):
    """A slice plan or a slice's measurement that cannot be used (names the rank, call or value)."""


# ----------------------------------------------------------------- planning
def _layout_slices(mode: str, layout: Layout) -> list[tuple[int, ...]]:
    t_, p_, d_ = layout.tp, layout.pp, layout.dp
    if mode == "tp":
        return [tuple(layout.rank(t, d, p) for t in range(t_)) for p in range(p_) for d in range(d_)]
    if mode == "pp":
        return [tuple(layout.rank(t, d, p) for p in range(p_)) for d in range(d_) for t in range(t_)]
    # gang: one DP replica's TP x PP block
    return [tuple(sorted(layout.rank(t, d, p) for p in range(p_) for t in range(t_))) for d in range(d_)]


def _pairs(world: int, size: int) -> list[tuple[int, ...]]:
    return [tuple(range(a, min(a + size, world))) for a in range(0, world, size)]


def plan_slices(world: int, spec: str, *, cores: int, layout: Layout | None = None) -> tuple[tuple[int, ...], ...]:
    """The slices of a world of ``world`` ranks; each holds at most ``cores`` ranks.

    ``spec``: ``"tp"`` (the TP groups), ``"pp"`` (the pipelines: one rank per
    stage, same TP and DP rank), ``"gang"`` (a DP replica's TP x PP block),
    ``"pairs"`` (ranks 0,1; 2,3; ...), ``"auto"`` (the TP groups if TP > 1,
    else the pipelines if PP > 1, else pairs; pairs too when those do not
    fit), or explicit slices ``"0,1;2,3"`` (ranks not named keep their bare
    durations). ``layout`` is needed for tp, pp and gang.
    """
    if cores < 1:
        raise CalibrationError(f"cores must be >= 1, got {cores}")
    spec = spec.strip()
    if spec in SLICE_MODES:
        mode = spec
        if mode == "auto":
            if layout is not None and layout.tp > 1 and layout.tp <= cores:
                mode = "tp"
            elif layout is not None and layout.tp == 1 and layout.pp > 1 and layout.pp <= cores:
                mode = "pp"
            else:
                return tuple(_pairs(world, min(2, cores)))
        if mode == "pairs":
            return tuple(_pairs(world, min(2, cores)))
        if layout is None:
            raise CalibrationError(f"--slices {mode} needs the run's layout (tp, pp, dp), and the run's manifest "
                                   "has none: pass --layout tp=T,pp=P,dp=D or explicit slices like 0,1;2,3")
        if layout.world_size != world:
            raise CalibrationError(f"layout {layout} has {layout.world_size} ranks but the run has {world}")
        if mode == "tp" and layout.tp == 1:
            raise CalibrationError("--slices tp: the run has no TP groups (tp = 1); use pp, pairs or auto")
        if mode == "pp" and layout.pp == 1:
            raise CalibrationError("--slices pp: the run has no pipeline (pp = 1); use tp, pairs or auto")
        slices = _layout_slices(mode, layout)
    else:
        slices = []
        seen: dict[int, int] = {}
        for k, part in enumerate(spec.split(";")):
            members = []
            for tok in part.split(","):
                tok = tok.strip()
                if not tok:
                    continue
                if not tok.isdigit():
                    raise CalibrationError(f"--slices: {tok!r} in slice {k} is not a rank; give "
                                           f"{', '.join(SLICE_MODES)} or slices like 0,1;2,3")
                r = int(tok)
                if r >= world:
                    raise CalibrationError(f"--slices: rank {r} in slice {k} is not in the run (world size {world}: "
                                           f"ranks 0..{world - 1})")
                if r in seen:
                    raise CalibrationError(f"--slices: rank {r} is in slice {seen[r]} and in slice {k}; a rank is "
                                           "calibrated once")
                seen[r] = k
                members.append(r)
            if not members:
                raise CalibrationError(f"--slices {spec!r}: slice {k} is empty")
            slices.append(tuple(sorted(members)))
    for s in slices:
        if len(s) > cores:
            raise CalibrationError(f"slice {','.join(map(str, s))} has {len(s)} ranks but only {cores} fit this "
                                   "machine (one core per sandbox rank, so its timing is not polluted); choose "
                                   "smaller slices (--slices pairs or explicit ones)")
    return tuple(slices)


def pack_slices(slices: Sequence[Sequence[int]], cores: int) -> tuple[tuple[int, ...], ...]:
    """Slices run together: consecutive slices merged while the merged one
    holds at most ``cores`` ranks (each slice kept whole, order kept).

    One slice alone leaves the rest of the machine idle, and an idle machine
    computes faster than a full one (a CPU's turbo clock and its shared caches
    and memory bandwidth; a GPU node's power and PCIe share): packed, the
    slices' ranks load the machine as the job's ranks did, one core each."""
    if cores < 1:
        raise CalibrationError(f"cores must be >= 1, got {cores}")
    out: list[tuple[int, ...]] = []
    cur: list[int] = []
    for s in slices:
        if len(s) > cores:
            raise CalibrationError(f"slice {','.join(map(str, s))} has {len(s)} ranks but only {cores} fit")
        if cur and len(cur) + len(s) > cores:
            out.append(tuple(sorted(cur)))
            cur = []
        cur.extend(s)
    if cur:
        out.append(tuple(sorted(cur)))
    return tuple(out)


def node_rounds(slices: int, agents: int) -> tuple[tuple[int, ...], ...]:
    """The slices (by index) run together: with ``agents`` nodes, one slice
    per node at a time, ``agents`` slices a round in order; without agents
    (0), one slice a round."""
    if slices < 0 or agents < 0:
        raise CalibrationError(f"slices and agents are counts, got {slices} and {agents}")
    per = max(agents, 1)
    return tuple(tuple(range(i, min(i + per, slices))) for i in range(0, slices, per))


def symmetry_classes(world: int, layout: Layout | None) -> tuple[tuple[int, ...], ...]:
    """Classes of equivalent ranks: same TP rank, PP stage and EP rank, any DP
    replica (in Megatron's order, ``prism.core.scaleout.Layout``). Without a
    layout every rank is its own class."""
    if layout is None:
        return tuple((r,) for r in range(world))
    if layout.world_size != world:
        raise CalibrationError(f"layout {layout} has {layout.world_size} ranks but the run has {world}")
    classes: dict[tuple[int, int, int], list[int]] = {}
    for r in range(world):
        t, d, p = layout.coords(r)
        classes.setdefault((p, t, d % layout.ep), []).append(r)
    return tuple(tuple(v) for _, v in sorted(classes.items(), key=lambda kv: kv[1][0]))


def symmetric_plan(slices: Sequence[Sequence[int]], classes: Sequence[Sequence[int]]
                   ) -> tuple[tuple[tuple[int, ...], ...], dict[int, int]]:
    """The fewest of ``slices`` (taken in order) that hold a rank of every
    class that a slice covers, and per rank the rank whose durations it takes
    (its class's representative: the first slice member of the class).
    Ranks of classes no slice holds are left out of the map."""
    cls_of = {r: k for k, c in enumerate(classes) for r in c}
    rep: dict[int, int] = {}
    kept = []
    for s in slices:
        new = [r for r in s if cls_of[r] not in rep]
        if not new:
            continue
        kept.append(tuple(s))
        for r in s:
            rep.setdefault(cls_of[r], r)
    rep_of = {r: rep[cls_of[r]] for r in cls_of if cls_of[r] in rep}
    return tuple(kept), rep_of


# -------------------------------------------------------------- measurement
@dataclass(frozen=True)
class Measured:
    """A sandbox rank's calibrated durations: per compute segment of the bare
    graph's rank (program order), and how they were obtained."""

    rank: int
    durations: np.ndarray  # int64 ns, one per Compute event in program order
    segments: int  # compute segments of the rank
    replaced: int  # those that took the slice's measurement
    kept_two_clock: int  # those kept because the capture timed them with two clocks
    regrouped: int  # gaps between calls whose segments were cut differently (their total split in proportion)
    kept_clean: int = 0  # one-clock segments kept because the capture ran them undisturbed (CLEAN_SHARE)
    #: ns totals: the kept-clean segments' (as captured), the replaced ones' as
    #: captured and as the slice measured them (where a calibration's change comes from)
    clean_ns: int = 0
    replaced_bare_ns: int = 0
    replaced_ns: int = 0


def _call_key(ev: Event) -> tuple:
    if isinstance(ev, Collective):
        return ev.op, ev.gid, ev.seq
    if isinstance(ev, P2P):
        return ev.op, ev.gid, ev.pseq, ev.peer
    return "step end", ev.step


def _describe(key: tuple) -> str:
    if key[0] == "step end":
        return f"the end of step {key[1]}"
    tail = f" peer {key[3]}" if len(key) > 3 else ""
    return f"{key[0]} on group {key[1]!r} seq {key[2]}{tail}"


def _walk(events: Sequence[Event]) -> tuple[list[tuple], list[list[Compute]]]:
    """A rank's calls (keys) in program order and the compute segments
    before each call (``gaps[k]``) and after the last (``gaps[-1]``).

    Calls are issues and step ends. The wait of an async op is not one: where
    it falls among the other calls depends on timing (a pipeline's irecv is
    waited on before or after the next send is issued, run by run), so it
    neither delimits a gap nor takes part in the comparison; its op's issue
    does."""
    calls: list[tuple] = []
    gaps: list[list[Compute]] = [[]]
    for _, sub, ev in program_order(events):
        if isinstance(ev, Compute):
            gaps[-1].append(ev)
        elif isinstance(ev, (Collective, P2P, Iteration)) and not sub:
            calls.append(_call_key(ev))
            gaps.append([])
    return calls, gaps


#: A one-clock segment whose main thread was on a CPU for at least this share
#: of its wall time (``Compute.thread_cpu_ns``) ran undisturbed in the capture:
#: calibration keeps its captured duration (``keep_clean``), since a slice run,
#: itself an emulation, measures it no better. Below it the rank was
#: descheduled or waited for the GIL: the measurement is polluted and the
#: slice's replaces it.
CLEAN_SHARE = 0.95


def _clean(ev: Compute) -> bool:
    wall = ev.end_ns - ev.start_ns
    return ev.cpu_ns < 0 and ev.thread_cpu_ns >= 0 and ev.thread_cpu_ns >= CLEAN_SHARE * wall


def measured_durations(rank: int, bare: Sequence[Event], slice_events: Sequence[Event], *,
                       keep_clean: bool = True) -> Measured:
    """Rank ``rank``'s compute durations as its slice run measured them.

    ``bare``: the rank's events in the capture; ``slice_events``: its events
    as a sandbox rank. The calls must match one by one (op, group, sequence;
    step ends), else ``CalibrationError`` names the rank and the call. Where
    a gap between two calls holds as many segments in both, each takes its
    measured duration; otherwise the gap's measured total is split over the
    capture's segments in proportion to their bare durations. With
    ``keep_clean`` the capture's undisturbed segments (``CLEAN_SHARE``) keep
    their captured durations.
    """
    want, bgaps = _walk(bare)
    got, egaps = _walk(slice_events)
    for k, key in enumerate(want):
        if k >= len(got):
            raise CalibrationError(f"rank {rank}: its slice run stopped after {len(got)} of the capture's {len(want)} "
                                   f"calls; the next one would have been call {k}, {_describe(key)}")
        if got[k] != key:
            raise CalibrationError(f"rank {rank}, call {k}: the slice run made {_describe(got[k])} where the capture "
                                   f"has {_describe(key)}; the program took another path than in the capture, so "
                                   "its durations cannot calibrate this graph")
    measured = [[ev.end_ns - ev.start_ns for ev in g] for g in egaps]
    d, replaced, kept, regrouped, clean, sums = _fill(bgaps, measured, keep_clean)
    return Measured(rank, d, len(d), replaced, kept, regrouped, clean, *sums)


def _shape(key: tuple) -> tuple:
    """A call's place in the program regardless of which replica's group it is on."""
    return key[:1] + key[2:3]


def _split(total: int, bare: Sequence[int]) -> list[int]:
    """``total`` split over segments in proportion to their bare durations."""
    base = sum(bare)
    if base > 0:
        return [int(round(total * d / base)) for d in bare]
    return [int(round(total / len(bare)))] * len(bare) if bare else []


def _fill(bgaps: list[list[Compute]], measured: list[list[int]],
          keep_clean: bool = True) -> tuple[np.ndarray, int, int, int, int, tuple[int, int, int]]:
    """Per bare segment its new duration: one to one where a gap holds as many
    measured segments, else the gap's measured total split in proportion;
    two-clock segments (and with ``keep_clean`` undisturbed ones) keep their
    bare duration. Also the counts and ``(clean_ns, replaced_bare_ns,
    replaced_ns)`` of ``Measured``."""
    out: list[int] = []
    replaced = kept = regrouped = clean = 0
    clean_ns = replaced_bare_ns = replaced_ns = 0
    for k, b in enumerate(bgaps):
        meas = measured[k] if k < len(measured) else []
        bare_d = [ev.end_ns - ev.start_ns for ev in b]
        if len(b) == len(meas):
            new = list(meas)
        else:
            regrouped += 1 if b else 0
            new = _split(sum(meas), bare_d)
        for ev, d_bare, d_new in zip(b, bare_d, new):
            if ev.cpu_ns >= 0:
                out.append(d_bare)
                kept += 1
            elif keep_clean and _clean(ev):
                out.append(d_bare)
                clean += 1
                clean_ns += d_bare
            else:
                out.append(max(int(d_new), 0))
                replaced += 1
                replaced_bare_ns += d_bare
                replaced_ns += out[-1]
    return (np.asarray(out, np.int64), replaced, kept, regrouped, clean,
            (clean_ns, replaced_bare_ns, replaced_ns))


def expand_classes(ranks: Mapping[int, Sequence[Event]], table: Mapping[int, np.ndarray],
                   rep_of: Mapping[int, int], *, keep_clean: bool = True) -> dict[int, Measured]:
    """Durations for every rank of ``rep_of`` from its representative's
    (``table``: per representative, its calibrated durations in program
    order). The member's calls must be the representative's (op and sequence,
    on its own replica's groups), else ``CalibrationError`` names both ranks
    and the call; a gap between calls takes the representative's measured
    gap, segment by segment where both cut it alike, else in proportion."""
    out = {}
    for r, p in sorted(rep_of.items()):
        if p not in table:
            raise CalibrationError(f"rank {r}'s representative {p} has no measured durations (a Prism bug: please "
                                   "report it)")
        calls_p, gaps_p = _walk(ranks[p])
        calls_r, gaps_r = _walk(ranks[r])
        for k in range(max(len(calls_p), len(calls_r))):
            a = _shape(calls_p[k]) if k < len(calls_p) else None
            b = _shape(calls_r[k]) if k < len(calls_r) else None
            if a != b:
                raise CalibrationError(
                    f"rank {r} is not symmetric to its class representative, rank {p}: at call {k} rank {r} has "
                    + (_describe(calls_r[k]) if b else "no more calls") + f" and rank {p} has "
                    + (_describe(calls_p[k]) if a else "no more calls") + "; calibrate without --symmetric")
        durs = iter(table[p].tolist())
        measured = [[next(durs) for _ in g] for g in gaps_p]
        d, replaced, kept, regrouped, clean, sums = _fill(gaps_r, measured, keep_clean)
        out[r] = Measured(r, d, len(d), replaced, kept, regrouped, clean, *sums)
    return out


def apply_calibration(ranks: Mapping[int, Sequence[Event]],
                      table: Mapping[int, np.ndarray]) -> dict[int, list[Event]]:
    """``ranks`` with the calibrated durations of ``table`` (rank -> one
    duration per Compute event in program order): each one-clock segment's
    end moves to its start plus the calibrated duration (program order goes
    by starts, so the graph's structure is unchanged); two-clock segments and
    ranks not in ``table`` stay as captured."""
    out = {}
    for r, events in ranks.items():
        durs = table.get(r)
        if durs is None:
            out[r] = list(events)
            continue
        order = [i for i, _, ev in program_order(events) if isinstance(ev, Compute)]
        if len(order) != len(durs):
            raise CalibrationError(f"rank {r}: the calibration holds {len(durs)} compute segments but the run has "
                                   f"{len(order)}; the trace changed since it was calibrated: run `prism calibrate` "
                                   "again")
        new = list(events)
        for i, d in zip(order, durs.tolist()):
            ev = new[i]
            if ev.cpu_ns < 0:
                new[i] = dataclasses.replace(ev, end_ns=ev.start_ns + int(d))
        out[r] = new
    return out


#: Below this share of their compute segments' wall time on a CPU, a CPU
#: capture's timing counts as polluted (ranks descheduled by context
#: switching, or waiting for the GIL): ``predict`` and ``emulate`` with no
#: calibration to use (``--calibration auto`` and none stored) say so and
#: point to ``prism calibrate``. Clean captures on a
#: 16-core host measured 88-99% (bench/results/accuracy-2026-12-04-h200cpu.md);
#: eight ranks on two cores far less.
POLLUTED_SHARE = 0.8


def cpu_share(ranks: Mapping[int, Sequence[Event]]) -> tuple[float, float, int, int, int] | None:
    """The CPU ranks' compute segments (PrismTrace 1.4, ``thread_cpu_ns``):
    (share of their wall time the main threads spent on a CPU, the lowest
    rank's share, that rank, segments, clean segments: on a CPU for
    ``CLEAN_SHARE`` or more).
    None where no segment has a CPU clock (GPU captures, older traces)."""
    wall = cpu = n = clean = 0
    worst: tuple[float, int] | None = None
    for rank, events in ranks.items():
        w = c = 0
        for ev in events:
            if type(ev) is Compute and ev.cpu_ns < 0 and ev.thread_cpu_ns >= 0:
                d = ev.end_ns - ev.start_ns
                w, c, n = w + d, c + min(ev.thread_cpu_ns, d), n + 1
                clean += ev.thread_cpu_ns >= CLEAN_SHARE * d
        if w:
            wall, cpu = wall + w, cpu + c
            if worst is None or c / w < worst[0]:
                worst = (c / w, rank)
    if not n or not wall or worst is None:
        return None
    return cpu / wall, worst[0], worst[1], n, clean
