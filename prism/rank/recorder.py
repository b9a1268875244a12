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
        self._segment_start: int | None = None
        self.closed = False

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

    def start_segment(self, t_ns: int) -> None:
        """User code starts running with a slot (after init)."""
        with self._lock:
            if self._in_comm == 0:
                self._segment_start = t_ns

    def comm_enter(self, t_ns: int) -> None:
        """A communication call (issue or wait) starts: the segment ends."""
        with self._lock:
            if self._in_comm == 0:
                self._close_segment(t_ns)
            self._in_comm += 1

    def comm_exit(self, t_ns: int) -> None:
        """A communication call returns to user code."""
        with self._lock:
            self._in_comm -= 1
            if self._in_comm == 0:
                self._segment_start = t_ns

    def end_step(self, end_ns: int) -> None:
        """The iteration ended at ``end_ns``: emit it and cut the segment."""
        with self._lock:
            if self._in_comm == 0 and self._segment_start is not None:
                self._close_segment(end_ns)
                self._segment_start = end_ns
            self.emit(trace.Iteration(step=self.step, end_ns=end_ns))
            self.step += 1
            self._flush_locked()

    def _close_segment(self, t_ns: int) -> None:
        start, self._segment_start = self._segment_start, None
        if start is not None and t_ns > start:
            self.emit(trace.Compute(start_ns=start, end_ns=t_ns, step=self.step))

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
