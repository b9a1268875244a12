"""The slot scheduler of phase 1 as a deterministic state machine (sans-IO).

``K`` slots bound how many ranks compute at once (on CPU: in total; see
"slot" in ``prism/__init__.py``). A rank asks for a slot before it computes
(``protocol.SlotRequest``), gives it back when it is about to block in a
communication call (``protocol.SlotRelease``), and asks again once it can go
on. Waiting ranks are granted in FIFO order of their requests, so every
requester is granted once the ranks ahead of it release; the same event
sequence always gives the same actions.

Rank states (``RankState``)::

    STARTING --request--> WAITING --(slot free)--> RUNNING --release--> BLOCKED
                             ^                                             |
                             +----------------request / unblock-----------+
    any state --finish--> FINISHED   (a RUNNING rank's slot is handed on)

Events return the actions the shell must carry out, in order:
``Grant(rank)`` (send ``protocol.SlotGrant``), and, from the ``SwapPolicy``,
``SwapOut(rank)`` / ``SwapIn(rank)`` (move a rank's GPU state to host memory
and back; on CPU ``NoSwap`` never asks for either). A ``SwapIn(r)`` always
comes before ``Grant(r)``.

Public API
----------
``Scheduler(slots, ranks, policy=None)`` with ``request(rank)``,
``release(rank)``, ``unblock(rank)``, ``finish(rank)`` (each ``-> list[Action]``),
``state(rank)``, ``ranks``, ``running``, ``waiting``;
``RankState``, ``Grant``, ``SwapIn``, ``SwapOut``, ``Action``,
``SwapPolicy`` (protocol: every call made on a policy), ``Rescue``,
``NoSwap``, ``ResidentLimit(max_resident)``, ``SchedulerError``.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


class SchedulerError(Exception):
    """An event that the rank's state does not allow (a Prism bug in the
    shell or the rank's backend: please report it)."""


class RankState(enum.Enum):
    STARTING = "starting"
    WAITING = "waiting-for-slot"
    RUNNING = "running"
    BLOCKED = "blocked-in-comm"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class Grant:
    """Send ``SlotGrant`` to ``rank``: it may compute now."""

    rank: int


@dataclass(frozen=True, slots=True)
class SwapOut:
    """Move ``rank``'s GPU state to host memory (it is blocked or finished)."""

    rank: int


@dataclass(frozen=True, slots=True)
class SwapIn:
    """Bring ``rank``'s GPU state back before it is granted."""

    rank: int


Action = Grant | SwapOut | SwapIn


class SwapPolicy(Protocol):
    """Decides GPU residency around grants; must be deterministic.

    These are every call the coordinator and the scheduler make on a policy:
    a policy that does not swap answers each with no actions (``NoSwap``).
    The scheduler calls ``pick``, ``before_grant``, ``on_release`` and
    ``on_finish``; the coordinator calls the others as it learns what the
    ranks do (data delivered, data taken in, a release that crossed its
    result, a quiet spell).
    """

    def pick(self, queue: Sequence[int], sched: Scheduler) -> int | None:
        """Index in ``queue`` (waiting ranks, first in line first) of the rank
        to grant next, or None to hold the free slot back for now."""
        ...

    def before_grant(self, rank: int, sched: Scheduler) -> list[Action]:
        """Actions to run before ``rank`` is granted (``SwapIn``, ``SwapOut``)."""
        ...

    def on_release(self, rank: int, sched: Scheduler) -> list[Action]:
        """Actions after ``rank`` released its slot (it blocks)."""
        ...

    def on_finish(self, rank: int, sched: Scheduler) -> list[Action]:
        """Actions after ``rank`` finished."""
        ...

    def returning(self, rank: int) -> None:
        """``rank`` is about to release its slot although what it waits for
        has already completed (it asks again at once)."""
        ...

    def wake(self, rank: int, sched: Scheduler, pin: bool = True) -> list[Action]:
        """Data was delivered to ``rank``: actions that give it its device
        back. ``pin=False``: a rescue, the rank may go out again."""
        ...

    def taken(self, rank: int, sched: Scheduler) -> list[Action]:
        """``rank`` took its delivered data in and still waits."""
        ...

    def unpin_blocked(self, sched: Scheduler) -> list[Action]:
        """Last resort after a quiet spell: drop what holds grants back for
        blocked ranks."""
        ...

    def retry(self, sched: Scheduler) -> list[Action]:
        """Actions deferred until room is made (run after every batch)."""
        ...

    def is_resident(self, rank: int) -> bool:
        """Whether ``rank``'s state is on its device now."""
        ...

    def rescue(self, now: int, last_progress_ns: int, waiting_for: Callable[[int], object | None],
               sched: Scheduler) -> Iterator[Rescue]:
        """Called on the coordinator's watchdog tick: what to do when nothing
        progressed (no completion, no swap) since ``last_progress_ns``.
        ``waiting_for(rank)`` is what the rank waits for, None when it waits
        for no known operation. Lazy: the shell carries out each step (and
        ``retry``) before the next is decided."""
        ...


@dataclass(frozen=True, slots=True)
class Rescue:
    """One step of a rescue after ``quiet_ns`` without progress: ``rank``
    restored (None: pins of blocked ranks dropped so that a held-back grant
    goes), by ``actions``."""

    rank: int | None
    quiet_ns: int
    actions: tuple[Action, ...]


class NoSwap:
    """CPU: every rank stays where it is; slots only bound concurrency."""

    def pick(self, queue: Sequence[int], sched: Scheduler) -> int | None:
        return 0

    def before_grant(self, rank: int, sched: Scheduler) -> list[Action]:
        return []

    def on_release(self, rank: int, sched: Scheduler) -> list[Action]:
        return []

    def on_finish(self, rank: int, sched: Scheduler) -> list[Action]:
        return []

    def returning(self, rank: int) -> None:
        pass

    def wake(self, rank: int, sched: Scheduler, pin: bool = True) -> list[Action]:
        return []

    def taken(self, rank: int, sched: Scheduler) -> list[Action]:
        return []

    def unpin_blocked(self, sched: Scheduler) -> list[Action]:
        return []

    def retry(self, sched: Scheduler) -> list[Action]:
        return []

    def is_resident(self, rank: int) -> bool:
        return True

    def rescue(self, now: int, last_progress_ns: int, waiting_for: Callable[[int], object | None],
               sched: Scheduler) -> Iterator[Rescue]:
        return iter(())


class ResidentLimit(NoSwap):
    """GPU: at most ``max_resident`` ranks keep their state on the device.

    A rank about to be granted is swapped in if it is not resident; to make
    room, the resident rank that blocked longest ago (least recently run, and
    not running) is swapped out first. A finished rank leaves residency
    without a swap (its memory is simply freed). ``max_resident`` must be at
    least the scheduler's slot count, or running ranks could not all be
    resident. It swaps only around grants: a blocked rank that receives data
    stays out until it asks for a slot, so the other hooks are ``NoSwap``'s.
    """

    def __init__(self, max_resident: int):
        if max_resident < 1:
            raise ValueError(f"max_resident must be at least 1, got {max_resident}")
        self.max_resident = max_resident
        #: Resident ranks, least recently run first.
        self.resident: OrderedDict[int, None] = OrderedDict()

    def before_grant(self, rank: int, sched: Scheduler) -> list[Action]:
        if rank in self.resident:
            self.resident.move_to_end(rank)
            return []
        actions: list[Action] = []
        while len(self.resident) >= self.max_resident:
            victim = next((r for r in self.resident if sched.state(r) == RankState.BLOCKED), None)
            if victim is None:
                victim = next((r for r in self.resident if sched.state(r) != RankState.RUNNING), None)
            if victim is None:
                raise SchedulerError(
                    f"all {len(self.resident)} resident ranks are running; max_resident "
                    f"({self.max_resident}) must be at least the slot count ({sched.slots})")
            del self.resident[victim]
            actions.append(SwapOut(victim))
        self.resident[rank] = None
        # A rank's first grant has no saved state to bring back.
        if rank in sched.started:
            actions.append(SwapIn(rank))
        return actions

    def on_finish(self, rank: int, sched: Scheduler) -> list[Action]:
        self.resident.pop(rank, None)
        return []

    def is_resident(self, rank: int) -> bool:
        return rank in self.resident


class Scheduler:
    """``slots`` slots shared by ``ranks``; see the module docstring."""

    def __init__(self, slots: int, ranks: Iterable[int], policy: SwapPolicy | None = None,
                 nodes: Mapping[int, int] | None = None, node_slots: Sequence[int] | None = None):
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if (nodes is None) != (node_slots is None):
            raise ValueError("give both nodes (rank -> node) and node_slots, or neither")
        if node_slots is not None and (min(node_slots, default=0) < 1):
            raise ValueError(f"every node needs at least 1 slot, got {list(node_slots)}")
        self.slots = slots
        #: Ranks served by agents: rank -> node, and each node's own slots
        #: (a node's cores are its own; a free slot elsewhere does not help).
        self.nodes = dict(nodes) if nodes is not None else None
        self.node_slots = list(node_slots) if node_slots is not None else None
        self._node_busy = [0] * len(self.node_slots or ())
        self.policy: SwapPolicy = policy if policy is not None else NoSwap()
        self._state: dict[int, RankState] = {r: RankState.STARTING for r in ranks}
        self._queue: deque[int] = deque()
        #: Ranks holding a slot, in grant order.
        self.running: list[int] = []
        #: Ranks that have been granted at least once.
        self.started: set[int] = set()

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every scheduled rank, in the order given."""
        return tuple(self._state)

    @property
    def waiting(self) -> tuple[int, ...]:
        """Ranks waiting for a slot, first in line first."""
        return tuple(self._queue)

    def state(self, rank: int) -> RankState:
        try:
            return self._state[rank]
        except KeyError:
            raise SchedulerError(f"rank {rank} is not scheduled here; known ranks: "
                                 f"{min(self._state, default=None)}..{max(self._state, default=None)}") from None

    def request(self, rank: int) -> list[Action]:
        """``rank`` wants to compute. A rank already waiting or running is
        left as it is (a request may cross an ``unblock``)."""
        st = self.state(rank)
        if st in (RankState.WAITING, RankState.RUNNING):
            return []
        if st == RankState.FINISHED:
            raise SchedulerError(f"rank {rank} asked for a slot after it finished; "
                                 "this is a Prism bug, please report it")
        self._state[rank] = RankState.WAITING
        self._queue.append(rank)
        return self._fill()

    def unblock(self, rank: int) -> list[Action]:
        """What ``rank`` blocked in has completed: it may go on (same as a request)."""
        return self.request(rank)

    def release(self, rank: int) -> list[Action]:
        """``rank`` is about to block: its slot goes to the next waiting rank."""
        st = self.state(rank)
        if st == RankState.WAITING:
            # It blocked again before its grant arrived: it no longer needs one.
            self._queue.remove(rank)
            self._state[rank] = RankState.BLOCKED
            return []
        if st != RankState.RUNNING:
            raise SchedulerError(f"rank {rank} released a slot it does not hold (state "
                                 f"{st.value}); this is a Prism bug, please report it")
        self._leave(rank)
        self._state[rank] = RankState.BLOCKED
        return self.policy.on_release(rank, self) + self._fill()

    def finish(self, rank: int) -> list[Action]:
        """``rank`` ended (normally or not): it leaves the schedule."""
        st = self.state(rank)
        if st == RankState.FINISHED:
            return []
        if st == RankState.RUNNING:
            self._leave(rank)
        elif st == RankState.WAITING:
            self._queue.remove(rank)
        self._state[rank] = RankState.FINISHED
        return self.policy.on_finish(rank, self) + self._fill()

    def poke(self) -> list[Action]:
        """Grant free slots again (the policy's state changed: a rank it held
        the GPU for no longer needs it)."""
        return self._fill()

    def _leave(self, rank: int) -> None:
        self.running.remove(rank)
        if self.nodes is not None:
            self._node_busy[self.nodes[rank]] -= 1

    def _fill_nodes(self) -> list[Action]:
        """Grant each rank only from its own node's slots (a rank whose node
        is full lets the ones behind it from other nodes by), in the order the
        policy picks among the ranks whose node has a free slot (FIFO but for
        a swap policy's preferences, as ``_fill``)."""
        actions: list[Action] = []
        assert self.nodes is not None and self.node_slots is not None
        while self._queue and len(self.running) < self.slots:
            eligible = [r for r in self._queue if self._node_busy[self.nodes[r]] < self.node_slots[self.nodes[r]]]
            if not eligible:
                break
            i = self.policy.pick(eligible, self)
            if i is None:
                break  # the policy holds the slots back; ``poke`` retries
            rank = eligible[i]
            node = self.nodes[rank]
            self._queue.remove(rank)
            actions += self.policy.before_grant(rank, self)
            self._state[rank] = RankState.RUNNING
            self.running.append(rank)
            self._node_busy[node] += 1
            self.started.add(rank)
            actions.append(Grant(rank))
        return actions

    def _fill(self) -> list[Action]:
        if self.nodes is not None:
            return self._fill_nodes()
        actions: list[Action] = []
        while self._queue and len(self.running) < self.slots:
            # A policy may grant out of FIFO order (GangResidency: resident ranks first, bounded).
            i = self.policy.pick(self._queue, self)
            if i is None:
                # The policy holds the slot back (GangResidency: room is
                # about to be asked for by ranks it keeps); ``poke`` retries.
                break
            rank = self._queue[i]
            del self._queue[i]
            actions += self.policy.before_grant(rank, self)
            self._state[rank] = RankState.RUNNING
            self.running.append(rank)
            self.started.add(rank)
            actions.append(Grant(rank))
        return actions
