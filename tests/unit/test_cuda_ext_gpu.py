"""cuda_ext on a GPU: the compiled kernels against the pure-torch fallback,
bit for bit, for every op and dtype (aligned and unaligned, odd sizes, NaN
and signed zeros); the pool outside torch's allocator; the stream-ordered
release in both modes; the prefetch pool's ordering on the GPU. Skips
without a CUDA device (tests/unit/test_cuda_ext.py covers the CPU)."""

import threading
import time

import pytest
import torch

import cuda_ext
from cuda_ext import reference

pytestmark = pytest.mark.gpu(reason="the CUDA kernels of cuda_ext")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def test_the_kernels_were_built():
    i = cuda_ext.info()
    assert i.path == "kernels", i.reason


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op", list(reference.OPS))
@pytest.mark.parametrize("n_elems,offset", [(1 << 20, 0), (4099, 0), (4099, 3)])
def test_kernel_equals_fallback_bit_for_bit(op, dtype, n_elems, offset):
    g = torch.Generator(device="cuda").manual_seed(1)
    a = (torch.randn(n_elems + offset, device="cuda", generator=g) * 3).to(dtype)[offset:]
    b = (torch.randn(n_elems + offset, device="cuda", generator=g) * 1e-2).to(dtype)[offset:]
    a[:6] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1.0, 60000.0]).to(dtype)
    b[:6] = torch.tensor([-0.0, 0.0, 1.0, 2.0, float("nan"), 60000.0]).to(dtype)
    kw = dict(n=7, factor=0.125 if op == "PREMUL_SUM" else 1.0)
    got = cuda_ext.combine(op, a, b, **kw)
    want = reference.combine(op, a, b, **kw)
    nan = torch.isnan(got.float())
    assert torch.equal(nan, torch.isnan(want.float()))
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))


def test_pool_memory_is_not_torchs():
    torch.cuda.synchronize()
    before, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    pool = cuda_ext.DevicePool(64 << 20, "cuda")
    _, v = pool.alloc(1 << 20)
    v.fill_(3)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before and torch.cuda.max_memory_allocated() == peak
    assert int(v[:16].sum()) == 48


def test_prefetch_fill_is_ordered_on_the_gpu():
    pp = cuda_ext.PrefetchPool(32 << 20, "cuda")
    host = torch.arange(1 << 20, dtype=torch.float32)
    torch.cuda._sleep(50_000_000)  # the consumer stream is busy; the fill goes on beside it
    pp.stage("k", host)
    x = pp.take("k", torch.float32, (1 << 20,))
    y = x * 2
    pp.done("k")
    assert torch.equal(y.cpu(), host * 2)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_prefetch_deliver_behind_a_release_wait_gives_the_bytes_and_reuses_its_blocks(native, monkeypatch):
    # PrefetchPool.deliver (one native call with the extension; take, copy and done through torch
    # without): each delivery lands after its fill and after the release the stream waits on; the
    # ring's blocks come back once the stream passed them, and the native events are reused.
    monkeypatch.setenv(cuda_ext.POOL_NATIVE_ENV, "1" if native else "0")
    pp = cuda_ext.PrefetchPool(4 << 20, "cuda")  # room for 3 blocks of 1 MiB (+ alignment): it wraps
    assert pp.native is native
    flags = cuda_ext.ReleaseFlags(8, "cuda")
    host = torch.empty(8 << 20, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.randint(0, 256, (8 << 20,), dtype=torch.uint8))
    outs = []
    for i in range(8):
        while not pp.fits(1 << 20):
            torch.cuda.synchronize()
        block = host[i << 20:(i + 1) << 20]
        pp.stage(i, block, block=False, ready=True, ptr=block.data_ptr())
        flags.wait(i, 1)  # the stream holds here until released
        out = torch.full((1 << 18,), -1.0, device="cuda")  # fp32: 1 MiB
        pp.deliver(i, out)
        outs.append(out)
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.002)
        assert not done.query()  # the copy waits behind the release
        flags.release(i, 1)
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert torch.equal(out.view(torch.uint8).cpu(), host[i << 20:(i + 1) << 20]), i
    if native:
        assert 0 < pp.events_made <= 8  # reused, not one per fill and delivery (16)
    # a staged block refused (never taken) goes back after its fill
    pp.stage("x", host[:1 << 20], ready=True)
    pp.done("x")
    torch.cuda.synchronize()
    assert pp.fits(3 << 20)


@pytest.mark.parametrize("mode", ["kernel", "memop"])
def test_release_holds_the_stream_not_the_cpu(mode):
    flags = cuda_ext.ReleaseFlags(8, "cuda")  # loads the kernels (a JIT build or the cache) before the timing
    out = torch.zeros(4, device="cuda")
    t0 = time.monotonic()
    flags.wait(3, 1, mode=mode)
    out.fill_(5)  # queued behind the wait
    returned = time.monotonic() - t0
    assert returned < 0.05  # the call did not block the CPU
    ev = torch.cuda.Event()
    ev.record()
    time.sleep(0.05)
    assert not ev.query()  # still held by the flag
    threading.Timer(0.05, flags.release, (3, 1)).start()
    ev.synchronize()
    assert out.sum().item() == 20
    assert flags.released_ns(3) >= flags.reached_ns(3) > 0


def test_the_reach_is_seen_by_the_host_while_the_wait_still_spins():
    """The wait kernel stamps its reach before it spins (the rank's watcher
    reports it as the call's arrival); a release flipped late is measured as
    such (late_ns), one flipped ahead of time is not."""
    flags = cuda_ext.ReleaseFlags(8, "cuda")
    flags.clear_stamps(4)
    t0 = time.monotonic_ns()
    torch.cuda._sleep(20_000_000)  # the stream gets there some ms after the CPU queued it
    flags.wait(4, 1, mode="kernel")
    deadline = time.monotonic() + 5
    while not flags.reached_mono_ns(4) and time.monotonic() < deadline:
        time.sleep(1e-4)
    reach = flags.reached_mono_ns(4)
    assert reach > t0 + 1_000_000  # the GPU's reach, later than the CPU's issue
    assert flags.late_ns(4) is None  # still spinning
    flags.release(4, 1, at_ns=reach + 1_000_000)  # due 1 ms after the reach, flipped before that
    torch.cuda.synchronize()
    late = flags.late_ns(4)
    assert late is not None and late < 200_000, late  # on time: the GPU timed it
    flags.clear_stamps(5)
    flags.wait(5, 1, mode="kernel")
    while not flags.reached_mono_ns(5):
        time.sleep(1e-4)
    time.sleep(0.01)
    flags.release(5, 1, at_ns=flags.reached_mono_ns(5) + 1_000_000)  # flipped ~9 ms after it was due
    torch.cuda.synchronize()
    assert 5_000_000 < flags.late_ns(5) < 50_000_000


def test_the_wait_kernel_times_a_release_flipped_ahead_of_time():
    """The flag flips at once; the GPU holds the stream until the release's
    moment (on its globaltimer) and, for a stream that got there late, until
    the call's tail after it got there."""
    flags = cuda_ext.ReleaseFlags(8, "cuda")
    off = flags.clock_offset_ns()
    flags.wait(1, 1, mode="kernel")
    ev = torch.cuda.Event()
    ev.record()
    at = time.monotonic_ns() + 30_000_000
    flags.release(1, 1, at_ns=at)
    ev.synchronize()
    done = time.monotonic_ns()
    assert done >= at - 100_000  # the GPU's clock against ours: within 0.1 ms
    assert flags.released_ns(1) + off >= at - 100_000
    # a tail 20 ms long: released "in the past", the stream still pays it after it got there
    flags.release(2, 1, at_ns=time.monotonic_ns() - 5_000_000, tail_ns=20_000_000)
    torch.cuda._sleep(50_000_000)  # the stream gets to the wait late
    flags.wait(2, 1, mode="kernel")
    torch.cuda.synchronize()
    assert flags.released_ns(2) - flags.reached_ns(2) >= 20_000_000


def test_the_delivery_stamp_times_the_work_queued_behind_a_wait():
    """``mark_delivered`` stamps the stream after what follows the wait (a
    call's outputs formed): ``delivery_ns`` is that work's time on the GPU."""
    flags = cuda_ext.ReleaseFlags(4, "cuda")
    flags.clear_stamps(3)
    assert flags.delivery_ns(3) == 0
    flags.release(3, 1)
    flags.wait(3, 1, mode="kernel")
    torch.cuda._sleep(20_000_000)  # ~10 ms of the stream's time after the wait ends
    flags.mark_delivered(3)
    torch.cuda.synchronize()
    d = flags.delivery_ns(3)
    assert 1_000_000 < d < 200_000_000, d
    flags.clear_stamps(3)
    assert flags.delivery_ns(3) == 0


def test_wait_stamps_returns_on_a_stamp_or_a_new_generation_with_the_gil_released():
    mod = cuda_ext.kernels()
    stamps = torch.zeros(4, dtype=torch.int64, pin_memory=True)
    gen = torch.zeros(1, dtype=torch.int64)
    assert mod.wait_stamps(stamps, 1, 2, gen, 0, 20_000, 2_000_000) == -1  # nothing set: its bound
    gen[0] = 1
    assert mod.wait_stamps(stamps, 1, 2, gen, 0, 20_000, 2_000_000) == 2
    none = torch.empty(0, dtype=torch.int32)
    mod.stamp(stamps, 2, none, 0, 0)  # the GPU's globaltimer into stamps[2], as a wait kernel's reach
    assert mod.wait_stamps(stamps, 1, 2, gen, 1, 20_000, 5_000_000_000) == 1
    # while a thread waits there, this thread runs Python freely (the GIL is not held)
    stamps.zero_()
    t = threading.Thread(target=mod.wait_stamps, args=(stamps, 0, -1, gen, 1, 20_000, 300_000_000))
    t0 = time.monotonic()
    t.start()
    n = 0
    while time.monotonic() - t0 < 0.1:
        n += 1
    stamps[0] = 7
    t.join(5)
    assert not t.is_alive() and n > 10_000


SHARED_WRITER = """
import sys, time
from transport.shared_release import SharedRelease
s = SharedRelease.open(sys.argv[1])
time.sleep(0.1)
at = time.monotonic_ns() + 20_000_000 - int(s.header[4])  # due 20 ms from now, on the rank's dilated clock
s.release(int(sys.argv[2]), 1, at_rank_ns=at, tail_ns=0)
print(at + int(s.header[4]))
"""


def test_another_process_releases_the_gpu_through_shared_flags(tmp_path):
    """``ReleaseFlags(shared=...)``: the flags and deadlines in a file
    registered with CUDA; another process (the coordinator) writes a deadline
    and the flag, and the stream goes on at that deadline, with no call of
    this process's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    # where the device path puts it (tmpfs): a disk file's page cache is not what a sandbox registers
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(shm, f"prism-test-release-{os.getpid()}")
    flags = cuda_ext.ReleaseFlags(8, "cuda", shared=path)
    assert flags.flags.is_pinned() and flags.default_mode() == "kernel"
    flags.publish_dilation(5_000)
    off = flags.clock_offset_ns()
    flags.clear_stamps(3)
    flags.wait(3, 1, mode="kernel")
    ev = torch.cuda.Event()
    ev.record()
    went_on = False
    try:
        proc = subprocess.run([sys.executable, "-c", SHARED_WRITER, path, "3"],
                              capture_output=True, text=True, timeout=20, cwd=Path(__file__).resolve().parents[2])
        assert proc.returncode == 0, proc.stderr
        due_mono = int(proc.stdout.strip())
        deadline = time.monotonic() + 10
        while not ev.query() and time.monotonic() < deadline:
            time.sleep(1e-3)
        went_on = ev.query()
    finally:
        if not ev.query():  # never leave the GPU spinning (the next test would hang)
            flags.release(3, 1)
            torch.cuda.synchronize()
        os.unlink(path)
    assert went_on, "the stream did not go on after the other process's release"
    assert flags.released_ns(3) + off >= due_mono - 100_000  # held until the deadline the writer asked for
    late = flags.late_ns(3)
    assert late is not None and late < 2_000_000, late


def test_the_stream_calls_can_keep_the_gil_held():
    """``hold_gil(True)``: a release wait and a delivery queue with the GIL
    held throughout; the stream still waits for the release and goes on at it."""
    assert cuda_ext.hold_gil(True)
    try:
        flags = cuda_ext.ReleaseFlags(4, "cuda")
        flags.wait(0, 1, mode="kernel")
        ev = torch.cuda.Event()
        ev.record()
        time.sleep(0.005)
        assert not ev.query()
        flags.release(0, 1)
        ev.synchronize()
    finally:
        cuda_ext.hold_gil(False)
