"""A ZeroMQ socket for trio (no maintained integration exists).

ZeroMQ hands out one file descriptor per socket (``zmq.FD``) that becomes
readable when the socket's state *may* have changed, edge-triggered: once
ZeroMQ has processed its internal commands (which any send, recv or
``getsockopt(EVENTS)`` may do), the descriptor stays quiet even though a
message is waiting. So the rules are: receive only when ``zmq.EVENTS`` says
a message is queued, send without blocking and read ``zmq.EVENTS`` on
``zmq.Again``, and park on the descriptor only when no event is pending. A send and a receive may wait at once, but trio lets only
one task park on a descriptor; the first to wait parks (the *watcher*), the
other waits for the watcher to wake, and every send or recv that might have
swallowed the watcher's edge re-reads ``EVENTS`` and wakes it when needed.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import trio
import zmq

from prism.core import protocol
from prism.core.protocol import DEFAULT_MAX_MESSAGE_BYTES, Message, ProtocolError

from ._frames import EVENTS as _EVENTS
from ._frames import POLLIN as _POLLIN
from ._frames import POLLOUT as _POLLOUT
from ._frames import recv_frames, send_frames
from .endpoints import check_listen_endpoint

__all__ = ["AsyncSocket"]

_ROUTED = {zmq.ROUTER}


class _Owner:
    """Raise ``BusyResourceError`` when a second task uses one direction."""

    __slots__ = ("_busy", "_what")

    def __init__(self, what: str) -> None:
        self._busy = False
        self._what = what

    def __enter__(self) -> None:
        if self._busy:
            raise trio.BusyResourceError(
                f"another task is already {self._what} on this socket: a ZeroMQ socket "
                "has one receiving and one sending task; fan messages out to other "
                "tasks through a trio memory channel"
            )
        self._busy = True

    def __exit__(self, *exc: object) -> None:
        self._busy = False


class AsyncSocket:
    """A ``zmq.Socket`` driven from trio: one receiving task and one sending
    task at a time, both cancellable; messages are Prism protocol messages or
    raw multipart frames.

    Create with ``AsyncSocket.create(zmq.ROUTER)`` (a socket of the shared
    ``zmq.Context.instance()``) or wrap an existing non-blocking-capable
    socket. ``max_message_bytes`` bounds each inbound frame (``zmq.MAXMSGSIZE``,
    enforced by ZeroMQ, which drops the connection of a peer that exceeds it)
    and each decoded message.
    """

    def __init__(
        self, sock: zmq.Socket, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> None:
        self.socket = sock
        self.max_message_bytes = max_message_bytes
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._fd: int = sock.getsockopt(zmq.FD)
        self._routed = sock.type in _ROUTED
        self._closed = False
        self._recv_owner = _Owner("receiving")
        self._send_owner = _Owner("sending")
        # The watcher parks on the descriptor; the other direction waits on
        # _wake (see _park). _watching: the POLLIN/POLLOUT bit the watcher needs.
        self._watch_scope: trio.CancelScope | None = None
        self._watching = 0
        self._wake = trio.Event()
        self._wake_wanted = False

    @classmethod
    def create(
        cls,
        socket_type: int,
        *,
        context: zmq.Context | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        linger_s: float = 0.0,
    ) -> AsyncSocket:
        """A new socket of ``socket_type`` (``zmq.ROUTER``, ``zmq.DEALER`` ...)
        in ``context`` (default: the shared ``zmq.Context.instance()``)."""
        sock = (context or zmq.Context.instance()).socket(socket_type)
        sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
        return cls(sock, max_message_bytes=max_message_bytes)

    def bind(self, endpoint: str, *, authenticated: bool = False) -> str:
        """Listen on ``endpoint`` after the endpoint policy
        (``check_listen_endpoint``); returns the bound address (a ``:*`` port
        resolved to the port chosen)."""
        check_listen_endpoint(endpoint, authenticated=authenticated)
        self.socket.bind(endpoint)
        return self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, endpoint: str) -> None:
        """Connect to ``endpoint`` (ZeroMQ connects in the background)."""
        self.socket.connect(endpoint)

    # --- waiting on the edge-triggered descriptor ------------------------

    async def _park(self, flag: int, events: int) -> None:
        """Wait once for the socket's state to change (``events``: EVENTS as
        just read, without ``flag``); the caller reads EVENTS again."""
        if self._watch_scope is not None:
            # The other direction is parked on the descriptor. Reading EVENTS
            # may just have swallowed its edge: wake it if its event is due,
            # then wait until it has looked again.
            if events & self._watching:
                self._watch_scope.cancel()
            self._wake_wanted = True
            await self._wake.wait()
            return
        self._watching = flag
        with trio.CancelScope() as scope:
            self._watch_scope = scope
            try:
                await trio.lowlevel.wait_readable(self._fd)
            finally:
                self._watch_scope = None
                self._watching = 0
                if self._wake_wanted:
                    self._wake_wanted = False
                    self._wake.set()
                    self._wake = trio.Event()

    def _after_op(self) -> None:
        """A send or recv may have consumed the descriptor's edge: if a task
        is parked on it, read EVENTS for it and wake it if its event is due."""
        if self._watch_scope is not None and (
            self.socket.getsockopt(_EVENTS) & self._watching
        ):
            self._watch_scope.cancel()

    # --- frames ----------------------------------------------------------

    async def send_multipart(
        self, frames: Sequence[object], copy: bool = False, track: bool = False
    ) -> zmq.MessageTracker | None:
        """Send one multipart message; with ``copy=False`` payload buffers are
        sent without copying and must not change until ZeroMQ is done with
        them (``track=True`` returns a ``zmq.MessageTracker`` that says when).
        """
        with self._send_owner:
            await trio.lowlevel.checkpoint_if_cancelled()
            waited = False
            while True:
                if self._closed:
                    raise trio.ClosedResourceError("this AsyncSocket was closed")
                try:
                    tracker = send_frames(self.socket, frames, copy=copy, track=track)
                except zmq.Again:
                    events = self.socket.getsockopt(_EVENTS)
                    if not events & _POLLOUT:
                        await self._park(_POLLOUT, events)
                        waited = True
                    continue
                self._after_op()
                # A call that waited has yielded already: one schedule point
                # per call is the contract, a second one only costs latency.
                if not waited:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return tracker

    def send_multipart_nowait(
        self, frames: Sequence[object], copy: bool = False, track: bool = False
    ) -> zmq.MessageTracker | None:
        """``send_multipart`` without waiting or yielding: ``trio.WouldBlock``
        if ZeroMQ's queue is full (a ROUTER never is: it drops messages to
        a peer whose queue is full, as ZeroMQ documents)."""
        with self._send_owner:
            if self._closed:
                raise trio.ClosedResourceError("this AsyncSocket was closed")
            try:
                tracker = send_frames(self.socket, frames, copy=copy, track=track)
            except zmq.Again:
                raise trio.WouldBlock from None
            self._after_op()
            return tracker

    async def recv_multipart(self, copy: bool = False) -> list[zmq.Frame] | list[bytes]:
        """Receive one whole multipart message (``zmq.Frame`` objects with
        ``copy=False``, ``bytes`` with ``copy=True``)."""
        with self._recv_owner:
            await trio.lowlevel.checkpoint_if_cancelled()
            waited = False
            while True:
                if self._closed:
                    raise trio.ClosedResourceError("this AsyncSocket was closed")
                # Ask EVENTS before receiving: an empty socket is the common
                # case, and pyzmq's zmq.Again costs more than the question.
                events = self.socket.getsockopt(_EVENTS)
                if not events & _POLLIN:
                    await self._park(_POLLIN, events)
                    waited = True
                    continue
                try:
                    frames = recv_frames(self.socket)
                except zmq.Again:
                    continue
                self._after_op()
                if not waited:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return [f.bytes for f in frames] if copy else frames

    # --- messages --------------------------------------------------------

    async def send_message(self, msg: Message, identity: bytes | None = None) -> None:
        """Encode and send ``msg``; on a ROUTER ``identity`` names the peer."""
        await self.send_multipart(self._frames_for(msg, identity), copy=False)

    def send_message_nowait(self, msg: Message, identity: bytes | None = None) -> None:
        """``send_message`` without yielding (``trio.WouldBlock`` if the queue
        is full): for a coordinator answering many ranks at once, where one
        schedule point per reply would only add latency."""
        self.send_multipart_nowait(self._frames_for(msg, identity), copy=False)

    def _frames_for(self, msg: Message, identity: bytes | None) -> list[Any]:
        frames = protocol.encode(msg, max_bytes=self.max_message_bytes)
        if self._routed:
            if identity is None:
                raise ValueError(
                    f"sending {type(msg).__name__} on a ROUTER socket needs the peer's "
                    "identity (as returned by recv_message)"
                )
            frames = [identity, *frames]
        elif identity is not None:
            raise ValueError("only ROUTER sockets take an identity; pass identity=None")
        return frames

    async def recv_message(self) -> tuple[bytes | None, Message]:
        """The next message and its sender's identity (None unless ROUTER).

        A malformed message is consumed whole and raises ``ProtocolError``
        with ``identity`` set, so the caller can answer the peer with an
        ``Error`` and keep receiving.
        """
        frames = await self.recv_multipart(copy=False)
        identity: bytes | None = None
        if self._routed:
            identity = frames[0].bytes
            frames = frames[1:]
        try:
            return identity, protocol.decode(frames, max_bytes=self.max_message_bytes)
        except ProtocolError as e:
            e.identity = identity
            raise

    # --- lifetime --------------------------------------------------------

    def close(self, linger_s: float | None = None) -> None:
        """Close the socket; tasks waiting on it get ``ClosedResourceError``.
        ``linger_s``: how long ZeroMQ may keep sending queued messages (None:
        the socket's LINGER option)."""
        if self._closed:
            return
        self._closed = True
        try:
            trio.lowlevel.notify_closing(self._fd)
        except RuntimeError:
            pass  # closed outside trio, where nobody can wait on the descriptor
        self._wake.set()
        self.socket.close(linger=None if linger_s is None else int(linger_s * 1000))

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> AsyncSocket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> AsyncSocket:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.close()
