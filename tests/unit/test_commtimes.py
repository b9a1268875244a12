"""In-situ communication times (prism.core.commtimes): the skeleton's
programs, the costs taken from its measured issue and completion times, and
the cost model that uses them only for the graph they were measured on."""

import numpy as np
import pytest
from tests.support.helpers_graph import Program

from prism.core.commtimes import CommTimesError, MeasuredComm, graph_fingerprint, mean_costs, measured_costs, rank_program
from prism.core.costmodel import CostModel, Link
from prism.core.graph import ExecutionGraph
from prism.core.replay import replay_batch


def _graph(durations: tuple[int, int, int, int] = (100, 300, 50, 50)) -> ExecutionGraph:
    a, b, c, d = durations
    p = Program(2)
    p.compute(0, a)
    p.compute(1, b)
    p.coll("world", nbytes=4096)
    p.coll("world", op="all_to_all_single", nbytes=1024, async_on=(0, 1))
    p.compute(0, c)
    p.compute(1, d)
    p.wait(0)
    p.wait(1)
    p.send(0, 1, nbytes=8192, tag=3)
    p.end_step()
    return ExecutionGraph.from_events(p.events)


MODEL = CostModel("flat", 8, Link(1e9, 1e-6), Link(1e9, 1e-6))


def test_rank_program_walks_the_rank_in_order_with_the_instance_size():
    g = _graph()
    prog = rank_program(g, 0)
    kinds = [item[0] for item in prog]
    assert kinds == ["c", "coll", "coll", "c", "wait", "send", "iter"]
    assert prog[0][2] == 100
    coll = prog[1]
    assert coll[2:] == ["all_reduce", 0, 4096, "float32", False]
    a2a = prog[2]
    assert a2a[2] == "all_to_all_single" and a2a[-1] is True
    assert prog[4][2] == a2a[1]  # the wait names the async op's node
    send = prog[5]
    assert send[2:] == [1, 0, 8192, 3, False]
    assert [item[0] for item in rank_program(g, 1)] == ["c", "coll", "coll", "c", "wait", "recv", "iter"]


def test_measured_costs_take_the_last_issue_and_the_median_completion():
    g = _graph()
    n = len(g.kind)
    start = np.full(n, -1, np.int64)
    end = np.full(n, -1, np.int64)
    (m0, m1) = g.inst_nodes[g.inst_ptr[0]:g.inst_ptr[1]]
    start[[m0, m1]] = [1_000, 4_000]  # rank 1 arrives last
    end[[m0, m1]] = [6_000, 6_200]
    s, r = g.msg_send[0], g.msg_recv[0]
    start[[s, r]] = [10_000, 12_000]  # the receive posted after the send
    end[r] = 12_500
    inst, msg = measured_costs(g, start, end)
    assert inst[0] == 6_100 - 4_000
    assert inst[1] == -1  # the async instance was not measured
    assert msg.tolist() == [500]
    with pytest.raises(CommTimesError, match="nodes"):
        measured_costs(g, start[:-1], end)


def test_measured_comm_replaces_measured_entries_only_and_only_for_its_graph():
    g = _graph()
    inst = np.array([2_000_000, -1], np.int64)
    msg = np.array([-1], np.int64)
    m = MeasuredComm(MODEL, inst, msg, graph_fingerprint(g), "t1")
    model = MODEL.instance_costs(g)
    got = m.instance_costs(g)
    assert got[0] == 2_000_000 and got[1] == model[1]
    assert m.message_costs(g).tolist() == MODEL.message_costs(g).tolist()
    assert m.ranks_per_node == 8 and "t1" in m.name
    # the replay takes it like any cost model
    slow = replay_batch(g, cost_model=m).iteration_times
    fast = replay_batch(g, cost_model=MODEL).iteration_times
    assert slow[0] > fast[0]
    p = Program(2)
    p.compute(0, 10)
    p.coll("world", nbytes=64)
    p.end_step()
    other = ExecutionGraph.from_events(p.events)
    with pytest.raises(CommTimesError, match="another graph"):
        m.instance_costs(other)


def test_fingerprint_follows_the_communication_not_the_durations():
    g = _graph()
    assert graph_fingerprint(_graph((999, 1, 5, 5))) == graph_fingerprint(g)  # other durations, same calls
    q = Program(2)
    q.coll("world", nbytes=2048)
    q.end_step()
    assert graph_fingerprint(ExecutionGraph.from_events(q.events)) != graph_fingerprint(g)


def test_mean_costs_average_the_passes_that_measured_each_entry():
    a = (np.array([100, -1, 30], np.int64), np.array([-1], np.int64))
    b = (np.array([300, -1, -1], np.int64), np.array([-1], np.int64))
    inst, msg = mean_costs([a, b])
    assert inst.tolist() == [200, -1, 30] and msg.tolist() == [-1]
    with pytest.raises(CommTimesError, match="no pass"):
        mean_costs([])
