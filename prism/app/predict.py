"""Predict a captured run's iteration time and breakdown.

``predict(PredictConfig(run=...))`` reads the run directory, chooses the cost
profile (``resolve_profile``), builds the execution graph (grown to
``scale_dp`` when asked, ``prism.core.scaleout``), replays it
(``prism.core.replay``) and returns a ``Prediction``: the replay's result, why
that profile was chosen, and the text and JSON forms ``prism predict`` prints.
``predict_events`` does the same from per-rank event lists in memory.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prism.app.errors import InconsistentTraceError, UsageError
from prism.core.costmodel import CostModel, ProfileError
from prism.core.graph import ExecutionGraph, GraphError
from prism.core.replay import DEFAULT_WARMUP, ReplayError, ReplayResult, describe_step, replay_batch
from prism.core.scaleout import Layout, ScaleOutError, scale_graph
from prism.core.steps import completeness, cut_to_step
from prism.core.trace import Event, Manifest, Memory, TraceFormatError
from prism.core.whatif import MemoryVerdict, WhatIf, WhatIfError, apply_compute, apply_link, check_memory, peak_memory
from prism.shell.profiles import load_profile
from prism.shell.runfolder import manifest_path, read_manifest, read_run

__all__ = ["PredictConfig", "Prediction", "predict", "predict_events", "load_run_events", "load_run_manifest",
           "resolve_profile", "traced_device_kind", "parse_layout", "format_report", "DEFAULT_PROFILE",
           "RunReadError"]

DEFAULT_PROFILE = "h200_nvlink_ib400"


class RunReadError(UsageError):
    """The run directory cannot be read by this build of Prism."""


@dataclass(frozen=True)
class PredictConfig:
    """What to predict. ``net``: a TOML path, a bundled profile name or "zero"
    (None: ``resolve_profile``'s choice). ``layout``: the captured run's layout
    for ``scale_dp``, as ``Layout`` or ``"tp=2,pp=2,dp=4"`` (None: the manifest's)."""

    run: str | os.PathLike[str]
    net: str | None = None
    scale_dp: int | None = None
    layout: Layout | str | None = None
    warmup: int = DEFAULT_WARMUP
    #: A stored slice calibration (``prism.app.calibrate``): "auto" (the
    #: newest when the run has one, else the bare graph; the default: it wins
    #: on polluted captures and ties on clean ones,
    #: bench/results/calibration-2026-12-07-h100cpu.md), "on" (the newest,
    #: required), "off" (the bare graph) or its name.
    calibration: str = "auto"
    #: Communication times: "model" (the cost profile's), "measured" (the
    #: newest ``prism commtime`` of the run) or a measurement's name.
    comm: str = "model"
    #: What-if knobs (``prism.core.whatif``): a straggler, throttled GPUs, slower
    #: links, a memory limit. None: the capture as it was.
    whatif: WhatIf | None = None


@dataclass(frozen=True)
class Prediction:
    """A replayed run: ``result`` holds the graph, the timings and the breakdowns."""

    config: PredictConfig
    result: ReplayResult
    #: Why this cost profile was used (``resolve_profile``).
    profile_choice: str
    #: The captured layout the prediction was scaled from (None: not scaled).
    layout: Layout | None
    #: What the run lacks (a failed or killed capture), one line each; empty when complete.
    missing: tuple[str, ...] = ()
    #: The manifest of the slice calibration used (None: the bare graph).
    calibration: dict | None = None
    #: Peak memory per rank from the trace, judged against ``whatif.memory_limit_gib``.
    memory: MemoryVerdict | None = None
    #: On the bare graph: why the capture's CPU timing may run long and what
    #: to do (``prism.app.calibrate.pollution_hint``); None when it looks clean.
    calibration_hint: str | None = None

    @property
    def oom(self) -> bool:
        """True when a rank's peak memory exceeds the what-if memory limit."""
        return self.memory is not None and self.memory.status == "oom"

    @property
    def mean_iteration_ns(self) -> float:
        return self.result.mean_iteration_time(self.config.warmup)

    def summary(self) -> dict[str, Any]:
        """The prediction as JSON-able data (``prism predict --json``)."""
        data = self.result.summary(self.config.warmup)
        data["cost_model_choice"] = self.profile_choice
        if self.config.scale_dp is not None:
            data["scaled"] = {"from_layout": dataclasses.asdict(self.layout), "to_dp": self.config.scale_dp}
        if self.missing:
            data["incomplete_run"] = list(self.missing)
        data["calibration"] = None if self.calibration is None else {
            k: self.calibration.get(k) for k in ("name", "created_utc", "slices", "symmetric", "rule")}
        if self.calibration_hint:
            data["calibration_hint"] = self.calibration_hint
        if self.config.whatif is not None:
            data["whatif"] = self.config.whatif.describe()
        if self.memory is not None and (self.memory.peaks or self.memory.limit_gib is not None):
            data["memory"] = self.memory.summary()
        return data

    def text(self) -> str:
        """The human-readable prediction (``prism predict``)."""
        text = format_report(self.result, self.config.warmup)
        text += f"\ncost profile chosen: {self.profile_choice}"
        if self.config.scale_dp is not None:
            text = (f"scaled from {self.layout} (world {self.layout.world_size}) to dp {self.config.scale_dp} "
                    f"(world {self.result.graph.world_size}): replicas copied, see prism.core.scaleout\n") + text
        if self.missing:
            text = "".join(f"incomplete run: {line}\n" for line in self.missing) + text
        c = self.calibration
        if c is not None:
            text += (f"\ncompute durations: slice calibration {c.get('name')!r} of {c.get('created_utc')} "
                     f"({len(c.get('slices', []))} slices{', symmetric' if c.get('symmetric') else ''}; "
                     "two-clock GPU segments as captured)")
        elif self.calibration_hint:
            text += f"\n{self.calibration_hint}"
        if self.config.whatif is not None:
            text += "".join(f"\nwhat-if {line}" for line in self.config.whatif.describe())
        if self.memory is not None and (self.memory.peaks or self.memory.limit_gib is not None):
            text += "\n" + self.memory.text()
        return text


def predict(config: PredictConfig) -> Prediction:
    from prism.core.commtimes import CommTimesError

    """Predict the run ``config.run``. Raises ``UsageError`` for options or a
    run that cannot be read, ``InconsistentTraceError`` for a trace whose
    records contradict each other."""
    run = config.run
    if config.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {config.warmup}")
    try:
        manifest = load_run_manifest(run)
    except TraceFormatError as e:
        raise UsageError(f"{manifest_path(run)}: {e}") from None
    layout = None
    try:
        if isinstance(config.layout, Layout):
            layout = config.layout
        elif config.layout is not None:
            layout = parse_layout(config.layout)
        elif config.scale_dp is not None and manifest is not None:
            layout = Layout.from_manifest(manifest)
    except ValueError as e:  # ScaleOutError is one
        raise UsageError(str(e)) from None
    ranks = load_run_events(run)
    if not ranks:
        raise InconsistentTraceError(f"nothing to predict in {run}: it has no rank files ({run}/ranks is empty); "
                                     "the capture stopped before any rank wrote its trace: see its logs/")
    ranks, missing = _complete_steps(run, ranks)
    from prism.app.calibrate import events_for_replay

    ranks, calibration, hint = events_for_replay(run, ranks, config.calibration)
    try:
        model, why = resolve_profile(config.net, manifest, traced_device_kind(ranks))
    except ProfileError as e:
        raise UsageError(str(e)) from None
    if config.comm not in (None, "", "model"):
        from prism.app.commtime import comm_model

        if config.scale_dp is not None or (config.whatif is not None and config.whatif.link is not None):
            raise UsageError(f"--comm {config.comm}: in-situ communication times are of the captured graph and "
                             "its links only; with --scale-dp or --link-slowdown use --comm model")
        model = comm_model(run, config.comm, model)
        why = f"in-situ communication times ({model.label}); the rest from {why}"
    try:
        result = predict_events(ranks, model, scale_dp=config.scale_dp, layout=layout, whatif=config.whatif)
        result.iteration_times  # noqa: B018  (computed here, so a bad trace fails here, not while printing)
    except WhatIfError as e:
        raise UsageError(str(e)) from None
    except ScaleOutError as e:
        raise UsageError(f"cannot scale {run} to dp {config.scale_dp}: {e}") from None
    except (GraphError, ReplayError) as e:
        raise InconsistentTraceError(f"the trace in {run} is inconsistent: {e}") from None
    except CommTimesError as e:
        raise UsageError(str(e)) from None
    w = config.whatif or WhatIf()
    memory = check_memory(peak_memory(ranks), w.memory_limit_gib, w.memory_overhead_gib)
    return Prediction(config, result, why, layout, missing, calibration, memory, hint)


def _complete_steps(run, ranks: dict[int, list[Event]]) -> tuple[dict[int, list[Event]], tuple[str, ...]]:
    """``ranks`` cut to the steps every rank completed, and what is missing;
    a complete run comes back as it is."""
    done = completeness(ranks)
    if not done.failed:
        # A run that ended well and still lacks marks is inconsistent: the graph says how.
        return ranks, ()
    if not done.common:
        raise InconsistentTraceError(f"nothing to predict in {run}: no step was completed by every rank ("
                                     + "; ".join(done.describe()) + ")")
    if done.uneven:
        ranks = cut_to_step(ranks, done.common[-1])
    first, last = done.common[0], done.common[-1]
    return ranks, (f"the capture did not finish: predicted from the {len(done.common)} step(s) every rank "
                   f"completed ({first}..{last})", *done.describe())


def load_run_events(run_dir: str | os.PathLike[str]) -> dict[int, list[Event]]:
    """Per-rank event lists of a run directory, through the trace reader."""
    try:
        return dict(read_run(run_dir).ranks)
    except (TraceFormatError, OSError) as e:
        raise RunReadError(f"cannot read run {run_dir}: {e}") from None


def load_run_manifest(run_dir: str | os.PathLike[str]) -> Manifest | None:
    """The run's manifest, or None when the directory has none."""
    if not manifest_path(run_dir).is_file():
        return None
    return read_manifest(run_dir)


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
        from prism.app.netprofile import backend_of, fitted_profile_path

        backend = backend_of(device_kind or manifest.device_kind)
        path = fitted_profile_path(backend, manifest.hostname)
        if path.is_file():
            return load_profile(path), f"fitted by `prism netprofile` for this run's backend and host ({path})"
        why = f"no fitted profile at {path} (`python -m prism netprofile` makes one)"
        if backend == "gloo":
            # the shipped profile is of NCCL on NVLink and InfiniBand: a 16-core host's gloo calls cost 17-30x its
            # times (bench/results/insitu_check-2026-12-07-h100cpu-world16.json)
            why += ("; it times NCCL on GPUs, so this CPU run's gloo communication comes out far too cheap: run "
                    "`python -m prism netprofile` on the capture's host, or pass --net")
    else:
        why = "the run has no manifest to name its backend and host"
    return load_profile(DEFAULT_PROFILE), f"shipped default: {why}"


def traced_device_kind(ranks: Mapping[int, Sequence[Event]]) -> str | None:
    """"cuda" when a rank's trace shows CUDA memory (it drove a GPU), None
    when no rank did (then the manifest's guess stands)."""
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


def predict_events(ranks: Mapping[int, Sequence[Event]], cost_model: CostModel, *, scale_dp: int | None = None,
                   layout: Layout | None = None, whatif: WhatIf | None = None) -> ReplayResult:
    """Build the execution graph of ``ranks`` (grown to ``scale_dp`` when given,
    which needs the run's ``layout``) and replay it under ``cost_model``, with
    the compute and link knobs of ``whatif`` applied to the built graph."""
    if scale_dp is None:
        graph = ExecutionGraph.from_events(ranks)
    else:
        if layout is None:
            raise ScaleOutError("--scale-dp needs the run's layout: the manifest has none; pass --layout")
        graph = scale_graph(ranks, layout, scale_dp)
    if whatif is not None:
        graph, cost_model = apply_compute(graph, whatif), apply_link(cost_model, whatif)
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
