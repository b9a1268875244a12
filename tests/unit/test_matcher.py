"""prism.core.matcher: matching in any arrival order, mismatches, p2p pairing,
deadlock reports, dead and finished ranks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.core.collectives import from_array, reduce_arrays, to_array
from prism.core.matcher import (
    CollectiveDone,
    CollectiveMismatch,
    GroupMismatch,
    InvalidCall,
    Matcher,
    NeverCompletes,
    P2PDone,
    P2PMismatch,
    PeerFailed,
    wait_key_coll,
    wait_key_p2p,
)
from prism.core.protocol import CollectiveArrive, GroupCreate, RecvPost, Send, Wait
from prism.core.scheduler import RankState, Scheduler

WORLD = "g0-00000000"
G02 = "g1-ab12cd34"
S = 1_000_000_000


def matcher(world=4, groups=((WORLD, None), (G02, (0, 2)))):
    m = Matcher(world)
    for gid, ranks in groups:
        ranks = ranks or tuple(range(world))
        for r in ranks:
            assert m.group_create(GroupCreate(rank=r, gid=gid, index=0, ranks=ranks, name=""), 0) == []
    return m


def coll(rank, op="all_reduce", gid=WORLD, seq=0, arrays=(), reduce_op="SUM", dtype="float32",
         out_shapes=None, **kw):
    arrays = [np.asarray(a) for a in arrays]
    in_shapes = tuple(a.shape for a in arrays)
    return CollectiveArrive(rank=rank, gid=gid, seq=seq, op=op, reduce_op=reduce_op, dtype=dtype,
                            in_shapes=in_shapes, out_shapes=in_shapes if out_shapes is None else out_shapes,
                            payloads=tuple(from_array(a) for a in arrays), **kw)


def send(src, dst, tag=0, pseq=0, array=np.zeros(3, np.float32), dtype="float32"):
    return Send(rank=src, gid=WORLD, dst=dst, tag=tag, pseq=pseq, dtype=dtype, shape=array.shape,
                payloads=(from_array(array),))


def recv(dst, src, tag=0, pseq=0, shape=(3,), dtype="float32"):
    return RecvPost(rank=dst, gid=WORLD, src=src, tag=tag, pseq=pseq, dtype=dtype, shape=shape)


# --- collectives in any order --------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(order=st.permutations(range(4)), seed=st.integers(0, 2**16))
def test_all_reduce_completes_on_the_last_arrival_in_any_order(order, seed):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((5, 2)).astype(np.float32) for _ in range(4)]
    m = matcher()
    outcomes = []
    for k, r in enumerate(order):
        got = m.arrive(coll(r, arrays=[xs[r]]), now=k)
        outcomes.append(got)
    assert all(o == [] for o in outcomes[:-1])
    (done,) = outcomes[-1]
    assert isinstance(done, CollectiveDone) and (done.gid, done.seq, done.ranks) == (WORLD, 0, (0, 1, 2, 3))
    want = reduce_arrays(xs, "SUM", "float32").tobytes()
    assert {r: p for r, p in done.outputs.items()} == {r: (want,) for r in range(4)}


@settings(max_examples=40, deadline=None)
@given(order=st.permutations([(r, s) for r in range(4) for s in range(2)]))
def test_interleaved_instances_match_by_sequence(order):
    # Arrivals of seq 0 and 1 on WORLD and G02 interleave; each rank's own
    # sequence numbers stay in order, as a real backend sends them.
    order = sorted(order, key=lambda rs: (order.index(rs) if rs[1] == 0 else order.index((rs[0], 0)) + 0.5))
    m = matcher()
    done = {}
    for r, s in order:
        gather = coll(r, "all_gather", seq=s, arrays=[np.full(2, 10 * s + r, np.int64)], dtype="int64",
                      reduce_op="", out_shapes=((2,),) * 4)
        for o in m.arrive(gather, now=0):
            done[(o.gid, o.seq)] = o
    assert sorted(done) == [(WORLD, 0), (WORLD, 1)]
    for s in range(2):
        out = done[(WORLD, s)].outputs[3]
        assert [to_array(p, "int64", (2,))[0] for p in out] == [10 * s + r for r in range(4)]


def test_subgroup_results_go_to_members_only():
    m = matcher()
    assert m.arrive(coll(2, gid=G02, seq=0, arrays=[np.ones(2, np.float32)]), 0) == []
    (done,) = m.arrive(coll(0, gid=G02, seq=0, arrays=[np.ones(2, np.float32)]), 1)
    assert set(done.outputs) == {0, 2}
    assert to_array(done.outputs[0][0], "float32", (2,)).tolist() == [2.0, 2.0]


# --- mismatches ----------------------------------------------------------------------


def test_mismatch_is_reported_on_the_differing_arrival():
    m = matcher()
    x = np.zeros((4, 4), np.float32)
    assert m.arrive(coll(0, gid=G02, seq=7, arrays=[x]), 0) == []
    (f,) = m.arrive(coll(2, "all_gather_into_tensor", gid=G02, seq=7, arrays=[x], reduce_op="",
                         out_shapes=((8, 4),)), 1)
    assert isinstance(f, CollectiveMismatch) and f.code == "mismatch"
    assert (f.ranks, f.gid, f.seq) == ((0, 2), G02, 7)
    assert f.message == (
        "collective mismatch on group g1-ab12cd34 (ranks [0, 2]) at sequence 7: rank 0 called "
        "all_reduce(SUM, float32, [(4, 4)]) but rank 2 called all_gather_into_tensor(float32, "
        "[(4, 4)]); the script calls different collectives on different ranks")


def test_mismatch_before_all_arrive_and_late_members_get_it_too():
    m = matcher()
    x = np.zeros(2, np.float32)
    m.arrive(coll(1, arrays=[x]), 0)
    (f,) = m.arrive(coll(3, arrays=[x], reduce_op="MAX"), 1)
    assert isinstance(f, CollectiveMismatch) and f.ranks == (1, 3)
    assert "rank 1 called all_reduce(SUM, float32, [(2,)]) but rank 3 called all_reduce(MAX" in f.message
    (late,) = m.arrive(coll(0, arrays=[x]), 2)
    assert isinstance(late, CollectiveMismatch) and late.ranks == (0,) and late.message == f.message


@pytest.mark.parametrize(
    "other, words",
    [
        (dict(dtype="float64", arrays=[np.zeros(2)]), "all_reduce(SUM, float64, [(2,)])"),
        (dict(arrays=[np.zeros(3, np.float32)]), "all_reduce(SUM, float32, [(3,)])"),
        (dict(op="broadcast", reduce_op="", root=1, arrays=[np.zeros(2, np.float32)], out_shapes=()), "broadcast(float32, [(2,)], root=1)"),
    ],
)
def test_mismatch_on_dtype_shape_op(other, words):
    m = matcher()
    m.arrive(coll(0, arrays=[np.zeros(2, np.float32)]), 0)
    (f,) = m.arrive(coll(1, **other), 1)
    assert isinstance(f, CollectiveMismatch) and words in f.message


def test_refused_op_fails_the_whole_instance():
    m = matcher(2, groups=((WORLD, None),))
    m.arrive(coll(0, arrays=[np.zeros(2, np.int64)], dtype="int64", reduce_op="AVG"), 0)
    (f,) = m.arrive(coll(1, arrays=[np.zeros(2, np.int64)], dtype="int64", reduce_op="AVG"), 1)
    assert isinstance(f, InvalidCall) and f.ranks == (0, 1)
    assert "desired output type Long" in f.message


def test_group_with_different_members_is_an_error():
    m = Matcher(4)
    assert m.group_create(GroupCreate(rank=0, gid="g3-x", index=3, ranks=(0, 1), name=""), 0) == []
    (f,) = m.group_create(GroupCreate(rank=1, gid="g3-x", index=3, ranks=(0, 1, 2), name=""), 0)
    assert isinstance(f, GroupMismatch) and f.ranks == (0, 1)
    assert f.message.startswith("group g3-x (creation index 3) has ranks [0, 1] on rank 0 but [0, 1, 2] on rank 1")


def test_non_member_and_unknown_group():
    m = matcher()
    (f,) = m.arrive(coll(1, gid=G02, arrays=[np.zeros(1, np.float32)]), 0)
    assert isinstance(f, InvalidCall) and "but it is not a member" in f.message
    (f,) = m.arrive(coll(1, gid="g9-zz", arrays=[np.zeros(1, np.float32)]), 0)
    assert isinstance(f, InvalidCall) and "Prism bug" in f.message


# --- point to point ------------------------------------------------------------------


@pytest.mark.parametrize("send_first", [True, False])
def test_send_and_recv_pair_in_either_order(send_first):
    m = matcher()
    data = np.arange(3, dtype=np.float32)
    events = [lambda: m.send(send(1, 2, tag=5, pseq=0, array=data), 0), lambda: m.recv_post(recv(2, 1, tag=5), 0)]
    if not send_first:
        events.reverse()
    assert events[0]() == []
    (done,) = events[1]()
    assert isinstance(done, P2PDone) and (done.src, done.dst, done.tag, done.pseq) == (1, 2, 5, 0)
    assert to_array(done.payloads[0], "float32", (3,)).tolist() == [0.0, 1.0, 2.0]


@settings(max_examples=40, deadline=None)
@given(order=st.permutations(range(6)))
def test_p2p_pairs_by_tag_and_pseq_in_any_order(order):
    m = matcher()
    events = []
    for pseq in range(3):
        a = np.full(3, pseq, np.float32)
        events.append(("send", send(0, 3, tag=1, pseq=pseq, array=a)))
        events.append(("recv", recv(3, 0, tag=1, pseq=pseq)))
    delivered = {}
    for i in order:
        kind, msg = events[i]
        for o in (m.send if kind == "send" else m.recv_post)(msg, 0):
            assert isinstance(o, P2PDone)
            delivered[o.pseq] = to_array(o.payloads[0], "float32", (3,))[0]
    assert delivered == {0: 0.0, 1: 1.0, 2: 2.0}


def test_p2p_size_mismatch_names_both_ranks():
    m = matcher()
    m.recv_post(recv(2, 1, tag=4, shape=(3, 3)), 0)
    (f,) = m.send(send(1, 2, tag=4, array=np.zeros((2, 3), np.float32)), 1)
    assert isinstance(f, P2PMismatch) and f.ranks == (1, 2)
    assert f.message == (
        "send/recv mismatch: rank 1 sends a float32 tensor of shape (2, 3) to rank 2 with tag 4 but "
        "rank 2 receives a float32 tensor of shape (3, 3) from rank 1 with tag 4; the script sends "
        "and receives tensors of different sizes or dtypes")


def test_p2p_shapes_may_differ_when_sizes_agree():
    # torch.distributed.pipelining (torch 2.11) sends a 0-d loss into a (1,)
    # buffer; gloo and NCCL only compare sizes.
    m = matcher()
    m.recv_post(recv(2, 1, tag=0, shape=(1,)), 0)
    (done,) = m.send(send(1, 2, tag=0, array=np.zeros((), np.float32)), 1)
    assert isinstance(done, P2PDone)


def test_send_to_self_or_out_of_range():
    m = matcher()
    (f,) = m.send(send(1, 1), 0)
    assert "tried to send to itself" in f.message
    (f,) = m.recv_post(recv(1, 7), 0)
    assert "ranks are in [0, 4)" in f.message


# --- deadlocks ---------------------------------------------------------------------


def test_deadlock_report_for_a_send_nobody_receives():
    m = matcher(2, groups=((WORLD, None),))
    m.send(send(0, 1, tag=1), 0)
    m.arrive(coll(0, arrays=[np.zeros(1, np.float32)]), 1)  # rank 0 then blocks in all_reduce
    m.recv_post(recv(1, 0, tag=0), 2)
    assert m.deadlock_report([0, 1], 3) is None  # rank 1 has not started to wait yet
    m.wait(Wait(rank=1, what=wait_key_p2p(0, 1, 0, 0), t_ns=0), 2 * S)
    report = m.deadlock_report([0, 1], 32 * S)
    assert report is not None and report.quiet_ns == 30 * S
    assert report.text.splitlines() == [
        "deadlock: all 2 running ranks wait and none can proceed (nothing happened for 30.0 s):",
        f"rank 0: waits in all_reduce on group {WORLD} (ranks [0, 1]) seq 0; missing: rank 1",
        "rank 1: waits in recv from rank 0 tag 0 (no matching send; rank 0 sent it tag 1 (pseq 0))",
        "rank 0 sent to rank 1 with tag 1 (pseq 0); never received",
        "the script calls collectives in a different order on different ranks, skips one on some "
        "ranks, or posts a recv that no send matches",
    ]
    assert report.unmatched_sends == ((0, 1, 1, 0),)


def test_deadlock_report_for_a_collective_a_member_never_reaches():
    m = matcher()
    for r in (0, 1, 2):
        m.arrive(coll(r, arrays=[np.zeros(1, np.float32)]), r)
    m.arrive(coll(2, gid=G02, seq=0, arrays=[np.zeros(1, np.float32)], async_op=True), 3)
    m.recv_post(recv(3, 2, tag=0, shape=(1,)), 4)
    m.wait(Wait(rank=3, what=wait_key_p2p(2, 3, 0, 0), t_ns=0), 5)
    lines = m.deadlock_report(range(4), 40 * S).text.splitlines()
    assert lines[1:5] == [
        f"rank 0: waits in all_reduce on group {WORLD} (ranks [0, 1, 2, 3]) seq 0; missing: rank 3",
        f"rank 1: waits in all_reduce on group {WORLD} (ranks [0, 1, 2, 3]) seq 0; missing: rank 3",
        f"rank 2: waits in all_reduce on group {WORLD} (ranks [0, 1, 2, 3]) seq 0; missing: rank 3",
        "rank 3: waits in recv from rank 2 tag 0 (no matching send)",
    ]
    assert m.waiting_for(2).startswith("waits in all_reduce")


def test_async_collective_is_waited_on_only_after_wait():
    m = matcher(2, groups=((WORLD, None),))
    m.arrive(coll(0, arrays=[np.zeros(1, np.float32)], async_op=True), 0)
    m.arrive(coll(1, seq=1, op="barrier", reduce_op="", dtype=""), 0)
    assert m.waiting_for(0) is None and m.deadlock_report([0, 1], 99 * S) is None
    m.wait(Wait(rank=0, what=wait_key_coll(WORLD, 0), t_ns=0), 1)
    report = m.deadlock_report([0, 1], 99 * S)
    assert "rank 0: waits in all_reduce" in report.text and "rank 1: waits in barrier" in report.text


def test_no_report_while_a_rank_computes_or_after_completion():
    m = matcher(2, groups=((WORLD, None),))
    m.arrive(coll(0, arrays=[np.zeros(1, np.float32)]), 0)
    assert m.deadlock_report([0, 1], 99 * S) is None
    m.arrive(coll(1, arrays=[np.zeros(1, np.float32)]), 1)
    assert m.waiting_for(0) is None and m.deadlock_report([0, 1], 99 * S) is None


# --- dead and finished ranks ----------------------------------------------------------


def test_dead_rank_fails_what_needs_it():
    m = matcher()
    m.arrive(coll(0, arrays=[np.zeros(1, np.float32)]), 0)
    m.arrive(coll(1, arrays=[np.zeros(1, np.float32)]), 0)
    m.recv_post(recv(2, 3), 0)
    failures = m.rank_failed(3, "killed by signal 9", 1)
    assert [type(f) for f in failures] == [PeerFailed, PeerFailed]
    assert failures[0].ranks == (0, 1) and failures[0].code == "peer_failed"
    assert failures[0].message == (
        f"rank 3 failed (killed by signal 9) before reaching all_reduce(SUM, float32, [(1,)]) on group "
        f"{WORLD} (ranks [0, 1, 2, 3]) at sequence 0; this collective can never complete")
    assert failures[1].ranks == (2,) and "before sending to rank 2 with tag 0" in failures[1].message
    (late,) = m.arrive(coll(2, arrays=[np.zeros(1, np.float32)]), 2)
    assert isinstance(late, PeerFailed) and late.ranks == (2,)
    (f,) = m.arrive(coll(0, seq=1, arrays=[np.zeros(1, np.float32)]), 3)
    assert isinstance(f, PeerFailed) and "before reaching all_reduce" in f.message
    (f,) = m.recv_post(recv(1, 3), 4)
    assert isinstance(f, PeerFailed) and f.ranks == (1,)


def test_finished_rank_never_completes_a_collective():
    m = matcher(2, groups=((WORLD, None),))
    m.arrive(coll(0, arrays=[np.zeros(1, np.float32)]), 0)
    (f,) = m.rank_finished(1, 1)
    assert isinstance(f, NeverCompletes) and f.code == "deadlock" and f.ranks == (0,)
    assert "rank 1 finished without reaching all_reduce" in f.message
    assert m.deadlock_report([0], 99 * S) is None  # the failed instance is no longer waited on


def test_wait_texts_of_the_rank_backend_are_understood():
    m = matcher(2, groups=((WORLD, None),))
    m.arrive(coll(0, arrays=[np.zeros(1, np.float32)], async_op=True), 0)
    m.recv_post(recv(1, 0, tag=2, pseq=5), 0)
    assert m.wait(Wait(rank=0, what=f"all_reduce on group {WORLD} (seq 0)", t_ns=0), 1) == []
    assert m.wait(Wait(rank=1, what="recv from rank 0 tag 2 (pseq 5)", t_ns=0), 1) == []
    assert m.waiting_for(0).startswith("waits in all_reduce") and m.waiting_for(1).startswith("waits in recv")
    assert m.wait(Wait(rank=0, what="send to rank 1 tag 0", t_ns=0), 1) == []  # eager: nothing to wait for


def test_blocked_ranks_without_a_readable_wait_list_their_pending_operations():
    m = matcher(3, groups=((WORLD, None),))
    m.arrive(coll(0, arrays=[np.zeros(1, np.float32)], async_op=True), 0)  # e.g. DDP's bucket all_reduce
    m.recv_post(recv(0, 2, tag=0, shape=(1,)), 0)
    m.arrive(coll(1, arrays=[np.zeros(1, np.float32)]), 0)
    m.recv_post(recv(2, 1, tag=0, shape=(1,)), 0)
    m.wait(Wait(rank=2, what=wait_key_p2p(1, 2, 0, 0), t_ns=0), 0)
    assert m.deadlock_report(range(3), 60 * S) is None  # rank 0 might still be computing
    lines = m.deadlock_report(range(3), 60 * S, blocked=[0]).text.splitlines()
    assert lines[1:5] == [
        f"rank 0: waits in all_reduce on group {WORLD} (ranks [0, 1, 2]) seq 0; missing: rank 2",
        "rank 0: waits in recv from rank 2 tag 0 (no matching send)",
        f"rank 1: waits in all_reduce on group {WORLD} (ranks [0, 1, 2]) seq 0; missing: rank 2",
        "rank 2: waits in recv from rank 1 tag 0 (no matching send)",
    ]


def test_broadcast_receivers_send_no_payload():
    m = matcher(3, groups=((WORLD, None),))
    x = np.arange(4, dtype=np.float32)
    recv_call = CollectiveArrive(rank=0, gid=WORLD, seq=0, op="broadcast", reduce_op="", dtype="float32",
                                 in_shapes=((4,),), out_shapes=((4,),), root=1)
    assert m.arrive(recv_call, 0) == []
    assert m.arrive(coll(1, "broadcast", arrays=[x], reduce_op="", out_shapes=(), root=1), 0) == []
    (done,) = m.arrive(CollectiveArrive(rank=2, gid=WORLD, seq=0, op="broadcast", reduce_op="", dtype="float32",
                                        in_shapes=(), out_shapes=((4,),), root=1), 0)
    assert done.outputs[1] == () and done.outputs[0] == done.outputs[2] == (x.tobytes(),)


def test_unsupported_dtype_is_named():
    m = matcher(2, groups=((WORLD, None),))
    c = CollectiveArrive(rank=1, gid=WORLD, seq=0, op="all_reduce", reduce_op="SUM", dtype="complex64",
                         in_shapes=((2,),), out_shapes=((2,),), payloads=(b"\0" * 16,))
    (f,) = m.arrive(c, 0)
    assert isinstance(f, InvalidCall) and f.ranks == (1,)
    assert f.message.endswith("not complex64")


# --- a tiny world driven through the Scheduler and the Matcher ------------------------

def run_world(programs, order, slots=2):
    """Drive rank programs as the coordinator shell would: a granted rank runs
    its next step; a blocking step releases the slot until its result comes.
    ``order`` picks which granted rank moves next. Returns (results, report)."""
    n = len(programs)
    m = matcher(n, groups=((WORLD, None),))
    sched = Scheduler(slots, range(n))
    pc = [0] * n
    seq = [0] * n
    results = {r: [] for r in range(n)}
    blocked_on = {}
    for r in range(n):
        sched.request(r)

    def deliver(outcomes):
        for o in outcomes:
            if isinstance(o, CollectiveDone):
                for r in o.ranks:
                    results[r].append(to_array(o.outputs[r][0], "int64", (1,))[0] if o.outputs[r] else None)
                    if blocked_on.pop(r, None) is not None:
                        sched.unblock(r)
            elif isinstance(o, P2PDone):
                results[o.dst].append(int(to_array(o.payloads[0], "int64", (1,))[0]))
                if blocked_on.pop(o.dst, None) is not None:
                    sched.unblock(o.dst)
            else:
                raise AssertionError(o.message)

    now = 0
    for pick in order:
        if not sched.running:
            break
        now += 1
        r = sched.running[pick % len(sched.running)]
        if pc[r] == len(programs[r]):
            sched.finish(r)
            deliver(m.rank_finished(r, now))
            continue
        step = programs[r][pc[r]]
        pc[r] += 1
        if step[0] == "all_reduce":
            blocked_on[r] = True
            sched.release(r)
            deliver(m.arrive(coll(r, seq=seq[r], arrays=[np.array([step[1]], np.int64)], dtype="int64"), now))
            seq[r] += 1
        elif step[0] == "send":
            deliver(m.send(send(r, step[1], array=np.array([step[2]], np.int64), dtype="int64"), now))
        elif step[0] == "recv":
            blocked_on[r] = True
            sched.release(r)
            deliver(m.recv_post(recv(r, step[1], shape=(1,), dtype="int64"), now))
            deliver(m.wait(Wait(rank=r, what=wait_key_p2p(step[1], r, 0, 0), t_ns=0), now))
        assert len(sched.running) <= slots
    live = [r for r in range(n) if sched.state(r) != RankState.FINISHED]
    blocked = [r for r in live if sched.state(r) == RankState.BLOCKED]
    return results, (m.deadlock_report(live, now + 30 * S, blocked) if live else None), live


@settings(max_examples=60, deadline=None)
@given(order=st.lists(st.integers(0, 3), min_size=200, max_size=200))
def test_a_correct_world_completes_in_any_schedule(order):
    # rank r sends r+10 to rank r+1 (a ring), receives from r-1, then all ranks all_reduce.
    programs = [[("send", (r + 1) % 4, r + 10), ("recv", (r - 1) % 4), ("all_reduce", r)] for r in range(4)]
    results, report, live = run_world(programs, order)
    assert live == [] and report is None
    assert results == {r: [(r - 1) % 4 + 10, 6] for r in range(4)}


@settings(max_examples=30, deadline=None)
@given(order=st.lists(st.integers(0, 3), min_size=200, max_size=200))
def test_a_world_with_a_missing_send_is_reported(order):
    # rank 3 waits for a message rank 2 never sends; the others wait for rank 3 in all_reduce.
    programs = [[("all_reduce", 0)], [("all_reduce", 1)], [("all_reduce", 2)], [("recv", 2), ("all_reduce", 3)]]
    _, report, live = run_world(programs, order)
    assert live == [0, 1, 2, 3]
    assert report.text.splitlines()[1:5] == [
        f"rank {r}: waits in all_reduce on group {WORLD} (ranks [0, 1, 2, 3]) seq 0; missing: rank 3"
        for r in range(3)
    ] + ["rank 3: waits in recv from rank 2 tag 0 (no matching send)"]
