"""``PrismProcessGroup``: a torch.distributed backend written in Python whose
every call goes through the coordinator.

Registered as backend ``"prism"`` (``register()``, extended API, devices cpu
and cuda). Both dispatch paths are implemented: the Python front end calls
methods by their Python names (``all_gather_single``, ``alltoall``,
``reduce_scatter_single`` ...), C++ callers (DDP's reducer,
``_c10d_functional``) reach the trampoline names (``allgather``,
``_allgather_base``, ``allgather_into_tensor_coalesced``, ``alltoall_base``,
``reduce_scatter_tensor_coalesced`` ...).

Wire contract with the coordinator
==================================

A collective is one ``CollectiveArrive`` per member, keyed ``(gid, seq)`` with
``seq`` the group's own call counter, answered by one ``CollectiveResult``
(routing key ``("coll", gid, seq)``). The per-op shapes and payloads are
``prism.core.collectives``' contract (its module docstring has the table);
this rank declares its own tensors in ``in_shapes``/``out_shapes`` and sends
one payload per input, except that a broadcast's non-root members declare the
tensor without sending it. A reply carries one payload per declared output,
or none, which means "leave your tensors as they are" (the broadcast root, a
reduce's non-root members). Each payload holds a tensor's raw bytes,
C-contiguous, native (little-endian) byte order, dtype ``dtype`` (torch's name
without ``torch.``). Calls that carry several tensors where the contract takes
one (coalesced all_gather_into_tensor and reduce_scatter_tensor, the old
multi-input all_gather) become one collective instance per tensor, issued
back to back; their Work completes with the last.

A coalesced all-gather or reduce-scatter of k tensors (``_coalescing_manager``,
the ``*_coalesced`` methods) is k collectives, one per tensor, joined into
one Work (``prism.rank.joined``).

``reduce_op`` is the ReduceOp's name; for ``PREMUL_SUM`` the inputs are sent
unscaled and ``premul`` carries the factor (result = sum of factor * t).
``root`` is a *group* rank. Point-to-point: ``Send`` carries its payload
eagerly and completes locally; ``RecvPost`` is answered by ``P2PData`` (key
``("p2p", src, dst, tag, pseq)``), with global ranks and ``pseq`` counted per
``(src, dst, tag)``.

CUDA tensors are staged through host memory: inputs are copied to the host
(which synchronises the current stream), results are copied back by the
completion thread, which then synchronises the device before the operation
counts as complete.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d  # the option types (2.11 does not re-export all in dist)
from torch._C._distributed_c10d import ReduceOp

from prism.core import payloads as PL, protocol, trace
from prism.core.matcher import wait_key_coll, wait_key_p2p
from prism.rank import devicepath, pruned
from prism.rank import runtime as _rt

# torch.frombuffer on the coordinator's read-only frames (see _from_payload).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
from prism.rank.joined import JoinedOp
from prism.rank.runtime import PrismRankError

BACKEND_NAME = "prism"


#: A group's Prism id from its creation index and members (WORLD: "world").
_group_id: Callable[[int, Sequence[int]], str] = trace.group_id


def _unsupported(call: str) -> NotImplementedError:
    return NotImplementedError(
        f"Prism does not support {call} yet; please open an issue with the call and the "
        "script that makes it"
    )


# --- tensors <-> bytes ----------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(x) for x in t.shape)


def _host(t: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """A contiguous CPU tensor with ``t``'s values (``t`` itself when possible)."""
    h = t.detach().resolve_conj().resolve_neg()
    if h.device.type != "cpu":
        # Blocking copy: synchronises the current stream, so pending kernels
        # that write ``t`` have finished.
        return h.to("cpu").contiguous()
    if copy or not h.is_contiguous():
        return h.clone(memory_format=torch.contiguous_format)
    return h


def _settle(tensors: Sequence[torch.Tensor]) -> None:
    """Wait for the GPU work queued before a communication call.

    The CPU runs ahead of a CUDA device; without this the kernels still queued
    would finish inside the call (the copy to host waits for them) and their
    time would count as communication, which the replay replaces by the cost
    model. Synchronising first puts them in the compute segment that queued
    them. The copy to host would wait anyway, so this costs nothing extra.
    """
    seen: set[int] = set()
    for t in tensors:
        dev = t.device
        if dev.type == "cuda" and dev.index not in seen:
            seen.add(dev.index)
            torch.cuda.synchronize(dev)


def _buffer(h: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    if h.numel() == 0:
        return memoryview(b"")
    return memoryview(h.reshape(-1).view(torch.uint8).numpy())


def _from_payload(buf: Any, like: torch.Tensor, where: str) -> torch.Tensor:
    view = memoryview(buf).cast("B")
    expected = like.numel() * like.element_size()
    if view.nbytes != expected:
        raise PrismRankError(
            f"{where}: the coordinator sent {view.nbytes} bytes for a {_dtype_name(like.dtype)} "
            f"tensor of shape {_shape(like)} ({expected} bytes); this is a Prism bug, please report it"
        )
    if expected == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    # Read-only frames: the tensor is only read (copied into the output); the
    # warning torch gives for that is filtered once, at import (a
    # catch_warnings here would swap the process's filters from the completion
    # thread while the main thread's warnings are being handled).
    flat = torch.frombuffer(view, dtype=torch.uint8)
    return flat.view(like.dtype).reshape(like.shape)


#: RedOpType -> its name (``_reduce_op`` took 9-26 us a call inside a rank, 1.7 in a hot loop; 2026-12-08).
_REDUCE_NAMES: dict[Any, str] = {}


def _reduce_op(op: Any) -> tuple[str, float | None]:
    """(name, PREMUL_SUM factor) of a ReduceOp or RedOpType."""
    kind = op.op if isinstance(op, ReduceOp) else op
    name = _REDUCE_NAMES.get(kind)
    if name is None:
        name = _REDUCE_NAMES[kind] = kind.name
    if name == "PREMUL_SUM":
        factor = getattr(op, "factor", None)
        if factor is None:
            # torch before 2.13 keeps the factor in a C++ supplement that
            # Python cannot read (seen on 2.11).
            raise NotImplementedError(
                f"Prism does not support ReduceOp.PREMUL_SUM on torch {torch.__version__} yet: this torch "
                "does not expose the factor to a Python backend. Use torch >= 2.13, or for FSDP2 call "
                "set_force_sum_reduction_for_comms(True) so it reduces with SUM")
        return name, float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    return name, None


def _caller_is_blocking(name: str) -> bool:
    # send/recv carry no options object saying whether the call is async: the
    # front end's blocking wrapper (dist.send, dist.recv) is found on the stack.
    frame = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == name and code.co_filename.endswith("distributed_c10d.py"):
            return True
    return False


# --- operations and Work ---------------------------------------------------------


class _Op:
    """One communication call in flight on this rank."""

    def __init__(self, what: str, outputs: list[torch.Tensor], result: list[torch.Tensor], issue_ns: int,
                 blocking: bool, step: int) -> None:
        self.what = what
        #: What the coordinator's matcher calls this op in a ``Wait``
        #: (``matcher.wait_key_coll`` / ``wait_key_p2p``); set by the caller.
        self.wait_key = what
        self.outputs = outputs
        self._result: list[torch.Tensor] = result
        self._weak: list[Any] | None = None
        self.issue_ns = issue_ns
        self.wait_ns: int | None = issue_ns if blocking else None
        self.end_ns = 0
        #: Emulation: when the emulated job completes this call (monotonic ns; 0: unknown).
        self.release_mono_ns = 0
        #: Emulation on a GPU (``prism.rank.devicepath``): the stream waits on
        #: ``release_flag`` (releaser, slot, value), flipped at the release;
        #: a wait from the host returns at once, as NCCL's does.
        self.release_flag: tuple[Any, int, int] | None = None
        #: the flag was flipped as the result arrived (``_flip_release``)
        self.flipped = False
        #: The device path's call-log record (``PRISM_DEVICE_CALL_LOG``), if any.
        self.call_log: dict | None = None
        #: An async device-path call on the side stream (``devicepath.SideStream``):
        #: the event after its outputs, which a wait (or the future) orders
        #: the consumer's stream behind; its tensors, held until then (NCCL's
        #: stash: the caller's stream must not reuse their memory before).
        self.stream_done: Any = None
        self.stash: list[torch.Tensor] = []
        self.step = step
        self.done = threading.Event()
        self._error: BaseException | None = None
        self.lock = threading.Lock()
        self._devices = sorted({t.device for t in result if t.device.type == "cuda"}, key=str)
        #: The torch future (``get_future``), made when first asked for: most
        #: calls never are, and making one (and completing it) costs each call
        #: host time (~16 us on the VM inside a rank, 2026-12-07).
        self._torch_future: _PrismFuture | None = None
        self._settled = False
        #: Builds the trace events once the op completed: f(op) -> events.
        self.finish_events: Callable[[_Op], list[Any]] = lambda op: []
        #: Run before the op completes (a pruned call: the members' real
        #: collective finished and the virtual part folded in, ``prism.rank.pruned``).
        self.before_done: Callable[[], None] | None = None
        _rt.current().track(self)

    @property
    def result(self) -> list[torch.Tensor]:
        if self._weak is None:
            return self._result
        return [t for t in (r() for r in self._weak) if t is not None]

    def hold_weakly(self) -> None:
        """Keep the result tensors by weak reference only (the device path,
        whose outputs are formed on the stream at the call): the program
        alone decides when they are freed, as in the capture, and the call in
        flight does not raise its peak memory."""
        self._weak = [weakref.ref(t) for t in self._result]
        self._result = []

    @property
    def error(self) -> BaseException | None:
        return self._error

    def wait(self) -> None:
        if self.release_flag is not None:
            # The caller's stream already waits for the release (NCCL's
            # semantics), or, for an async call on the side stream, is ordered
            # behind it now.
            if self.stream_done is not None:
                torch.cuda.current_stream(self.stream_done.device).wait_event(self.stream_done.event)
                self.stash = []
            return
        if not self.done.is_set():
            rt = _rt.current()
            t = rt.recorder.comm_enter()
            with self.lock:
                if self.wait_ns is None and not self.done.is_set():
                    self.wait_ns = t
            try:
                rt.block_on(self.done, self.wait_key, t)
            finally:
                resumed = time.monotonic_ns()
                rt.recorder.comm_exit(resumed)
                rt.waited(self.release_mono_ns, t, resumed)
        if self.error is not None:
            raise self.error

    def complete(self, payloads: Sequence[Any] | None, error: BaseException | None) -> None:
        """Copy results in, record, and wake waiters (completion thread)."""
        arrived = time.monotonic_ns()
        rt = _rt.current()
        try:
            rt.before_complete(self)
        except BaseException as e:  # no slot to be had: the coordinator failed
            error = error or e
        if self.before_done is not None:
            run, self.before_done = self.before_done, None
            try:
                run()  # also when the reply failed: gloo must be done with the tensors before the program sees them
            except PrismRankError as e:
                error = error or e
            except BaseException as e:  # noqa: BLE001 (the members' real call failed: the program's error)
                error = error or PrismRankError(f"{self.what}: the sandbox members' own collective failed: {e}")
            arrived = max(arrived, time.monotonic_ns())
        if error is None and payloads is not None:
            gpu = rt.recorder.gpu
            if gpu is not None:
                gpu.acquire()  # GPU ranks sharing a GPU take turns, copies included
            try:
                self._copy_out(payloads)
            except BaseException as e:
                error = e
            finally:
                if gpu is not None:
                    gpu.release()
        with self.lock:
            self.end_ns = arrived
            # A wait that began after the reply arrived (while this thread took
            # the slot back) waited for nothing.
            if self.wait_ns is None or self.wait_ns > arrived:
                self.wait_ns = arrived
        try:
            if error is None:
                for ev in self.finish_events(self):
                    rt.recorder.emit(ev)
        finally:
            self._error = error
            self.done.set()
            self.settle_future()

    @property
    def torch_future(self) -> "_PrismFuture":
        """The call's torch future, made at the first ask (completed at once
        if the call is done already)."""
        with self.lock:
            fut = self._torch_future
            if fut is None:
                fut = self._torch_future = _PrismFuture(self, devices=self._devices)
                late = self._settled
            else:
                late = False
        if late:
            self._complete(fut)
        return fut

    def settle_future(self) -> None:
        """Give the torch future, if one was asked for, its result (or error),
        then cut it loose (one asked for later is completed as it is made).

        The future no longer needs this op once done: without the cut the pair
        is a reference cycle, and the call's tensors (GPU memory the real run
        has freed) live until Python's cyclic collector runs: +16 MiB per step
        and ~190 MiB above the truth's peak in the NCCL bench (GPT tp2).
        """
        with self.lock:
            self._settled = True
            fut = self._torch_future
        if fut is not None:
            self._complete(fut)
        self.outputs = []

    def _complete(self, fut: "_PrismFuture") -> None:
        if self._error is None:
            if self.stream_done is not None:
                # A CUDA future orders its consumers behind the streams current
                # when it completes: here, one that waits for the side stream's
                # event (not the completion thread's default stream).
                with torch.cuda.stream(self.stream_done.follower()):
                    fut.set_result(self.result)
            else:
                fut.set_result(self.result)
        else:
            fut.set_exception(self._error)
        fut._op = None

    def _copy_out(self, payloads: Sequence[Any]) -> None:
        if not payloads:
            return  # the coordinator's "leave your tensors as they are"
        if len(payloads) != len(self.outputs):
            raise PrismRankError(
                f"{self.what}: the coordinator sent {len(payloads)} tensors, expected "
                f"{len(self.outputs)}; this is a Prism bug, please report it"
            )
        cuda: set[torch.device] = set()
        with torch.no_grad():
            for buf, out in zip(payloads, self.outputs):
                src = _from_payload(buf, out, self.what)
                out.copy_(src)
                if out.device.type == "cuda":
                    cuda.add(out.device)
        for dev in cuda:
            torch.cuda.synchronize(dev)


class _PrismFuture(torch.futures.Future):
    """The torch Future of a Prism call: a wait from Python releases the slot
    like ``Work.wait`` (C++ waits are the stall monitor's business)."""

    def __init__(self, op: _Op, devices: list[torch.device]) -> None:
        super().__init__(devices=devices or None)
        self._op = op

    def wait(self) -> Any:
        op = self._op
        if op is not None and not self.done():
            try:
                op.wait()
            except BaseException:
                pass  # the future's own wait raises it below
        return super().wait()


class PrismWork(dist._Work):
    """Work of one Prism operation: ``wait()`` blocks (without the slot) until
    the coordinator's reply is applied; ``get_future()`` is completed then."""

    def __init__(self, op: _Op) -> None:
        super().__init__()
        self._op = op

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._op.wait()
        return True

    def is_completed(self) -> bool:
        return self._op.done.is_set()

    def is_success(self) -> bool:
        return self._op.done.is_set() and self._op.error is None

    def exception(self) -> BaseException | None:
        return self._op.error

    def result(self) -> list[torch.Tensor]:
        self._op.wait()
        return self._op.result

    def synchronize(self) -> None:
        self._op.wait()

    def get_future(self) -> torch.futures.Future:
        return self._op.torch_future


class _DeviceTemplate:
    """What every device-path call of one signature (op, reduction, dtypes,
    shapes, splits, root, async) sends and records, made at its first call:
    its ``CollectiveArrive``'s header with the per-call fields still to set
    (``seq``, ``issue_ns``, ``recorded``, ``release_slot``,
    ``release_value``), the declared shapes and splits, the bytes moved.
    A call then copies the header and encodes it instead of building and
    encoding a message: 12 us less a call in the CPU test mode, 2 more to look
    the template up (2026-12-08, the 2-core VM, ``bench/call_cost.py
    --call-log``). At most ``MAX`` signatures a group are kept (a PREMUL_SUM
    whose factor changes each call would make one each)."""

    MAX = 256

    __slots__ = ("header", "in_shapes", "out_shapes", "in_splits", "out_splits", "nbytes")

    def __init__(self, rank: int, gid: str, op: str, reduce_name: str, premul: float | None, dtype: str,
                 declared: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], root: int,
                 in_splits: Sequence[int], out_splits: Sequence[int], async_op: bool, reach: bool) -> None:
        self.in_shapes = tuple(_shape(t) for t in declared)
        self.out_shapes = tuple(_shape(t) for t in outputs)
        self.in_splits = tuple(int(x) for x in in_splits)
        self.out_splits = tuple(int(x) for x in out_splits)
        self.nbytes = sum(t.numel() * t.element_size() for t in declared)
        self.header = protocol.header_template(protocol.CollectiveArrive(
            rank=rank, gid=gid, seq=0, op=op, reduce_op=reduce_name, dtype=dtype, in_shapes=self.in_shapes,
            out_shapes=self.out_shapes, root=root, in_splits=self.in_splits, out_splits=self.out_splits,
            premul=premul, async_op=async_op, issue_ns=0, on_device=True, reach_follows=reach, recorded=False,
            release_slot=-1, release_value=0))
        for name in ("seq", "issue_ns", "recorded", "release_slot", "release_value"):
            if name not in self.header:  # a protocol change that renamed one: fail at the first call, by name
                raise RuntimeError(f"the device path's CollectiveArrive template has no field {name!r}: "
                                   "a Prism bug, please report it")


def _value(ref: str, t: torch.Tensor) -> trace.TensorValue:
    return trace.TensorValue(ref=ref, dtype=_dtype_name(t.dtype), shape=_shape(t), data=bytes(_buffer(_host(t))))


def _value_events(ref_prefix: str, role: str, tensors: Sequence[torch.Tensor], limit: int) -> list[trace.TensorValue]:
    """Values of the small ones among ``tensors`` (role "in"/"out", or
    "in{i}"/"out{i}" when there are several)."""
    single = len(tensors) == 1
    return [
        _value(f"{ref_prefix}:{role if single else f'{role}{i}'}", t)
        for i, t in enumerate(tensors)
        if t.numel() * t.element_size() <= limit
    ]


# --- the process group -------------------------------------------------------------


class PrismProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose calls go through the Prism
    coordinator (see the module docstring for the wire contract)."""

    def __init__(self, rank: int, size: int, ranks: Sequence[int], gid: str, index: int, name: str) -> None:
        super().__init__(rank, size)
        self._group_rank = rank
        self._size = size
        #: Global ranks of the members, in group-rank order.
        self.global_ranks = tuple(ranks)
        self.gid = gid
        self.index = index
        self._name = name
        self._desc = ""
        self._seq = 0
        self._seq_lock = threading.Lock()
        #: Ops issued since ``_start_coalescing`` (None: not coalescing).
        self._coalesced: list[Any] | None = None
        #: Whether this group's calls may take the GPU sandbox's device path
        #: (``devicepath.group_eligible``; None: not asked yet).
        self._device_group: bool | None = None
        #: The device path's per-signature templates (``_DeviceTemplate``).
        self._device_templates: dict[tuple, "_DeviceTemplate"] = {}

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices this group carries tensors of. torch reads it to pick
        the device of object collectives and state-dict broadcasts, and
        ``dcp.async_save`` requires "cpu" in it; a Python process group
        registers no C++ backend, so the inherited answer would be empty."""
        return [torch.device("cpu"), torch.device("cuda")] if torch.cuda.is_available() else [torch.device("cpu")]

    def __repr__(self) -> str:
        return f"PrismProcessGroup(gid={self.gid!r}, rank={self._group_rank}, ranks={list(self.global_ranks)})"

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    # --- the collective engine ---------------------------------------------

    def _collective(
        self,
        op: str,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        opts: Any,
        *,
        result: Sequence[torch.Tensor] | None = None,
        reduce: Any = None,
        root: int = -1,
        in_splits: Sequence[int] = (),
        out_splits: Sequence[int] = (),
    ) -> PrismWork:
        t_in = time.monotonic_ns()  # the backend's entry (a device-path call's issue time counts from here)
        rt = _rt.current()
        reduce_name, premul = _reduce_op(reduce) if reduce is not None else ("", None)
        group_ok = self._device_group
        if group_ok is None:  # the group's part of the device path's eligibility, decided once
            group_ok = self._device_group = bool(rt.hybrid) and devicepath.group_eligible(self.global_ranks, rt.rank)
        on_device = group_ok and devicepath.call_eligible(op, (*inputs, *outputs), reduce_name)
        if rt.recorder.gpu is None and not on_device:
            _settle([*inputs, *outputs])
        rt.ensure_slot()
        t0 = rt.recorder.comm_enter()
        try:
            with self._seq_lock:
                seq = self._seq
                self._seq += 1
            tensors = list(inputs) or list(outputs)
            dtype = _dtype_name(tensors[0].dtype) if tensors else "uint8"
            async_op = bool(getattr(opts, "asyncOp", True))
            if on_device:
                return self._on_device(rt, op, seq, reduce_name, premul, dtype, inputs, outputs, result, root,
                                       in_splits, out_splits, async_op, t0, t_in)
            ours = (pruned.members(op, reduce_name, dtype, self.global_ranks, rt.rank, [*inputs, *outputs])
                    if rt.hybrid and len(inputs) == len(outputs) == 1 else None)
            if ours is not None:
                return self._pruned(rt, op, seq, reduce_name, premul, dtype, inputs[0], outputs[0], async_op, t0,
                                    ours)
            hosts = [_host(t) for t in inputs]
            msg = protocol.CollectiveArrive(
                rank=rt.rank,
                gid=self.gid,
                seq=seq,
                op=op,
                reduce_op=reduce_name,
                dtype=dtype,
                # Every member declares the broadcast tensor (the matcher
                # compares them); only the root sends its payload.
                in_shapes=tuple(_shape(t) for t in (inputs if inputs or op != "broadcast" else outputs)),
                out_shapes=tuple(_shape(t) for t in outputs),
                root=root,
                in_splits=tuple(int(s) for s in in_splits),
                out_splits=tuple(int(s) for s in out_splits),
                premul=premul,
                async_op=async_op,
                issue_ns=rt.emu_ns(t0),
                payloads=tuple(_buffer(h) for h in hosts),
            )
            what = f"{op} on group {self.gid} (seq {seq})"
            pending = _Op(what, list(outputs), list(result if result is not None else outputs), t0,
                          not async_op, rt.recorder.step)
            pending.wait_key = wait_key_coll(self.gid, seq)
            ref = f"coll:{self.gid}:{seq}"
            limit = rt.recorder.small_tensor_limit
            in_values = _value_events(ref, "in", hosts, limit)
            # A broadcast's non-root members record the tensor they receive
            # (as in their CollectiveArrive): its size is what the op moves.
            nbytes = sum(h.numel() * h.element_size() for h in hosts) if hosts or op != "broadcast" else \
                sum(t.numel() * t.element_size() for t in outputs)

            return self._submit(rt, msg, pending, nbytes, in_values, ref, limit)
        finally:
            rt.recorder.comm_exit(time.monotonic_ns())

    def _pruned(self, rt: Any, op: str, seq: int, reduce_name: str, premul: float | None, dtype: str,
                inp: torch.Tensor, out: torch.Tensor, async_op: bool, t0: int, ours: tuple[int, ...]) -> PrismWork:
        """A collective among two or more sandbox members (``prism.rank.pruned``):
        they run it among themselves for real, the virtual members' part is
        folded in, and the result is the program's once the emulated release
        has come as well."""
        ref = f"coll:{self.gid}:{seq}"
        limit = rt.recorder.small_tensor_limit
        in_values = _value_events(ref, "in", [inp], limit)  # before the real call overwrites it
        nbytes = inp.numel() * inp.element_size()
        t_own = time.monotonic_ns()
        # what the host path's coordinator would hash of the payload, before the real call overwrites it
        digests = (PL.digest(memoryview(_buffer(_host(inp))).cast("B")),) if pruned.digests_wanted() else ()
        msg = protocol.CollectiveArrive(
            rank=rt.rank, gid=self.gid, seq=seq, op=op, reduce_op=reduce_name, dtype=dtype,
            in_shapes=(_shape(inp),), out_shapes=(_shape(out),), premul=premul, async_op=async_op,
            issue_ns=rt.emu_ns(t0), pruned=True, in_digests=digests)
        what = f"{op} on group {self.gid} (seq {seq})"
        pending = _Op(what, [out], [out], t0, not async_op, rt.recorder.step)
        pending.wait_key = wait_key_coll(self.gid, seq)
        # The arrival goes out first, so the coordinator checks the call against
        # the graph (a script that diverged stops with its mismatch) while the
        # members meet; the real call follows at once.
        started: dict[str, Any] = {}
        ready = threading.Event()

        def real_then_fold() -> None:
            ready.wait()
            if "error" in started:
                raise started["error"]
            started["work"].wait()
            with torch.no_grad():
                started["after"]()

        pending.before_done = real_then_fold
        work = self._submit(rt, msg, pending, nbytes, in_values, ref, limit)
        try:
            with torch.no_grad():
                started["work"], started["after"] = pruned.start(self.gid, ours, rt.rank, op, inp, out, reduce_name,
                                                                 premul, self.global_ranks)
        except Exception as e:  # noqa: BLE001 (reported as the call's error, when the program waits for it)
            started["error"] = PrismRankError(
                f"{what}: --pruned could not run it among the sandbox members {list(ours)} ({e}); every member "
                "must reach it (run without --pruned to stage it through the coordinator)")
        finally:
            ready.set()
            # the digest, the packing and a first call's communicator set-up are Prism's time, not the job's
            rt.add_dilation(time.monotonic_ns() - t_own)
        return work

    def _submit(self, rt: Any, msg: protocol.CollectiveArrive, pending: _Op, nbytes: int, in_values: list[Any],
                ref: str, limit: int) -> PrismWork:
        """Send a host-path (or pruned) collective's arrival and complete
        ``pending`` from the coordinator's reply; its trace events then."""
        def finish(p: _Op) -> list[Any]:
            ev = trace.Collective(
                gid=msg.gid, seq=msg.seq, op=msg.op, reduce_op=msg.reduce_op, dtype=msg.dtype,
                in_shapes=msg.in_shapes, out_shapes=msg.out_shapes, bytes=nbytes, root=msg.root,
                in_splits=msg.in_splits, out_splits=msg.out_splits, premul=msg.premul, async_op=msg.async_op,
                issue_ns=p.issue_ns, wait_ns=p.wait_ns or p.end_ns, end_ns=p.end_ns, step=p.step)
            return [ev, *in_values, *_value_events(ref, "out", p.outputs, limit)]

        pending.finish_events = finish
        fut = rt.client.future(("coll", self.gid, msg.seq))
        rt.send_call(msg)
        rt.on_done(fut, lambda f: _complete_from_future(pending, f))
        return self._issued(PrismWork(pending))

    def _on_device(self, rt: Any, op: str, seq: int, reduce_name: str, premul: float | None, dtype: str,
                   inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                   result: Sequence[torch.Tensor] | None, root: int, in_splits: Sequence[int],
                   out_splits: Sequence[int], async_op: bool, t0: int, t_in: int) -> PrismWork:
        """A GPU sandbox's call answered by virtual members only
        (``prism.rank.devicepath``): the stream waits for the release and
        forms the outputs in place; the CPU goes on at once."""
        marks = devicepath.entry_marks()  # the call log's moments before its record (None: no log)
        devicepath.stamp(marks, "t_on")
        rel = devicepath.releaser()
        slot, value = rel.reserve()
        reach = rel.reports_reach and devicepath.reach_from_gpu()
        shared = rel.shared_path is not None
        if shared and not rel.announced:
            _announce_shared_release(rt, rel)
        declared = inputs if inputs or op != "broadcast" else outputs  # as in _collective
        tmpl = self._device_template(rt.rank, op, reduce_name, premul, dtype, declared, outputs, root, in_splits,
                                     out_splits, async_op, reach)
        # The capture's recorded outputs, where this rank has them (its
        # prefetch pool, ``devicepath.RecordedFeed``); else compensated.
        anyt = [*outputs, *inputs]
        feed = devicepath.recorded_feed(rt.rank, anyt[0].device if anyt else None)
        refs = [PL.coll_ref(self.gid, seq, "out", i, len(outputs)) for i in range(len(outputs))]
        recorded = feed is not None and all(feed.can_deliver(r, o) for r, o in zip(refs, outputs))
        devicepath.stamp(marks, "t_feed")
        # The CollectiveArrive, from the signature's header (``_DeviceTemplate``).
        header = dict(tmpl.header)
        header["seq"], header["issue_ns"], header["recorded"] = seq, rt.emu_ns(t0), recorded
        if shared:
            header["release_slot"], header["release_value"] = slot, value
        what = f"{op} on group {self.gid} (seq {seq})"
        pending = _Op(what, [], list(result if result is not None else outputs), t0, False, rt.recorder.step)
        pending.wait_key = wait_key_coll(self.gid, seq)
        pending.release_flag = (rel, slot, value)
        devicepath.stamp(marks, "t_op")
        dev = anyt[0].device if anyt else None
        busy0 = devicepath.stream_busy(dev)
        drained = self._charge_entry(rt, t0, busy0)
        rec = pending.call_log = None if marks is None else devicepath.call_record(
            op=op, gid=self.gid, seq=seq, t0=t0, async_op=async_op, recorded=recorded, busy0=busy0, marks=marks,
            step=rt.recorder.step)
        pending.hold_weakly()
        gid = self.gid

        def finish(p: _Op) -> list[Any]:
            return [trace.Collective(
                gid=gid, seq=seq, op=op, reduce_op=reduce_name, dtype=dtype, in_shapes=tmpl.in_shapes,
                out_shapes=tmpl.out_shapes, bytes=tmpl.nbytes, root=root, in_splits=tmpl.in_splits,
                out_splits=tmpl.out_splits, premul=premul, async_op=async_op, issue_ns=p.issue_ns,
                wait_ns=p.wait_ns or p.end_ns, end_ns=p.end_ns, step=p.step)]

        pending.finish_events = finish
        fut = rt.client.future(("coll", self.gid, seq))
        devicepath.stamp(rec, "t_msg")
        # The call is out of this thread's hands before anything is queued
        # on the GPU: whatever blocks this thread next (a kernel's first
        # launch, a copy), the release can come (the flags only grow: a
        # release before the wait is queued lets it pass at once). Where the
        # reach is watched (protocol 12) the arrival leaves with the reach,
        # from the reach watcher, on which the release waited anyway (its
        # ``Reached``), or before the rank's next ordered message.
        if reach and devicepath.arrive_at_reach():
            rt.defer_arrival((self.gid, seq), header)
        else:
            rt.send_call(None, protocol.encode_header(header))
        devicepath.stamp(rec, "t_sent")
        _on_result(rt, pending, fut)
        side = devicepath.side_stream(anyt[0].device) if async_op and anyt else None
        with side.run(pending, anyt) if side is not None else contextlib.nullcontext():
            if reach:
                rel.prepare(slot)
            rel.enqueue_wait(slot, value)
            if reach:
                rel.watch(slot, t0, _reach_reporter(rt, self.gid, seq), rt.add_dilation, rec, drained,
                          rt.recorder.step)
            devicepath.stamp(rec, "t_wait")
            if recorded:
                with torch.no_grad():
                    for r, o in zip(refs, outputs):
                        feed.deliver(r, o, rec)  # type: ignore[union-attr]
            else:
                devicepath.form_outputs(op, reduce_name, premul, self._size, self._group_rank, inputs, outputs,
                                        in_splits, out_splits)
            if reach:
                rel.mark_delivered(slot)
            devicepath.stamp(rec, "t_out")
        work = self._issued(PrismWork(pending))
        t1 = time.monotonic_ns()
        devicepath.count_issue(t1 - t_in)
        self._charge_return(rel, slot, t0, t1, drained, sync=not async_op)
        if rec is not None:
            devicepath.mark_return(rec, t1, devicepath.stream_busy(dev))
        return work

    def _device_template(self, rank: int, op: str, reduce_name: str, premul: float | None, dtype: str,
                         declared: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], root: int,
                         in_splits: Sequence[int], out_splits: Sequence[int], async_op: bool,
                         reach: bool) -> "_DeviceTemplate":
        """The device-path template of this call's signature, made at its first call."""
        key = (op, reduce_name, premul, dtype, root, async_op, reach, tuple(in_splits), tuple(out_splits),
               tuple([(tuple(t.shape), t.dtype) for t in declared]), tuple([tuple(t.shape) for t in outputs]))
        tmpl = self._device_templates.get(key)
        if tmpl is None:
            if len(self._device_templates) >= _DeviceTemplate.MAX:
                self._device_templates.clear()
            tmpl = self._device_templates[key] = _DeviceTemplate(
                rank, self.gid, op, reduce_name, premul, dtype, declared, outputs, root, in_splits, out_splits,
                async_op, reach)
        return tmpl

    @staticmethod
    def _charge_entry(rt: Any, t0: int, busy0: bool | None) -> bool:
        """A device-path call enters with its stream ``busy0``: charge Prism's
        issue time the GPU waited for (``devicepath.HostCharge``). Returns
        whether the stream had drained (and the charge is on)."""
        hc = devicepath.host_charge()
        if hc is None:
            return False
        drained = busy0 is False
        charge = hc.on_entry(t0, drained)
        if charge:
            rt.add_dilation(charge)
        return drained

    @staticmethod
    def _charge_return(rel: Any, slot: int, t0: int, t1: int, drained: bool, sync: bool = False) -> None:
        rel.note_return(slot, t1 - t0)
        hc = devicepath.host_charge()
        if hc is not None:
            hc.on_return(t0, t1, drained, rel.moments(slot), sync, lambda ns: rel.spend_excess(slot, ns))

    def _check_len(self, call: str, what: str, items: Sequence[Any], n: int) -> None:
        if len(items) != n:
            raise ValueError(
                f"{call} on group {self.gid}: {what} has {len(items)} tensors, the group has {n} "
                "ranks; pass one tensor per rank (your script's fault)"
            )

    # --- all_reduce ----------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> PrismWork:
        if opts is None or isinstance(opts, (ReduceOp, ReduceOp.RedOpType)):
            o = _c10d.AllreduceOptions()
            if opts is not None:
                o.reduceOp = opts
            opts = o
        op = "all_reduce" if len(tensors) == 1 else "all_reduce_coalesced"
        return self._collective(op, tensors, tensors, opts, reduce=opts.reduceOp)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> PrismWork:
        opts = opts or _c10d.AllreduceCoalescedOptions()
        return self._collective("all_reduce_coalesced", tensors, tensors, opts, reduce=opts.reduceOp)

    # --- broadcast / reduce ----------------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> PrismWork:
        opts = opts or _c10d.BroadcastOptions()
        root = opts.rootRank
        if root == self._group_rank:
            return self._collective("broadcast", tensors, [], opts, result=tensors, root=root)
        return self._collective("broadcast", [], tensors, opts, root=root)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> PrismWork:
        opts = opts or _c10d.ReduceOptions()
        root = opts.rootRank
        outputs = tensors if root == self._group_rank else []
        return self._collective("reduce", tensors, outputs, opts, result=tensors, reduce=opts.reduceOp, root=root)

    # --- all_gather ------------------------------------------------------------

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> PrismWork:
        opts = opts or _c10d.AllgatherOptions()
        for lst in output_lists:
            self._check_len("all_gather", "the output list", lst, self._size)
        return self._one_by_one(lambda lst, t: self._collective("all_gather", [t], list(lst), opts),
                                output_lists, inputs)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> PrismWork:
        return self.allgather(output_lists, inputs, opts)

    def _one_by_one(self, issue: Callable[..., PrismWork], *lists: Sequence[Any]) -> PrismWork:
        """A coalesced call the coordinator takes one tensor at a time: k
        collectives, one Work (``prism.rank.joined``)."""
        works = [issue(*items) for items in zip(*lists, strict=True)]
        if len(works) == 1:
            return works[0]
        return PrismWork(JoinedOp([w._op for w in works]))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PrismWork:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PrismWork:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> PrismWork:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> PrismWork:
        opts = opts or _c10d.AllgatherOptions()
        for o, i in zip(outputs, inputs, strict=True):
            if o.numel() != i.numel() * self._size:
                raise ValueError(
                    f"all_gather_into_tensor on group {self.gid}: output has {o.numel()} elements, "
                    f"expected input's {i.numel()} x {self._size} ranks (your script's fault)"
                )
        return self._one_by_one(lambda o, i: self._collective("all_gather_into_tensor", [i], [o], opts),
                                outputs, inputs)

    # --- gather / scatter --------------------------------------------------------

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> PrismWork:
        opts = opts or _c10d.GatherOptions()
        root = opts.rootRank
        outputs: list[torch.Tensor] = []
        if root == self._group_rank:
            self._check_len("gather", "the gather list", output_lists[0], self._size)
            outputs = list(output_lists[0])
        return self._collective("gather", inputs, outputs, opts, root=root)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None) -> PrismWork:
        opts = opts or _c10d.ScatterOptions()
        root = opts.rootRank
        inputs: list[torch.Tensor] = []
        if root == self._group_rank:
            self._check_len("scatter", "the scatter list", input_lists[0], self._size)
            inputs = list(input_lists[0])
        return self._collective("scatter", inputs, outputs, opts, root=root)

    # --- reduce_scatter ----------------------------------------------------------

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None) -> PrismWork:
        opts = opts or _c10d.ReduceScatterOptions()
        if len(outputs) != 1:
            raise _unsupported(f"reduce_scatter with {len(outputs)} output tensors")
        self._check_len("reduce_scatter", "the input list", input_lists[0], self._size)
        return self._collective("reduce_scatter", list(input_lists[0]), outputs, opts, reduce=opts.reduceOp)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PrismWork:
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PrismWork:
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> PrismWork:
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> PrismWork:
        opts = opts or _c10d.ReduceScatterOptions()
        for o, i in zip(outputs, inputs, strict=True):
            if i.numel() != o.numel() * self._size:
                raise ValueError(
                    f"reduce_scatter_tensor on group {self.gid}: input has {i.numel()} elements, "
                    f"expected output's {o.numel()} x {self._size} ranks (your script's fault)"
                )
        return self._one_by_one(
            lambda o, i: self._collective("reduce_scatter_tensor", [i], [o], opts, reduce=opts.reduceOp),
            outputs, inputs)

    # --- all_to_all ----------------------------------------------------------------

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> PrismWork:
        opts = opts or _c10d.AllToAllOptions()
        self._check_len("all_to_all", "the input list", inputs, self._size)
        self._check_len("all_to_all", "the output list", outputs, self._size)
        return self._collective("all_to_all", inputs, outputs, opts)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None,
                          input_split_sizes: list[int] | None, opts: Any = None) -> PrismWork:
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None,
                      input_split_sizes: list[int] | None, opts: Any = None) -> PrismWork:
        opts = opts or _c10d.AllToAllOptions()
        in_splits = self._splits("input", input, input_split_sizes)
        out_splits = self._splits("output", output, output_split_sizes)
        return self._collective("all_to_all_single", [input], [output], opts,
                                in_splits=in_splits, out_splits=out_splits)

    def _splits(self, which: str, t: torch.Tensor, splits: list[int] | None) -> list[int]:
        rows = int(t.shape[0]) if t.dim() > 0 else 0
        # Any sequence of integers, as the C++ binding takes: Megatron's MoE
        # dispatcher passes numpy arrays, others pass tensors or tuples.
        splits = [] if splits is None else [int(s) for s in splits]
        if not splits:
            if rows % self._size:
                raise ValueError(
                    f"all_to_all_single on group {self.gid}: the {which} has {rows} rows, not divisible "
                    f"by the {self._size} ranks; pass {which}_split_sizes (your script's fault)"
                )
            return [rows // self._size] * self._size
        if len(splits) != self._size or sum(splits) != rows:
            raise ValueError(
                f"all_to_all_single on group {self.gid}: {which}_split_sizes {list(splits)} must have "
                f"{self._size} entries summing to the {which}'s {rows} rows (your script's fault)"
            )
        return [int(s) for s in splits]

    # --- barrier ---------------------------------------------------------------------

    def barrier(self, opts: Any = None) -> PrismWork:
        return self._collective("barrier", [], [], opts or _c10d.BarrierOptions())

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        self.barrier().wait()

    # --- point to point ------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> PrismWork:
        rt = _rt.current()
        peer = self.global_ranks[dst]
        on_device = rt.hybrid and len(tensors) == 1 and devicepath.eligible_p2p(peer, tensors[0])
        if rt.recorder.gpu is None and not on_device:
            _settle(tensors)
        blocking = _caller_is_blocking("send")
        rt.ensure_slot()
        t0 = rt.recorder.comm_enter()
        try:
            (t,) = tensors
            pseq = rt.next_pseq(rt.rank, peer, tag)
            if on_device:
                return self._send_on_device(rt, t, peer, tag, pseq, blocking, t0)
            h = _host(t, copy=True)  # eager send: the caller may reuse t at once
            rt.send_call(protocol.Send(
                rank=rt.rank, gid=self.gid, dst=peer, tag=tag, pseq=pseq, dtype=_dtype_name(t.dtype),
                shape=_shape(t), issue_ns=rt.emu_ns(t0), payloads=(_buffer(h),),
            ))
            end = time.monotonic_ns()
            pending = _Op(f"send to rank {peer} tag {tag}", [], [t], t0, True, rt.recorder.step)
            pending.end_ns = end
            rt.recorder.emit(trace.P2P(
                op="send", gid=self.gid, peer=peer, tag=tag, pseq=pseq, dtype=_dtype_name(t.dtype),
                shape=_shape(t), bytes=h.numel() * h.element_size(), async_op=not blocking,
                issue_ns=t0, wait_ns=t0, end_ns=end, step=rt.recorder.step,
            ))
            if h.numel() * h.element_size() <= rt.recorder.small_tensor_limit:
                rt.recorder.emit(_value(f"p2p:{rt.rank}:{peer}:{tag}:{pseq}", h))
            rt.untrack(pending)
            pending.done.set()
            pending.settle_future()
            return self._issued(PrismWork(pending))
        finally:
            rt.recorder.comm_exit(time.monotonic_ns())

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> PrismWork:
        rt = _rt.current()
        peer = self.global_ranks[src]
        on_device = rt.hybrid and len(tensors) == 1 and devicepath.eligible_p2p(peer, tensors[0])
        if rt.recorder.gpu is None and not on_device:
            _settle(tensors)
        blocking = _caller_is_blocking("recv")
        rt.ensure_slot()
        t0 = rt.recorder.comm_enter()
        try:
            (t,) = tensors
            pseq = rt.next_pseq(peer, rt.rank, tag)
            shape, dtype = _shape(t), _dtype_name(t.dtype)
            if on_device:
                return self._recv_on_device(rt, t, peer, tag, pseq, blocking, t0)
            pending = _Op(f"recv from rank {peer} tag {tag} (pseq {pseq})", [t], [t], t0, blocking, rt.recorder.step)
            pending.wait_key = wait_key_p2p(peer, rt.rank, tag, pseq)
            nbytes = t.numel() * t.element_size()

            def finish(p: _Op) -> list[Any]:
                return [trace.P2P(
                    op="recv", gid=self.gid, peer=peer, tag=tag, pseq=pseq, dtype=dtype, shape=shape,
                    bytes=nbytes, async_op=not blocking, issue_ns=p.issue_ns, wait_ns=p.wait_ns or p.end_ns,
                    end_ns=p.end_ns, step=p.step,
                )]

            pending.finish_events = finish
            fut = rt.client.future(("p2p", peer, rt.rank, tag, pseq))
            rt.send_call(protocol.RecvPost(
                rank=rt.rank, gid=self.gid, src=peer, tag=tag, pseq=pseq, dtype=dtype, shape=shape,
                issue_ns=rt.emu_ns(t0),
            ))
            rt.on_done(fut, lambda f: _complete_from_future(pending, f))
            return self._issued(PrismWork(pending))
        finally:
            rt.recorder.comm_exit(time.monotonic_ns())

    def _send_on_device(self, rt: Any, t: torch.Tensor, peer: int, tag: int, pseq: int, blocking: bool,
                        t0: int) -> PrismWork:
        """A GPU sandbox's send to a virtual rank (``prism.rank.devicepath``):
        shapes only; nothing is copied off the GPU. Where the GPU stamps its
        reach, a wait released in advance goes on the stream, so that the
        send arrives in the emulated job when the stream gets to it (as
        NCCL's send kernel starts), not when the CPU, often milliseconds
        ahead of its stream, issued it; the stream does not wait (the send
        is eager, as the engine models it)."""
        dtype, shape = _dtype_name(t.dtype), _shape(t)
        rel = devicepath.releaser()
        reach = rel is not None and rel.reports_reach and devicepath.reach_from_gpu()
        send = protocol.Send(rank=rt.rank, gid=self.gid, dst=peer, tag=tag, pseq=pseq, dtype=dtype, shape=shape,
                             issue_ns=rt.emu_ns(t0), on_device=True, reach_follows=reach)
        if reach and devicepath.arrive_at_reach():
            rt.defer_arrival((protocol.send_reach_gid(peer, tag), pseq), send)  # protocol 12, as a collective's
        else:
            rt.send_call(send)
        if reach:
            slot, value = rel.reserve()
            rel.prepare(slot)
            rel.release(slot, value)  # nothing to wait for: the wait only stamps the reach
            rel.enqueue_wait(slot, value)
            rec = devicepath.call_record(op="send", peer=peer, tag=tag, pseq=pseq, t0=t0)
            rel.watch(slot, t0, _reach_reporter(rt, protocol.send_reach_gid(peer, tag), pseq), rt.add_dilation, rec,
                      step=rt.recorder.step)
        end = time.monotonic_ns()
        pending = _Op(f"send to rank {peer} tag {tag}", [], [t], t0, True, rt.recorder.step)
        pending.end_ns = end
        rt.recorder.emit(trace.P2P(
            op="send", gid=self.gid, peer=peer, tag=tag, pseq=pseq, dtype=dtype, shape=shape,
            bytes=t.numel() * t.element_size(), async_op=not blocking, issue_ns=t0, wait_ns=t0, end_ns=end,
            step=rt.recorder.step,
        ))
        rt.untrack(pending)
        pending.done.set()
        pending.settle_future()
        work = self._issued(PrismWork(pending))
        devicepath.count_issue(time.monotonic_ns() - t0)
        return work

    def _recv_on_device(self, rt: Any, t: torch.Tensor, peer: int, tag: int, pseq: int, blocking: bool,
                        t0: int) -> PrismWork:
        """A GPU sandbox's receive from a virtual rank (``prism.rank.devicepath``):
        the stream waits for the release, then the tensor is zeroed (the
        compensated receive); the CPU goes on at once."""
        rel = devicepath.releaser()
        slot, value = rel.reserve()
        reach = rel.reports_reach and devicepath.reach_from_gpu()
        dtype, shape = _dtype_name(t.dtype), _shape(t)
        nbytes = t.numel() * t.element_size()
        pending = _Op(f"recv from rank {peer} tag {tag} (pseq {pseq})", [], [t], t0, False, rt.recorder.step)
        pending.wait_key = wait_key_p2p(peer, rt.rank, tag, pseq)
        pending.release_flag = (rel, slot, value)
        pending.hold_weakly()
        busy0 = devicepath.stream_busy(t.device)
        drained = self._charge_entry(rt, t0, busy0)
        rec = pending.call_log = devicepath.call_record(op="recv", peer=peer, tag=tag, pseq=pseq, t0=t0,
                                                        busy0=busy0)

        def finish(p: _Op) -> list[Any]:
            return [trace.P2P(
                op="recv", gid=self.gid, peer=peer, tag=tag, pseq=pseq, dtype=dtype, shape=shape, bytes=nbytes,
                async_op=not blocking, issue_ns=p.issue_ns, wait_ns=p.wait_ns or p.end_ns, end_ns=p.end_ns,
                step=p.step,
            )]

        pending.finish_events = finish
        fut = rt.client.future(("p2p", peer, rt.rank, tag, pseq))
        feed = devicepath.recorded_feed(rt.rank, t.device)
        ref = PL.p2p_ref(peer, rt.rank, tag, pseq)
        recorded = feed is not None and feed.can_deliver(ref, t)
        # As a device-path collective: the call is out of this thread's hands before the wait is queued
        # (at its reach, with it, protocol 12; else now).
        post = protocol.RecvPost(rank=rt.rank, gid=self.gid, src=peer, tag=tag, pseq=pseq, dtype=dtype, shape=shape,
                                 issue_ns=rt.emu_ns(t0), on_device=True, reach_follows=reach, recorded=recorded)
        if reach and devicepath.arrive_at_reach():
            rt.defer_arrival((protocol.recv_reach_gid(peer, tag), pseq), post)
        else:
            rt.send_call(post)
        _on_result(rt, pending, fut)

        def queue() -> None:
            if reach:
                rel.prepare(slot)
            rel.enqueue_wait(slot, value)
            if reach:
                rel.watch(slot, t0, _reach_reporter(rt, protocol.recv_reach_gid(peer, tag), pseq), rt.add_dilation,
                          rec, drained, rt.recorder.step)
            with torch.no_grad():
                if recorded:
                    feed.deliver(ref, t)  # type: ignore[union-attr]
                else:
                    t.zero_()
            if reach:
                rel.mark_delivered(slot)

        side = devicepath.side_stream(t.device) if not blocking else None
        if side is not None:
            # An irecv waits on the side stream, as NCCL's runs on its own: a
            # wait on the caller's stream would hold the sends issued after it
            # (their reach is their arrival, protocol 8) behind this receive,
            # and a virtual peer that sends only once it received (a batch,
            # ``batch_isend_irecv``, which NCCL runs as one) would never get it.
            with side.run(pending, [t]):
                queue()
        else:
            queue()
        work = self._issued(PrismWork(pending))
        t1 = time.monotonic_ns()
        devicepath.count_issue(t1 - t0)
        self._charge_return(rel, slot, t0, t1, drained)
        if rec is not None:
            devicepath.mark_return(rec, t1, devicepath.stream_busy(t.device))
        return work

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> PrismWork:
        raise _unsupported("recv from any source (dist.recv/irecv without src)")

    # --- device-level coalescing ----------------------------------------------------

    def _issued(self, work: PrismWork) -> PrismWork:
        if self._coalesced is not None:
            self._coalesced.append(work._op)
        return work

    def _start_coalescing(self, device: Any) -> None:
        """Device-level coalescing (``_coalescing_manager(group, device)``,
        NCCL-style ``batch_isend_irecv``): the ops until ``_end_coalescing``
        are issued as they come (a send never blocks, a receive is posted
        asynchronously, so no order among them can deadlock) and
        ``_end_coalescing`` returns one Work over all of them."""
        if self._coalesced is not None:
            raise PrismRankError(
                f"_start_coalescing on group {self.gid}: the group is already coalescing; end the "
                "first _coalescing_manager before starting another (your script's fault)"
            )
        self._coalesced = []

    def _end_coalescing(self, device: Any) -> PrismWork:
        if self._coalesced is None:
            raise PrismRankError(
                f"_end_coalescing on group {self.gid} without _start_coalescing (your script's fault)"
            )
        ops, self._coalesced = self._coalesced, None
        return PrismWork(JoinedOp(ops))

    # --- not supported ------------------------------------------------------------

    def split_group(self, *args: Any, **kwargs: Any) -> Any:
        raise _unsupported("split_group (create groups with dist.new_group instead)")


def _announce_shared_release(rt: Any, rel: Any) -> None:
    """Tell the coordinator where this rank's release flags live
    (``devicepath.SHARED_RELEASE_ENV``), before the first call naming a slot,
    and keep the rank's dilation in the file from now on (the coordinator's
    release times are on the rank's dilated clock)."""
    rel.flags.publish_dilation(rt.dilation_ns)
    rt.on_dilation = rel.flags.publish_dilation
    rt.client.send(protocol.ReleaseShared(rt.rank, rel.shared_path, len(rel.flags.flags)))
    rel.announced = True


def _flip_release(pending: _Op, fut: Any) -> None:
    """The device path: flip the release flag as the result arrives (the
    transport's thread, before the completion thread's turn): the wait on
    the GPU times itself (the release moment, and the call's tail after the
    stream got there), so the flag is flipped now and no Python thread has
    to wake on time; one thread hop less on the stream's critical path (the
    completion thread took 66-87 us more at the median, 400 us at p90, on the
    2-core VM in cpu-test, 2026-12-06). A failed call is left to
    ``_complete_from_future``."""
    if pending.release_flag is None or fut.cancelled() or fut.exception() is not None:
        return
    reply = fut.result()
    _take_release(pending, reply)
    tail = getattr(reply, "tail_ns", 0)
    rel, slot, value = pending.release_flag
    rel.release(slot, value, pending.release_mono_ns, tail)
    pending.flipped = True
    if pending.call_log is not None:
        pending.call_log.update(t_flip=time.monotonic_ns(), due=pending.release_mono_ns, tail=tail)


def _take_release(pending: _Op, reply: Any) -> None:
    """The reply's release moment, on the rank's dilated clock (an
    emulation), back onto the monotonic one."""
    if reply.release_ns:
        pending.release_mono_ns = reply.release_ns + _rt.current().dilation_ns


def _on_result(rt: Any, pending: _Op, fut: Any) -> None:
    """``pending``'s result: a device-path call's flag flips at once
    (``_flip_release``), the rest in the completion thread."""
    if pending.release_flag is not None:
        fut.add_done_callback(lambda f: _flip_release(pending, f))
    rt.on_done(fut, lambda f: _complete_from_future(pending, f))


def _complete_from_future(pending: _Op, fut: Any) -> None:
    if pending.call_log is not None:  # the result reached this rank's completion thread
        pending.call_log["t_res"] = time.monotonic_ns()
    try:
        reply = fut.result()
    except BaseException as e:
        _release_gpu(pending)  # never leave the GPU spinning on a call that failed
        pending.complete(None, PrismRankError(f"{pending.what} failed: {e}"))
        return
    if pending.release_flag is not None:
        if not pending.flipped:  # (the transport's callback flips it first)
            _flip_release(pending, fut)
    else:
        _take_release(pending, reply)
        _hold_until(pending.release_mono_ns)
    pending.complete(tuple(reply.payloads), None)


def _reach_reporter(rt: Any, gid: str, seq: int) -> Callable[[int], Any]:
    """What tells the coordinator that the stream reached the device-path
    call ``(gid, seq)`` at a moment of this host's clock, on the rank's
    dilated clock: the call's arrival with the reach in it where it waits for
    it (``RankRuntime.defer_arrival``), else a ``Reached``."""
    key = (gid, seq)
    return lambda at: rt.reached(key, at)


def _release_gpu(pending: _Op) -> None:
    """Let a device-path call's stream go on (``prism.rank.devicepath``)."""
    if pending.release_flag is not None:
        rel, slot, value = pending.release_flag
        rel.release(slot, value)


def _hold_until(release_ns: int) -> None:
    """An emulation's coordinator sends a result a little before the emulated
    job completes the call, with that moment (this rank's monotonic clock):
    the completion thread holds it until then, to well under a millisecond
    (the coordinator's timers are not that fine). Results come in release
    order, so holding one never delays an earlier one."""
    if not release_ns:
        return
    while (left := release_ns - time.monotonic_ns()) > 0:
        time.sleep(left / 1e9 if left > 200_000 else 0)


# --- registration ----------------------------------------------------------------


def _create_prism_pg(dist_opts: Any, backend_opts: Any) -> PrismProcessGroup:
    rt = _rt.current()
    members = list(dist_opts.global_ranks_in_group)
    name = str(dist_opts.group_id)
    if not members:  # torch passes no ranks for WORLD
        members = list(range(dist_opts.group_size))
        index = 0
    elif name.isdigit():
        # torch numbers groups by creation on every rank, members or not.
        index = int(name)
    else:
        # Hashed names (use_local_synchronization=True) skip torch's counter;
        # this rank's own count is the best available.
        index = 1 + rt.groups_created
    rt.groups_created += 1
    gid = _group_id(index, members)
    pg = PrismProcessGroup(dist_opts.group_rank, dist_opts.group_size, members, gid, index, name)
    rt.client.send(protocol.GroupCreate(rank=rt.rank, gid=gid, index=index, ranks=tuple(members), name=name))
    rt.recorder.emit(trace.GroupCreated(gid=gid, ranks=tuple(members), index=index, name=name,
                                        t_ns=time.monotonic_ns()))
    return pg


def register() -> None:
    """Register backend ``"prism"`` with torch.distributed (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_prism_pg, extended_api=True, devices=["cpu", "cuda"])
