"""``prism.rank.bootstrap._front_end`` (``PRISM_FRONT_END_IN_COMM=1``): the
call starts at the wrapper, and in an emulation the way back from a blocking
call's release to the caller is dilated out (Prism's time, not the job's)."""

import time

import prism.rank.runtime as _rt
from prism.rank.bootstrap import _front_end


class FakeRecorder:
    def __init__(self):
        self.calls = []

    def comm_enter(self, t_ns=None, *, settle=True, front_end=False):
        self.calls.append(("enter", front_end))
        return time.monotonic_ns()

    def comm_exit(self, t_ns):
        self.calls.append(("exit", t_ns))


class FakeRuntime:
    def __init__(self, hybrid):
        self.recorder = FakeRecorder()
        self.hybrid = hybrid
        self.last_resumed_ns = None
        self.dilated = []

    def add_dilation(self, ns):
        self.dilated.append(ns)


def _run(monkeypatch, hybrid, resumes):
    rt = FakeRuntime(hybrid)
    monkeypatch.setattr(_rt, "_current", rt)

    def backend_call(x):
        if resumes:
            rt.last_resumed_ns = time.monotonic_ns()  # the wait came back from its release here
        time.sleep(0.01)  # the way back out, through Prism and torch
        return x + 1

    assert _front_end(backend_call)(1) == 2
    return rt


def test_an_emulated_blocking_call_dilates_the_way_back(monkeypatch):
    rt = _run(monkeypatch, hybrid=True, resumes=True)
    assert rt.recorder.calls[0] == ("enter", True) and rt.recorder.calls[-1][0] == "exit"
    assert len(rt.dilated) == 1 and 9_000_000 <= rt.dilated[0] < 1_000_000_000


def test_nothing_is_dilated_in_a_capture_or_without_a_wait(monkeypatch):
    assert _run(monkeypatch, hybrid=False, resumes=True).dilated == []
    assert _run(monkeypatch, hybrid=True, resumes=False).dilated == []
    rt = FakeRuntime(True)
    rt.last_resumed_ns = 1  # an earlier call's resume
    monkeypatch.setattr(_rt, "_current", rt)
    _front_end(lambda: None)()
    assert rt.dilated == []
