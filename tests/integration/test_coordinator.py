"""The trio coordinator against fake ranks speaking the protocol over real
ZeroMQ (no torch): registration, collectives, slots, and the failure paths
(mismatch, deadlock, a dead rank) ending as results with a valid trace."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import trio
import zmq

from prism.shell.coordinator import Coordinator
from prism.core import protocol as P
from prism.core import trace as T
from transport.endpoints import default_endpoint
from transport.trio_socket import AsyncSocket


class FakeRank:
    def __init__(self, rank: int, world: int, endpoint: str):
        self.rank, self.world = rank, world
        self.sock = AsyncSocket.create(zmq.DEALER)
        self.sock.connect(endpoint)
        self.seq: dict[str, int] = {}

    async def hello(self) -> P.Message:
        await self.sock.send_message(P.Hello(P.PROTOCOL_VERSION, self.rank, self.world, self.rank, os.getpid(),
                                             "host", "cpu", time.monotonic_ns()))
        _, msg = await self.sock.recv_message()
        return msg

    async def trace(self, *events) -> None:
        await self.sock.send_message(P.TraceRecords(self.rank, payloads=tuple(T.encode_event(e) for e in events)))

    async def start(self) -> None:
        welcome = await self.hello()
        assert isinstance(welcome, P.Welcome)
        await self.trace(T.RankStart(self.rank, self.world, self.rank, os.getpid(), "host", "cpu", "cpu", 0, 0),
                         T.GroupCreated("world", tuple(range(self.world)), 0, "0", 0))
        await self.sock.send_message(P.GroupCreate(self.rank, "world", 0, tuple(range(self.world)), "0"))
        await self.sock.send_message(P.SlotRequest(self.rank))
        _, grant = await self.sock.recv_message()
        assert isinstance(grant, P.SlotGrant)

    async def all_reduce(self, values: np.ndarray, op: str = "all_reduce") -> P.Message:
        seq = self.seq.get("world", 0)
        self.seq["world"] = seq + 1
        await self.sock.send_message(P.SlotRelease(self.rank))
        shape = tuple(values.shape)
        await self.sock.send_message(P.CollectiveArrive(
            self.rank, "world", seq, op, "SUM" if op == "all_reduce" else "", "float32", (shape,),
            (shape,) if op == "all_reduce" else ((self.world * shape[0],),), payloads=(values.tobytes(),)))
        _, res = await self.sock.recv_message()
        return res

    async def bye(self) -> None:
        await self.trace(T.RankEnd(1, "ok"))
        await self.sock.send_message(P.Goodbye(self.rank, "ok"))

    def close(self) -> None:
        self.sock.close()


def make(tmp_path, world, **kw) -> Coordinator:
    return Coordinator(tmp_path / "run", world, slots=kw.pop("slots", 2),
                       endpoint=default_endpoint(tmp_path / "run"), **kw)


async def test_collective_roundtrip_and_valid_trace(tmp_path):
    world = 3
    coord = make(tmp_path, world, slots=1)
    results = {}

    async def rank_main(r, endpoint):
        fr = FakeRank(r, world, endpoint)
        await fr.start()
        res = await fr.all_reduce(np.full(4, r + 1, np.float32))
        results[r] = np.frombuffer(bytes(res.payloads[0]), np.float32)
        await fr.sock.send_message(P.SlotRequest(r))
        await fr.sock.recv_message()
        await fr.bye()
        fr.close()

    async with trio.open_nursery() as n:
        endpoint = await n.start(_serve, coord)
        for r in range(world):
            n.start_soon(rank_main, r, endpoint)
    assert coord.result.status == "ok", coord.result.message
    for r in range(world):
        np.testing.assert_array_equal(results[r], np.full(4, 6, np.float32))
    T.write_manifest(tmp_path / "run", T.Manifest(1, "t", world, 0, ("x",), "cpu", "0", "0", "h"))
    run = T.read_run(tmp_path / "run")
    assert sorted(run.ranks) == [0, 1, 2]
    assert all(type(evs[-1]).__name__ == "RankEnd" for evs in run.ranks.values())


async def _serve(coord, *, task_status):
    coord.result = await coord.run(task_status=task_status)


async def test_mismatch_names_ranks_group_and_both_calls(tmp_path):
    coord = make(tmp_path, 2, grace_s=0.5)

    async def rank_main(r, endpoint):
        fr = FakeRank(r, 2, endpoint)
        await fr.start()
        res = await fr.all_reduce(np.ones(2, np.float32), op="all_reduce" if r == 0 else "all_gather_into_tensor")
        assert isinstance(res, (P.Error, P.Shutdown))
        fr.close()

    t0 = time.monotonic()
    async with trio.open_nursery() as n:
        endpoint = await n.start(_serve, coord)
        for r in range(2):
            n.start_soon(rank_main, r, endpoint)
    assert coord.result.status == "mismatch"
    assert coord.result.exit_code == 1
    msg = coord.result.message
    assert "all_reduce" in msg and "all_gather_into_tensor" in msg and "world" in msg
    assert time.monotonic() - t0 < 5
    run_ranks = T.read_run  # the trace so far is closed with rank_end records
    for r in range(2):
        events = T.read_rank_file(T.rank_path(tmp_path / "run", r)).events
        assert type(events[-1]).__name__ == "RankEnd"


async def test_deadlock_reported_rank_by_rank(tmp_path):
    coord = make(tmp_path, 2, quiet_s=1.0, grace_s=0.5)

    async def rank_main(r, endpoint):
        fr = FakeRank(r, 2, endpoint)
        await fr.start()
        if r == 0:
            # Rank 1 never reaches this collective.
            res = await fr.all_reduce(np.ones(2, np.float32))
            assert isinstance(res, (P.Error, P.Shutdown))
        else:
            await fr.sock.send_message(P.SlotRelease(1))
            await fr.sock.send_message(P.RecvPost(1, "world", 0, 7, 0, "float32", (2,)))
            await fr.sock.send_message(P.Wait(1, "p2p:0:1:7:0", 0))
            _, res = await fr.sock.recv_message()
            assert isinstance(res, (P.Error, P.Shutdown))
        fr.close()

    async with trio.open_nursery() as n:
        endpoint = await n.start(_serve, coord)
        for r in range(2):
            n.start_soon(rank_main, r, endpoint)
    assert coord.result.status == "deadlock", coord.result.message
    text = coord.result.message
    assert "rank 0:" in text and "rank 1:" in text
    assert "missing: 1" in text or "missing" in text
    assert "tag 7" in text


class FakeProcesses:
    def __init__(self):
        self.exited: dict[int, int] = {}
        self.killed = False

    def poll(self):
        return [self.exited.get(r) for r in range(2)]

    def kill_all(self):
        self.killed = True


@pytest.mark.slow
async def test_dead_rank_stops_the_others(tmp_path):
    procs = FakeProcesses()
    coord = make(tmp_path, 2, grace_s=0.5, processes=procs)

    async def rank_main(r, endpoint):
        fr = FakeRank(r, 2, endpoint)
        await fr.start()
        if r == 0:
            res = await fr.all_reduce(np.ones(2, np.float32))
            assert isinstance(res, (P.Error, P.Shutdown))
        else:
            await trio.sleep(0.2)
            procs.exited[1] = -9
        fr.close()

    async with trio.open_nursery() as n:
        endpoint = await n.start(_serve, coord)
        for r in range(2):
            n.start_soon(rank_main, r, endpoint)
    assert coord.result.status == "rank_failed"
    assert "rank 1" in coord.result.message and "SIGKILL" in coord.result.message
    assert procs.killed
    assert set(coord.result.failed_ranks) == {1}


async def test_exit_seen_before_the_goodbye_is_not_a_crash(tmp_path):
    # Under load the process watcher can see a rank's exit (status 0) before
    # its Goodbye is read from the socket (seen at world 256 on a busy host).
    procs = FakeProcesses()
    coord = make(tmp_path, 2, processes=procs)

    async def rank_main(r, endpoint):
        fr = FakeRank(r, 2, endpoint)
        await fr.start()
        res = await fr.all_reduce(np.ones(2, np.float32))
        assert isinstance(res, P.CollectiveResult), res
        await fr.sock.send_message(P.SlotRequest(r))
        await fr.sock.recv_message()
        if r == 1:
            procs.exited[1] = 0
            await trio.sleep(1.0)  # several watcher polls and ticks before the Goodbye
        await fr.bye()
        fr.close()
        procs.exited[r] = 0

    async with trio.open_nursery() as n:
        endpoint = await n.start(_serve, coord)
        for r in range(2):
            n.start_soon(rank_main, r, endpoint)
    assert coord.result.status == "ok", coord.result.message


@pytest.mark.slow
async def test_registration_fails_only_when_it_stalls(tmp_path):
    # Ranks keep arriving (each within the stall limit, all of them later than
    # it): the run goes on. Then one never comes: the run ends, naming it.
    world = 4
    coord = make(tmp_path, world, register_stall_s=1.0)

    async def rank_main(r, endpoint):
        if r == 3:
            return  # never registers
        await trio.sleep(0.6 * r)  # rank 2 arrives 1.2 s after the start
        fr = FakeRank(r, world, endpoint)
        try:
            await fr.hello()
            await trio.sleep(10)  # keeps its connection; cancelled when the run ends
        finally:
            fr.close()

    t0 = time.monotonic()
    async with trio.open_nursery() as n:
        endpoint = await n.start(_serve_then_cancel, coord, n)
        for r in range(world):
            n.start_soon(rank_main, r, endpoint)
    assert coord.result.status == "deadlock", coord.result.message
    assert "only 3 of 4 ranks registered" in coord.result.message and "missing: 3" in coord.result.message
    assert time.monotonic() - t0 > 2.0  # rank 2 came after 1.2 s and did not end the run


async def _serve_then_cancel(coord, nursery, *, task_status):
    coord.result = await coord.run(task_status=task_status)
    nursery.cancel_scope.cancel()


async def test_version_mismatch_is_refused(tmp_path):
    coord = make(tmp_path, 1)
    async with trio.open_nursery() as n:
        endpoint = await n.start(_serve, coord)
        sock = AsyncSocket.create(zmq.DEALER)
        sock.connect(endpoint)
        await sock.send_message(P.Hello(P.PROTOCOL_VERSION + 1, 0, 1, 0, 1, "h", "cpu", 0))
        _, reply = await sock.recv_message()
        assert isinstance(reply, P.Error) and reply.code == "version"
        assert "protocol" in reply.message and "same Prism version" in reply.message
        sock.close()
        n.cancel_scope.cancel()


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_world_size(tmp_path, bad):
    with pytest.raises(ValueError, match="world size must be at least 1"):
        make(tmp_path, bad)
