"""Timelines of a captured run: Perfetto, a Gantt plot, Chakra ET.

``report(ReportConfig(run=..., perfetto=..., plot=..., chakra=...))`` builds
the run's timeline (the replay's predictions under ``net`` by default; with
``recorded`` the recorded timestamps, each rank's clock converted with its
clock offset) and writes each output asked for: a Perfetto / Chrome trace
(gzipped when the name ends in ``.gz``), a Gantt chart with a breakdown
(needs matplotlib) and per-rank Chakra execution traces (needs protobuf).
It returns the timeline and what it wrote.
"""

from __future__ import annotations

import gzip
import os
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import orjson

from prism.app.errors import InconsistentTraceError, UsageError
from prism.app.predict import DEFAULT_PROFILE, load_run_events
from prism.core.costmodel import ProfileError
from prism.core.graph import ExecutionGraph, GraphError
from prism.core.replay import Costs, ReplayError, replay_batch
from prism.core.timeline import Timeline, chrome_trace, predicted_timeline, recorded_timeline
from prism.core.trace import Event, Memory, RankStart
from prism.shell.profiles import load_profile

__all__ = ["ReportConfig", "Report", "report", "build_timeline", "parse_ranks", "parse_steps", "clock_offsets",
           "memory_samples"]


@dataclass(frozen=True)
class ReportConfig:
    run: str | os.PathLike[str]
    perfetto: str | None = None
    plot: str | None = None
    chakra: str | None = None
    chakra_prefix: str = "prism"
    #: The cost profile (None: ``DEFAULT_PROFILE``; with ``comm`` other than
    #: "model", the profile predict would choose for the run, so that report
    #: draws what ``predict --comm`` predicts).
    net: str | None = None
    recorded: bool = False
    #: Perfetto trace: only these ranks, e.g. "0-7,64" (None: all).
    ranks: str | None = None
    #: Plot only these steps, "FIRST[:LAST]" (None: the whole run).
    steps: str | None = None
    #: The replay's compute durations, as ``predict``'s: "auto" (the run's
    #: newest calibration if it has one), "on", "off" or a calibration's name;
    #: unused with ``recorded`` (the capture's own timestamps).
    calibration: str = "auto"
    #: Communication times, as ``predict``'s ``--comm``: "model" (the cost
    #: profile's), "measured" (the run's newest ``prism commtime``) or a
    #: measurement's name.
    comm: str = "model"


@dataclass(frozen=True)
class Report:
    timeline: Timeline
    #: One line per file written: the path and what it holds.
    wrote: list[str] = field(default_factory=list)


def report(config: ReportConfig) -> Report:
    """Write what ``config`` asks for. Raises ``UsageError`` (options, missing
    extras, an unreadable run) or ``InconsistentTraceError``."""
    if not (config.perfetto or config.plot or config.chakra):
        raise UsageError("nothing to write; give at least one of --perfetto FILE.json, --plot FILE.png, "
                         "--chakra DIR")
    try:
        steps = parse_steps(config.steps)
    except ValueError as e:
        raise UsageError(str(e)) from None
    ranks = load_run_events(config.run)
    if config.comm not in (None, "", "model"):  # measured on the steps every rank finished, as predict cuts them
        from prism.app.predict import _complete_steps

        ranks, _ = _complete_steps(config.run, ranks)
    if not config.recorded:
        from prism.app.calibrate import calibrated_events

        ranks, _ = calibrated_events(config.run, ranks, config.calibration)
    try:
        tl = build_timeline(ranks, config.net, config.recorded, comm=config.comm, run=config.run)
    except ProfileError as e:
        raise UsageError(str(e)) from None
    except (GraphError, ReplayError, ValueError) as e:
        raise InconsistentTraceError(f"the trace in {config.run} is inconsistent: {e}") from None
    try:
        shown = parse_ranks(config.ranks, tl.graph.world_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    wrote = []
    if config.perfetto:
        trace = chrome_trace(tl, memory_samples(ranks), metadata={"run": str(pathlib.Path(config.run).resolve())},
                             ranks=shown)
        data = orjson.dumps(trace)
        # Perfetto opens gzipped JSON as is; traces of thousands of ranks shrink about tenfold
        pathlib.Path(config.perfetto).write_bytes(gzip.compress(data, 6) if config.perfetto.endswith(".gz") else data)
        wrote.append(f"{config.perfetto} (Chrome trace, {len(trace['traceEvents']):,} events; open in ui.perfetto.dev)")
    if config.plot:
        from prism.shell.plot import PlotUnavailableError, write_plot

        try:
            write_plot(tl, config.plot, steps=steps, title=pathlib.Path(config.run).name)
        except PlotUnavailableError as e:
            raise UsageError(str(e)) from None
        except ValueError as e:
            raise UsageError(f"--steps {config.steps}: {e}") from None
        wrote.append(f"{config.plot} (Gantt chart and breakdown)")
    if config.chakra:
        from prism.shell.chakra import ChakraUnavailableError, write_chakra

        try:
            paths = write_chakra(tl, config.chakra, config.chakra_prefix)
        except ChakraUnavailableError as e:
            raise UsageError(str(e)) from None
        wrote.append(f"{config.chakra}/{config.chakra_prefix}.{{0..{len(paths) - 1}}}.et (Chakra ET) and comm_group.json")
    return Report(tl, wrote)


def parse_steps(text: str | None) -> tuple[int | None, int | None]:
    """``"2:4"`` -> (2, 4); ``"2:"`` -> (2, None); ``"3"`` -> (3, 3); None -> (None, None)."""
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


def build_timeline(ranks: Mapping[int, Sequence[Event]], net: str | None, recorded: bool, comm: str = "model",
                   run: str | os.PathLike[str] | None = None) -> Timeline:
    """The graph of ``ranks`` on the predicted (or recorded) clock; ``comm``
    other than "model" takes the in-situ communication times stored in
    ``run`` (``prism commtime``) over the profile's."""
    graph = ExecutionGraph.from_events(ranks)
    if comm not in (None, "", "model"):
        from prism.app.commtime import comm_model
        from prism.app.predict import load_run_manifest, resolve_profile, traced_device_kind

        if run is None:
            raise ValueError("build_timeline: comm other than 'model' needs the run directory")
        base, _ = resolve_profile(net, load_run_manifest(run), traced_device_kind(ranks))
        model = comm_model(run, comm, base, graph)
    else:
        model = load_profile(net if net is not None else DEFAULT_PROFILE)
    if recorded:
        return recorded_timeline(graph, clock_offsets(ranks), Costs.of(graph, cost_model=model))
    return predicted_timeline(replay_batch(graph, cost_model=model))


def memory_samples(ranks: Mapping[int, Sequence[Event]]) -> dict[int, list[Memory]]:
    return {r: [e for e in evs if isinstance(e, Memory)] for r, evs in ranks.items()}
