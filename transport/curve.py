"""ZeroMQ CURVE for Prism's sockets: the key files, a server's ZAP handler,
a client's keys, and a clear text for a refused handshake.

``prism keys DIR`` (``make_keys``) writes one keypair for the serving side
(the job daemon, a capture's coordinator that agents join) and one for
clients (``prism submit``, ``prism agent``, the ranks an agent starts), and
puts the client's public key into ``DIR/authorized/``. Keys are distributed
by path: a server needs ``server.key_secret`` and ``authorized/``; a client
``server.key`` and ``client.key_secret``. On a cluster the directory sits on
the shared filesystem, readable by the job's user only (0700).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

__all__ = ["CurveKeyError", "KeyFiles", "make_keys", "load_key", "serve_curve", "connect_curve",
           "HANDSHAKE_FAILED_EVENTS", "HANDSHAKE_TRIES", "handshake_text", "SERVER_PUBLIC", "SERVER_SECRET", "CLIENT_PUBLIC",
           "CLIENT_SECRET", "AUTHORIZED_DIR", "KEYS_ENV"]

#: Key files of ``make_keys`` (``zmq.auth`` certificate format).
SERVER_PUBLIC, SERVER_SECRET = "server.key", "server.key_secret"
CLIENT_PUBLIC, CLIENT_SECRET = "client.key", "client.key_secret"
AUTHORIZED_DIR = "authorized"
#: The key directory a rank's client connects with (set by ``prism agent``).
KEYS_ENV = "PRISM_KEYS"
#: The monitor events of a refused CURVE handshake.
HANDSHAKE_FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
#: Handshakes failing without detail in a row (none succeeding in between)
#: before a client blames the keys: a peer closing mid-handshake (a
#: coordinator or daemon restarting) gives one or two, a wrong server key
#: every one.
HANDSHAKE_TRIES = 3


class CurveKeyError(ValueError):
    """A key file is missing or unreadable (the user's setup is at fault)."""


@dataclass(frozen=True, slots=True)
class KeyFiles:
    """What ``make_keys`` wrote: the server's pair, the client's pair, and
    the client's public key among those the server lets in."""

    dir: Path
    server_public: Path
    server_secret: Path
    client_public: Path
    client_secret: Path
    authorized: Path


def make_keys(directory: str | os.PathLike[str]) -> KeyFiles:
    """Write a CURVE keypair for the server and one for a client into
    ``directory`` (mode 0700, files 0600), the client's public key also into
    ``authorized/``. Refuses to overwrite keys."""
    import zmq.auth

    d = Path(directory)
    existing = [n for n in (SERVER_SECRET, CLIENT_SECRET) if (d / n).exists()]
    if existing:
        raise CurveKeyError(f"{d} already holds keys ({', '.join(existing)}); remove them or choose another directory")
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    (d / AUTHORIZED_DIR).mkdir(exist_ok=True, mode=0o700)
    zmq.auth.create_certificates(d, "server")
    zmq.auth.create_certificates(d, "client")
    shutil.copyfile(d / CLIENT_PUBLIC, d / AUTHORIZED_DIR / CLIENT_PUBLIC)
    for p in (d / SERVER_PUBLIC, d / SERVER_SECRET, d / CLIENT_PUBLIC, d / CLIENT_SECRET,
              d / AUTHORIZED_DIR / CLIENT_PUBLIC):
        os.chmod(p, 0o600)
    return KeyFiles(d, d / SERVER_PUBLIC, d / SERVER_SECRET, d / CLIENT_PUBLIC, d / CLIENT_SECRET,
                    d / AUTHORIZED_DIR)


def load_key(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    """``(public, secret)`` of the certificate at ``path``; ``CurveKeyError``
    naming the file when it is missing, unreadable or (``secret``) holds no
    secret key."""
    import zmq.auth

    if not path.is_file():
        raise CurveKeyError(f"key file {path} does not exist: make keys with `prism keys DIR` and pass --keys DIR")
    try:
        public, sec = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as e:
        raise CurveKeyError(f"key file {path} cannot be read as a CURVE certificate: {e}") from None
    if secret and sec is None:
        raise CurveKeyError(f"key file {path} holds no secret key")
    return public, sec


class _SharedAuth:
    """One ZAP handler per context (ZeroMQ allows one): every CURVE server
    socket of the context shares it; the last ``stop()`` stops it."""

    _lock = threading.Lock()
    _running: dict[int, list] = {}

    def __init__(self, ctx: zmq.Context, allowed: Path, log_name: str) -> None:
        self._key = id(ctx)
        with self._lock:
            entry = self._running.get(self._key)
            if entry is None:
                entry = self._running[self._key] = [_start_auth(ctx, log_name), 0, str(allowed)]
            elif entry[2] != str(allowed):
                raise CurveKeyError(f"this process already serves CURVE with the keys of {entry[2]}; one process "
                                    f"serves one key directory (not {allowed})")
            entry[0].configure_curve(domain="*", location=str(allowed))
            entry[1] += 1
        self._stopped = False

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            entry = self._running[self._key]
            entry[1] -= 1
            if entry[1] == 0:
                entry[0].stop()
                del self._running[self._key]


#: How long a new ZAP handler waits for the last one's address to be freed.
ZAP_REBIND_S = 5.0


def _start_auth(ctx: zmq.Context, log_name: str) -> Any:
    """A started ZAP handler on ``ctx``. ZeroMQ frees ``inproc://zeromq.zap.01``
    a little after the last handler's socket closed: a server started at once
    again (a daemon's next run) retries the bind until then."""
    from zmq.auth.thread import ThreadAuthenticator

    deadline = time.monotonic() + ZAP_REBIND_S
    while True:
        auth = ThreadAuthenticator(ctx, log=logging.getLogger(log_name))
        try:
            auth.start()
            return auth
        except zmq.ZMQError as e:
            auth.stop()
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def serve_curve(sock: zmq.Socket, keys: Path, ctx: zmq.Context | None = None,
                log_name: str = "prism.transport.zap") -> Any:
    """Make ``sock`` (not yet bound) a CURVE server with ``keys``, with a ZAP
    handler that lets in only the public keys in ``keys/authorized/``
    (shared by the context's CURVE sockets); returns a handle to ``stop()``
    when the socket is closed."""
    keys = Path(keys).resolve()
    public, secret = load_key(keys / SERVER_SECRET, secret=True)
    allowed = keys / AUTHORIZED_DIR
    if not allowed.is_dir() or not any(allowed.glob("*.key")):
        raise CurveKeyError(f"{allowed} holds no client public keys (*.key): the server would let nobody in; "
                            "make keys with `prism keys DIR`")
    auth = _SharedAuth(ctx or sock.context, allowed, log_name)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


def connect_curve(sock: zmq.Socket, keys: Path) -> None:
    """Give ``sock`` (not yet connected) the client keys of ``keys``."""
    keys = Path(keys)
    server_public, _ = load_key(keys / SERVER_PUBLIC, secret=False)
    public, secret = load_key(keys / CLIENT_SECRET, secret=True)
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def handshake_text(what: str, endpoint: str, event: int, keys: Path | None) -> str:
    """Why the handshake with ``what`` ("the daemon", "the coordinator") at
    ``endpoint`` failed (a monitor ``event``), and what to do."""
    if keys is None:
        return (f"{what} at {endpoint} requires CURVE keys: pass --keys DIR with the keys made by "
                "`prism keys DIR` (its server.key and client.key_secret)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"{what} at {endpoint} refused your key ({Path(keys) / CLIENT_SECRET}): its public key is not in "
                f"the server's {AUTHORIZED_DIR}/ directory")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return (f"{what} at {endpoint} does not use CURVE (or speaks another protocol): drop --keys, or "
                "restart it with --keys DIR")
    return (f"the CURVE handshake with {what} at {endpoint} failed: {Path(keys) / SERVER_PUBLIC} is not its "
            "public key")
