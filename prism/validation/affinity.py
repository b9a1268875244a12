"""Run part of a benchmark on a subset of the CPUs, and give every thread its
CPUs back afterwards.

``os.sched_setaffinity(0, ...)`` changes the calling thread only, and a thread
created meanwhile inherits the narrowed set and keeps it: trio's cached worker
threads, ZeroMQ's I/O threads, the launcher's threads. A later
``prism emulate`` in the same process launched its fork server from such a
thread, so its ranks ran on the capture's few cores (found 2026-12-06:
``bench/calibration.py``'s packed slices of a polluted capture measured as slow
as the polluted capture itself). The other way round too: a capture that
launched its ranks from a thread created before the narrowing ran them on every
CPU. ``on_cpus`` narrows every thread of the process (``/proc/self/task``) and
gives each its set back when it ends.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator


def thread_affinities() -> dict[int, set[int]]:
    """Each thread of this process (its native id) and the CPUs it may run on."""
    out = {}
    for t in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            out[int(t)] = os.sched_getaffinity(int(t))
    return out


def _set_all(cpus: set[int], before: dict[int, set[int]]) -> None:
    """Every thread on ``before``'s set for it, else ``cpus``; again while
    threads appear during a pass (one a not-yet-set thread started inherits
    its old set)."""
    seen: set[str] = set()
    for _ in range(10):
        tids = set(os.listdir("/proc/self/task"))
        if tids == seen:
            return
        for t in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(t), before.get(int(t), cpus))
        seen = tids


@contextlib.contextmanager
def on_cpus(cpus: Iterable[int]) -> Iterator[None]:
    """Every thread of this process (and what they start: threads, processes)
    on ``cpus``; at the end each thread gets back its earlier set, and one
    started meanwhile the calling thread's. A set the machine cannot honour
    raises ``OSError`` at once (from the calling thread's change)."""
    want = set(cpus)
    before = thread_affinities()
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, want)
    try:
        _set_all(want, {})
        yield
    finally:
        _set_all(mine, before)
