"""``python -m prism predict RUN``: predict iteration time and breakdown from a
captured run (a thin shell over ``prism.core.graph`` / ``replay`` / ``costmodel``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from collections.abc import Mapping, Sequence

from prism.core.costmodel import CostModel, ProfileError, load_profile
from prism.core.graph import ExecutionGraph, GraphError
from prism.core.replay import DEFAULT_WARMUP, ReplayError, ReplayResult, describe_step, replay_batch
from prism.core.scaleout import Layout, ScaleOutError, scale_graph
from prism.core.trace import Event, Manifest, TraceFormatError, decode_manifest, manifest_path

DEFAULT_PROFILE = "h200_nvlink_ib400"


class RunReadError(RuntimeError):
    """The run directory cannot be read by this build of Prism."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory (a PrismTrace capture)")
    p.add_argument("--net", default=None, metavar="PROFILE",
                   help="communication cost profile: a TOML path, a bundled name, or 'zero' (default: the profile "
                        "`prism netprofile` fitted for the run's backend and host, ~/.cache/prism/profiles/"
                        f"BACKEND-HOST.toml, if there is one, else the shipped {DEFAULT_PROFILE})")
    p.add_argument("--scale-dp", type=int, default=None, metavar="N",
                   help="predict the run grown to data-parallel degree N (replicas copied; see prism.core.scaleout)")
    p.add_argument("--layout", default=None, metavar="tp=T,pp=P,dp=D[,ep=E]",
                   help="the captured run's layout for --scale-dp (default: the manifest's, from --tp/--pp/--dp flags)")
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


def load_run_manifest(run_dir: str | pathlib.Path) -> Manifest | None:
    """The run's manifest, or None when the directory has none."""
    path = manifest_path(run_dir)
    if not path.is_file():
        return None
    return decode_manifest(path.read_bytes(), file=str(path))


def resolve_profile(net: str | None, manifest: Manifest | None,
                    device_kind: str | None = None) -> tuple[CostModel, str]:
    """The cost model to use and why: ``net`` if given; else the profile fitted
    by ``prism netprofile`` for the run's backend on the run's host, if one
    exists; else the shipped ``DEFAULT_PROFILE``. ``device_kind`` (what the
    ranks' trace shows) overrides the manifest's, which is a guess made
    before the run from the command line."""
    if net is not None:
        return load_profile(net), "given with --net"
    if manifest is not None:
        from prism.netprofile_cli import backend_of, fitted_profile_path

        path = fitted_profile_path(backend_of(device_kind or manifest.device_kind), manifest.hostname)
        if path.is_file():
            return load_profile(path), f"fitted by `prism netprofile` for this run's backend and host ({path})"
        why = f"no fitted profile at {path} (`python -m prism netprofile` makes one)"
    else:
        why = "the run has no manifest to name its backend and host"
    return load_profile(DEFAULT_PROFILE), f"shipped default: {why}"


def traced_device_kind(ranks) -> str | None:
    """"cuda" when a rank's trace shows CUDA memory (it drove a GPU), None
    when no rank did (then the manifest's guess stands)."""
    from prism.core.trace import Memory

    for events in ranks.values():
        for e in events:
            if isinstance(e, Memory) and e.device.startswith("cuda"):
                return "cuda"
    return None


def parse_layout(text: str) -> Layout:
    """``tp=2,pp=2,dp=4[,ep=2]`` -> Layout; raises ValueError naming the bad part."""
    known = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("tp", "pp", "dp", "ep") or not value.strip().isdigit():
            raise ValueError(f"--layout: {part!r} is not tp=N, pp=N, dp=N or ep=N (e.g. tp=2,pp=2,dp=4)")
        known[key.strip()] = int(value)
    return Layout(**known)


def predict(ranks: Mapping[int, Sequence[Event]], cost_model: CostModel, *, scale_dp: int | None = None,
            layout: Layout | None = None) -> ReplayResult:
    """Build the execution graph of ``ranks`` (grown to ``scale_dp`` when given,
    which needs the run's ``layout``) and replay it under ``cost_model``."""
    if scale_dp is None:
        graph = ExecutionGraph.from_events(ranks)
    else:
        if layout is None:
            raise ScaleOutError("--scale-dp needs the run's layout: the manifest has none; pass --layout")
        graph = scale_graph(ranks, layout, scale_dp)
    return replay_batch(graph, cost_model=cost_model)


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
    if result.costs.two_clock:
        two = int(((g.kind == 0) & (g.cpu >= 0)).sum())
        lines.append(f"GPU timing: two clocks for {two:,} compute segments (CPU issue and GPU busy time, each "
                     "the smallest of the segment's occurrences; docs/GPU-TIMING.md)")
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
    if args.warmup < 0:
        print(f"prism predict: --warmup must be >= 0, got {args.warmup}", file=sys.stderr)
        return 2
    try:
        manifest = load_run_manifest(args.run)
    except TraceFormatError as e:
        print(f"prism predict: {manifest_path(args.run)}: {e}", file=sys.stderr)
        return 2
    layout = None
    try:
        if args.layout is not None:
            layout = parse_layout(args.layout)
        elif args.scale_dp is not None and manifest is not None:
            layout = Layout.from_manifest(manifest)
    except ValueError as e:  # ScaleOutError is one
        print(f"prism predict: {e}", file=sys.stderr)
        return 2
    try:
        ranks = load_run_events(args.run)
    except RunReadError as e:
        print(f"prism predict: {e}", file=sys.stderr)
        return 2
    try:
        model, why = resolve_profile(args.net, manifest, traced_device_kind(ranks))
    except ProfileError as e:
        print(f"prism predict: {e}", file=sys.stderr)
        return 2
    try:
        result = predict(ranks, model, scale_dp=args.scale_dp, layout=layout)
    except ScaleOutError as e:
        print(f"prism predict: cannot scale {args.run} to dp {args.scale_dp}: {e}", file=sys.stderr)
        return 2
    except (GraphError, ReplayError) as e:
        print(f"prism predict: the trace in {args.run} is inconsistent: {e}", file=sys.stderr)
        return 1
    if args.json:
        data = result.summary(args.warmup)
        data["cost_model_choice"] = why
        if args.scale_dp is not None:
            data["scaled"] = {"from_layout": dataclasses.asdict(layout), "to_dp": args.scale_dp}
        text = json.dumps(data, indent=2)
    else:
        text = format_report(result, args.warmup)
        text += f"\ncost profile chosen: {why}"
        if args.scale_dp is not None:
            text = (f"scaled from {layout} (world {layout.world_size}) to dp {args.scale_dp} "
                    f"(world {result.graph.world_size}): replicas copied, see prism.core.scaleout\n") + text
    print(text)
    return 0
