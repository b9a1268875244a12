"""An emulating coordinator driven by hand, without sockets or ranks: a
synthetic GPT tp2 graph with sandbox rank 0, whose messages are fed to
``_handle`` and whose sends are kept (for unit tests of the emulator's
message handling)."""

from __future__ import annotations

import pathlib


class RecordingSocket:
    """The coordinator's socket, keeping what it sends."""

    def __init__(self) -> None:
        self.sent: list = []

    async def send_message(self, msg, identity=None) -> None:
        self.sent.append((identity, msg))

    def close(self) -> None:
        pass


def offline_emulator(tmp_path: pathlib.Path, endpoint: str = "tcp://192.0.2.2:1"):
    """An ``Emulator`` over a tp2 graph, sandbox rank 0, its run folder made,
    its socket a ``RecordingSocket``: drive it with ``await coord._handle(
    Received(identity, message))`` inside ``trio.run``."""
    from prism.core.costmodel import CostModel, Link
    from prism.core.graph import ExecutionGraph
    from prism.core.hybrid import HybridReplay
    from prism.core.synthetic import MegatronSpec, megatron_events
    from prism.shell import runfolder
    from prism.shell.emulator import Emulator

    graph = ExecutionGraph.from_events(megatron_events(MegatronSpec(tp=2, pp=1, dp=1, iterations=1)))
    model = CostModel("test", 4, Link(100e9, 2e-6), Link(25e9, 5e-6), base_latency=3e-6, source="test")
    coord = Emulator(tmp_path / "run", HybridReplay(graph, [0], cost_model=model), endpoint=endpoint)
    runfolder.make_run_dir(coord.run_dir)
    coord._sock = RecordingSocket()
    coord.bound_endpoint = coord.endpoint
    return coord
