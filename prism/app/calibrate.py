"""Slice calibration of a captured run (PrismLLM phase 1, step 3).

``calibrate(CalibrateConfig(run="runs/gpt"))`` plans the slices
(``prism.core.calibration.plan_slices``: by default the TP groups, else the
pipelines, else pairs; each at most this machine's cores, or for a GPU
capture its GPUs), packs them (``pack_slices``: as many slices at once as
the cores hold, so the machine is loaded as in the job; ``--no-pack``: one
slice after the other), runs each as sandbox ranks against the bare graph
(``prism.app.emulate.emulate``; with agents, one slice per node side by
side, ``node_rounds``, unpacked unless ``--pack``), takes every
sandbox rank's compute durations from its emulation trace (matched call by
call to the capture) and stores them under ``RUN/calibration/<name>/``:

- ``durations.npz``: per calibrated rank (``rank-000003``), one duration
  (int64 ns) per compute segment in program order;
- ``manifest.json``: the slices, the emulations that measured them, the date,
  whether symmetric (and the class map), per rank what was replaced, and the
  bare and calibrated predictions under the same cost profile.

``--symmetric`` runs one slice per class of equivalent ranks (same TP rank,
PP stage and EP rank) and copies the representatives' durations to their
class. ``predict`` and ``emulate`` use the run's newest stored calibration
by default (``--calibration auto``; ``on``: the newest, required; ``off``: the
bare graph; or ``--calibration NAME``): on a 16-core host's CPUs it cut a
polluted capture's error from +105..+155% to +13..+22% at world 8 and from +45%
to about -10% at world 16, and tied with the bare prediction on clean captures
(bench/results/calibration-2026-12-07-h100cpu.md; archive/calibration-2026-12.md has
why packing is the default: on clean captures packed slices stay within
0.2-0.6 points of the bare prediction where lone slices on an idle host drift
1-2 points low, on polluted ones they correct as much, at a quarter of the
wall time). Without a calibration, ``pollution_hint`` says when the capture's
ranks were off a CPU for over a fifth of their compute.
Segments the capture timed with two clocks (GPU captures) keep their
capture timing (``prism.core.calibration``, the rule).
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prism.app.errors import InconsistentTraceError, PrismError, UsageError
from prism.core.calibration import (
    CLEAN_SHARE,
    POLLUTED_SHARE,
    cpu_share,
    CalibrationError,
    apply_calibration,
    expand_classes,
    measured_durations,
    node_rounds,
    pack_slices,
    plan_slices,
    symmetric_plan,
    symmetry_classes,
)
from prism.core.scaleout import Layout, ScaleOutError
from prism.core.trace import Event

__all__ = ["CalibrateConfig", "CalibrationResult", "CalibrationFailed", "calibrate", "calibrated_events",
           "load_calibration", "CALIBRATION_CHOICES", "has_calibration",
           "pollution_hint", "events_for_replay"]

#: ``--calibration`` values besides a calibration's name.
CALIBRATION_CHOICES = ("auto", "off", "on")
_DURATIONS = "durations.npz"
_MANIFEST = "manifest.json"


class CalibrationFailed(PrismError):
    """A slice's emulation failed (its message says why); exit status 1."""

    exit_code = 1


@dataclass(frozen=True)
class CalibrateConfig:
    """What to calibrate. ``slices``: auto, tp, pp, gang, pairs or ``"0,1;2,3"``;
    ``cores``: how many ranks a slice may hold (None: this machine's usable
    cores); ``net``: the cost profile as for ``predict``; ``layout``: the run's
    layout when the manifest has none (``"tp=2,pp=2,dp=4"``)."""

    run: str | os.PathLike[str]
    slices: str = "auto"
    symmetric: bool = False
    #: Run slices together, as many as fit ``cores`` (``pack_slices``): the
    #: machine loaded as in the job instead of idle around one slice.
    pack: bool | None = None  # None: packed, except with agents (one slice per node)
    name: str | None = None
    net: str | None = None
    cores: int | None = None
    #: GPUs the slices' sandbox ranks run on, as ``prism emulate --gpus``
    #: (None: GPU 0 when the capture ran on CUDA). A CUDA capture's slice holds
    #: at most one rank per GPU (unless ``cores`` says otherwise): sandboxes
    #: sharing a GPU would time-share it, and the slice would measure the
    #: contention the capture's two-clock segments already took out.
    gpus: str | None = None
    layout: str | None = None
    warmup: int = 1
    quiet_s: float = 30.0
    #: Keep the segments the capture ran undisturbed (``prism.core.calibration.
    #: CLEAN_SHARE``); False replaces every one-clock segment (``--replace-clean``).
    keep_clean: bool = True
    #: Keep the slices an earlier, interrupted ``calibrate`` of the same
    #: ``name`` finished (their emulations' summaries say ok, for the same
    #: ranks) and run only the others; a failed attempt's folder is kept and
    #: its slice runs again under ``<emulation>-retry<N>``.
    resume: bool = False
    # Agents, as ``prism emulate --agents``: each slice's emulation places its
    # ranks on them (an agent a slice has no rank for gets an empty launch), so
    # they must outlive one run: ``prism agent --runs 0``.
    agents: int = 0
    listen: str | None = None
    keys: str | os.PathLike[str] | None = None
    insecure: bool = False
    agent_wait_s: float = 60.0


@dataclass
class CalibrationResult:
    out_dir: Path
    manifest: dict = field(default_factory=dict)

    def text(self) -> str:
        m = self.manifest
        lines = [f"calibrated {m['run']} (world {m['world_size']}) with {len(m['slices'])} slice(s) "
                 f"({m['slice_mode']}{', symmetric' if m['symmetric'] else ''}{', packed' if m.get('packed') else ''}), {m['cores']} {m.get('slot_unit', 'cores')} per slice at most:"]
        nodes = m.get("slice_nodes") or [None] * len(m["slices"])
        for k, s in enumerate(m["slices"]):
            on = f" on node {nodes[k]['node']}" if nodes[k] else ""
            kept = ", kept from an earlier run" if m["emulations"][k] in m.get("resumed", ()) else ""
            lines.append(f"  slice {k}: ranks {','.join(map(str, s))}{on}  ({m['emulations'][k]}, "
                         f"{m['slice_wall_s'][k]:.1f} s{kept})")
        if m.get("cramped_slices"):
            lines.append("warning: a slice had more ranks than its node's slots, so its ranks took turns and their "
                         "durations include the waits: " + "; ".join(m["cramped_slices"])
                         + ". Pass --cores with the nodes' slots (or start the agents with more --slots)")
        if m["symmetric"]:
            lines.append("classes (representative: members):")
            for rep, members in m["classes"].items():
                lines.append(f"  {rep}: {','.join(map(str, members))}")
        uncal = m["uncalibrated_ranks"]
        if uncal:
            lines.append(f"ranks left with their bare durations: {','.join(map(str, uncal))}")
        seg = sum(v["replaced"] for v in m["per_rank"].values())
        kept = sum(v["kept_two_clock"] for v in m["per_rank"].values())
        clean = sum(v.get("kept_clean", 0) for v in m["per_rank"].values())
        lines.append(f"{seg:,} compute segments calibrated" + (f", {kept:,} two-clock (GPU) segments kept as captured"
                                                               if kept else "")
                     + (f", {clean:,} kept as captured: their rank ran undisturbed (main thread on a CPU for "
                        f"{CLEAN_SHARE:.0%} of the segment or more; --replace-clean to replace them too)"
                        if clean else ""))
        b, c = m["bare_mean_ns"], m["calibrated_mean_ns"]
        if b and c:
            lines.append(f"predicted iteration time: bare {b / 1e6:,.3f} ms, calibrated {c / 1e6:,.3f} ms "
                         f"({c / b - 1:+.2%}; cost profile {m['cost_model']})")
        biggest = max((len(x) for x in m["slices"]), default=0)
        if (not m.get("packed") and not m.get("agents") and len(m["slices"]) > 1 and seg
                and m.get("slot_unit", "cores") == "cores" and 2 * biggest <= m["cores"]):
            lines.append(f"note: each slice ran alone, {biggest} rank(s) on a machine of {m['cores']} cores: an idle "
                         "machine computes faster than the job's full one (turbo clocks, shared caches and memory "
                         "bandwidth), so the slices' figures may run short of the job's; without --no-pack the "
                         "slices run together, the machine loaded as in the job")
        lines.append(f"stored in {self.out_dir}; `prism predict RUN` and `prism emulate RUN` use the newest "
                     "calibration (or name it: `--calibration " + m["name"] + "`; `--calibration off`: the bare graph)")
        return "\n".join(lines)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _packs(config: CalibrateConfig) -> bool:
    """Whether the slices run packed: ``--pack``/``--no-pack``, else packed
    except with agents (there one slice per node, each alone on its node)."""
    return config.pack if config.pack is not None else not config.agents


def _on_cuda(manifest, ranks) -> bool:
    """Whether the capture drove GPUs (its traces show CUDA memory, or its manifest says so)."""
    from prism.app.predict import traced_device_kind

    return traced_device_kind(ranks) == "cuda" or getattr(manifest, "device_kind", None) == "cuda"


def _check_gpus(config: CalibrateConfig, cuda: bool) -> None:
    """``--gpus`` fits the run (``cuda``: it drove GPUs) and the options, before any slice runs."""
    if config.gpus is None:
        return
    if config.agents:
        raise UsageError("--gpus names this machine's GPUs; with --agents each node's agent offers its own "
                         "(`prism agent --gpus 0,1`): drop --gpus")
    if not cuda:
        raise UsageError(f"--gpus {config.gpus}: this capture ran on CPU, so its slices run on CPU cores (--cores); "
                         "drop --gpus")


def _default_slots(config: CalibrateConfig, cuda: bool) -> tuple[int, str]:
    """How many ranks a slice holds when ``--cores`` is not given: this
    machine's usable cores, or for a capture that drove GPUs (``cuda``), the
    GPUs the sandboxes are given (one rank per GPU; ``--gpus``, default GPU 0),
    or with agents the cores (each agent's node places its own GPUs); and what
    it counts ("cores" or "GPUs")."""
    cores = _usable_cores()
    if not cuda or config.agents:
        return cores, "cores"
    gpus = config.gpus if config.gpus is not None else "0"
    try:
        n = len({int(x) for x in gpus.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--gpus takes GPU indices like 0 or 0,1; got {gpus!r}") from None
    if n < 1:
        raise UsageError(f"--gpus {gpus!r} names no GPU; give indices like 0 or 0,1")
    return min(cores, n), "GPUs"


def _layout(config_layout: str | None, manifest) -> Layout | None:
    from prism.app.predict import parse_layout

    try:
        if config_layout is not None:
            return parse_layout(config_layout)
        if manifest is not None and manifest.layout:
            return Layout.from_manifest(manifest)
    except (ValueError, ScaleOutError) as e:
        raise UsageError(str(e)) from None
    return None


def _bare_events(run: Path) -> tuple[Any, dict[int, list[Event]]]:
    """The run's manifest and the events its graph is built from (as ``predict``: complete steps only)."""
    from prism.app.predict import _complete_steps, load_run_events, load_run_manifest
    from prism.shell import runfolder

    rdir = run / runfolder.RANKS_DIR
    if not rdir.is_dir() or not any(rdir.iterdir()):
        raise UsageError(f"{run} has no graph to calibrate (no rank traces in {rdir}): give the --out of a "
                         "`prism capture`")
    manifest = load_run_manifest(run)
    if manifest is None:
        raise UsageError(f"{run} has no manifest: calibration runs the capture's command and needs it")
    ranks = load_run_events(run)
    ranks, _ = _complete_steps(run, ranks)
    return manifest, ranks


def calibrate(config: CalibrateConfig) -> CalibrationResult:
    """Calibrate ``config.run`` slice by slice; raises ``UsageError`` for bad
    options or a run that cannot be calibrated, ``CalibrationFailed`` when a
    slice's emulation fails, ``InconsistentTraceError`` when a slice's calls do
    not match the capture's."""
    import orjson

    from prism.app.emulate import EmulateConfig, emulate
    from prism.shell import runfolder

    run = Path(config.run)
    manifest, ranks = _bare_events(run)
    world = len(ranks)
    layout = _layout(config.layout, manifest)
    packed = _packs(config)
    cuda = _on_cuda(manifest, ranks)
    _check_gpus(config, cuda)
    cores, slot_unit = (config.cores, "cores") if config.cores is not None else _default_slots(config, cuda)
    try:
        slices = plan_slices(world, config.slices, cores=cores, layout=layout)
        rep_of: dict[int, int] = {}
        if config.symmetric:
            if layout is None:
                raise CalibrationError("--symmetric needs the run's layout to know which ranks are equivalent; the "
                                       "manifest has none: pass --layout tp=T,pp=P,dp=D")
            slices, rep_of = symmetric_plan(slices, symmetry_classes(world, layout))
        if packed:
            slices = pack_slices(slices, cores)
    except CalibrationError as e:
        if slot_unit == "GPUs" and "fit this machine" in str(e):
            raise UsageError(f"{e}. This capture ran on GPUs, so a slice holds one rank per GPU given ({cores} "
                             "now): give more with --gpus 0,1,... or choose smaller slices") from None
        raise UsageError(str(e)) from None
    name = config.name or time.strftime("%Y%m%d-%H%M%S")
    if not name or "/" in name or name in CALIBRATION_CHOICES:
        raise UsageError(f"--name {name!r}: give a plain name (not auto, off or on, no '/')")
    out = runfolder.calibration_path(run, name)
    if (out / _MANIFEST).exists():
        raise UsageError(f"{out} already holds a calibration; choose another --name")
    # With agents, one slice per node at a time (each alone on its node's
    # cores, as it would be alone on this machine), the nodes side by side:
    # a round of ``agents`` slices is one emulation.
    rounds = node_rounds(len(slices), config.agents)
    emu_names = [""] * len(slices)
    for ks in rounds:
        for j in ks:
            emu_names[j] = (f"calibrate-{name}-slice{ks[0]}" if len(ks) == 1
                            else f"calibrate-{name}-slices{ks[0]}-{ks[-1]}")
    if config.resume and config.name is None:
        raise UsageError("--resume needs the --name of the calibration to finish")
    if not config.resume:
        for e in dict.fromkeys(emu_names):
            if (run / runfolder.EMULATION_DIR / e).exists():
                raise UsageError(f"{run / runfolder.EMULATION_DIR / e} exists already: an earlier calibration "
                                 f"{name!r}; --resume keeps the slices it finished, or choose another --name")

    table: dict[int, np.ndarray] = {}
    per_rank: dict[str, dict] = {}
    walls: list[float] = [0.0] * len(slices)
    nodes: list[dict | None] = [None] * len(slices)
    cramped: list[str] = []
    resumed: list[str] = []
    for i, ks in enumerate(rounds):
        k = ks[0]
        ranks_of = [slices[j] for j in ks]
        sandbox = sorted(r for s in ranks_of for r in s)
        what = (f"slice {k} (ranks {','.join(map(str, slices[k]))})" if len(ks) == 1 else
                "slices " + ", ".join(f"{j} (ranks {','.join(map(str, slices[j]))})" for j in ks))
        if config.resume:
            done, emu = _earlier_attempts(run / runfolder.EMULATION_DIR, emu_names[k], sandbox, what)
            for j in ks:
                emu_names[j] = emu
            if done is not None:
                resumed.append(emu)
                wall = float((done.get("coordinator") or {}).get("wall_s") or 0.0)
                _note_round(ks, slices, done, wall, walls, nodes, cramped)
                continue
        t0 = time.perf_counter()
        outcome = emulate(EmulateConfig(run=run, sandbox=",".join(map(str, sandbox)), net=config.net,
                                        calibration="off",
                                        name=emu_names[k], warmup=config.warmup, quiet_s=config.quiet_s,
                                        show_ranks="none", progress="off", agents=config.agents,
                                        listen=config.listen, keys=config.keys, insecure=config.insecure,
                                        agent_wait_s=config.agent_wait_s, gpus=config.gpus,
                                        placement=tuple(tuple(s) for s in ranks_of) if config.agents else None))
        wall = time.perf_counter() - t0
        if not outcome.ok:
            finished = sum(map(len, rounds[:i]))
            kept = f"The {finished} slice(s) measured before it are kept: " if finished else ""
            raise CalibrationFailed(f"{what} failed in {outcome.out_dir} ({outcome.status}): "
                                    f"{outcome.message.strip()}\n{kept}`prism calibrate {run} --name {name} "
                                    "--resume` (with the same options) runs only the slices not measured yet.")
        _note_round(ks, slices, outcome.summary, wall, walls, nodes, cramped)
    for k, s in enumerate(slices):
        outcome_dir = run / runfolder.EMULATION_DIR / emu_names[k]
        for r in s:
            path = runfolder.rank_path(outcome_dir, r)
            try:
                events = runfolder.read_rank_file(path, ignore_unknown=True).events
            except Exception as e:  # noqa: BLE001 (TraceFormatError, OSError: named below)
                raise CalibrationFailed(f"slice {k}: cannot read sandbox rank {r}'s trace {path}: {e}") from None
            try:
                m = measured_durations(r, ranks[r], events, keep_clean=config.keep_clean)
            except CalibrationError as e:
                raise InconsistentTraceError(f"slice {k} ({outcome_dir}): {e}") from None
            table[r] = m.durations
            per_rank[str(r)] = {"slice": k, "source_rank": r, "segments": m.segments, "replaced": m.replaced,
                                "kept_two_clock": m.kept_two_clock, "kept_clean": m.kept_clean, "regrouped_gaps": m.regrouped,
                                "clean_ns": m.clean_ns, "replaced_bare_ns": m.replaced_bare_ns,
                                "replaced_ns": m.replaced_ns,
                                "bare_compute_ns": _bare_total(ranks[r]),
                                "calibrated_compute_ns": int(m.durations.sum())}
    classes: dict[str, list[int]] = {}
    if config.symmetric:
        try:
            copied = expand_classes(ranks, table, rep_of, keep_clean=config.keep_clean)
        except CalibrationError as e:
            raise UsageError(str(e)) from None
        for r, p in sorted(rep_of.items()):
            classes.setdefault(str(p), []).append(r)
            if r != p:
                m = copied[r]
                table[r] = m.durations
                per_rank[str(r)] = {"slice": per_rank[str(p)]["slice"], "source_rank": p, "segments": m.segments,
                                    "replaced": m.replaced, "kept_two_clock": m.kept_two_clock, "kept_clean": m.kept_clean,
                                    "clean_ns": m.clean_ns, "replaced_bare_ns": m.replaced_bare_ns,
                                    "replaced_ns": m.replaced_ns,
                                    "regrouped_gaps": m.regrouped, "bare_compute_ns": _bare_total(ranks[r]),
                                    "calibrated_compute_ns": int(m.durations.sum())}
    uncal = [r for r in range(world) if r not in table]

    bare_mean, cal_mean, model_name = _predictions(run, ranks, table, config, manifest)
    data = {
        "name": name, "run": str(run), "world_size": world, "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                         time.gmtime()),
        "slice_mode": config.slices, "slices": [list(s) for s in slices], "cores": cores,
        "slot_unit": slot_unit, "gpus": config.gpus,
        "symmetric": config.symmetric, "packed": packed, "classes": classes, "emulations": emu_names,
        "slice_wall_s": walls, "resumed": resumed, "uncalibrated_ranks": uncal, "per_rank": per_rank,
        "rule": "one-clock (CPU-timed) compute segments take the slice's measurement; segments the capture timed "
                "with two clocks (GPU) keep the capture's timing"
                + (", and so do segments whose main thread was on a CPU for clean_share of their wall time or more"
                   if config.keep_clean else ""),
        "layout": None if layout is None else {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "ep": layout.ep},
        "cost_model": model_name, "warmup": config.warmup, "agents": config.agents,
        "slice_nodes": nodes if config.agents else None, "cramped_slices": cramped,
        "keep_clean": config.keep_clean, "clean_share": CLEAN_SHARE,
        "bare_mean_ns": bare_mean, "calibrated_mean_ns": cal_mean,
    }
    out.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, **{f"rank-{r:06d}": v for r, v in sorted(table.items())})
    (out / _DURATIONS).write_bytes(buf.getvalue())
    (out / _MANIFEST).write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    return CalibrationResult(out, data)


def _note_round(ks: Sequence[int], slices, summary: dict, wall: float, walls: list[float],
                nodes: list[dict | None], cramped: list[str]) -> None:
    """A finished round's wall time and, with agents, each slice's node."""
    agents = summary.get("agents") or []
    for i, j in enumerate(ks):
        walls[j] = wall
        if i < len(agents):
            a = agents[i]
            nodes[j] = {"node": a.get("node"), "host": a.get("host"), "slots": a.get("slots")}
            if a.get("slots") is not None and a["slots"] < len(slices[j]):
                cramped.append(f"slice {j} ({len(slices[j])} ranks) on node {a.get('node')} "
                               f"({a['slots']} slot{'' if a['slots'] == 1 else 's'})")


def _earlier_attempts(emulations: Path, base: str, sandbox: list[int], what: str) -> tuple[dict | None, str]:
    """For ``--resume``: the summary of a finished earlier run of this round
    (``base`` or a retry of it) and its name, else None and the name the
    round runs under now (``base``, or the first free ``base-retryN`` when
    failed attempts hold the others: their folders are kept)."""
    import orjson

    names = [base]
    while (emulations / names[-1]).exists():
        names.append(f"{base}-retry{len(names) + 1}")
    for emu in names[:-1]:
        try:
            summary = orjson.loads((emulations / emu / "summary.json").read_bytes())
        except (OSError, orjson.JSONDecodeError):
            continue  # killed before it wrote its summary: run again
        if summary.get("status") != "ok":
            continue
        if sorted(summary.get("sandbox") or []) != sandbox:
            raise UsageError(f"--resume: {emulations / emu} ran sandbox ranks "
                             f"{','.join(map(str, sorted(summary.get('sandbox') or [])))}, but {what} now holds "
                             f"{','.join(map(str, sandbox))}: the earlier calibration had other --slices, --cores, "
                             "--gpus, --pack/--no-pack or --symmetric; resume with those, or choose another --name "
                             "(since 2026-12-06 slices are packed by default: a calibration begun before needs "
                             "--no-pack, and a GPU capture's slices hold one rank per GPU: --cores N as before)")
        return summary, emu
    return None, names[-1]


def _bare_total(events: Sequence[Event]) -> int:
    return int(sum(ev.end_ns - ev.start_ns for ev in events if type(ev).__name__ == "Compute"))


def _predictions(run: Path, ranks, table, config: CalibrateConfig, manifest) -> tuple[float | None, float | None, str]:
    from prism.app.predict import predict_events, resolve_profile, traced_device_kind
    from prism.core.costmodel import ProfileError

    try:
        model, _ = resolve_profile(config.net, manifest, traced_device_kind(ranks))
    except ProfileError as e:
        raise UsageError(str(e)) from None
    bare = predict_events(ranks, model)
    cal = predict_events(apply_calibration(ranks, table), model)
    w = config.warmup

    def mean(res) -> float | None:
        return res.mean_iteration_time(w) if len(res.iteration_times) > w else None

    return mean(bare), mean(cal), model.name


def load_calibration(run: str | os.PathLike[str], which: str = "on") -> tuple[dict[int, np.ndarray], dict]:
    """A stored calibration of ``run``: ``which`` = "on" (the newest) or its
    name. Returns (rank -> durations, its manifest)."""
    import orjson

    from prism.shell import runfolder

    base = runfolder.calibration_path(run, None)
    if which == "on":
        found = []
        for d in _stored(run):
            try:
                created = orjson.loads((d / _MANIFEST).read_bytes()).get("created_utc", "")
            except (OSError, ValueError, AttributeError) as e:
                raise UsageError(f"cannot read the calibration manifest {d / _MANIFEST}: {e}; remove that "
                                 "folder or pass --calibration off (or another calibration's name)") from None
            found.append((created, d.name, d))
        if not found:
            raise UsageError(f"{run} has no calibration (nothing in {base}): run `prism calibrate {run}` first, or "
                             "pass --calibration off")
        d = max(found)[2]
    else:
        d = runfolder.calibration_path(run, which)
        if not (d / _MANIFEST).is_file():
            names = sorted(p.name for p in base.iterdir() if (p / _MANIFEST).is_file()) if base.is_dir() else []
            raise UsageError(f"--calibration {which!r}: no such calibration in {base} (there are: "
                             f"{', '.join(names) or 'none'}); give auto, off, on or one of those names")
    try:
        manifest = orjson.loads((d / _MANIFEST).read_bytes())
        with np.load(d / _DURATIONS) as z:
            table = {int(k.split("-")[1]): z[k].astype(np.int64) for k in z.files}
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"cannot read the calibration in {d}: {e}") from None
    return table, manifest


def _stored(run: str | os.PathLike[str]) -> list[Path]:
    """The folders of ``run``'s stored calibrations (a manifest and durations each)."""
    from prism.shell import runfolder

    base = runfolder.calibration_path(run, None)
    return [d for d in base.iterdir() if (d / _MANIFEST).is_file() and (d / _DURATIONS).is_file()] \
        if base.is_dir() else []


def has_calibration(run: str | os.PathLike[str]) -> bool:
    """Whether ``run`` holds a stored calibration (``prism calibrate``)."""
    return bool(_stored(run))


def calibrated_events(run: str | os.PathLike[str], ranks: Mapping[int, Sequence[Event]],
                      which: str) -> tuple[Mapping[int, Sequence[Event]], dict | None]:
    """``ranks`` with the calibration ``which`` applied ("off": as they are;
    "auto": the newest when the run has one, else as they are) and that
    calibration's manifest (None when none is applied)."""
    if which == "off" or (which == "auto" and not has_calibration(run)):
        return ranks, None
    table, manifest = load_calibration(run, "on" if which == "auto" else which)
    if manifest.get("world_size") != len(ranks):
        raise UsageError(f"the calibration {manifest.get('name')!r} is of a world of {manifest.get('world_size')} "
                         f"ranks but {run} has {len(ranks)}: pass --calibration off (the bare graph) or "
                         "calibrate again")
    try:
        return apply_calibration(ranks, table), manifest
    except CalibrationError as e:
        raise UsageError(str(e)) from None


def events_for_replay(run: str | os.PathLike[str], ranks: Mapping[int, Sequence[Event]],
                      which: str) -> tuple[Mapping[int, Sequence[Event]], dict | None, str | None]:
    """``calibrated_events`` and, where no calibration was applied though one
    could have been ("auto" and none stored), ``pollution_hint``'s line."""
    ranks, manifest = calibrated_events(run, ranks, which)
    hint = pollution_hint(run, ranks) if manifest is None and which != "off" else None
    return ranks, manifest, hint


def pollution_hint(run: str | os.PathLike[str], ranks: Mapping[int, Sequence[Event]]) -> str | None:
    """For a prediction on the bare graph: a line saying the capture's CPU
    timing looks polluted (``prism.core.calibration.POLLUTED_SHARE``) and
    what to do; None when it does not (or the capture has no CPU clocks)."""
    got = cpu_share(ranks)
    if got is None or got[0] >= POLLUTED_SHARE:
        return None
    share, worst, worst_rank, _, _ = got
    return (f"the capture's CPU timing looks polluted: its ranks' main threads were on a CPU for {share:.0%} of their "
            f"compute (rank {worst_rank}: {worst:.0%}; more ranks than free cores?), so the prediction runs long; "
            f"`prism calibrate {run}` measures the compute again in slices, and predict and emulate then use it")
