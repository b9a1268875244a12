"""A GPU sandbox's collectives without a host round trip (emulation).

In ``prism emulate`` on a GPU (``PRISM_GPU_SANDBOX=1``, set by the emulator's
launch), a collective of CUDA tensors whose group has no other sandbox member
(``PRISM_SANDBOX_RANKS``) is answered by virtual ranks only, so its data never
needs to leave the GPU. The backend then, instead of staging through host
memory and synchronising:

1. enqueues on the caller's stream a wait for a release flag
   (``cuda_ext.ReleaseFlags``: pinned host memory the GPU polls, a spinning
   kernel or ``cuStreamWaitValue32``),
2. enqueues behind it the compensated outputs, computed in place on the GPU
   (``form_outputs``: the rules of ``prism/core/compensation.py`` for one
   sandbox, whose virtual members contribute what it does),
3. sends the call's shapes (``CollectiveArrive.on_device``, no payloads) and
   returns at once, as NCCL does;

and the completion thread flips the flag at the emulated release. The GPU
thus runs the program's kernels back to back and waits only where the
emulated job's communication would hold it. Prism allocates no device memory
here (the outputs are the program's own tensors, changed in place).

For one sandbox among N members, compensated (``compensation.hybrid_outputs``):

=======================  ==============================================
op                       output
=======================  ==============================================
all_reduce SUM           N x own               (rounded once, float32 math)
all_reduce PREMUL_SUM    N x factor x own
all_reduce AVG/MIN/MAX   own (unchanged)
reduce_scatter_tensor    its chunk of own, x N (SUM) or x N x factor
all_gather_into_tensor   own in every slot
all_to_all_single        its input (equal splits: the chunk from a virtual
                         member j is its own chunk for j)
broadcast / barrier      nothing changes
=======================  ==============================================

Other ops (uneven all_to_all, gather, scatter, point-to-point, groups with
two sandbox members) keep the host path.

The hazard: while the GPU waits on a flag, anything that needs the whole
GPU idle before it returns blocks the thread that asked, and if that thread
holds the GIL the release (a Python thread) cannot come. CUDA's lazy module
loading is one such thing (a kernel's first launch may synchronise the
context: CUDA programming guide, "Lazy Loading", potential hazards), so a
device-path sandbox runs with ``CUDA_MODULE_LOADING=EAGER`` (set by
``prism emulate``; the module images then sit in GPU memory from the start,
outside torch's allocator, whose figures do not change). ``cudaFree`` under
memory pressure and ``torch.cuda.empty_cache()`` are others, not handled yet.
The call's message is sent before the wait is queued, so the release never
depends on what the main thread does after it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from prism.rank.envnames import GPU_SANDBOX_ENV, SANDBOX_ENV  # noqa: F401 (their home for torch-free readers)
#: Release flags in the ring (a flag is reused after this many calls, with a higher value).
SLOTS = 4096

_OPS = frozenset({"all_reduce", "all_reduce_coalesced", "reduce_scatter_tensor", "all_gather_into_tensor",
                  "all_to_all_single", "broadcast", "barrier"})
_lock = threading.Lock()
_releaser: "Releaser | None" = None
_sandbox: frozenset[int] | None = None


_issued = [0, 0, 0]  # calls, total ns, max ns: the CPU time Prism's backend spends issuing a call


def count_issue(ns: int) -> None:
    """Account one device-path call's issue time on the CPU (the backend's part)."""
    if _issued[0] == 0:
        import atexit

        atexit.register(_report_issue)
    _issued[0] += 1
    _issued[1] += ns
    _issued[2] = max(_issued[2], ns)


def issue_stats() -> tuple[int, float, int]:
    """(calls, mean ns, max ns) of the device-path calls issued so far."""
    n, total, top = _issued
    return n, (total / n if n else 0.0), top


def _report_issue() -> None:
    import sys

    n, mean, top = issue_stats()
    print(f"prism: device path: {n} calls issued, {mean / 1e3:.1f} us of CPU each in Prism's backend "
          f"(max {top / 1e3:.1f} us)", file=sys.stderr, flush=True)


def enabled() -> bool:
    return os.environ.get(GPU_SANDBOX_ENV) in ("1", "cpu-test")


def _cpu_test() -> bool:
    """``PRISM_GPU_SANDBOX=cpu-test``: the device path's protocol and in-place
    outputs on CPU tensors, with no stream to wait on (the outputs are formed
    at the call, not at the release): for tests of the path without a GPU."""
    return os.environ.get(GPU_SANDBOX_ENV) == "cpu-test"


def sandbox_ranks() -> frozenset[int]:
    global _sandbox
    if _sandbox is None:
        text = os.environ.get(SANDBOX_ENV, "")
        _sandbox = frozenset(int(x) for x in text.split(",") if x.strip())
    return _sandbox


def eligible(op: str, members: Sequence[int], rank: int, tensors: Sequence[torch.Tensor],
             in_splits: Sequence[int], out_splits: Sequence[int], reduce_name: str) -> bool:
    """Whether this call takes the device path (see the module docstring)."""
    if op not in _OPS or not enabled():
        return False
    if any(m in sandbox_ranks() for m in members if m != rank):
        return False  # another sandbox's real data is needed: the host path exchanges it
    if tensors and not all((t.is_cuda or _cpu_test()) and t.is_contiguous() for t in tensors):
        return False
    if op == "all_to_all_single" and (len(set(in_splits)) > 1 or list(in_splits) != list(out_splits)):
        return False
    if reduce_name and reduce_name not in ("SUM", "AVG", "PREMUL_SUM", "MIN", "MAX"):
        return False
    return releaser() is not None


class Releaser:
    """The process's ring of release flags (``cuda_ext.ReleaseFlags``)."""

    def __init__(self) -> None:
        import cuda_ext

        self.flags = cuda_ext.ReleaseFlags(SLOTS, "cuda")
        self.mode = self.flags.default_mode()
        self._n = 0
        self._lock = threading.Lock()

    def reserve(self) -> tuple[int, int]:
        """The next (slot, value) to wait on."""
        with self._lock:
            n, self._n = self._n, self._n + 1
        return n % SLOTS, n // SLOTS + 1

    def enqueue_wait(self, slot: int, value: int) -> None:
        """Make the current stream wait until ``slot`` reaches ``value``."""
        self.flags.wait(slot, value, mode=self.mode)

    def release(self, slot: int, value: int, at_ns: int = 0, tail_ns: int = 0) -> None:
        """Flip the flag now; the wait itself ends at ``max(at_ns, reached + tail_ns)``
        (``cuda_ext.ReleaseFlags.release``)."""
        self.flags.release(slot, value, at_ns, tail_ns)


class _NullReleaser:
    """``cpu-test``: nothing to wait on."""

    mode = "cpu-test"

    def reserve(self) -> tuple[int, int]:
        return 0, 0

    def enqueue_wait(self, slot: int, value: int) -> None:
        pass

    def release(self, slot: int, value: int, at_ns: int = 0, tail_ns: int = 0) -> None:
        pass


def releaser() -> Releaser | None:
    """The process's releaser, or None where the GPU cannot wait on a flag
    (no compiled wait kernel and no cuda-python): the host path runs."""
    global _releaser
    with _lock:
        if _releaser is None and _cpu_test():
            _releaser = _NullReleaser()
        if _releaser is None:
            try:
                r = Releaser()
            except Exception:  # noqa: BLE001 (no CUDA, no pinned memory: the host path)
                return None
            if r.mode == "host":
                return None
            _releaser = r
        return _releaser


@torch.no_grad()
def form_outputs(op: str, reduce_name: str, premul: float | None, n: int, g: int,
                 inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    """Enqueue on the current stream the compensated outputs of a call of a
    sandbox (group rank ``g`` of ``n``) whose other members are all virtual,
    in place (the module docstring's table)."""
    scale = float(n) * (premul if reduce_name == "PREMUL_SUM" and premul is not None else 1.0)
    scaled = reduce_name in ("SUM", "PREMUL_SUM")
    if op in ("all_reduce", "all_reduce_coalesced"):
        if scaled:
            for t in inputs:
                t.mul_(scale)
        return
    if op == "reduce_scatter_tensor":
        (x,), (out,) = inputs, outputs
        c = out.numel()
        chunk = x.reshape(-1)[g * c:(g + 1) * c].view(out.shape)
        if scaled:
            torch.mul(chunk, scale, out=out)
        else:
            out.copy_(chunk)
        return
    if op == "all_gather_into_tensor":
        (x,), (out,) = inputs, outputs
        out.view(n, -1).copy_(x.reshape(1, -1).expand(n, -1))
        return
    if op == "all_to_all_single":
        (x,), (out,) = inputs, outputs
        out.copy_(x)
        return
    # broadcast (the root keeps its tensor; from a virtual root the tensor is
    # left as it is, as compensation does), barrier: nothing to form


def describe() -> dict[str, Any]:
    r = _releaser
    return {"enabled": enabled(), "mode": r.mode if r is not None else None}
