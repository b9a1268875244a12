"""How a capture uses GPUs: which GPUs, how many ranks stay resident on each,
which ranks form gangs, and the objects that carry it out.

``plan_gpus`` turns the capture options (``--gpus``, ``--resident``,
``--gang``, ``--rank-memory``) and the script's layout flags into a
``GpuPlan``; ``GpuPlan.setup(run_dir)`` makes the swap policy
(``prism.core.residency.GangResidency``) and executor (``prism.shell.swap``) when
not every rank fits, for the coordinator to take at construction. The ranks learn their GPU from ``PRISM_GPUS``
(``prism.rank.devices``). Used by ``prism capture``; returns None when the
capture does not use GPUs (the CPU path is untouched).

Defaults: the GPUs are every GPU NVML sees; one rank computes per GPU at a
time (``--slots`` = GPUs) as docs/DESIGN.md asks for cleaner durations; all ranks
stay resident when ``ranks per GPU x --rank-memory`` fits in the GPU's free
memory, else as many as fit (at least one gang). ``--rank-memory`` is an
estimate the user gives (default 2 GiB: a CUDA context with torch's kernels
takes about 0.6 GiB on an H200, docs/DESIGN.md), not a measurement.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prism.core.residency import GANG_KINDS, GangResidency, megatron_gangs
from prism.rank import placement as D

DEFAULT_RANK_MEMORY_GIB = 2.0


class GpuPlanError(ValueError):
    """The GPU options do not fit the machine or the layout (the user's input)."""


@dataclass
class GpuPlan:
    gpus: list[int]
    world_size: int
    resident: int
    gang: str
    gang_of: dict[int, int]
    slots: int
    why: str
    #: Made by ``setup`` when swapping (else None): ``prism.shell.swap.SwapExecutor``
    #: and ``prism.core.residency.GangResidency``.
    executor: Any = None
    policy: Any = None
    #: The checkpoint driver (default ``prism.shell.swap.CheckpointDriver()``; tests plug in a fake).
    driver: Any = None
    settings: dict = field(default_factory=dict)
    #: A CPU dry run (``--simulate-swaps``): no GPU is given to the ranks.
    simulated: bool = False
    #: Advice for the user about the chosen options (printed by ``prism capture``).
    notes: list[str] = field(default_factory=list)
    #: torch's allocator budget per rank under ``--memory-limit`` (None: the device's memory).
    memory_limit_bytes: int | None = None
    #: Ranks served by agents (``prism capture --agents``): each node's agent
    #: swaps its own ranks with the driver ``agent_swap`` names (``Launch.swap``);
    #: ``rank_gpu`` (rank -> a (node, GPU) index, ``prism.core.agents.node_gpu_of``)
    #: is set once the agents joined. ``setup`` does not apply.
    agent_swap: dict | None = None
    rank_gpu: dict[int, int] | None = None

    @property
    def swapping(self) -> bool:
        if self.rank_gpu is not None:
            per_gpu: dict[int, int] = {}
            for g in self.rank_gpu.values():
                per_gpu[g] = per_gpu.get(g, 0) + 1
            return self.resident < max(per_gpu.values(), default=0)
        return self.resident < math.ceil(self.world_size / len(self.gpus))

    def env(self) -> dict[str, str]:
        if self.simulated:
            return {}
        env = {D.GPUS_ENV: ",".join(map(str, self.gpus))}
        if self.memory_limit_bytes is not None:
            from prism.rank.oom import MEMORY_LIMIT_ENV

            env[MEMORY_LIMIT_ENV] = str(self.memory_limit_bytes)
        return env

    def gpu_of(self) -> dict[int, int]:
        if self.rank_gpu is not None:
            return dict(self.rank_gpu)
        return {r: D.choose_gpu(r, self.world_size, self.gpus) for r in range(self.world_size)}

    def setup(self, run_dir: str | os.PathLike[str]) -> None:
        """Make the swap policy and executor (when swapping) of a capture into
        ``run_dir``: ``policy`` and ``executor``, for the coordinator. Raises
        ``prism.shell.swap.SwapError`` when the checkpoint driver cannot load."""
        if self.agent_swap is not None:
            raise ValueError("a capture through agents swaps on their nodes: see prism.app.capture.setup_agent_swaps")
        if not self.swapping:
            return
        from prism.shell import swap, telemetry

        self.policy = GangResidency(self.resident, self.gang_of, self.gpu_of())
        self.executor = swap.SwapExecutor(self.driver or swap.CheckpointDriver(),
                                          memory_of=telemetry.process_memory,
                                          log=Path(run_dir) / "telemetry" / "swaps.jsonl")


def free_memory(gpus: Sequence[int]) -> dict[int, int] | None:
    """Free bytes on each of ``gpus``, by NVML; None without NVML."""
    from prism.shell.telemetry import nvml

    nv = nvml()
    if nv is None:
        return None
    return {g: nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(g)).free for g in gpus}


def visible_gpus() -> list[int]:
    """Indices of the GPUs NVML sees (empty without NVML or a GPU)."""
    from prism.shell.telemetry import nvml

    nv = nvml()
    return list(range(nv.nvmlDeviceGetCount())) if nv is not None else []


def plan_gpus(world_size: int, layout: dict[str, int], *, uses_cuda: bool, gpus: str | None,
              resident: int | None, gang: str | None, slots: int | None,
              rank_memory_gib: float = DEFAULT_RANK_MEMORY_GIB) -> GpuPlan | None:
    """The capture's GPU plan, or None for a CPU capture."""
    if gpus is None and resident is None and not uses_cuda:
        return None
    chosen = D.parse_gpus(gpus) if gpus else visible_gpus()
    if not chosen:
        raise GpuPlanError("this capture needs a GPU (--gpus, --resident or a cuda device in the command) "
                           "but NVML sees none; capture on CPU with --device cpu")
    tp, pp = layout.get("tp", 1), layout.get("pp", 1)
    dp = layout.get("dp", world_size // max(tp * pp, 1))
    gang = gang or ("tp" if tp > 1 else "1")
    if gang not in GANG_KINDS:
        raise GpuPlanError(f"--gang {gang!r}: expected one of {', '.join(GANG_KINDS)}")
    try:
        gang_of = megatron_gangs(world_size, tp, dp, pp, gang) if gang != "1" else {r: r for r in range(world_size)}
    except ValueError as e:
        raise GpuPlanError(f"--gang {gang}: {e}") from None
    gang_size = max(sum(1 for g in gang_of.values() if g == k) for k in set(gang_of.values()))
    per_gpu = math.ceil(world_size / len(chosen))
    if resident is not None:
        why = "--resident"
    else:
        free = free_memory(chosen)
        if free is None:
            resident, why = per_gpu, "all resident (free memory unknown)"
        else:
            fit = int(min(free.values()) // int(rank_memory_gib * 2**30))
            resident = min(per_gpu, max(fit, gang_size))
            why = (f"{min(free.values()) / 2**30:.1f} GiB free / {rank_memory_gib} GiB per rank (--rank-memory)"
                   f" -> {fit} fit; {per_gpu} ranks per GPU")
    if resident < 1:
        raise GpuPlanError(f"--resident must be at least 1, got {resident}")
    n_slots = slots or len(chosen)
    if resident < per_gpu and resident < gang_size * max(1, n_slots // len(chosen)):
        raise GpuPlanError(f"--resident {resident} is less than the gang size {gang_size} (--gang {gang}) times "
                           f"the ranks computing at once per GPU; raise --resident or use --gang 1")
    plan = GpuPlan(chosen, world_size, resident, gang, gang_of, n_slots, why)
    ep = layout.get("ep", 1)
    if gang == "tpxpp" and ep > 1 and resident < per_gpu:
        # Simulated (--simulate-swaps, GPT MoE tp2 pp2 dp2 ep2, world 8): each
        # all-to-all across pipelines swaps a whole pipeline; 249 swaps per
        # iteration at --resident 4 against 112 with TP gangs, 846 vs 92 at 6.
        plan.notes.append(
            f"--gang tpxpp with expert parallelism (--ep {ep}): every all-to-all between pipelines swaps a "
            f"whole pipeline out and another in; --gang tp swapped 2-9x less in a simulated MoE capture "
            f"(try both with --simulate-swaps on CPU first)")
    plan.settings = {"gpus": chosen, "resident_per_gpu": resident, "ranks_per_gpu": per_gpu, "gang": gang,
                     "gang_size": gang_size, "slots": n_slots, "resident_reason": why,
                     "layout": {"tp": tp, "dp": dp, "pp": pp}}
    return plan
