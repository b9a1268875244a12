"""The rank process's end of the transport: a blocking client, no trio.

A rank process runs the user's training script on its main thread, so the
client cannot own an event loop. A background I/O thread resolves
``concurrent.futures.Future`` objects as replies arrive, so an asynchronous
collective completes while the main thread computes.

ZeroMQ sockets are not thread-safe, but one may pass between threads under a
lock (a full memory barrier). Handing every message to the I/O thread would
cost two thread wake-ups per round trip, so the socket goes to whichever
thread holds the I/O lock (leader/followers): ``send`` sends directly when the
lock is free and otherwise queues the frames and wakes the I/O thread through
a pipe; a thread waiting in ``result()`` receives and dispatches replies
itself while nobody else needs the socket. Every holder re-reads
``zmq.EVENTS`` before letting go (the socket's descriptor is edge-triggered,
and any operation may swallow its edge) and wakes the I/O thread if work is
left.

Replies are matched to waiters by ``protocol.routing_key``. An ``Error`` or
``Shutdown`` from the coordinator, or the loss of the coordinator, fails every
pending and every later future, so no rank ever waits forever on a dead run.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
import types
from pathlib import Path
from collections.abc import Callable, Hashable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from prism.core import protocol
from prism.core.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Error,
    Hello,
    Message,
    ProtocolError,
    Shutdown,
    VersionMismatch,
    Welcome,
)

from ._frames import EVENTS as _EVENTS
from ._frames import POLLIN as _POLLIN
from ._frames import POLLOUT as _POLLOUT
from ._frames import recv_frames, send_frames
from .curve import HANDSHAKE_FAILED_EVENTS

__all__ = [
    "BlockingClient",
    "CoordinatorError",
    "CoordinatorLost",
    "HandshakeRefused",
]

log = logging.getLogger(__name__)

#: ZMTP heartbeats (answered by the peer's ZeroMQ I/O thread, so a busy
#: coordinator still answers): ping every second, declare the coordinator lost
#: after 10 s of silence, as a dead host or a killed process, not a slow one.
DEFAULT_HEARTBEAT_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0

_WELCOME_KEY = ("welcome",)
#: What ``send`` returns when ZeroMQ copied the payloads at once.
_SENT: concurrent.futures.Future[None] = concurrent.futures.Future()
_SENT.set_result(None)


class CoordinatorError(Exception):
    """The coordinator reported a failure (``msg`` is its ``Error`` or
    ``Shutdown``); whose fault it is depends on ``msg.code`` (see
    docs/PROTOCOL.md). Raised by every pending and later future."""

    def __init__(self, msg: Error | Shutdown, endpoint: str) -> None:
        super().__init__(msg, endpoint)
        self.msg = msg
        self.endpoint = endpoint

    def __str__(self) -> str:
        if isinstance(self.msg, Shutdown):
            return f"the coordinator at {self.endpoint} shut the run down: {self.msg.reason}"
        return f"{self.msg.message} [error {self.msg.code!r} from the coordinator at {self.endpoint}]"


class CoordinatorLost(CoordinatorError, ConnectionError):
    """The coordinator went away, never answered, or sent bytes this client
    cannot read. ``msg`` is an ``Error`` made by the client (code "lost",
    "unreachable" or "bad_message"), never one received."""


class HandshakeRefused(CoordinatorError, ConnectionError):
    """The coordinator refused this rank's ``Hello`` (e.g. another protocol
    version); ``msg`` is the coordinator's ``Error``."""


def _set_result(fut: concurrent.futures.Future, value: Any) -> None:
    # The caller may have cancelled the future meanwhile; that is not an error.
    try:
        fut.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass


def _set_exception(fut: concurrent.futures.Future, exc: BaseException) -> None:
    try:
        fut.set_exception(exc)
    except concurrent.futures.InvalidStateError:
        pass


#: How long a thread waiting in ``result()`` polls the socket itself before
#: it looks again whether the I/O thread needs the socket.
_LEAD_POLL_MS = 20
#: How long the I/O thread looks away from the socket while another thread
#: receives on it (the most a reply can wait when nobody waits for it).
_ASIDE_MS = 1


class _Reply(concurrent.futures.Future):
    """A future whose waiter receives replies itself while the socket is free."""

    def __init__(self, client: BlockingClient) -> None:
        super().__init__()
        self._client = client

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            timeout = self._client._wait_here(self, timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            timeout = self._client._wait_here(self, timeout)
        return super().exception(timeout)


class BlockingClient:
    """A rank's connection to the coordinator, usable from any thread.

    Open it with ``BlockingClient.connect`` (which does the handshake). Then
    ``send`` messages and wait on ``future(key)`` for the replies.
    ``on_error(msg)`` is called once with the ``Error`` or ``Shutdown`` that
    failed the client (for a lost coordinator an ``Error`` with code "lost"
    made by the client). It and the futures' done-callbacks run in the thread
    that received the reply (the I/O thread, or one waiting in ``result()``)
    and must not block.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        context: zmq.Context | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        on_error: Callable[[Error | Shutdown], None] | None = None,
        curve_keys: str | os.PathLike[str] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.max_message_bytes = max_message_bytes
        self._on_error = on_error
        ctx = context or zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout_s * 1000))
        self._curve_keys = curve_keys
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                                                | HANDSHAKE_FAILED_EVENTS)
        if curve_keys is not None:
            # A coordinator served through ``prism agent``: CURVE with the keys by path.
            from .curve import connect_curve

            connect_curve(sock, curve_keys)
        sock.connect(endpoint)
        self._sock = sock
        self._fd: int = sock.getsockopt(zmq.FD)
        self._copy_threshold: int = sock.copy_threshold
        # Whoever holds _io_lock may use _sock, _blocked and _trackers.
        self._io_lock = threading.Lock()
        self._io_waiting = False
        self._io_done = False
        #: Frames ZeroMQ could not take yet (its send queue was full).
        self._blocked: collections.deque[tuple[list[Any], concurrent.futures.Future | None]] = (
            collections.deque()
        )
        self._trackers: list[tuple[zmq.MessageTracker, concurrent.futures.Future]] = []
        self._lead_poller = zmq.Poller()
        self._lead_poller.register(sock, zmq.POLLIN)

        self._lock = threading.Lock()
        self._waiting: dict[Hashable, concurrent.futures.Future] = {}
        self._early: dict[Hashable, collections.deque[Message]] = {}
        self._failure: CoordinatorError | None = None
        self._outbox: collections.deque[tuple[list[Any], concurrent.futures.Future | None]] = (
            collections.deque()
        )
        self._closing = False
        self._linger_ms = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lead_poller.register(self._wake_r, zmq.POLLIN)
        self._thread = threading.Thread(
            target=self._run, name=f"prism-io {endpoint}", daemon=True
        )
        self._thread.start()

    @classmethod
    def connect(
        cls,
        endpoint: str,
        hello: Hello,
        *,
        timeout: float = 30.0,
        context: zmq.Context | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        on_error: Callable[[Error | Shutdown], None] | None = None,
        curve_keys: str | os.PathLike[str] | None = None,
    ) -> tuple[BlockingClient, Welcome]:
        """Connect to the coordinator at ``endpoint``, send ``hello`` and wait
        up to ``timeout`` seconds for its ``Welcome``.

        Raises ``HandshakeRefused`` with the coordinator's message when it
        answers ``Error`` (e.g. a protocol version mismatch), and
        ``CoordinatorLost`` when nothing answers in time.
        """
        client = cls(
            endpoint,
            context=context,
            max_message_bytes=max_message_bytes,
            heartbeat_s=heartbeat_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            on_error=on_error,
            curve_keys=curve_keys,
        )
        try:
            welcome_future = client.future(_WELCOME_KEY)
            client.send(hello)
            try:
                welcome = welcome_future.result(timeout)
            except concurrent.futures.TimeoutError:
                raise CoordinatorLost(
                    Error(
                        code="unreachable",
                        message=(
                            f"rank {hello.rank}: no Welcome from the coordinator at {endpoint} "
                            f"within {timeout:g} s; is `python -m prism coordinator` running and "
                            "listening there (same --endpoint)?"
                        ),
                        rank=hello.rank,
                    ),
                    endpoint,
                ) from None
            except CoordinatorLost:
                raise
            except CoordinatorError as e:
                raise HandshakeRefused(e.msg, endpoint) from None
        except BaseException:
            client.close(linger=0)
            raise
        return client, welcome

    # --- API for any thread --------------------------------------------------

    def send(self, msg: Message) -> concurrent.futures.Future[None]:
        """Send ``msg`` to the coordinator; thread-safe, never blocks. It
        sends on the calling thread when the socket is free (and then also
        dispatches replies that arrived meanwhile), else queues for the I/O
        thread.

        Payloads of ``copy_threshold`` bytes or more (64 KiB) are sent without
        copying: the returned future completes once ZeroMQ no longer reads
        them, and until then the caller must not modify them. Smaller ones are
        copied here, and the future is already done.
        """
        if self._closing:
            raise RuntimeError(f"send({type(msg).__name__}) on a closed BlockingClient ({self.endpoint})")
        return self.send_frames(protocol.encode(msg, max_bytes=self.max_message_bytes))

    def send_frames(self, frames: list[Any]) -> concurrent.futures.Future[None]:
        """``send`` of a message already encoded (``protocol.encode``'s frames:
        a caller that sends many alike keeps their header and fills in what
        changes, as a GPU sandbox's device path does)."""
        if self._closing:
            raise RuntimeError(f"send_frames on a closed BlockingClient ({self.endpoint})")
        tracked = any(memoryview(f).nbytes >= self._copy_threshold for f in frames[1:])
        if tracked:
            sent: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._outbox.append((frames, sent))
        else:
            sent = _SENT
            self._outbox.append(([f if isinstance(f, bytes) else bytes(f) for f in frames], None))
        if self._io_lock.acquire(blocking=False):
            try:
                if not self._io_done:
                    self._send_queued()
            finally:
                self._release_io()
            if tracked:
                self._wake()  # the I/O thread watches the tracker
        else:
            self._wake()
        return sent

    def future(self, key: Hashable) -> concurrent.futures.Future[Message]:
        """A future for the reply ``r`` with ``protocol.routing_key(r) == key``
        (a reply that already arrived is delivered at once). It fails with
        ``CoordinatorError`` once the client has failed; ``close`` cancels it.
        """
        fut = _Reply(self)
        with self._lock:
            early = self._early.get(key)
            if early:
                msg = early.popleft()
                if not early:
                    del self._early[key]
                fut.set_result(msg)
                return fut
            if self._failure is not None:
                fut.set_exception(self._failure)
                return fut
            if self._closing:
                fut.cancel()
                return fut
            if key in self._waiting:
                raise ValueError(
                    f"a future for {key!r} is already registered on this BlockingClient: "
                    "each reply is delivered once, so wait on the first future"
                )
            self._waiting[key] = fut
        return fut

    @property
    def failure(self) -> CoordinatorError | None:
        """Why the client failed, or None while it works."""
        return self._failure

    def close(self, linger: float = 5.0) -> None:
        """Send what is queued (for up to ``linger`` seconds), close the socket
        and join the I/O thread; pending futures are cancelled. Sends nothing
        by itself: send ``Goodbye`` first."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._linger_ms = int(linger * 1000)
        self._wake()
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.close()

    # --- the I/O thread ------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def _fail(self, exc: CoordinatorError) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = exc
            waiting = list(self._waiting.values())
            self._waiting.clear()
        for fut in waiting:
            _set_exception(fut, exc)
        if self._on_error is not None:
            try:
                self._on_error(exc.msg)
            except Exception:
                log.exception("on_error callback of the BlockingClient for %s failed", self.endpoint)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, (Error, Shutdown)):
            self._fail(CoordinatorError(msg, self.endpoint))
            return
        key = protocol.routing_key(msg)
        if key is None:
            self._fail(
                CoordinatorError(
                    Error(
                        code="bad_message",
                        message=(
                            f"the coordinator sent a {type(msg).__name__} message, which ranks "
                            "never receive: a Prism bug, please report it"
                        ),
                    ),
                    self.endpoint,
                )
            )
            return
        with self._lock:
            fut = self._waiting.pop(key, None)
            if fut is None:
                self._early.setdefault(key, collections.deque()).append(msg)
                return
        _set_result(fut, msg)

    # --- whoever holds _io_lock ---------------------------------------------

    def _send_queued(self) -> None:
        sock = self._sock
        while self._outbox:
            self._blocked.append(self._outbox.popleft())
        while self._blocked:
            frames, sent = self._blocked[0]
            try:
                tracker = send_frames(sock, frames, copy=False, track=sent is not None)
            except zmq.Again:
                return
            self._blocked.popleft()
            if sent is not None:
                self._trackers.append((tracker, sent))

    def _recv_all(self) -> int:
        """Receive and dispatch what is queued; returns ``zmq.EVENTS`` as last
        read, which no socket operation has made stale."""
        sock = self._sock
        # Ask EVENTS rather than end on zmq.Again, which costs more in pyzmq.
        while True:
            events: int = sock.getsockopt(_EVENTS)
            if not events & _POLLIN:
                return events
            frames = recv_frames(sock)
            try:
                msg = protocol.decode(frames, max_bytes=self.max_message_bytes)
            except VersionMismatch as e:
                self._fail(CoordinatorLost(Error(code="version", message=str(e)), self.endpoint))
                continue
            except ProtocolError as e:
                self._fail(
                    CoordinatorLost(
                        Error(
                            code="bad_message",
                            message=f"malformed message from the coordinator ({e}): a Prism bug, please report it",
                        ),
                        self.endpoint,
                    )
                )
                continue
            self._dispatch(msg)

    def _release_io(self, events: int | None = None) -> None:
        """Let go of the socket, first taking what arrived (waking the I/O
        thread for it would cost more than dispatching it here); wake the I/O
        thread if sends are left that no descriptor edge will announce.
        ``events``: a fresh ``_recv_all`` result, if the caller has one."""
        pending = False
        if not self._io_done:
            if events is None:
                events = self._recv_all()
            pending = bool((self._blocked and events & _POLLOUT) or self._outbox)
        self._io_lock.release()
        if pending:
            self._wake()

    def _wait_here(self, fut: concurrent.futures.Future, timeout: float | None) -> float | None:
        """Receive on the calling thread until ``fut`` is done, while no other
        thread needs the socket; returns the timeout left for the caller."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not fut.done() and not self._io_waiting and not self._closing:
            wait_ms = _LEAD_POLL_MS
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wait_ms = min(wait_ms, max(1, int(left * 1000)))
            if not self._io_lock.acquire(blocking=False):
                break
            events = None
            try:
                if self._io_done:
                    break
                self._send_queued()
                if fut.done() or self._blocked or self._outbox:
                    break
                # zmq_poll looks at EVENTS first, so a reply that is already
                # queued returns at once.
                ready = dict(self._lead_poller.poll(wait_ms))
                events = self._recv_all()
                if self._wake_r in ready:
                    break  # a wake-up for the I/O thread: let it take over
            finally:
                self._release_io(events)
        if deadline is None:
            return None
        return max(0.0, deadline - time.monotonic())

    def _check_monitor(self, handshaken: bool) -> bool:
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return handshaken
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                handshaken = True
            elif event["event"] & HANDSHAKE_FAILED_EVENTS and not handshaken and not self._closing:
                # A CURVE server that refuses our keys (or wants some): say so
                # now instead of waiting out the Welcome's timeout.
                from .curve import handshake_text

                keys = self._curve_keys
                text = handshake_text("the coordinator", self.endpoint, event["event"],
                                      None if keys is None else Path(keys))
                self._fail(CoordinatorLost(Error(code="unreachable", message=text), self.endpoint))
            elif event["event"] == zmq.EVENT_DISCONNECTED and handshaken and not self._closing:
                self._fail(
                    CoordinatorLost(
                        Error(
                            code="lost",
                            message=(
                                f"lost the connection to the coordinator at {self.endpoint} "
                                "(it exited, or sent no heartbeat for too long); see the "
                                "coordinator's log for why"
                            ),
                        ),
                        self.endpoint,
                    )
                )

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:
            self._fail(
                CoordinatorLost(
                    Error(
                        code="internal",
                        message=f"the transport's I/O thread failed ({e!r}): a Prism bug, please report it",
                    ),
                    self.endpoint,
                )
            )
            log.exception("I/O thread of the BlockingClient for %s failed", self.endpoint)
        finally:
            with self._lock:
                self._closing = True
                waiting = list(self._waiting.values())
                self._waiting.clear()
            for fut in waiting:
                fut.cancel()
            with self._io_lock:
                self._io_done = True
                for _frames, sent in self._blocked:
                    if sent is not None:
                        sent.cancel()
                for _tracker, sent in self._trackers:
                    sent.cancel()
                self._sock.disable_monitor()
                self._monitor.close(linger=0)
                self._sock.close(linger=self._linger_ms)

    def _loop(self) -> None:
        poller = zmq.Poller()
        # The raw descriptor, not the socket: another thread may be using
        # the socket meanwhile, and watching a descriptor touches nothing.
        poller.register(self._fd, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        # While a thread waiting in result() holds the socket, watch only the
        # pipe and the monitor: that thread takes the replies, and waking for
        # each of them would make the two threads fight over the GIL.
        aside = zmq.Poller()
        aside.register(self._wake_r, zmq.POLLIN)
        aside.register(self._monitor, zmq.POLLIN)
        handshaken = False
        again = False
        while True:
            # Trackers complete in ZeroMQ's threads with no wake-up for us:
            # look at them every millisecond while any is pending.
            timeout = 0 if again else (1 if self._trackers else None)
            ready = dict(poller.poll(timeout))
            woken = self._wake_r in ready
            if woken:
                try:
                    os.read(self._wake_r, 65536)
                except BlockingIOError:
                    pass
            if self._monitor in ready:
                handshaken = self._check_monitor(handshaken)
            closing = self._closing
            if not self._io_lock.acquire(blocking=False):
                if not (woken or closing or self._trackers):
                    # The waiting thread wakes us (the pipe) when it leaves
                    # work behind; a reply that comes after it left is seen
                    # within _ASIDE_MS.
                    aside.poll(_ASIDE_MS)
                    again = False
                    continue
                self._io_waiting = True
                self._io_lock.acquire()
                self._io_waiting = False
            try:
                self._send_queued()
                self._recv_all()
                if self._trackers:
                    still = []
                    for tracker, sent in self._trackers:
                        if tracker.done:
                            _set_result(sent, None)
                        else:
                            still.append((tracker, sent))
                    self._trackers = still
                if closing:
                    return
                events = self._recv_all()
                again = bool(self._blocked and events & _POLLOUT)
            finally:
                self._io_lock.release()
