"""prism.rank.devicepath: a GPU sandbox's in-place compensated outputs equal
what the coordinator computes for it (prism.core.compensation.hybrid_outputs)
for one sandbox among virtual members. The formulas are pure torch, so they
run on CPU tensors here; on a GPU they run on the caller's stream."""

import dataclasses

import numpy as np
import pytest
import torch

from prism.core import protocol as P
from prism.core.compensation import hybrid_outputs
from prism.rank import devicepath
from prism.shell.runfolder import payload_index_path


@pytest.fixture(autouse=True)
def _fresh_env():
    # the device path reads its switches once (devicepath._flags); these tests change them in process
    devicepath.reset_env()
    yield
    devicepath.reset_env()


def _arrive(op, dtype, x_shape, out_shape, reduce_op="", premul=None, splits=()):
    return P.CollectiveArrive(rank=0, gid="g", seq=0, op=op, reduce_op=reduce_op, dtype=dtype,
                              in_shapes=(x_shape,), out_shapes=(out_shape,), premul=premul,
                              in_splits=splits, out_splits=splits)


CASES = [
    ("all_reduce", "SUM", None), ("all_reduce", "AVG", None), ("all_reduce", "MIN", None),
    ("all_reduce", "MAX", None), ("all_reduce", "PREMUL_SUM", 0.25),
    ("reduce_scatter_tensor", "SUM", None), ("reduce_scatter_tensor", "AVG", None),
    ("all_gather_into_tensor", "", None), ("all_to_all_single", "", None),
]


@pytest.mark.parametrize("op,reduce_op,premul", CASES)
@pytest.mark.parametrize("g", [0, 2])
def test_device_outputs_equal_the_coordinators_compensation(op, reduce_op, premul, g):
    n, c = 4, 6
    x = torch.randn(n * c if op in ("reduce_scatter_tensor", "all_to_all_single") else c, generator=torch.Generator().manual_seed(g))
    out = {"all_reduce": x, "reduce_scatter_tensor": torch.empty(c), "all_gather_into_tensor": torch.empty(n * c),
           "all_to_all_single": torch.empty(n * c)}[op]
    splits = (c,) * n if op == "all_to_all_single" else ()
    msg = _arrive(op, "float32", tuple(x.shape), tuple(out.shape), reduce_op, premul, splits)
    want = hybrid_outputs({g: msg}, {g: [x.numpy().copy()]}, n)[g][0]
    devicepath.form_outputs(op, reduce_op, premul, n, g, [x], [out])
    got = out.numpy()
    if reduce_op == "PREMUL_SUM":
        np.testing.assert_allclose(got, np.asarray(want).reshape(got.shape), rtol=1e-6)
    else:
        assert np.array_equal(got, np.asarray(want).reshape(got.shape))


@pytest.mark.parametrize("ins,outs", [
    ((3, 1, 2, 2), (2, 5, 1, 2)),  # uneven both ways; a virtual member sends more rows than it got: tiled
    ((0, 4, 2, 2), (3, 4, 0, 1)),  # an empty chunk to a virtual member: its rows come from the whole input
    ((2, 2, 2, 2), (2, 2, 2, 2)),  # equal splits, given
])
@pytest.mark.parametrize("g", [1, 3])
def test_uneven_all_to_all_on_the_device_equals_the_coordinators_compensation(ins, outs, g):
    n, tail = 4, (3,)
    outs = list(outs)
    outs[g] = ins[g]  # what a rank sends itself it gets back
    x = torch.randn(sum(ins), *tail, generator=torch.Generator().manual_seed(g))
    out = torch.full((sum(outs), *tail), float("nan"))
    msg = dataclasses.replace(_arrive("all_to_all_single", "float32", tuple(x.shape), tuple(out.shape)),
                              in_splits=tuple(ins), out_splits=tuple(outs))
    want = hybrid_outputs({g: msg}, {g: [x.numpy().copy()]}, n)[g][0]
    devicepath.form_outputs("all_to_all_single", "", None, n, g, [x], [out], ins, outs)
    assert np.array_equal(out.numpy(), np.asarray(want).reshape(out.shape))


def test_eligibility_keeps_the_host_path_where_it_must(monkeypatch):
    monkeypatch.setenv(devicepath.GPU_SANDBOX_ENV, "1")
    monkeypatch.setattr(devicepath, "_sandbox", frozenset({0, 1}))
    monkeypatch.setattr(devicepath, "releaser", lambda: object())
    t = torch.zeros(4)
    assert not devicepath.eligible("all_reduce", (0, 2), 0, [t], (), (), "SUM")  # a CPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert devicepath.eligible("all_reduce", (0, 2), 0, [t], (), (), "SUM")
    assert not devicepath.eligible("all_reduce", (0, 1), 0, [t], (), (), "SUM")  # another sandbox in the group
    assert not devicepath.eligible("send", (0, 2), 0, [t], (), (), "")
    assert devicepath.eligible("all_to_all_single", (0, 2), 0, [t], (1, 3), (2, 2), "")  # uneven: formed on the GPU
    assert not devicepath.eligible("all_reduce", (0, 2), 0, [t], (), (), "PRODUCT")
    monkeypatch.delenv(devicepath.GPU_SANDBOX_ENV)
    assert devicepath.eligible("all_reduce", (0, 2), 0, [t], (), (), "SUM")  # the switches are read once
    devicepath.reset_env()
    assert not devicepath.eligible("all_reduce", (0, 2), 0, [t], (), (), "SUM")


def _reach_log(got: list, done, last: int = 2):
    """For the watcher's tests: ``reach(i)`` is call i's reach callback, noting
    ("reach", i, at) in ``got``; call ``last``'s sets ``done``."""
    def reach(i):
        def f(at):
            got.append(("reach", i, at))
            if i == last:
                done.set()
        return f
    return reach


def test_the_reach_watcher_reports_reaches_in_order_and_carries_only_the_lateness_that_delayed_them():
    # The GPU's stamps are written by hand into host-mode flags (the same
    # pinned layout): call 0 reached at 1,000 and, due at 5,000, ended at 7,000
    # (its release came 2,000 late); call 1, issued at 1,500 (the CPU was ahead),
    # reached at 8,000: delayed by all 2,000 (a lateness seen only after the next
    # reach carries into the one after). Call 1 then ends 500 late, but
    # call 2 was issued at 9,000 and reached at 9,100: the stream waited for
    # its CPU anyway, so only 100 of the 500 delayed it.
    import threading
    import time

    import cuda_ext

    flags = cuda_ext.ReleaseFlags(4, "cpu")
    w = devicepath._Watcher(flags, 1e-4)
    got: list = []
    done = threading.Event()

    reach = _reach_log(got, done)

    def late(ns):
        got.append(("late", ns))

    for slot in range(3):
        flags.clear_stamps(slot)
    w.add(0, 900, reach(0), late)
    w.add(1, 1500, reach(1), late)
    w.add(2, 9000, reach(2), late)
    time.sleep(0.01)
    assert got == []  # nothing reached yet
    flags._dl[0], flags._dl[1] = 5000, 0  # call 0: due at max(5,000, 1,000 + 0)
    flags._st[0] = 1000
    time.sleep(0.01)
    assert got == [("reach", 0, 1000)]
    flags._st[1] = 7000  # in stream order: call 0 ends, then call 1 is reached
    flags._st[2] = 8000
    flags._dl[2], flags._dl[3] = 0, 300  # call 1: due at 8,000 + its tail 300 = 8,300
    flags._st[3] = 8800
    flags._st[4] = 9100
    assert done.wait(5), got
    assert got == [("reach", 0, 1000), ("late", 2000), ("reach", 1, 8000), ("late", 100), ("reach", 2, 9100)]


def test_with_carry_delivery_the_outputs_forming_counts_as_the_calls_lateness(monkeypatch):
    # PRISM_DEVICE_CARRY_DELIVERY=1: call 0's wait ends on time at 5,000, its outputs' copy runs on the
    # stream until 5,400 (its delivery stamp); call 1, issued at 1,500 (the CPU ahead), is reached at
    # 5,400: the 400 the copy held the stream are carried as a late release would be. Call 1 is 100 late
    # and its copy takes 300, but call 2 (issued at 9,000) is reached at 9,050: 50 carried of the 400.
    import threading

    monkeypatch.setenv(devicepath.CARRY_DELIVERY_ENV, "1")
    flags, w = _host_watcher(3)
    got: list = []
    done = threading.Event()
    rec0, rec1 = {}, {}

    reach = _reach_log(got, done)

    w.add(0, 900, reach(0), lambda ns: got.append(("late", ns)), rec0)
    w.add(1, 1500, reach(1), lambda ns: got.append(("late", ns)), rec1)
    w.add(2, 9000, reach(2), lambda ns: got.append(("late", ns)))
    flags._dl[0], flags._dl[1] = 5000, 0
    flags._st[0] = 1000
    flags._st[1] = 5000  # on time
    flags._dv[0] = 5400  # its outputs formed
    flags._st[2] = 5400
    flags._dl[2], flags._dl[3] = 8500, 0
    flags._st[3] = 8600  # 100 late
    flags._dv[1] = 8900
    flags._st[4] = 9050
    assert done.wait(5), got
    assert got == [("reach", 0, 1000), ("late", 400), ("reach", 1, 5400), ("late", 50), ("reach", 2, 9050)]
    assert rec0["deliver"] == 400 and rec1["deliver"] == 300 and rec1["late"] == 100
    # off (the default), the copy is not the watcher's business
    monkeypatch.delenv(devicepath.CARRY_DELIVERY_ENV)
    devicepath.reset_env()
    assert devicepath._Watcher(flags, 1e-4)._delivery() == 0


def _host_watcher(slots: int):
    """A reach watcher over host-mode flags (the GPU's pinned layout, stamps
    written by hand), its first ``slots`` slots cleared: (flags, watcher)."""
    import cuda_ext

    flags = cuda_ext.ReleaseFlags(4, "cpu")
    w = devicepath._Watcher(flags, 1e-4)
    for slot in range(slots):
        flags.clear_stamps(slot)
    return flags, w


def test_the_watcher_waits_natively_on_the_stamps_it_needs_next(monkeypatch):
    # The same sequence as above with the watcher's native wait (cuda_ext's
    # wait_stamps, GIL released; a Python stand-in with its semantics here): it
    # waits on the oldest reached wait's end stamp and the next call's reach
    # stamp, and returns when a call is added.
    import threading
    import time

    waits: list = []

    def wait_stamps(stamps, a, b, gen, seen, period_ns, timeout_ns):
        st, g = stamps.numpy(), gen.numpy()
        waits.append((a, b))
        t0 = time.monotonic_ns()
        while True:
            if a >= 0 and st[a]:
                return 0
            if b >= 0 and st[b]:
                return 1
            if g[0] != seen:
                return 2
            if time.monotonic_ns() - t0 >= timeout_ns:
                return -1
            time.sleep(period_ns / 1e9)

    monkeypatch.setattr(devicepath, "_native_wait", lambda: wait_stamps)
    flags, w = _host_watcher(3)
    got: list = []
    done = threading.Event()
    w.add(0, 900, lambda at: got.append(("reach", 0, at)), lambda ns: got.append(("late", ns)))
    w.add(1, 1500, lambda at: got.append(("reach", 1, at)), lambda ns: got.append(("late", ns)))
    time.sleep(0.01)
    assert got == [] and waits and waits[-1] == (-1, 0)  # no wait reached yet: call 0's reach stamp
    flags._dl[0], flags._dl[1] = 5000, 0
    flags._st[0] = 1000
    time.sleep(0.01)
    assert got == [("reach", 0, 1000)] and waits[-1] == (1, 2)  # call 0's end, call 1's reach
    w.add(2, 9000, lambda at: (got.append(("reach", 2, at)), done.set()), lambda ns: got.append(("late", ns)))
    flags._st[1] = 7000
    flags._st[2] = 8000
    flags._dl[2], flags._dl[3] = 0, 300
    flags._st[3] = 8800
    flags._st[4] = 9100
    assert done.wait(5), got
    assert got == [("reach", 0, 1000), ("late", 2000), ("reach", 1, 8000), ("late", 100), ("reach", 2, 9100)]


def test_the_native_wait_is_off_on_request_and_without_the_compiled_module(monkeypatch):
    monkeypatch.setenv(devicepath.POLL_NATIVE_ENV, "0")
    assert devicepath._native_wait() is None
    monkeypatch.delenv(devicepath.POLL_NATIVE_ENV)
    import cuda_ext

    monkeypatch.setattr(cuda_ext, "kernels", lambda: None)
    assert devicepath._native_wait() is None


def _recording(tmp_path, tensors):
    """A run folder whose rank 0 recorded ``tensors`` (ref -> tensor), in that order."""
    from prism.core.payloads import digest
    from prism.core.trace.records import Payload
    from prism.shell.runfolder import PayloadWriter, payload_data_name

    w = PayloadWriter(tmp_path, 0)
    off = 0
    for ref, t in tensors.items():
        data = t.numpy().tobytes()
        rec = Payload(ref=ref, role="recv", dtype="float32", shape=tuple(t.shape), nbytes=len(data),
                      digest=digest(data), step=0, file=payload_data_name(0), offset=off)
        w.received([(rec, memoryview(data))])
        off += len(data)
    w.sent([Payload(ref="coll:g:0:in", role="sent", dtype="float32", shape=(4,), nbytes=16, digest="0" * 32,
                    step=0)])
    w.close()
    return tmp_path


@pytest.mark.parametrize("pool_bytes", [1 << 20, 1024])
@pytest.mark.parametrize("host_budget", [None, 0], ids=["preloaded", "streamed"])
def test_recorded_outputs_come_from_the_prefetch_pool_in_any_order(tmp_path, pool_bytes, host_budget):
    # 1 MiB holds every block (all staged ahead); 1 KiB holds one at a time
    # (staging waits for room; a call whose block is not staged copies from the host).
    gen = torch.Generator().manual_seed(3)
    tensors = {f"coll:g:{i}:out": torch.randn(64 + i, generator=gen) for i in range(6)}
    feed = devicepath.RecordedFeed(str(payload_index_path(_recording(tmp_path, tensors), 0)), pool_bytes, torch.device("cpu"),
                                   host_budget=host_budget)
    assert feed.preloaded is (host_budget is None)
    order = ["coll:g:0:out", "coll:g:2:out", "coll:g:1:out", "coll:g:3:out", "coll:g:5:out", "coll:g:4:out"]
    for ref in order:
        out = torch.zeros_like(tensors[ref])
        assert feed.can_deliver(ref, out)
        assert feed.deliver(ref, out)
        assert torch.equal(out, tensors[ref]), ref
    s = feed.stats()
    assert s["delivered"] == 6 and s["missing"] == 0
    assert s["pool_peak_bytes"] <= pool_bytes
    # nothing recorded, or recorded at another size: the caller compensates
    assert not feed.can_deliver("coll:g:9:out", torch.zeros(4))
    assert not feed.deliver("coll:g:9:out", torch.zeros(4)) and feed.stats()["missing"] == 1


@pytest.mark.parametrize("host_budget", [None, 0], ids=["preloaded", "streamed"])
def test_a_recorded_output_of_another_size_is_refused_and_its_block_returned(tmp_path, host_budget):
    tensors = {"coll:g:0:out": torch.ones(8), "p2p:1:0:0:0": torch.full((8,), 2.0)}
    feed = devicepath.RecordedFeed(str(payload_index_path(_recording(tmp_path, tensors), 0)), 1 << 16, torch.device("cpu"),
                                   host_budget=host_budget)
    wrong = torch.zeros(4)
    assert not feed.can_deliver("coll:g:0:out", wrong)
    assert not feed.deliver("coll:g:0:out", wrong) and torch.equal(wrong, torch.zeros(4))
    out = torch.zeros(8)
    assert feed.deliver("p2p:1:0:0:0", out) and torch.equal(out, torch.full((8,), 2.0))
    import time

    for _ in range(100):  # the reader ends once nothing is left to stage
        if feed.pool.pool.used == 0:
            break
        time.sleep(0.01)
    assert feed.pool.pool.used == 0


def test_host_charge_takes_out_only_the_issue_time_a_drained_stream_waited_for():
    # Prism's issue time counts against the job only where the GPU waited for
    # the host: the next call found the stream drained.
    hc = devicepath.HostCharge(nominal_ns=30)
    gpu = {"reach": 0, "end": 0}
    moments = lambda: (gpu["reach"], gpu["end"])  # noqa: E731
    # call A entered busy at 1,000 and returned at 1,500 (500 in Prism; NCCL: 30)
    assert hc.on_entry(1000, False) == 0
    hc.on_return(1000, 1500, False, moments)
    gpu.update(reach=1400, end=1450)  # the GPU passed A's wait at 1,450
    # call B enters busy: the GPU was ahead, A's time hidden; nothing charged, A forgotten
    assert hc.on_entry(2000, False) == 0
    hc.on_return(2000, 2500, False, moments)
    gpu.update(reach=2600, end=2700)
    # call C enters drained at 2,900: the stream can have idled since 2,700 at most (200),
    # less than B's 470 beyond NCCL's: 200 charged
    assert hc.on_entry(2900, True) == 200
    hc.on_return(2900, 3400, True, moments)
    gpu.update(reach=3100, end=3300)  # C: reached at 3,100 (its pre: 3,100 - 2,900 - 30 = 170), passed at 3,300
    assert hc.pre(2900, 3100) == 170
    # call D enters drained at 3,600: C entered drained, so only its time in Prism after
    # the GPU passed it (3,400 - 3,300 = 100) can have held the stream
    assert hc.on_entry(3600, True) == 100
    hc.on_return(3600, 3700, True, lambda: (0, 0))
    # E drained, but D's GPU moments are unknown: nothing charged
    assert hc.on_entry(3800, True) == 0
    # drained with no call before it: nothing
    assert devicepath.HostCharge().on_entry(10, True) == 0
    assert hc.charged_ns == 300 and hc.charges == 2
    # unknown (off a GPU): never drained
    hc.on_return(4000, 4500, False, lambda: (4100, 4200))
    assert hc.on_entry(5000, None) == 0


def test_host_charge_takes_out_the_idle_after_a_wait_the_gpu_passed_before_prism_returned():
    # A synchronous call entered busy at 1,000 returns at 1,500 (NCCL's part: 30);
    # its wait ended on the GPU at 1,200: the stream had nothing more until the
    # host came back, so it idled 300, all Prism's (its 470 beyond NCCL's is more).
    hc = devicepath.HostCharge(nominal_ns=30)
    hc.on_return(1000, 1500, False, lambda: (1100, 1200), sync=True)
    assert hc.on_entry(1600, False) == 300
    # ... at most its own time beyond NCCL's: ended at 1,000, returned at 1,400 from 1,300
    hc.on_return(1300, 1400, False, lambda: (1000, 1000), sync=True)
    assert hc.on_entry(1450, False) == 70
    # the GPU passed the wait after the return: it never waited for this host
    hc.on_return(2000, 2500, False, lambda: (2400, 2600), sync=True)
    assert hc.on_entry(2700, False) == 0
    # an async call (its wait on a side stream: the caller's stream went on) or an unknown end: nothing
    hc.on_return(3000, 3500, False, lambda: (3100, 3200), sync=False)
    assert hc.on_entry(3600, False) == 0
    hc.on_return(4000, 4500, False, lambda: (4100, 0), sync=True)
    assert hc.on_entry(4600, False) == 0
    # what it charges is told to the call's owner (the watcher then carries none of it again)
    spent: list = []
    hc.on_return(5000, 5500, False, lambda: (5100, 5200), sync=True, spent=spent.append)
    assert hc.on_entry(5600, False) == 300 and spent == [300]
    # PRISM_DEVICE_HOST_CHARGE=drained: the rule before, only at a drained entry
    old = devicepath.HostCharge(nominal_ns=30, busy=False)
    old.on_return(1000, 1500, False, lambda: (1100, 1200), sync=True)
    assert old.on_entry(1600, False) == 0
    assert hc.charged_ns == 670 and hc.charges == 3


def _late_then_reached(issue1: int, drained: bool = False, excess: int = 0, spent: int = 0,
                       steps: tuple = (None, None)) -> list:
    """Two calls on a fresh watcher: call 0 (issued at 900, reached at 1,000)
    is due at 5,000 and ends 2,000 late at 7,000; call 1 (issued at ``issue1``)
    is reached at 8,000; call 0 spent ``excess`` in Prism beyond NCCL's, of
    which the host charge took ``spent``; ``steps``: the program's step at
    each. What the watcher reported, in order."""
    import threading

    flags, w = _host_watcher(2)
    got: list = []
    done = threading.Event()
    w.add(0, 900, lambda at: got.append(("reach", 0, at)), lambda ns: got.append(("late", ns)), None, False,
          steps[0])
    w.add(1, issue1, lambda at: (got.append(("reach", 1, at)), done.set()), lambda ns: got.append(("late", ns)),
          None, drained, steps[1])
    w.note_excess(0, excess)
    w.spend_excess(0, spent)
    w.spend_excess(3, spent)  # nothing noted on slot 3: nothing happens
    flags._dl[0], flags._dl[1] = 5000, 0
    flags._st[0], flags._st[1] = 1000, 7000
    flags._st[2] = 8000
    assert done.wait(5), got
    return got


def test_the_watcher_carries_prisms_issue_time_for_a_drained_call_instead_of_the_lateness(monkeypatch):
    # Call 0 ends 2,000 late; call 1 entered with its stream drained at 7,500 and
    # was reached at 8,000: the GPU had caught up and waited for the host, so the
    # lateness was absorbed and what delayed it is Prism's issue time beyond
    # NCCL's (8,000 - 7,500 - 100 = 400).
    hc = devicepath.HostCharge(nominal_ns=100)
    monkeypatch.setattr(devicepath, "_host_charge", hc)
    assert _late_then_reached(7500, drained=True) == [("reach", 0, 1000), ("late", 400), ("reach", 1, 8000)]
    assert hc.charged_ns == 400 and hc.charges == 1


def test_the_watcher_carries_lateness_the_hosts_own_prism_time_hid(monkeypatch):
    # Call 0 is released 2,000 late (due 5,000, ended 7,000); call 1 was issued at
    # 7,900, after the GPU passed call 0, and reached at 8,000. Call 0 spent 700 in
    # Prism beyond NCCL's: without it the host would have issued call 1 at 7,200,
    # so 800 of the lateness delayed the stream (default, "excess"); "min" carries
    # 100 (the stream waited for the host anyway, the rule before); "all" all 2,000.
    monkeypatch.setattr(devicepath, "_host_charge", None)
    for mode, want in (("", 800), ("excess", 800), ("min", 100), ("all", 2000)):
        monkeypatch.setenv(devicepath.LATE_CARRY_ENV, mode)
        assert _late_then_reached(7900, excess=700) == [("reach", 0, 1000), ("late", want), ("reach", 1, 8000)], mode
    # more than the lateness is never carried
    monkeypatch.setenv(devicepath.LATE_CARRY_ENV, "excess")
    assert _late_then_reached(7900, excess=5000)[1] == ("late", 2000)
    import cuda_ext

    monkeypatch.setenv(devicepath.LATE_CARRY_ENV, "some")
    with pytest.raises(SystemExit, match="PRISM_DEVICE_LATE_CARRY='some'"):
        devicepath._Watcher(cuda_ext.ReleaseFlags(1, "cpu"), 1e-4)


def test_the_step_rule_carries_all_the_lateness_into_a_later_step(monkeypatch):
    # PRISM_DEVICE_LATE_CARRY=step: as "excess" within a step (800 of 2,000, as above); where call 1 is in
    # a later step than call 0, the host reached it late for having waited on the late GPU at the step's
    # end (loss.item()), so the small gap says nothing: all 2,000 are carried
    monkeypatch.setattr(devicepath, "_host_charge", None)
    monkeypatch.setenv(devicepath.LATE_CARRY_ENV, "step")
    assert _late_then_reached(7900, excess=700, steps=(3, 3))[1] == ("late", 800)
    assert _late_then_reached(7900, excess=700, steps=(3, 4))[1] == ("late", 2000)
    assert _late_then_reached(7900, excess=700, steps=(None, 4))[1] == ("late", 800)  # a step not known: as excess
    monkeypatch.setenv(devicepath.LATE_CARRY_ENV, "excess")
    assert _late_then_reached(7900, excess=700, steps=(3, 4))[1] == ("late", 800)


def test_excess_the_host_charge_took_is_not_carried_again(monkeypatch):
    # As above, call 0 spent 700 in Prism beyond NCCL's; the host charge took 500 of it
    # (``spend_excess``), so the watcher carries min(2,000, 100 + 200) = 300, not 800:
    # each nanosecond of Prism's time comes out of the emulated clock once.
    monkeypatch.setattr(devicepath, "_host_charge", None)
    monkeypatch.delenv(devicepath.LATE_CARRY_ENV, raising=False)
    assert _late_then_reached(7900, excess=700, spent=500)[1] == ("late", 300)


def test_the_release_flag_flips_as_the_result_arrives_and_only_once(monkeypatch):
    # A device-path call's flag is flipped by whoever completes its future (the
    # transport's thread), before the completion thread's turn; that thread then
    # completes the call without flipping again. A failed call is not flipped
    # there: the completion thread lets the GPU go and reports the failure.
    import concurrent.futures
    import types

    from prism.core.protocol import CollectiveResult
    from prism.rank import backend

    monkeypatch.setattr(backend._rt, "current", lambda: types.SimpleNamespace(dilation_ns=5))
    flips, queued = [], []
    rel = types.SimpleNamespace(release=lambda *a: flips.append(a))
    rt = types.SimpleNamespace(on_done=lambda fut, handler: fut.add_done_callback(lambda f: queued.append((handler, f))))

    def op(slot):  # what the two handlers use of a backend._Op
        o = types.SimpleNamespace(release_flag=(rel, slot, 9), call_log={"t0": 0}, flipped=False, release_mono_ns=0,
                                  what=f"all_reduce (seq {slot})", completed=[])
        o.complete = lambda payloads, error: o.completed.append((payloads, error))
        return o

    a = op(2)
    fut = concurrent.futures.Future()
    backend._on_result(rt, a, fut)
    fut.set_result(CollectiveResult("g", 3, payloads=(), release_ns=1000, tail_ns=70))
    assert flips == [(2, 9, 1005, 70)] and a.flipped  # at once, on the monotonic clock (dilation 5)
    assert a.call_log["due"] == 1005 and a.call_log["tail"] == 70 and not a.completed
    (handler, f), = queued
    handler(f)  # the completion thread's turn: completes, does not flip again
    assert flips == [(2, 9, 1005, 70)] and a.completed == [((), None)]

    b = op(3)
    fut = concurrent.futures.Future()
    queued.clear()
    backend._on_result(rt, b, fut)
    fut.set_exception(RuntimeError("the coordinator is gone"))
    assert len(flips) == 1 and not b.flipped
    (handler, f), = queued
    handler(f)
    assert flips[-1] == (3, 9)  # the GPU let go
    (payloads, error), = b.completed
    assert payloads is None and "the coordinator is gone" in str(error)


def test_the_call_log_waits_for_the_completion_threads_last_stamp(monkeypatch, tmp_path):
    # the GPU goes on at the flag's flip; the completion thread stamps t_res a little later
    import json
    import threading

    monkeypatch.setenv(devicepath.CALL_LOG_ENV, str(tmp_path / "calls-r{rank}.jsonl"))
    monkeypatch.setattr(devicepath, "_call_log", None)
    done = devicepath.call_record(t0=1, t_flip=2, t_res=3)
    late = devicepath.call_record(t0=4, t_flip=5)
    host = devicepath.call_record(t0=6)  # a host-path call: no flip, nothing to wait for
    threading.Timer(0.1, lambda: late.update(t_res=7)).start()
    devicepath._write_call_log(3)
    rows = [json.loads(line) for line in (tmp_path / "calls-r3.jsonl").read_text().splitlines()]
    assert rows == [done, late, host] and late["t_res"] == 7
    # each record notes when it was made, with the thread's CPU time and context switches then
    assert all(isinstance(r["t_rec"], int) and r["c_rec"] >= 0 and r["v_rec"] >= 0 for r in rows)
    threads = json.loads((tmp_path / "calls-r3.jsonl.threads.json").read_text())
    assert any(t["name"] == threading.current_thread().name for t in threads), threads
    # a stamp that never comes holds the writer only as long as the bound
    monkeypatch.setattr(devicepath, "_T_RES_WAIT_S", 0.05)
    devicepath.call_record(t0=8, t_flip=9)
    devicepath._write_call_log(4)
    row = json.loads((tmp_path / "calls-r4.jsonl").read_text())
    assert row["t0"] == 8 and row["t_flip"] == 9 and "t_res" not in row


def test_the_reach_watchers_poll_period_comes_from_the_environment(monkeypatch):
    from prism.rank import devicepath as dp

    monkeypatch.delenv(dp.POLL_ENV, raising=False)
    assert dp.poll_s() == dp.Releaser.POLL_S == 20e-6
    monkeypatch.setenv(dp.POLL_ENV, "200")
    assert dp.poll_s() == pytest.approx(200e-6)
    for bad in ("0", "-5", "fast", "1e9"):
        monkeypatch.setenv(dp.POLL_ENV, bad)
        with pytest.raises(SystemExit, match="PRISM_DEVICE_POLL_US.*microseconds"):
            dp.poll_s()


def test_the_cpu_test_releaser_can_report_reaches_from_a_thread_of_their_own(monkeypatch):
    # PRISM_CPU_TEST_THREADED_REACH=1 (for bench/call_cost.py --threaded-reach): as a GPU's reach watcher
    import threading

    r = devicepath._NullReleaser()
    got: list = []
    done = threading.Event()
    rec: dict = {}
    r.watch(0, 1, lambda at: got.append(threading.current_thread().name), None, rec)
    assert got == [threading.current_thread().name] and rec["reach"] > 0  # by default: on the calling thread
    monkeypatch.setenv(devicepath.THREADED_REACH_ENV, "1")
    devicepath.reset_env()  # the switches are read once
    r.watch(0, 1, lambda at: (got.append(threading.current_thread().name), done.set()), None)
    assert done.wait(5) and got[-1] == "prism-reach"
