"""The rank's trace recorder: PrismTrace events built in the rank, shipped to
the coordinator in ``TraceRecords`` batches.

The coordinator writes the files, so a rank that crashes later loses at most
the batch it had not sent yet; batches go out when they are large, when they
are old (checked on each event), at each iteration end, before the rank blocks
and at exit.

Times are ``time.monotonic_ns()`` of this process. Compute segments are the
time the rank spends outside communication calls while holding its slot: a
segment ends when a communication call (issue or wait) starts and the next one
begins when the last call in flight returns to user code; blocked time, slot
waits included, is never compute time. Segments are also cut at iteration
ends so each carries one step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from prism.core import trace
from prism.core.protocol import TraceRecords

#: A batch goes out when it holds this many events (or bytes), or when its
#: oldest event is older than ``MAX_BATCH_AGE_NS``: large enough that a busy
#: rank sends a few messages per second, small enough that a crash loses little.
MAX_BATCH_EVENTS = 512
MAX_BATCH_BYTES = 1 << 20
MAX_BATCH_AGE_NS = 500_000_000


class RankRecorder:
    """Builds this rank's PrismTrace events and ships them as ``TraceRecords``.

    ``send`` is the transport's thread-safe send (``BlockingClient.send``).
    Thread-safe: communication calls may come from autograd's threads.
    """

    def __init__(self, rank: int, send: Callable[[Any], None], *, small_tensor_limit: int) -> None:
        self.rank = rank
        self.small_tensor_limit = small_tensor_limit
        self._send = send
        self._lock = threading.RLock()
        self._batch: list[bytes] = []
        self._batch_bytes = 0
        self._batch_started_ns = 0
        #: Iteration (0-based) that is running now.
        self.step = 0
        self._in_comm = 0
        #: When the outermost call in progress started, where that call is
        #: torch.distributed's Python front end (``PRISM_FRONT_END_IN_COMM``):
        #: the backend's calls inside it start then too.
        self._front_start: int | None = None
        self._segment_start: int | None = None
        self.closed = False
        #: GPU ranks: per-segment two-clock timing (``attach_gpu``).
        self.gpu: Any = None
        #: CPU ranks: the main thread's CPU clock (the user's code runs there),
        #: read at each segment's ends for ``Compute.thread_cpu_ns``; None
        #: where the platform has no per-thread CPU clocks.
        try:
            self._cpu_clock: int | None = time.pthread_getcpuclockid(threading.main_thread().ident)
            time.clock_gettime_ns(self._cpu_clock)
        except (AttributeError, OSError, TypeError):
            self._cpu_clock = None
        self._segment_cpu = -1

    # --- events ------------------------------------------------------------

    def emit(self, ev: Any) -> None:
        """Queue one event; sends the batch when it is full or old."""
        line = trace.encode_event(ev)
        with self._lock:
            if self.closed:
                return
            now = time.monotonic_ns()
            if not self._batch:
                self._batch_started_ns = now
            self._batch.append(line)
            self._batch_bytes += len(line)
            if (
                len(self._batch) >= MAX_BATCH_EVENTS
                or self._batch_bytes >= MAX_BATCH_BYTES
                or now - self._batch_started_ns >= MAX_BATCH_AGE_NS
            ):
                self._flush_locked()

    def flush(self) -> None:
        """Send whatever is queued."""
        with self._lock:
            self._flush_locked()

    def flush_if_old(self, age_ns: int) -> None:
        """Send the batch if its oldest event is older than ``age_ns`` (cheap
        enough to call before every block)."""
        with self._lock:
            if self._batch and time.monotonic_ns() - self._batch_started_ns >= age_ns:
                self._flush_locked()

    def _flush_locked(self) -> None:
        if not self._batch:
            return
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        self._send(TraceRecords(rank=self.rank, payloads=tuple(batch)))

    # --- compute segments -------------------------------------------------

    def attach_gpu(self, gpu: Any) -> None:
        """Record two clocks per segment with ``gpu`` (a ``prism.rank.gputime.GpuTiming``)."""
        self.gpu = gpu
        gpu.on_script_sync = self.script_sync

    def _open(self, t_ns: int, after_comm: bool = False) -> None:
        if self.gpu is not None:
            # waits for the rank's turn on a shared GPU; the segment starts then
            t_ns = max(t_ns, self.gpu.open(self.step, after_comm))
        self._segment_start = t_ns
        self._segment_cpu = self._thread_cpu()

    def _thread_cpu(self) -> int:
        """The main thread's CPU time (ns), or -1 (GPU ranks, no such clock)."""
        if self.gpu is not None or self._cpu_clock is None:
            return -1
        try:
            return time.clock_gettime_ns(self._cpu_clock)
        except OSError:  # the main thread is gone
            return -1

    def start_segment(self, t_ns: int) -> None:
        """User code starts running with a slot (after init)."""
        with self._lock:
            if self._in_comm == 0:
                self._open(t_ns)

    def comm_enter(self, t_ns: int | None = None, *, settle: bool = True, front_end: bool = False) -> int:
        """A communication call (issue or wait) starts: the segment ends.

        On a GPU rank the GPU's queued work is waited for first (``settle``;
        the stall monitor, which acts for the main thread at a past time,
        passes False). Returns the call's start: ``t_ns``, or when omitted
        the time after that wait; inside a ``front_end`` call (torch's
        Python front end counted in the call) the front end's start, so the
        backend's call starts where the compute before it ended."""
        with self._lock:
            if self._in_comm == 0:
                t_ns = self._close_segment(t_ns, settle=settle)
                self._front_start = t_ns if front_end else None
            elif t_ns is None:
                t_ns = self._front_start if self._front_start is not None else time.monotonic_ns()
            self._in_comm += 1
            return t_ns

    def comm_exit(self, t_ns: int) -> None:
        """A communication call returns to user code."""
        with self._lock:
            self._in_comm -= 1
            if self._in_comm == 0:
                self._front_start = None
                self._open(t_ns, after_comm=True)

    def script_sync(self, t_ns: int) -> None:
        """The script waited for the GPU (GPU ranks): cut a joining segment."""
        with self._lock:
            if self._in_comm == 0 and self._segment_start is not None and not self.closed:
                end = self._close_segment(t_ns, script_join=True)
                self._open(end)

    def end_step(self, end_ns: int, *, extra: Callable[[int, int], Any] | None = None,
                 resume_clock: Callable[[], int] | None = None) -> int:
        """The iteration ended at ``end_ns``: emit it and cut the segment.

        On a GPU rank the step ends when its GPU work does (as a step clock
        that synchronises the device sees it); returns the end used.
        ``extra(end, step)`` may return one more event for the step (its
        memory sample). The batch goes out before the next segment opens: at
        ``resume_clock()`` when given (the rank's clock), so Prism's own work
        here (the sample, encoding and sending the batch, ~1 ms per step on the
        2-core VM) is no compute of the next step; without it at ``end_ns``."""
        with self._lock:
            cut = self._in_comm == 0 and self._segment_start is not None
            if cut:
                end_ns = self._close_segment(end_ns if self.gpu is None else None, step_end=True)
            step = self.step
            self.emit(trace.Iteration(step=step, end_ns=end_ns))
            self.step += 1
            try:
                ev = extra(end_ns, step) if extra is not None else None
                if ev is not None:
                    self.emit(ev)
                self._flush_locked()
            finally:  # the next step's compute is recorded whatever happened here
                if cut:
                    self._open(end_ns if resume_clock is None else max(end_ns, resume_clock()))
            return end_ns

    def _close_segment(self, t_ns: int | None, *, settle: bool = True, script_join: bool = False,
                       step_end: bool = False) -> int:
        start, self._segment_start = self._segment_start, None
        gpu = self.gpu
        if gpu is None or start is None:
            if t_ns is None:
                t_ns = time.monotonic_ns()
            if start is not None and t_ns > start:
                cpu0, cpu1 = self._segment_cpu, self._thread_cpu()
                used = cpu1 - cpu0 if cpu0 >= 0 and cpu1 >= cpu0 else -1
                self.emit(trace.Compute(start_ns=start, end_ns=t_ns, step=self.step, thread_cpu_ns=used))
            return t_ns
        free_ns, cold_ns = -1, 0
        if settle or script_join:
            _, end, cpu_ns, gpu_ns, free_ns, cold_ns = gpu.close(start, script_join)
        else:
            end = t_ns if t_ns is not None else time.monotonic_ns()
            cpu_ns, gpu_ns = max(end - start, 0), -1
            gpu.disarm()
        if end > start:
            self.emit(trace.Compute(start_ns=start, end_ns=end, step=self.step, cpu_ns=cpu_ns, gpu_ns=gpu_ns,
                                    join=script_join or step_end, free_ns=free_ns, cold_ns=cold_ns))
        return end

    def finish(self, t_ns: int, status: str, message: str = "") -> None:
        """Close the last segment, emit RankEnd and flush; later events are dropped."""
        with self._lock:
            if self.closed:
                return
            if self._in_comm == 0:
                self._close_segment(t_ns)
            self.emit(trace.RankEnd(t_ns=t_ns, status=status, message=message))
            self._flush_locked()
            self.closed = True
