"""RankRuntime, RankRecorder and the iteration rule, in process with a
client that grants every slot at once."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time

import orjson
import pytest

from prism.core import protocol
from prism.rank import recorder as rec_mod
from prism.rank.runtime import RankRuntime, _StepTracker


class GrantingClient:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)

    def future(self, key):
        fut = concurrent.futures.Future()
        assert key == ("slot",)
        fut.set_result(protocol.SlotGrant(rank=0))
        return fut

    def close(self) -> None:
        pass

    def events(self) -> list[dict]:
        return [orjson.loads(p) for m in self.sent if isinstance(m, protocol.TraceRecords) for p in m.payloads]


@pytest.fixture
def rt():
    client = GrantingClient()
    hello = protocol.Hello(protocol_version=protocol.PROTOCOL_VERSION, rank=0, world_size=1, local_rank=0,
                           pid=1, hostname="h", device="cpu", t_ns=100)
    welcome = protocol.Welcome(protocol_version=protocol.PROTOCOL_VERSION, run_id="r", t_ns=1_100,
                               small_tensor_limit=64)
    runtime = RankRuntime(client, welcome, hello, welcome_recv_ns=300)
    runtime.start()
    yield runtime
    runtime.finish("ok")  # stops its stall monitor


def test_start_takes_a_slot_and_estimates_the_clock_offset(rt):
    assert [type(m) for m in rt.client.sent] == [protocol.SlotRequest]
    assert rt.clock_offset_ns == 1_100 - 200
    rt.finish("ok")
    evs = rt.client.events()
    assert evs[0]["k"] == "rank_start" and evs[0]["clock_offset_ns"] == 900
    assert evs[-1] == {**evs[-1], "k": "rank_end", "status": "ok"}
    assert isinstance(rt.client.sent[-1], protocol.Goodbye)


def test_block_releases_then_requests_the_slot(rt):
    done = threading.Event()
    threading.Timer(0.05, done.set).start()
    rt.block_on(done, "coll:world:0", 5)
    kinds = [type(m) for m in rt.client.sent]
    assert kinds[-3:] == [protocol.Wait, protocol.SlotRelease, protocol.SlotRequest]
    assert rt.client.sent[-3].what == "coll:world:0"


def test_compute_segments_exclude_communication(rt):
    r = rt.recorder
    r.start_segment(1_000)
    r.comm_enter(2_000)
    r.comm_enter(2_500)  # a second thread's call nests
    r.comm_exit(3_000)
    r.comm_exit(4_000)
    r.end_step(6_000)
    r.comm_enter(7_000)
    r.comm_exit(9_000)
    r.finish(10_000, "ok")
    comp = [(e["start_ns"], e["end_ns"], e["step"]) for e in rt.client.events() if e["k"] == "compute"]
    assert comp[-4:] == [(1_000, 2_000, 0), (4_000, 6_000, 0), (6_000, 7_000, 1), (9_000, 10_000, 1)]
    assert [e["step"] for e in rt.client.events() if e["k"] == "iter"] == [0]


def test_a_call_inside_the_front_end_starts_where_the_front_end_did(rt):
    # PRISM_FRONT_END_IN_COMM: the wrapper's call starts at 2_000; the backend's
    # nested call (issue, then its wait) starts there too, not when it is reached
    r = rt.recorder
    r.start_segment(1_000)
    assert r.comm_enter(2_000, front_end=True) == 2_000
    assert r.comm_enter() == 2_000
    r.comm_exit(2_600)
    assert r.comm_enter() == 2_000
    r.comm_exit(2_900)
    r.comm_exit(3_000)
    # an ordinary call after it: nested calls take their own time again
    assert r.comm_enter(4_000) == 4_000
    assert r.comm_enter() > 4_000
    r.comm_exit(4_500)
    r.comm_exit(5_000)
    r.finish(6_000, "ok")
    comp = [(e["start_ns"], e["end_ns"]) for e in rt.client.events() if e["k"] == "compute"]
    assert comp[-3:] == [(1_000, 2_000), (3_000, 4_000), (5_000, 6_000)]


def test_the_next_step_opens_after_prisms_step_end_work(rt):
    # the sample and the batch's send happen between the step's end and the
    # next segment: Prism's time, not the next step's compute
    r = rt.recorder
    r.start_segment(1_000)
    sent_at = []
    r._send = lambda m: (sent_at.append(5_000), rt.client.send(m))
    r.end_step(2_000, extra=lambda end, step: rt_iteration(99) if (end, step) == (2_000, 0) else None,
               resume_clock=lambda: 5_000 if sent_at else 0)
    r.comm_enter(6_000)
    r.comm_exit(7_000)
    r.finish(8_000, "ok")
    comp = [(e["start_ns"], e["end_ns"], e["step"]) for e in rt.client.events() if e["k"] == "compute"]
    assert comp[-3:] == [(1_000, 2_000, 0), (5_000, 6_000, 1), (7_000, 8_000, 1)]
    assert [e["step"] for e in rt.client.events() if e["k"] == "iter"] == [0, 99]


def test_cpu_segments_carry_the_main_threads_cpu_time(rt):
    # a busy segment uses the CPU for (nearly) all its wall time, a sleeping
    # one for almost none of it: what calibration tells a clean measurement by
    import time

    r = rt.recorder
    t0 = time.monotonic_ns()
    r.start_segment(t0)
    while time.monotonic_ns() - t0 < 30_000_000:
        pass
    r.comm_enter(time.monotonic_ns())
    r.comm_exit(time.monotonic_ns())
    time.sleep(0.03)
    r.finish(time.monotonic_ns(), "ok")
    comp = [e for e in rt.client.events() if e["k"] == "compute"][-2:]
    busy, idle = ((e["thread_cpu_ns"], e["end_ns"] - e["start_ns"]) for e in comp)
    assert busy[1] >= 30_000_000 and 0.5 * busy[1] <= busy[0] <= busy[1] + 2_000_000, busy
    assert idle[1] >= 30_000_000 and 0 <= idle[0] < 0.2 * idle[1], idle


def test_batches_go_out_when_full(rt, monkeypatch):
    monkeypatch.setattr(rec_mod, "MAX_BATCH_EVENTS", 3)
    before = sum(isinstance(m, protocol.TraceRecords) for m in rt.client.sent)
    for i in range(7):
        rt.recorder.emit(rt_iteration(i))
    batches = [m for m in rt.client.sent if isinstance(m, protocol.TraceRecords)][before:]
    assert [len(b.payloads) for b in batches] == [3, 3]


def rt_iteration(i: int):
    from prism.core.trace import Iteration

    return Iteration(step=i, end_ns=i)


def test_events_after_finish_are_dropped(rt):
    rt.finish("ok")
    n = len(rt.client.sent)
    rt.recorder.emit(rt_iteration(5))
    rt.recorder.flush()
    assert len(rt.client.sent) == n


class Opt:
    pass


def _iters(rt) -> list[tuple[int, int]]:
    rt.recorder.flush()
    return [(e["step"], e["end_ns"]) for e in rt.client.events() if e["k"] == "iter"]


def test_one_optimizer_ends_an_iteration_per_step(rt):
    clock = iter(range(10, 1000, 10))
    tracker = _StepTracker(rt, lambda: next(clock))
    a = Opt()
    tracker.on_init(a)
    for _ in range(3):
        tracker.on_step(a, (), {})
    assert [s for s, _ in _iters(rt)] == [0, 1, 2]


def test_chained_optimizers_end_the_iteration_at_the_last(rt):
    times = iter([100, 200, 300, 400])
    tracker = _StepTracker(rt, lambda: next(times))
    a, b = Opt(), Opt()
    tracker.on_init(a)
    tracker.on_init(b)
    for opt in (a, b, a, b):
        tracker.on_step(opt, (), {})
    assert _iters(rt) == [(0, 200), (1, 400)]


def test_an_optimizer_that_never_steps_falls_back_to_the_repeat_rule(rt):
    times = iter([100, 200, 300])
    tracker = _StepTracker(rt, lambda: next(times))
    a, idle = Opt(), Opt()
    tracker.on_init(a)
    tracker.on_init(idle)
    for _ in range(3):
        tracker.on_step(a, (), {})
    assert _iters(rt) == [(0, 100), (1, 200)]
    tracker.flush_pending()
    assert _iters(rt) == [(0, 100), (1, 200), (2, 300)]


class FakeGpuTiming:
    """Stands in for prism.rank.gputime.GpuTiming: close() pretends the GPU
    took ``tail`` ns to drain, and the segment's GPU work ``gpu`` ns."""

    def __init__(self):
        self.now = 0
        self.opened = []
        self.after = []
        self.on_script_sync = None

    def open(self, step, after_comm=False):
        self.opened.append(step)
        self.after.append(after_comm)
        return 0

    def disarm(self):
        pass

    def close(self, start, script_join):
        cpu_end = self.now
        end = cpu_end + (0 if script_join else 300)
        gpu = 111 if self.opened[-1] == 1 else -1
        free = end - start - 7 if gpu == -1 else -1
        return cpu_end, end, (end if script_join else cpu_end) - start - 7, gpu, free, 50 if self.after[-1] else 0


def test_gpu_rank_segments_carry_two_clocks_and_joins(rt):
    r = rt.recorder
    fake = FakeGpuTiming()
    r.attach_gpu(fake)
    r.start_segment(1_000)
    fake.now = 2_000
    assert r.comm_enter() == 2_300  # the call starts after the GPU drained
    r.comm_exit(3_000)
    fake.now = 3_500
    fake.on_script_sync(3_500)  # the script waited for the GPU (e.g. .item())
    fake.now = 4_000
    assert r.end_step(3_900) == 4_300  # the step ends when the GPU is idle
    fake.now = 5_000
    r.comm_enter(4_900, settle=False)  # the stall monitor, for the main thread
    r.comm_exit(6_000)
    fake.now = 9_000
    r.finish(9_999, "ok")
    comp = [(e["start_ns"], e["end_ns"], e["step"], e["cpu_ns"], e["gpu_ns"], e["join"], e["free_ns"], e["cold_ns"])
            for e in rt.client.events() if e["k"] == "compute"]
    assert comp == [
        (1_000, 2_300, 0, 993, -1, False, 1_293, 0),
        (3_000, 3_500, 0, 493, -1, True, 493, 50),  # after a communication call: starts cold
        (3_500, 4_300, 0, 493, -1, True, 793, 0),  # after the script's own wait: as cold as the real job's
        (4_300, 4_900, 1, 600, -1, False, -1, 0),  # no wait for the GPU: its share is the wall time
        (6_000, 9_300, 1, 2_993, 111, False, -1, 50),  # step 1 calibrated
    ]
    assert [e["end_ns"] for e in rt.client.events() if e["k"] == "iter"] == [4_300]
    assert fake.opened[:4] == [0, 0, 0, 1]


class _InFlight:
    """What the stall monitor needs of an operation in flight."""

    def __init__(self) -> None:
        self.wait_key = "coll:world:0"
        self.issue_ns = 1
        self.wait_ns = None
        self.lock = threading.Lock()


def test_a_call_never_goes_out_after_the_monitor_gave_the_slot_away(rt):
    """CI saw it (2 cores, 3 ranks): after ensure_slot the main thread stalled
    (waiting for the GIL) long enough for the stall monitor to release the
    slot, then sent its CollectiveArrive without one. send_call takes the
    slot back first."""
    rt.track(_InFlight())  # an earlier async call is in flight
    rt.ensure_slot()
    deadline = time.monotonic() + 10
    while not rt._implicit and time.monotonic() < deadline:
        time.sleep(0.01)  # idle and not runnable: the monitor's condition
    assert rt._implicit, "the stall monitor never released the slot of an idle main thread"
    msg = protocol.Wait(rank=0, what="marker", t_ns=0)
    rt.send_call(msg)
    kinds = [type(m) for m in rt.client.sent if not isinstance(m, protocol.TraceRecords)]
    i = next(i for i, m in enumerate(rt.client.sent) if m is msg)
    after = [type(m) for m in rt.client.sent[:i] if not isinstance(m, protocol.TraceRecords)]
    assert after[-3:] == [protocol.Wait, protocol.SlotRelease, protocol.SlotRequest], kinds
    assert rt._holds_slot and not rt._implicit


def test_the_stall_monitor_holds_no_call_once_it_gave_the_slot_away(rt):
    """An op the monitor released the slot for is the program's to free: the
    monitor's frame (alive while it sleeps) must not keep it, or its tensors
    raise the rank's peak (seen as +4 KiB on an H200 through agents)."""
    import gc
    import weakref

    op = _InFlight()
    ref = weakref.ref(op)
    rt.track(op)
    rt.ensure_slot()
    deadline = time.monotonic() + 10
    while not rt._implicit and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rt._implicit, "the stall monitor never released the slot of an idle main thread"
    rt.before_complete(op)  # the completion thread takes it out of the pending calls
    del op
    gc.collect()
    assert ref() is None, [type(x).__name__ for x in gc.get_referrers(ref())]


def test_the_dilated_clock_takes_out_only_what_a_wait_spent_past_its_release():
    from types import SimpleNamespace

    from prism.rank.runtime import RankRuntime

    import threading

    rt = SimpleNamespace(hybrid=True, dilation_ns=0, _dilation_lock=threading.Lock(), on_dilation=None)
    rt.add_dilation = RankRuntime.add_dilation.__get__(rt)
    waited = RankRuntime.waited.__get__(rt)
    waited(1_000, 500, 1_300)  # released at 1000, resumed at 1300: Prism's 300
    assert rt.dilation_ns == 300
    waited(2_000, 2_500, 2_550)  # waited from after the release: only its own 50
    assert rt.dilation_ns == 350
    waited(3_000, 2_000, 2_900)  # resumed before the release (cannot happen late): nothing
    waited(0, 0, 10_000)  # no release known (capture): nothing
    assert rt.dilation_ns == 350
    assert RankRuntime.emu_ns.__get__(rt)(10_000) == 9_650
    rt.hybrid = False
    waited(1_000, 0, 9_000)
    assert rt.dilation_ns == 350


def test_the_switch_interval_knob(monkeypatch):
    import sys

    from prism.rank import bootstrap

    before = sys.getswitchinterval()
    try:
        monkeypatch.delenv("PRISM_SWITCH_INTERVAL_US", raising=False)
        assert bootstrap._switch_interval() is None and sys.getswitchinterval() == before
        monkeypatch.setenv("PRISM_SWITCH_INTERVAL_US", "200")
        assert bootstrap._switch_interval() == pytest.approx(200e-6)
        monkeypatch.setenv("PRISM_SWITCH_INTERVAL_US", "-1")
        with pytest.raises(SystemExit, match="PRISM_SWITCH_INTERVAL_US='-1': give the thread switch interval"):
            bootstrap._switch_interval()
    finally:
        sys.setswitchinterval(before)


# --- the clock sync of a rank on another host (protocol 9) ----------------------------------

#: The fake coordinator's clock runs this far ahead of the rank's.
COORD_AHEAD_NS = 7_000_000_000


class EchoingClient(GrantingClient):
    """A coordinator at ``endpoint`` that answers each ``ClockProbe`` at once,
    but whose echo spends ``delays[seq]`` = (to it, back) seconds on the way:
    the stamp lies where the round trip's two legs meet."""

    def __init__(self, endpoint: str, delays=()) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.delays = list(delays)
        self._echoes: dict = {}

    def future(self, key):
        if key[0] != "clock":
            return super().future(key)
        fut = self._echoes[key] = concurrent.futures.Future()
        return fut

    def send(self, msg) -> None:
        super().send(msg)
        if isinstance(msg, protocol.ClockProbe):
            there, back = self.delays[msg.seq] if msg.seq < len(self.delays) else (0, 0)
            time.sleep(there)
            stamp = time.monotonic_ns() + COORD_AHEAD_NS
            time.sleep(back)
            self._echoes.pop(("clock", msg.seq)).set_result(protocol.ClockEcho(msg.seq, msg.t_ns, stamp))


def make_runtime(client, probes: int) -> RankRuntime:
    hello = protocol.Hello(protocol_version=protocol.PROTOCOL_VERSION, rank=0, world_size=1, local_rank=0,
                           pid=1, hostname="h", device="cpu", t_ns=100)
    welcome = protocol.Welcome(protocol_version=protocol.PROTOCOL_VERSION, run_id="r", t_ns=1_100,
                               small_tensor_limit=64)
    return RankRuntime(client, welcome, hello, welcome_recv_ns=300, clock_probes=probes)


def test_a_rank_on_another_host_keeps_the_probe_with_the_shortest_round_trip():
    # the first probe waits 40 ms on the way there (as a Hello behind its
    # handshake), the third 30 ms on the way back; the second comes straight
    client = EchoingClient("tcp://10.1.2.3:5555", [(0.04, 0.0), (0.0, 0.0), (0.0, 0.03), (0.002, 0.002)])
    rt = make_runtime(client, 4)
    sent = client.sent
    assert [type(m) for m in sent] == [protocol.ClockProbe] * 4 + [protocol.ClockOffset]
    assert [m.seq for m in sent[:4]] == [0, 1, 2, 3]
    # the probes go one at a time: each after the previous one's echo
    assert all(a.t_ns < b.t_ns for a, b in zip(sent[:3], sent[1:4]))
    assert sent[1].t_ns - sent[0].t_ns >= 40_000_000
    # the second's round trip (no delay) was kept: within a few ms, where
    # the first alone is 20 ms off and the third 15 ms
    assert rt.clock_rtt_ns < 3_000_000
    assert abs(rt.clock_offset_ns - COORD_AHEAD_NS) < 3_000_000
    assert sent[-1] == protocol.ClockOffset(0, rt.clock_offset_ns, rt.clock_rtt_ns)
    assert rt.clock_sync_ns >= 74_000_000  # the delays


@pytest.mark.parametrize("endpoint", ["ipc:///tmp/run/prism.sock", "tcp://127.0.0.1:5555", "tcp://localhost:5",
                                      "tcp://[::1]:5", "inproc://x"])
def test_a_rank_on_its_coordinators_host_sends_no_probe(endpoint):
    client = EchoingClient(endpoint)
    rt = make_runtime(client, 8)
    assert client.sent == [] and rt.clock_offset_ns == 0 and rt.clock_rtt_ns is None


@pytest.mark.parametrize("endpoint", ["tcp://10.1.2.3:5555", ""])
def test_no_probes_wanted_or_no_tcp_endpoint_keep_the_hellos_estimate(endpoint):
    # PRISM_CLOCK_PROBES=0, or a client with no tcp endpoint (a test's fake coordinator)
    client = EchoingClient(endpoint)
    rt = make_runtime(client, 0 if endpoint else 8)
    assert client.sent == [] and rt.clock_offset_ns == 1_100 - 200 and rt.clock_rtt_ns is None


def test_the_clock_probes_knob(monkeypatch):
    from prism.rank.runtime import CLOCK_PROBES_ENV, DEFAULT_CLOCK_PROBES, clock_probes_from_env

    monkeypatch.delenv(CLOCK_PROBES_ENV, raising=False)
    assert clock_probes_from_env() == DEFAULT_CLOCK_PROBES == 8
    monkeypatch.setenv(CLOCK_PROBES_ENV, "0")
    assert clock_probes_from_env() == 0
    monkeypatch.setenv(CLOCK_PROBES_ENV, "3")
    assert clock_probes_from_env() == 3
    for bad in ("-1", "x", "2.5"):
        monkeypatch.setenv(CLOCK_PROBES_ENV, bad)
        with pytest.raises(SystemExit, match=f"PRISM_CLOCK_PROBES='{bad}': give how many clock probes"):
            clock_probes_from_env()


def test_goodbye_carries_the_scripts_end_on_the_dilated_clock(rt):
    rt.add_dilation(1_000)
    rt.finish("ok", end_ns=50_000)
    bye = rt.client.sent[-1]
    assert isinstance(bye, protocol.Goodbye) and bye.t_ns == 49_000


def test_a_rank_says_its_script_ended_before_prisms_own_reports(monkeypatch):
    # child_main takes the script's end before the device path's report (its
    # call log may take milliseconds to write): an emulation closes the
    # sandbox's last step at the Goodbye's time, and counted Prism's report
    # in the job's last step before.
    import sys
    import types

    from prism.rank import bootstrap

    seen: dict = {}

    class FakeRt:
        client = types.SimpleNamespace(close=lambda: None)

        def finish(self, status, message="", end_ns=None):
            seen["finish"] = (status, end_ns, time.monotonic_ns())

    fake_dp = types.ModuleType("prism.rank.devicepath")

    def report():
        seen["report"] = time.monotonic_ns()
        time.sleep(0.02)

    fake_dp.report = report
    monkeypatch.setitem(sys.modules, "prism.rank.devicepath", fake_dp)
    monkeypatch.setattr(bootstrap, "start_runtime", lambda *a, **k: FakeRt())
    monkeypatch.setattr(bootstrap, "patch_torch_distributed", lambda: None)
    monkeypatch.setattr(bootstrap, "run_command", lambda command: seen.setdefault("ran", time.monotonic_ns()))
    monkeypatch.setitem(sys.modules, "zmq", types.SimpleNamespace(
        Context=types.SimpleNamespace(instance=lambda: types.SimpleNamespace(term=lambda: None))))
    assert bootstrap.child_main(["x.py"], rank=0, world_size=1, local_rank=0, endpoint="ipc://nowhere") == 0
    status, end_ns, t_finish = seen["finish"]
    assert status == "ok" and end_ns is not None
    assert seen["ran"] <= end_ns <= seen["report"] and t_finish - end_ns >= 20_000_000


def _arrival(seq: int) -> dict:
    return protocol.header_template(protocol.CollectiveArrive(
        rank=0, gid="g", seq=seq, op="all_reduce", reduce_op="SUM", dtype="float32", in_shapes=((4,),),
        out_shapes=((4,),), on_device=True, reach_follows=True))


def _sent(rt) -> list:
    return [protocol.decode(m) if isinstance(m, list) else m for m in rt.client.sent
            if not isinstance(m, (protocol.SlotRequest, protocol.TraceRecords))]


def test_a_deferred_arrival_leaves_with_its_reach_and_those_before_it_first(rt):
    # protocol 12: a device-path collective's arrival leaves at its stream's reach, with the reach in it
    rt.client.send_frames = rt.client.sent.append
    rt.add_dilation(1_000)
    rt.defer_arrival(("g", 0), _arrival(0))  # async, on a side stream: reached later
    rt.defer_arrival(("g", 1), _arrival(1))
    rt.defer_arrival(("g", 2), _arrival(2))
    assert _sent(rt) == []
    rt.reached(("g", 1), 50_000)
    out = _sent(rt)
    assert [(m.seq, m.reach_ns) for m in out] == [(0, 0), (1, 49_000)]  # issue order kept; seq 0 has no reach yet
    rt.reached(("g", 0), 60_000)  # already out without its reach: a Reached says it
    assert _sent(rt)[-1] == protocol.Reached(0, "g", 0, 59_000)
    # anything the coordinator takes in order sends the waiting ones first, without their reach
    rt.send_call(protocol.Wait(rank=0, what="x", t_ns=1))
    assert [type(m).__name__ for m in _sent(rt)[-2:]] == ["CollectiveArrive", "Wait"]
    assert _sent(rt)[-2].seq == 2 and _sent(rt)[-2].reach_ns == 0
    rt.reached(("g", 2), 70_000)
    assert _sent(rt)[-1] == protocol.Reached(0, "g", 2, 69_000)


def test_the_goodbye_sends_the_arrivals_still_waiting_first(rt):
    rt.client.send_frames = rt.client.sent.append
    rt.defer_arrival(("g", 7), _arrival(7))
    rt.finish("ok")
    out = _sent(rt)
    assert [type(m).__name__ for m in out[-2:]] == ["CollectiveArrive", "Goodbye"] and out[-2].seq == 7


def test_a_deferred_send_leaves_with_its_reach_as_a_collective_does(rt):
    rt.client.send_frames = rt.client.sent.append
    send = protocol.Send(rank=0, gid="g", dst=1, tag=0, pseq=3, dtype="float32", shape=(4,), on_device=True,
                         reach_follows=True)
    key = (protocol.send_reach_gid(1, 0), 3)
    rt.defer_arrival(key, send)
    rt.defer_arrival(("g", 0), _arrival(0))
    rt.reached(("g", 0), 5_000)  # the later collective reached first (another stream): the send goes before it
    out = _sent(rt)
    assert out[0] == send and out[0].reach_ns == 0 and out[1].seq == 0 and out[1].reach_ns == 5_000
    rt.reached(key, 4_000)
    assert _sent(rt)[-1] == protocol.Reached(0, key[0], 3, 4_000)
    rt.defer_arrival(key, send)
    rt.reached(key, 6_000)
    assert _sent(rt)[-1] == dataclasses.replace(send, reach_ns=6_000)


def test_a_reply_callback_that_sends_while_an_arrival_goes_out_keeps_the_order(rt):
    # a send dispatches the replies that arrived meanwhile; their callbacks may send (flushing the
    # arrivals still waiting) on the same thread, inside reached(): no deadlock, the order kept
    def send_frames(frames):
        rt.client.sent.append(frames)
        if protocol.decode(frames).seq == 0:
            rt.flush_arrivals()

    rt.client.send_frames = send_frames
    for seq in range(3):
        rt.defer_arrival(("g", seq), _arrival(seq))
    rt.reached(("g", 1), 9_000)
    out = _sent(rt)
    assert [(type(m).__name__, getattr(m, "seq", None)) for m in out] == [
        ("CollectiveArrive", 0), ("CollectiveArrive", 1), ("CollectiveArrive", 2), ("Reached", 1)]
    assert out[1].reach_ns == 0 and out[3].reach_ns == 9_000
