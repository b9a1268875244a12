"""The replay engines (prism.core.replay): collective, async and point-to-point
timing, the steppable replay against the batch one on random and Megatron
graphs, critical paths, and the two-clock (CPU issue, GPU work) compute
segments and their calibration."""

import numpy as np
import pytest
from tests.support.helpers_graph import Program
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prism.core.costmodel import ZERO, CostModel, Link
from prism.core.graph import COLL, COMPUTE, WAIT, ExecutionGraph
from prism.core.replay import (
    ReplayError,
    SteppableReplay,
    _advance_after,
    replay_batch,
    replay_reference,
)
from prism.core.synthetic import MegatronSpec, megatron_graph

#: 1 byte per ns on every link, no latency: costs are easy to compute by hand.
UNIT = CostModel("unit", 2, Link(1e9, 0.0), Link(0.5e9, 0.0), source="test")
#: with latencies, and inter-node links slower than intra-node
SKEWED = CostModel("skewed", 2, Link(2e9, 3e-6), Link(0.25e9, 7e-6), base_latency=1e-6, source="test")


def same(a, b) -> bool:
    return np.array_equal(a.start, b.start) and np.array_equal(a.end, b.end)


# ------------------------------------------------------------ hand examples
def test_blocking_collective_completes_at_last_arrival_plus_cost():
    p = Program(2)
    p.compute(0, 100)
    p.compute(1, 300)
    p.coll("world", nbytes=1000)  # ring all_reduce, n=2: 2(n-1)/n * 1000 B at 1 B/ns
    p.compute(0, 10)
    p.end_step()
    r = replay_reference(ExecutionGraph.from_events(p.events), cost_model=UNIT)
    assert r.rank_end(0).tolist() == [100, 1300, 1310, 1310]
    assert r.rank_end(1).tolist() == [300, 1300, 1300]
    b = r.breakdown()
    assert b["waiting"].tolist() == [200, 0] and b["communication"].tolist() == [1000, 1000]
    assert b["compute"].tolist() == [110, 300]


def test_async_collective_overlaps_compute_until_the_wait():
    p = Program(2)
    p.compute(1, 100)
    p.coll("world", nbytes=1000, async_on=(0,))
    p.compute(0, 500)
    p.coll("world", nbytes=1000)
    p.wait(0)
    p.end_step()
    g = ExecutionGraph.from_events(p.events)
    r = replay_batch(g, cost_model=UNIT)
    # seq 0: rank 0 arrives at 0 and goes on computing, rank 1 arrives at 100 -> completes at 1100
    # seq 1: rank 0 arrives at 500, rank 1 at 1100 -> completes at 2100; rank 0's wait for seq 0 is then free
    assert g.kind[g.nodes_of(0)].tolist()[:4] == [COLL, COMPUTE, COLL, WAIT]
    assert r.rank_start(0).tolist()[:4] == [0, 0, 500, 2100]
    assert r.rank_end(0).tolist()[:4] == [1100, 500, 2100, 2100]
    assert r.rank_end(1).tolist()[:3] == [100, 1100, 2100]
    assert same(r, replay_reference(g, cost_model=UNIT))


def test_eager_send_and_receive():
    p = Program(2)
    p.send(0, 1, nbytes=4096)  # both issue at 0: the sender is done at 4096, the data arrives then
    p.compute(0, 10_000)
    p.compute(1, 10_000)
    p.send(0, 1, nbytes=4096)  # both issue at 14_096: the data arrives at 18_192
    p.end_step()
    r = replay_reference(ExecutionGraph.from_events(p.events), cost_model=UNIT)
    assert r.rank_end(0).tolist() == [4096, 14_096, 18_192, 18_192]
    assert r.rank_end(1).tolist() == [4096, 14_096, 18_192, 18_192]
    assert r.rank_start(1).tolist()[2] == 14_096  # rank 1's recv posted after its compute
    p2 = Program(2)
    p2.compute(1, 10_000)
    p2.send(0, 1, nbytes=4096)  # data arrived long before the receiver asks
    r2 = replay_reference(ExecutionGraph.from_events(p2.events), cost_model=UNIT)
    assert r2.rank_end(1).tolist() == [10_000, 10_000]


def test_zero_cost_no_waiting_iteration_equals_slowest_compute():
    spec = MegatronSpec(tp=2, pp=1, dp=2, micro_batches=2, layers_per_stage=2, iterations=4, jitter=0.0)
    g = megatron_graph(spec)
    r = replay_batch(g)
    b = r.breakdown()
    assert not b["waiting"].any() and not b["communication"].any()
    per_step = np.zeros((4, g.world_size), np.int64)
    c = g.kind == COMPUTE
    np.add.at(per_step, (g.step[c], g.rank[c]), g.dur[c])
    assert r.iteration_times.tolist() == per_step.max(axis=1).tolist()
    assert r.mean_iteration_time(2) == per_step[2:].max(axis=1).mean()


def test_mean_iteration_time_needs_steps_after_warmup():
    r = replay_batch(megatron_graph(MegatronSpec(iterations=2)))
    with pytest.raises(ValueError, match=r"the run has 2 step\(s\); cannot drop 2 warm-up"):
        r.mean_iteration_time()
    assert r.mean_iteration_time(1) == r.iteration_times[1]


def test_missing_step_mark_is_reported():
    p = Program(2)
    p.compute(0, 5)
    p.end_step(ranks=[0])
    r = replay_batch(ExecutionGraph.from_events(p.events))
    with pytest.raises(ReplayError, match="rank 1 has no end-of-step mark for step 0"):
        r.iteration_times


def test_durations_override_and_validation():
    g = megatron_graph(MegatronSpec(iterations=3))
    slow = g.dur * 2
    a, b = replay_batch(g, slow), replay_reference(g, slow)
    assert same(a, b) and a.makespan_ns > replay_batch(g).makespan_ns
    with pytest.raises(ValueError, match="one entry per node"):
        replay_batch(g, slow[:-1])
    with pytest.raises(ValueError, match="integer nanoseconds"):
        replay_batch(g, slow.astype(float))
    neg = slow.copy()
    first = int(np.flatnonzero(g.kind == COMPUTE)[0])
    neg[first] = -1
    with pytest.raises(ValueError, match=rf"durations\[{first}\] = -1 is negative \(rank 0 compute"):
        replay_batch(g, neg)


def test_steppable_is_paced_by_the_callers_now():
    g = megatron_graph(MegatronSpec(iterations=2))
    s = SteppableReplay(g, cost_model=SKEWED)
    assert s.next_event_time() == 0
    assert s.advance(-1) == 0 and s.step(-1) is None
    assert s.step(5) == (0, 0) and s.lag_ns == 5
    now = 0
    while not s.done:
        now += 1_000_000
        s.advance(now)
        assert s.lag_ns >= 0 and (s.done or s.next_event_time() > now)
    with pytest.raises(ReplayError, match="not finished"):
        SteppableReplay(g).result()
    assert same(s.result(), replay_reference(g, cost_model=SKEWED))


def test_critical_path_of_a_pipeline():
    g = megatron_graph(MegatronSpec(tp=2, pp=4, dp=2, iterations=3))
    r = replay_batch(g, cost_model=SKEWED)
    path = r.critical_path()
    assert sum(s.t1 - s.t0 for s in path) == r.makespan_ns
    assert all(a.t1 == b.t0 for a, b in zip(path, path[1:]))
    assert len({s.rank for s in path}) > 1
    ranking = r.group_ranking()
    assert ranking == sorted(ranking, key=lambda x: (-x.blocked_ns, -x.modelled_ns, x.gid))


# ----------------------------------------------------------- random graphs
@st.composite
def programs(draw, gpu: bool = True):
    """Random programs; ``gpu=False``: one-clock compute only (no GPU ranks)."""
    world = draw(st.integers(2, 5))
    extra = draw(st.lists(st.sets(st.integers(0, world - 1), min_size=1, max_size=world), max_size=3))
    groups = {f"g{i}": tuple(sorted(s)) for i, s in enumerate(extra)}
    p = Program(world, groups)
    outstanding: list[tuple[int, str]] = []
    n = 0
    gpu_ranks = draw(st.sets(st.integers(0, world - 1))) if gpu else set()  # two-clock compute (GPU ranks)
    for _ in range(draw(st.integers(1, 3))):
        for _ in range(draw(st.integers(1, 12))):
            n += 1
            what = draw(st.sampled_from(["compute", "compute", "coll", "p2p", "wait"]))
            if what == "compute":
                r = draw(st.integers(0, world - 1))
                if r in gpu_ranks:
                    p.compute(r, draw(st.integers(0, 5000)), cpu=draw(st.integers(0, 5000)),
                              gpu=draw(st.sampled_from([-1, -2, 0, 700, 4000])), join=draw(st.booleans()),
                              free=draw(st.sampled_from([-1, 0, 900, 6000])), cold=draw(st.sampled_from([0, 300])))
                else:
                    p.compute(r, draw(st.integers(0, 5000)))
            elif what == "coll":
                gid = draw(st.sampled_from(sorted(p.groups)))
                op = draw(st.sampled_from(["all_reduce", "all_gather_into_tensor", "all_to_all_single", "broadcast"]))
                asy = draw(st.sets(st.sampled_from(p.groups[gid])))
                p.coll(gid, op, draw(st.integers(0, 1 << 16)), async_on=asy, handle=f"h{n}")
                outstanding += [(r, f"h{n}") for r in sorted(asy)]
            elif what == "p2p":
                src, dst = draw(st.lists(st.integers(0, world - 1), min_size=2, max_size=2, unique=True))
                a_s, a_r = draw(st.booleans()), draw(st.booleans())
                p.send(src, dst, draw(st.integers(0, 1 << 16)), tag=draw(st.integers(0, 1)), async_send=a_s,
                       async_recv=a_r, handle=f"h{n}")
                outstanding += [(r, f"h{n}") for r, a in ((src, a_s), (dst, a_r)) if a]
            elif outstanding:
                r, h = outstanding.pop(draw(st.integers(0, len(outstanding) - 1)))
                p.wait(r, h)
        for r, h in outstanding:
            p.wait(r, h)
        outstanding = []
        p.end_step()
    return p.events


def check_causality(g: ExecutionGraph, r) -> None:
    start, end = r.start, r.end
    after = _advance_after(g)
    for rank in range(g.world_size):
        sl = g.nodes_of(rank)
        s, e, a = start[sl], end[sl], after[sl]
        if len(s):
            assert s[0] >= 0
            cursor = np.where(a[:-1], e[:-1], s[:-1])
            assert np.all(s[1:] >= cursor)  # no node starts before its predecessor lets the rank go
            assert np.all(e >= s)
    for i in range(g.n_instances):
        m = g.inst_nodes[g.inst_ptr[i]:g.inst_ptr[i + 1]]
        assert len(set(end[m].tolist())) == 1  # a collective ends at the same time on all members
        assert end[m[0]] >= start[m].max()
    assert np.all(end[g.msg_recv] >= start[g.msg_send])
    w = np.flatnonzero(g.kind == WAIT)
    assert np.all(end[w] >= end[g.wait_of[w]])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.sampled_from([ZERO, UNIT, SKEWED]))
def test_random_graphs_engines_agree_and_respect_causality(events, model):
    g = ExecutionGraph.from_events(events)
    ref = replay_reference(g, cost_model=model)
    assert same(ref, replay_batch(g, cost_model=model))
    assert same(ref, SteppableReplay(g, cost_model=model).run())
    assert same(ref, replay_reference(g, cost_model=model))  # deterministic
    check_causality(g, ref)
    b = ref.breakdown()
    assert np.array_equal(b["compute"] + b["communication"] + b["waiting"], b["total"])
    path = ref.critical_path()
    assert sum(s.t1 - s.t0 for s in path) == ref.makespan_ns
    if model is ZERO:
        assert not b["communication"].any()
        if not b["waiting"].any():
            assert ref.makespan_ns == b["compute"].max()


@settings(max_examples=40, deadline=None)
@given(programs(), st.lists(st.integers(1, 20_000), min_size=1, max_size=50))
def test_random_pacing_gives_the_same_timeline(events, increments):
    g = ExecutionGraph.from_events(events)
    s = SteppableReplay(g, cost_model=SKEWED)
    now, i = 0, 0
    last = -1
    while not s.done:
        t = s.next_event_time()
        assert t >= last  # events come out in time order
        last = t
        now += increments[i % len(increments)]
        i += 1
        if i % 3 == 0:
            while s.step(now) is not None:
                pass
        else:
            s.advance(now)
    assert same(s.result(), replay_reference(g, cost_model=SKEWED))


@pytest.mark.parametrize("spec", [
    MegatronSpec(tp=2, pp=3, dp=2, ep=2, micro_batches=5, iterations=3),
    MegatronSpec(tp=4, pp=2, dp=4, micro_batches=2, layers_per_stage=3, iterations=3, dp_buckets=3),
])
def test_megatron_engines_agree(spec):
    g = megatron_graph(spec)
    for model in (ZERO, SKEWED):
        ref = replay_reference(g, cost_model=model)
        assert same(ref, replay_batch(g, cost_model=model))
        assert same(ref, SteppableReplay(g, cost_model=model).run())
        check_causality(g, ref)



def test_steps_need_not_start_at_zero():
    p = Program(2)
    p.step = [5, 5]
    p.compute(0, 10)
    p.compute(1, 30)
    p.end_step()
    p.compute(0, 40)
    p.compute(1, 20)
    p.end_step()
    r = replay_batch(ExecutionGraph.from_events(p.events))
    assert r.steps.tolist() == [5, 6]
    assert r.iteration_times.tolist() == [30, 20]  # job ends: max(10, 30) = 30, then max(50, 50) = 50


def test_steppable_keeps_per_node_state_out_of_python_objects():
    # the real-time path must not give the garbage collector millions of objects to walk
    import gc

    g = megatron_graph(MegatronSpec(tp=2, pp=2, dp=4, micro_batches=8, iterations=2))
    gc.collect()
    before = len(gc.get_objects())
    s = SteppableReplay(g, cost_model=SKEWED)
    s.advance(s.next_event_time() + 5_000_000)
    gc.collect()
    assert len(gc.get_objects()) - before < g.n_nodes // 20


# ----------------------------------------------------------- two clocks
def test_two_clock_compute_overlaps_cpu_issue_with_gpu_work_and_joins():
    """GPU ranks: the CPU queues work and goes on; a collective waits on the
    GPU stream only; a join makes the CPU wait for the GPU."""
    p = Program(2)
    for r in (0, 1):
        p.compute(r, 9_999, cpu=1_000, gpu=3_000)  # GPU-bound: ends at 3_000 on the GPU, CPU at 1_000
    p.coll("world", nbytes=1000)  # UNIT: 1000 ns on the GPU stream: 3_000 .. 4_000
    for r in (0, 1):
        p.compute(r, 9_999, cpu=2_500, gpu=100)  # issued 1_000 .. 3_500, GPU starts at 4_000: ends 4_100
        p.compute(r, 9_999, cpu=1_000, gpu=200, join=True)  # issued 3_500 .. 4_500; GPU 4_100+200; join at 4_500
        p.compute(r, 9_999, cpu=100, gpu=50)  # CPU 4_500 .. 4_600; GPU max(4_500, 4_500) + 50 -> 4_600
    p.end_step()
    g = ExecutionGraph.from_events(p.events)
    for r in (replay_reference(g, cost_model=UNIT), SteppableReplay(g, cost_model=UNIT).run(),
              replay_batch(g, cost_model=UNIT)):
        assert r.rank_end(0).tolist() == [3_000, 4_000, 4_100, 4_500, 4_600, 4_600]
        assert r.iteration_times.tolist() == [4_600]
    # given durations replay one clock: the recorded wall times
    one = replay_reference(g, np.full(g.n_nodes, 10, np.int64), cost_model=UNIT)
    assert one.rank_end(0).tolist()[:2] == [10, 1010]


def _engines():
    return (replay_reference, lambda g, cost_model: SteppableReplay(g, cost_model=cost_model).run(), replay_batch)


def test_a_segment_ends_no_earlier_than_its_free_finish_unless_the_gpu_is_behind():
    """PrismTrace 1.2's free_ns: a segment whose launches come unevenly (the
    GPU idles between them) takes longer than max(cpu, gpu) from an idle GPU;
    behind a busy GPU its kernels queue up and its GPU time governs."""

    def program(w_gpu):
        p = Program(1)
        for calibrated in (False, True):  # step 0 measures free finishes, step 1 GPU times
            p.compute(0, 9_999, cpu=100 if not calibrated else 150, gpu=w_gpu if calibrated else -1,
                      free=-1 if calibrated else max(w_gpu, 100))
            p.compute(0, 9_999, cpu=1_000 if not calibrated else 1_200, gpu=2_000 if calibrated else -1,
                      free=-1 if calibrated else 2_500, join=True)
            p.end_step()
        return ExecutionGraph.from_events(p.events)

    idle, behind = program(10), program(3_000)
    assert idle.free.tolist()[:2] == [100, 2_500] and idle.free.tolist()[3:5] == [100, 2_500]
    for replay in _engines():
        # GPU idle at the segment: max(cpu 1_000, gpu 2_000) would end it at 2_000 (+10 behind W)
        assert replay(idle, cost_model=UNIT).rank_end(0).tolist()[:2] == [100, 2_600]
        # the GPU busy until 3_000 with W: 3_000 + 2_000, the free finish (100 + 2_500) is below
        assert replay(behind, cost_model=UNIT).rank_end(0).tolist()[:2] == [3_000, 5_000]


def test_a_cold_start_comes_off_the_cpu_share_and_free_finish_at_most_half_the_share():
    p = Program(1)
    p.compute(0, 9_999, cpu=1_000, gpu=-1, free=2_500, cold=300)
    p.compute(0, 9_999, cpu=400, gpu=-1, free=500, cold=300, join=True)
    p.end_step()
    p.compute(0, 9_999, cpu=1_100, gpu=200, cold=300)
    p.compute(0, 9_999, cpu=450, gpu=100, cold=300, join=True)
    p.end_step()
    g = ExecutionGraph.from_events(p.events)
    assert g.cpu.tolist() == [700, 200, -1, 700, 200, -1]
    assert g.free.tolist() == [2_200, 300, -1, 2_200, 300, -1]
    for replay in _engines():
        # step 0: free 2_200 > cpu 700 and gpu 200; then CPU 700 .. 900, GPU 2_200 + 100; free 700 + 300
        assert replay(g, cost_model=UNIT).rank_end(0).tolist()[:2] == [2_200, 2_300]


def test_the_issue_cost_of_a_call_lengthens_the_cpu_side_only():
    """A profile's issue_us (NCCL: the CPU time of the call itself) goes on the
    CPU clock of the segment before the call: it shows where the rank is
    CPU-bound and hides behind the GPU where it is GPU-bound."""
    import dataclasses

    def program(cpu0, gpu0, cpu1, gpu1):
        p = Program(1)
        p.compute(0, 9_999, cpu=cpu0, gpu=gpu0)
        p.coll("world", nbytes=0)
        p.compute(0, 9_999, cpu=cpu1, gpu=gpu1)
        p.end_step()
        return ExecutionGraph.from_events(p.events)

    model = dataclasses.replace(UNIT, issue=500e-9)
    assert model.issue_costs(program(1, 1, 1, 1)).tolist() == [0, 500, 0, 0]
    cpu_bound = program(3_000, 1_000, 3_000, 1_000)
    gpu_bound = program(1_000, 3_000, 100, 3_000)
    for replay in (replay_reference, lambda g, cost_model: SteppableReplay(g, cost_model=cost_model).run(),
                   replay_batch):
        # the collective alone is 0 bytes: UNIT's cost is 0
        assert replay(cpu_bound, cost_model=UNIT).rank_end(0).tolist()[:3] == [3_000, 3_000, 6_000]
        assert replay(cpu_bound, cost_model=model).rank_end(0).tolist()[:3] == [3_500, 3_500, 6_500]
        assert replay(gpu_bound, cost_model=UNIT).rank_end(0).tolist()[:3] == [3_000, 3_000, 6_000]
        assert replay(gpu_bound, cost_model=model).rank_end(0).tolist()[:3] == [3_000, 3_000, 6_000]


def test_gpu_times_follow_the_aligned_program_point_when_steps_differ_in_their_joins():
    """MoE: a step with an extra join (one more .tolist()) must not shift every
    later segment onto the next program point's GPU time."""
    p = Program(2)

    def step(calibrated, extra_join):
        for r in (0, 1):
            gpu = (lambda v: v if calibrated else -1)
            p.compute(r, 900, cpu=100, gpu=gpu(50), join=True)  # routing: token counts to the host
            if extra_join:
                p.compute(r, 900, cpu=100, gpu=-1, join=True)
        p.coll("world", nbytes=0)
        for r in (0, 1):
            p.compute(r, 9_000, cpu=100, gpu=gpu(8_000), join=True)  # the experts
            p.compute(r, 900, cpu=100, gpu=gpu(20), join=True)  # the step's end
        p.end_step()

    step(False, False)
    step(True, False)
    step(False, True)
    g = ExecutionGraph.from_events(p.events)
    r0 = [int(x) for x in g.gpu[g.nodes_of(0)][g.kind[g.nodes_of(0)] == COMPUTE]]
    # step 2: the extra join aligns with the routing segment (both end before the
    # call); the routing segment, now ending before a join, is matched by kind only
    # (the experts'), so its own wall time bounds it; experts and step end aligned
    assert r0[-4:] == [900, 50, 8_000, 20], r0
    assert r0[:3] == [50, 8_000, 20]


def test_an_uncalibrated_segment_takes_the_largest_calibrated_time_its_wall_allows():
    p = Program(1)
    for gpu, wall in ((300, 2_000), (450, 2_000), (-1, 400), (-1, 900), (-1, 200)):
        p.compute(0, wall, cpu=100, gpu=gpu, join=True)
        p.end_step()
    g = ExecutionGraph.from_events(p.events)
    c = np.flatnonzero(g.kind == COMPUTE)
    # walls 400 and 900 allow 300 and 450; no calibrated time fits in 200: the smallest
    assert g.gpu[c].tolist() == [300, 450, 300, 450, 300]


def test_two_clock_calibration_fills_gpu_time_and_cpu_share_by_counterpart():
    p = Program(1)
    p.compute(0, 900, cpu=500, gpu=-1)
    p.compute(0, 900, cpu=600, gpu=-1, join=True)
    p.end_step()
    p.compute(0, 2_000, cpu=1_900, gpu=300)  # calibration step: its CPU shares come from step 0
    p.compute(0, 2_000, cpu=1_950, gpu=-2, join=True)  # discarded measurement
    p.end_step()
    p.compute(0, 2_000, cpu=1_900, gpu=450)  # a second calibration: the larger the wall allows wins
    p.compute(0, 2_000, cpu=1_950, gpu=-2, join=True)
    p.end_step()
    p.compute(0, 900, cpu=510, gpu=-1)  # three segments: aligned with the reference step (step 1),
    p.compute(0, 900, cpu=590, gpu=-1)  # the first and the join pair with its two; this one by position
    p.compute(0, 900, cpu=100, gpu=-1, join=True)
    p.end_step()
    own = ExecutionGraph.from_events(p.events, cpu_share="own")
    c = np.flatnonzero(own.kind == COMPUTE)
    # a calibration step takes the median of its aligned counterparts' shares (500, 510; 600, 100)
    assert own.cpu[c].tolist() == [500, 600, 505, 350, 505, 350, 510, 590, 100]
    # by default every segment takes the smallest share of its counterparts in the uncalibrated steps
    g = ExecutionGraph.from_events(p.events)
    assert g.cpu[c].tolist() == [500, 100, 500, 100, 500, 100, 500, 590, 100]
    assert ExecutionGraph.from_events(p.events, cpu_share="median").cpu[c].tolist() == [
        505, 350, 505, 350, 505, 350, 505, 590, 350]
    with pytest.raises(ValueError, match="cpu_share 'mean'"):
        ExecutionGraph.from_events(p.events, cpu_share="mean")
    # the unaligned segment has no calibrated counterpart: its wall time
    assert g.gpu[c].tolist() == [450, 900, 300, 2_000, 450, 2_000, 450, 900, 900]
    assert g.join[c].tolist() == [False, True, False, True, False, True, False, False, True]
    plain = Program(1)
    plain.compute(0, 5)
    assert ExecutionGraph.from_events(plain.events).cpu is None
