"""``python -m prism report RUN``: timelines of a captured run.

Writes any of: a Perfetto / Chrome trace (``--perfetto FILE.json``), a Gantt
chart with a breakdown (``--plot FILE.png``, needs matplotlib) and per-rank
Chakra execution traces (``--chakra DIR``, needs protobuf). Times are the
replay's predictions under ``--net`` by default; ``--recorded`` uses the
recorded timestamps (each rank's clock converted with its clock offset).
A thin shell over ``prism.core.timeline``, ``prism.plot`` and ``prism.chakra``.
"""

from __future__ import annotations

import argparse
import gzip
import pathlib
import sys
from collections.abc import Mapping, Sequence

import orjson

from prism.core.costmodel import ProfileError, load_profile
from prism.core.graph import ExecutionGraph, GraphError
from prism.core.replay import Costs, ReplayError, replay_batch
from prism.core.timeline import Timeline, chrome_trace, predicted_timeline, recorded_timeline
from prism.core.trace import Event, Memory, RankStart
from prism import predict_cli
from prism.predict_cli import DEFAULT_PROFILE, RunReadError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory (a PrismTrace capture)")
    p.add_argument("--perfetto", metavar="FILE.json",
                   help="write a Chrome trace JSON, gzipped if FILE ends in .gz (open it in ui.perfetto.dev)")
    p.add_argument("--plot", metavar="FILE.png", help="write a per-rank Gantt chart and breakdown (needs matplotlib)")
    p.add_argument("--chakra", metavar="DIR", help="write Chakra execution traces DIR/PREFIX.RANK.et (needs protobuf)")
    p.add_argument("--chakra-prefix", default="prism", metavar="PREFIX", help="file name prefix of the Chakra traces")
    p.add_argument("--net", default=DEFAULT_PROFILE, metavar="PROFILE",
                   help=f"communication cost profile for the replay: a TOML path, a bundled name, or 'zero' "
                        f"(default: {DEFAULT_PROFILE}); with --recorded it only splits held time into "
                        "transfer and waiting")
    p.add_argument("--recorded", action="store_true",
                   help="use the recorded timestamps instead of the replay's predicted times")
    p.add_argument("--ranks", metavar="LIST",
                   help="Perfetto trace: only these ranks, e.g. 0-7,64 (default: all; a viewer struggles with "
                        "thousands)")
    p.add_argument("--steps", metavar="FIRST[:LAST]",
                   help="plot only these steps (inclusive), e.g. 2: to skip warm-up (default: the whole run)")
    p.set_defaults(func=main)


def _parse_steps(text: str | None) -> tuple[int | None, int | None]:
    if text is None:
        return None, None
    first, sep, last = text.partition(":")
    try:
        a = int(first) if first else None
        b = (int(last) if last else None) if sep else a
    except ValueError:
        raise ValueError(f"--steps takes FIRST[:LAST] with whole step numbers (e.g. 2:4 or 2:), got {text!r}") from None
    return a, b


def parse_ranks(text: str | None, world_size: int) -> list[int] | None:
    """``"0-7,64"`` -> [0, ..., 7, 64]; None when not given."""
    if text is None:
        return None
    out: list[int] = []
    for part in text.split(","):
        a, sep, b = part.strip().partition("-")
        try:
            lo = int(a)
            hi = int(b) if sep else lo
        except ValueError:
            raise ValueError(f"--ranks takes ranks and ranges like 0-7,64, got {text!r}") from None
        if not 0 <= lo <= hi < world_size:
            raise ValueError(f"--ranks {part.strip()!r}: ranks must lie in 0..{world_size - 1} (the run's world) "
                             "and a range must not run backwards")
        out.extend(range(lo, hi + 1))
    return out


def clock_offsets(ranks: Mapping[int, Sequence[Event]]) -> list[int]:
    """Each rank's ``RankStart.clock_offset_ns`` (rank order)."""
    out = []
    for r in range(len(ranks)):
        first = next((e for e in ranks[r] if isinstance(e, RankStart)), None)
        if first is None:
            raise ValueError(f"rank {r} has no rank_start record, so its clock offset is unknown; "
                             "--recorded needs it (the rank file is damaged: drop --recorded to use predictions)")
        out.append(first.clock_offset_ns)
    return out


def build_timeline(ranks: Mapping[int, Sequence[Event]], net: str, recorded: bool) -> Timeline:
    """The graph of ``ranks`` on the predicted (or recorded) clock."""
    model = load_profile(net)
    graph = ExecutionGraph.from_events(ranks)
    if recorded:
        return recorded_timeline(graph, clock_offsets(ranks), Costs.of(graph, cost_model=model))
    return predicted_timeline(replay_batch(graph, cost_model=model))


def memory_samples(ranks: Mapping[int, Sequence[Event]]) -> dict[int, list[Memory]]:
    return {r: [e for e in evs if isinstance(e, Memory)] for r, evs in ranks.items()}


def main(args: argparse.Namespace) -> int:
    if not (args.perfetto or args.plot or args.chakra):
        print("prism report: nothing to write; give at least one of --perfetto FILE.json, --plot FILE.png, "
              "--chakra DIR", file=sys.stderr)
        return 2
    try:
        steps = _parse_steps(args.steps)
    except ValueError as e:
        print(f"prism report: {e}", file=sys.stderr)
        return 2
    try:
        ranks = predict_cli.load_run_events(args.run)  # looked up at call time
        tl = build_timeline(ranks, args.net, args.recorded)
    except (ProfileError, RunReadError) as e:
        print(f"prism report: {e}", file=sys.stderr)
        return 2
    except (GraphError, ReplayError, ValueError) as e:
        print(f"prism report: the trace in {args.run} is inconsistent: {e}", file=sys.stderr)
        return 1
    try:
        shown = parse_ranks(args.ranks, tl.graph.world_size)
    except ValueError as e:
        print(f"prism report: {e}", file=sys.stderr)
        return 2
    wrote = []
    if args.perfetto:
        trace = chrome_trace(tl, memory_samples(ranks), metadata={"run": str(pathlib.Path(args.run).resolve())},
                             ranks=shown)
        data = orjson.dumps(trace)
        # Perfetto opens gzipped JSON as is; traces of thousands of ranks shrink about tenfold
        pathlib.Path(args.perfetto).write_bytes(gzip.compress(data, 6) if args.perfetto.endswith(".gz") else data)
        wrote.append(f"{args.perfetto} (Chrome trace, {len(trace['traceEvents']):,} events; open in ui.perfetto.dev)")
    if args.plot:
        from prism.plot import PlotUnavailableError, write_plot

        try:
            write_plot(tl, args.plot, steps=steps, title=pathlib.Path(args.run).name)
        except PlotUnavailableError as e:
            print(f"prism report: {e}", file=sys.stderr)
            return 2
        except ValueError as e:
            print(f"prism report: --steps {args.steps}: {e}", file=sys.stderr)
            return 2
        wrote.append(f"{args.plot} (Gantt chart and breakdown)")
    if args.chakra:
        from prism.chakra import ChakraUnavailableError, write_chakra

        try:
            paths = write_chakra(tl, args.chakra, args.chakra_prefix)
        except ChakraUnavailableError as e:
            print(f"prism report: {e}", file=sys.stderr)
            return 2
        wrote.append(f"{args.chakra}/{args.chakra_prefix}.{{0..{len(paths) - 1}}}.et (Chakra ET) and comm_group.json")
    print(f"prism report: {tl.source} timeline of {args.run} ({tl.graph.world_size} ranks, "
          f"cost model {tl.costs.model.name}); wrote:")
    for w in wrote:
        print(f"  {w}")
    return 0
