"""prism.rank.gputime: calibration steps, the mode's per-call cost, joins from
the script's GPU waits, and (on a GPU) the busy time of a calibrated segment."""

import time
import warnings

import pytest
import torch

from prism.rank import gputime
from prism.rank.devices import LogicalDeviceMode


def test_parse_steps():
    assert gputime.parse_steps("1,2") == {1, 2}
    assert gputime.parse_steps(" 0-3, 7 ") == {0, 1, 2, 3, 7}
    assert gputime.parse_steps("") == gputime.parse_steps("none") == frozenset()
    with pytest.raises(ValueError):
        gputime.parse_steps("x")


def test_mode_overhead_is_measured_and_the_probe_is_not_counted():
    mode = LogicalDeviceMode()
    with mode:
        x = torch.ones(3)
        torch.add(x, 1)
        assert mode.calls >= 2
        before = mode.calls
        per_call = gputime.measure_mode_overhead(mode, n=300, rounds=3)
        assert mode.calls == before
    # A Python-level mode costs something per call, and far less than a millisecond.
    assert 0 <= per_call < 1e6


def test_script_waits_become_joins_only_on_the_main_thread(monkeypatch):
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    t = gputime.GpuTiming(frozenset(), None)
    t.install()
    seen = []
    t.on_script_sync = seen.append
    torch.cuda.synchronize()
    warnings.warn("called a synchronizing CUDA operation (Triggered internally)", UserWarning)
    warnings.warn("called a synchronizing CUDA operation (Triggered internally)", UserWarning)  # every time
    import threading

    th = threading.Thread(target=torch.cuda.synchronize)
    th.start()
    th.join()
    assert len(seen) == 3
    with pytest.warns(UserWarning, match="something else"):
        warnings.warn("something else", UserWarning)


def test_cpu_share_without_cuda_is_the_wall_time_less_the_mode_cost():
    mode = LogicalDeviceMode()
    t = gputime.GpuTiming(frozenset({0}), mode)
    t.per_call_ns = 1_000.0
    start = time.monotonic_ns()
    t.open(0)
    mode.calls += 50
    cpu_end, end, cpu_ns, gpu_ns, free_ns, cold_ns = t.close(start, False)
    assert gpu_ns == -1 and end == cpu_end
    assert cpu_ns == max(cpu_end - start - 50_000, 0)


def test_ranks_sharing_a_gpu_take_turns(tmp_path):
    import threading

    path = str(tmp_path / "gpu.lock")
    a = gputime.GpuTiming(frozenset(), None, path)
    b = gputime.GpuTiming(frozenset(), None, path)
    a.open(0)  # rank a computes a segment
    a.acquire()  # its completion thread copies in: re-entrant within the process
    got = threading.Event()

    def other():
        b.open(0)
        got.set()

    th = threading.Thread(target=other)
    th.start()
    assert not got.wait(0.2)  # rank b waits for the GPU
    a.release()
    assert not got.wait(0.1)  # a's segment still holds it
    a.close(time.monotonic_ns(), False)
    assert got.wait(5)
    th.join()
    b.close(time.monotonic_ns(), False)
    a.open(0)  # free again
    a.close(time.monotonic_ns(), False)


def _busy_ns(a) -> float:
    """What 8 matmuls of ``a`` take back to back on the current stream (ns)."""
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        e0.record()
        for _ in range(8):
            a @ a
        e1.record()
        e1.synchronize()
    return e0.elapsed_time(e1) * 1e6


@pytest.mark.gpu(reason="measures GPU busy time")
def test_calibrated_segment_measures_gpu_busy_time_not_issue_gaps():
    a = torch.randn(2048, 2048, device="cuda")
    busy = _busy_ns(a)
    t = gputime.GpuTiming(frozenset({0}), None)
    t._walls_prev = [20_000_000]  # a spin of 40 ms
    start = time.monotonic_ns()
    t.open(0)
    for _ in range(8):
        a @ a
        time.sleep(0.002)  # a slow CPU: 16 ms of gaps a plain event pair would count
    cpu_end, end, cpu_ns, gpu_ns, free_ns, cold_ns = t.close(start, False)
    assert gpu_ns > 0, "the spin should have covered the issue time"
    assert abs(gpu_ns - busy) < 0.25 * busy + 100_000, (gpu_ns, busy)
    assert cpu_ns >= 16_000_000 and end >= cpu_end


@pytest.mark.gpu(reason="measures GPU busy time")
def test_calibration_covers_the_scripts_own_streams():
    """FSDP2 runs kernels on streams of its own and calls collectives with one
    of them current: the busy time must cover them, from the spin's stream."""
    a = torch.randn(2048, 2048, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        busy = _busy_ns(a)
    t = gputime.GpuTiming(frozenset({0}), None)
    set_stream, sync = torch.cuda.set_stream, torch.cuda.synchronize
    try:
        t.install()  # hooks torch.cuda.set_stream, which torch.cuda.stream(...) uses
        with torch.cuda.stream(side):
            pass
        assert (side.device_index, side.stream_id) in t._streams  # (the default stream too, on exit)
        t._walls_prev = [20_000_000]  # a spin of 40 ms
        start = time.monotonic_ns()
        t.open(0)
        with torch.cuda.stream(side):
            for _ in range(8):
                a @ a
                time.sleep(0.002)
            # the segment ends at a call made with the side stream current
            cpu_end, end, cpu_ns, gpu_ns, free_ns, cold_ns = t.close(start, False)
    finally:
        torch.cuda.set_stream, torch.cuda.synchronize = set_stream, sync
        torch.cuda.set_sync_debug_mode(0)
    assert gpu_ns > 0, "the spin should have covered the issue time"
    assert abs(gpu_ns - busy) < 0.25 * busy + 100_000, (gpu_ns, busy)


def test_a_join_segments_cpu_share_ends_where_the_waiting_call_began():
    mode = LogicalDeviceMode()
    t = gputime.GpuTiming(frozenset(), mode)
    closed = []
    start = time.monotonic_ns()
    t.on_script_sync = lambda now: closed.append(t.close(start, True))
    t.open(0)
    mode.call_ns = start + 1_000  # the .item() began 1 us into the segment, then waited
    time.sleep(0.01)
    t._script_synced()
    cpu_end, end, cpu_ns, gpu_ns, _, _ = closed[-1]
    assert cpu_ns == 1_000 and end - start >= 10_000_000
    # a stamp from before the segment (the wait came from outside the mode): the wall time
    t.open(0)
    mode.call_ns = start - 5
    t._script_synced()
    assert closed[-1][2] == closed[-1][1] - start
    # torch.cuda.synchronize stamps its own start
    t.open(0)
    t._script_synced(start + 2_000)
    assert closed[-1][2] == 2_000


def test_ranks_take_turns_per_physical_gpu_and_not_while_swapping(monkeypatch):
    monkeypatch.delenv(gputime.EXCLUSIVE_ENV, raising=False)
    monkeypatch.delenv(gputime.TWO_CLOCK_ENV, raising=False)
    # One GPU per rank in the script's numbering: CUDA_VISIBLE_DEVICES is not
    # set, the physical GPU names the turn (two GPUs, two separate turns).
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    names = set()
    for phys in ("0", "1"):
        monkeypatch.setenv("PRISM_PHYSICAL_DEVICE", phys)
        t = gputime.from_env(None)
        names.add(t.exclusive)
    assert len(names) == 2 and all(n.endswith(("-0.lock", "-1.lock")) for n in names)
    # Swapping: no turns (a checkpointed rank's copy would hold its turn).
    assert gputime.from_env(None, swapping=True).exclusive is None


@pytest.mark.gpu(reason="times kernel launches")
def test_cold_start_probe_leaves_the_scripts_random_stream_and_call_count_alone():
    mode = LogicalDeviceMode()
    torch.zeros(1, device="cuda")
    rng = torch.cuda.get_rng_state()
    mode.calls = 7
    cold = gputime.measure_cold_start(mode, rounds=5)
    assert 0 <= cold < 50_000_000  # ns: a cold start is tens to hundreds of microseconds
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    assert mode.calls == 7


@pytest.mark.gpu(reason="measures GPU busy time")
def test_an_uncalibrated_segment_records_its_free_finish_and_a_cold_start_after_a_call():
    a = torch.randn(2048, 2048, device="cuda")
    busy = _busy_ns(a)
    t = gputime.GpuTiming(frozenset(), None)
    t.open(0)  # CUDA is up: the cold-start probe runs here, before the segment starts
    assert t.cold_ns is not None and t.cold_ns >= 0
    t.close(time.monotonic_ns(), False)
    start = time.monotonic_ns()
    t.open(0, after_comm=True)
    for _ in range(8):
        a @ a
    cpu_end, end, cpu_ns, gpu_ns, free_ns, cold_ns = t.close(start, False)
    assert gpu_ns == -1 and cold_ns == t.cold_ns
    assert free_ns >= max(cpu_ns, 0.75 * busy), (free_ns, cpu_ns, busy)
    start = time.monotonic_ns()
    t.open(0)  # after a join or at a step's start: no cold start to take off
    assert t.close(start, False)[5] == 0
