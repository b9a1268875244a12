"""In-memory transports for tests: a pair (as ``trio.testing.memory_stream_pair``)
and a ROUTER that many DEALER-like ends connect to.

``memory_pair()`` returns two ``MemorySocket`` ends with the message-level
interface of ``AsyncSocket`` (``send_message``, ``recv_message``, plus the raw
``send_multipart``/``recv_multipart``), so a coordinator loop written against
``AsyncSocket`` runs unchanged on it. Hooks make the fake network misbehave:
``delay(msg) -> seconds`` holds a message back (in order, as on one ZeroMQ
connection; use ``autojump_clock``), ``drop(msg) -> bool`` loses it, and
``codec=True`` (the default) sends every message through ``encode``/``decode``
with payloads copied, so codec bugs and aliasing show up in unit tests.

``MemoryRouter`` is the coordinator's side of a whole world: each
``connect(identity)`` returns a ``MemorySocket`` (the DEALER a rank holds),
and the router receives ``(identity, msg)`` from all of them and sends to
any by identity, as a ZeroMQ ROUTER does. Each connection keeps its own
order and its own hooks (a delay on one rank's messages holds back only
that rank's), and the router takes the earliest deliverable message of any
connection, oldest first, so runs under ``autojump_clock`` are
deterministic. A closed DEALER is a peer that vanished: what it sent before
still arrives, and messages to it are dropped, as ZeroMQ drops them.
"""

from __future__ import annotations

import itertools
import math
import types
from collections import deque
from collections.abc import Callable, Sequence

import trio

from prism.core import protocol
from prism.core.protocol import DEFAULT_MAX_MESSAGE_BYTES, Message, ProtocolError

from .trio_socket import _Owner

__all__ = ["MemoryRouter", "MemorySocket", "memory_pair"]

#: What travels: frames (a list of bytes) or, with ``codec=False``, the
#: message object itself.
_Item = list[bytes] | Message



def _decoded(identity: bytes | None, item: _Item, max_bytes: int) -> tuple[bytes | None, Message]:
    """A received item as (identity, message): frames are decoded (a
    ``ProtocolError`` carries ``identity``), a message object passes."""
    if not isinstance(item, list):
        return identity, item
    try:
        return identity, protocol.decode(item, max_bytes=max_bytes)
    except ProtocolError as e:
        e.identity = identity
        raise

class MemorySocket:
    """One end of ``memory_pair``. With ``identity`` set on the pair, the first
    end behaves as a ROUTER: it receives ``(identity, msg)`` and must name that
    identity when sending; the second end is its DEALER peer."""

    def __init__(
        self,
        send_channel: trio.MemorySendChannel[tuple[float, _Item]],
        receive_channel: trio.MemoryReceiveChannel[tuple[float, _Item]],
        *,
        routed_identity: bytes | None,
        delay: Callable[[Message], float] | float | None,
        drop: Callable[[Message], bool] | None,
        codec: bool,
        max_message_bytes: int,
    ) -> None:
        self._send = send_channel
        self._receive = receive_channel
        #: On the ROUTER end, the peer's identity (sent to, received from).
        self._routed_identity = routed_identity
        self._delay = delay
        self._drop = drop
        self._codec = codec
        self.max_message_bytes = max_message_bytes
        self._recv_owner = _Owner("receiving")
        self._closed = False

    def _transit_delay(self, msg: Message) -> float:
        if self._delay is None:
            return 0.0
        if callable(self._delay):
            return float(self._delay(msg))
        return float(self._delay)

    async def _put(self, item: _Item, msg: Message | None) -> None:
        await trio.lowlevel.checkpoint()
        self._put_nowait(item, msg)

    def _put_nowait(self, item: _Item, msg: Message | None) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this MemorySocket was closed")
        if msg is not None and self._drop is not None and self._drop(msg):
            return
        deliver_at = trio.current_time() + (0.0 if msg is None else self._transit_delay(msg))
        try:
            self._send.send_nowait((deliver_at, item))
        except trio.BrokenResourceError:
            # The peer closed: like ZeroMQ, sending to nobody is not an error.
            pass

    async def send_message(self, msg: Message, identity: bytes | None = None) -> None:
        """Send ``msg``; on the ROUTER end ``identity`` must name the peer."""
        await self._put(self._item_for(msg, identity), msg)

    def send_message_nowait(self, msg: Message, identity: bytes | None = None) -> None:
        """``send_message`` without yielding (the queue is unbounded)."""
        self._put_nowait(self._item_for(msg, identity), msg)

    def _item_for(self, msg: Message, identity: bytes | None) -> _Item:
        self._check_identity(identity, type(msg).__name__)
        if self._codec:
            return [bytes(f) for f in protocol.encode(msg, max_bytes=self.max_message_bytes)]
        return msg

    async def send_multipart(self, frames: Sequence[object], copy: bool = False) -> None:
        """Send raw frames (on the ROUTER end the first frame is the peer's
        identity); they skip the delay and drop hooks, which see messages."""
        frames = [bytes(memoryview(f)) for f in frames]  # type: ignore[arg-type]
        if self._routed_identity is not None:
            if not frames:
                raise ValueError("a ROUTER message needs the peer's identity as its first frame")
            self._check_identity(frames[0], "frames")
            frames = frames[1:]
        await self._put(frames, None)

    def _check_identity(self, identity: bytes | None, what: str) -> None:
        if self._routed_identity is None:
            if identity is not None:
                raise ValueError("only the ROUTER end of a memory pair takes an identity")
        elif identity is None:
            raise ValueError(f"sending {what} on the ROUTER end needs the peer's identity")
        # A ROUTER drops messages to unknown identities silently; in a test
        # that is always a bug, so say so.
        elif identity != self._routed_identity:
            raise ValueError(
                f"no peer with identity {identity!r} on this memory pair "
                f"(the peer is {self._routed_identity!r})"
            )

    async def _get(self) -> _Item:
        if self._closed:
            raise trio.ClosedResourceError("this MemorySocket was closed")
        try:
            deliver_at, item = await self._receive.receive()
        except trio.EndOfChannel:
            raise trio.BrokenResourceError("the other end of the memory pair was closed") from None
        await trio.sleep_until(deliver_at)
        return item

    async def recv_multipart(self, copy: bool = False) -> list[bytes]:
        """The next message's frames (the ROUTER end gets the identity first)."""
        with self._recv_owner:
            item = await self._get()
        frames = item if isinstance(item, list) else [bytes(f) for f in protocol.encode(item)]
        if self._routed_identity is not None:
            return [self._routed_identity, *frames]
        return frames

    async def recv_message(self) -> tuple[bytes | None, Message]:
        """The next message and the sender's identity (None unless ROUTER);
        ``ProtocolError`` (with ``identity``) for malformed frames."""
        with self._recv_owner:
            item = await self._get()
        return _decoded(self._routed_identity, item, self.max_message_bytes)

    def close(self) -> None:
        """Close this end; the peer's receives then raise ``BrokenResourceError``."""
        if not self._closed:
            self._closed = True
            self._send.close()
            self._receive.close()

    async def __aenter__(self) -> MemorySocket:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.close()


def memory_pair(
    *,
    identity: bytes | None = None,
    delay: Callable[[Message], float] | float | None = None,
    drop: Callable[[Message], bool] | None = None,
    codec: bool = True,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> tuple[MemorySocket, MemorySocket]:
    """Two connected in-memory sockets ``(a, b)``.

    ``identity``: make ``a`` a ROUTER that sees ``b`` under this identity.
    ``delay``: seconds each message spends in transit (a number or a function
    of the message); messages keep their order. ``drop``: a predicate; True
    loses the message. Both hooks apply in both directions. ``codec``: carry
    encoded frames (payloads copied) instead of the message objects.
    """
    a_to_b_send, a_to_b_recv = trio.open_memory_channel[tuple[float, _Item]](math.inf)
    b_to_a_send, b_to_a_recv = trio.open_memory_channel[tuple[float, _Item]](math.inf)
    common = dict(delay=delay, drop=drop, codec=codec, max_message_bytes=max_message_bytes)
    a = MemorySocket(
        a_to_b_send, b_to_a_recv, routed_identity=identity, **common
    )
    b = MemorySocket(
        b_to_a_send, a_to_b_recv, routed_identity=None, **common
    )
    return a, b


class _Connection:
    """One DEALER's link to a ``MemoryRouter``: what it sent, not yet taken
    (``inbox``, as ``(deliver_at, order, item)``), and the channel to it."""

    def __init__(self, router: MemoryRouter, identity: bytes,
                 to_dealer: trio.MemorySendChannel[tuple[float, _Item]],
                 delay: Callable[[Message], float] | float | None,
                 drop: Callable[[Message], bool] | None) -> None:
        self.router = router
        self.identity = identity
        self.inbox: deque[tuple[float, int, _Item]] = deque()
        self.to_dealer = to_dealer
        self.delay = delay
        self.drop = drop
        self.connected = True

    # The DEALER's ``MemorySocket`` sends through these two (its send channel).
    def send_nowait(self, value: tuple[float, _Item]) -> None:
        if self.router._closed:
            raise trio.BrokenResourceError("the MemoryRouter was closed")
        deliver_at, item = value
        self.inbox.append((deliver_at, next(self.router._order), item))
        self.router._wake()

    def close(self) -> None:
        self.connected = False
        self.to_dealer.close()


class MemoryRouter:
    """A ROUTER for in-memory DEALERs (see the module docstring). Same
    message interface as ``AsyncSocket`` on a ROUTER: ``recv_message()``
    returns ``(identity, msg)``, ``send_message(msg, identity)``.

    ``delay``/``drop``/``codec`` are the defaults of every connection (as in
    ``memory_pair``); ``connect`` takes its own. Sending to an identity that
    never connected raises ``ValueError`` (a ROUTER would drop it silently;
    in a test that is a bug); sending to one that disconnected is dropped.
    """

    def __init__(
        self,
        *,
        delay: Callable[[Message], float] | float | None = None,
        drop: Callable[[Message], bool] | None = None,
        codec: bool = True,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self._delay = delay
        self._drop = drop
        self._codec = codec
        self.max_message_bytes = max_message_bytes
        self._connections: dict[bytes, _Connection] = {}
        self._order = itertools.count()
        self._arrived = trio.Event()
        self._recv_owner = _Owner("receiving")
        self._closed = False

    def connect(
        self,
        identity: bytes,
        *,
        delay: Callable[[Message], float] | float | None = None,
        drop: Callable[[Message], bool] | None = None,
    ) -> MemorySocket:
        """A new DEALER end the router sees as ``identity``; ``delay`` and
        ``drop`` (default: the router's) apply to this connection, both ways."""
        if self._closed:
            raise trio.ClosedResourceError("this MemoryRouter was closed")
        old = self._connections.get(identity)
        if old is not None and old.connected:
            raise ValueError(f"identity {identity!r} is already connected to this MemoryRouter")
        delay = self._delay if delay is None else delay
        drop = self._drop if drop is None else drop
        to_dealer, dealer_inbox = trio.open_memory_channel[tuple[float, _Item]](math.inf)
        conn = _Connection(self, identity, to_dealer, delay, drop)
        self._connections[identity] = conn
        return MemorySocket(conn, dealer_inbox, routed_identity=None, delay=delay, drop=drop,  # type: ignore[arg-type]
                            codec=self._codec, max_message_bytes=self.max_message_bytes)

    @property
    def identities(self) -> list[bytes]:
        """The identities connected now."""
        return [i for i, c in self._connections.items() if c.connected]

    def _wake(self) -> None:
        self._arrived.set()

    # --- receiving -------------------------------------------------------

    async def _get(self) -> tuple[bytes, _Item]:
        while True:
            if self._closed:
                raise trio.ClosedResourceError("this MemoryRouter was closed")
            heads = [(c.inbox[0][0], c.inbox[0][1], c) for c in self._connections.values() if c.inbox]
            if heads:
                deliver_at, _, conn = min(heads, key=lambda h: (h[0], h[1]))
                if deliver_at <= trio.current_time():
                    await trio.lowlevel.checkpoint()
                    if conn.inbox and conn.inbox[0][0] <= trio.current_time():
                        _, _, item = conn.inbox.popleft()
                        return conn.identity, item
                    continue
                wake_at = deliver_at
            else:
                wake_at = math.inf
            self._arrived = trio.Event()
            with trio.move_on_at(wake_at):
                await self._arrived.wait()

    async def recv_message(self) -> tuple[bytes, Message]:
        """The next message of any DEALER and its identity; ``ProtocolError``
        (with ``identity``) for malformed frames."""
        with self._recv_owner:
            identity, item = await self._get()
        return _decoded(identity, item, self.max_message_bytes)

    async def recv_multipart(self, copy: bool = False) -> list[bytes]:
        """The next message's frames, the sender's identity first."""
        with self._recv_owner:
            identity, item = await self._get()
        frames = item if isinstance(item, list) else [bytes(f) for f in protocol.encode(item)]
        return [identity, *frames]

    # --- sending ---------------------------------------------------------

    def _connection(self, identity: bytes | None, what: str) -> _Connection:
        if self._closed:
            raise trio.ClosedResourceError("this MemoryRouter was closed")
        if identity is None:
            raise ValueError(f"sending {what} on a MemoryRouter needs the peer's identity")
        conn = self._connections.get(identity)
        if conn is None:
            raise ValueError(f"no peer with identity {identity!r} on this MemoryRouter "
                             f"(connected: {self.identities!r})")
        return conn

    def _put(self, conn: _Connection, item: _Item, msg: Message | None) -> None:
        if msg is not None and conn.drop is not None and conn.drop(msg):
            return
        delay = 0.0
        if msg is not None and conn.delay is not None:
            delay = float(conn.delay(msg)) if callable(conn.delay) else float(conn.delay)
        try:
            conn.to_dealer.send_nowait((trio.current_time() + delay, item))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer vanished: ZeroMQ drops what goes to it

    def send_message_nowait(self, msg: Message, identity: bytes | None = None) -> None:
        """Send ``msg`` to the DEALER ``identity`` without yielding."""
        conn = self._connection(identity, type(msg).__name__)
        item: _Item = msg
        if self._codec:
            item = [bytes(f) for f in protocol.encode(msg, max_bytes=self.max_message_bytes)]
        self._put(conn, item, msg)

    async def send_message(self, msg: Message, identity: bytes | None = None) -> None:
        """Send ``msg`` to the DEALER ``identity``."""
        await trio.lowlevel.checkpoint()
        self.send_message_nowait(msg, identity)

    async def send_multipart(self, frames: Sequence[object], copy: bool = False) -> None:
        """Send raw frames, the first the peer's identity (no hooks)."""
        frames = [bytes(memoryview(f)) for f in frames]  # type: ignore[arg-type]
        if not frames:
            raise ValueError("a ROUTER message needs the peer's identity as its first frame")
        await trio.lowlevel.checkpoint()
        self._put(self._connection(frames[0], "frames"), frames[1:], None)

    def close(self) -> None:
        """Close the router; its DEALERs' receives then raise ``BrokenResourceError``."""
        if not self._closed:
            self._closed = True
            for conn in self._connections.values():
                conn.to_dealer.close()
            self._wake()

    async def __aenter__(self) -> MemoryRouter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
