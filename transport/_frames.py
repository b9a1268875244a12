"""Multipart send and receive without pyzmq's per-call overhead.

``Socket.send_multipart``/``recv_multipart`` combine pyzmq's IntFlag
constants (an enum object per ``|``) and ask ``RCVMORE`` through a
``SocketOption`` lookup per frame; on the hot path of a small message that
is a measurable share of a round trip. These helpers use plain ints and
``Frame.more`` instead, with the same semantics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | NOBLOCK


def send_frames(
    sock: zmq.Socket, frames: Sequence[Any], *, copy: bool, track: bool
) -> zmq.MessageTracker | None:
    """Send ``frames`` as one message without blocking. Only the first frame
    can raise ``zmq.Again``: ZeroMQ admits the rest of a message it started."""
    last = len(frames) - 1
    send = sock.send
    for i in range(last):
        send(frames[i], _SNDMORE_NOBLOCK, copy=copy, track=track)
    return send(frames[last], NOBLOCK, copy=copy, track=track)


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame]:
    """Receive one whole message as ``zmq.Frame`` objects without blocking
    (``zmq.Again`` if none is queued; the rest of a message is always there)."""
    frame = sock.recv(NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(NOBLOCK, copy=False)
        frames.append(frame)
    return frames
