"""Emulate a captured run: the sandbox ranks run for real, every other rank is virtual.

``emulate(EmulateConfig(run="runs/gpt", sandbox="0,5"))`` reads the capture
(its graph, its recorded payloads, its command), builds the hybrid engine
(``prism.core.hybrid.HybridReplay``) under the capture's cost profile,
launches only the sandbox ranks (each with the environment of its rank in
the full world) against the emulating coordinator
(``prism.shell.emulator.Emulator``) and writes the results to
``RUN/emulation/<id>/``:

- ``ranks/``, ``logs/``: the sandbox ranks' own traces and output;
- ``summary.json``: per sandbox rank its measured iteration times, losses
  (the ``loss`` lines it printed) beside the capture's, peak memory; the
  emulated job's iteration times beside the capture's prediction; groups
  instantiated for real; recorded and compensated calls; pacing lag;
- ``timeline.json``: the emulated timeline in Perfetto (Chrome trace) form,
  sandbox tracks as measured and virtual tracks from the graph.

With ``scale_dp`` the capture is grown first (``prism.core.scaleout``, as
``prism predict --scale-dp``): the sandbox ranks start at the scaled world
size (their command's ``--dp`` set to it), their groups are matched to the
scaled graph's by members and creation order (``prism.core.groupmatch``),
and the DP replicas that are copies of one another with no sandbox rank are
folded into one stepped representative each (``ScalePlan.fold``), so the
coordinator's work per iteration stays flat as the world grows. The
capture's recording is not used then (the recorded values are the small
world's): every virtual contribution is compensated.

With ``agents`` the sandbox ranks run on other nodes: ``prism agent``
processes join ``listen`` (CURVE with ``keys``), each gets the sandbox ranks
``prism.core.agents.place_ranks`` puts on it (a TP group's sandboxes on one
node) with the sandbox environment, and the emulator takes their calls over
tcp, as ``prism capture --agents`` does a capture's ranks. An agent lost
mid-run ends the emulation as ``node_lost``, naming it and its ranks.

An emulation that fails (a mismatch with the graph, a crashing or OOM-ing
sandbox rank, a lost agent) is a result with a non-zero exit code, not an exception.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import resource
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prism.app.errors import InconsistentTraceError, UsageError
from prism.app.trace import compact_ranks

__all__ = ["EmulateConfig", "EmulationOutcome", "emulate", "parse_losses"]

_LOSS = re.compile(r"\bstep (\d+)\b.*?\bloss[ =:]+([-+0-9.eEinfa]+)")


@dataclass(frozen=True)
class EmulateConfig:
    """What to emulate. ``sandbox``: ranks as ``"0,5"`` or ``"0-3"``.
    ``command``: the script and arguments (None: the capture's). ``net``: the
    cost profile as for ``predict`` (None: the same choice). ``dormant``:
    "simulate" (every virtual rank stepped, exact), "offline" (ranks in no
    group with a sandbox take their batch-replay times) or "auto" (offline
    from a world of 256, unless scaled out: folding keeps simulate cheap)."""

    run: str | os.PathLike[str]
    sandbox: str = "0"
    command: Sequence[str] | None = None
    net: str | None = None
    name: str | None = None
    dormant: str = "auto"
    quiet_s: float = 30.0
    warmup: int = 1
    show_ranks: str | tuple[int, ...] = ()
    progress: str = "off"
    use_recording: bool = True
    #: GPUs the sandbox ranks run on (``"0"``, ``"0,1"``); None: GPU 0 when
    #: the capture ran on CUDA, none otherwise. A sandbox keeps its logical
    #: device (local rank 5 sees ``cuda:5``) on whichever GPU it is given.
    gpus: str | None = None
    #: As ``prism capture --memory-limit``: torch's allocator may hold this
    #: much per sandbox rank, less ``memory_overhead_gib``.
    memory_limit_gib: float | None = None
    memory_overhead_gib: float = 0.6  # prism.app.capture.DEFAULT_MEMORY_OVERHEAD_GIB
    #: GPU sandboxes: collectives answered by virtual members only keep their
    #: data on the GPU (``prism.rank.devicepath``). Off by default until it
    #: meets its timing bar (bench/results/gpu_sandbox-2026-12-06.md and its archive: each
    #: workload within it in some runs on an H200, the recorded GPT tp2 and MoE not); False stages every call
    #: through host memory (the capture's path, which works on GPUs).
    device_path: bool = False
    #: Device path with a recording: each sandbox's prefetch pool (MiB of
    #: device memory outside torch's allocator, plus as much pinned host
    #: memory) that the capture's recorded outputs are staged into ahead of
    #: their calls (``prism.rank.devicepath.RecordedFeed``). It counts
    #: against ``memory_limit_gib``: torch's allocator gets the limit less
    #: the larger of ``memory_overhead_gib`` and the pool.
    prefetch_pool_mib: int = 256
    #: A stored slice calibration for the virtual ranks' durations: "auto"
    #: (the newest when the run has one, else as captured; the default),
    #: "on" (the newest, required), "off" or its name (``prism.app.calibrate``).
    calibration: str = "auto"
    #: The virtual ranks' communication times: "model" (the cost profile's),
    #: "measured" (the newest ``prism commtime`` of the run) or its name.
    comm: str = "model"
    #: Sandbox members of one group run their all_reduces among themselves,
    #: for real (gloo; ``prism.rank.pruned``), the virtual part folded in.
    pruned: bool = False
    #: Grow the capture to this data-parallel degree first (``prism.core.scaleout``).
    scale_dp: int | None = None
    #: The captured layout for ``scale_dp``, as ``Layout`` or ``"tp=2,pp=2,dp=2"`` (None: the manifest's).
    layout: Any = None
    # Agents (``prism agent`` on each node), as ``prism capture --agents``
    #: Run the sandbox ranks through this many agents (0: launch them here).
    agents: int = 0
    #: Where the agents join: ``tcp://HOST:PORT`` (the sandboxes get a port of their own on HOST).
    listen: str | None = None
    #: ``prism keys`` directory (CURVE for agents and sandboxes); None only with ``insecure``.
    keys: str | os.PathLike[str] | None = None
    #: Plaintext tcp (a private network only).
    insecure: bool = False
    #: How long to wait for the agents to join.
    agent_wait_s: float = 60.0
    #: With agents: the sandbox ranks for each agent in node order (a
    #: calibration runs one slice per node); None: ``place_ranks`` decides.
    placement: tuple[tuple[int, ...], ...] | None = None


@dataclass
class EmulationOutcome:
    out_dir: Path
    exit_code: int
    status: str
    message: str
    summary: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def text(self) -> str:
        return format_summary(self.summary, self.out_dir)


def _check_agent_options(config: EmulateConfig, device_kind: str | None) -> None:
    """The agent options alone (before the capture is loaded): what they need
    and what they do not drive yet."""
    from prism.app.capture import agents_wanted, check_agent_address

    if not agents_wanted("an emulation", config.agents, config.listen, config.keys, config.insecure):
        return
    if config.gpus is not None:
        raise UsageError("--gpus names this machine's GPUs; with --agents each node's agent offers its own "
                         "(`prism agent --gpus 0,1`): drop --gpus")
    if config.memory_limit_gib is not None and device_kind != "cuda":
        raise UsageError("--memory-limit emulates a smaller GPU, but this capture ran on CPU")
    if config.device_path and device_kind != "cuda":
        raise UsageError("--device-path runs GPU sandboxes on the device path, but this capture ran on CPU: "
                         "drop --device-path")
    check_agent_address(config.listen, config.keys, config.insecure)


def parse_losses(text: str) -> dict[int, str]:
    """``step N ... loss X`` lines of a rank's output: step -> the loss as printed (last one wins)."""
    out = {}
    for m in _LOSS.finditer(text):
        out[int(m.group(1))] = m.group(2)
    return out


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _gpu_env(config: EmulateConfig, device_kind: str | None, sandbox: Sequence[int],
             pool_gib: float = 0.0) -> dict[str, str]:
    """The sandbox ranks' GPU environment (``prism.rank.devices``: the
    logical-device mode; ``prism.rank.oom``: the memory limit, less
    ``pool_gib`` of prefetch pool where that is more than the overhead), or {} on CPU."""
    from prism.rank import envnames as D  # not prism.rank.devices: it would bring torch into the coordinator
    from prism.shell.gpu_plan import visible_gpus

    gpus = config.gpus
    if config.agents and device_kind == "cuda":
        # each node's GPUs come with its Launch (prism.app.capture.agent_gpu_env), once the agents are placed
        return _gpu_limits(config, {D.SANDBOX_ENV: ",".join(map(str, sandbox))}, pool_gib)
    if gpus is None and device_kind == "cuda":
        gpus = "0"
    if gpus is None:
        if config.memory_limit_gib is not None:
            raise UsageError("--memory-limit emulates a smaller GPU, but this capture ran on CPU and no --gpus "
                             "was given")
        return {D.SANDBOX_ENV: ",".join(map(str, sandbox))}
    try:
        ids = [int(x) for x in gpus.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--gpus takes GPU indices like 0 or 0,1; got {gpus!r}") from None
    seen = visible_gpus()
    bad = [g for g in ids if g not in seen]
    if not ids or bad:
        raise UsageError(f"--gpus {gpus}: {'GPU ' + str(bad[0]) + ' is' if bad else 'no GPU'} not visible here "
                         f"(visible: {seen or 'none'}); the capture ran on {device_kind or 'an unknown device'}: "
                         "a sandbox of a CUDA capture needs a GPU")
    # The GPUs are the sandboxes' alone: place them among themselves (one per
    # GPU while they fit), not as blocks of the whole world, which put every
    # sandbox of a small slice on the first GPU.
    env = {D.GPUS_ENV: ",".join(map(str, ids)), D.SANDBOX_ENV: ",".join(map(str, sandbox)),
           D.NODE_RANKS_ENV: ",".join(map(str, sorted(sandbox)))}
    return _gpu_limits(config, env, pool_gib)


def _gpu_limits(config: EmulateConfig, env: dict[str, str], pool_gib: float) -> dict[str, str]:
    """``_gpu_env``'s device-path and memory-limit part (also for sandboxes on agents' GPUs)."""
    from prism.rank import envnames as D

    if config.device_path:
        env[D.GPU_SANDBOX_ENV] = "1"
        # no lazy module loading while the GPU waits on a release (prism/rank/devicepath.py, the hazard)
        env["CUDA_MODULE_LOADING"] = "EAGER"
        from prism.rank.envnames import ARRIVE_AT_REACH_ENV
        from prism.shell.emulator import EARLY_RELEASE_ENV

        if os.environ.get(EARLY_RELEASE_ENV) == "1":
            # early releases need each arrival at its issue: said to the ranks here, for ranks on
            # agents do not inherit this process's environment (protocol 12's default is at the reach)
            env[ARRIVE_AT_REACH_ENV] = "0"
    if config.memory_limit_gib is not None:
        from prism.rank.oom import MEMORY_LIMIT_ENV

        outside = max(config.memory_overhead_gib, pool_gib)
        budget = config.memory_limit_gib - outside
        if budget <= 0:
            raise UsageError(f"--memory-limit {config.memory_limit_gib} GiB leaves nothing for torch's allocator "
                             f"after --memory-overhead {config.memory_overhead_gib} GiB"
                             + (f" and the {pool_gib:.2f} GiB prefetch pool (--prefetch-pool)" if pool_gib else ""))
        env[MEMORY_LIMIT_ENV] = str(int(budget * 2**30))
    return env


def prepare_kernels(env: dict[str, str], note: Any = None, timeout_s: float | None = None) -> dict:
    """``--device-path`` on this machine: build (or just load) cuda_ext's
    kernels before any sandbox starts (``prism.shell.kernels.check_kernels``;
    through agents each node's agent does it) and return ``cuda_ext.info()``
    as a dict (``path``: "kernels" or "fallback", ``reason``). ``env``: the
    sandboxes' environment."""
    import sys

    from prism.shell.kernels import KERNEL_BUILD_TIMEOUT_S, KernelCheckError, check_kernels, describe

    note = note or (lambda text: print(f"prism emulate: {text}", file=sys.stderr, flush=True))
    try:
        info = check_kernels(env, KERNEL_BUILD_TIMEOUT_S if timeout_s is None else timeout_s)
    except KernelCheckError as e:
        raise UsageError(f"--device-path: {e}") from None
    if (line := describe(info)) is not None:
        note(line)
    return info


def agents_kernels(per_node: dict[str, dict]) -> dict:
    """The summary's ``cuda_ext`` for sandboxes on agents' nodes: the path
    all nodes took (or "mixed"), the first reason, and each node's check."""
    paths = sorted({info.get("path") for info in per_node.values()})
    reasons = [info.get("reason") for info in per_node.values() if info.get("reason")]
    return {"path": paths[0] if len(paths) == 1 else "mixed", "reason": reasons[0] if reasons else "",
            "nodes": per_node}


_DP_FLAG = re.compile(r"--dp(?:=(\d+))?$")


def scaled_command(cmd: Sequence[str], dp: int) -> tuple[list[str], bool]:
    """``cmd`` with its ``--dp N`` (or ``--dp=N``) set to ``dp``; whether it had one."""
    out = list(cmd)
    for i, a in enumerate(out):
        m = _DP_FLAG.match(a)
        if m is None:
            continue
        if m.group(1) is not None:
            out[i] = f"--dp={dp}"
            return out, True
        if i + 1 < len(out) and out[i + 1].isdigit():
            out[i + 1] = str(dp)
            return out, True
    return out, False


def dp_flag(cmd: Sequence[str]) -> int | None:
    """The value of ``cmd``'s ``--dp N`` or ``--dp=N`` (None: it has none)."""
    for i, a in enumerate(cmd):
        m = _DP_FLAG.match(a)
        if m is not None and m.group(1) is not None:
            return int(m.group(1))
        if m is not None and i + 1 < len(cmd) and cmd[i + 1].isdigit():
            return int(cmd[i + 1])
    return None


def _scale(config: EmulateConfig, run: Path, manifest: Any, ranks: Any, graph: Any) -> tuple[Any, Any, Any]:
    """The graph grown to ``config.scale_dp``, its plan and the captured layout (UsageError: why not)."""
    from prism.app.predict import parse_layout
    from prism.core.scaleout import Layout, ScaleOutError, scale_out

    dp = config.scale_dp
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise UsageError(f"--scale-dp must be a positive data-parallel degree, got {dp!r}")
    try:
        if isinstance(config.layout, Layout):
            layout = config.layout
        elif config.layout is not None:
            layout = parse_layout(config.layout)
        else:
            layout = Layout.from_manifest(manifest)
    except ValueError as e:  # ScaleOutError is one
        raise UsageError(str(e)) from None
    if layout.world_size != manifest.world_size:
        raise UsageError(f"--layout {layout} has {layout.world_size} ranks, the capture {run} "
                         f"{manifest.world_size}")
    try:
        big, plan = scale_out(ranks, layout, dp, graph)
    except ScaleOutError as e:
        raise UsageError(f"cannot scale {run} (layout tp{layout.tp} pp{layout.pp} dp{layout.dp}"
                         f"{f' ep{layout.ep}' if layout.ep > 1 else ''}) to --scale-dp {dp}: {e}") from None
    return big, plan, layout


def emulate(config: EmulateConfig) -> EmulationOutcome:
    """Run one emulation; raises ``UsageError`` for bad options or a run that cannot be emulated."""
    import orjson
    import trio

    from prism.app.predict import _complete_steps, load_run_events, load_run_manifest, resolve_profile, \
        traced_device_kind
    from prism.core.graph import ExecutionGraph, GraphError
    from prism.core.hybrid import HybridReplay
    from prism.core.payloads import RecordPlan, index
    from prism.core.replay import replay_batch
    from prism.core.costmodel import ProfileError
    from prism.core.timeline import Timeline, chrome_trace
    from prism.core.replay import ReplayResult
    from prism.shell import runfolder
    from prism.shell.coordinator import Progress, default_stop_signals
    from prism.shell.emulator import LEAD_NS, Emulator, Recording
    from prism.shell.launcher import launch_ranks
    from transport.endpoints import default_endpoint
    from prism.app.capture import advertised, agent_key, gang_of, join_agents, manifest_for

    run = Path(config.run)
    if not (run / runfolder.RANKS_DIR).is_dir():
        raise UsageError(f"{run} is not a captured run (no {runfolder.RANKS_DIR}/ in it): give the --out of a "
                         "`prism capture`")
    manifest = load_run_manifest(run)
    if manifest is None:
        raise UsageError(f"{run} has no manifest: emulation needs the capture's command and world size")
    world = manifest.world_size
    _check_agent_options(config, manifest.device_kind)
    if config.scale_dp is None and config.layout is not None:
        raise UsageError("--layout describes the capture for --scale-dp; give --scale-dp N too")
    if config.dormant not in ("auto", "simulate", "offline"):
        raise UsageError(f"--dormant {config.dormant!r}: choose simulate, offline or auto")
    if config.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {config.warmup}")
    if config.pruned and config.agents:
        raise UsageError("--pruned: the sandbox members meet through file stores in the run folder, so they must "
                         "run on this host; leave out --agents (pruned collectives across nodes are not built)")
    if config.pruned and manifest.device_kind == "cuda":
        raise UsageError("--pruned runs the sandbox members' all_reduces among themselves with gloo on CPU "
                         "tensors; the NCCL counterpart for GPU sandboxes is not built: leave out --pruned")
    cmd = list(config.command) if config.command else list(manifest.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError(f"the capture in {run} names no command: give the script after --")
    rss: dict[str, int] = {"start": _peak_rss()}
    t_load = time.perf_counter()
    ranks = load_run_events(run)
    ranks, missing = _complete_steps(run, ranks)
    from prism.app.calibrate import events_for_replay

    ranks, calibration, hint = events_for_replay(run, ranks, config.calibration)
    try:
        graph = ExecutionGraph.from_events(ranks)
    except GraphError as e:
        raise InconsistentTraceError(f"the trace in {run} is inconsistent: {e}") from None
    device_kind = traced_device_kind(ranks)
    scaled = None
    plan = None
    if config.scale_dp is not None:
        graph, plan, layout = _scale(config, run, manifest, ranks, graph)
        del ranks
        captured_world, world = world, plan.world_size
        has_flag = True
        if not config.command:
            cmd, has_flag = scaled_command(cmd, config.scale_dp)
        else:
            given = dp_flag(cmd)
            if given is not None and given != config.scale_dp:
                raise UsageError(f"the command given after -- has --dp {given}, but --scale-dp is "
                                 f"{config.scale_dp}: the sandbox must run at the scaled layout (drop the command "
                                 f"to have the capture's with --dp {config.scale_dp}, or pass --dp {config.scale_dp})")
            has_flag = given is not None
        scaled = {"from_layout": dataclasses.asdict(layout), "to_dp": config.scale_dp,
                  "captured_world": captured_world, "world": world,
                  "command_dp_flag": has_flag}
    rss["graph"] = _peak_rss()
    try:
        sandbox = sorted(RecordPlan.parse_ranks(config.sandbox, world))
    except ValueError as e:
        where = (f" (the capture's world of {scaled['captured_world']} scaled to dp {config.scale_dp}: world {world})"
                 if scaled else "")
        raise UsageError(f"--sandbox: {e}{where}") from None
    gang = gang_of(cmd)
    if config.agents:
        from prism.core.agents import check_placement, place_ranks

        try:
            if config.placement is None:
                place_ranks(sandbox, config.agents, gang)
            else:
                check_placement(config.placement, sandbox, config.agents)
        except ValueError as e:
            raise UsageError(f"--agents {config.agents}: {e}") from None
    elif config.placement is not None:
        raise UsageError("a placement on agents needs agents (--agents K)")
    try:
        model, why = resolve_profile(config.net, manifest, device_kind)
    except ProfileError as e:
        raise UsageError(str(e)) from None
    if config.comm != "model":
        from prism.app.commtime import comm_model

        if plan is not None:
            raise UsageError(f"--comm {config.comm}: in-situ communication times are of the captured graph only; "
                             "with --scale-dp use --comm model")
        model = comm_model(run, config.comm, model, graph)
        why = f"in-situ communication times ({model.label}); the rest from {why}"
    if config.prefetch_pool_mib <= 0:
        raise UsageError(f"--prefetch-pool must be a positive number of MiB, got {config.prefetch_pool_mib}")
    t_setup = time.perf_counter()
    batch = replay_batch(graph, cost_model=model)
    # Scaled out, folding leaves a few ranks to step whatever the world: simulate, exact, costs no more.
    dormant = (config.dormant if config.dormant != "auto" else
               "simulate" if plan is not None or world < 256 else "offline")
    fold = plan.fold(sandbox) if plan is not None else None
    engine = HybridReplay(graph, sandbox, cost_model=model, dormant=dormant, fold=fold, batch=batch)
    first_call = {}
    for r in sandbox:
        sl = graph.nodes_of(r)
        comm = np.flatnonzero(np.isin(graph.kind[sl], (1, 2, 3, 4)))
        first_call[r] = int(batch.start[sl.start + comm[0]]) if len(comm) else 0
    recordings = {}
    if config.use_recording and scaled is None:
        payloads, _ = runfolder.read_payloads(run)
        for r in sandbox:
            if payloads.get(r):
                recordings[r] = Recording(index(payloads[r]), _PayloadCache(run).load)
    # A device-path sandbox delivers its recorded outputs itself, from a
    # prefetch pool it fills from the capture's side files.
    pool = config.prefetch_pool_mib << 20 if recordings and config.device_path else 0
    env = _gpu_env(config, manifest.device_kind, sandbox, pool / 2**30)
    from prism.rank.envnames import GPU_SANDBOX_ENV

    # through agents, each node checks its own (prism.shell.agent._prepare_kernels)
    kernels = prepare_kernels(env) if env.get(GPU_SANDBOX_ENV) == "1" and not config.agents else None
    if recordings:
        from prism.rank.envnames import POOL_ENV, RECORDING_ENV

        env[RECORDING_ENV] = runfolder.payload_index_template(run.resolve())
        env[POOL_ENV] = str(config.prefetch_pool_mib << 20)
    setup_s = time.perf_counter() - t_setup
    load_s = t_setup - t_load
    rss["engine"] = _peak_rss()

    name = config.name or time.strftime("%Y%m%d-%H%M%S")
    out = run / "emulation" / name
    if (out / runfolder.RANKS_DIR).exists() and any((out / runfolder.RANKS_DIR).iterdir()):
        raise UsageError(f"{out} already holds an emulation; choose another --name")
    if config.pruned:
        from prism.rank.envnames import PRUNED_ENV

        stores = out / "pruned"  # the members' communicators meet through file stores here
        shutil.rmtree(stores, ignore_errors=True)
        stores.mkdir(parents=True)
        env[PRUNED_ENV] = str(stores.resolve())
        if recordings:  # a pruned call's inputs are checked against the recording by their digests
            from prism.rank.envnames import PRUNED_DIGESTS_ENV

            env[PRUNED_DIGESTS_ENV] = "1"
    show = () if config.show_ranks == "none" else config.show_ranks
    endpoint = default_endpoint(out)

    def launch(endpoint: str) -> Any:
        return launch_ranks(world, endpoint, out, cmd, show_ranks=show, ranks=sandbox, env=env)

    agent_procs = None
    if config.agents:
        agent_procs, endpoint, _ = join_agents(config.listen, config.agents, world, config.keys, config.insecure,
                                               config.agent_wait_s)

        node_env: dict[tuple[str, str, int], dict[str, str]] = {}

        def launch(bound: str) -> Any:
            return agent_procs.launch(advertised(bound, config.listen), out, cmd, env=env,
                                      show_ranks=sandbox if show == "all" else show,
                                      env_of=lambda hello, _ranks: node_env.get(agent_key(hello), {}))
    try:
        if agent_procs is not None:
            agent_procs.place(gang, sandbox, config.placement)
            if manifest.device_kind == "cuda":
                from prism.app.capture import place_on_agent_gpus

                try:
                    node_env.update(place_on_agent_gpus(agent_procs))
                except UsageError:
                    agent_procs = None  # closed: the finally below must not close it again
                    raise
        runfolder.make_run_dir(out)
        runfolder.write_manifest(out, manifest_for(out, world, cmd, len(sandbox), manifest.device_kind,
                                                   (("emulation_of", str(run)),
                                                    ("sandbox", compact_ranks(sandbox)))))
        emu = Emulator(out, engine, endpoint=endpoint, recordings=recordings, quiet_s=config.quiet_s,
                       progress=Progress(len(sandbox), mode=config.progress), first_call_ns=first_call,
                       launch=launch, stop_signals=default_stop_signals(),
                       curve_keys=None if config.insecure else config.keys, authenticated=bool(config.agents))
        from prism.rank.envnames import CALL_LOG_ENV

        call_log = os.environ.get(CALL_LOG_ENV)
        emu.stats.keep_trips = bool(call_log)
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        # What setup made lives as long as the emulation: out of the collector's
        # sight, so a full collection does not walk the graph's groups and the
        # plan (tens of thousands of objects at 8,192 ranks) while a sandbox waits.
        gc.collect()
        gc.freeze()
        wall0 = time.perf_counter()
        try:
            result = trio.run(emu.run)
        finally:
            gc.unfreeze()
            if call_log and emu.stats.trips:
                _write_trips(call_log, emu.stats.trips)
    finally:
        if agent_procs is not None:
            agent_procs.close()
            if agent_procs.kernels:
                kernels = agents_kernels(agent_procs.kernels)
    wall = time.perf_counter() - wall0
    rss["run"] = _peak_rss()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    coord_cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)

    # --- results ---------------------------------------------------------------
    engine.fill_folded()
    start = np.frombuffer(engine._start, dtype=np.int64).copy()
    end = np.frombuffer(engine._end, dtype=np.int64).copy()
    emulated = ReplayResult(graph, engine.costs, start, end)
    per_rank = {}
    for r in sandbox:
        events = []
        path = runfolder.rank_path(out, r)
        if path.is_file():
            try:
                events = runfolder.read_rank_file(path, ignore_unknown=True).events
            except Exception:  # noqa: BLE001 (a rank killed mid-write: what is readable counts)
                events = []
        iters = [e.end_ns for e in events if type(e).__name__ == "Iteration"]
        # the rank's clock onto the coordinator's, then engine time
        off = (emu.offset_ns or 0) - emu.clock_offsets.get(r, 0)
        wall_times = np.diff(np.asarray(iters, np.int64) - off, prepend=0).tolist() if iters else []
        sl = graph.nodes_of(r)
        marks = np.flatnonzero(graph.kind[sl] == 5) + sl.start
        done = end[marks]
        times = np.diff(done[done >= 0], prepend=0).tolist() if len(marks) else []
        mems = [e for e in events if type(e).__name__ == "Memory"]
        peaks = _peaks(mems)
        src = plan.source(r) if plan is not None else r  # scaled: the captured rank it copies
        capture_peaks = _peaks(_memory_events(runfolder.rank_path(run, src)))
        losses = parse_losses(_read_text(runfolder.log_path(out, r)))
        captured = parse_losses(_read_text(runfolder.log_path(run, src)))
        per_rank[str(r)] = {
            "iteration_ns": times,
            "wall_iteration_ns": wall_times,
            "prism_overhead_ns": emu.stats.dilation_ns.get(r),
            "mean_iteration_ns": float(np.mean(times[config.warmup:])) if len(times) > config.warmup else None,
            "losses": losses,
            "capture_losses": captured,
            "losses_equal": (losses == {k: v for k, v in captured.items() if k in losses}) if losses else None,
            "max_loss_rel_diff": _max_rel(losses, captured),
            "peak_allocated": max(peaks.values(), default=None),
            "capture_peak_allocated": max(capture_peaks.values(), default=None),
            # per step: torch's peak allocated bytes, the emulation's beside the capture's
            "peak_allocated_by_step": {str(k): v for k, v in peaks.items()},
            "capture_peak_allocated_by_step": {str(k): v for k, v in capture_peaks.items()},
            "peaks_equal": ({k: capture_peaks.get(k) for k in peaks} == peaks) if peaks else None,
            "peak_rss_bytes": getattr(emu._processes, "peak_rss", {}).get(r),
            "divergence": emu.stats.divergence.get(r, ""),
            "resized": emu.stats.resized.get(r, ""),
            "recorded": r in recordings,
            "capture_rank": src,
            # the coordinator's clock less this rank's (0 on one host; a sandbox on another node: from its Hello)
            "clock_offset_ns": emu.clock_offsets.get(r, 0),
        }
    job_times = emulated.iteration_times.tolist() if result.status == "ok" else []
    turn = np.asarray(emu.stats.turnaround_ns or [0], np.int64)
    lag = np.asarray(emu.stats.lag_ns or [0], np.int64)
    walls = [x for info in per_rank.values() for x in info["wall_iteration_ns"][config.warmup:]]
    overhead = [v for v in emu.stats.dilation_ns.values()]
    groups_with_sandbox = sum(1 for g in graph.groups if set(g.ranks) & set(sandbox))
    summary: dict[str, Any] = {
        "run": str(run), "emulation": name, "status": result.status, "message": result.message,
        "exit_code": result.exit_code, "world_size": world, "sandbox": sandbox, "command": cmd,
        "dormant": dormant, "live": len(engine.live), "dormant_ranks": len(engine.dormant),
        "folded": len(engine.folded), "stepped": len(engine.stepped),
        "scaled": scaled,
        "recording": ("used" if recordings else "not used: the run is scaled out, its recorded values are the "
                      "small world's; every virtual contribution is compensated" if scaled and config.use_recording
                      else "none"),
        "prefetch_pool_bytes": pool or None,
        # --device-path: cuda_ext's path ("kernels" or "fallback") and why, as checked before the sandboxes started
        "cuda_ext": kernels,
        "cost_model": model.name, "cost_model_choice": why, "warmup": config.warmup,
        # the virtual ranks' compute: a stored slice calibration, or as captured (with why that may run long)
        "calibration": None if calibration is None else {k: calibration.get(k) for k in ("name", "created_utc",
                                                                                          "slices", "symmetric")},
        "calibration_hint": hint,
        "predicted_iteration_ns": batch.iteration_times.tolist(),
        "predicted_mean_ns": _mean(batch.iteration_times.tolist(), config.warmup),
        "emulated_iteration_ns": job_times,
        "emulated_mean_ns": _mean(job_times, config.warmup),
        "ranks": per_rank,
        "groups": {"in_graph": len(graph.groups), "with_sandbox": groups_with_sandbox,
                   "instantiated": len(emu.stats.groups_created)},
        "calls": {"recorded": emu.stats.recorded_calls, "compensated": emu.stats.compensated_calls,
                  "pruned": emu.stats.pruned_calls,
                  "on_device": emu.stats.device_calls, "sends_on_device": emu.stats.device_sends,
                  "reached_on_gpu": emu.stats.reached_calls,
                  # protocol 12: the arrival sent at the reach, with it (no Reached of its own)
                  "arrived_with_reach": emu.stats.arrived_with_reach,
                  "released_before_reach": emu.stats.early_releases, "early_release_off": emu.stats.early_off,
                  # PRISM_DEVICE_SHARED_RELEASE=1: released by the coordinator writing the rank's flag
                  "released_through_shared_memory": emu.stats.shared_releases,
                  "implicit_waits": emu.stats.implicit_waits, "deliveries": emu.stats.deliveries},
        "pacing": {"lead_ns": LEAD_NS,
                   "turnaround_p50_ns": int(np.percentile(turn, 50)), "turnaround_p99_ns": int(np.percentile(turn, 99)),
                   "lag_p50_ns": int(np.percentile(lag, 50)), "lag_p99_ns": int(np.percentile(lag, 99)),
                   "prism_overhead_ns": max(overhead) if overhead else None,
                   # device path: how long after the CPU issued a call its stream reached it
                   "reach_lag_p50_ns": int(np.percentile(emu.stats.reach_lag_ns, 50)) if emu.stats.reach_lag_ns else None,
                   "reach_lag_p99_ns": int(np.percentile(emu.stats.reach_lag_ns, 99)) if emu.stats.reach_lag_ns else None},
        "coordinator": {"cpu_s": coord_cpu, "wall_s": wall, "setup_s": setup_s, "load_s": load_s,
                        "engine_events": engine.events,
                        "cpu_s_per_iteration": coord_cpu / max(len(job_times), 1),
                        "wall_s_per_iteration": float(np.mean(walls)) / 1e9 if walls else None,
                        "peak_rss_bytes": _peak_rss()},
        "groups_renamed": emu.stats.renamed_groups,
        "incomplete_capture": list(missing),
        "failed_ranks": {str(k): v[-4000:] for k, v in result.failed_ranks.items()},
        # with --agents: where each sandbox ran
        "agents": ([{"node": h.node, "host": h.host, "slots": h.slots, "ranks": ranks}
                    for h, ranks in agent_procs.placement()] if agent_procs is not None else None),
    }
    if result.status == "ok":
        try:
            tl = Timeline(graph, start, end, engine.costs, "emulated")
            shown = sorted(set(sandbox) | set(sorted(engine.live)[:62]))
            trace = chrome_trace(tl, ranks=shown, metadata={"prism": "emulation", "sandbox": sandbox,
                                                            "run": str(run)})
            (out / "timeline.json").write_bytes(orjson.dumps(trace))
            summary["timeline"] = str(out / "timeline.json")
        except Exception as e:  # noqa: BLE001 (the timeline is a view; the results stand without it)
            summary["timeline_error"] = str(e)
    rss["results"] = _peak_rss()
    summary["coordinator"]["peak_rss_bytes"] = rss["results"]
    # the peak so far after each phase: where the coordinator's memory goes
    summary["coordinator"]["peak_rss_after_bytes"] = rss
    (out / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    return EmulationOutcome(out, result.exit_code, result.status, result.message, summary)


def _peak_rss() -> int:
    """This process's peak resident set so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _PayloadCache:
    """A capture's recorded bytes, each side file read once (the first time
    one of its records is needed) and checked against the digests then, so
    a release on the sandbox's critical path costs a slice, not a read."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self._files: dict[str, bytes] = {}

    def load(self, record: Any) -> memoryview:
        from prism.core.payloads import digest
        from prism.core.trace import TraceFormatError
        from prism.shell import runfolder

        data = self._files.get(record.file)
        if data is None:
            path = self.run / record.file
            try:
                data = self._files[record.file] = path.read_bytes()
            except OSError as e:
                raise TraceFormatError(f"cannot read the recorded payloads {path}: {e}") from None
        view = memoryview(data)[record.offset:record.offset + record.nbytes]
        if len(view) != record.nbytes or digest(view) != record.digest:
            # The slow path names what is wrong.
            return memoryview(runfolder.load_payload(self.run, record))
        return view


def _write_trips(template: str, trips: list[dict]) -> None:
    """The coordinator's side of the device path's call log (``--device-path``
    with ``PRISM_DEVICE_CALL_LOG``): per released collective, when its
    ``Reached`` came in (``c_in``) and its result went out (``c_out``), host
    monotonic ns, as rank ``coord`` beside the ranks' logs
    (``bench/host_time.py`` joins them into the release's round trip)."""
    import orjson

    path = template.replace("{rank}", "coord") if "{rank}" in template else template + ".coord"
    try:
        with open(path, "wb") as f:
            for t in trips:
                f.write(orjson.dumps(t) + b"\n")
    except OSError as e:
        print(f"prism: could not write the coordinator's call log {path}: {e}", flush=True)


def _mean(times: Sequence[float], warmup: int) -> float | None:
    return float(np.mean(times[warmup:])) if len(times) > warmup else None


def _memory_events(path: Path) -> list[Any]:
    """A rank file's Memory records ([] where it is missing or unreadable)."""
    from prism.shell import runfolder

    if not path.is_file():
        return []
    try:
        events = runfolder.read_rank_file(path, ignore_unknown=True).events
    except Exception:  # noqa: BLE001 (a rank killed mid-write: nothing to compare)
        return []
    return [e for e in events if type(e).__name__ == "Memory"]


def _peaks(mems: list[Any]) -> dict[int, int]:
    """step -> the highest torch peak allocated of its Memory samples."""
    out: dict[int, int] = {}
    for m in mems:
        out[m.step] = max(out.get(m.step, 0), m.peak_allocated)
    return out


def _max_rel(losses: dict[int, str], captured: dict[int, str]) -> float | None:
    diffs = []
    for k, v in losses.items():
        if k in captured:
            try:
                a, b = float(v), float(captured[k])
            except ValueError:
                continue
            diffs.append(abs(a - b) / max(abs(b), 1e-30))
    return max(diffs) if diffs else None


def _ms(ns: float | None) -> str:
    return "n/a" if ns is None else f"{ns / 1e6:,.3f} ms"


def format_summary(s: dict, out_dir: Path) -> str:
    """The table ``prism emulate`` prints at the end."""
    lines = []
    if s.get("status") != "ok":
        lines.append(f"prism emulate: FAILED ({s.get('status')}):\n{s.get('message', '').rstrip()}")
    sc = s.get("scaled")
    if sc:
        lay = sc["from_layout"]
        lines.append(f"scaled out: the capture's world {sc['captured_world']} (tp{lay['tp']} pp{lay['pp']} "
                     f"dp{lay['dp']}{' ep' + str(lay['ep']) if lay['ep'] > 1 else ''}) grown to dp {sc['to_dp']}: "
                     f"world {sc['world']}; {s['recording']}"
                     + ("" if sc["command_dp_flag"] else "; the command has no --dp flag to set, so it runs as "
                        "given (the script must read its DP degree from WORLD_SIZE)"))
    lines.append(f"emulation of {s['run']} (world {s['world_size']}): sandbox ranks {compact_ranks(s['sandbox'])}; "
                 f"{s['live']} live and {s['dormant_ranks']} dormant virtual ranks ({s['dormant']})"
                 + (f"; {s['folded']:,} of them folded into copies they equal, {s['stepped']} ranks stepped"
                    if s.get("folded") else ""))
    for a in s.get("agents") or ():
        if not a["ranks"]:
            lines.append(f"agent {a['node']} on {a['host']} had no sandbox rank in this run")
            continue
        lines.append(f"agent {a['node']} on {a['host']} ran sandbox ranks {compact_ranks(a['ranks'])}"
                     + (f" (more than its {a['slots']} slots: they shared cores, which their timing shows)"
                        if len(a["ranks"]) > a["slots"] else ""))
    gr = s["groups"]
    lines.append(f"groups: {gr['instantiated']} instantiated for real (the sandbox's), of {gr['in_graph']} in the "
                 f"graph ({gr['with_sandbox']} have a sandbox member)")
    c = s["calls"]
    lines.append(f"calls: {c['recorded']} answered from the recording, {c['compensated']} compensated"
                 + (f" ({c['on_device']} of them on the sandbox's GPU, no host round trip)" if c.get("on_device") else "")
                 + (f"; {c['sends_on_device']} sends to virtual ranks kept on the GPU" if c.get("sends_on_device")
                    else "")
                 + (f"; {c['pruned']} run by the sandbox members among themselves (--pruned)"
                    if c.get("pruned") else "")
                 + f"; {c['deliveries']} results released")
    if s.get("prefetch_pool_bytes"):
        lines.append(f"prefetch pool: {s['prefetch_pool_bytes'] / 2**20:.0f} MiB of device memory per sandbox rank "
                     "(Prism's own, outside torch's allocator; each rank's log ends with its use)")
    cal = s.get("calibration")
    if cal:
        lines.append(f"virtual ranks' compute: slice calibration {cal.get('name')!r} of {cal.get('created_utc')} "
                     f"({len(cal.get('slices') or [])} slices{', symmetric' if cal.get('symmetric') else ''})")
    elif s.get("calibration_hint"):
        lines.append(s["calibration_hint"])
    lines.append(f"{'':<28}{'iteration time':>16}")
    lines.append(f"{'capture prediction':<28}{_ms(s['predicted_mean_ns']):>16}")
    lines.append(f"{'emulated job':<28}{_ms(s['emulated_mean_ns']):>16}")
    for r, info in s["ranks"].items():
        eq = info["losses_equal"]
        loss = ("losses equal to the capture's" if eq else
                f"losses moved by up to {info['max_loss_rel_diff']:.3g} (relative)" if info["max_loss_rel_diff"]
                is not None else "no losses printed" if eq is None else "losses differ")
        peak = f", torch peak {info['peak_allocated']:,} B" if info["peak_allocated"] is not None else ""
        if info["peak_allocated"] is not None and info.get("capture_peak_allocated") is not None:
            peak += (" (equal to the capture's at every step)" if info.get("peaks_equal") else
                     f" (capture's {info['capture_peak_allocated']:,} B)")
        if info.get("peak_rss_bytes"):
            peak += f", process peak RSS {info['peak_rss_bytes'] / 2**20:,.0f} MiB"
        lines.append(f"{'sandbox rank ' + r:<28}{_ms(info['mean_iteration_ns']):>16}  {loss}{peak}")
        if info.get("prism_overhead_ns") is not None and info["wall_iteration_ns"]:
            n = max(len(info["wall_iteration_ns"]), 1)
            lines.append(f"  its wall clock: {_ms(_mean(info['wall_iteration_ns'], s['warmup']))} per step; Prism's own "
                         f"delay in its waits, {_ms(info['prism_overhead_ns'] / n)} per step, is not the job's and is "
                         "taken out of the emulated time")
        if info["divergence"]:
            lines.append(f"  {info['divergence']}")
        if info.get("resized"):
            lines.append(f"  its token dispatch moved other sizes than the capture's from {info['resized']} "
                         "(data-dependent; the virtual ranks keep the capture's timing)")
    if s["predicted_mean_ns"] and s["emulated_mean_ns"]:
        d = s["emulated_mean_ns"] / s["predicted_mean_ns"] - 1
        lines.append(f"emulated vs predicted: {d:+.2%} (mean of steps {s['warmup']}.., warm-up dropped)")
    p, co = s["pacing"], s["coordinator"]
    lines.append(f"pacing: results left {p['turnaround_p50_ns'] / 1e6:.3f} ms after the coordinator took the call "
                 f"(p50; p99 {p['turnaround_p99_ns'] / 1e6:.3f}), each held by its rank until the emulated release")
    if p.get("reach_lag_p50_ns") is not None:
        lines.append(f"device path: {s['calls']['reached_on_gpu']:,} calls arrived when the GPU reached them, "
                     f"{p['reach_lag_p50_ns'] / 1e6:.3f} ms after the CPU issued them (p50; p99 "
                     f"{p['reach_lag_p99_ns'] / 1e6:.3f}); {s['calls'].get('released_before_reach', 0):,} of them "
                     "released before their reach came (their completion known)"
                     + (f", {s['calls']['early_release_off']} completed at another time than released (a Prism "
                        "bug: please report it)" if s['calls'].get('early_release_off') else ""))
    lines.append(f"pacing lag: results left {p['lag_p50_ns'] / 1e6:+.3f} ms from their emulated release on the "
                 f"rank's clock (p50; p99 {p['lag_p99_ns'] / 1e6:+.3f}; negative: ahead, held by the rank)")
    per = co.get("wall_s_per_iteration")
    lines.append(f"coordinator: {co['cpu_s']:.2f} s CPU ({co['cpu_s_per_iteration']:.3f} s per emulated iteration), "
                 f"{co['wall_s']:.1f} s wall" + (f" ({per:.3f} s per emulated iteration)" if per else "")
                 + f", load {co.get('load_s', 0):.2f} s, setup {co['setup_s']:.2f} s, {co['engine_events']:,} engine "
                 f"events, peak RSS {co.get('peak_rss_bytes', 0) / 2**20:,.0f} MiB")
    lines.append(f"results: {out_dir}/summary.json" + (f", timeline {s['timeline']}" if s.get("timeline") else ""))
    return "\n".join(lines)
