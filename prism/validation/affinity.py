"""Run part of a benchmark on a subset of the CPUs, and give every thread its
CPUs back afterwards.

``os.sched_setaffinity(0, ...)`` changes the calling thread only, and a thread
created meanwhile inherits the narrowed set and keeps it: trio's cached worker
threads, ZeroMQ's I/O threads, the launcher's threads. A later
``prism emulate`` in the same process launched its fork server from such a
thread, so its ranks ran on the capture's few cores (found 2026-12-06:
``bench/calibration.py``'s packed slices of a polluted capture measured as slow
as the polluted capture itself). ``on_cpus`` restores the set on every thread
of the process (``/proc/self/task``) when it ends.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator


def thread_affinities() -> dict[int, set[int]]:
    """Each thread of this process (its native id) and the CPUs it may run on."""
    out = {}
    for t in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out[int(t)] = os.sched_getaffinity(int(t))
    return out


@contextlib.contextmanager
def on_cpus(cpus: Iterable[int]) -> Iterator[None]:
    """The calling thread (and what it starts: threads, processes) on ``cpus``;
    at the end every thread of the process gets back the calling thread's
    earlier set."""
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        for tid in thread_affinities():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, mine)
