"""Gantt chart and time breakdown of a timeline, drawn with matplotlib.

``write_plot(tl, path)`` draws two panels into one PNG (or any format
matplotlib writes, by the file's suffix):

* a per-rank Gantt chart: compute, communication (modelled transfer while
  the rank was held), waiting (held while peers had not arrived) and, as a
  thin bar under each row, async communication in flight; dashed vertical
  lines mark the job's step ends (the last rank's end of each step);
* a stacked bar per rank of the same categories' totals over the window.

Needs the optional ``plot`` extra (``matplotlib``). Uses the object API
(``Figure``) so that no global pyplot state or GUI backend is involved.
"""

from __future__ import annotations

import os

import numpy as np

from prism.core.graph import ITER
from prism.core.timeline import CATEGORIES, Timeline, segments

__all__ = ["COLOURS", "PlotUnavailableError", "write_plot", "step_window"]

COLOURS = {"compute": "#4C72B0", "communication": "#DD8452", "waiting": "#C44E52", "async": "#8C8C8C"}
#: Beyond this many ranks the Gantt chart shows an evenly spaced sample of them.
DEFAULT_MAX_RANKS = 64


class PlotUnavailableError(RuntimeError):
    """Plotting needs matplotlib, which is missing."""


def step_window(tl: Timeline, first: int | None, last: int | None) -> tuple[int, int]:
    """The time window (ns) of steps ``first .. last`` (inclusive; None = open end).

    A step's window runs from the job end of the previous step (time 0 for
    the first) to its own job end (when the last rank finished it).
    """
    g = tl.graph
    it = np.flatnonzero(g.kind == ITER)
    steps = np.unique(g.step[it])
    ends = np.array([int(tl.start[it[g.step[it] == s]].max()) for s in steps], np.int64)
    horizon = int(tl.end.max()) if g.n_nodes else 0
    if first is None and last is None:
        return 0, horizon
    if len(steps) == 0:
        raise ValueError("the run has no end-of-step marks, so a step window cannot be chosen; omit the steps")
    known = f"the run's steps are {steps[0]}..{steps[-1]}"
    t0, t1 = 0, horizon
    if first is not None:
        if first not in steps:
            raise ValueError(f"step {first} has no end-of-step marks; {known}")
        i = int(np.searchsorted(steps, first))
        t0 = int(ends[i - 1]) if i > 0 else 0
    if last is not None:
        if last not in steps:
            raise ValueError(f"step {last} has no end-of-step marks; {known}")
        t1 = int(ends[int(np.searchsorted(steps, last))])
    if t1 <= t0:
        raise ValueError(f"empty step window {first}..{last}: the last step must not come before the first")
    return t0, t1


def _unit(span_ns: int) -> tuple[float, str]:
    if span_ns >= 5e9:
        return 1e9, "s"
    if span_ns >= 5e6:
        return 1e6, "ms"
    return 1e3, "µs"


def write_plot(tl: Timeline, path: str | os.PathLike[str], *, steps: tuple[int | None, int | None] = (None, None),
               max_ranks: int = DEFAULT_MAX_RANKS, title: str = "") -> None:
    """Draw the Gantt chart and breakdown of ``tl`` to ``path`` (see the module docstring)."""
    try:
        from matplotlib.collections import PolyCollection
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise PlotUnavailableError("--plot needs matplotlib: pip install 'prism-emu[plot]' (or pip install matplotlib)") from None
    g = tl.graph
    t0, t1 = step_window(tl, *steps)
    world = g.world_size
    shown = np.arange(world) if world <= max_ranks else np.unique(np.linspace(0, world - 1, max_ranks).round().astype(int))
    row_of = np.full(world, -1)
    row_of[shown] = np.arange(len(shown))
    scale, unit = _unit(t1 - t0)
    seg = segments(tl)
    nrows = len(shown)
    fig = Figure(figsize=(14, 3 + 0.25 * nrows + 0.12 * nrows), layout="constrained")
    gantt, bars = fig.subplots(2, 1, height_ratios=[max(nrows, 2) + 1, max(nrows, 2) * 0.5])
    totals = {}
    for cat, (rank, s, e, _) in seg.by_category.items():
        # clip to the window; keep what overlaps it
        s_c, e_c = np.maximum(s, t0), np.minimum(e, t1)
        keep = e_c > s_c
        rank, s_c, e_c = rank[keep], s_c[keep], e_c[keep]
        tot = np.zeros(world, np.int64)
        np.add.at(tot, rank, e_c - s_c)
        totals[cat] = tot
        vis = row_of[rank] >= 0
        rows = row_of[rank[vis]]
        xs = (s_c[vis] - t0) / scale
        ws = (e_c[vis] - s_c[vis]) / scale
        if cat == "async":
            y, h = rows + 0.28, 0.14  # a thin bar under the row: in flight, not holding the rank
        else:
            y, h = rows - 0.35, 0.6
        # one collection of rectangles per category: tens of thousands of bars stay fast
        verts = np.stack([np.stack([xs, y], 1), np.stack([xs + ws, y], 1),
                          np.stack([xs + ws, y + h], 1), np.stack([xs, y + h], 1)], 1)
        gantt.add_collection(PolyCollection(verts, facecolors=COLOURS[cat], linewidths=0))
    it = np.flatnonzero(g.kind == ITER)
    for s in np.unique(g.step[it]).tolist():
        t = int(tl.start[it[g.step[it] == s]].max())
        if t0 < t <= t1:
            x = (t - t0) / scale
            gantt.axvline(x, color="black", linestyle="--", linewidth=0.8)
            gantt.text(x, -0.45, f"end of step {s} ", fontsize=8, va="bottom", ha="right")
    gantt.set_ylim(nrows - 0.5, -1.2)
    gantt.set_xlim(0, (t1 - t0) / scale)
    step_yticks = max(1, nrows // 32)
    gantt.set_yticks(np.arange(0, nrows, step_yticks), [f"rank {r}" for r in shown[::step_yticks]])
    gantt.set_xlabel(f"time ({unit}) from {t0 / scale:,.3f} {unit}")
    what = f"{tl.source} timeline" + (f", cost model {tl.costs.model.name}" if tl.costs.model.name else "")
    sample = f"; {nrows} of {world} ranks shown" if nrows < world else ""
    gantt.set_title(f"{title + ': ' if title else ''}{what}{sample}")
    gantt.legend(handles=[Patch(color=COLOURS[c], label=c if c != "async" else "async comm in flight")
                          for c in CATEGORIES],
                 loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    gantt.grid(axis="x", alpha=0.3)
    # breakdown
    ranks_b = shown if world > max_ranks else np.arange(world)
    left = np.zeros(len(ranks_b))
    bscale, bunit = _unit(int(max(1, (totals["compute"] + totals["communication"] + totals["waiting"]).max())))
    for cat in ("compute", "communication", "waiting"):
        v = totals[cat][ranks_b] / bscale
        bars.barh(np.arange(len(ranks_b)), v, left=left, color=COLOURS[cat], label=cat, height=0.7)
        left += v
    bars.set_yticks(np.arange(0, len(ranks_b), step_yticks), [f"rank {r}" for r in ranks_b[::step_yticks]])
    bars.invert_yaxis()
    bars.set_xlabel(f"time in window ({bunit})")
    bars.set_title("per-rank breakdown over the window (async communication overlaps and is not counted)")
    bars.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    bars.grid(axis="x", alpha=0.3)
    fig.savefig(os.fspath(path), dpi=110)
