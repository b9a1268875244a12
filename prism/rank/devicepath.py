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
all_to_all_single        the chunk from a virtual member j is its own chunk
                         for j, cut or tiled to the rows j sends (uneven
                         splits too); its own chunk comes back as it is
broadcast / barrier      nothing changes
send to a virtual rank   nothing is queued: the data never leaves the GPU
                         (no copy to the host, which would wait for the
                         stream: NCCL's send does not hold the CPU either)
recv from a virtual rank zeros, behind the release (the host path's
                         compensation of a receive)
=======================  ==============================================

Other ops (gather, scatter, point-to-point with another sandbox, groups
with two sandbox members) keep the host path.

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


REACH_ENV = "PRISM_DEVICE_REACH"


def reach_from_gpu() -> bool:
    """Whether a device-path call's arrival is the GPU's reach (the default)
    or, with ``PRISM_DEVICE_REACH=issue``, the CPU's issue (for comparison:
    the engine then sees the CPU's lead over its stream as early arrivals)."""
    return os.environ.get(REACH_ENV, "gpu") != "issue"


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
    if reduce_name and reduce_name not in ("SUM", "AVG", "PREMUL_SUM", "MIN", "MAX"):
        return False
    return releaser() is not None


def eligible_p2p(peer: int, tensor: torch.Tensor) -> bool:
    """Whether a send to or receive from ``peer`` takes the device path: the
    peer is virtual (another sandbox needs the real data: the host path)."""
    if not enabled() or peer in sandbox_ranks():
        return False
    if not ((tensor.is_cuda or _cpu_test()) and tensor.is_contiguous()):
        return False
    return releaser() is not None


class Releaser:
    """The process's ring of release flags (``cuda_ext.ReleaseFlags``).

    In ``kernel`` mode the wait kernel stamps the GPU's globaltimer as its
    stream reaches it; ``watch`` hands the call to a watcher thread that
    polls those stamps (pinned host memory) and reports each reach, on this
    host's monotonic clock, to the backend's callback: the emulated job's
    arrival at the call is when the GPU got there, not when the CPU issued it.
    The same thread reads how late each wait ended past the moment its
    release asked for (``ReleaseFlags.late_ns``: the release reached the GPU
    after it was due, Prism's delay) and hands the part that delayed the
    stream's next call to ``on_late`` (see ``_Watcher``)."""

    #: The watcher's poll period while calls are in flight (s).
    POLL_S = 20e-6

    def __init__(self) -> None:
        import cuda_ext

        self.flags = cuda_ext.ReleaseFlags(SLOTS, "cuda")
        self.mode = self.flags.default_mode()
        self._n = 0
        self._lock = threading.Lock()
        #: Whether the stream's reach is stamped as it happens (and on this host's clock).
        self.reports_reach = self.mode == "kernel"
        self._watcher: _Watcher | None = None

    def watch(self, slot: int, issue_mono_ns: int, on_reach: Any, on_late: Any) -> None:
        """Report the reach of the wait just queued on ``slot`` (issued by the
        CPU at ``issue_mono_ns``): ``on_reach(reach_mono_ns)`` from the
        watcher thread; ``on_late(ns)`` for Prism's delay it carried."""
        if self._watcher is None:
            self._watcher = _Watcher(self.flags, self.POLL_S)
        self._watcher.add(slot, issue_mono_ns, on_reach, on_late)

    def prepare(self, slot: int) -> None:
        """Before a wait on ``slot`` is queued: clear its stamps (a reach seen later is this call's)."""
        if self.reports_reach:
            self.flags.clear_stamps(slot)

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


class _Watcher:
    """The thread behind ``Releaser.watch``.

    Lateness: a wait that ended ``late`` ns after it was due delayed its
    stream, but what follows it was only delayed where the stream would
    otherwise have been busy: the next call's reach, had the release been on
    time, is ``max(reach - late, its CPU issue)`` (a stream cannot get to a
    call its CPU has not issued). So the next reach carries
    ``min(late, reach - issue)`` of it into ``on_late`` (the rank's dilated
    clock), and the rest, absorbed while the stream waited for its CPU
    anyway, is dropped."""

    def __init__(self, flags: Any, poll_s: float) -> None:
        import collections

        self.flags = flags
        self.poll_s = poll_s
        self._calls: collections.deque = collections.deque()  # (slot, issue, on_reach, on_late)
        self._reached: collections.deque = collections.deque()  # slots reached, their lateness not yet read
        self._late = 0
        self._cond = threading.Condition()
        threading.Thread(target=self._loop, name="prism-reach", daemon=True).start()

    def add(self, slot: int, issue_mono_ns: int, on_reach: Any, on_late: Any) -> None:
        with self._cond:
            self._calls.append((slot, issue_mono_ns, on_reach, on_late))
            self._cond.notify()

    def _loop(self) -> None:
        import time

        flags = self.flags
        while True:
            with self._cond:
                while not self._calls and not self._reached:
                    self._cond.wait()
            moved = False
            while True:
                # the waits before (their ends precede the next reach on a stream) ...
                while self._reached and (late := flags.late_ns(self._reached[0])) is not None:
                    self._reached.popleft()
                    self._late += late
                if not self._calls:
                    break
                slot, issue, on_reach, on_late = self._calls[0]
                reach = flags.reached_mono_ns(slot)  # ... then the next call's reach
                if not reach:
                    break
                with self._cond:
                    self._calls.popleft()
                carried = min(self._late, max(0, reach - issue))
                self._late = 0
                if carried:
                    on_late(carried)
                on_reach(reach)
                self._reached.append(slot)
                moved = True
            if not moved:
                time.sleep(self.poll_s)


class _NullReleaser:
    """``cpu-test``: nothing to wait on; the "stream" reaches a call as it is
    issued (the protocol of a reported reach is exercised all the same)."""

    mode = "cpu-test"
    reports_reach = True

    def watch(self, slot: int, issue_mono_ns: int, on_reach: Any, on_late: Any) -> None:
        import time

        on_reach(time.monotonic_ns())

    def prepare(self, slot: int) -> None:
        pass

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
                 inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                 in_splits: Sequence[int] = (), out_splits: Sequence[int] = ()) -> None:
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
        if not in_splits and not out_splits:
            out.copy_(x)
            return
        _all_to_all_uneven(x, out, n, g, list(in_splits), list(out_splits))
        return
    # broadcast (the root keeps its tensor; from a virtual root the tensor is
    # left as it is, as compensation does), barrier: nothing to form


def _all_to_all_uneven(x: torch.Tensor, out: torch.Tensor, n: int, g: int, ins: list[int], outs: list[int]) -> None:
    """``compensation.hybrid_outputs`` for ``all_to_all_single`` with splits,
    one sandbox: the rows from a virtual member j are the sandbox's own chunk
    for j (its whole input where that chunk is empty), cut or tiled to the
    rows j sends; its own chunk comes back as it is. Copies only, into the
    program's output tensor (no memory of Prism's own)."""
    rows = x.shape[0] if x.dim() else 0
    ins = ins or [rows // n] * n
    outs = outs or [rows // n] * n
    row = int(x[0].numel()) if rows else int(out[0].numel()) if out.dim() and out.shape[0] else 1
    src_flat, dst_flat = x.reshape(-1), out.reshape(-1)
    a = b = 0
    for j in range(n):
        mine = src_flat[a * row:(a + ins[j]) * row]
        dst = dst_flat[b * row:(b + outs[j]) * row]
        a += ins[j]
        b += outs[j]
        if j == g:
            dst.copy_(mine)
            continue
        src = mine if mine.numel() else src_flat
        m, k = src.numel(), dst.numel()
        if m == 0:
            dst.zero_()
            continue
        for at in range(0, k, m):  # tiled; splits are near-balanced, so once or twice
            dst[at:at + m].copy_(src[:min(m, k - at)])


def describe() -> dict[str, Any]:
    r = _releaser
    return {"enabled": enabled(), "mode": r.mode if r is not None else None}
