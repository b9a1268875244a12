"""Front-end calls that check the backend's *name*, made to behave as under
the backend the script asked for.

The Prism backend replaces whatever the script passed to
``init_process_group`` ("gloo", "nccl", None ...), so ``get_backend(group)``
answers "prism". A few ``torch.distributed`` functions refuse to run unless
the name is a particular one; each is wrapped here so it behaves as it would
under the requested backend:

``monitored_barrier``
    torch implements it only for gloo (``ValueError`` otherwise). Under Prism
    it runs as a barrier of the group when the script asked for gloo (or for
    no backend in particular, which includes gloo for CPU tensors), and raises
    torch's own ``ValueError`` when it asked for another backend, as that run
    would. A rank that never arrives is reported by the coordinator's
    deadlock watchdog (which names every waiting rank) rather than by the
    barrier's timeout.

``bootstrap.patch_torch_distributed`` calls :func:`note_requested_backend`
from its ``init_process_group`` and :func:`install` once.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch.distributed.distributed_c10d as c10d

from prism.rank.backend import BACKEND_NAME

#: What the script passed to ``init_process_group`` (None: torch's default).
_requested: str | None = None


def note_requested_backend(backend: Any) -> None:
    """Remember the backend the script asked for (a str, a ``Backend`` or None)."""
    global _requested
    _requested = None if backend is None else str(backend).lower()


def _asked_for_gloo() -> bool:
    # None and "" select torch's default, "cpu:gloo,cuda:nccl": gloo for CPU tensors.
    return not _requested or "gloo" in _requested


def _wrap_monitored_barrier(original: Any) -> Any:
    @functools.wraps(original)
    def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
        if c10d._rank_not_in_group(group) or c10d.get_backend(group) != BACKEND_NAME:
            return original(group, timeout, wait_all_ranks)
        if not _asked_for_gloo():
            raise ValueError("monitored_barrier is only implemented for GLOO backend.")
        pg = c10d._get_default_group() if group is None else group
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier._prism_patched = True  # type: ignore[attr-defined]
    return monitored_barrier


def install() -> None:
    """Wrap the functions listed in the module docstring where scripts find them (idempotent)."""
    if getattr(c10d.monitored_barrier, "_prism_patched", False):
        return
    wrapped = _wrap_monitored_barrier(c10d.monitored_barrier)
    for name in ("torch.distributed", "torch.distributed.distributed_c10d"):
        mod = importlib.import_module(name)
        if hasattr(mod, "monitored_barrier"):
            mod.monitored_barrier = wrapped
