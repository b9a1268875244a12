"""prism.validation.affinity: a narrowed CPU set does not outlive ``on_cpus`` on any thread."""

import contextlib
import os
import threading

import pytest

from prism.validation.affinity import on_cpus, thread_affinities

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task")
                                or len(os.sched_getaffinity(0)) < 2,
                                reason="needs Linux's per-thread CPU affinity and two CPUs to narrow from")


@contextlib.contextmanager
def _a_thread():
    """A thread that lives until the block ends; yields its native id."""
    started, stop = threading.Event(), threading.Event()
    tid = []

    def worker():
        tid.append(threading.get_native_id())
        started.set()
        stop.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    started.wait(10)
    try:
        yield tid[0]
    finally:
        stop.set()
        t.join()


def test_a_thread_started_before_runs_on_the_narrowed_set_and_gets_its_own_back():
    # the other half of the bug: a capture launching its ranks from a thread
    # created before the narrowing ran them on every CPU
    mine = os.sched_getaffinity(0)
    one = {min(mine)}
    with _a_thread() as tid:
        with on_cpus(one):
            assert os.sched_getaffinity(tid) == one
            assert os.sched_getaffinity(0) == one
        assert os.sched_getaffinity(tid) == mine


def test_a_thread_started_on_fewer_cpus_gets_them_all_back():
    mine = os.sched_getaffinity(0)
    one = {min(mine)}
    with contextlib.ExitStack() as stack:
        with on_cpus(one):
            tid = stack.enter_context(_a_thread())
            assert os.sched_getaffinity(tid) == one  # what the bug was: the thread inherits the narrowed set
        assert os.sched_getaffinity(0) == mine
        assert os.sched_getaffinity(tid) == mine
        assert thread_affinities()[tid] == mine


def test_a_cpu_set_the_machine_cannot_honour_raises_and_changes_nothing():
    mine = os.sched_getaffinity(0)
    with pytest.raises(OSError):
        with on_cpus({max(mine) + 4096}):
            pass
    assert os.sched_getaffinity(0) == mine
