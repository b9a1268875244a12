"""What-if knobs (prism.core.whatif): each changes the replay the way its
docstring says, on hand-built programs whose answer is known."""

import pytest

from prism.core.costmodel import CostModel, Link
from prism.core.graph import ExecutionGraph
from prism.core.replay import replay_batch
from prism.core.trace import Memory
from prism.core.whatif import (
    GIB,
    WhatIf,
    WhatIfError,
    apply_compute,
    apply_link,
    check_memory,
    parse_link,
    parse_straggler,
    parse_throttle,
    peak_memory,
)
from tests.support.helpers_graph import Program

MS = 1_000_000


def _allreduce_job(world=4, steps=3, compute=10 * MS, **two_clock):
    """Every rank computes ``compute`` then all-reduces, ``steps`` times (synchronous DDP)."""
    p = Program(world)
    for _ in range(steps):
        for r in range(world):
            p.compute(r, compute, **two_clock)
        p.coll("world", nbytes=64 << 20)
        p.end_step()
    return p.events


MODEL = CostModel("t", 8, Link(100e9, 5e-6), Link(10e9, 20e-6), base_latency=10e-6)


def _iter(graph, model=MODEL):
    return replay_batch(graph, cost_model=model).mean_iteration_time(1)


def test_straggler_slows_every_rank_of_a_synchronous_job_by_its_extra_compute():
    g = ExecutionGraph.from_events(_allreduce_job())
    base = _iter(g)
    slow = _iter(apply_compute(g, WhatIf(straggler=((2, 20.0),))))
    assert slow - base == pytest.approx(2 * MS, rel=0.01)  # 20% of 10 ms, for everyone
    res = replay_batch(apply_compute(g, WhatIf(straggler=((2, 20.0),))), cost_model=MODEL)
    ends = [res.rank_end(r)[-1] for r in range(4)]
    assert max(ends) - min(ends) < MS  # the others waited for rank 2 at every all-reduce
    assert g.dur.sum() == ExecutionGraph.from_events(_allreduce_job()).dur.sum()  # the graph given is unchanged


def test_throttle_is_a_clock_factor_and_on_gpu_ranks_stretches_only_device_time():
    g = ExecutionGraph.from_events(_allreduce_job())
    t20 = _iter(apply_compute(g, WhatIf(throttle=(None, 20.0))))
    assert t20 - _iter(g) == pytest.approx(10 * MS * (1 / 0.8 - 1), rel=0.01)
    # two-clock segments: 1 ms of CPU issue, 10 ms on the GPU; a 50% throttle doubles the GPU part only
    g2 = ExecutionGraph.from_events(_allreduce_job(compute=10 * MS, cpu=1 * MS, gpu=10 * MS))
    thr = apply_compute(g2, WhatIf(throttle=((0, 1, 2, 3), 50.0)))
    assert (thr.gpu[thr.gpu > 0] == 2 * g2.gpu[g2.gpu > 0]).all()
    assert (thr.cpu == g2.cpu).all()
    assert _iter(thr) - _iter(g2) == pytest.approx(10 * MS, rel=0.02)
    strag = apply_compute(g2, WhatIf(straggler=((1, 100.0),)))
    assert (strag.cpu[(strag.rank == 1) & (strag.cpu > 0)] == 2 * MS).all()  # a straggler is slow on both clocks


def test_link_slowdown_multiplies_modelled_communication_per_tier():
    g = ExecutionGraph.from_events(_allreduce_job(world=4, compute=0))
    base = MODEL.instance_costs(g)
    assert (apply_link(MODEL, WhatIf(link=(3.0, "all"))).instance_costs(g) == pytest.approx(3 * base, rel=1e-6))
    # world 4 on nodes of 8: one node, so only the intra tier matters
    assert (apply_link(MODEL, WhatIf(link=(3.0, "inter"))).instance_costs(g) == base).all()
    assert (apply_link(MODEL, WhatIf(link=(3.0, "intra"))).instance_costs(g) > 2.5 * base).all()
    two_nodes = CostModel("t", 2, MODEL.intra, MODEL.inter)
    assert (apply_link(two_nodes, WhatIf(link=(2.0, "inter"))).instance_costs(g)
            == pytest.approx(2 * two_nodes.instance_costs(g), rel=1e-6))
    assert _iter(g, apply_link(MODEL, WhatIf(link=(3.0, "all")))) > 2.5 * _iter(g)


def test_link_slowdown_scales_measured_points_too():
    measured = CostModel("m", 8, MODEL.intra, MODEL.inter, measured=(("all_reduce", 4, (1 << 20, 1 << 26), (1e-3, 5e-2)),))
    g = ExecutionGraph.from_events(_allreduce_job(world=4, compute=0))
    assert (apply_link(measured, WhatIf(link=(2.0, "all"))).instance_costs(g)
            == pytest.approx(2 * measured.instance_costs(g), rel=1e-6))


def test_memory_limit_names_the_rank_and_how_far_over():
    events = _allreduce_job(world=2, steps=1)
    events[0].append(Memory(0, "cuda:0", 1, 1, int(3.0 * GIB)))
    events[1].append(Memory(0, "cuda:1", 1, 1, int(5.0 * GIB)))
    peaks = peak_memory(events)
    assert peaks == {0: int(3 * GIB), 1: int(5 * GIB)}
    v = check_memory(peaks, 5.5, 0.6)
    assert v.status == "oom" and v.worst_rank == 1 and v.oom_ranks == (1,)
    assert v.over_gib == pytest.approx(0.1)
    assert "rank 1" in v.text() and "0.100 GiB over" in v.text()
    assert check_memory(peaks, 6.0, 0.6).status == "fits"
    assert check_memory({}, 6.0).status == "unknown"  # a CPU capture: never "fits"


def test_parsers_and_bad_values():
    assert parse_straggler("3:20") == (3, 20.0)
    assert parse_throttle("0-2,5:15") == ((0, 1, 2, 5), 15.0)
    assert parse_throttle("all:10") == (None, 10.0)
    assert parse_link("1.5:inter") == (1.5, "inter") and parse_link("2") == (2.0, "all")
    for bad in (lambda: parse_straggler("x:1"), lambda: parse_throttle("0-:1"), lambda: parse_link("fast"),
                lambda: WhatIf(throttle=(None, 100.0)), lambda: WhatIf(link=(2.0, "pcie")),
                lambda: WhatIf(memory_limit_gib=0.0)):
        with pytest.raises(WhatIfError):
            bad()
    g = ExecutionGraph.from_events(_allreduce_job(world=2, steps=1))
    with pytest.raises(WhatIfError, match="rank 7 is not in the replayed world"):
        apply_compute(g, WhatIf(straggler=((7, 10.0),)))
