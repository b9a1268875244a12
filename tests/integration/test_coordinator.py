"""The trio coordinator against fake ranks speaking the protocol (no torch):
registration, collectives, slots, and the failure paths (mismatch,
deadlock, a dead rank) ending as results with a valid trace.

Most tests use ``prism.testing``: the real coordinator serves an in-memory
ROUTER (``transport.memory.MemoryRouter``) in the test's loop, the fake
ranks are ``prism.testing.FakeRank`` tasks of that loop and the process
handle is a fake one called in the loop, so nothing happens outside it and
trio's virtual clock (``autojump_clock``) can jump over quiet periods,
grace periods and registration stalls. One test runs the same fake ranks
over the coordinator's own ZeroMQ ROUTER (ipc)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import trio
import zmq

from prism.core import protocol as P
from prism.core import trace as T
from prism.shell import runfolder
from prism.shell.coordinator import Coordinator
from prism.testing import FakeRank, RankStopped, assert_failed, assert_ok, emulated_world
from transport.endpoints import default_endpoint
from transport.trio_socket import AsyncSocket


async def test_collective_roundtrip_and_valid_trace(tmp_path, autojump_clock):
    async def script(rank):
        return await rank.all_reduce(np.full(4, rank.rank + 1, np.float32))

    async with emulated_world(3, tmp_path / "run", slots=1) as world:
        result = await world.run(script)
    assert_ok(result)
    for r in range(3):
        np.testing.assert_array_equal(world.outcomes.returns[r], np.full(4, 6, np.float32))
    trace = world.trace()
    assert trace.ranks == [0, 1, 2] and trace.problems() == []
    assert all(trace.end(r) is not None for r in range(3))


async def test_collective_roundtrip_over_zeromq(tmp_path):
    world, results = 3, {}

    async def rank_main(r: int, endpoint: str) -> None:
        sock = AsyncSocket.create(zmq.DEALER)
        sock.connect(endpoint)
        rank = FakeRank(r, world, sock)
        await rank.init()
        results[r] = await rank.all_reduce(np.full(4, r + 1, np.float32))
        await rank.finish()
        sock.close()

    run_dir = tmp_path / "run"
    async with trio.open_nursery() as n:
        def start(endpoint: str) -> None:
            for r in range(world):
                n.start_soon(rank_main, r, endpoint)

        result = await Coordinator(run_dir, world, slots=1, endpoint=default_endpoint(run_dir),
                                   on_listening=start).run()
    assert result.status == "ok", result.message
    for r in range(world):
        np.testing.assert_array_equal(results[r], np.full(4, 6, np.float32))
    runfolder.write_manifest(run_dir, T.Manifest(1, "t", world, 0, ("x",), "cpu", "0", "0", "h"))
    run = runfolder.read_run(run_dir)
    assert sorted(run.ranks) == [0, 1, 2]
    assert all(type(evs[-1]).__name__ == "RankEnd" for evs in run.ranks.values())
    assert not list(run_dir.glob("*.sock"))


async def test_mismatch_names_ranks_group_and_both_calls(tmp_path, autojump_clock):
    async def script(rank):
        if rank.rank == 0:
            await rank.all_reduce(np.ones(2, np.float32))
        else:
            await rank.all_gather_into_tensor(np.ones(2, np.float32))

    t0 = trio.current_time()
    async with emulated_world(2, tmp_path / "run", grace_s=0.5) as world:
        result = await world.run(script)
    assert_failed(result, "mismatch")
    assert result.exit_code == 1
    msg = result.message
    assert "all_reduce" in msg and "all_gather_into_tensor" in msg and "world" in msg
    # Both ranks' calls were answered with Error or Shutdown.
    assert sorted(world.outcomes.stopped) == [0, 1]
    assert all(isinstance(e.reply, (P.Error, P.Shutdown)) for e in world.outcomes.stopped.values())
    # Within 5 s of the coordinator's clock: the grace period is all it waits.
    assert trio.current_time() - t0 < 5
    # The trace so far is closed with rank_end records.
    for r in range(2):
        events = runfolder.read_rank_file(runfolder.rank_path(tmp_path / "run", r)).events
        assert type(events[-1]).__name__ == "RankEnd"


async def test_deadlock_reported_rank_by_rank(tmp_path, autojump_clock):
    async def script(rank):
        if rank.rank == 0:
            await rank.all_reduce(np.ones(2, np.float32))  # rank 1 never reaches it
        else:
            await rank.recv((2,), src=0, tag=7, dtype="float32")

    t0 = trio.current_time()
    async with emulated_world(2, tmp_path / "run", quiet_s=1.0, grace_s=0.5) as world:
        result = await world.run(script)
    assert_failed(result, "deadlock")
    assert trio.current_time() - t0 >= 1.0  # after the quiet period, not before
    text = result.message
    assert "rank 0:" in text and "rank 1:" in text
    assert "missing" in text
    assert "tag 7" in text
    assert sorted(world.outcomes.stopped) == [0, 1]


async def test_dead_rank_stops_the_others(tmp_path, autojump_clock):
    async def script(rank):
        if rank.rank == 0:
            await rank.all_reduce(np.ones(2, np.float32))
        else:
            await trio.sleep(0.2)
            rank.die(-9)

    async with emulated_world(2, tmp_path / "run", grace_s=0.5) as world:
        result = await world.run(script)
    assert_failed(result, "died", rank=1, match="SIGKILL")
    assert world.processes.killed and world.processes.closed
    assert set(result.failed_ranks) == {1}
    assert isinstance(world.outcomes.stopped[0], RankStopped)


async def test_exit_seen_before_the_goodbye_is_not_a_crash(tmp_path, autojump_clock):
    # Under load the process watcher can see a rank's exit (status 0) before
    # its Goodbye is read from the socket (seen at world 256 on a busy host).
    async def script(rank):
        await rank.all_reduce(np.ones(2, np.float32))
        if rank.rank == 1:
            world.processes.exit(1, 0)
            await trio.sleep(1.0)  # several watcher polls and ticks before the Goodbye

    async with emulated_world(2, tmp_path / "run") as world:
        result = await world.run(script)
    assert_ok(result)
    assert world.processes.closed


async def test_registration_fails_only_when_it_stalls(tmp_path, autojump_clock):
    # Ranks keep arriving (each within the stall limit, all of them later than
    # it): the run goes on. Then one never comes: the run ends, naming it.
    async def script(rank):
        await trio.sleep(0.6 * rank.rank)  # rank 2 arrives 1.2 s after the start
        assert isinstance(await rank.hello(), P.Welcome)
        await trio.sleep(10)  # keeps its connection; cancelled when the run ends

    t0 = trio.current_time()
    async with emulated_world(4, tmp_path / "run", register_stall_s=1.0) as world:
        result = await world.run({r: script for r in range(3)}, init=False)  # rank 3 never registers
    assert result.status == "deadlock", result.message
    assert "only 3 of 4 ranks registered" in result.message and "missing: 3" in result.message
    assert trio.current_time() - t0 > 2.0  # rank 2 came after 1.2 s and did not end the run


async def test_version_mismatch_is_refused(tmp_path, autojump_clock):
    async with emulated_world(1, tmp_path / "run") as world:
        reply = await world.rank(0).hello(protocol_version=P.PROTOCOL_VERSION + 1)
        assert isinstance(reply, P.Error) and reply.code == "version"
        assert "protocol" in reply.message and "same Prism version" in reply.message
        # Refused: the coordinator still waits for its rank (leaving the block stops it).
        assert world.coordinator.ranks == {}


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_world_size(tmp_path, bad):
    with pytest.raises(ValueError, match="world size must be at least 1"):
        Coordinator(tmp_path / "run", bad, slots=2, endpoint=default_endpoint(tmp_path / "run"))


async def test_messages_out_of_place_are_refused(tmp_path, autojump_clock):
    # Before Hello, and a type no rank may send: each gets Error(bad_message)
    # and the capture goes on.
    async def script(rank):
        await rank.send_message(P.SlotRequest(0))
        _, early = await rank.sock.recv_message()
        assert isinstance(early, P.Error) and early.code == "bad_message" and "before Hello" in early.message
        assert isinstance(await rank.hello(), P.Welcome)
        await rank.send_message(P.SlotGrant(0))
        _, odd = await rank.sock.recv_message()
        assert isinstance(odd, P.Error) and odd.code == "bad_message" and odd.rank == 0
        assert "a rank may not send SlotGrant" in odd.message

    async with emulated_world(1, tmp_path / "run") as world:
        assert_ok(await world.run(script, init=False))


async def test_a_scheduler_error_ends_the_capture_as_a_result(tmp_path, autojump_clock):
    # A slot released twice is Prism's own bookkeeping gone wrong (a rank
    # cannot do it): the capture ends "invalid" with the scheduler's words and
    # a valid trace, not with an exception out of the coordinator.
    async def script(rank):
        await rank.send_message(P.SlotRelease(0))
        await rank.send_message(P.SlotRelease(0))
        await rank.compute(60)

    async with emulated_world(1, tmp_path / "run") as world:
        result = await world.run(script)
    assert_failed(result, "invalid", match=r"(?s)Prism's scheduler stopped the capture: rank 0 released a slot it "
                                           r"does not hold.*Prism bug.*The trace so far is kept")
    assert world.trace().problems() == []


async def test_coordinator_time_is_the_ranks_clock(tmp_path):
    # On the real clock the coordinator's now (here: the Welcome's) is
    # time.monotonic_ns(), the clock ranks stamp their trace with.
    async def script(rank):
        before = time.monotonic_ns()
        welcome = await rank.hello()
        after = time.monotonic_ns()
        assert before - 1_000_000 <= welcome.t_ns <= after + 1_000_000

    async with emulated_world(1, tmp_path / "run") as world:
        assert_ok(await world.run(script, init=False))
