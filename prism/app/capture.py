"""Capture an unmodified ``torch.distributed`` script as N logical ranks.

``capture(CaptureConfig(world_size=16, command=["train.py", "--tp", "2"]))``
checks the options (``plan_capture``: the command, the run directory, the GPU
plan), makes the run directory, starts an embedded coordinator (or joins one
given as ``coordinator``), launches one process per logical rank through the
fork server, and returns a ``CaptureOutcome``: how the capture ended, where
its trace is, and the swap summary of a GPU capture. ``capture_run`` is the
same without the option checks, for callers that build a ``GpuPlan``
themselves. A capture that fails (a mismatch, a deadlock, a failed rank) is a
result, not an exception; the trace so far is kept valid.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prism import __version__
from prism.app.errors import PrismError, UsageError
from prism.app.trace import compact_ranks
from prism.core import payloads as PL
from prism.core import trace as T
from prism.shell import runfolder

#: What a rank's GPU holds outside torch's allocator: a CUDA context with
#: torch's kernels takes about 0.6 GiB on an H200 (docs/DESIGN.md, pitfalls).
#: NCCL's own buffers (0.8-1.5 GiB per rank, measured on H200s:
#: bench/results/nccl_accuracy-2026-11-30.md) are not in the default: add them
#: with ``memory_overhead_gib`` for a job that uses NCCL.
DEFAULT_MEMORY_OVERHEAD_GIB = 0.6

__all__ = ["AgentsError", "CaptureConfig", "CapturePlan", "CaptureOutcome", "capture", "plan_capture", "capture_run",
           "serve_coordinator", "default_out", "layout_of", "device_kind_of", "manifest_for", "join_agents",
           "advertised", "gang_of", "setup_agent_swaps"]


@dataclass(frozen=True)
class CaptureConfig:
    """What to capture and how. ``command`` is ``[SCRIPT, ARGS...]`` or
    ``["-m", MODULE, ARGS...]``. ``show_ranks``: whose output reaches the
    console besides failing ranks ("all", "none" or a tuple of ranks).
    ``progress``: "auto", "on" or "off" (a live line on stderr). The
    library's defaults are quiet; the command line passes its own."""

    world_size: int
    command: Sequence[str]
    out: str | os.PathLike[str] | None = None
    slots: int | None = None
    coordinator: str | None = None
    nproc_per_node: int = 8
    show_ranks: str | tuple[int, ...] = ()
    quiet_s: float = 30.0
    progress: str = "off"
    # GPUs (see prism.shell.gpu_plan)
    gpus: str | None = None
    resident: int | None = None
    gang: str | None = None
    rank_memory_gib: float = 2.0
    #: CPU dry run of the GPU swap policy; seconds per swap (None: off).
    simulate_swaps: float | None = None
    #: Through agents: how long one swap may take on its node before the
    #: capture stops, naming the node (a hung checkpoint driver).
    swap_timeout_s: float = 600.0
    #: Emulate a GPU of this many GiB for every rank (None: the real device's memory).
    memory_limit_gib: float | None = None
    #: Of ``memory_limit_gib``, what the real job holds outside torch's allocator
    #: that Prism's ranks do not (the CUDA context; NCCL's buffers).
    memory_overhead_gib: float = DEFAULT_MEMORY_OVERHEAD_GIB
    #: ``--record``: ranks whose received tensors (and sent digests) are kept,
    #: as ``"0,5"``, ``"0-3"`` or ``"all"`` (None: nothing recorded).
    record: str | None = None
    #: ``--record-steps``: only these iterations (``"1-2"``, ``"0,3-"``; None: all).
    record_steps: str | None = None
    #: ``--record-limit``: at most this many GiB of recorded tensors, all ranks together.
    record_limit_gib: float = PL.DEFAULT_RECORD_LIMIT / 2**30
    #: ``--value-limit``: tensors up to this many bytes have their values in the trace (0: none).
    small_tensor_limit: int = T.DEFAULT_SMALL_TENSOR_LIMIT
    # Agents (``prism agent`` on each node; prism.shell.agent)
    #: Serve the ranks through this many agents (0: launch them here).
    agents: int = 0
    #: Where the agents join: ``tcp://HOST:PORT`` (the ranks get a port of their own on HOST).
    listen: str | None = None
    #: ``prism keys`` directory (CURVE for agents and ranks); None only with ``insecure``.
    keys: str | os.PathLike[str] | None = None
    #: Plaintext tcp (a private network only).
    insecure: bool = False
    #: How long to wait for the agents to join.
    agent_wait_s: float = 60.0


@dataclass
class CapturePlan:
    """A checked ``CaptureConfig``: the command, the run directory, the slots and the GPU plan."""

    config: CaptureConfig
    command: list[str]
    run_dir: Path
    slots: int
    #: ``prism.shell.gpu_plan.GpuPlan``, or None for a CPU capture.
    gpu: Any = None
    #: Advice about the chosen options, for the user.
    notes: list[str] = field(default_factory=list)
    #: ``--record``'s checked plan (None: nothing recorded).
    record: PL.RecordPlan | None = None
    #: A CUDA command served by agents: the ranks run on the agents' GPUs.
    agent_gpus: bool = False
    #: ``--memory-limit`` through agents: torch's allocator budget per rank (bytes).
    agent_memory_limit_bytes: int | None = None


@dataclass
class CaptureOutcome:
    """How a capture ended. ``result`` is the coordinator's
    ``prism.shell.coordinator.CaptureResult`` (None when the ranks joined an
    external coordinator, which records the trace itself)."""

    run_dir: Path
    exit_code: int
    result: Any = None
    #: Rank -> exit code of ranks that failed (external-coordinator mode).
    failed_exits: dict[int, int] = field(default_factory=dict)
    #: A GPU capture's swap summary (``prism.shell.swap.write_report``) and its one-line form.
    swaps: dict | None = None
    swap_line: str = ""
    coordinator: str | None = None
    world_size: int = 0
    #: ``--record``'s summary (``payloads/summary.json``), None when nothing was recorded.
    record: dict | None = None
    #: With agents: (node, host, ranks) of each.
    placement: list[tuple[str, str, list[int]]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def text(self) -> str:
        """What ``prism capture`` prints at the end (on stderr)."""
        run_dir = self.run_dir
        if self.result is None:
            if self.failed_exits:
                return f"prism capture: ranks failed: {self.failed_exits}; see {run_dir / runfolder.LOGS_DIR}"
            return (f"prism capture: all {self.world_size} ranks finished; the coordinator at {self.coordinator} "
                    f"recorded the trace into its own --out; rank logs are in {run_dir / runfolder.LOGS_DIR}")
        lines = [self.swap_line] if self.swap_line else []
        rec = self.record
        if rec is not None:
            n = sum(rec["records"].values())
            lines.append(f"prism: recorded {n:,} payload records ({rec['bytes']:,} bytes received) of ranks "
                         f"{compact_ranks(rec['ranks'])}, steps {rec['steps']}, into {run_dir / runfolder.PAYLOADS_DIR}")
            if rec["stopped"]:
                lines.append(f"prism: warning: {rec['stopped']}")
        for node, host, ranks in self.placement:
            lines.append(f"prism: agent {node} on {host} ran ranks {compact_ranks(ranks)}")
        r = self.result
        if r.status == "ok":
            lines.append(f"prism: captured {r.steps_done} steps of {run_dir} in {r.wall_s:.1f} s; "
                         f"`python -m prism trace summary {run_dir}` shows it")
        else:
            lines.append(f"prism: capture FAILED ({r.status}) after {r.wall_s:.1f} s:\n{r.message}\n"
                         f"The trace so far is kept in {run_dir}; rank logs in {run_dir / runfolder.LOGS_DIR}.")
        return "\n".join(lines)


def default_out(prefix: str) -> Path:
    """``runs/PREFIX-YYYYmmdd-HHMMSS``."""
    return Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"


def _check_command(command: Sequence[str]) -> list[str]:
    cmd = list(command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("give the script to run after --, e.g. `prism capture -n 4 -- train.py --lr 1e-3`")
    if cmd[0] == "-m" and len(cmd) < 2:
        raise UsageError("-m needs a module name, e.g. `-- -m mypkg.train`")
    if cmd[0] != "-m" and not Path(cmd[0]).is_file():
        raise UsageError(f"script {cmd[0]!r} does not exist (use -m MODULE for a module)")
    return cmd


def layout_of(cmd: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """Parallel degrees given as flags (--tp 2 --pp 2 ...), recorded in the manifest."""
    out = []
    for i, word in enumerate(cmd[:-1]):
        m = re.fullmatch(r"--(tp|pp|dp|ep|cp|sp)", word)
        if m and cmd[i + 1].isdigit():
            out.append((m.group(1), int(cmd[i + 1])))
    return tuple(out)


def device_kind_of(cmd: Sequence[str]) -> str:
    """"cuda" when the command names a CUDA device, else "cpu"."""
    return "cuda" if any(w == "cuda" or w.startswith("cuda:") for w in cmd) else "cpu"


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def manifest_for(run_dir: Path, world_size: int, cmd: Sequence[str], slots: int, device_kind: str,
                 notes: Sequence[tuple[str, str]] = ()) -> T.Manifest:
    """The manifest a capture of ``cmd`` into ``run_dir`` writes."""
    return T.Manifest(
        version=T.TRACE_VERSION, run_id=run_dir.name, world_size=world_size,
        created_unix_ns=time.time_ns(), command=tuple(cmd), device_kind=device_kind,
        prism_version=__version__, torch_version=_torch_version(), hostname=socket.gethostname(),
        layout=layout_of(cmd), notes=(("slots", str(slots)), *notes),
    )


def _record_plan(config: CaptureConfig) -> PL.RecordPlan | None:
    if config.record is None:
        if config.record_steps is not None:
            raise UsageError("--record-steps chooses the steps --record keeps: give --record RANKS too")
        return None
    if config.coordinator is not None:
        raise UsageError("--record keeps payloads at the embedded coordinator; a standalone one "
                         "(--coordinator) records none: drop one of the two")
    try:
        ranks = PL.RecordPlan.parse_ranks(config.record, config.world_size)
    except ValueError as e:
        raise UsageError(f"--record: {e}") from None
    try:
        steps = PL.StepSet.parse(config.record_steps) if config.record_steps is not None else None
    except ValueError as e:
        raise UsageError(f"--record-steps: {e}") from None
    if not config.record_limit_gib > 0:
        raise UsageError(f"--record-limit must be more than 0 GiB, got {config.record_limit_gib}")
    return PL.RecordPlan(ranks, steps, int(config.record_limit_gib * 2**30))


def agents_wanted(what: str, agents: int, listen: str | None, keys: Any, insecure: bool) -> bool:
    """Whether agents serve a command (``what``: "a capture", "an
    emulation"); ``UsageError`` for --listen/--keys/--insecure without
    --agents or a negative count. The command's own checks follow, then
    ``check_agent_address``."""
    if not agents:
        if listen is not None or keys is not None or insecure:
            raise UsageError(f"--listen, --keys and --insecure are for {what} served by agents: add --agents N")
        return False
    if agents < 0:
        raise UsageError(f"--agents must be at least 1, got {agents}")
    return True


def check_agent_address(listen: str | None, keys: Any, insecure: bool) -> None:
    """``UsageError`` for a missing --listen, or tcp without keys and without --insecure."""
    if listen is None:
        raise UsageError("--agents needs --listen tcp://HOST:PORT, the address the agents join")
    if keys is None and not insecure:
        raise UsageError("--agents talks tcp with CURVE: pass --keys DIR (made by `prism keys DIR`), or --insecure "
                         "on a private network")


def _check_agents(config: CaptureConfig) -> None:
    if not agents_wanted("a capture", config.agents, config.listen, config.keys, config.insecure):
        return
    if config.coordinator is not None:
        raise UsageError("--agents serves the ranks from this capture's coordinator; --coordinator joins another: "
                         "drop one of the two")
    if config.gpus is not None:
        raise UsageError("--gpus names this machine's GPUs; with --agents each node's agent offers its own "
                         "(`prism agent --gpus 0,1`, default every GPU it sees): drop --gpus")
    if config.resident is not None and config.simulate_swaps is None and device_kind_of(config.command) != "cuda":
        raise UsageError("--resident through agents swaps ranks on the agents' GPUs, but the command runs on CPU: "
                         "give the script its cuda device (e.g. --device cuda), or add --simulate-swaps for a CPU "
                         "dry run of the swaps")
    if config.resident is None and config.gang is not None:
        raise UsageError("--gang chooses the ranks --resident swaps together; through agents every rank stays "
                         "resident unless --resident K is given: add it, or drop --gang")
    if not config.swap_timeout_s > 0:
        raise UsageError(f"--swap-timeout {config.swap_timeout_s:g}: give the seconds one swap may take on its "
                         "node, more than 0")
    check_agent_address(config.listen, config.keys, config.insecure)
    from prism.core.agents import assign_blocks

    try:
        assign_blocks(config.world_size, config.agents, gang_of(config.command))
    except ValueError as e:
        raise UsageError(f"--agents {config.agents}: {e}") from None


def gang_of(cmd: Sequence[str]) -> int:
    """Ranks that stay on one node: the TP group (the ``--tp`` flag), as a
    real job's placement keeps it on a node's NVLink (pipeline stages and
    data-parallel replicas may span nodes)."""
    return dict(layout_of(list(cmd))).get("tp", 1)


def prestart_forkserver() -> None:
    """Start the fork server of this process's next launch of ranks now
    (``prism.shell.launcher.prestart_forkserver``): its import of torch
    overlaps with this process's own start. The command line does it for
    the commands that launch ranks (capture, emulate, run, calibrate)."""
    from prism.shell.launcher import prestart_forkserver as start

    start()


def plan_capture(config: CaptureConfig) -> CapturePlan:
    """Check ``config``; raises ``UsageError`` naming the bad option."""
    if config.world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {config.world_size}")
    if config.small_tensor_limit < 0:
        raise UsageError(f"--value-limit must be 0 or more bytes, got {config.small_tensor_limit}")
    cmd = _check_command(config.command)
    record = _record_plan(config)
    _check_agents(config)
    run_dir = Path(config.out) if config.out else default_out("capture")
    if (run_dir / runfolder.RANKS_DIR).exists() and any((run_dir / runfolder.RANKS_DIR).iterdir()):
        raise UsageError(f"run directory {run_dir} already holds a capture; choose another --out")
    from prism.shell.gpu_plan import GpuPlanError, plan_gpus, visible_gpus

    simulate = config.simulate_swaps
    if simulate is not None:
        if device_kind_of(cmd) == "cuda":
            raise UsageError("--simulate-swaps runs the ranks on CPU, but the command uses cuda; give the script "
                             "--device cpu (the swaps are decided the same way)")
        if config.resident is None:
            raise UsageError("--simulate-swaps needs --resident K (how many ranks the GPU would hold)")
        if simulate < 0:
            raise UsageError(f"--simulate-swaps {simulate}: seconds per swap must be 0 or more")
    if config.agents and (device_kind_of(cmd) == "cuda" or simulate is not None):
        # the agents' GPUs, not this machine's: placed once the agents join (agent_gpu_env)
        notes: list[str] = []
        if simulate is not None and config.memory_limit_gib is not None:
            raise UsageError("--memory-limit emulates a smaller GPU for ranks that use one: give the script a cuda "
                             "device (or --gpus)")
        limit = _allocator_budget(config, notes) if config.memory_limit_gib is not None else None
        gpu = _agent_swap_plan(config, cmd, simulate) if config.resident is not None else None
        if gpu is not None:
            notes += gpu.notes
        return CapturePlan(config, cmd, run_dir, config.slots or 0, gpu, notes, record,
                           agent_gpus=device_kind_of(cmd) == "cuda", agent_memory_limit_bytes=limit)
    try:
        gpu = plan_gpus(config.world_size, dict(layout_of(cmd)), uses_cuda=device_kind_of(cmd) == "cuda",
                        gpus=config.gpus or ("0" if simulate is not None else None), resident=config.resident,
                        gang=config.gang, slots=config.slots, rank_memory_gib=config.rank_memory_gib)
    except (GpuPlanError, ValueError) as e:
        raise UsageError(str(e)) from None
    if simulate is not None and gpu is not None:
        from prism.shell.swap import SimulatedDriver

        gpu.driver = SimulatedDriver(simulate)
        gpu.simulated = True
        gpu.settings["simulated"] = {"driver": "SIGSTOP/SIGCONT", "seconds_per_swap": simulate}
    notes = list(gpu.notes) if gpu is not None else []
    if config.memory_limit_gib is not None:
        if gpu is None or gpu.simulated:
            raise UsageError("--memory-limit emulates a smaller GPU for ranks that use one: give the script a cuda "
                             "device (or --gpus)")
        gpu.memory_limit_bytes = _allocator_budget(config, notes)
    if gpu is None and simulate is None and not any(w == "cpu" or w.startswith("cpu:") for w in cmd):
        seen = visible_gpus()
        if seen:
            notes.append(f"the command names no device and this machine has {len(seen)} GPU(s): "
                         "a script that takes CUDA when it is there would run rank r on GPU LOCAL_RANK with no "
                         "logical devices; to capture on GPUs pass --gpus (e.g. --gpus 0), to stay on CPU give the "
                         "script its CPU flag")
    slots = gpu.slots if gpu is not None else (config.slots or os.cpu_count() or 1)
    return CapturePlan(config, cmd, run_dir, slots, gpu, notes, record)


def _agent_swap_plan(config: CaptureConfig, cmd: list[str], simulate: float | None) -> Any:
    """``--resident`` through agents: the swap plan (``GpuPlan`` with
    ``agent_swap``, the driver each node's agent loads) of ranks placed on
    the agents in whole TP groups. Its GPUs are the agents' (CUDA: known
    once they join, ``setup_agent_swaps``) or, with ``--simulate-swaps``,
    one simulated GPU per node, holding ``--resident`` ranks as one machine's
    simulated GPU does. A gang must lie on one node; ``UsageError`` otherwise."""
    from prism.core.agents import assign_blocks
    from prism.shell.gpu_plan import GpuPlanError, plan_gpus

    try:
        # One GPU as a stand-in while the agents' GPUs are unknown: it checks
        # the layout, the gang and --resident against the gang size.
        gpu = plan_gpus(config.world_size, dict(layout_of(cmd)), uses_cuda=False, gpus="0", resident=config.resident,
                        gang=config.gang, slots=None, rank_memory_gib=config.rank_memory_gib)
    except (GpuPlanError, ValueError) as e:
        raise UsageError(str(e)) from None
    assert gpu is not None  # resident is given
    blocks = assign_blocks(config.world_size, config.agents, gang_of(cmd))
    node_of = {r: i for i, block in enumerate(blocks) for r in block}
    members: dict[int, list[int]] = {}
    for r, g in gpu.gang_of.items():
        members.setdefault(g, []).append(r)
    for g, ranks in sorted(members.items()):
        nodes = sorted({node_of[r] for r in ranks})
        if len(nodes) > 1:
            raise UsageError(f"--gang {gpu.gang} with --agents {config.agents}: gang {g} (ranks "
                             f"{compact_ranks(sorted(ranks))}) would span nodes {nodes}, but a gang swaps as one on "
                             "one GPU; the agents get whole TP groups, so use --gang tp or --gang 1")
    if simulate is not None:
        gpu.agent_swap = {"driver": "simulated", "delay_s": simulate}
        gpu.simulated = True
        gpu.settings["simulated"] = {"driver": "SIGSTOP/SIGCONT", "seconds_per_swap": simulate,
                                     "gpus": "one per agent's node"}
    else:
        gpu.agent_swap = {"driver": "checkpoint"}
    gpu.settings["gpus"] = "the agents'"
    return gpu


def setup_agent_swaps(gpu: Any, agent_procs: Any, run_dir: Path, timeout_s: float = 600.0) -> None:
    """Once the agents joined and the ranks are placed: each rank's GPU
    (its node's GPUs, or the node's one simulated GPU), the swap policy and
    the coordinator's ``AgentSwapper`` (when some GPU holds more ranks than
    ``--resident``). ``UsageError`` (the agents refused with it) when a
    gang would span two GPUs of a node."""
    from prism.core.agents import node_gpu_of
    from prism.core.residency import GangResidency
    from prism.shell.agent import AgentSwapper

    placed = agent_procs.placement()
    blocks = [ranks for _, ranks in placed]
    gpus = [(0,) if gpu.simulated else tuple(h.gpus) for h, _ in placed]
    try:
        gpu.rank_gpu = node_gpu_of(blocks, gpus)
        if gpu.swapping:
            gpu.policy = GangResidency(gpu.resident, gpu.gang_of, gpu.rank_gpu)
    except ValueError as e:
        text = f"--resident {gpu.resident} through agents: {e}"
        agent_procs.close(reason=text)
        raise UsageError(text) from None
    per_gpu: dict[int, int] = {}
    for g in gpu.rank_gpu.values():
        per_gpu[g] = per_gpu.get(g, 0) + 1
    gpu.settings["ranks_per_gpu"] = max(per_gpu.values(), default=0)
    gpu.settings["agents"] = [{"node": h.node, "host": h.host, "ranks": compact_ranks(ranks),
                               "gpus": list(g)} for (h, ranks), g in zip(placed, gpus)]
    if gpu.swapping:
        gpu.executor = AgentSwapper(agent_procs, log=Path(run_dir) / "telemetry" / "swaps.jsonl",
                                    timeout_s=timeout_s)


def _allocator_budget(config: CaptureConfig, notes: list[str]) -> int:
    """``--memory-limit``: torch's allocator budget per rank in bytes (the
    limit less ``--memory-overhead``), with a note on what it leaves out."""
    budget = config.memory_limit_gib - config.memory_overhead_gib
    if budget <= 0:
        raise UsageError(f"--memory-limit {config.memory_limit_gib} GiB leaves nothing for torch's allocator "
                         f"after --memory-overhead {config.memory_overhead_gib} GiB")
    notes.append(f"--memory-limit {config.memory_limit_gib:g} GiB: torch's allocator may hold {budget:.2f} GiB "
                 f"per rank, the limit less {config.memory_overhead_gib:g} GiB (--memory-overhead) for what a "
                 "rank's GPU holds outside the allocator and Prism cannot see: the CUDA context (about 0.6 GiB "
                 "on an H200) and, in the real job, NCCL's buffers (0.8-1.5 GiB per rank measured on H200s; "
                 "add them to --memory-overhead for a job that uses NCCL); a request past the budget raises "
                 "torch.OutOfMemoryError in the rank")
    return int(budget * 2**30)


def capture(config: CaptureConfig | CapturePlan) -> CaptureOutcome:
    """Plan (unless given a plan) and run the capture."""
    plan = config if isinstance(config, CapturePlan) else plan_capture(config)
    c = plan.config
    # With agents and no --slots, the slots are the agents' (each says its own).
    slots = 0 if c.agents and c.slots is None else plan.slots
    return capture_run(plan.run_dir, c.world_size, plan.command, slots=slots, coordinator=c.coordinator,
                       nproc_per_node=c.nproc_per_node, show_ranks=c.show_ranks, quiet_s=c.quiet_s,
                       progress=c.progress, gpu=plan.gpu, record=plan.record,
                       small_tensor_limit=c.small_tensor_limit, agents=c.agents, listen=c.listen, keys=c.keys,
                       insecure=c.insecure, agent_wait_s=c.agent_wait_s, agent_gpus=plan.agent_gpus,
                       agent_memory_limit_bytes=plan.agent_memory_limit_bytes, swap_timeout_s=c.swap_timeout_s)


def agent_key(hello: Any) -> tuple[str, str, int]:
    """One agent among a run's (two started with the same --node-rank on one host share a name)."""
    return hello.node, hello.host, hello.pid


def agent_gpu_env(placement: Sequence[tuple[Any, list[int]]]) -> dict[tuple[str, str, int], dict[str, str]]:
    """A CUDA capture through agents: per agent (``agent_key``) the
    environment of its ranks: its GPUs (``PRISM_GPUS``) and its ranks
    (``PRISM_NODE_RANKS``), so each rank takes one of its node's GPUs in
    contiguous blocks (``prism.rank.placement.choose_node_gpu``). Every rank
    stays resident. ``UsageError`` naming a node with ranks and no GPU."""
    from prism.rank.envnames import GPUS_ENV, NODE_RANKS_ENV

    out = {}
    for hello, ranks in placement:
        if not ranks:
            continue
        if not hello.gpus:
            raise UsageError(f"this capture's command runs on cuda, but agent {hello.node} (host {hello.host}) "
                             f"offers no GPU for its ranks {compact_ranks(ranks)}: start it on a node with GPUs, "
                             "or with --gpus 0,1; or give the script --device cpu")
        out[agent_key(hello)] = {GPUS_ENV: ",".join(map(str, hello.gpus)), NODE_RANKS_ENV: compact_ranks(ranks)}
    return out


def place_on_agent_gpus(agent_procs: Any) -> dict[tuple[str, str, int], dict[str, str]]:
    """``agent_gpu_env`` of the agents' placement; a node without a GPU
    refuses the agents with the same reason (closing them) and raises."""
    try:
        return agent_gpu_env(agent_procs.placement())
    except UsageError as e:
        agent_procs.close(reason=str(e))
        raise


def capture_run(run_dir: str | os.PathLike[str], world_size: int, cmd: Sequence[str], *, slots: int,
                coordinator: str | None = None, nproc_per_node: int = 8, show_ranks: str | tuple[int, ...] = (),
                quiet_s: float = 30.0, progress: str = "off", gpu: Any = None,
                record: PL.RecordPlan | None = None,
                small_tensor_limit: int = T.DEFAULT_SMALL_TENSOR_LIMIT, agents: int = 0,
                listen: str | None = None, keys: str | os.PathLike[str] | None = None, insecure: bool = False,
                agent_wait_s: float = 60.0, agent_gpus: bool = False,
                agent_memory_limit_bytes: int | None = None, swap_timeout_s: float = 600.0) -> CaptureOutcome:
    """Capture ``cmd`` as ``world_size`` ranks into ``run_dir``. ``gpu`` is a
    ``prism.shell.gpu_plan.GpuPlan`` (None: CPU); ``record`` what to keep of
    the chosen ranks' payloads. ``agents``: serve the ranks through that many
    ``prism agent`` processes joining ``listen`` (CURVE with ``keys`` unless
    ``insecure``); ``agent_gpus``: a CUDA command on the agents' GPUs
    (``agent_gpu_env``), each rank's allocator held to
    ``agent_memory_limit_bytes`` if given (``--memory-limit``), a swap on a
    node allowed ``swap_timeout_s``. Raises ``UsageError`` when a GPU swap cannot be set up,
    ``AgentsError`` when the agents do not join."""
    run_dir = Path(run_dir)
    cmd = list(cmd)
    if show_ranks == "none":
        show_ranks = ()
    import trio

    from prism.shell.coordinator import Coordinator, Progress, default_stop_signals
    from prism.shell.launcher import launch_ranks
    from transport.endpoints import default_endpoint

    runfolder.make_run_dir(run_dir)
    agent_procs = agent_endpoint = node_slots = None
    if agents:
        agent_procs, agent_endpoint, agent_slots = join_agents(listen, agents, world_size, keys, insecure,
                                                                agent_wait_s)
        agent_procs.place(gang_of(cmd))
        node_env: dict[tuple[str, str, int], dict[str, str]] = {}
        if agent_gpus:
            node_env = place_on_agent_gpus(agent_procs)
            if agent_memory_limit_bytes is not None:
                from prism.rank.oom import MEMORY_LIMIT_ENV

                for e in node_env.values():
                    e[MEMORY_LIMIT_ENV] = str(agent_memory_limit_bytes)
            # one rank computes per GPU at a time, as on one machine
            agent_slots = sum(agent_procs.node_slots(gpus=True)[1])
        node_slots = agent_procs.node_slots(gpus=agent_gpus)
        if gpu is not None and gpu.agent_swap is not None:
            setup_agent_swaps(gpu, agent_procs, run_dir, swap_timeout_s)
            if gpu.simulated:
                # one simulated GPU per node: one rank computes on it at a time, as on one machine
                node_slots = (node_slots[0], [1] * len(node_slots[1]))
                agent_slots = len(node_slots[1])
        # --slots caps the run as a whole; each node computes on its own slots.
        slots = slots or agent_slots
    # A GPU plan means the ranks drive GPUs, whether or not the command says
    # so (scripts that take CUDA when it is there); simulated swaps run on CPU.
    kind = ("cuda" if (gpu is not None and not getattr(gpu, "simulated", False)) or agent_gpus
            else device_kind_of(cmd))
    limit = getattr(gpu, "memory_limit_bytes", None) or (agent_memory_limit_bytes if agent_gpus else None)
    notes = (("allocator_limit_bytes", str(limit)),) if limit else ()
    if record is not None:
        notes += (("record_ranks", compact_ranks(sorted(record.ranks))),
                  ("record_steps", str(record.steps) if record.steps is not None else "all"),
                  ("record_limit_bytes", str(record.limit_bytes)))
    runfolder.write_manifest(run_dir, manifest_for(run_dir, world_size, cmd, slots, kind, notes))

    env = gpu.env() if gpu is not None and agent_procs is None else {}
    if coordinator is not None:
        procs = launch_ranks(world_size, coordinator, run_dir, cmd, nproc_per_node=nproc_per_node,
                             show_ranks=show_ranks, env=env)
        codes = procs.wait()
        bad = {r: c for r, c in enumerate(codes) if c != 0}
        return CaptureOutcome(run_dir, 1 if bad else 0, failed_exits=bad, coordinator=coordinator,
                              world_size=world_size)

    if gpu is not None and agent_procs is None:
        from prism.shell.swap import SwapError

        try:
            gpu.setup(run_dir)
        except SwapError as e:
            raise UsageError(f"cannot swap ranks on the GPU: {e}") from None
    endpoint = default_endpoint(run_dir)

    def launch(endpoint: str) -> Any:
        return launch_ranks(world_size, endpoint, run_dir, cmd, nproc_per_node=nproc_per_node,
                            show_ranks=show_ranks, env=env)

    if agent_procs is not None:
        endpoint = agent_endpoint

        swap_spec = gpu.agent_swap if gpu is not None and gpu.executor is not None else None

        def launch(endpoint: str) -> Any:
            return agent_procs.launch(advertised(endpoint, listen), run_dir, cmd, nproc_per_node=nproc_per_node,
                                      show_ranks=show_ranks if show_ranks != "all" else range(world_size),
                                      env_of=lambda hello, _ranks: node_env.get(agent_key(hello), {}),
                                      swap=swap_spec)
    coord = Coordinator(run_dir, world_size, slots=slots, endpoint=endpoint,
                        quiet_s=quiet_s, progress=Progress(world_size, mode=progress),
                        launch=launch, curve_keys=None if insecure else keys,
                        authenticated=bool(agents),
                        node_slots=node_slots,
                        policy=gpu.policy if gpu is not None else None,
                        swapper=gpu.executor if gpu is not None else None, record=record,
                        small_tensor_limit=small_tensor_limit, stop_signals=default_stop_signals())
    if agent_procs is not None and gpu is not None and gpu.executor is not None:
        # A rank's swap times come on its node's clock: its offset maps them onto this one.
        gpu.executor.offset_of = lambda rank: getattr(coord.sessions.get(rank), "clock_offset_ns", 0)
    from prism.shell.telemetry import GpuSampler

    sampler = GpuSampler(run_dir, gpu.gpus if gpu is not None and not gpu.simulated and agent_procs is None
                         else None)
    sampler.start()
    try:
        result = trio.run(coord.run)
    finally:
        sampler.stop()
        if agent_procs is not None:
            agent_procs.close()
    outcome = CaptureOutcome(run_dir, result.exit_code, result, world_size=world_size,
                             record=coord.payloads.summary() if coord.payloads is not None else None)
    if agent_procs is not None:
        outcome.placement = [(h.node, h.host, ranks) for h, ranks in agent_procs.placement()]
    if gpu is not None:
        from prism.shell import swap

        if gpu.executor:
            gpu.executor.close()
        outcome.swaps = swap.write_report(run_dir, gpu.executor.records if gpu.executor else [], result.steps_done,
                                          gpu.settings, rescues=coord.rescues)
        if agent_procs is not None:
            where = ("simulated on CPU, one per agent's node" if gpu.simulated
                     else "on the agents' GPUs") + f", {len(outcome.placement)} agents"
        else:
            where = "simulated on CPU" if gpu.simulated else f"on GPUs {gpu.gpus}"
        outcome.swap_line = (swap.format_summary(outcome.swaps)
                             + f" [resident {gpu.resident}/GPU {where}, gang {gpu.gang}]")
    return outcome


class AgentsError(PrismError):
    """The agents did not join, or their keys or address are wrong (exit status 1)."""

    exit_code = 1


def join_agents(listen: str | None, agents: int, world_size: int, keys: Any, insecure: bool,
                 wait_s: float) -> tuple[Any, str, int]:
    """Listen for the agents and wait until all joined: their handle, the
    ranks' endpoint (a port of its own on the same host) and their slots."""
    from prism.shell.agent import AgentError, AgentProcesses

    if listen is None:
        raise UsageError("--agents needs --listen tcp://HOST:PORT, the address the agents join")
    try:
        procs = AgentProcesses(listen, agents, world_size, keys=keys, insecure=insecure)
    except AgentError as e:
        raise AgentsError(str(e)) from None
    try:
        hellos = procs.wait_agents(wait_s)
    except AgentError as e:
        procs.close()
        raise AgentsError(str(e)) from None
    host = listen.removeprefix("tcp://").rpartition(":")[0]
    return procs, f"tcp://{host}:*", sum(h.slots for h in hellos)


def advertised(bound: str, listen: str | None) -> str:
    """The ranks' endpoint as other nodes reach it: a wildcard host
    (``0.0.0.0``, ``*``) becomes this machine's name."""
    host, _, port = bound.removeprefix("tcp://").rpartition(":")
    if host in ("0.0.0.0", "*", "[::]", "::"):
        host = socket.getfqdn()
    return f"tcp://{host}:{port}"


def serve_coordinator(run_dir: str | os.PathLike[str], world_size: int, endpoint: str, *, slots: int | None = None,
                      quiet_s: float = 30.0, progress: str = "off",
                      on_listening: Callable[[str], None] | None = None) -> CaptureOutcome:
    """A standalone coordinator: listen on ``endpoint`` for ``world_size``
    ranks launched elsewhere (``capture(..., coordinator=ENDPOINT)``) and
    record their trace into ``run_dir``; ``on_listening(bound_endpoint)`` is
    called once it listens."""
    import trio

    from prism.shell.coordinator import Coordinator, Progress, default_stop_signals
    from transport.endpoints import UnsafeEndpointError, check_listen_endpoint

    # Checked before anything is made or started, so a refused endpoint is
    # one line of error, not a traceback out of the event loop.
    try:
        check_listen_endpoint(endpoint)
    except UnsafeEndpointError as e:
        raise UsageError(str(e)) from None
    run_dir = Path(run_dir)
    slots = slots or os.cpu_count() or 1
    runfolder.make_run_dir(run_dir)
    runfolder.write_manifest(run_dir, manifest_for(run_dir, world_size, [], slots, "cpu"))
    coord = Coordinator(run_dir, world_size, slots=slots, endpoint=endpoint, quiet_s=quiet_s,
                        progress=Progress(world_size, mode=progress), on_listening=on_listening,
                        stop_signals=default_stop_signals())
    result = trio.run(coord.run)
    return CaptureOutcome(run_dir, result.exit_code, result, world_size=world_size)
