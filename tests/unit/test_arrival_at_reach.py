"""Protocol 12: a device-path call's arrival sent at its reach, with it.
The rank keeps the order of its messages across threads; the coordinator
takes the reach onto its own clock as it does a ``Reached``'s."""

import concurrent.futures
import threading
import time

import trio
import trio.testing

from prism.core import protocol as P
from prism.rank.runtime import RankRuntime
from prism.shell.coordinator import Received
from tests.support.emulator_harness import offline_emulator


class _SlowWatcherClient:
    """A client whose send of an arrival with its reach, from the thread
    named "watcher", takes a while (its encode and hand-over made long)."""

    def __init__(self) -> None:
        self.sent: list = []
        self.lock = threading.Lock()
        self.in_send = threading.Event()

    def send(self, msg) -> None:
        self.send_frames(P.encode(msg))

    def send_frames(self, frames) -> None:
        m = P.decode(frames)
        if isinstance(m, P.CollectiveArrive) and m.reach_ns and threading.current_thread().name == "watcher":
            self.in_send.set()
            time.sleep(0.05)
        with self.lock:
            self.sent.append(m)

    def future(self, key):
        f = concurrent.futures.Future()
        f.set_result(P.SlotGrant(rank=0))
        return f

    def close(self) -> None:
        pass


def _arrival(seq: int) -> dict:
    return P.header_template(P.CollectiveArrive(
        rank=0, gid="g", seq=seq, op="all_reduce", reduce_op="SUM", dtype="float32", in_shapes=((4,),),
        out_shapes=((4,),), on_device=True, reach_follows=True))


def test_a_call_from_another_thread_does_not_overtake_an_arrival_leaving_at_its_reach():
    # the watcher has taken the last waiting arrival and is sending it: the main thread's next call
    # (its flush finds nothing left to send) must still go after it
    c = _SlowWatcherClient()
    hello = P.Hello(protocol_version=P.PROTOCOL_VERSION, rank=0, world_size=1, local_rank=0, pid=1, hostname="h",
                    device="cpu", t_ns=100)
    welcome = P.Welcome(protocol_version=P.PROTOCOL_VERSION, run_id="r", t_ns=1_100, small_tensor_limit=64)
    rt = RankRuntime(c, welcome, hello, welcome_recv_ns=300)
    rt.start()
    try:
        rt.defer_arrival(("g", 0), _arrival(0))
        w = threading.Thread(target=rt.reached, args=(("g", 0), 5_000_000), name="watcher")
        w.start()
        assert c.in_send.wait(5)
        rt.send_call(P.CollectiveArrive(rank=0, gid="g", seq=1, op="all_reduce", reduce_op="SUM", dtype="float32",
                                        in_shapes=((4,),), out_shapes=((4,),), issue_ns=1))
        w.join()
    finally:
        rt.finish("ok")
    assert [m.seq for m in c.sent if isinstance(m, P.CollectiveArrive)] == [0, 1]


def test_the_coordinator_takes_an_arrivals_reach_onto_its_clock_as_a_reacheds(tmp_path):
    # a sandbox on another host (a clock offset): the reach in its arrival is moved by the offset, as
    # a Reached's is, and its lag behind the issue is what the rank measured
    coord = offline_emulator(tmp_path)
    seen: dict = {}

    async def main() -> None:
        await coord._handle(Received(b"r0", P.Hello(P.PROTOCOL_VERSION, 0, 2, 0, 1, "node1", "cpu", 1_000)))
        await coord._handle(Received(b"r0", P.ClockOffset(0, -123_456_789, 250_000)))
        await coord._handle(Received(b"r0", P.CollectiveArrive(
            rank=0, gid="g", seq=0, op="all_reduce", reduce_op="SUM", dtype="float32", in_shapes=((4,),),
            out_shapes=((4,),), issue_ns=5_000_000_000, on_device=True, reach_follows=True,
            reach_ns=5_000_100_000)))
        seen["lag"] = list(coord.stats.reach_lag_ns)
        seen["arrived"] = coord.stats.arrived_with_reach
        coord._close_traces()

    coord._anchor_s, coord._anchor_ns = 0.0, 10**15
    trio.run(main, clock=trio.testing.MockClock())
    assert seen["arrived"] == 1 and seen["lag"] == [100_000], seen


def test_a_hang_report_names_the_call_whose_gpu_reach_never_came(tmp_path):
    # the quiet watchdog: a sandbox whose device-path call arrived without its reach (its stream held up
    # before it) is named with that call, not as a rank that "has not called anything"
    coord = offline_emulator(tmp_path)

    async def main() -> None:
        await coord._handle(Received(b"r0", P.Hello(P.PROTOCOL_VERSION, 0, 2, 0, 1, "node1", "cpu", 1_000)))
        await coord._handle(Received(b"r0", P.CollectiveArrive(
            rank=0, gid="g", seq=0, op="all_reduce", reduce_op="SUM", dtype="float32", in_shapes=((4,),),
            out_shapes=((4,),), issue_ns=5_000, on_device=True, reach_follows=True)))
        coord._close_traces()

    coord._anchor_s, coord._anchor_ns = 0.0, 10**15
    trio.run(main, clock=trio.testing.MockClock())
    coord._heap.clear()
    coord._watchdog(coord._last_activity + coord.quiet_ns + 1)
    assert coord._result is not None and coord._result.status == "deadlock", coord._result
    assert "issued coll all_reduce (group g, seq 0) but its GPU stream never reached it" in coord._result.message
