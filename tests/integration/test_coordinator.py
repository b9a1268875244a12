"""The trio coordinator against fake ranks speaking the protocol over real
ZeroMQ (no torch): registration, collectives, slots, and the failure paths
(mismatch, deadlock, a dead rank) ending as results with a valid trace.

Tests that wait for a quiet period, a grace period or a registration stall
run on trio's virtual clock (``autojump_clock``): the fake ranks are trio
tasks in the coordinator's loop and talk over ``inproc://``, where a send
reaches the peer's socket within the sending call, so no party acts outside
the loop while the clock jumps. (Over ``ipc://`` ZeroMQ's I/O thread carries
the bytes, and the clock could jump past a quiet period while a message is
in flight.) Where the coordinator launches "processes" (a worker thread),
the clock stays frozen (``mock_clock``) until that launch returns."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
import trio
import zmq

from prism.shell.coordinator import CaptureResult, Coordinator
from prism.core import protocol as P
from prism.core import trace as T
from prism.shell import runfolder
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
                       endpoint=kw.pop("endpoint", None) or default_endpoint(tmp_path / "run"), **kw)


_inproc = itertools.count()


def inproc() -> str:
    return f"inproc://prism-test-coordinator-{os.getpid()}-{next(_inproc)}"


async def serve(tmp_path, world: int, rank_main: Callable[[int, str], Awaitable[None]], *,
                ranks: int | None = None, cancel_ranks: bool = False, **kw) -> CaptureResult:
    """Run a coordinator for ``world`` ranks; once it listens, ``rank_main(r,
    endpoint)`` runs as a task for each of the first ``ranks`` (default: all).
    ``cancel_ranks``: cancel the rank tasks when the run ends."""
    async with trio.open_nursery() as n:
        def start(endpoint: str) -> None:
            for r in range(world if ranks is None else ranks):
                n.start_soon(rank_main, r, endpoint)

        result = await make(tmp_path, world, on_listening=start, **kw).run()
        if cancel_ranks:
            n.cancel_scope.cancel()
    return result


async def test_collective_roundtrip_and_valid_trace(tmp_path):
    world = 3
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

    result = await serve(tmp_path, world, rank_main, slots=1)
    assert result.status == "ok", result.message
    for r in range(world):
        np.testing.assert_array_equal(results[r], np.full(4, 6, np.float32))
    runfolder.write_manifest(tmp_path / "run", T.Manifest(1, "t", world, 0, ("x",), "cpu", "0", "0", "h"))
    run = runfolder.read_run(tmp_path / "run")
    assert sorted(run.ranks) == [0, 1, 2]
    assert all(type(evs[-1]).__name__ == "RankEnd" for evs in run.ranks.values())


async def test_mismatch_names_ranks_group_and_both_calls(tmp_path, autojump_clock):
    async def rank_main(r, endpoint):
        fr = FakeRank(r, 2, endpoint)
        await fr.start()
        res = await fr.all_reduce(np.ones(2, np.float32), op="all_reduce" if r == 0 else "all_gather_into_tensor")
        assert isinstance(res, (P.Error, P.Shutdown))
        fr.close()

    t0 = trio.current_time()
    result = await serve(tmp_path, 2, rank_main, grace_s=0.5, endpoint=inproc())
    assert result.status == "mismatch"
    assert result.exit_code == 1
    msg = result.message
    assert "all_reduce" in msg and "all_gather_into_tensor" in msg and "world" in msg
    # Within 5 s of the coordinator's clock: the grace period is all it waits.
    assert trio.current_time() - t0 < 5
    # The trace so far is closed with rank_end records.
    for r in range(2):
        events = runfolder.read_rank_file(runfolder.rank_path(tmp_path / "run", r)).events
        assert type(events[-1]).__name__ == "RankEnd"


async def test_deadlock_reported_rank_by_rank(tmp_path, autojump_clock):

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

    t0 = trio.current_time()
    result = await serve(tmp_path, 2, rank_main, quiet_s=1.0, grace_s=0.5, endpoint=inproc())
    assert result.status == "deadlock", result.message
    assert trio.current_time() - t0 >= 1.0  # after the quiet period, not before
    text = result.message
    assert "rank 0:" in text and "rank 1:" in text
    assert "missing: 1" in text or "missing" in text
    assert "tag 7" in text


class FakeProcesses:
    """The launcher's handle, for rank tasks that play processes. Launching
    it (in the coordinator's worker thread) lets the virtual clock jump: up to
    then it stands still, so it cannot run past a quiet period while the
    thread is on its way."""

    def __init__(self, clock: trio.testing.MockClock):
        self.exited: dict[int, int] = {}
        self.killed = self.closed = False
        self.clock = clock

    def launch(self, endpoint: str) -> FakeProcesses:
        trio.from_thread.run_sync(setattr, self.clock, "autojump_threshold", 0)
        return self

    def poll(self):
        return [self.exited.get(r) for r in range(2)]

    def kill_all(self):
        self.killed = True

    def wait(self, timeout=None):
        return self.poll()

    def close(self):
        self.closed = True


async def test_dead_rank_stops_the_others(tmp_path, mock_clock):
    procs = FakeProcesses(mock_clock)

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

    result = await serve(tmp_path, 2, rank_main, grace_s=0.5, launch=procs.launch, endpoint=inproc())
    assert result.status == "rank_failed"
    assert "rank 1" in result.message and "SIGKILL" in result.message
    assert procs.killed and procs.closed
    assert set(result.failed_ranks) == {1}


async def test_exit_seen_before_the_goodbye_is_not_a_crash(tmp_path, mock_clock):
    # Under load the process watcher can see a rank's exit (status 0) before
    # its Goodbye is read from the socket (seen at world 256 on a busy host).
    procs = FakeProcesses(mock_clock)

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

    result = await serve(tmp_path, 2, rank_main, launch=procs.launch, endpoint=inproc())
    assert result.status == "ok", result.message
    assert procs.closed


async def test_registration_fails_only_when_it_stalls(tmp_path, autojump_clock):
    # Ranks keep arriving (each within the stall limit, all of them later than
    # it): the run goes on. Then one never comes: the run ends, naming it.
    world = 4

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

    t0 = trio.current_time()
    result = await serve(tmp_path, world, rank_main, cancel_ranks=True, register_stall_s=1.0, endpoint=inproc())
    assert result.status == "deadlock", result.message
    assert "only 3 of 4 ranks registered" in result.message and "missing: 3" in result.message
    assert trio.current_time() - t0 > 2.0  # rank 2 came after 1.2 s and did not end the run


async def test_version_mismatch_is_refused(tmp_path):
    async def peer(r, endpoint):
        sock = AsyncSocket.create(zmq.DEALER)
        sock.connect(endpoint)
        await sock.send_message(P.Hello(P.PROTOCOL_VERSION + 1, 0, 1, 0, 1, "h", "cpu", 0))
        _, reply = await sock.recv_message()
        assert isinstance(reply, P.Error) and reply.code == "version"
        assert "protocol" in reply.message and "same Prism version" in reply.message
        sock.close()
        raise Refused

    with pytest.RaisesGroup(Refused):
        await serve(tmp_path, 1, peer)


class Refused(Exception):
    """The peer got its answer: ends a run that would wait for ever."""


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_world_size(tmp_path, bad):
    with pytest.raises(ValueError, match="world size must be at least 1"):
        make(tmp_path, bad)


async def test_messages_out_of_place_are_refused(tmp_path, autojump_clock):
    # Before Hello, and a type no rank may send: each gets Error(bad_message)
    # and the capture goes on.
    async def rank_main(r, endpoint):
        fr = FakeRank(r, 1, endpoint)
        await fr.sock.send_message(P.SlotRequest(0))
        _, early = await fr.sock.recv_message()
        assert isinstance(early, P.Error) and early.code == "bad_message" and "before Hello" in early.message
        assert isinstance(await fr.hello(), P.Welcome)
        await fr.sock.send_message(P.SlotGrant(0))
        _, odd = await fr.sock.recv_message()
        assert isinstance(odd, P.Error) and odd.code == "bad_message" and odd.rank == 0
        assert "a rank may not send SlotGrant" in odd.message
        await fr.bye()
        fr.close()

    result = await serve(tmp_path, 1, rank_main, endpoint=inproc())
    assert result.status == "ok", result.message


async def test_coordinator_time_is_the_ranks_clock(tmp_path):
    # On the real clock the coordinator's now (here: the Welcome's) is
    # time.monotonic_ns(), the clock ranks stamp their trace with.
    async def rank_main(r, endpoint):
        fr = FakeRank(r, 1, endpoint)
        before = time.monotonic_ns()
        welcome = await fr.hello()
        after = time.monotonic_ns()
        assert before - 1_000_000 <= welcome.t_ns <= after + 1_000_000
        await fr.bye()
        fr.close()

    result = await serve(tmp_path, 1, rank_main)
    assert result.status == "ok", result.message
