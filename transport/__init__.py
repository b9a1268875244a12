"""ZeroMQ messaging between rank processes and the coordinator.

The wire format (messages, codec, handshake) is sans-IO and lives in
``prism.core.protocol`` (specified in ``docs/PROTOCOL.md``); this package
moves it:

``endpoints``    where the coordinator may listen (ipc or loopback unless
                 authenticated) and the default ipc endpoint of a run.
``trio_socket``  ``AsyncSocket``: a ZeroMQ socket for trio (the coordinator).
``client``       ``BlockingClient``: a rank's connection, with a background
                 I/O thread that resolves futures (no trio in rank processes).
``memory``       ``memory_pair``: an in-memory pair with delay and loss hooks
                 for unit tests; ``MemoryRouter``: a ROUTER many in-memory
                 DEALERs connect to (``prism.testing`` serves a world on it).
"""

from .client import BlockingClient, CoordinatorError, CoordinatorLost, HandshakeRefused
from .endpoints import (
    UnsafeEndpointError,
    check_listen_endpoint,
    default_endpoint,
    free_tcp_endpoint,
)
from .memory import MemoryRouter, MemorySocket, memory_pair
from .trio_socket import AsyncSocket

__all__ = [
    "AsyncSocket",
    "BlockingClient",
    "CoordinatorError",
    "CoordinatorLost",
    "HandshakeRefused",
    "MemoryRouter",
    "MemorySocket",
    "UnsafeEndpointError",
    "check_listen_endpoint",
    "default_endpoint",
    "free_tcp_endpoint",
    "memory_pair",
]
