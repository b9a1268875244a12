"""A fake coordinator for rank-side tests: threads in the test process that
speak prism.core.protocol over ``multiprocessing.connection`` (AF_UNIX) and
compute collectives with a straightforward torch reference.

The rank side reaches it through ``PRISM_CLIENT_FACTORY=tests.support.fake_coordinator:connect``
(``FakeClient`` mirrors ``transport.client.BlockingClient``). Endpoints look
like ``fake:/path/to/socket``. Only for tests: no flow control, no timeouts.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from multiprocessing.connection import Client, Listener
from typing import Any

import torch

from prism.core import protocol
from prism.core.protocol import (
    CollectiveArrive, CollectiveResult, Error, GroupCreate, Goodbye, Hello, P2PData, RecvPost, Send,
    SlotGrant, SlotRelease, SlotRequest, TraceRecords, Welcome,
)


class CoordinatorError(RuntimeError):
    """The fake coordinator sent Error or Shutdown."""


# --- the client (rank side) ----------------------------------------------------------


class FakeClient:
    """``BlockingClient``'s API over a multiprocessing connection."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._waiting: dict[Any, collections.deque] = collections.defaultdict(collections.deque)
        self._early: dict[Any, collections.deque] = collections.defaultdict(collections.deque)
        self._failed: BaseException | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)

    @classmethod
    def connect(cls, endpoint: str, hello: Hello, *, timeout: float = 30.0) -> tuple[FakeClient, Welcome]:
        path = endpoint.removeprefix("fake:")
        deadline = time.monotonic() + timeout
        while True:
            try:
                conn = Client(path, family="AF_UNIX")
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client = cls(conn)
        client.send(hello)
        welcome = protocol.decode(conn.recv())
        if not isinstance(welcome, Welcome):
            raise CoordinatorError(f"handshake refused: {welcome}")
        client._reader.start()
        return client, welcome

    def send(self, msg: Any) -> None:
        frames = [bytes(memoryview(f).cast("B")) for f in protocol.encode(msg)]
        with self._send_lock:
            self._conn.send(frames)

    def future(self, key: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._failed is not None:
                fut.set_exception(self._failed)
            elif self._early[key]:
                fut.set_result(self._early[key].popleft())
            else:
                self._waiting[key].append(fut)
        return fut

    def _read(self) -> None:
        while True:
            try:
                frames = self._conn.recv()
            except (EOFError, OSError):
                return
            msg = protocol.decode(frames)
            key = protocol.routing_key(msg)
            with self._lock:
                if key is None:
                    self._failed = CoordinatorError(str(msg))
                    for q in self._waiting.values():
                        while q:
                            q.popleft().set_exception(self._failed)
                    continue
                q = self._waiting[key]
                fut = q.popleft() if q else None
                if fut is None:
                    self._early[key].append(msg)
            if fut is not None:
                fut.set_result(msg)

    def close(self) -> None:
        self._conn.close()


def connect(endpoint: str, hello: Hello, *, timeout: float = 30.0) -> tuple[FakeClient, Welcome]:
    return FakeClient.connect(endpoint, hello, timeout=timeout)


# --- the reference semantics -----------------------------------------------------------


def _tensor(buf: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    dt = getattr(torch, dtype)
    raw = bytearray(buf)
    if not raw:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dt).reshape(shape)


def _bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _reduce(op: str, ts: list[torch.Tensor], premul: float | None) -> torch.Tensor:
    if op in ("SUM", "AVG", "PREMUL_SUM"):
        acc = torch.zeros_like(ts[0], dtype=torch.float64 if ts[0].is_floating_point() else ts[0].dtype)
        for t in ts:
            acc = acc + (t.to(acc.dtype) * premul if op == "PREMUL_SUM" else t.to(acc.dtype))
        if op == "AVG":
            acc = acc / len(ts)
        return acc.to(ts[0].dtype)
    fns = {
        "PRODUCT": lambda a, b: a * b, "MIN": torch.minimum, "MAX": torch.maximum,
        "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor,
    }
    acc = ts[0]
    for t in ts[1:]:
        acc = fns[op](acc, t)
    return acc


def reference(msgs: list[CollectiveArrive]) -> list[list[bytes]]:
    """Reply payloads for each member (group-rank order) of one collective."""
    m0 = msgs[0]
    n, op, dt = len(msgs), m0.op, m0.dtype
    ins = [[_tensor(p, dt, s) for p, s in zip(m.payloads, m.in_shapes)] for m in msgs]
    red = lambda ts: _reduce(m0.reduce_op, ts, m0.premul)  # noqa: E731
    if op in ("all_reduce", "all_reduce_coalesced"):
        out = [_bytes(red([ins[r][i] for r in range(n)])) for i in range(len(ins[0]))]
        return [out for _ in range(n)]
    if op == "broadcast":
        return [[] if j == m0.root else [_bytes(ins[m0.root][0])] for j in range(n)]
    if op == "reduce":
        return [[_bytes(red([x[0] for x in ins]))] if j == m0.root else [] for j in range(n)]
    if op == "all_gather":
        out = [_bytes(ins[r][i]) for i in range(len(ins[0])) for r in range(n)]
        return [out for _ in range(n)]
    if op == "all_gather_into_tensor":
        out = [b"".join(_bytes(ins[r][i]) for r in range(n)) for i in range(len(ins[0]))]
        return [out for _ in range(n)]
    if op == "gather":
        return [[_bytes(x[0]) for x in ins] if j == m0.root else [] for j in range(n)]
    if op == "scatter":
        return [[_bytes(ins[m0.root][j])] for j in range(n)]
    if op == "reduce_scatter":
        return [[_bytes(red([ins[r][j] for r in range(n)]))] for j in range(n)]
    if op == "reduce_scatter_tensor":
        outs: list[list[bytes]] = [[] for _ in range(n)]
        for i in range(len(ins[0])):
            total = red([ins[r][i].reshape(-1) for r in range(n)])
            for j, chunk in enumerate(total.chunk(n)):
                outs[j].append(_bytes(chunk))
        return outs
    if op == "all_to_all":
        return [[_bytes(ins[r][j]) for r in range(n)] for j in range(n)]
    if op == "all_to_all_single":
        outs = []
        for j in range(n):
            parts = []
            for r, m in enumerate(msgs):
                flat = bytes(m.payloads[0])
                rows = sum(m.in_splits)
                row = len(flat) // rows if rows else 0
                off = sum(m.in_splits[:j]) * row
                parts.append(flat[off: off + m.in_splits[j] * row])
            outs.append([b"".join(parts)])
        return outs
    if op == "barrier":
        return [[] for _ in range(n)]
    raise AssertionError(f"fake coordinator: unknown op {op}")


# --- the coordinator ---------------------------------------------------------------------


class FakeCoordinator:
    """Accepts ``world_size`` ranks; ``slots`` of them may compute at once."""

    def __init__(self, path: str, world_size: int, *, slots: int | None = None,
                 small_tensor_limit: int = 64 * 1024) -> None:
        self.endpoint = f"fake:{path}"
        self.world_size = world_size
        self.slots = slots or world_size
        self.small_tensor_limit = small_tensor_limit
        self._listener = Listener(path, family="AF_UNIX")
        self._lock = threading.Lock()
        self.conns: dict[int, Any] = {}
        self._send_locks: dict[int, threading.Lock] = {}
        self.groups: dict[str, tuple[int, ...]] = {"world": tuple(range(world_size))}
        self.group_msgs: list[GroupCreate] = []
        self._colls: dict[tuple[str, int], dict[int, CollectiveArrive]] = {}
        self._sends: dict[tuple[int, int, int, int], Send] = {}
        self._recvs: dict[tuple[int, int, int, int], RecvPost] = {}
        self.holders: set[int] = set()
        self._queue: collections.deque[int] = collections.deque()
        self.max_holders = 0
        #: Protocol violations seen (e.g. a call issued without a slot).
        self.violations: list[str] = []
        self.messages: dict[int, list[Any]] = collections.defaultdict(list)
        self.trace_lines: dict[int, list[bytes]] = collections.defaultdict(list)
        self.goodbyes: dict[int, Goodbye] = {}
        self._threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _reply(self, rank: int, msg: Any) -> None:
        frames = [bytes(memoryview(f).cast("B")) for f in protocol.encode(msg)]
        with self._send_locks[rank]:
            try:
                self.conns[rank].send(frames)
            except OSError:
                pass

    def _serve(self, conn: Any) -> None:
        hello = protocol.decode(conn.recv())
        protocol.check_hello(hello, world_size=self.world_size)
        rank = hello.rank
        with self._lock:
            self.conns[rank] = conn
            self._send_locks[rank] = threading.Lock()
            self.messages[rank].append(hello)
        conn.send([bytes(f) for f in protocol.encode(Welcome(
            protocol_version=protocol.PROTOCOL_VERSION, run_id="fake", t_ns=time.monotonic_ns(),
            small_tensor_limit=self.small_tensor_limit))])
        while True:
            try:
                frames = conn.recv()
            except (EOFError, OSError):
                with self._lock:
                    if rank in self.holders:
                        self._release(rank)
                return
            self._handle(rank, protocol.decode(frames))

    def _grant(self, rank: int) -> None:
        self.holders.add(rank)
        self.max_holders = max(self.max_holders, len(self.holders))
        self._reply(rank, SlotGrant(rank=rank))

    def _release(self, rank: int) -> None:
        self.holders.discard(rank)
        while self._queue and len(self.holders) < self.slots:
            self._grant(self._queue.popleft())

    def _handle(self, rank: int, msg: Any) -> None:
        with self._lock:
            if not isinstance(msg, TraceRecords):
                self.messages[rank].append(msg)
            if isinstance(msg, (CollectiveArrive, Send, RecvPost)) and rank not in self.holders:
                self.violations.append(f"rank {rank} sent {type(msg).__name__} without a slot")
            if isinstance(msg, SlotRequest):
                if rank in self.holders:
                    self.violations.append(f"rank {rank} requested a slot it holds")
                elif len(self.holders) < self.slots:
                    self._grant(rank)
                else:
                    self._queue.append(rank)
            elif isinstance(msg, SlotRelease):
                if rank not in self.holders:
                    self.violations.append(f"rank {rank} released a slot it does not hold")
                self._release(rank)
            elif isinstance(msg, TraceRecords):
                self.trace_lines[rank].extend(bytes(p) for p in msg.payloads)
            elif isinstance(msg, GroupCreate):
                self.group_msgs.append(msg)
                self.groups[msg.gid] = msg.ranks
            elif isinstance(msg, CollectiveArrive):
                key = (msg.gid, msg.seq)
                arrived = self._colls.setdefault(key, {})
                arrived[rank] = msg
                members = self.groups[msg.gid]
                ops = {m.op for m in arrived.values()}
                if len(ops) > 1:
                    for r in arrived:
                        self._reply(r, Error(code="mismatch", rank=r, gid=msg.gid, seq=msg.seq,
                                             message=f"ranks called different collectives: {sorted(ops)}"))
                elif len(arrived) == len(members):
                    del self._colls[key]
                    ordered = [arrived[r] for r in members]
                    for r, payloads in zip(members, reference(ordered)):
                        self._reply(r, CollectiveResult(gid=msg.gid, seq=msg.seq, payloads=tuple(payloads)))
            elif isinstance(msg, Send):
                key = (rank, msg.dst, msg.tag, msg.pseq)
                self._sends[key] = msg
                self._match(key)
            elif isinstance(msg, RecvPost):
                key = (msg.src, rank, msg.tag, msg.pseq)
                self._recvs[key] = msg
                self._match(key)
            elif isinstance(msg, Goodbye):
                self.goodbyes[rank] = msg
                if rank in self.holders:
                    self._release(rank)

    def _match(self, key: tuple[int, int, int, int]) -> None:
        if key in self._sends and key in self._recvs:
            send = self._sends.pop(key)
            self._recvs.pop(key)
            self._reply(key[1], P2PData(src=key[0], dst=key[1], tag=key[2], pseq=key[3], payloads=send.payloads))

    def fail(self, rank: int, message: str) -> None:
        """Send Error to ``rank`` (all its waits fail)."""
        self._reply(rank, Error(code="peer_failed", message=message))

    def close(self) -> None:
        self._listener.close()

