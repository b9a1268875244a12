"""Gang-aware residency (prism/core/residency.py) through the scheduler,
and its rescue rule (sans-IO: time and the matcher's view are arguments)."""

import pytest

from prism.core.residency import RESCUE_QUIET_NS, GangResidency, megatron_gangs
from prism.core.scheduler import (Grant, NoSwap, RankState, Rescue, ResidentLimit, Scheduler, SwapIn, SwapOut, SwapPolicy)


def test_megatron_gangs_from_the_layout():
    # tp2 dp2 pp2: rank = tp + 2 * (dp + 2 * pp)
    assert megatron_gangs(8, 2, 2, 2, "tp") == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}
    pipe = megatron_gangs(8, 2, 2, 2, "tpxpp")
    assert sorted(r for r, g in pipe.items() if g == pipe[0]) == [0, 1, 4, 5]
    assert sorted(r for r, g in pipe.items() if g == pipe[2]) == [2, 3, 6, 7]
    assert megatron_gangs(4, 1, 4, 1, "1") == {0: 0, 1: 1, 2: 2, 3: 3}
    with pytest.raises(ValueError, match="multiply to the world size"):
        megatron_gangs(8, 2, 2, 1, "tp")


def test_gang_must_fit_and_share_a_gpu():
    with pytest.raises(ValueError, match="raise --resident to at least the gang size"):
        GangResidency(1, {0: 0, 1: 0})
    with pytest.raises(ValueError, match="spans GPUs"):
        GangResidency(2, {0: 0, 1: 0}, {0: 0, 1: 1})


def _sched(world, resident, gangs=None, slots=1):
    policy = GangResidency(resident, gangs)
    return Scheduler(slots, range(world), policy), policy


def test_first_grants_need_no_swap_in_and_lru_is_evicted():
    s, p = _sched(3, 2)
    assert s.request(0) == [Grant(0)]
    assert s.request(1) == []
    assert s.release(0) == [Grant(1)]
    assert s.request(2) == []
    # Rank 0 blocked longest ago: it goes out for rank 2.
    assert s.release(1) == [SwapOut(0), Grant(2)]
    assert p.resident() == [1, 2]
    assert s.request(0) == []
    assert s.release(2) == [SwapOut(1), SwapIn(0), Grant(0)]


def test_gang_enters_and_leaves_together():
    gangs = {0: 0, 1: 0, 2: 1, 3: 1}
    s, p = _sched(4, 2, gangs)
    s.request(0), s.request(1), s.request(2), s.request(3)
    assert s.release(0) == [Grant(1)]
    assert s.release(1) == [SwapOut(0), SwapOut(1), Grant(2)]
    assert s.release(2) == [Grant(3)]
    s.request(0)
    # Rank 1 is started and in 0's gang: it comes back too.
    assert s.release(3) == [SwapOut(2), SwapOut(3), SwapIn(0), SwapIn(1), Grant(0)]
    assert sorted(p.resident()) == [0, 1]


def test_wake_restores_a_checkpointed_blocked_rank_and_pins_it():
    s, p = _sched(3, 2)
    s.request(0)
    s.request(1), s.request(2)
    s.release(0)  # grant 1
    s.release(1)  # 0 out, grant 2
    assert not p.is_resident(0) and s.state(0) == RankState.BLOCKED
    # Data for 0 arrives: it must come back; 1 (blocked, not pinned) goes.
    assert p.wake(0, s) == [SwapOut(1), SwapIn(0)]
    assert 0 in p.pinned
    # A wake for a resident or running rank does nothing.
    assert p.wake(0, s) == [] and p.wake(2, s) == []
    # 1 wants to run: 2 (blocked, not pinned) goes rather than the pinned 0.
    s.request(1)
    assert s.release(2) == [SwapOut(2), SwapIn(1), Grant(1)]
    assert p.retry(s) == []


def test_grant_waits_for_a_pinned_rank_to_take_its_data():
    s, p = _sched(2, 1)
    s.request(0), s.request(1)
    assert s.release(0) == [SwapOut(0), Grant(1)]
    s.release(1)
    assert p.wake(0, s) == [SwapOut(1), SwapIn(0)]
    # Only the pinned rank could make room for 1: the slot is held back
    # (evicting 0 before it took its data in would swap it straight back).
    assert s.request(1) == []
    # 0 took its data in and still waits: now 1 goes.
    assert p.taken(0, s) == [SwapOut(0), SwapIn(1), Grant(1)]
    assert 0 not in p.pinned and p.retry(s) == []


def test_held_back_grant_goes_to_the_pinned_rank_when_it_asks():
    s, p = _sched(2, 1)
    s.request(0), s.request(1)
    s.release(0), s.release(1)
    assert p.wake(0, s) == [SwapOut(1), SwapIn(0)]
    assert s.request(1) == []
    # 0 asks for a slot (its wait ended): it is resident and goes first.
    assert s.request(0) == [Grant(0)]
    assert s.release(0) == [SwapOut(0), SwapIn(1), Grant(1)]


def test_rescue_wake_does_not_pin():
    s, p = _sched(2, 1)
    s.request(0), s.request(1)
    s.release(0), s.release(1)
    assert p.wake(0, s, pin=False) == [SwapOut(1), SwapIn(0)]
    assert p.pinned == set()
    # A resident rank's rescue changes nothing.
    assert p.wake(0, s, pin=False) == [] and p.pinned == set()
    assert s.request(1) == [SwapOut(0), SwapIn(1), Grant(1)]


def test_wake_waits_when_nothing_can_go():
    s, p = _sched(3, 1)
    s.request(0), s.request(1)
    s.release(0)  # 0 out, grant 1
    assert s.running == [1]
    assert p.wake(0, s) == []  # only the running rank is resident
    s.request(2)
    assert s.release(1) == [SwapOut(1), Grant(2)]
    assert p.retry(s) == []  # 2 runs now
    s.release(2)
    assert p.retry(s) == [SwapOut(2), SwapIn(0)]


def test_no_room_for_a_grant_waits_for_the_running_rank():
    s, p = _sched(2, 1, slots=2)
    s.request(0)
    # A free slot but no room on the GPU: 1 waits for 0 to block.
    assert s.request(1) == [] and s.waiting == (1,)
    assert s.release(0) == [SwapOut(0), Grant(1)]


def test_finished_rank_leaves_without_a_swap():
    s, p = _sched(2, 1)
    s.request(0), s.request(1)
    assert s.finish(0) == [Grant(1)]
    assert p.resident() == [1]


def test_resident_ranks_are_granted_first():
    s, p = _sched(3, 2)
    s.request(0), s.request(1)
    s.release(0)  # 1 runs; 0 and 1 resident
    s.request(2), s.request(0)  # queue: 2 (not resident), 0 (resident)
    assert s.release(1) == [Grant(0)]  # 0 passes 2
    s.request(1)
    assert s.release(0) == [Grant(1)]  # and again
    # No resident rank waits: 2 goes, the least recently granted 0 makes room.
    assert s.release(1) == [SwapOut(0), Grant(2)]


def test_idle_gang_is_evicted_before_one_waiting_for_a_slot():
    s, p = _sched(3, 2)
    s.request(0), s.request(1)
    s.release(0)  # 1 runs; 0 blocked
    s.request(2), s.request(0)  # 0 resident again: it is waiting, not idle
    assert s.release(1) == [Grant(0)]
    # 1 is blocked (idle), 0 runs: 2's grant evicts 1, not a waiting rank.
    assert s.release(0) == [SwapOut(1), Grant(2)]


def test_data_to_a_resident_blocked_rank_pins_it():
    # Data reached 0 and 1 while resident; 2's grant must not evict them
    # silently: they go only as a last resort, and come back by themselves.
    s, p = _sched(3, 2)
    s.request(0), s.request(1)
    s.release(0)
    s.request(2)
    assert p.wake(0, s) == [] and 0 in p.pinned
    assert s.release(1) == [SwapOut(1), Grant(2)]  # 1 (not pinned) goes, 0 stays
    assert p.retry(s) == []


def test_stale_pins_are_dropped_as_a_last_resort():
    s, p = _sched(2, 1)
    s.request(0), s.request(1)
    s.release(0), s.release(1)
    assert p.wake(0, s) == [SwapOut(1), SwapIn(0)]
    assert s.request(1) == []  # held back for the pinned 0
    # 0 never asks nor says Taken: the coordinator's rescue drops the pin.
    assert p.unpin_blocked(s) == [SwapOut(0), SwapIn(1), Grant(1)]
    assert p.pinned == set() and p.unpin_blocked(s) == []


def test_rescue_restores_checkpointed_ranks_that_wait_for_nothing_known():
    s, p = _sched(3, 1)
    s.request(0), s.request(1), s.request(2)
    s.release(0)  # 0 out, grant 1
    s.release(1)  # 1 out, grant 2
    s.release(2)
    # 0 and 1 are checkpointed. 1 waits for a receive (its data will wake
    # it); 0 waits for nothing the matcher knows (released by the stall
    # monitor with work left): only 0 is rescued, and not pinned.
    waits = {1: "p2p:0:1:7:0", 2: "world:0"}.get
    last = 1_000
    assert list(p.rescue(last + RESCUE_QUIET_NS - 1, last, waits, s)) == []
    now = last + RESCUE_QUIET_NS
    assert list(p.rescue(now, last, waits, s)) == [Rescue(0, RESCUE_QUIET_NS, (SwapOut(2), SwapIn(0)))]
    assert p.pinned == set() and p.resident() == [0]
    # A rescue counts as progress: the next one comes a quiet period later.
    assert list(p.rescue(now + RESCUE_QUIET_NS - 1, last, lambda r: None, s)) == []
    assert next(p.rescue(now + RESCUE_QUIET_NS, last, lambda r: None, s)) == Rescue(
        1, RESCUE_QUIET_NS, (SwapOut(0), SwapIn(1)))


def test_rescue_first_drops_pins_that_hold_a_grant_back():
    s, p = _sched(2, 1)
    s.request(0), s.request(1)
    s.release(0), s.release(1)
    assert p.wake(0, s) == [SwapOut(1), SwapIn(0)]
    assert s.request(1) == []  # held back for the pinned 0, which never asks
    steps = list(p.rescue(2 * RESCUE_QUIET_NS, 0, {0: "world:3"}.get, s))
    assert steps == [Rescue(None, 2 * RESCUE_QUIET_NS, (SwapOut(0), SwapIn(1), Grant(1)))]
    assert p.pinned == set()


def test_rescue_leaves_pins_alone_when_no_rank_waits_for_a_slot():
    s, p = _sched(2, 1)
    s.request(0), s.request(1)
    s.release(0), s.release(1)
    p.wake(0, s)
    assert list(p.rescue(RESCUE_QUIET_NS, 0, {1: "world:3"}.get, s)) == []
    assert p.pinned == {0}


def test_policies_without_wakes_never_rescue():
    for policy in (NoSwap(), ResidentLimit(1)):
        s = Scheduler(1, range(2), policy)
        s.request(0), s.request(1)
        s.release(0)
        assert list(policy.rescue(10 * RESCUE_QUIET_NS, 0, lambda r: None, s)) == []
        assert policy.wake(0, s) == [] and policy.taken(0, s) == [] and policy.retry(s) == []
        assert policy.unpin_blocked(s) == []


def test_every_policy_answers_every_call_of_the_protocol():
    calls = {name for name in vars(SwapPolicy) if not name.startswith("_")}
    assert {"pick", "before_grant", "on_release", "on_finish", "returning", "wake", "taken",
            "unpin_blocked", "retry", "is_resident", "rescue"} <= calls
    for policy in (NoSwap(), ResidentLimit(2), GangResidency(2)):
        assert [c for c in sorted(calls) if not callable(getattr(policy, c, None))] == [], type(policy).__name__


def test_a_resident_rank_is_granted_while_its_mate_cannot_come_in_yet():
    """A gang half on the GPU (its mate left out for want of room while the
    other gang's rank runs): the resident half asks again and is granted; its
    mate comes in later. Before, the grant raised `no room on GPU` (seen in a
    `--gpus 0,1 --resident 2 --simulate-swaps` capture of tp2 dp4, 1 run in 6)."""
    gangs = {0: 0, 1: 0, 2: 1, 3: 1}
    s, p = _sched(4, 2, gangs, slots=2)
    assert s.request(0) == [Grant(0)] and s.request(1) == [Grant(1)]
    s.release(0), s.release(1)
    assert s.request(2) == [SwapOut(0), SwapOut(1), Grant(2)]
    assert s.request(3) == [Grant(3)]
    s.release(2), s.release(3)
    assert s.request(1) == [SwapOut(2), SwapOut(3), SwapIn(1), SwapIn(0), Grant(1)]
    assert s.finish(0) == []
    # room for 2 but not for its mate 3 while 1 runs: 2 alone comes in
    assert s.request(2) == [SwapIn(2), Grant(2)]
    assert s.release(2) == []
    assert s.request(2) == [Grant(2)]  # resident: granted; 3 still out
    assert sorted(p.resident()) == [1, 2]
    assert s.finish(1) == []
    assert s.request(3) == [SwapIn(3), Grant(3)]  # room now
    assert sorted(p.resident()) == [2, 3]
