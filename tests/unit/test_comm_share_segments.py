"""``bench/comm_share.py``'s segment split: the capture's segments in program
order (an async call's record comes when it completes, after the compute that
overlapped it), with their CPU time, and the truth's from the step clock's
call lines."""

from prism.core.trace import P2P, Compute, Iteration
from prism.testing.bench import load_bench


def _comm_share():
    return load_bench("comm_share")


def _p2p(op, issue, wait, end):
    return P2P(op=op, gid="g", peer=1, tag=0, pseq=0, dtype="float32", shape=(4,), bytes=16, async_op=True,
               issue_ns=issue, wait_ns=wait, end_ns=end, step=1)


def test_capture_segments_follow_program_order_not_record_order():
    cs = _comm_share()
    # isend at 100, compute, irecv at 300, compute, wait on both, compute, step end; the records of the
    # async calls are written when they complete (after the computes)
    events = [
        Compute(start_ns=0, end_ns=100, step=1, thread_cpu_ns=90),
        Compute(start_ns=100, end_ns=290, step=1, thread_cpu_ns=180),
        Compute(start_ns=300, end_ns=310, step=1, thread_cpu_ns=10),
        _p2p("send", 100, 310, 320),
        _p2p("recv", 300, 320, 330),
        Compute(start_ns=330, end_ns=400, step=1, thread_cpu_ns=60),
        Iteration(step=1, end_ns=400),
    ]
    (per,) = cs.capture_segments({0: events}, warmup=1)
    assert per[1] == [(100, "send", 90), (190, "recv", 180), (80, "end", 70)]


def test_truth_segments_pair_wall_and_cpu_gaps():
    cs = _comm_share()
    calls = [(1, "all_reduce", 2, 16, 150, 170, False), (1, "all_reduce", 2, 16, 250, 260, False)]
    ends = [100, 300]
    cpu = ([(1040, 1050), (1120, 1125)], [1000, 1150])
    assert cs.truth_segments(calls, ends, 1, cpu) == {1: [(50, "all_reduce", 40), (80, "all_reduce", 70),
                                                          (40, "end", 25)]}
    assert cs.truth_segments(calls, ends, 1) == {1: [(50, "all_reduce", -1), (80, "all_reduce", -1),
                                                     (40, "end", -1)]}


def test_a_blocking_collective_splits_into_each_members_waiting_and_its_cost():
    cs = _comm_share()
    # one all_reduce of ranks 0 and 1 in step 2: rank 0 enters at 100, rank 1 at 400 (the last), both
    # return at 500; and one at step 1 (the warm-up), left out. Lines as the step clock writes them:
    # call STEP OP N BYTES T0 T1 ASYNC CPU0 CPU1 GROUP
    r0 = "call 1 all_reduce 2 16 0 50 0 -1 -1 0,1\ncall 2 all_reduce 2 16 100 500 0 -1 -1 0,1\n"
    r1 = "call 1 all_reduce 2 16 0 50 0 -1 -1 0,1\ncall 2 all_reduce 2 16 400 500 0 -1 -1 0,1\n"
    split = cs.truth_call_split([r0, r1], warmup=2, steps=1)
    # waiting: rank 0 300 ns, rank 1 0; cost: 100 ns each; per rank and step (2 ranks, 1 step), in ms
    assert split["all"] == {"wait_ms": 300 / 2 / 1e6, "cost_ms": 200 / 2 / 1e6, "instances": 1,
                            "late_return_us": 0.0}
    assert split["all_reduce/2"]["instances"] == 1
    # calls that do not pair up by order (a member made fewer) give no split rather than a wrong one
    assert cs.truth_call_split([r0, r1.splitlines()[0] + "\n"], warmup=2, steps=1) == {}


def test_the_split_gives_how_far_the_last_member_returns_past_the_median_one():
    cs = _comm_share()
    # three members enter at 100, 200, 300 and return at 400, 450, 700: the median return is 450
    lines = ["call 2 all_reduce 3 16 100 400 0 -1 -1 0,1,2\n", "call 2 all_reduce 3 16 200 450 0 -1 -1 0,1,2\n",
             "call 2 all_reduce 3 16 300 700 0 -1 -1 0,1,2\n"]
    split = cs.truth_call_split(lines, warmup=2, steps=1)
    assert split["all"]["late_return_us"] == (700 - 450) / 1e3
    # waiting 200 + 100 + 0 and cost 100 + 150 + 400 ns, per rank (3) and step (1)
    assert split["all"]["wait_ms"] == 300 / 3 / 1e6 and split["all"]["cost_ms"] == 650 / 3 / 1e6


def test_late_return_lengthens_each_instance_by_its_ops_measured_late_return():
    import types

    import numpy as np

    from prism.core.graph import OPS

    cs = _comm_share()
    ar, a2a = OPS.index("all_reduce"), OPS.index("all_to_all_single")

    class Base:
        name, source = "concurrent", "x"

        def instance_costs(self, graph):
            return np.array([100, 200, 300, 400], np.int64)

    graph = types.SimpleNamespace(inst_op=np.array([ar, a2a, ar, ar]), inst_group=np.array([0, 0, 1, 0]),
                                  group_size=np.array([2, 4]))
    late = cs.LateReturn(Base(), {"all_reduce/2": 1.5, "all_reduce/4": 3.0})  # us; none for all_to_all_single/2
    assert late.instance_costs(graph).tolist() == [1600, 200, 3300, 1900]
