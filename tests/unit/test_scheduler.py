"""prism.core.scheduler: slot invariants, FIFO fairness, determinism, swaps."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.core.scheduler import (
    Grant,
    NoSwap,
    RankState,
    ResidentLimit,
    Scheduler,
    SchedulerError,
    SwapIn,
    SwapOut,
)

EVENTS = ("request", "release", "unblock", "finish")


def applicable(s: Scheduler, rank: int) -> list[str]:
    """Events a well-behaved shell could send for ``rank`` now."""
    st_ = s.state(rank)
    if st_ == RankState.FINISHED:
        return []
    out = ["finish"]
    if st_ in (RankState.STARTING, RankState.BLOCKED):
        out += ["request", "unblock"]
    if st_ in (RankState.RUNNING, RankState.WAITING):
        out += ["release", "request"]
    return out


def drive(slots, n, choices, policy=None):
    """Run the events ``choices`` picks; check invariants after each; return the log."""
    s = Scheduler(slots, range(n), policy)
    log = []
    queue_model: list[int] = []  # FIFO of requesters, as the model of fairness
    for rank_pick, event_pick in choices:
        rank = rank_pick % n
        events = applicable(s, rank)
        if not events:
            continue
        event = events[event_pick % len(events)]
        before = s.state(rank)
        actions = getattr(s, event)(rank)
        log.append((rank, event, tuple(actions)))
        if event in ("request", "unblock") and before in (RankState.STARTING, RankState.BLOCKED):
            queue_model.append(rank)
        if event in ("release", "finish") and rank in queue_model:
            queue_model.remove(rank)
        grants = [a.rank for a in actions if isinstance(a, Grant)]
        # FIFO: grants go to the first in line, in order.
        assert grants == queue_model[:len(grants)]
        del queue_model[:len(grants)]
        assert tuple(queue_model) == s.waiting
        # Never more than K running; states agree with the running list.
        assert len(s.running) <= slots
        assert sorted(s.running) == sorted(r for r in range(n) if s.state(r) == RankState.RUNNING)
        # A slot is never idle while someone waits.
        assert not (s.waiting and len(s.running) < slots)
    return s, log


choices_st = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 10)), max_size=120)


@settings(max_examples=200, deadline=None)
@given(slots=st.integers(1, 4), n=st.integers(1, 9), choices=choices_st)
def test_invariants_and_fifo(slots, n, choices):
    drive(slots, n, choices)


@settings(max_examples=100, deadline=None)
@given(slots=st.integers(1, 4), n=st.integers(1, 9), choices=choices_st)
def test_deterministic(slots, n, choices):
    assert drive(slots, n, choices)[1] == drive(slots, n, choices)[1]


@settings(max_examples=100, deadline=None)
@given(slots=st.integers(1, 3), n=st.integers(1, 9), choices=choices_st)
def test_every_requester_is_granted_once_others_release(slots, n, choices):
    s, _ = drive(slots, n, choices)
    waiting = set(s.waiting)
    granted = set()
    # Running ranks compute, then block: each release hands a slot on.
    for _ in range(n * n):
        if not s.running:
            break
        for a in s.release(s.running[0]):
            if isinstance(a, Grant):
                granted.add(a.rank)
    assert waiting <= granted


def test_blocked_rank_yields_its_slot_to_the_first_waiter():
    s = Scheduler(1, range(3))
    assert s.request(0) == [Grant(0)]
    assert s.request(2) == [] and s.request(1) == []
    assert s.release(0) == [Grant(2)]
    assert s.unblock(0) == []
    assert s.waiting == (1, 0)
    assert s.finish(2) == [Grant(1)]
    assert s.state(0) == RankState.WAITING and s.state(2) == RankState.FINISHED


def test_repeated_request_and_release_before_grant():
    s = Scheduler(1, range(2))
    s.request(0)
    assert s.request(0) == [] and s.request(1) == [] and s.unblock(1) == []
    assert s.release(1) == []  # it blocked again before it was granted
    assert s.state(1) == RankState.BLOCKED and s.waiting == ()


def test_bad_events_are_prism_bugs():
    s = Scheduler(1, range(2))
    with pytest.raises(SchedulerError, match="rank 0 released a slot it does not hold .state starting."):
        s.release(0)
    s.finish(0)
    with pytest.raises(SchedulerError, match="rank 0 asked for a slot after it finished"):
        s.request(0)
    with pytest.raises(SchedulerError, match="rank 5 is not scheduled here"):
        s.request(5)
    with pytest.raises(ValueError, match="slots must be at least 1, got 0"):
        Scheduler(0, range(2))


def test_cpu_policy_never_swaps():
    s, log = drive(2, 5, [(i * 7, i * 3) for i in range(200)], NoSwap())
    assert all(isinstance(a, Grant) for _, _, actions in log for a in actions)


@settings(max_examples=150, deadline=None)
@given(slots=st.integers(1, 3), extra=st.integers(0, 2), n=st.integers(1, 8), choices=choices_st)
def test_resident_limit(slots, extra, n, choices):
    policy = ResidentLimit(slots + extra)
    _, log = drive(slots, n, choices, policy)
    resident: set[int] = set()
    ever_granted: set[int] = set()
    for rank, event, actions in log:
        if event == "finish":
            resident.discard(rank)  # its memory is freed before its slot is handed on
        for a in actions:
            if isinstance(a, SwapOut):
                assert a.rank in resident
                resident.discard(a.rank)
            elif isinstance(a, SwapIn):
                assert a.rank not in resident and a.rank in ever_granted
                resident.add(a.rank)
            else:
                resident.add(a.rank)  # first grant: state is created on the device
                ever_granted.add(a.rank)
            assert len(resident) <= slots + extra
    assert resident == set(policy.resident)


def test_resident_limit_swaps_out_the_longest_blocked():
    s = Scheduler(1, range(3), ResidentLimit(2))
    assert s.request(0) == [Grant(0)]
    s.request(1)
    assert s.release(0) == [Grant(1)]
    s.request(2)
    assert s.release(1) == [SwapOut(0), Grant(2)]
    s.request(0)
    assert s.release(2) == [SwapOut(1), SwapIn(0), Grant(0)]
