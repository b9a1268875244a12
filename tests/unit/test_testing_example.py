"""The example test of README.md ("Testing your collective code with
prism.testing"), shown there verbatim: a piece of collective code run on
four fake ranks against the real coordinator, on the virtual clock."""

import numpy as np
import pytest

from prism.testing import assert_calls, assert_failed, assert_ok, assert_order, emulated_world


async def sync_step(rank, *, losses_first=False):
    """The code under test: average the gradients, then gather the losses."""
    grads = np.full(1024, rank.rank, np.float32)
    loss = np.array([0.5 * rank.rank], np.float32)
    if losses_first:  # the bug the test must catch
        losses = await rank.all_gather(loss)
        mean = await rank.all_reduce(grads) / rank.world_size
    else:
        mean = await rank.all_reduce(grads) / rank.world_size
        losses = await rank.all_gather(loss)
    await rank.step()
    return mean, losses


def check_order(trace):
    # Who called what, in which order, with which sizes (bytes sent).
    assert_calls(trace, None, [("all_reduce", "world", 4096), ("all_gather", "world", 4)])
    assert_order(trace, "all_reduce", "all_gather")


async def test_sync_step(tmp_path, autojump_clock):
    async with emulated_world(4, tmp_path / "run") as world:
        result = await world.run(sync_step)
    assert_ok(result)
    check_order(world.trace())
    mean, losses = world.outcomes.returns[3]
    assert (mean == 1.5).all() and [x.item() for x in losses] == [0.0, 0.5, 1.0, 1.5]


async def test_reordered_collectives_are_caught(tmp_path, autojump_clock):
    # Every rank reorders: the capture succeeds, the trace assertions fail.
    async with emulated_world(4, tmp_path / "all") as world:
        assert_ok(await world.run(lambda rank: sync_step(rank, losses_first=True)))
    with pytest.raises(AssertionError, match="differ from the expected at call 0"):
        check_order(world.trace())
    # One rank reorders: the coordinator reports the mismatch.
    async with emulated_world(4, tmp_path / "one") as world:
        result = await world.run(lambda rank: sync_step(rank, losses_first=rank.rank == 2))
    assert_failed(result, "mismatch", rank=2, match="all_gather")
