"""Where the coordinator listens, and where it must not.

Without authentication, anyone who can reach a coordinator's socket can
inject tensors into a run or shut it down. So Prism listens only on ``ipc://``
(a file with the run directory's permissions) or TCP on a loopback address,
unless the caller says authentication is on: the job daemon (``prism
coordinator --daemon --keys DIR``) listens beyond loopback with ZeroMQ CURVE.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tempfile

__all__ = [
    "UnsafeEndpointError",
    "check_listen_endpoint",
    "default_endpoint",
    "free_tcp_endpoint",
    "on_one_host",
]

SOCKET_NAME = "prism.sock"
#: Longest ipc path we use, in bytes. ``sun_path`` holds 108 bytes on Linux
#: and 104 on macOS, both including the terminating NUL (see unix(7)); we keep
#: under the smaller so a run directory works on either.
MAX_IPC_PATH_BYTES = 103

_LOOPBACK_NAMES = {"localhost", "ip6-localhost", "ip6-loopback"}


#: Endpoints whose two sides share one host: CLOCK_MONOTONIC is system-wide
#: on Linux, so their clocks are one clock (a clock offset of 0, no probes).
ONE_HOST_PREFIXES = ("ipc://", "inproc://", "memory://", "tcp://127.", "tcp://localhost", "tcp://[::1]")


def on_one_host(endpoint: str) -> bool:
    """Whether both sides of ``endpoint`` are on this host (``ONE_HOST_PREFIXES``)."""
    return endpoint.startswith(ONE_HOST_PREFIXES)


class UnsafeEndpointError(ValueError):
    """The endpoint would expose the coordinator beyond this machine (the
    caller's configuration is at fault)."""


def default_endpoint(run_dir: str | os.PathLike[str] | None = None) -> str:
    """``ipc://RUN_DIR/prism.sock``, or a socket in a fresh private temporary
    directory when ``run_dir`` is None or its path is too long for a Unix
    socket (``MAX_IPC_PATH_BYTES``)."""
    if run_dir is not None:
        path = os.path.join(os.path.abspath(os.fspath(run_dir)), SOCKET_NAME)
        if len(os.fsencode(path)) <= MAX_IPC_PATH_BYTES:
            return f"ipc://{path}"
    # mkdtemp makes the directory mode 0700, so only this user can connect.
    path = os.path.join(tempfile.mkdtemp(prefix="prism-"), SOCKET_NAME)
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise UnsafeEndpointError(
            f"the temporary directory gives an ipc path of {len(os.fsencode(path))} bytes "
            f"({path}), over the {MAX_IPC_PATH_BYTES}-byte limit of Unix sockets: "
            "set TMPDIR to a shorter directory or pass --endpoint tcp://127.0.0.1:PORT"
        )
    return f"ipc://{path}"


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listen_endpoint(endpoint: str, *, authenticated: bool = False) -> None:
    """Refuse (``UnsafeEndpointError``) to listen on ``endpoint`` unless it is
    ``ipc://``, ``inproc://`` or ``tcp://`` on a loopback address (127.0.0.0/8,
    ``localhost``, ``[::1]``); any address is allowed when ``authenticated``."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or not rest:
        raise UnsafeEndpointError(
            f"endpoint {endpoint!r} is not a ZeroMQ address: expected ipc://PATH or "
            "tcp://127.0.0.1:PORT"
        )
    if scheme in ("ipc", "inproc"):
        return
    if scheme != "tcp":
        if authenticated:
            return
        raise UnsafeEndpointError(
            f"refusing to listen on {endpoint}: Prism listens only on ipc:// or loopback "
            "tcp:// unless CURVE authentication is on (the job daemon with --keys DIR from "
            "`prism keys DIR`); use ipc:// or tcp://127.0.0.1:PORT"
        )
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not port:
        raise UnsafeEndpointError(
            f"endpoint {endpoint!r} lacks a host or port: expected tcp://127.0.0.1:PORT"
        )
    if authenticated or _is_loopback(host):
        return
    raise UnsafeEndpointError(
        f"refusing to listen on {endpoint}: Prism listens only on ipc:// or loopback "
        "unless CURVE authentication is on (the job daemon with --keys DIR from "
        "`prism keys DIR`); use ipc:// or tcp://127.0.0.1:PORT"
    )


def free_tcp_endpoint() -> str:
    """``tcp://127.0.0.1:PORT`` with a port free right now (for tests; another
    process may take it before it is bound, so prefer binding ``:*``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"
