"""``python -m prism predict RUN``: predict iteration time and breakdown from a
captured run (a thin shell over ``prism.core.graph`` / ``replay`` / ``costmodel``)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Mapping, Sequence

from prism.core.costmodel import CostModel, ProfileError, load_profile
from prism.core.graph import ExecutionGraph, GraphError
from prism.core.replay import DEFAULT_WARMUP, ReplayError, ReplayResult, describe_step, replay_batch
from prism.core.trace import Event

DEFAULT_PROFILE = "h200_nvlink_ib400"


class RunReadError(RuntimeError):
    """The run directory cannot be read by this build of Prism."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory (a PrismTrace capture)")
    p.add_argument("--net", default=DEFAULT_PROFILE, metavar="PROFILE",
                   help=f"communication cost profile: a TOML path, a bundled name, or 'zero' (default: {DEFAULT_PROFILE})")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                   help=f"steps dropped before averaging iteration times (default: {DEFAULT_WARMUP})")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.set_defaults(func=main)


def load_run_events(run_dir: str | pathlib.Path) -> dict[int, list[Event]]:
    """Per-rank event lists of a run directory, through the trace reader."""
    try:
        from prism.core.trace import read_run  # type: ignore[attr-defined]
    except ImportError:
        raise RunReadError(
            "reading a run directory needs the trace reader (prism.core.trace.read_run), which this build of "
            "Prism does not have yet; it arrives with the trace codec. The graph and replay can be used from "
            "Python today: ExecutionGraph.from_events({rank: [events...]})"
        ) from None
    return dict(read_run(run_dir).ranks)


def predict(ranks: Mapping[int, Sequence[Event]], cost_model: CostModel) -> ReplayResult:
    """Build the execution graph of ``ranks`` and replay it under ``cost_model``."""
    return replay_batch(ExecutionGraph.from_events(ranks), cost_model=cost_model)


def _ms(ns: float) -> str:
    return f"{ns / 1e6:,.3f} ms"


def format_report(result: ReplayResult, warmup: int) -> str:
    """The human-readable prediction."""
    g, model = result.graph, result.costs.model
    times = result.iteration_times
    lines = []
    if len(times) > warmup:
        lines.append(f"predicted iteration time: {_ms(result.mean_iteration_time(warmup))} "
                     f"(mean of steps {warmup}..{len(times) - 1}; {warmup} warm-up step(s) dropped)")
    else:
        lines.append(f"predicted iteration time: n/a (the run has {len(times)} step(s); "
                     f"--warmup {warmup} leaves none; pass a smaller --warmup)")
    lines.append("per step: " + ", ".join(_ms(t) for t in times))
    lines.append(f"cost profile: {model.name} ({model.source}){': ' + model.description if model.description else ''}")
    lines.append(f"world size {g.world_size}, {g.n_nodes:,} nodes, {g.n_instances:,} collective instances, "
                 f"{g.n_messages:,} p2p messages")
    b = result.breakdown()
    lines.append("per-rank breakdown (whole run)   mean          min          max (rank)")
    for key in ("compute", "communication", "waiting", "total"):
        v = b[key]
        lines.append(f"  {key:<14} {_ms(v.mean()):>16} {_ms(v.min()):>12} {_ms(v.max()):>12} ({int(v.argmax())})")
    path = result.critical_path()
    comp = sum(s.t1 - s.t0 for s in path if s.what == "compute")
    comm = sum(s.t1 - s.t0 for s in path if s.what != "compute")
    lines.append(f"critical path: {len(path)} steps, compute {_ms(comp)}, communication {_ms(comm)}; "
                 f"longest stretches:")
    for s in sorted(path, key=lambda s: (s.t0 - s.t1, s.t0))[:5]:
        lines.append("  " + describe_step(g, s))
    lines.append("groups by time members were held in their communication:")
    for x in result.group_ranking()[:8]:
        lines.append(f"  {x.gid:<24} size {x.size:>5}  calls {x.calls:>7,}  held {_ms(x.blocked_ns):>14} "
                     f"(waiting {_ms(x.waiting_ns)})  modelled {_ms(x.modelled_ns)}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        model = load_profile(args.net)
    except ProfileError as e:
        print(f"prism predict: {e}", file=sys.stderr)
        return 2
    if args.warmup < 0:
        print(f"prism predict: --warmup must be >= 0, got {args.warmup}", file=sys.stderr)
        return 2
    try:
        ranks = load_run_events(args.run)
    except RunReadError as e:
        print(f"prism predict: {e}", file=sys.stderr)
        return 2
    try:
        result = predict(ranks, model)
        text = json.dumps(result.summary(args.warmup), indent=2) if args.json else format_report(result, args.warmup)
    except (GraphError, ReplayError) as e:
        print(f"prism predict: the trace in {args.run} is inconsistent: {e}", file=sys.stderr)
        return 1
    print(text)
    return 0
