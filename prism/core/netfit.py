"""The alpha-beta fit of measured communication times (sans-IO).

``prism netprofile`` (``prism.app.netprofile``) measures each op at each
message size on groups of each size; this module fits the parameters of
``prism.core.costmodel`` (base latency, per-step latency, bandwidth) by
non-negative least squares on the *relative* error (sizes span four orders
of magnitude; plain least squares would fit only the largest messages) and
writes the TOML profile ``parse_profile`` reads, with every measured point in
its comments.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prism.core.costmodel import CostModel, Link


@dataclass(frozen=True, slots=True)
class Point:
    """One measurement: ``op`` on ``n`` ranks, ``nbytes`` per rank, ``seconds`` per call."""

    op: str
    n: int
    nbytes: int
    seconds: float
    #: CPU seconds one call costs its caller (NCCL); None where not measured
    issue_seconds: float | None = None
    #: The median member's seconds per call where ``seconds`` is the slowest
    #: member's (gloo; with every group at once, a typical group's time where
    #: ``seconds`` is the worst group's); None where not measured
    median_rank_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Fit:
    """Fitted alpha-beta parameters (seconds, seconds per step, bytes per second)."""

    base_latency: float
    latency: float
    bandwidth: float

    def model(self, name: str = "fit", ranks_per_node: int = 1 << 20) -> CostModel:
        link = Link(self.bandwidth, self.latency)
        return CostModel(name, ranks_per_node, link, link, self.base_latency, source="fit")


def _features(points: Sequence[Point]) -> np.ndarray:
    """Columns (1, alpha steps, bytes over the link) of each point under the cost model's formulas."""
    big = 1 << 40  # every rank on one node: the intra link
    steps_m = CostModel("steps", big, Link(math.inf, 1.0), Link(math.inf, 1.0))
    bytes_m = CostModel("bytes", big, Link(1e9, 0.0), Link(1e9, 0.0))
    rows = []
    for p in points:
        ranks = list(range(p.n))
        if p.op == "send":
            steps, moved = steps_m.p2p_ns(p.nbytes, 0, 1) / 1e9, bytes_m.p2p_ns(p.nbytes, 0, 1)
        else:
            steps, moved = steps_m.collective_ns(p.op, p.nbytes, ranks) / 1e9, bytes_m.collective_ns(p.op, p.nbytes, ranks)
        rows.append((1.0, steps, float(moved)))
    return np.array(rows, dtype=np.float64)


def fit_points(points: Sequence[Point]) -> Fit:
    """Non-negative least squares on relative error over (base, latency, 1/bandwidth).

    Three unknowns, so every subset of them being zero is tried and the best
    feasible solution kept (an exact NNLS for this size).
    """
    if len(points) < 3:
        raise ValueError(f"need at least 3 measured points to fit 3 parameters, got {len(points)}")
    X = _features(points)
    y = np.array([p.seconds for p in points], dtype=np.float64)
    if np.any(y <= 0):
        raise ValueError("measured times must be positive")
    A = X / y[:, None]
    b = np.ones(len(y))
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 8):
        cols = [i for i in range(3) if mask >> i & 1]
        sol, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
        if np.any(sol < 0):
            continue
        x = np.zeros(3)
        x[cols] = sol
        err = float(np.sum((A @ x - b) ** 2))
        if best is None or err < best[0]:
            best = (err, x)
    assert best is not None  # a single non-negative column always fits: y > 0 and features >= 0
    base, lat, inv_bw = best[1]
    # A bandwidth the data cannot resolve (no byte term) is written as very large, not infinite.
    return Fit(float(base), float(lat), 1.0 / inv_bw if inv_bw > 1e-15 else 1e15)


def fit_per_op(points: Sequence[Point]) -> dict[str, Fit]:
    """One fit per op that has at least 3 points (gloo's and NCCL's algorithms
    differ per op, so one set of parameters for all fits them badly)."""
    by_op: dict[str, list[Point]] = {}
    for p in points:
        by_op.setdefault(p.op, []).append(p)
    return {op: fit_points(pts) for op, pts in by_op.items() if len(pts) >= 3}


def predict_seconds(fit: Fit, points: Sequence[Point], per_op: dict[str, Fit] | None = None) -> np.ndarray:
    """Seconds per point: each op's own fit where ``per_op`` has one, else ``fit``."""
    X = _features(points)
    params = np.array([[f.base_latency, f.latency, 1.0 / f.bandwidth]
                       for f in ((per_op or {}).get(p.op, fit) for p in points)]).reshape(len(points), 3)
    return np.sum(X * params, axis=1)


def relative_errors(fit: Fit, points: Sequence[Point], per_op: dict[str, Fit] | None = None) -> np.ndarray:
    y = np.array([p.seconds for p in points])
    return np.abs(predict_seconds(fit, points, per_op) - y) / y


def profile_toml(fit: Fit, points: Sequence[Point], *, host: str, backend: str, ranks_per_node: int,
                 command: str, date: str, per_op: dict[str, Fit] | None = None, measured: bool = True,
                 concurrent: int | None = None) -> str:
    """The fitted profile as TOML (``parse_profile`` format), measured points in
    comments; ``per_op`` fits become ``[ops.NAME]`` tables; with ``measured``
    the points also become ``[[measured]]`` tables, which correct the fitted
    form to them. ``date`` is when the points were measured (ISO 8601, UTC),
    written into the header; ``concurrent`` (a world size) says the points
    were timed with every group of a size busy at once on that many ranks."""
    err = relative_errors(fit, points, per_op)
    one = relative_errors(fit, points)
    pred = predict_seconds(fit, points, per_op)
    lines = [
        f"# Cost profile fitted by `prism netprofile` on {host}, {date}.",
        f"# Command: {command}",
        f"# {backend}, one process per rank ({'one GPU each' if backend == 'nccl' else 'OMP_NUM_THREADS=1'}), "
        "all ranks on this host: the",
        "# inter-node link was NOT measured; it is set equal to the intra-node one.",
        *([f"# Concurrent: {concurrent} ranks, every group of a size timed at once ({concurrent} // n groups of n),",
           "# as a training layout's groups run together; the time is the slowest group's."] if concurrent else []),
        f"# Fit: non-negative least squares on relative error over {len(points)} points;",
        f"# relative error median {np.median(err):.1%}, max {np.max(err):.1%}"
        + (f" with per-op parameters ({', '.join(sorted(per_op))}); one set for all ops: median "
           f"{np.median(one):.1%}, max {np.max(one):.1%}." if per_op else "."),
        "# Measured points (op, ranks, bytes per rank, measured us, fitted us):",
    ]
    issues = issue_per_op(points)
    if issues:
        lines[-1:-1] = ["# Times are GPU times per call (back to back, the CPU ahead); issue_us: CPU time per call",
                        "# on the calling thread (median over sizes; added to GPU ranks' CPU clocks by the replay)."]
    for p, t in zip(points, pred):
        lines.append(f"#   {p.op:<24} {p.n:>3} {p.nbytes:>10} {p.seconds * 1e6:>12.1f} {t * 1e6:>12.1f}"
                     + (f"   issue {p.issue_seconds * 1e6:.1f}" if p.issue_seconds is not None else ""))
    desc = (f"{backend} on {host}, measured {date[:10]} by prism netprofile"
            + (f" ({concurrent} ranks at once)" if concurrent else "") + "; fit error median "
            f"{np.median(err):.0%}, max {np.max(err):.0%}")
    bw = fit.bandwidth / 1e9
    lines += [
        "",
        f'name = "{backend}-{host}"',
        f'description = "{desc}"',
        f"ranks_per_node = {ranks_per_node}",
        f"base_latency_us = {fit.base_latency * 1e6:.6g}",
        *([f"issue_us = {statistics.median(x for x in (p.issue_seconds for p in points) if x is not None) * 1e6:.6g}"]
          if issues else []),
        "",
        "[intra]",
        f"bandwidth_GBps = {bw:.6g}",
        f"latency_us = {fit.latency * 1e6:.6g}",
        "",
        "[inter]",
        "# not measured (one host); equal to [intra]",
        f"bandwidth_GBps = {bw:.6g}",
        f"latency_us = {fit.latency * 1e6:.6g}",
        "",
    ]
    if measured:
        lines += ["# The measured points themselves: the model's times are corrected to them per op, size and",
                  "# group size (prism.core.costmodel, 'Measured points').", ""]
        groups: dict[tuple[str, int], list[Point]] = {}
        for p in points:
            groups.setdefault((p.op, p.n), []).append(p)
        for (op, n), ps in sorted(groups.items()):
            ps = sorted({q.nbytes: q for q in ps}.values(), key=lambda q: q.nbytes)
            lines += ["[[measured]]", f'op = "{op}"', f"ranks = {n}",
                      f"bytes = [{', '.join(str(q.nbytes) for q in ps)}]",
                      f"us = [{', '.join(f'{q.seconds * 1e6:.6g}' for q in ps)}]", ""]
    for op, f in sorted((per_op or {}).items()):
        lines += [
            f"[ops.{op}]",
            f"base_latency_us = {f.base_latency * 1e6:.6g}",
            f"latency_us = {f.latency * 1e6:.6g}",
            f"bandwidth_GBps = {f.bandwidth / 1e9:.6g}",
            # a ping-pong's time already holds both sides' CPU
            *([f"issue_us = {issues[op] * 1e6:.6g}"] if op in issues else ["issue_us = 0"] if issues else []),
            "",
        ]
    return "\n".join(lines)


def issue_per_op(points: Sequence[Point]) -> dict[str, float]:
    """op -> median CPU issue seconds per call over its measured points."""
    by: dict[str, list[float]] = {}
    for p in points:
        if p.issue_seconds is not None:
            by.setdefault(p.op, []).append(p.issue_seconds)
    return {op: statistics.median(v) for op, v in by.items()}
