"""cuda_ext on CPU: the fallback against an independent numpy oracle of the
kernels' semantics (cuda_ext/reference.py's table), bit for bit, for every op
and dtype; the pool's ring; the host mode of the release flags; and which
path runs here. The kernels against the fallback: tests/unit/test_cuda_ext_gpu.py."""

import threading
import time

import numpy as np
import pytest
import torch

import cuda_ext
from cuda_ext import reference

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _to_bf16_bits(x32: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (NaN stays NaN)."""
    b = x32.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x32), np.uint16(0x7FC0), r)


def _round(x32: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """The dtype's values as float32, rounded once from float32."""
    if dtype == torch.float32:
        return x32.astype(np.float32)
    if dtype == torch.float16:
        with np.errstate(over="ignore"):  # 65504 + 65504 overflows to inf, as on the GPU
            return x32.astype(np.float16).astype(np.float32)
    return (_to_bf16_bits(x32).astype(np.uint32) << 16).view(np.float32)


def _oracle(op: str, a: np.ndarray, b: np.ndarray, n: int, factor: float, dtype: torch.dtype) -> np.ndarray:
    a, b = a.astype(np.float32), b.astype(np.float32)
    with np.errstate(all="ignore"):
        if op == "SUM":
            r = a + b
        elif op == "AVG":
            r = (a + b) / np.float32(n)
        elif op == "PREMUL_SUM":
            r = np.float32(factor) * a
            r = r + b
        elif op == "MIN":
            r = np.where(np.isnan(a), a, np.where(np.isnan(b), b, np.where(b < a, b, a)))
        else:
            r = np.where(np.isnan(a), a, np.where(np.isnan(b), b, np.where(b > a, b, a)))
    return _round(r.astype(np.float32), dtype)


def _inputs(dtype: torch.dtype, n: int = 4099, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(n, generator=g) * 3).to(dtype)
    b = (torch.randn(n, generator=g) * 1e-2).to(dtype)  # folded terms of other magnitudes: rounding matters
    a[:6] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1.0, 65504.0]).to(dtype)
    b[:6] = torch.tensor([-0.0, 0.0, 1.0, 2.0, float("nan"), 65504.0]).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op", list(reference.OPS))
def test_fallback_equals_the_numpy_oracle_bit_for_bit(op, dtype):
    a, b = _inputs(dtype)
    got = cuda_ext.combine(op, a, b, n=7, factor=0.125 if op == "PREMUL_SUM" else 1.0)
    assert got.dtype == dtype
    want = _oracle(op, a.float().numpy(), b.float().numpy(), 7, 0.125, dtype)
    g = got.float().numpy()
    assert np.array_equal(np.isnan(g), np.isnan(want))
    ok = ~np.isnan(g)
    # bit for bit (signed zeros included), not approximately
    assert np.array_equal(g[ok].view(np.uint32), want[ok].view(np.uint32))


def test_combine_into_out_and_integer_dtypes():
    a = torch.tensor([5, -3, 7], dtype=torch.int64)
    b = torch.tensor([1, 1, -9], dtype=torch.int64)
    out = torch.empty_like(a)
    assert cuda_ext.combine("SUM", a, b, out=out) is out and out.tolist() == [6, -2, -2]
    assert cuda_ext.combine("MAX", a, b).tolist() == [5, 1, 7]
    assert cuda_ext.combine("AVG", a, b, n=2).tolist() == [3, -1, -1]


def test_combine_names_what_does_not_match():
    a = torch.zeros(4)
    with pytest.raises(ValueError, match="unknown reduce op 'PRODUCTX'"):
        cuda_ext.combine("PRODUCTX", a, a)
    with pytest.raises(ValueError, match=r"own \(4,\) torch.float32 .* folded \(3,\)"):
        cuda_ext.combine("SUM", a, torch.zeros(3))


def test_place_writes_own_chunk_into_the_layout():
    bg = torch.arange(12.0)
    out = torch.full((3, 4), -1.0)
    cuda_ext.place(out, bg, torch.tensor([100.0, 101.0, 102.0, 103.0]), 4)
    assert out.view(-1).tolist() == [0, 1, 2, 3, 100, 101, 102, 103, 8, 9, 10, 11]
    cuda_ext.place(out, bg, torch.tensor([7.0, 8.0]), 10)  # the last slot, uneven
    assert out.view(-1).tolist()[-3:] == [9, 7, 8]
    with pytest.raises(ValueError, match="do not fit"):
        cuda_ext.place(out, bg, torch.zeros(4), 10)


def test_this_machine_runs_the_fallback_and_says_why():
    i = cuda_ext.info()
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: tests/unit/test_cuda_ext_gpu.py checks the kernels")
    assert i.path == "fallback" and "no CUDA device" in i.reason


def test_holding_the_gil_is_refused_without_the_compiled_extension():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: tests/unit/test_cuda_ext_gpu.py checks the kernels")
    assert cuda_ext.hold_gil(True) is False  # the fallback has no stream calls to hold it in


def test_fallback_is_forced_by_the_environment(monkeypatch):
    monkeypatch.setenv("PRISM_CUDA_EXT", "off")
    mod, i = cuda_ext._load()
    assert mod is None and i.reason == "PRISM_CUDA_EXT=off"


def test_device_pool_is_a_ring_in_delivery_order():
    pool = cuda_ext.DevicePool(4096, "cpu")
    a, va = pool.alloc(1000)   # 1024 with alignment
    b, vb = pool.alloc(2000)   # 2048
    assert va.numel() == 1000 and vb.numel() == 2000 and pool.used == 3072
    with pytest.raises(cuda_ext.PoolFull, match="full"):
        pool.alloc(1500)
    pool.free(b)  # out of order: held until a is done
    assert pool.used == 3072
    pool.free(a)
    assert pool.used == 0 and pool.peak == 3072
    c, vc = pool.alloc(4096)
    vc.fill_(7)
    assert int(pool.slab.sum()) == 7 * 4096
    pool.free(c)
    with pytest.raises(cuda_ext.PoolFull, match="exceeds the whole prefetch pool"):
        pool.alloc(5000)


def test_device_pool_wraps_around():
    pool = cuda_ext.DevicePool(4096, "cpu")
    ids = [pool.alloc(1024)[0] for _ in range(3)]
    pool.free(ids[0])
    pool.free(ids[1])
    d, vd = pool.alloc(2048)  # the 1024 left at the end is skipped: wraps to 0
    assert vd.data_ptr() == pool.slab.data_ptr()
    assert pool.used == 1024 + 1024 + 2048


def test_device_pool_fits_says_what_alloc_would_do():
    import random

    rng = random.Random(7)
    pool = cuda_ext.DevicePool(8192, "cpu")
    live: list[int] = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            pool.free(live.pop(rng.randrange(len(live))))
            continue
        n = rng.choice([1, 100, 1000, 2048, 3000, 5000, 8192, 9000])
        used, head = pool.used, pool._head
        want = pool.fits(n)
        assert (pool.used, pool._head) == (used, head)  # a question changes nothing
        try:
            live.append(pool.alloc(n)[0])
            got = True
        except cuda_ext.PoolFull:
            got = False
        assert got == want, (n, used, head)


def test_prefetch_pool_stages_takes_and_reclaims():
    pp = cuda_ext.PrefetchPool(1 << 12, "cpu")
    for k in range(3):
        pp.stage(("g", k), torch.full((256,), float(k)))
    assert pp.take(("g", 1), torch.float32, (16, 16))[3, 3].item() == 1.0
    for k in range(3):
        pp.done(("g", k))
    assert pp.pool.used == 0
    for k in range(8):  # more than fits at once: consumed blocks make room
        pp.stage(("h", k), torch.full((256,), float(k)))
        assert pp.take(("h", k), torch.float32, (256,))[0].item() == k
        pp.done(("h", k))
    with pytest.raises(KeyError, match="already staged"):
        pp.stage(("x", 0), torch.zeros(1))
        pp.stage(("x", 0), torch.zeros(1))


def test_prefetch_pool_deliver_fills_any_layout_and_a_refused_block_goes_back():
    pp = cuda_ext.PrefetchPool(1 << 12, "cpu")
    assert not pp.native  # the CPU pool: torch's copies
    data = torch.arange(6, dtype=torch.float32)
    pp.stage("a", data)
    out = torch.zeros(2, 3).T  # not contiguous: its elements in order get the recording's
    pp.deliver("a", out)
    assert torch.equal(out, data.view(3, 2)) and "a" not in pp
    pp.stage("b", data)
    pp.stage("c", data)
    pp.done("b")  # refused, never taken: its block goes back
    pp.deliver("c", torch.empty(6))
    assert pp.pool.used == 0


def test_release_flags_host_mode_orders_the_wait_after_the_release():
    flags = cuda_ext.ReleaseFlags(4, "cpu")
    assert flags.default_mode() == "host"
    seen = []

    def waiter():
        flags.wait(2, 3)
        seen.append(time.monotonic_ns())

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.05)
    flags.release(2, 1)  # below the value: still waiting
    time.sleep(0.02)
    assert not seen
    t = time.monotonic_ns()
    flags.release(2, 3)
    th.join(5)
    assert seen and seen[0] >= t and flags.released_ns(2) >= t
    with pytest.raises(ValueError, match="mode 'spin'"):
        flags.wait(0, 0, mode="spin")


def test_a_release_flipped_ahead_of_time_ends_the_wait_at_its_moment_and_tail():
    """``release(at_ns, tail_ns)``: the wait (here the host mode's thread)
    ends at max(at_ns, the moment it was reached + tail_ns), never sooner,
    though the flag was flipped at once."""
    import threading
    import time

    flags = cuda_ext.ReleaseFlags(4, "cpu")
    assert flags.clock_offset_ns() == 0 and flags.to_wait_clock(123) == 123
    ended = {}

    def waiter(slot):
        flags.wait(slot, 1, mode="host")
        ended[slot] = time.monotonic_ns()

    t = threading.Thread(target=waiter, args=(0,))
    t.start()
    at = time.monotonic_ns() + 40_000_000
    flags.release(0, 1, at_ns=at)
    t.join(5)
    assert ended[0] >= at
    # a tail: the stream got there late, the call still takes its time after it got there
    flags.release(1, 1, tail_ns=30_000_000)
    t = threading.Thread(target=waiter, args=(1,))
    t.start()
    t.join(5)
    assert ended[1] - flags.stamps[2].item() >= 30_000_000
    assert flags.released_ns(1) >= flags.reached_ns(1) + 30_000_000


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    assert not cuda_ext._clear_stale_lock(tmp_path)  # a build may hold it now
    assert lock.exists()
    old = time.time() - cuda_ext.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert cuda_ext._clear_stale_lock(tmp_path)
    assert not lock.exists()
    assert "stale build lock" in capsys.readouterr().err


def test_host_mode_delivery_stamp_times_what_follows_the_wait():
    # the CPU twin of the GPU's mark_delivered: from the wait's end to the mark
    import time as _time

    import cuda_ext as ce

    flags = ce.ReleaseFlags(2, "cpu")
    flags.clear_stamps(1)
    flags.release(1, 1)
    flags.wait(1, 1)  # released already: returns at once, stamped
    _time.sleep(0.002)
    flags.mark_delivered(1)
    assert 1_000_000 <= flags.delivery_ns(1) < 1_000_000_000
    flags.clear_stamps(1)
    assert flags.delivery_ns(1) == 0
