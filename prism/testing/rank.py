"""A scripted fake rank: the protocol a real rank speaks, driven by a test.

``FakeRank`` stands in for a rank process (``prism/rank``): its async
methods mirror torch.distributed's calls (``all_reduce``, ``all_gather``,
``broadcast``, ``send``/``recv``, ``barrier``, ``new_group``) and send what
the real backend sends for them, in the same order (the call holding a
slot, then ``Wait`` and ``SlotRelease``, the reply, ``SlotRequest`` and the
grant), and ship the trace records a real rank writes (``RankStart``,
``GroupCreated``, ``Collective``, ``P2P``, ``Iteration``, ``RankEnd``). The
coordinator under test cannot tell it from a process, so a scripted world
exercises its real matching, scheduling, deadlock and failure paths.

Tensors are numpy arrays; a call given a shape instead (``(1024,)`` and a
``dtype``, which may be one numpy lacks, e.g. ``bfloat16``) sends zeros.
Results are what the coordinator computed (``prism.core.collectives``).

The socket is anything with ``send_message``/``recv_message``: a DEALER of
``transport.memory.MemoryRouter`` (``prism.testing.emulated_world``) or a
real ZeroMQ DEALER (``transport.trio_socket.AsyncSocket``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import trio

from prism.core import collectives as C
from prism.core import matcher as M
from prism.core import protocol as P
from prism.core import trace as T

__all__ = ["FakeRank", "Group", "RankKilled", "RankStopped", "Tensor"]

#: What a call takes: an array, or a shape (zeros of the call's ``dtype``).
Tensor = np.ndarray | Sequence[int]


class RankStopped(Exception):
    """The coordinator ended this rank's call with ``Error`` or ``Shutdown``
    (a mismatch, a deadlock, a failed peer). ``reply`` is that message."""

    def __init__(self, rank: int, reply: P.Message):
        self.rank = rank
        self.reply = reply
        text = reply.message if isinstance(reply, P.Error) else getattr(reply, "reason", str(reply))
        code = reply.code if isinstance(reply, P.Error) else "shutdown"
        self.code = code
        super().__init__(f"rank {rank}: the coordinator stopped it ({code}): {text}")


class RankKilled(Exception):
    """The rank was killed (``FakeRank.die``, ``EmulatedWorld.kill``): its
    script stops where it was."""


@dataclass(frozen=True, slots=True)
class Group:
    """A communicator as ``new_group`` returns it: ``gid`` (as the trace
    names it), its global ``ranks`` in group-rank order, its creation index."""

    gid: str
    ranks: tuple[int, ...]
    index: int

    def group_rank(self, rank: int) -> int:
        """``rank``'s place in the group (``ValueError`` if it is no member)."""
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not a member of group {self.gid} (ranks {list(self.ranks)})") from None


class _Socket(Protocol):
    async def send_message(self, msg: P.Message, identity: bytes | None = None) -> None: ...

    async def recv_message(self) -> tuple[bytes | None, P.Message]: ...

    def close(self) -> None: ...


def _dtype_name(dtype: Any) -> str:
    name = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
    if name not in C.DTYPES:
        raise ValueError(f"dtype {name!r} is not one Prism's collectives support ({sorted(C.DTYPES)})")
    return name


def _payload(x: Tensor, dtype: str | None) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype name, shape, raw bytes) of a call's tensor."""
    if isinstance(x, np.ndarray):
        name = _dtype_name(x.dtype if dtype is None else dtype)
        arr = np.ascontiguousarray(x, dtype=C.storage_dtype(name))
        return name, tuple(arr.shape), arr.tobytes()
    shape = tuple(int(d) for d in x)
    if any(d < 0 for d in shape):
        raise ValueError(f"a shape needs dimensions >= 0, got {shape}")
    name = _dtype_name(dtype or "float32")
    return name, shape, bytes(C.nbytes(name, shape))


class FakeRank:
    """Rank ``rank`` of ``world_size`` on ``sock`` (see the module docstring).

    ``init()`` registers (Hello, the WORLD group, a slot); ``finish()`` ends
    (``RankEnd``, ``Goodbye``). A call the coordinator refuses raises
    ``RankStopped``. ``world`` is the WORLD group (``gid`` "world").
    """

    def __init__(self, rank: int, world_size: int, sock: _Socket, *, hostname: str = "fake-host",
                 device: str = "cpu", on_die: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.sock = sock
        self.hostname = hostname
        self.device = device
        self.world = Group("world", tuple(range(world_size)), 0)
        #: Every group created so far, WORLD first (as torch counts them on every rank).
        self.groups: list[Group] = [self.world]
        self.welcome: P.Welcome | None = None
        #: The iteration running now (``step()`` ends it).
        self.step_index = 0
        self.finished = False
        self.killed = False
        self._on_die = on_die
        self._seq: dict[str, int] = {}
        self._pseq: dict[tuple[int, int, int], int] = {}
        self._early: dict[tuple, P.Message] = {}
        self._base_ns = 0

    # --- the clock ---------------------------------------------------------

    def now_ns(self) -> int:
        """The rank's clock: the coordinator's (it says so in ``Welcome``),
        advancing with trio's clock, so virtual time shows in the trace."""
        if self.welcome is None:
            return time.monotonic_ns()
        return self._base_ns + round(trio.current_time() * 1e9)

    # --- the messages --------------------------------------------------------

    async def send_message(self, msg: P.Message) -> None:
        """Send a raw protocol message (``send`` is torch's point-to-point send)."""
        if self.killed:
            raise RankKilled(f"rank {self.rank} was killed")
        try:
            await self.sock.send_message(msg)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            self.killed = True
            raise RankKilled(f"rank {self.rank} was killed") from None

    async def receive(self, key: tuple) -> P.Message:
        """The coordinator's reply under routing key ``key``
        (``protocol.routing_key``); replies for other keys wait their turn.
        ``Error`` and ``Shutdown`` raise ``RankStopped``."""
        if key in self._early:
            return self._early.pop(key)
        while True:
            msg = await self._recv()
            got = P.routing_key(msg)
            if got is None:
                raise RankStopped(self.rank, msg)
            if got == key:
                return msg
            self._early[got] = msg

    async def _recv(self) -> P.Message:
        """The next message from the coordinator; ``RankKilled`` once this
        rank's connection is gone."""
        try:
            _, msg = await self.sock.recv_message()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            self.killed = True
            raise RankKilled(f"rank {self.rank} was killed") from None
        return msg

    async def trace(self, *events: T.Event) -> None:
        """Ship trace records (what ``prism.rank.recorder`` batches)."""
        await self.send_message(P.TraceRecords(self.rank, payloads=tuple(T.encode_event(e) for e in events)))

    async def _block(self, what: str, key: tuple) -> P.Message:
        """Wait for a reply without the slot, as ``RankRuntime.block_on`` does."""
        await self.send_message(P.Wait(self.rank, what, self.now_ns()))
        await self.send_message(P.SlotRelease(self.rank))
        reply = await self.receive(key)
        await self._acquire()
        return reply

    async def _acquire(self) -> None:
        await self.send_message(P.SlotRequest(self.rank))
        await self.receive(("slot",))

    # --- lifecycle --------------------------------------------------------------

    async def hello(self, *, protocol_version: int = P.PROTOCOL_VERSION) -> P.Message:
        """Say Hello; the reply (``Welcome``, or the coordinator's ``Error``)."""
        await self.send_message(P.Hello(protocol_version, self.rank, self.world_size, self.rank, os.getpid(),
                                 self.hostname, self.device, time.monotonic_ns()))
        while True:
            msg = await self._recv()
            if isinstance(msg, P.Welcome):
                self.welcome = msg
                self._base_ns = msg.t_ns - round(trio.current_time() * 1e9)
                return msg
            if isinstance(msg, (P.Error, P.Shutdown)):
                return msg
            self._early[P.routing_key(msg)] = msg

    async def init(self) -> None:
        """``init_process_group``: Hello, the trace's start, the WORLD group, a slot."""
        reply = await self.hello()
        if not isinstance(reply, P.Welcome):
            raise RankStopped(self.rank, reply)
        now = self.now_ns()
        await self.trace(T.RankStart(self.rank, self.world_size, self.rank, os.getpid(), self.hostname,
                                     self.device, self.device, 0, now),
                         T.GroupCreated("world", self.world.ranks, 0, "0", now))
        await self.send_message(P.GroupCreate(self.rank, "world", 0, self.world.ranks, "0"))
        await self._acquire()

    async def new_group(self, ranks: Sequence[int]) -> Group:
        """``dist.new_group(ranks)``: call it on every rank, in the same order
        (torch numbers groups on every rank); members announce it."""
        members = tuple(int(r) for r in ranks)
        bad = [r for r in members if not 0 <= r < self.world_size]
        if not members or bad or len(set(members)) != len(members):
            raise ValueError(f"new_group({list(members)}): ranks must be distinct members of the world "
                             f"0..{self.world_size - 1}")
        index = len(self.groups)
        group = Group(T.group_id(index, members), members, index)
        self.groups.append(group)
        if self.rank in members:
            await self.send_message(P.GroupCreate(self.rank, group.gid, index, members, str(index)))
            await self.trace(T.GroupCreated(group.gid, members, index, str(index), self.now_ns()))
        return group

    async def compute(self, seconds: float) -> None:
        """Work between calls: ``seconds`` pass (virtual under ``autojump_clock``)
        and a ``Compute`` record says so."""
        start = self.now_ns()
        await trio.sleep(seconds)
        await self.trace(T.Compute(start, self.now_ns(), self.step_index))

    async def step(self) -> None:
        """The optimizer step ended the iteration (``Iteration``, ``Heartbeat``)."""
        now = self.now_ns()
        await self.trace(T.Iteration(self.step_index, now))
        await self.send_message(P.Heartbeat(self.rank, now, self.step_index))
        self.step_index += 1

    async def finish(self, status: str = "ok", message: str = "") -> None:
        """The script ended: ``RankEnd`` and ``Goodbye`` (``status`` "error":
        it raised, ``message`` its traceback)."""
        if self.finished:
            return
        self.finished = True
        await self.trace(T.RankEnd(self.now_ns(), status, message[:4000]))
        await self.send_message(P.Goodbye(self.rank, status, message, self.now_ns()))

    async def fail(self, message: str) -> None:
        """The script raised: ends the rank with status "error" and ``message``."""
        await self.finish("error", message)

    def die(self, code: int = -9) -> None:
        """The process dies now (``-9``: SIGKILL; ``code >= 0``: it exited
        without a goodbye): no more messages; raises ``RankKilled``."""
        self.kill(code)
        raise RankKilled(f"rank {self.rank} died (exit code {code})")

    def kill(self, code: int = -9) -> None:
        """Kill the rank from outside: its connection closes and the
        world's process handle reports ``code``; its pending call raises ``RankKilled``."""
        if self.killed:
            return
        self.killed = True
        self.sock.close()
        if self._on_die is not None:
            self._on_die(self.rank, code)

    # --- collectives ----------------------------------------------------------

    def _group(self, group: Group | None) -> Group:
        return self.world if group is None else group

    async def collective(self, op: str, inputs: Sequence[Tensor], out_shapes: Sequence[Sequence[int]], *,
                         dtype: str | None = None, reduce_op: str = "", root: int = -1,
                         group: Group | None = None) -> list[np.ndarray]:
        """Any collective, as the backend sends it: ``inputs`` (arrays or
        shapes), the output shapes, ``root`` a group rank. Returns the
        outputs the coordinator computed (one array per output shape it sent)."""
        g = self._group(group)
        staged = [_payload(x, dtype) for x in inputs]
        name = staged[0][0] if staged else (_dtype_name(dtype) if dtype else "uint8")
        in_shapes = tuple(s for _, s, _ in staged)
        payloads = tuple(b for _, _, b in staged)
        me = g.ranks.index(self.rank) if self.rank in g.ranks else -1
        if op == "broadcast" and me != root:
            payloads = ()
        seq = self._seq.get(g.gid, 0)
        self._seq[g.gid] = seq + 1
        issue = self.now_ns()
        outs = tuple(tuple(int(d) for d in s) for s in out_shapes)
        await self.send_message(P.CollectiveArrive(self.rank, g.gid, seq, op, reduce_op, name, in_shapes, outs,
                                            root=root, issue_ns=issue, payloads=payloads))
        reply = await self._block(M.wait_key_coll(g.gid, seq), ("coll", g.gid, seq))
        end = self.now_ns()
        await self.trace(T.Collective(g.gid, seq, op, reduce_op, name, in_shapes, outs,
                                      sum(C.nbytes(name, s) for s in in_shapes), root=root, issue_ns=issue,
                                      wait_ns=issue, end_ns=end, step=self.step_index))
        got = list(reply.payloads)
        shapes = outs if len(outs) == len(got) else in_shapes
        return [C.to_array(p, name, s).copy() for p, s in zip(got, shapes)]

    async def all_reduce(self, x: Tensor, op: str = "SUM", *, dtype: str | None = None,
                         group: Group | None = None) -> np.ndarray:
        """``dist.all_reduce``: the reduced array."""
        _, shape, _ = _payload(x, dtype)
        return (await self.collective("all_reduce", [x], [shape], dtype=dtype, reduce_op=op, group=group))[0]

    async def all_gather(self, x: Tensor, *, dtype: str | None = None, group: Group | None = None) -> list[np.ndarray]:
        """``dist.all_gather`` (list output): every member's array, in group order."""
        g = self._group(group)
        _, shape, _ = _payload(x, dtype)
        return await self.collective("all_gather", [x], [shape] * len(g.ranks), dtype=dtype, group=group)

    async def all_gather_into_tensor(self, x: Tensor, *, dtype: str | None = None,
                                     group: Group | None = None) -> np.ndarray:
        """``dist.all_gather_into_tensor``: the members' arrays stacked along dim 0."""
        g = self._group(group)
        _, shape, _ = _payload(x, dtype)
        out = (len(g.ranks) * (shape[0] if shape else 1), *shape[1:])
        return (await self.collective("all_gather_into_tensor", [x], [out], dtype=dtype, group=group))[0]

    async def reduce_scatter_tensor(self, x: Tensor, op: str = "SUM", *, dtype: str | None = None,
                                    group: Group | None = None) -> np.ndarray:
        """``dist.reduce_scatter_tensor``: this member's part of the reduced array (dim 0)."""
        g = self._group(group)
        _, shape, _ = _payload(x, dtype)
        n = len(g.ranks)
        out = (shape[0] // n if shape else 0, *shape[1:])
        got = await self.collective("reduce_scatter_tensor", [x], [out], dtype=dtype, reduce_op=op, group=group)
        return got[0].reshape(out)

    async def broadcast(self, x: Tensor, src: int, *, dtype: str | None = None,
                        group: Group | None = None) -> np.ndarray:
        """``dist.broadcast`` from global rank ``src``: the root's array (the
        root gets its own back)."""
        g = self._group(group)
        _, shape, _ = _payload(x, dtype)
        got = await self.collective("broadcast", [x], [shape], dtype=dtype, root=g.group_rank(src), group=group)
        if got:
            return got[0]
        name, shape, raw = _payload(x, dtype)
        return C.to_array(raw, name, shape).copy()

    async def barrier(self, *, group: Group | None = None) -> None:
        """``dist.barrier``."""
        await self.collective("barrier", [], [], group=group)

    # --- point to point -----------------------------------------------------------

    def _next_pseq(self, src: int, dst: int, tag: int) -> int:
        n = self._pseq.get((src, dst, tag), 0)
        self._pseq[(src, dst, tag)] = n + 1
        return n

    async def send(self, x: Tensor, dst: int, *, tag: int = 0, dtype: str | None = None,
                          group: Group | None = None) -> None:
        """``dist.send`` to global rank ``dst`` (eager: returns at once)."""
        g = self._group(group)
        name, shape, raw = _payload(x, dtype)
        pseq = self._next_pseq(self.rank, dst, tag)
        now = self.now_ns()
        await self.send_message(P.Send(self.rank, g.gid, dst, tag, pseq, name, shape, issue_ns=now, payloads=(raw,)))
        await self.trace(T.P2P("send", g.gid, dst, tag, pseq, name, shape, C.nbytes(name, shape),
                               issue_ns=now, wait_ns=now, end_ns=now, step=self.step_index))

    async def recv(self, x: Tensor, src: int, *, tag: int = 0, dtype: str | None = None,
                   group: Group | None = None) -> np.ndarray:
        """``dist.recv`` from global rank ``src`` into a tensor like ``x``
        (an array or a shape): what the sender sent."""
        g = self._group(group)
        name, shape, _ = _payload(x, dtype)
        pseq = self._next_pseq(src, self.rank, tag)
        issue = self.now_ns()
        await self.send_message(P.RecvPost(self.rank, g.gid, src, tag, pseq, name, shape, issue_ns=issue))
        reply = await self._block(M.wait_key_p2p(src, self.rank, tag, pseq), ("p2p", src, self.rank, tag, pseq))
        await self.trace(T.P2P("recv", g.gid, src, tag, pseq, name, shape, C.nbytes(name, shape),
                               issue_ns=issue, wait_ns=issue, end_ns=self.now_ns(), step=self.step_index))
        return C.to_array(reply.payloads[0], name, shape).copy()
