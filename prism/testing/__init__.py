"""``prism.testing``: test your collective code (or a Prism extension)
against Prism's real coordinator, with scripted fake ranks, in one trio loop.

    async def test_my_step(tmp_path, autojump_clock):
        async with emulated_world(4, tmp_path / "run") as world:
            result = await world.run(my_step)      # my_step(rank: FakeRank)
        assert_ok(result)
        assert_calls(world.trace(), None, [("all_reduce", "world", 4096)])

``emulated_world`` (``prism.testing.world``): the coordinator on the
in-memory transport (``transport.memory.MemoryRouter``), faults (``kill``,
``drop``, ``delay``); ``FakeRank`` (``prism.testing.rank``): torch.distributed's
calls as a rank sends them; ``Trace`` and the ``assert_*`` helpers
(``prism.testing.trace``). Fixtures for pytest-trio:
``pytest_plugins = ["prism.testing.pytest_plugin"]`` (``prism_world``).
"""

from prism.shell.coordinator import CaptureResult
from prism.testing.rank import FakeRank, Group, RankKilled, RankStopped
from prism.testing.trace import Call, Trace, assert_calls, assert_failed, assert_ok, assert_order
from prism.testing.world import EmulatedWorld, FakeProcesses, Fault, Op, emulated_world, message

__all__ = [
    "Call",
    "CaptureResult",
    "EmulatedWorld",
    "FakeProcesses",
    "FakeRank",
    "Fault",
    "Group",
    "Op",
    "RankKilled",
    "RankStopped",
    "Trace",
    "assert_calls",
    "assert_failed",
    "assert_ok",
    "assert_order",
    "emulated_world",
    "message",
]
