"""Prism's CUDA extension for phase 2 (hybrid emulation on GPUs).

What a GPU sandbox rank needs so that a collective answered by virtual ranks
looks to it as it would on the real cluster, with no host round trip on its
critical path (docs/DESIGN.md, "GPU sandbox and cuda_ext"):

``combine(op, own, folded, n=, factor=, out=)``
    the compensation step, ``out = own (op) folded`` for SUM, AVG, PREMUL_SUM,
    MIN and MAX, fused in one kernel for float32, float16 and bfloat16
    (``cuda_ext/reference.py`` has the semantics); ``place`` puts the
    sandbox's own chunk into a gather or all-to-all layout.
``DevicePool(nbytes, device)``
    device memory from ``cudaMalloc``, outside torch's caching allocator, so
    ``torch.cuda.memory_allocated`` and the program's peaks stay the
    program's; handed out as a ring in delivery order (``nbytes`` and
    ``peak`` are Prism's own memory, reported apart).
``PrefetchPool(nbytes, device)``
    a ``DevicePool`` filled ahead of time from pinned host staging on a side
    stream: ``stage(key, data)`` while the sandbox computes, ``take(key)``
    on the consuming stream (which waits for the fill on the GPU, not the
    CPU), ``done(key)`` once consumed; or ``deliver(key, out)``, the three
    in one (with the compiled extension, one native call).
``ReleaseFlags(slots)``
    stream-ordered release: ``wait(slot, value)`` enqueues on the current
    stream a wait for ``flags[slot] >= value`` and returns at once (a
    spinning kernel, ``mode="kernel"``, or ``cuStreamWaitValue32``,
    ``mode="memop"``); ``release(slot, value)`` from any host thread lets the
    stream go on; the GPU's clock when the stream reached the wait and when it
    saw the release are stamped in ``reached_ns(slot)`` / ``released_ns(slot)``
    (the GPU's globaltimer, nanoseconds).

The kernels are compiled on first use with ``torch.utils.cpp_extension``
(cached under ``$PRISM_CUDA_EXT_DIR``, default
``~/.cache/prism/cuda_ext/TORCH-VERSION``; ninja from PyPI). Where there is no
GPU, no compiler, or the build fails, the pure-torch fallback runs with the
same results (``info()`` says which path runs and why; ``PRISM_CUDA_EXT=off``
forces the fallback). ``pip install -e .`` never compiles anything.
"""

from __future__ import annotations

import collections
import os
import pathlib
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from cuda_ext.reference import OPS, place
from cuda_ext import reference

__all__ = ["OPS", "KERNEL_DTYPES", "Info", "info", "combine", "place", "DevicePool", "PrefetchPool",
           "ReleaseFlags", "PoolFull"]

#: The dtypes the combine kernels take; others run the fallback.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_lock = threading.Lock()
_module: Any = None
_info: "Info | None" = None


@dataclass(frozen=True)
class Info:
    """Which path runs: ``"kernels"`` (the compiled extension) or ``"fallback"``, and why."""

    path: str
    reason: str
    build_dir: str | None = None
    build_s: float | None = None


def build_dir() -> pathlib.Path:
    base = os.environ.get("PRISM_CUDA_EXT_DIR")
    root = pathlib.Path(base) if base else pathlib.Path.home() / ".cache" / "prism" / "cuda_ext"
    return root / torch.__version__.replace("+", "-")


def _load() -> tuple[Any, Info]:
    if os.environ.get("PRISM_CUDA_EXT", "").lower() in ("off", "0", "fallback"):
        return None, Info("fallback", "PRISM_CUDA_EXT=off")
    if not torch.cuda.is_available():
        return None, Info("fallback", "no CUDA device (torch.cuda.is_available() is False)")
    try:
        from torch.utils import cpp_extension
    except ImportError as e:  # pragma: no cover - torch always has it
        return None, Info("fallback", f"torch.utils.cpp_extension unavailable: {e}")
    if cpp_extension.CUDA_HOME is None:
        return None, Info("fallback", "no CUDA toolkit (nvcc) found: set CUDA_HOME to build the kernels")
    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(d)
    src = pathlib.Path(__file__).with_name("csrc") / "prism_ext.cu"
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        # this GPU's architecture only: a faster build, and no warning from torch about the choice
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    t0 = time.monotonic()
    try:
        with warnings.catch_warnings():  # the build's own notices are not the program's warnings
            warnings.simplefilter("ignore")
            mod = cpp_extension.load(name="prism_cuda_ext", sources=[str(src)], build_directory=str(d),
                                     extra_cuda_cflags=["-O3", "--fmad=false"], extra_ldflags=["-lcuda"],
                                     verbose=bool(os.environ.get("PRISM_CUDA_EXT_VERBOSE")))
    except Exception as e:  # a failed build is reported, and the fallback runs
        last = str(e).strip().splitlines()[-1:] or [type(e).__name__]
        return None, Info("fallback", f"the build failed ({last[0][:300]}); see {d}", str(d))
    return mod, Info("kernels", f"built with {cpp_extension.CUDA_HOME}", str(d), time.monotonic() - t0)


#: A build lock older than this (s) was left by a build that was killed:
#: torch's ``FileBaton`` would wait on it for ever. A real build takes ~1 min.
STALE_LOCK_S = float(os.environ.get("PRISM_CUDA_EXT_STALE_LOCK_S", "600"))


def _clear_stale_lock(d: pathlib.Path) -> bool:
    """Remove ``d/lock`` (torch's build lock) when older than ``STALE_LOCK_S``;
    says so on stderr. True if it removed one."""
    lock = d / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return False
    if age < STALE_LOCK_S:
        return False
    try:
        lock.unlink()
    except OSError:
        return False
    import sys

    print(f"cuda_ext: removed a stale build lock {lock} ({age:.0f} s old, left by a build that was killed; "
          "PRISM_CUDA_EXT_STALE_LOCK_S sets the age)", file=sys.stderr, flush=True)
    return True


def kernels() -> Any:
    """The compiled module, or None (the fallback runs; ``info()`` says why)."""
    global _module, _info
    with _lock:
        if _info is None:
            _module, _info = _load()
        return _module


def info() -> Info:
    kernels()
    assert _info is not None
    return _info


# --- compensation -------------------------------------------------------------


def combine(op: str, own: torch.Tensor, folded: torch.Tensor, *, n: int = 1, factor: float = 1.0,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = own (op) folded`` (``cuda_ext/reference.py``): the kernel on
    contiguous CUDA float tensors when built, else the fallback."""
    reference._check(op, own, folded, out)
    mod = kernels() if own.is_cuda else None
    if (mod is None or own.dtype not in KERNEL_DTYPES or not own.is_contiguous() or not folded.is_contiguous()
            or (out is not None and not out.is_contiguous())):
        return reference.combine(op, own, folded, n=n, factor=factor, out=out)
    if out is None:
        out = torch.empty_like(own)
    mod.combine(out, own, folded, OPS[op], float(factor), int(n))
    return out


# --- device memory outside torch's allocator ------------------------------------


class PoolFull(RuntimeError):
    """The pool has no room for the request until earlier deliveries are done."""


def _slab(nbytes: int, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    mod = kernels()
    if mod is not None:
        return mod.device_slab(nbytes, device.index if device.index is not None else torch.cuda.current_device())
    return _slab_cuda_python(nbytes, device)


def _slab_cuda_python(nbytes: int, device: torch.device) -> torch.Tensor:
    """cudaMalloc through cuda-python, wrapped without torch's allocator."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        raise RuntimeError("cuda_ext: a device pool outside torch's allocator needs the compiled extension or "
                           "cuda-python (pip install cuda-bindings); neither is here") from None
    with torch.cuda.device(device):
        err, ptr = cudart.cudaMalloc(nbytes)
    if int(err) != 0:
        raise RuntimeError(f"cuda_ext: cudaMalloc of {nbytes} bytes for the prefetch pool failed ({err})")

    class _Mem:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (int(ptr), False), "version": 3}

        def __del__(self) -> None:
            cudart.cudaFree(ptr)

    holder = _Mem()
    t = torch.as_tensor(holder, device=device)
    t._prism_holder = holder  # type: ignore[attr-defined]  # frees with the tensor
    return t


class DevicePool:
    """``nbytes`` of device memory outside torch's caching allocator, handed
    out as a ring in delivery order: ``alloc`` takes from the head, ``free``
    of the oldest live block moves the tail (blocks freed out of order are
    reclaimed when everything before them is)."""

    ALIGN = 256

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.nbytes = int(nbytes)
        self.slab = _slab(self.nbytes, self.device)
        self._live: collections.OrderedDict[int, list] = collections.OrderedDict()  # id -> [start, size, freed]
        self._head = 0  # next free byte (mod nbytes)
        self._used = 0
        self.peak = 0
        self._next = 0

    @property
    def used(self) -> int:
        return self._used

    def fits(self, nbytes: int) -> bool:
        """Whether ``alloc(nbytes)`` would succeed now (nothing changes)."""
        size = max(self.ALIGN, -(-int(nbytes) // self.ALIGN) * self.ALIGN)
        if size > self.nbytes:
            return False
        pad = self.nbytes - self._head if self._head + size > self.nbytes else 0
        return self._used + pad + size <= self.nbytes

    def alloc(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """(block id, a uint8 view of ``nbytes``); raises ``PoolFull``."""
        bid, start = self.alloc_block(nbytes)
        return bid, self.slab[start:start + int(nbytes)]

    def alloc_block(self, nbytes: int) -> tuple[int, int]:
        """(block id, its first byte in the slab), no view made; raises ``PoolFull``."""
        size = max(self.ALIGN, -(-int(nbytes) // self.ALIGN) * self.ALIGN)
        if size > self.nbytes:
            raise PoolFull(f"a delivery of {nbytes} bytes exceeds the whole prefetch pool ({self.nbytes} bytes): "
                           "raise the pool size")
        start = self._head
        pad = 0
        if start + size > self.nbytes:  # wrap: the rest of the slab is skipped
            pad, start = self.nbytes - start, 0
        if self._used + pad + size > self.nbytes:
            raise PoolFull(f"the prefetch pool is full ({self._used} of {self.nbytes} bytes in use)")
        bid = self._next
        self._next += 1
        self._live[bid] = [start, size + pad, False]
        self._head = (start + size) % self.nbytes
        self._used += size + pad
        self.peak = max(self.peak, self._used)
        return bid, start

    def free(self, bid: int) -> None:
        blk = self._live.get(bid)
        if blk is None:
            raise KeyError(f"pool block {bid} is not live")
        blk[2] = True
        while self._live:
            first = next(iter(self._live.values()))
            if not first[2]:
                break
            self._live.popitem(last=False)
            self._used -= first[1]
        if not self._live:
            self._head, self._used = 0, 0


#: "0": a GPU ``PrefetchPool`` queues its copies and events through torch's
#: Python API (about 20 torch calls a delivery) even where the compiled
#: extension offers its native calls (one a delivery).
HOLD_GIL_ENV = "PRISM_CUDA_EXT_HOLD_GIL"


def hold_gil(hold: bool) -> bool:
    """Keep the GIL held in the compiled calls that queue stream work (the
    wait kernel, stamps, the prefetch pool's fills and deliveries) instead of
    letting it go around their CUDA calls (the default; see
    ``csrc/prism_ext.cu``). Whether the setting took: False without the
    compiled extension (the fallback holds nothing) or one built before it."""
    mod = kernels()
    if mod is None or not hasattr(mod, "set_hold_gil"):
        return False
    mod.set_hold_gil(bool(hold))
    return True


POOL_NATIVE_ENV = "PRISM_POOL_NATIVE"


class PrefetchPool:
    """A ``DevicePool`` filled ahead of use from pinned host staging on a side
    stream (see the module docstring). Keys are the caller's (e.g. a
    collective's ``(gid, seq)``).

    On a GPU with the compiled extension (``native``), each fill, delivery
    and event is one call into it, with raw CUDA events made once and
    reused (a call that queues stream work lets the GIL go once, around its
    CUDA calls, which may block on a full queue behind a release wait);
    else torch's streams and events (the same stream order, more host time:
    ~20 torch calls a delivery, each letting the GIL go and waiting to take
    it back, behind whatever other thread wanted it)."""

    def __init__(self, nbytes: int, device: torch.device | str, *, host_mirror: bool = False) -> None:
        self.pool = DevicePool(nbytes, device)
        self.device = self.pool.device
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if cuda else None
        #: key -> (block id, start, nbytes, fill event or None, host data kept alive, taken)
        self._items: dict[Any, list] = {}
        #: (block id, the consumer's finish event, host data the fill read): the block and the
        #: host data go back once the consumer's stream has passed the event (the native fill's
        #: cudaMemcpyAsync is not known to torch's pinned-memory cache, which would otherwise
        #: hand a dropped staging buffer out again before the copy ran)
        self._retired: collections.deque[tuple[int, Any, Any]] = collections.deque()
        self._reserved: dict[Any, tuple[int, int, int]] = {}
        self.staged_bytes = 0
        mod = kernels() if cuda and os.environ.get(POOL_NATIVE_ENV, "1") != "0" else None
        self._native = mod if mod is not None and hasattr(mod, "pool_deliver") else None
        self._dev = (self.device.index if self.device.index is not None else torch.cuda.current_device()) if cuda \
            else -1
        self._slab_ptr = self.pool.slab.data_ptr()
        self._stream_ptr = self.stream.cuda_stream if self.stream is not None else 0
        self._events: list[Any] = []  # free native event handles
        self.events_made = 0
        #: ``host_mirror``: pinned host memory as large as the pool, allocated
        #: once here (``reserve`` hands out the block at the device block's
        #: offset), so filling never allocates pinned memory later, when a
        #: stream may be waiting on a release (cudaHostAlloc may synchronise).
        self.host: torch.Tensor | None = None
        if host_mirror:
            self.host = (torch.empty(self.pool.nbytes, dtype=torch.uint8, pin_memory=True) if cuda
                         else self.pool.slab)

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    @property
    def native(self) -> bool:
        """Whether fills and deliveries go through the extension's native calls."""
        return self._native is not None

    # --- events: native handles (reused) or torch's -------------------------------

    def _event(self) -> Any:
        if self._events:
            return self._events.pop()
        self.events_made += 1
        return self._native.event_new(self._dev)

    def _mark(self) -> Any:
        """An event recorded on the current stream (None on a CPU pool)."""
        if self.stream is None:
            return None
        if self._native is not None:
            ev = self._event()
            self._native.stream_mark(self._dev, ev)
            return ev
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _wait(self, ev: Any) -> None:
        """The current stream waits for ``ev`` (the GPU, not the host)."""
        if ev is None:
            return
        if self._native is not None:
            self._native.stream_wait(self._dev, ev)
        else:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def _passed(self, ev: Any, block: bool) -> bool:
        if ev is None:
            return True
        if self._native is not None:
            if self._native.event_done(ev):
                return True
            if block:
                self._native.event_sync(ev)
            return block
        if ev.query():
            return True
        if block:
            ev.synchronize()
        return block

    def _free_event(self, ev: Any) -> None:
        if ev is not None and self._native is not None:
            self._events.append(ev)

    def _fill(self, start: int, src_ptr: int, src: torch.Tensor | None, nbytes: int) -> Any:
        """Queue the copy of ``nbytes`` of pinned host memory at ``src_ptr``
        (``src``: the same as a tensor) into the slab at ``start`` on the side
        stream; its event (None on a CPU pool, where the copy is done now)."""
        if self.stream is None:
            self.pool.slab[start:start + nbytes].copy_(src)
            return None
        if self._native is not None:
            ev = self._event()
            try:
                self._native.pool_fill(self._dev, self._slab_ptr + start, src_ptr, nbytes, self._stream_ptr, ev)
            except BaseException:
                self._events.append(ev)
                raise
            return ev
        with torch.cuda.stream(self.stream):
            self.pool.slab[start:start + nbytes].copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    # --- the pool ---------------------------------------------------------------

    def _reclaim(self, block: bool = False) -> None:
        """Return to the pool the blocks whose consumers have passed them (in
        order); with ``block``, wait for the oldest first."""
        while self._retired:
            bid, fin, _ = self._retired[0]
            if not self._passed(fin, block):
                return
            block = False
            self._retired.popleft()
            self._free_event(fin)
            self.pool.free(bid)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` can be staged now without waiting (after the
        blocks whose consumers have passed them are returned)."""
        self._reclaim()
        return self.pool.fits(nbytes)

    def _alloc(self, nbytes: int, block: bool) -> tuple[int, int]:
        self._reclaim()
        while True:
            try:
                bid, start = self.pool.alloc_block(nbytes)
                return bid, start
            except PoolFull:
                if not self._retired or not block:
                    raise
                self._reclaim(block=True)

    def stage(self, key: Any, data: torch.Tensor, *, block: bool = True, ready: bool = False,
              ptr: int | None = None) -> None:
        """Copy ``data`` (a CPU tensor) into the pool on the side stream;
        returns once the copy is queued. Raises ``PoolFull`` only when even the
        deliveries already consumed cannot make room (``block=False``: when
        the consumers have not passed them yet, instead of waiting).
        ``ready``: ``data`` is already a contiguous 1-D uint8 tensor, pinned
        for a GPU pool (a preloaded recording's slice): used as it is;
        ``ptr``: its address, where the caller knows it."""
        if key in self._items:
            raise KeyError(f"prefetch: {key!r} is already staged")
        src = data if ready else data.detach().reshape(-1).contiguous().view(torch.uint8)
        n = src.numel()
        bid, start = self._alloc(n, block)
        if self.stream is not None and not (ready or src.is_pinned()):
            pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            pinned.copy_(src)
            src, ptr = pinned, None
        if ptr is None and self.stream is not None and self._native is not None:
            ptr = src.data_ptr()
        try:
            ev = self._fill(start, ptr or 0, src, n)
        except BaseException:
            self.pool.free(bid)  # nothing was queued into it
            raise
        self._items[key] = [bid, start, n, ev, src if self.stream is not None else None, False]
        self.staged_bytes += n

    def reserve(self, key: Any, nbytes: int) -> torch.Tensor:
        """Room for ``key`` in a ``host_mirror`` pool: the pinned host block to
        fill (any thread, no lock of the pool's held), then ``commit(key)``.
        Raises ``PoolFull`` (never blocks) while the deliveries in the way
        are not yet consumed or their consumers have not passed them."""
        if self.host is None:
            raise RuntimeError("prefetch: reserve needs a pool made with host_mirror=True")
        if key in self._items or key in self._reserved:
            raise KeyError(f"prefetch: {key!r} is already staged")
        self._reclaim()
        bid, start = self.pool.alloc_block(nbytes)
        self._reserved[key] = (bid, start, int(nbytes))
        return self.host[start:start + int(nbytes)]

    def commit(self, key: Any) -> None:
        """The host block of ``key`` is filled: queue its copy to the device on
        the side stream (on a CPU pool the host block is the device block)."""
        bid, start, n = self._reserved[key]
        ev = None
        if self.stream is not None:
            hview = self.host[start:start + n]
            ev = self._fill(start, self.host.data_ptr() + start if self._native is not None else 0, hview, n)
        del self._reserved[key]
        # the host block is reused only with its device block, after the consumer passed it
        self._items[key] = [bid, start, n, ev, None, False]
        self.staged_bytes += n

    def take(self, key: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The staged data as ``dtype``/``shape``, ordered after its fill on the
        current stream (the GPU waits, the CPU does not)."""
        item = self._items[key]
        bid, start, n, ev, _, _ = item
        self._wait(ev)
        item[5] = True
        return self.pool.slab[start:start + n].view(dtype).view(shape)

    def deliver(self, key: Any, out: torch.Tensor) -> None:
        """``out`` (contiguous, of the block's size) gets ``key``'s data on the
        current stream, after its fill, and the block returns to the pool once
        the stream has passed the copy: ``take``, a copy and ``done`` in one
        (one native call where the pool is native)."""
        if (self._native is None or not out.is_contiguous() or out.device.type != "cuda"
                or out.device.index != self._dev):
            # (a non-contiguous out: its elements in order, as the recording holds them)
            out.copy_(self.take(key, out.dtype, tuple(out.shape)))
            self.done(key)
            return
        bid, start, n, ev, keep, _ = self._items[key]
        fin = self._event()
        try:
            self._native.pool_deliver(out, self._slab_ptr + start, n, ev or 0, fin)
        except BaseException:
            self._events.append(fin)  # nothing queued: the block stays staged for the caller to refuse
            raise
        del self._items[key]
        self._free_event(ev)  # the stream's wait took its state: it may be recorded again
        self._retired.append((bid, fin, keep))
        self._reclaim()

    def done(self, key: Any) -> None:
        """The delivery of ``key`` is queued on the current stream: its block
        returns to the pool once that stream has passed this point (the slab
        is not torch's, so torch's stream bookkeeping does not cover it). A
        block never taken (a refused delivery) is waited for on the stream
        first, so that its fill cannot land in the block's next use."""
        bid, _, _, ev, keep, taken = self._items[key]
        if not taken:
            self._wait(ev)
        fin = self._mark()
        del self._items[key]
        self._free_event(ev)
        self._retired.append((bid, fin, keep))
        self._reclaim()

    def __contains__(self, key: Any) -> bool:
        return key in self._items


# --- stream-ordered release ----------------------------------------------------------


def _host_register(shared: Any, flags: torch.Tensor) -> None:
    """Register a shared file's mapping with CUDA (``cudaHostRegister``,
    portable and mapped) so kernels read it as they read pinned memory."""
    cudart = torch.cuda.cudart()
    ptr = shared.header.ctypes.data
    err = cudart.cudaHostRegister(ptr, shared.layout.nbytes, 0x01 | 0x02)  # Portable | Mapped
    code = int(err) if not hasattr(err, "value") else int(err.value)
    if code != 0:
        raise RuntimeError(f"cuda_ext: cudaHostRegister of the shared release flags {shared.path} failed "
                           f"(error {code}); unset PRISM_DEVICE_SHARED_RELEASE to release through messages")
    if not flags.is_pinned():
        raise RuntimeError(f"cuda_ext: the shared release flags {shared.path} were registered but torch does not "
                           "see them pinned; unset PRISM_DEVICE_SHARED_RELEASE")


class ReleaseFlags:
    """``slots`` release flags in pinned host memory the GPU can read (see the
    module docstring). On a CPU (no streams) ``wait`` blocks the calling
    thread until the release: the same order of events, on the host."""

    MODES = ("kernel", "memop", "host")

    def __init__(self, slots: int, device: torch.device | str = "cuda", shared: str | None = None) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        #: ``shared``: the flags and deadlines live in a file another process
        #: (the coordinator) maps and releases through (``transport.shared_release``).
        self.shared = None
        if shared is not None:
            from transport.shared_release import H_DILATION, H_OFFSET, SharedRelease

            self._h_dilation = H_DILATION  # publish_dilation's word (called as the dilation moves)
            self.shared = SharedRelease.create(shared, slots)
            self.flags = torch.from_numpy(self.shared.flags)
            self.deadlines = torch.from_numpy(self.shared.deadlines)
            if cuda:
                _host_register(self.shared, self.flags)
        else:
            self.flags = torch.zeros(slots, dtype=torch.int32, pin_memory=cuda)
            #: Per slot (deadline, tail), in the wait's clock (``clock``): see ``release``.
            self.deadlines = torch.zeros(2 * slots, dtype=torch.int64, pin_memory=cuda)
        self.stamps = torch.zeros(2 * slots, dtype=torch.int64, pin_memory=cuda)
        #: Per slot, when the stream got past what followed the wait (``mark_delivered``: a call's
        #: outputs formed), in the wait's clock; 0: not marked.
        self.delivered = torch.zeros(slots, dtype=torch.int64, pin_memory=cuda)
        # Cheap host-side views of the same memory (a watcher polls them).
        self._st = self.stamps.numpy()
        self._dv = self.delivered.numpy()
        self._dl = self.deadlines.numpy()
        self._cond = threading.Condition()
        self._offset: int | None = None
        if cuda and self.default_mode() == "kernel":
            # Now, while no wait holds the GPU: measuring synchronises it, so
            # a release (which converts its moment) must never have to.
            self.clock_offset_ns()
        if self.shared is not None:
            self.shared.header[H_OFFSET] = self.clock_offset_ns()  # the coordinator converts with it

    def publish_dilation(self, dilation_ns: int) -> None:
        """The rank's dilation (its clock's lag behind the monotonic one) for a
        coordinator that releases through the shared file (its release times are
        on the rank's dilated clock). No-op without ``shared``."""
        if self.shared is not None:
            self.shared.header[self._h_dilation] = int(dilation_ns)

    def default_mode(self) -> str:
        if self.device.type != "cuda":
            return "host"
        return "kernel" if kernels() is not None else ("memop" if _driver() is not None else "host")

    def wait(self, slot: int, value: int, mode: str | None = None) -> None:
        """Make the current stream (``host``: this thread) wait until
        ``flags[slot] >= value``."""
        mode = mode or self.default_mode()
        if mode not in self.MODES:
            raise ValueError(f"ReleaseFlags.wait: mode {mode!r}; known: {', '.join(self.MODES)}")
        if mode == "host":
            reached = time.monotonic_ns()
            self.stamps[2 * slot] = reached
            with self._cond:
                # shared: another process may write the flag without notifying: look every 0.5 ms
                while int(self.flags[slot]) < value:
                    self._cond.wait(0.0005 if self.shared is not None else None)
            until = max(int(self.deadlines[2 * slot]), reached + int(self.deadlines[2 * slot + 1]))
            while (left := until - time.monotonic_ns()) > 0:
                time.sleep(left / 1e9 if left > 200_000 else 0)
            self.stamps[2 * slot] = reached
            self.stamps[2 * slot + 1] = time.monotonic_ns()
            return
        mod = kernels()
        if mode == "kernel":
            if mod is None:
                raise RuntimeError(f"ReleaseFlags: the wait kernel needs the compiled extension ({info().reason})")
            mod.wait_flag_kernel(self.flags, slot, value, self.stamps, self.deadlines)
        elif mod is not None:
            none = torch.empty(0, dtype=torch.int32)
            mod.stamp(self.stamps, 2 * slot, none, 0, 0)
            mod.wait_flag_memop(self.flags, slot, value)
            mod.stamp(self.stamps, 2 * slot + 1, none, 0, 0)
        else:
            _memop_cuda_python(self.flags, slot, value)

    def release(self, slot: int, value: int, at_ns: int = 0, tail_ns: int = 0) -> None:
        """Let waits on ``slot`` up to ``value`` go on (any host thread).

        ``at_ns`` (this host's monotonic clock; 0: at once) and ``tail_ns``
        time the release where the wait runs (``kernel`` on the GPU's
        globaltimer, ``host`` in the waiting thread): a wait ends at
        ``max(at_ns, the moment its stream reached it + tail_ns)``, so the
        flag may be flipped ahead of time and the releasing thread need not
        wake on time. ``memop`` waits cannot be timed: ``at_ns`` is held here."""
        if at_ns or tail_ns:
            if self.default_mode() == "memop":
                while (left := at_ns - time.monotonic_ns()) > 0:
                    time.sleep(left / 1e9 if left > 200_000 else 0)
            else:
                self.deadlines[2 * slot] = self.to_wait_clock(at_ns) if at_ns else 0
                self.deadlines[2 * slot + 1] = max(0, int(tail_ns))
        elif self.device.type == "cuda":
            self.deadlines[2 * slot] = self.deadlines[2 * slot + 1] = 0
        with self._cond:
            self.flags[slot] = value  # a store to pinned memory: the GPU sees it over PCIe/NVLink-C2C
            self._cond.notify_all()

    def clock_offset_ns(self) -> int:
        """This host's monotonic clock minus the wait's clock (the GPU's
        globaltimer in ``kernel`` mode; 0 in ``host`` mode), measured once:
        the tightest of a few stamp-and-synchronise round trips, whose
        midpoint is taken."""
        if self._offset is None:
            mod = kernels()
            if self.device.type != "cuda" or mod is None or self.default_mode() != "kernel":
                self._offset = 0
            else:
                probe = torch.zeros(1, dtype=torch.int64, pin_memory=True)
                none = torch.empty(0, dtype=torch.int32)
                best = None
                for _ in range(8):
                    torch.cuda.synchronize(self.device)
                    a = time.monotonic_ns()
                    mod.stamp(probe, 0, none, 0, 0)
                    torch.cuda.synchronize(self.device)
                    b = time.monotonic_ns()
                    if best is None or b - a < best[0]:
                        best = (b - a, (a + b) // 2 - int(probe[0]))
                self._offset = best[1]
        return self._offset

    def to_wait_clock(self, mono_ns: int) -> int:
        """A moment of this host's monotonic clock on the wait's clock."""
        return int(mono_ns) - self.clock_offset_ns()

    def clear_stamps(self, slot: int) -> None:
        """Zero ``slot``'s stamps before a wait on it is queued, so that its
        reach (``reached_mono_ns``) is seen as new."""
        self._st[2 * slot] = 0
        self._st[2 * slot + 1] = 0
        self._dv[slot] = 0

    def mark_delivered(self, slot: int) -> None:
        """Stamp, on the current stream, the moment it gets here (after the
        wait on ``slot`` and the work queued behind it: a device-path call's
        outputs formed), for ``delivery_ns``. ``host`` mode: now, on this thread."""
        if self.default_mode() == "host":
            self._dv[slot] = time.monotonic_ns()
            return
        mod = kernels()
        if mod is not None:
            mod.stamp(self.delivered, slot, torch.empty(0, dtype=torch.int32), 0, 0)

    def delivery_ns(self, slot: int) -> int:
        """From the end of the wait on ``slot`` to its ``mark_delivered``
        (the stream's time forming the call's outputs, which the emulated
        job's collective would have written itself); 0 while either is not
        known."""
        t1, t2 = int(self._st[2 * slot + 1]), int(self._dv[slot])
        return max(0, t2 - t1) if t1 and t2 else 0

    def reached_mono_ns(self, slot: int) -> int:
        """When the stream reached the wait on ``slot``, on this host's
        monotonic clock; 0 while it has not (``kernel`` and ``host`` modes
        stamp the reach as it happens; ``memop`` only behind the wait)."""
        t = int(self._st[2 * slot])
        return t + self.clock_offset_ns() if t else 0

    def ended_mono_ns(self, slot: int) -> int:
        """When the wait on ``slot`` let its stream go on, on this host's
        monotonic clock; 0 while it has not (``kernel`` and ``host`` modes)."""
        t = int(self._st[2 * slot + 1])
        return t + self.clock_offset_ns() if t else 0

    def late_ns(self, slot: int) -> int | None:
        """How long the wait on ``slot`` held its stream past the moment the
        release asked for (``max(at_ns, reached + tail_ns)``): the release
        came late, which the emulated job would not have waited; None while
        the wait has not ended (``kernel`` and ``host`` modes)."""
        t1 = int(self._st[2 * slot + 1])
        if not t1:
            return None
        t0 = int(self._st[2 * slot])
        due = max(int(self._dl[2 * slot]), t0 + int(self._dl[2 * slot + 1]))
        return max(0, t1 - due)

    def reached_ns(self, slot: int) -> int:
        """The GPU's globaltimer when the stream reached the wait (kernel mode; 0 if not known)."""
        return int(self.stamps[2 * slot])

    def released_ns(self, slot: int) -> int:
        """The GPU's globaltimer when the wait saw the release (kernel mode; host mode: this host's monotonic clock)."""
        return int(self.stamps[2 * slot + 1])


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


def _memop_cuda_python(flags: torch.Tensor, slot: int, value: int) -> None:
    drv = _driver()
    if drv is None:
        raise RuntimeError("ReleaseFlags: mode 'memop' needs the compiled extension or cuda-python")
    host = flags.data_ptr() + 4 * slot
    err, dptr = drv.cuMemHostGetDevicePointer(host, 0)
    if int(err) != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed ({err})")
    stream = torch.cuda.current_stream().cuda_stream
    (err,) = drv.cuStreamWaitValue32(stream, dptr, value, drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
    if int(err) != 0:
        raise RuntimeError(f"cuStreamWaitValue32 failed ({err}); use mode='kernel'")
