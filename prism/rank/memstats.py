"""CUDA memory statistics that Prism reads without the script noticing.

Prism records each rank's peak allocated memory per step: it reads the
caching allocator's peak at every step end and resets it. A script that logs
``torch.cuda.max_memory_allocated()`` (Megatron does, every log interval)
would then see only the peak since the last step. So the two readers keep
separate books over torch's one set of counters:

- ``torch._C._cuda_memoryStats`` and ``torch._C._cuda_resetPeakMemoryStats``
  (what every reading in ``torch.cuda.memory`` goes through:
  ``memory_stats``, ``memory_stats_as_nested_dict``, ``max_memory_allocated``,
  ``max_memory_reserved``, ``memory_summary``, ``reset_peak_memory_stats``,
  ``reset_max_memory_allocated``) are replaced by wrappers. A reading returns
  every ``peak`` as the largest value since the *script's* last reset: the
  allocator's current peak, or a peak Prism saw before one of its own resets.
- ``step_sample`` (Prism's reading) returns the peak since *Prism's* last
  sample, folding in what the script's own resets would have hidden.

Each book is a dict per in-process device index; current values, counts and
everything but ``peak`` pass through untouched. ``mem_get_info`` on a GPU
shared by several logical ranks answers as if this rank were alone on it
(``total - this process's use``, from NVML), since without Prism it would be;
the communication library's buffers the real job would hold are not there
(docs/DESIGN.md, "Memory").

Public API: ``install()``, ``installed()``, ``step_sample(device)``.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_real_stats: Any = None
_real_reset: Any = None
#: device -> (metric, pool) -> the largest peak the script's readings must include.
_script_book: dict[int, dict[tuple[str, str], int]] = {}
#: device -> (metric, pool) -> the largest peak Prism's next sample must include.
_prism_book: dict[int, dict[tuple[str, str], int]] = {}


def _peaks(stats: dict) -> dict[tuple[str, str], int]:
    return {(metric, pool): entry["peak"]
            for metric, pools in stats.items() if isinstance(pools, dict)
            for pool, entry in pools.items() if isinstance(entry, dict) and "peak" in entry}


def _fold(book: dict[int, dict[tuple[str, str], int]], device: int, peaks: dict[tuple[str, str], int]) -> None:
    mine = book.setdefault(device, {})
    for key, value in peaks.items():
        if value > mine.get(key, -1):
            mine[key] = value


def _apply(stats: dict, book: dict[tuple[str, str], int] | None) -> dict:
    for (metric, pool), value in (book or {}).items():
        entry = stats.get(metric, {}).get(pool)
        if isinstance(entry, dict) and entry.get("peak", 0) < value:
            entry["peak"] = value
    return stats


def _script_stats(device: int) -> dict:
    with _lock:
        return _apply(_real_stats(device), _script_book.get(device))


def _script_reset(device: int) -> None:
    with _lock:
        # What the reset clears, Prism's next sample must still see.
        _fold(_prism_book, device, _peaks(_real_stats(device)))
        _script_book.pop(device, None)
        _real_reset(device)


def step_sample(device: int) -> tuple[int, int, int]:
    """(allocated, reserved, peak allocated since Prism's last sample) on
    in-process ``device``; starts Prism's next window."""
    with _lock:
        stats = _apply(_real_stats(device), _prism_book.pop(device, None))
        # The script's book keeps what this reset clears.
        _fold(_script_book, device, _peaks(_real_stats(device)))
        _real_reset(device)
    return (stats["allocated_bytes"]["all"]["current"], stats["reserved_bytes"]["all"]["current"],
            stats["allocated_bytes"]["all"]["peak"])


def installed() -> bool:
    return _real_stats is not None


def install(*, shared_gpu: bool = False) -> None:
    """Wrap torch's two allocator statistics entry points (idempotent);
    ``shared_gpu``: this rank shares its GPU with other logical ranks, so
    ``mem_get_info`` answers as if it were alone on it."""
    global _real_stats, _real_reset
    import torch

    if _real_stats is not None:
        return
    _real_stats = torch._C._cuda_memoryStats
    _real_reset = torch._C._cuda_resetPeakMemoryStats
    torch._C._cuda_memoryStats = _script_stats
    torch._C._cuda_resetPeakMemoryStats = _script_reset
    if shared_gpu:
        _install_mem_get_info(torch)


def _install_mem_get_info(torch: Any) -> None:
    import os

    import torch.cuda.memory as cmem

    original = cmem.mem_get_info

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        free, total = original(device)
        used = _process_bytes(os.getpid())
        return (max(total - used, 0), total) if used else (free, total)

    mem_get_info.__doc__ = original.__doc__
    cmem.mem_get_info = mem_get_info
    torch.cuda.mem_get_info = mem_get_info


def _process_bytes(pid: int) -> int:
    """GPU memory NVML attributes to ``pid`` (0 when NVML cannot tell)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        total = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == pid:
                    total += p.usedGpuMemory or 0
        return total
    except Exception:  # no NVML, no driver, a container that hides pids
        return 0
