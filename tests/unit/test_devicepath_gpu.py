"""prism.rank.devicepath on a GPU: an async device-path call on the side
stream holds neither the CPU nor the caller's stream until its release,
and a wait (or the torch future) orders the consumer behind its outputs.
Skips without a CUDA device."""

import threading
import time

import pytest
import torch

import cuda_ext
from prism.rank import devicepath

pytestmark = pytest.mark.gpu(reason="streams and the release flags on a GPU")


class _Pending:
    stream_done = None
    stash: list = []


def _async_call(slot: int, factor: float):
    """An async call on the side stream: it waits for release flag ``slot``,
    then multiplies its output by ``factor``. (flags, device, output, pending)."""
    flags = cuda_ext.ReleaseFlags(8, "cuda")
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.ones(1 << 20, device=dev)
    pending = _Pending()
    with devicepath.SideStream(dev).run(pending, [x]):
        flags.wait(slot, 1, mode=flags.default_mode())
        x.mul_(factor)  # the call's outputs, behind the release
    return flags, dev, x, pending


def test_an_async_call_on_the_side_stream_lets_the_callers_stream_compute():
    flags, dev, x, pending = _async_call(2, 3)
    assert pending.stream_done is not None and pending.stash == [x]
    y = torch.full((1 << 20,), 2.0, device=dev)
    y.mul_(5)  # the caller's compute goes on
    computed = torch.cuda.Event()
    computed.record()
    deadline = time.monotonic() + 5
    while not computed.query() and time.monotonic() < deadline:
        time.sleep(1e-3)
    assert computed.query()  # the caller's stream did not wait for the release
    assert not pending.stream_done.event.query()  # the call still waits for it
    threading.Timer(0.05, flags.release, (2, 1)).start()
    torch.cuda.current_stream(dev).wait_event(pending.stream_done.event)  # what Work.wait() does
    z = x + 0  # ordered behind the call's outputs
    assert z.sum().item() == 3 * (1 << 20) and y[0].item() == 10


def test_the_future_of_an_async_call_completes_behind_the_side_stream():
    flags, dev, x, pending = _async_call(3, 7)
    fut = torch.futures.Future(devices=[dev])
    done = threading.Event()

    def complete():  # the completion thread's part: its current stream waits for the call's event
        with torch.cuda.stream(pending.stream_done.follower()):
            fut.set_result([x])
        done.set()

    threading.Thread(target=complete).start()
    done.wait(5)
    threading.Timer(0.05, flags.release, (3, 1)).start()
    (got,) = fut.wait()  # the current stream waits for the follower's event
    assert got.sum().item() == 7 * (1 << 20)


@pytest.mark.parametrize("native", [True, False], ids=["cuda_ext", "torch"])
def test_stream_busy_says_whether_the_current_stream_has_work_queued(native, monkeypatch):
    if not native:
        monkeypatch.setattr(devicepath, "_stream_busy_fn", None)
    elif devicepath._native_stream_busy() is None:
        pytest.skip(f"cuda_ext is not built here ({cuda_ext.info().reason})")
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    assert devicepath.stream_busy(dev) is False
    torch.cuda._sleep(50_000_000)
    assert devicepath.stream_busy(dev) is True
    torch.cuda.synchronize()
    assert devicepath.stream_busy(dev) is False
    assert devicepath.stream_busy(torch.device("cpu")) is None
