"""The execution graph (prism.core.graph): program order and matching of
collectives and point-to-point calls across ranks, and every way a trace can
fail to form a graph (truncation, mismatches, unmatched sends and receives,
deadlocks, group disagreements), each error naming ranks and calls."""

import dataclasses

import numpy as np
import pytest
from tests.support.helpers_graph import Program

from prism.core.graph import (
    COLL,
    COMPUTE,
    ITER,
    RECV,
    SEND,
    WAIT,
    CollectiveMismatchError,
    DeadlockError,
    ExecutionGraph,
    GraphError,
    GroupError,
    TruncatedTraceError,
    UnmatchedP2PError,
)
from prism.core.synthetic import MegatronSpec, megatron_events, megatron_graph
from prism.core.trace import Collective, Compute


def two_groups() -> Program:
    return Program(4, {"tp0": (0, 1), "tp1": (2, 3)})


# ----------------------------------------------------------------- structure
def test_program_order_and_matching():
    p = Program(2)
    p.compute(0, 10)
    p.compute(1, 20)
    p.coll("world")
    p.send(0, 1)
    p.end_step()
    g = ExecutionGraph.from_events(p.events)
    assert g.kind[g.nodes_of(0)].tolist() == [COMPUTE, COLL, SEND, ITER]
    assert g.kind[g.nodes_of(1)].tolist() == [COMPUTE, COLL, RECV, ITER]
    assert g.n_instances == 1 and g.n_messages == 1
    assert g.inst_nodes.tolist() == [1, 5]
    assert (g.msg_send.tolist(), g.msg_recv.tolist()) == ([2], [6])
    assert g.dur[[0, 4]].tolist() == [10, 20]


def test_async_record_written_at_completion_is_placed_at_its_issue():
    # The async all_reduce's record comes after the overlapping compute in the
    # file; the graph must still put the issue before that compute and the
    # wait after it.
    p = Program(2)
    p.coll("world", async_on=(0, 1))
    p.compute(0, 50)
    p.compute(1, 50)
    p.wait(0)
    p.wait(1)
    p.end_step()
    assert isinstance(p.events[0][-2], Collective) and isinstance(p.events[0][-3], Compute)
    g = ExecutionGraph.from_events(p.events)
    assert g.kind[g.nodes_of(0)].tolist() == [COLL, COMPUTE, WAIT, ITER]
    assert g.is_async[0] and g.wait_of[2] == 0


def test_events_and_array_builders_give_the_same_graph():
    spec = MegatronSpec(tp=2, pp=3, dp=4, ep=2, micro_batches=3, layers_per_stage=1, iterations=2)
    a = ExecutionGraph.from_events(megatron_events(spec))
    b = megatron_graph(spec)
    assert a.groups == b.groups
    for name in ("kind", "rank", "dur", "is_async", "group", "seq", "op", "peer", "tag", "nbytes", "wait_of",
                 "step", "rec_start", "rec_end", "ref", "inst_nodes", "inst_ptr", "msg_send", "msg_recv"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert all(np.array_equal(x, y) for x, y in zip(dataclasses.astuple(a.waves), dataclasses.astuple(b.waves)))


@pytest.mark.parametrize("tp,pp,dp,ep", [(2, 2, 2, 1), (1, 4, 2, 2), (4, 1, 2, 1)])
def test_synthetic_counts_follow_the_layout(tp, pp, dp, ep):
    # expected from the layout (DESIGN.md), not from the graph under test
    spec = MegatronSpec(tp=tp, pp=pp, dp=dp, ep=ep, micro_batches=3, layers_per_stage=2, iterations=2, dp_buckets=2)
    g = megatron_graph(spec)
    it, m, L = spec.iterations, spec.micro_batches, spec.layers_per_stage
    n_groups = dp * pp + tp * pp + tp * dp + (tp * pp * dp // ep if ep > 1 else 0)
    assert len(g.groups) == n_groups
    expected_inst = it * (dp * pp * m * L * 2 * 2  # TP all_reduces: 2 per layer half, fwd and bwd
                          + tp * pp * spec.dp_buckets  # DP buckets
                          + (tp * pp * (dp // ep) * m * L * 2 * 2 if ep > 1 else 0))  # EP all_to_all pairs
    assert g.n_instances == expected_inst
    assert g.n_messages == it * tp * dp * (pp - 1) * m * 2
    for r in range(spec.world_size):
        t, d, p = spec.coords(r)
        assert r == t + tp * (d + dp * p)
    tp_groups = [gr.ranks for gr in g.groups if gr.gid.startswith("tp/")]
    assert sorted(tp_groups) == sorted(tuple(spec.rank(t, d, p) for t in range(tp)) for d in range(dp) for p in range(pp))


# -------------------------------------------------------------------- errors
def test_truncated_trace_names_missing_rank_group_op_and_seq():
    p = two_groups()
    p.coll("tp0")
    p.coll("tp0", op="all_gather_into_tensor")
    ev = p.events
    ev[1] = ev[1][:-1]  # rank 1's file lost its last record
    with pytest.raises(TruncatedTraceError,
                       match=r"all_gather_into_tensor on group 'tp0' \(ranks \[0, 1\]\) seq 1: ranks \[1\] have no "
                             r"record of it while ranks \[0\] do.*trace is incomplete"):
        ExecutionGraph.from_events(ev)


def test_mismatched_op_names_both_ranks_and_calls():
    p = two_groups()
    p.coll("tp1")
    ev = p.events
    ev[3] = [dataclasses.replace(e, op="broadcast") if isinstance(e, Collective) else e for e in ev[3]]
    with pytest.raises(CollectiveMismatchError,
                       match=r"group 'tp1' \(ranks \[2, 3\]\) seq 0: members disagree on the op: rank 2 called "
                             r"all_reduce\(SUM, float32.*\) but rank 3 called broadcast\(.*training script"):
        ExecutionGraph.from_events(ev)


@pytest.mark.parametrize("field,value,shown", [
    ("dtype", "bfloat16", "bfloat16"),
    ("reduce_op", "MAX", "MAX"),
    ("in_shapes", ((7,),), r"\(7,\)"),
])
def test_mismatched_signature(field, value, shown):
    p = two_groups()
    p.coll("tp0", op="all_reduce")
    ev = p.events
    ev[1] = [dataclasses.replace(e, **{field: value}) if isinstance(e, Collective) else e for e in ev[1]]
    with pytest.raises(CollectiveMismatchError, match=rf"seq 0: members disagree on the signature: rank 0 called "
                                                      rf"all_reduce\(.*\) but rank 1 called all_reduce\(.*{shown}"):
        ExecutionGraph.from_events(ev)


def test_unmatched_send_names_ranks_tag_and_pseq():
    p = Program(2)
    p.send(0, 1, tag=3)
    p.send(0, 1, tag=3)
    ev = p.events
    ev[1] = ev[1][:-1]  # the second recv is missing
    with pytest.raises(UnmatchedP2PError,
                       match=r"send from rank 0 to rank 1 \(group 'world', tag 3, pseq 1, step 0\) has no matching "
                             r"recv on rank 1"):
        ExecutionGraph.from_events(ev)


def test_unmatched_recv():
    p = Program(3)
    p.send(2, 0)
    ev = p.events
    ev[2] = ev[2][:-1]
    with pytest.raises(UnmatchedP2PError, match=r"recv from rank 2 to rank 0 .* has no matching send on rank 2"):
        ExecutionGraph.from_events(ev)


def test_collective_cycle_is_a_deadlock_naming_who_waits_for_what():
    p = Program(2, {"a": (0, 1), "b": (0, 1)})
    p.coll("a")
    p.coll("b")
    ev = p.events
    # rank 1 issues them in the opposite order: each waits for the other forever
    ev[1] = ev[1][:3] + [dataclasses.replace(ev[1][4], issue_ns=2, wait_ns=2, end_ns=3),
                         dataclasses.replace(ev[1][3], issue_ns=3, wait_ns=3, end_ns=4)]
    with pytest.raises(DeadlockError,
                       match=r"cycle \(deadlock\): rank 0 waits in all_reduce on group 'a' \(ranks \[0, 1\]\) seq 0, "
                             r"which ranks \[1\] never reach; rank 1 waits in all_reduce on group 'b' .* seq 0, "
                             r"which ranks \[0\] never reach"):
        ExecutionGraph.from_events(ev)


def test_recv_before_send_on_both_sides_is_a_deadlock():
    p = Program(2)
    p.send(0, 1)
    p.send(1, 0)
    ev = p.events
    # rank 0 receives first, then sends: with rank 1 doing the same, neither send is reached
    ev[0] = ev[0][:1] + [dataclasses.replace(ev[0][2], issue_ns=0), dataclasses.replace(ev[0][1], issue_ns=1)]
    ev[1] = ev[1][:1] + [dataclasses.replace(ev[1][1], issue_ns=0), dataclasses.replace(ev[1][2], issue_ns=1)]
    with pytest.raises(DeadlockError, match=r"rank 0 waits in recv from rank 1 .*tag 0, pseq 0\), whose send is never "
                                            r"reached; rank 1 waits in recv from rank 0"):
        ExecutionGraph.from_events(ev)


def test_groups_disagreeing_between_ranks():
    p = two_groups()
    ev = p.events
    ev[1] = [dataclasses.replace(e, ranks=(0, 1, 2)) if getattr(e, "gid", "") == "tp0" and hasattr(e, "ranks")
             else e for e in ev[1]]
    with pytest.raises(GroupError, match=r"group 'tp0': rank 0 recorded members \[0, 1\] but rank 1 recorded \[0, 1, 2\]"):
        ExecutionGraph.from_events(ev)


def test_collective_on_group_never_created():
    p = two_groups()
    p.coll("tp0")
    ev = p.events
    ev[0] = [e for e in ev[0] if not (hasattr(e, "ranks") and e.gid == "tp0")]
    with pytest.raises(GroupError, match=r"rank 0: all_reduce on group 'tp0' \(seq 0\) comes before any group record"):
        ExecutionGraph.from_events(ev)


def test_missing_rank_file():
    p = Program(3)
    ev = p.events
    del ev[1]
    with pytest.raises(GraphError, match=r"no events for ranks \[1\]"):
        ExecutionGraph.from_events(ev)


def test_duplicate_participation():
    p = Program(2)
    p.coll("world")
    ev = p.events
    ev[0] = ev[0] + [dataclasses.replace(ev[0][-1], issue_ns=5, wait_ns=5, end_ns=6)]
    with pytest.raises(GraphError, match=r"rank 0 recorded all_reduce on group 'world' .* seq 0 twice"):
        ExecutionGraph.from_events(ev)


def test_graph_cannot_be_built_by_constructor():
    with pytest.raises(TypeError, match="from_events"):
        ExecutionGraph()
