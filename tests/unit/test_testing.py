"""prism.testing's harness: faults (a dead rank, a dropped and a delayed
message), the calls a fake rank makes and their results, declarative
scripts, the assertion helpers and the pytest fixture. All on the virtual
clock (``autojump_clock``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio

from prism.core import protocol as P
from prism.testing import (
    Op, RankStopped, assert_calls, assert_failed, assert_ok, assert_order, emulated_world, message,
)


async def two_reduces(rank):
    await rank.all_reduce((256,))
    await rank.all_reduce((512,))


async def test_dead_rank_is_named(tmp_path, autojump_clock):
    async def script(rank):
        if rank.rank == 2:
            rank.die()  # SIGKILL before its first call
        await rank.all_reduce((8,))

    async with emulated_world(4, tmp_path) as world:
        result = await world.run(script)
    assert_failed(result, "died", rank=2, match="SIGKILL")
    assert set(result.failed_ranks) == {2}
    assert world.processes.killed and world.processes.closed
    # The others were stopped in their call, and the trace is still valid.
    assert sorted(world.outcomes.stopped) == [0, 1, 3]
    assert world.trace().problems() == []
    assert world.trace().end(2).status == "died"  # closed for it by the coordinator


async def test_killed_from_outside_while_waiting(tmp_path, autojump_clock):
    async def script(rank):
        if rank.rank == 1:
            await trio.sleep(10)
        await rank.all_reduce((8,))

    async with emulated_world(2, tmp_path) as world:
        async with trio.open_nursery() as n:
            async def killer():
                await trio.sleep(5)
                world.kill(1, code=3)
            n.start_soon(killer)
            result = await world.run(script)
    assert_failed(result, "died", rank=1, match="exited with status 3")


async def test_dropped_message_is_a_deadlock_after_the_quiet_period(tmp_path, autojump_clock):
    async with emulated_world(3, tmp_path, quiet_s=20) as world:
        lost = world.drop(message(P.CollectiveArrive, seq=1), rank=1)
        t0 = trio.current_time()
        result = await world.run(two_reduces)
    assert lost.hits == 1
    assert_failed(result, "deadlock", rank=1)
    assert 20 <= trio.current_time() - t0 < 30
    # The first all_reduce completed everywhere; the second nowhere.
    assert_calls(world.trace(), None, [("all_reduce", "world", 1024)])


async def test_delayed_message_completes_later(tmp_path, autojump_clock):
    async with emulated_world(3, tmp_path) as world:
        late = world.delay(message(P.CollectiveArrive, seq=0), 7.0, rank=2)
        result = await world.run(two_reduces)
    assert_ok(result)
    assert late.hits == 1
    trace = world.trace()
    first = trace.calls(rank=0)[0]
    assert (first.end_ns - first.issue_ns) / 1e9 >= 7.0  # rank 0 waited for rank 2's late arrival
    assert_calls(trace, None, [("all_reduce", "world", 1024), ("all_reduce", "world", 2048)])


async def test_delayed_result_to_one_rank(tmp_path, autojump_clock):
    async with emulated_world(2, tmp_path) as world:
        world.delay(message(P.CollectiveResult), 3.0, rank=1, times=1)
        assert_ok(await world.run(two_reduces))
    a, b = (world.trace().calls(rank=r)[0] for r in (0, 1))
    assert (b.end_ns - a.end_ns) / 1e9 >= 3.0


async def test_every_call_and_its_result(tmp_path, autojump_clock):
    async def script(rank):
        r = rank.rank
        pair = await rank.new_group([0, 1])
        other = await rank.new_group([2, 3])
        mine = pair if r < 2 else other
        out = {}
        out["ar"] = await rank.all_reduce(np.full(4, r, np.int64), op="MAX", group=mine)
        out["ag"] = await rank.all_gather_into_tensor(np.array([r], np.float32))
        out["rs"] = await rank.reduce_scatter_tensor(np.arange(8, dtype=np.float32))
        out["bc"] = await rank.broadcast(np.full(2, r, np.float32), src=3)
        await rank.barrier()
        if r == 0:
            await rank.send(np.array([42.0], np.float32), dst=3, tag=5)
        if r == 3:
            out["p2p"] = await rank.recv((1,), src=0, tag=5, dtype="float32")
        await rank.compute(0.25)
        await rank.step()
        return out

    async with emulated_world(4, tmp_path) as world:
        assert_ok(await world.run(script))
    ret = world.outcomes.returns
    assert ret[0]["ar"].tolist() == [1] * 4 and ret[3]["ar"].tolist() == [3] * 4
    assert ret[2]["ag"].tolist() == [0, 1, 2, 3]
    assert ret[1]["rs"].tolist() == [8.0, 12.0]  # 4 ranks x arange(8), elements 2..3
    assert all(ret[r]["bc"].tolist() == [3.0, 3.0] for r in range(4))
    assert ret[3]["p2p"].tolist() == [42.0]
    trace = world.trace()
    assert trace.problems() == []
    assert trace.steps(0) == 1
    assert [c.op for c in trace.calls(rank=3)] == [
        "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier", "recv"]
    assert trace.calls(group=(2, 3), op="all_reduce")[0].dtype == "int64"
    assert [c.rank for c in trace.calls(op="send")] == [0]
    assert_order(trace, "broadcast", "recv", rank=3)


async def test_declarative_script_and_bfloat16_shapes(tmp_path, autojump_clock):
    steps = [Op("all_reduce", (1024,), dtype="bfloat16"), Op("barrier"), Op("step")]
    async with emulated_world(2, tmp_path) as world:
        assert_ok(await world.run_script({0: steps, 1: steps}))
    assert_calls(world.trace(), [0, 1], [("all_reduce", "world", 2048), "barrier"])
    with pytest.raises(ValueError, match="FakeRank has no such call"):
        Op("all_reduse")


async def test_a_script_that_raises_is_the_rank_failing(tmp_path, autojump_clock):
    async def script(rank):
        await rank.all_reduce((4,))
        if rank.rank == 1:
            raise KeyError("user bug")

    async with emulated_world(2, tmp_path) as world:
        with pytest.raises(KeyError, match="user bug"):
            await world.run(script)
    result = await world.result()
    assert_failed(result, "error", rank=1, match="KeyError: 'user bug'")


async def test_explicit_failure_and_the_stopped_peer(tmp_path, autojump_clock):
    async def script(rank):
        if rank.rank == 0:
            await rank.fail("Traceback: boom")
            return
        await rank.all_reduce((4,))

    async with emulated_world(2, tmp_path) as world:
        result = await world.run(script)
    assert_failed(result, "error", rank=0, match="boom")
    stopped = world.outcomes.stopped[1]
    assert isinstance(stopped, RankStopped) and stopped.code in ("peer_failed", "shutdown")
    with pytest.raises(AssertionError, match="not as 'died'"):
        assert_failed(result, "died", rank=0)


async def test_assertions_say_what_differed(tmp_path, autojump_clock):
    async with emulated_world(2, tmp_path) as world:
        assert_ok(await world.run(two_reduces))
    trace = world.trace()
    assert_calls(trace, 0, ["all_reduce", "all_reduce"])
    with pytest.raises(AssertionError, match=r"at call 1:\n  expected: .*4096.*\n  actual: .*2048"):
        assert_calls(trace, 0, [("all_reduce", "world", 1024), ("all_reduce", "world", 4096)])
    with pytest.raises(AssertionError, match="at call 2"):
        assert_calls(trace, 1, ["all_reduce", "all_reduce", "barrier"])
    assert_order(trace, ("all_reduce", "world", 1024), ("all_reduce", "world", 2048))
    with pytest.raises(AssertionError, match="before"):
        assert_order(trace, ("all_reduce", "world", 2048), ("all_reduce", "world", 1024))
    with pytest.raises(AssertionError, match="made no call"):
        assert_order(trace, "all_reduce", "barrier")
    with pytest.raises(AssertionError, match="not 'deadlock'"):
        assert_failed(await world.result(), "deadlock")
    with pytest.raises(ValueError, match="kind must be one of"):
        assert_failed(await world.result(), "hang")


async def test_bad_arguments_are_named(tmp_path):
    async with emulated_world(2, tmp_path) as world:
        with pytest.raises(ValueError, match="rank 5 is outside the world of 2"):
            world.rank(5)
        with pytest.raises(ValueError, match="has no field 'sequence'"):
            message(P.CollectiveArrive, sequence=1)
        with pytest.raises(ValueError, match="ranks must be distinct members"):
            await world.rank(0).new_group([0, 7])


async def test_prism_world_fixture(prism_world, autojump_clock):
    async with prism_world(2, slots=1) as world:
        assert_ok(await world.run(two_reduces))
    assert world.run_dir.name == "prism-world-0"
    assert len(world.trace().calls()) == 4


def test_readme_shows_the_example_verbatim():
    root = Path(__file__).resolve().parents[2]
    example = (root / "tests" / "unit" / "test_testing_example.py").read_text()
    assert f"```python\n{example}```" in (root / "README.md").read_text()


async def test_the_block_raises_what_the_test_raised(tmp_path, autojump_clock):
    # A failed assert inside the block comes out as itself, not in a group.
    with pytest.raises(AssertionError, match="the test's own"):
        async with emulated_world(2, tmp_path) as world:
            assert_ok(await world.run(two_reduces))
            raise AssertionError("the test's own")
    with pytest.raises(RuntimeError, match="runs one capture"):
        await world.run(two_reduces)
