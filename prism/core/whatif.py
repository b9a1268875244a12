"""What-if knobs on a replay (sans-IO): slow ranks, slow links, a smaller GPU.

A campaign (``prism.core.campaign``) and ``prism predict`` ask how a job
would run if something were worse than in the capture. Each knob changes
what the replay is given, never the trace:

* ``straggler`` ``(rank, pct)``: rank ``rank`` is ``pct`` percent slower at
  everything it computes: its compute durations are multiplied by
  ``1 + pct/100`` (on GPU ranks both the CPU share and the GPU busy time: a
  slow host and a slow device). A rank in a synchronous all-reduce job slows
  every rank's iteration by about its extra compute, because everyone waits
  for it at the next collective.
* ``throttle`` ``(ranks, pct)``: the GPUs of ``ranks`` (None: all) run at a
  clock ``pct`` percent below nominal, so their device work takes
  ``1 / (1 - pct/100)`` times as long. On GPU ranks (two-clock nodes,
  docs/GPU-TIMING.md) only the GPU busy time stretches, the CPU's issue time
  does not; a CPU capture has one clock and all of it stretches.
* ``link`` ``(factor, tier)``: every link of ``tier`` ("all", "intra": inside
  a node, "inter": between nodes) is ``factor`` times slower: bandwidth
  divided by it, latencies and measured points' times multiplied by it, so a
  call over that tier takes exactly ``factor`` times its modelled time.
* ``memory_limit_gib``: the GPU has this much memory. A rank is out of memory
  when its peak allocated bytes in the trace (``Memory`` samples, written by
  GPU captures) plus ``memory_overhead_gib`` (what the real job holds outside
  torch's allocator: CUDA context, communication buffers) exceed it;
  ``check_memory`` says which rank and by how much. A CPU capture has no
  memory samples, so its verdict is "unknown", never "fits".

Ranks are those of the replayed graph (after ``--scale-dp``, the scaled
world's). ``apply_compute`` and ``apply_link`` return new objects; the graph
and model given are not changed.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from prism.core.costmodel import CostModel, Link, OpParams
from prism.core.graph import COMPUTE, ExecutionGraph
from prism.core.trace import Event, Memory

__all__ = ["WhatIf", "WhatIfError", "MemoryVerdict", "parse_straggler", "parse_throttle", "parse_link",
           "apply_compute", "apply_link", "peak_memory", "check_memory", "LINK_TIERS"]

GIB = 2**30
LINK_TIERS = ("all", "intra", "inter")


class WhatIfError(ValueError):
    """A what-if knob's value is invalid (the caller's fault); the text names the knob."""


@dataclass(frozen=True)
class WhatIf:
    """The knobs of one prediction; the default changes nothing."""

    #: (rank, percent slower) per straggler
    straggler: tuple[tuple[int, float], ...] = ()
    #: (ranks or None for all, percent below the nominal clock)
    throttle: tuple[tuple[int, ...] | None, float] | None = None
    #: (slowdown factor >= 1 or any positive number, tier)
    link: tuple[float, str] | None = None
    memory_limit_gib: float | None = None
    memory_overhead_gib: float = 0.6

    def __post_init__(self) -> None:
        for rank, pct in self.straggler:
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
                raise WhatIfError(f"straggler: rank must be a non-negative integer, got {rank!r}")
            if not math.isfinite(pct) or pct < 0:
                raise WhatIfError(f"straggler: percent must be >= 0, got {pct!r}")
        if self.throttle is not None:
            ranks, pct = self.throttle
            if not math.isfinite(pct) or not 0 <= pct < 100:
                raise WhatIfError(f"throttle: percent below the nominal clock must be in [0, 100), got {pct!r}")
            if ranks is not None and any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
                raise WhatIfError(f"throttle: ranks must be non-negative integers, got {ranks!r}")
        if self.link is not None:
            factor, tier = self.link
            if not math.isfinite(factor) or factor <= 0:
                raise WhatIfError(f"link slowdown: factor must be a positive number, got {factor!r}")
            if tier not in LINK_TIERS:
                raise WhatIfError(f"link slowdown: tier must be one of {LINK_TIERS}, got {tier!r}")
        if self.memory_limit_gib is not None and not (math.isfinite(self.memory_limit_gib)
                                                      and self.memory_limit_gib > 0):
            raise WhatIfError(f"memory limit must be a positive number of GiB, got {self.memory_limit_gib!r}")
        if not math.isfinite(self.memory_overhead_gib) or self.memory_overhead_gib < 0:
            raise WhatIfError(f"memory overhead must be >= 0 GiB, got {self.memory_overhead_gib!r}")

    @property
    def changes_compute(self) -> bool:
        return any(p for _, p in self.straggler) or (self.throttle is not None and self.throttle[1] > 0)

    def describe(self) -> list[str]:
        """One line per knob that is set, for reports."""
        out = [f"straggler: rank {r} computes {p:g}% slower" for r, p in self.straggler]
        if self.throttle is not None:
            ranks, pct = self.throttle
            who = "every rank" if ranks is None else "ranks " + ",".join(map(str, ranks))
            out.append(f"throttle: the GPU of {who} runs {pct:g}% below its clock "
                       f"(device work x{1 / (1 - pct / 100):.3f})")
        if self.link is not None:
            out.append(f"link slowdown: {self.link[1]} links x{self.link[0]:g} slower")
        if self.memory_limit_gib is not None:
            out.append(f"memory limit: {self.memory_limit_gib:g} GiB per GPU "
                       f"(of which {self.memory_overhead_gib:g} GiB held outside torch's allocator)")
        return out


def _pct(text: str, what: str) -> float:
    try:
        v = float(text.strip().rstrip("%"))
    except ValueError:
        raise WhatIfError(f"{what}: {text!r} is not a percentage") from None
    return v


def _ranks(text: str, what: str) -> tuple[int, ...] | None:
    text = text.strip()
    if text == "all":
        return None
    out: list[int] = []
    for part in text.split(","):
        a, sep, b = part.partition("-")
        if not a.strip().isdigit() or (sep and not b.strip().isdigit()):
            raise WhatIfError(f"{what}: {text!r} is not a rank list (e.g. 0,3 or 0-7 or all)")
        out.extend(range(int(a), int(b) + 1) if sep else [int(a)])
    return tuple(sorted(set(out)))


def parse_straggler(text: str) -> tuple[int, float]:
    """``"RANK:PCT"`` (``"3:20"``: rank 3 computes 20% slower)."""
    rank, sep, pct = text.partition(":")
    if not sep or not rank.strip().isdigit():
        raise WhatIfError(f"--straggler: {text!r} is not RANK:PCT (e.g. 3:20)")
    return int(rank), _pct(pct, "--straggler")


def parse_throttle(text: str) -> tuple[tuple[int, ...] | None, float]:
    """``"RANKS:PCT"`` (``"0-3:15"``, ``"all:10"``)."""
    ranks, sep, pct = text.rpartition(":")
    if not sep:
        raise WhatIfError(f"--throttle: {text!r} is not RANKS:PCT (e.g. 0-3:15 or all:10)")
    return _ranks(ranks, "--throttle"), _pct(pct, "--throttle")


def parse_link(text: str) -> tuple[float, str]:
    """``"X"`` or ``"X:TIER"`` (``"2"``, ``"1.5:inter"``)."""
    factor, _, tier = text.partition(":")
    try:
        x = float(factor)
    except ValueError:
        raise WhatIfError(f"--link-slowdown: {text!r} is not X or X:TIER (e.g. 2 or 1.5:inter)") from None
    return x, (tier.strip() or "all")


def _factors(graph: ExecutionGraph, w: WhatIf) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: the factor on all compute (straggler) and on device work (throttle)."""
    n = graph.world_size
    whole = np.ones(n)
    device = np.ones(n)
    for rank, pct in w.straggler:
        if rank >= n:
            raise WhatIfError(f"straggler: rank {rank} is not in the replayed world (ranks 0..{n - 1})")
        whole[rank] *= 1 + pct / 100
    if w.throttle is not None:
        ranks, pct = w.throttle
        bad = [r for r in (ranks or ()) if r >= n]
        if bad:
            raise WhatIfError(f"throttle: rank {bad[0]} is not in the replayed world (ranks 0..{n - 1})")
        sel = slice(None) if ranks is None else list(ranks)
        device[sel] *= 1 / (1 - pct / 100)
    return whole, device


def _scaled(values: np.ndarray, factor: np.ndarray, mask: np.ndarray) -> np.ndarray:
    out = values.copy()
    keep = mask & (values > 0)
    out[keep] = np.rint(values[keep] * factor[keep]).astype(np.int64)
    return out


def apply_compute(graph: ExecutionGraph, w: WhatIf) -> ExecutionGraph:
    """``graph`` with the compute durations the straggler and throttle knobs
    give (the same object when neither is set)."""
    if not w.changes_compute:
        return graph
    whole, device = _factors(graph, w)
    comp = graph.kind == COMPUTE
    rank = graph.rank.astype(np.int64)
    out = copy.copy(graph)
    # one clock: all of a segment is the rank's; both knobs stretch it
    out.dur = _scaled(graph.dur, (whole * device)[rank], comp)
    if graph.cpu is not None:
        two = comp & (graph.cpu >= 0)
        out.cpu = _scaled(graph.cpu, whole[rank], two)
        out.gpu = _scaled(graph.gpu, (whole * device)[rank], two)
        if graph.free is not None:
            out.free = _scaled(graph.free, (whole * device)[rank], two)
    return out


def _slow_link(link: Link, x: float) -> Link:
    return Link(link.bandwidth / x, link.latency * x)


def apply_link(model: CostModel, w: WhatIf) -> CostModel:
    """``model`` with the link knob applied (the same object when unset)."""
    if w.link is None or model._zero:
        return model
    x, tier = w.link
    intra = tier in ("all", "intra")
    inter = tier in ("all", "inter")
    per_op = tuple((op, OpParams(p.base_latency * x, p.latency * x, p.bandwidth / x, p.issue))
                   for op, p in model.per_op) if intra else model.per_op
    # measured points hold for groups inside one node (costmodel's docstring)
    measured = tuple((op, n, sizes, tuple(s * x for s in secs))
                     for op, n, sizes, secs in model.measured) if intra else model.measured
    return dataclasses.replace(
        model,
        intra=_slow_link(model.intra, x) if intra else model.intra,
        inter=_slow_link(model.inter, x) if inter else model.inter,
        # the per-call base latency is paid by every call; it slows with the whole fabric only
        base_latency=model.base_latency * x if tier == "all" else model.base_latency,
        per_op=per_op, measured=measured,
        description=(model.description + "; " if model.description else "") + f"{tier} links x{x:g} slower")


def peak_memory(ranks: Mapping[int, Sequence[Event]]) -> dict[int, int]:
    """Per rank with memory samples: its largest ``peak_allocated`` (bytes)."""
    out: dict[int, int] = {}
    for r, events in ranks.items():
        peaks = [e.peak_allocated for e in events if isinstance(e, Memory)]
        if peaks:
            out[r] = max(peaks)
    return out


@dataclass(frozen=True)
class MemoryVerdict:
    """Whether every rank fits in ``limit_gib``: "fits", "oom", "unchecked"
    (no limit given) or "unknown" (no memory samples). Ranks are the
    capture's: a scaled-out world's replicas hold what their original holds."""

    status: str
    limit_gib: float | None
    overhead_gib: float
    #: per rank: peak allocated bytes in the trace
    peaks: dict[int, int]
    #: the rank with the largest peak (None: no samples)
    worst_rank: int | None
    #: how far the worst rank's peak plus overhead is over (> 0) or under the limit, GiB
    over_gib: float | None
    #: ranks over the limit
    oom_ranks: tuple[int, ...] = ()

    @property
    def peak_gib(self) -> float | None:
        return None if self.worst_rank is None else self.peaks[self.worst_rank] / GIB

    def text(self) -> str:
        if self.worst_rank is None:
            return ("peak memory: unknown (the trace has no memory samples: a CPU capture records none; "
                    "capture on a GPU to check a memory limit)")
        head = f"peak memory: {self.peak_gib:.3f} GiB allocated on rank {self.worst_rank} (the largest)"
        if self.limit_gib is None:
            return head
        need = self.peak_gib + self.overhead_gib
        if self.status == "oom":
            return (f"{head}; OUT OF MEMORY under {self.limit_gib:g} GiB: rank {self.worst_rank} needs {need:.3f} GiB "
                    f"(with {self.overhead_gib:g} GiB overhead), {self.over_gib:.3f} GiB over; "
                    f"{len(self.oom_ranks)} rank(s) over the limit")
        return f"{head}; fits in {self.limit_gib:g} GiB with {-self.over_gib:.3f} GiB to spare"

    def summary(self) -> dict:
        return {"status": self.status, "limit_gib": self.limit_gib, "overhead_gib": self.overhead_gib,
                "worst_rank": self.worst_rank, "peak_gib": self.peak_gib, "over_gib": self.over_gib,
                "oom_ranks": list(self.oom_ranks), "peak_bytes_by_rank": {str(k): v for k, v in self.peaks.items()}}


def check_memory(peaks: Mapping[int, int], limit_gib: float | None, overhead_gib: float = 0.6) -> MemoryVerdict:
    """The memory verdict for per-rank ``peaks`` (bytes) under ``limit_gib``
    (None: report the peaks, judge nothing)."""
    peaks = dict(peaks)
    if not peaks:
        return MemoryVerdict("unknown", limit_gib, overhead_gib, peaks, None, None)
    worst = max(sorted(peaks), key=lambda r: peaks[r])
    if limit_gib is None:
        return MemoryVerdict("unchecked", None, overhead_gib, peaks, worst, None)
    limit = limit_gib * GIB - overhead_gib * GIB
    over = tuple(r for r in sorted(peaks) if peaks[r] > limit)
    return MemoryVerdict("oom" if over else "fits", limit_gib, overhead_gib, peaks, worst,
                         (peaks[worst] - limit) / GIB, over)
