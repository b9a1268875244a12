"""The clock sync between a rank on another host and its coordinator
(protocol 9, ``prism.core.clocksync``).

The coordinator's side alone: it echoes each ``ClockProbe`` at once and
takes the rank's ``ClockOffset`` for its own (the RankStart/RankEnd it
writes, an emulation's ``clock_offsets``); a rank of protocol 8 gets the
version error."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio
import trio.testing

from prism.core import protocol as P
from prism.core import trace as T
from prism.shell import runfolder
from prism.shell.coordinator import Coordinator, Received
from transport.endpoints import default_endpoint

ROOT = Path(__file__).resolve().parents[2]

# --- the coordinator's side ---------------------------------------------------------------


class RecordingSocket:
    """The coordinator's socket, keeping what it sends."""

    def __init__(self) -> None:
        self.sent: list = []

    async def send_message(self, msg, identity=None) -> None:
        self.sent.append((identity, msg))

    def close(self) -> None:
        pass


@pytest.mark.parametrize("kind", ["coordinator", "emulator"])
def test_the_coordinator_echoes_probes_and_takes_the_ranks_offset(tmp_path, kind):
    # The handlers alone, as the loop calls them, on a coordinator serving
    # another host (its Hello's one-way estimate first, then the rank's).
    if kind == "emulator":
        from prism.core.costmodel import CostModel, Link
        from prism.core.graph import ExecutionGraph
        from prism.core.hybrid import HybridReplay
        from prism.core.synthetic import MegatronSpec, megatron_events
        from prism.shell.emulator import Emulator

        graph = ExecutionGraph.from_events(megatron_events(MegatronSpec(tp=2, pp=1, dp=1, iterations=1)))
        model = CostModel("test", 4, Link(100e9, 2e-6), Link(25e9, 5e-6), base_latency=3e-6, source="test")
        coord = Emulator(tmp_path / "run", HybridReplay(graph, [0], cost_model=model), endpoint="tcp://192.0.2.2:1")
    else:
        coord = Coordinator(tmp_path / "run", 2, slots=1, endpoint="tcp://192.0.2.2:1")
    runfolder.make_run_dir(coord.run_dir)
    coord._sock = sock = RecordingSocket()
    coord.bound_endpoint = coord.endpoint
    hello = P.Hello(P.PROTOCOL_VERSION, 0, 2, 0, 1, "node1", "cpu", 1_000)

    async def main() -> None:
        await coord._handle(Received(b"r0", hello))
        assert coord.sessions[0].clock_offset_ns != 0  # another host: the Hello's one-way estimate first
        for seq in range(3):
            await coord._handle(Received(b"r0", P.ClockProbe(0, seq, 5_000 + seq)))
        await coord._handle(Received(b"r0", P.ClockOffset(0, -123_456_789, 250_000)))
        assert coord.sessions[0].clock_offset_ns == -123_456_789
        if kind == "emulator":
            assert coord.clock_offsets[0] == -123_456_789
            # fixed: a timed message no longer moves it (it did without probes)
            await coord._handle(Received(b"r0", P.Wait(0, "x", 10**15 + 10**9)))  # "1 s behind"
            assert coord.clock_offsets[0] == -123_456_789
        coord._close_traces()  # the rank sent no trace: the coordinator writes its start and end

    coord._anchor_s, coord._anchor_ns = 0.0, 10**15
    trio.run(main, clock=trio.testing.MockClock())  # the coordinator's now stays 10^15
    replies = [m for ident, m in sock.sent if ident == b"r0"]
    assert isinstance(replies[0], P.Welcome)
    echoes = replies[1:4]
    assert [type(m) for m in echoes] == [P.ClockEcho] * 3
    assert [(m.seq, m.probe_ns) for m in echoes] == [(0, 5_000), (1, 5_001), (2, 5_002)]
    assert all(m.t_ns == 10**15 for m in echoes)  # the coordinator's clock when it handled the probe
    events = runfolder.read_rank_file(runfolder.rank_path(coord.run_dir, 0)).events
    assert isinstance(events[0], T.RankStart) and events[0].clock_offset_ns == -123_456_789
    assert isinstance(events[-1], T.RankEnd) and events[-1].t_ns == 10**15 + 123_456_789  # on the rank's clock


OLD_RANK = """
import os, sys, time
import prism.core.protocol as p
p.PROTOCOL_VERSION = 8  # frames and reads as a Prism of protocol 8 does
from transport.client import BlockingClient, CoordinatorError
try:
    BlockingClient.connect(sys.argv[1], p.Hello(8, 0, 1, 0, os.getpid(), "h", "cpu", time.monotonic_ns()), timeout=20)
except CoordinatorError as e:
    print(type(e).__name__, e.msg.code, e)
"""


def test_a_rank_of_protocol_8_gets_the_version_error(tmp_path):
    got = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            async def old_rank(endpoint: str) -> None:
                got["run"] = await trio.run_process([sys.executable, "-c", OLD_RANK, endpoint], capture_stdout=True,
                                                    capture_stderr=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
                nursery.cancel_scope.cancel()  # the coordinator still waits for its rank

            coord = Coordinator(tmp_path / "run", 1, slots=1, endpoint=default_endpoint(tmp_path / "run"),
                                on_listening=lambda ep: nursery.start_soon(old_rank, ep))
            await coord.run()

    trio.run(main)
    out = got["run"].stdout.decode()
    assert out.startswith("CoordinatorLost version error message in protocol version 9, this side speaks 8: "
                          "run the same Prism version on every side"), (out, got["run"].stderr.decode()[-2000:])
