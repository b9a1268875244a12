"""Drive a HybridReplay as a shell would, with the sandbox ranks' arrivals
decided by a function: each time a sandbox rank is released into a compute
segment, ``arrival(rank, first_node, start_ns)`` says when it calls again.

``ahead``: before each arrival the engine works through everything queued
(``work_ahead``, this many events a call), far past that arrival's time, the
most out of time order a shell can take it; None: in time order (``step``)."""

from __future__ import annotations

import heapq

from prism.core.hybrid import HybridReplay


def drive(eng: HybridReplay, arrival, ahead: int | None = None, before=None) -> list:
    """Run ``eng`` to the end; returns every Released in order. ``before(rank,
    call, t)``: called just before each sandbox call arrives (at ``t``)."""
    due: list[tuple[int, int]] = []  # (arrival time, rank)
    scheduled: set[int] = set()
    released = []
    while True:
        for r, (nd, t0) in eng.computing.items():
            if r not in scheduled:
                scheduled.add(r)
                heapq.heappush(due, (arrival(r, nd, t0), r))
        if ahead and eng.work_ahead(ahead) is not None:
            released += eng.take_released()
            continue
        t_eng = eng.next_due()
        if due and (t_eng is None or due[0][0] <= t_eng):
            t, r = heapq.heappop(due)
            scheduled.discard(r)
            nd, _ = eng.computing[r]
            cn = eng.next_call_node(r, nd)
            if cn == eng.graph.rank_ptr[r + 1]:
                eng.finish(r, t)
            else:
                if before is not None:
                    before(r, eng.call_of(cn), t)
                mismatch = eng.arrive(r, eng.call_of(cn), t)
                assert mismatch is None, mismatch
            continue
        if t_eng is None:
            break
        eng.step(t_eng)
        released += eng.take_released()
    return released
