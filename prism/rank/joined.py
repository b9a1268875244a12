"""One ``Work`` for several Prism operations issued by one call.

The coordinator computes ``all_gather``, ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` one tensor at a time (``prism.core.collectives``),
but torch's coalesced forms hand the process group k tensors in one call:
``allgather_into_tensor_coalesced`` / ``all_gather_single_coalesced``
(``_coalescing_manager()``, ``_functional_collectives.all_gather_into_tensor_coalesced``),
their reduce-scatter twins, and ``allgather_coalesced``. ``PrismProcessGroup``
issues such a call as k collectives, in order on every member (so their
sequence numbers agree), and returns a ``PrismWork`` over a :class:`JoinedOp`:
done when all k are, failed with the first failure. ``_end_coalescing``
(device-level coalescing) joins the ops issued since ``_start_coalescing``
the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch


class _AllSet:
    """``done`` of a JoinedOp: set when every part's ``done`` is."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self._parts = parts

    def is_set(self) -> bool:
        return all(p.done.is_set() for p in self._parts)


class JoinedOp:
    """Duck-types ``backend._Op`` for ``PrismWork``: ``wait``, ``done``,
    ``error``, ``result``, ``torch_future``."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = list(parts)
        self.what = " + ".join(p.what for p in self.parts)
        self.result = [t for p in self.parts for t in p.result]
        self.done = _AllSet(self.parts)
        devices = sorted({t.device for t in self.result if t.device.type == "cuda"}, key=str)
        self.torch_future: torch.futures.Future = (
            torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        )
        self._left = len(self.parts)
        self._lock = threading.Lock()
        if not self.parts:
            self.torch_future.set_result([])
        for p in self.parts:
            p.torch_future.add_done_callback(self._part_done)

    @property
    def error(self) -> BaseException | None:
        return next((p.error for p in self.parts if p.error is not None), None)

    def wait(self) -> None:
        for p in self.parts:
            p.wait()

    def _part_done(self, _fut: torch.futures.Future) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if not last:
            return
        error = self.error
        if error is None:
            self.torch_future.set_result(self.result)
        else:
            self.torch_future.set_exception(error)
