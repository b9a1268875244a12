"""``prism agent``: serve a capture's or an emulation's ranks on this node (library API).

``serve_agent(AgentRunConfig(coordinator="tcp://head:29431", keys="keys"))``
joins the capture started with ``prism capture --agents N --listen ...``,
runs the block of ranks it assigns with this node's fork server, and returns
a ``prism.shell.agent.AgentOutcome``. ``runs``: how many runs it serves,
one after another (0: until stopped; a calibration's slices are one
emulation each). Without ``coordinator`` the address
comes from the launcher's environment (``prism.core.agents.discover``:
SLURM's or torchrun's variables; the coordinator's host is node 0) and
``port``. Everything the ranks write (logs, trace) goes to the capture's run
directory by path, so it must be on a filesystem every node shares.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from prism.app.errors import PrismError, UsageError
from prism.core import agents as A

__all__ = ["AgentRunConfig", "AgentFailed", "resolve", "serve_agent"]


class AgentFailed(PrismError):
    """The agent could not join or was refused (exit status 1)."""

    exit_code = 1


@dataclass(frozen=True)
class AgentRunConfig:
    coordinator: str | None = None
    keys: str | os.PathLike[str] | None = None
    insecure: bool = False
    port: int = A.DEFAULT_AGENT_PORT
    node_rank: int | None = None
    slots: int | None = None
    wait_s: float = 120.0
    runs: int = 1
    #: This node's GPUs for CUDA runs: "0,1", "none", or None (every GPU NVML sees).
    gpus: str | None = None


def node_gpus(text: str | None) -> tuple[int, ...]:
    """``--gpus``: the GPU indices this agent offers (``UsageError`` on a bad
    list); None: every GPU NVML sees here (none on a CPU node)."""
    from prism.shell.gpu_plan import visible_gpus

    if text is None:
        return tuple(visible_gpus())
    if text.strip().lower() == "none":
        return ()
    from prism.rank.placement import parse_gpus

    try:
        ids = parse_gpus(text)
    except ValueError as e:
        raise UsageError(f"--gpus: {e}") from None
    if not ids or len(set(ids)) != len(ids):
        raise UsageError(f"--gpus {text}: give distinct GPU indices such as 0,1 (or none)")
    seen = visible_gpus()  # empty without NVML: nothing to check against
    missing = [g for g in ids if seen and g not in seen]
    if missing:
        raise UsageError(f"--gpus {text}: GPU {missing[0]} is not on this node (NVML sees {seen})")
    return tuple(ids)


def resolve(config: AgentRunConfig, env: Mapping[str, str]) -> tuple[str, int, str]:
    """``(coordinator endpoint, node rank, node name)`` from the options, else
    from the launcher's environment; ``UsageError`` saying what is missing."""
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    if config.coordinator is not None:
        if not config.coordinator.startswith("tcp://"):
            raise UsageError(f"--coordinator {config.coordinator}: expected tcp://HOST:PORT")
        rank = config.node_rank if config.node_rank is not None else -1
        return config.coordinator, rank, node
    try:
        d = A.discover(env)
    except ValueError as e:
        raise UsageError(str(e)) from None
    rank = config.node_rank if config.node_rank is not None else d.node_rank
    return f"tcp://{d.coordinator_host}:{config.port}", rank, node


def serve_agent(config: AgentRunConfig, env: Mapping[str, str] | None = None,
                on_note: Callable[[str], None] = lambda _: None) -> object:
    """Join the coordinator and serve its run; ``AgentFailed`` when it cannot."""
    from prism.shell.agent import AgentConfig, AgentError, run_agent

    if config.keys is None and not config.insecure:
        raise UsageError("pass --keys DIR (from `prism keys DIR`, on a path every node reads) or --insecure on a "
                         "private network")
    if config.keys is not None and not Path(config.keys).is_dir():
        raise UsageError(f"--keys {config.keys}: no such directory; make one with `prism keys DIR`")
    if config.runs < 0:
        raise UsageError(f"--runs must be 0 (serve runs until stopped) or a number of runs, got {config.runs}")
    if config.slots is not None and config.slots < 1:
        raise UsageError(f"--slots must be at least 1, got {config.slots}")
    gpus = node_gpus(config.gpus)
    endpoint, rank, node = resolve(config, os.environ if env is None else env)
    name = f"{node}#{rank}" if rank >= 0 else f"{node}:{os.getpid()}"
    on_note(f"joining {endpoint} as {name}" + (f" with GPUs {','.join(map(str, gpus))}" if gpus else ""))
    try:
        return run_agent(AgentConfig(endpoint, config.keys, config.insecure, name, rank, config.slots, gpus,
                                     wait_s=config.wait_s, runs=config.runs), on_note)
    except AgentError as e:
        raise AgentFailed(str(e)) from None
