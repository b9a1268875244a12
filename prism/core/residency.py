"""Gang-aware GPU residency: the swap policy of a capture on GPUs (sans-IO).

Each physical GPU holds at most ``max_resident`` ranks' state at once; the
others are checkpointed to host memory (``prism.shell.swap``). Ranks are grouped in
*gangs* (vocabulary in ``prism/__init__.py``): ranks that communicate densely,
such as a TP group or a whole pipeline, enter and leave the GPU together, so
their collectives complete without a swap in between.

The policy plugs into ``prism.core.scheduler.Scheduler`` as its
``SwapPolicy``. Besides the scheduler's hooks it has one event of its own,
``wake(rank)``: the coordinator calls it when it delivers data (a collective
result, a point-to-point message) to a rank. A checkpointed process's CUDA
calls block until it is restored, and a rank copies delivered data onto its
GPU before it asks for a slot again, so a checkpointed rank that receives
data must be restored without waiting for its request, or it never makes
one. A woken rank (resident or brought back) is *pinned* (evicted only when nothing else can go) until
it is granted, blocks again, or says it took the data in and still waits
(``taken(rank)``: the coordinator calls it on the rank's ``Taken``); if room cannot be made at once the wake waits
in a queue that ``retry(sched)`` serves after every scheduler event.

Choosing what to evict: the least recently granted gang on that GPU whose
resident members are all blocked (none running, pinned or waiting for a
slot); failing that, for a grant only, one with members waiting for a slot,
then one with a pinned member (that member's wake is queued again, so it
comes back); a gang with a running member is never evicted. A rank granted
for the first time has no saved state and needs no ``SwapIn``.

Granting order (``pick``, which the scheduler consults): a waiting rank that
is already resident goes first, so a gang finishes its work between two
collectives before the GPU changes hands; then the first in line whose gang
fits without evicting a pinned rank; otherwise the slot is held back until
the pinned ranks ask for it or say ``Taken`` (the policy pokes the
scheduler). A resident gang leaves the GPU when all its ranks block, so
every waiting rank is granted in the end.

Rescue (``rescue``, called on the coordinator's watchdog tick): after
``RESCUE_QUIET_NS`` without a completion or a swap, pins of blocked ranks are
dropped if ranks wait for a slot, then checkpointed ranks that wait for no
known operation are restored without a pin. Sans-IO: time and the matcher's
view (``waiting_for(rank)``) come in as arguments; the coordinator carries out
the actions.

Public API: ``GangResidency(max_resident, gang_of=None, gpu_of=None)``, a
complete ``SwapPolicy`` (``pick``, ``before_grant``, ``on_release``,
``on_finish``, ``returning``, ``wake(rank, sched, pin=True)``, ``taken``,
``unpin_blocked``, ``retry``, ``is_resident``, ``rescue``) plus
``resident(gpu=None)``; ``RESCUE_QUIET_NS``; ``megatron_gangs(world_size,
tp, dp, pp, kind)``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence

from prism.core.scheduler import Action, RankState, Rescue, Scheduler, SchedulerError, SwapIn, SwapOut

#: With ranks checkpointed, this long without progress (nor a swap) restores
#: them (``GangResidency.rescue``): well above one swap (about 1 s per GB out).
RESCUE_QUIET_NS = 5_000_000_000

GANG_KINDS = ("1", "tp", "tpxpp")


def megatron_gangs(world_size: int, tp: int, dp: int, pp: int, kind: str) -> dict[int, int]:
    """``rank -> gang id`` for the Megatron layout ``rank = tp_rank + TP *
    (dp_rank + DP * pp_rank)`` (docs/DESIGN.md): ``"1"`` one rank per gang, ``"tp"``
    the TP groups, ``"tpxpp"`` the TP groups of one pipeline (all ranks with
    the same dp_rank)."""
    if tp * dp * pp != world_size:
        raise ValueError(f"layout tp {tp} x dp {dp} x pp {pp} = {tp * dp * pp} ranks, but the world has "
                         f"{world_size}; give --tp/--dp/--pp that multiply to the world size")
    if kind == "1":
        return {r: r for r in range(world_size)}
    if kind == "tp":
        return {r: r // tp for r in range(world_size)}
    if kind == "tpxpp":
        return {r: (r // tp) % dp for r in range(world_size)}
    raise ValueError(f"gang kind {kind!r}: expected one of {', '.join(GANG_KINDS)}")


class GangResidency:
    """At most ``max_resident`` ranks resident per GPU, gangs kept together.

    ``gang_of`` maps rank -> gang id (default: every rank its own gang);
    ``gpu_of`` rank -> physical GPU (default: all on GPU 0). A gang must lie
    on one GPU and fit in ``max_resident``.
    """

    def __init__(self, max_resident: int, gang_of: Mapping[int, int] | None = None,
                 gpu_of: Mapping[int, int] | None = None) -> None:
        if max_resident < 1:
            raise ValueError(f"--resident must be at least 1, got {max_resident}")
        self.max_resident = max_resident
        self.gang_of: Mapping[int, int] = gang_of if gang_of is not None else {}
        self.gpu_of: Mapping[int, int] = gpu_of if gpu_of is not None else {}
        self.members: dict[int, list[int]] = {}
        for rank, gang in self.gang_of.items():
            self.members.setdefault(gang, []).append(rank)
        for gang, ranks in self.members.items():
            gpus = {self._gpu(r) for r in ranks}
            if len(gpus) > 1:
                raise ValueError(f"gang {gang} (ranks {sorted(ranks)}) spans GPUs {sorted(gpus)}: a gang must "
                                 "share one GPU; choose a smaller gang or fewer GPUs")
            if len(ranks) > max_resident:
                raise ValueError(f"gang {gang} has {len(ranks)} ranks but --resident is {max_resident}: "
                                 "raise --resident to at least the gang size or choose a smaller gang")
        #: Per GPU: resident ranks, least recently granted gang first.
        self._resident: dict[int, OrderedDict[int, None]] = {}
        self.pinned: set[int] = set()
        self._wakes: deque[int] = deque()
        self._returning: set[int] = set()
        #: When ``rescue`` last acted on a quiet spell.
        self._rescued_ns = 0

    # --- queries -------------------------------------------------------------

    def _gpu(self, rank: int) -> int:
        return self.gpu_of.get(rank, 0)

    def _gang(self, rank: int) -> list[int]:
        gang = self.gang_of.get(rank)
        return self.members[gang] if gang is not None else [rank]

    def resident(self, gpu: int | None = None) -> list[int]:
        """Resident ranks (of one GPU, or of all), least recently granted first."""
        if gpu is not None:
            return list(self._resident.get(gpu, ()))
        return [r for res in self._resident.values() for r in res]

    def is_resident(self, rank: int) -> bool:
        return rank in self._resident.get(self._gpu(rank), ())

    # --- SwapPolicy ----------------------------------------------------------

    def before_grant(self, rank: int, sched: Scheduler) -> list[Action]:
        self.pinned.discard(rank)
        actions = self._bring_in(rank, sched, for_grant=True)
        if actions is None:
            raise SchedulerError(
                f"rank {rank}: no room on GPU {self._gpu(rank)} (--resident {self.max_resident}, resident "
                f"{self.resident(self._gpu(rank))}, running {sched.running}); --resident must be at least the "
                "gang size times the ranks that may run at once on a GPU")
        res = self._resident[self._gpu(rank)]
        for m in self._gang(rank):
            if m in res:
                res.move_to_end(m)
        return actions

    def on_release(self, rank: int, sched: Scheduler) -> list[Action]:
        if rank in self._returning:
            # Its wait ended before it released (the result crossed the
            # release): it asks again at once, so it keeps its GPU.
            self._returning.discard(rank)
            self.pinned.add(rank)
        else:
            self.pinned.discard(rank)
        return []

    def returning(self, rank: int) -> None:
        """``rank`` is about to release its slot although what it waits for
        has already completed: pin it when it does."""
        self._returning.add(rank)

    def on_finish(self, rank: int, sched: Scheduler) -> list[Action]:
        # A finished rank's memory is freed when its process exits: no swap.
        self._resident.get(self._gpu(rank), OrderedDict()).pop(rank, None)
        self.pinned.discard(rank)
        if rank in self._wakes:
            self._wakes.remove(rank)
        return []

    def pick(self, queue: Sequence[int], sched: Scheduler) -> int | None:
        """Which waiting rank to grant: the first one that is resident (no
        swap needed); else the first whose gang can come in without evicting
        a pinned rank (one that just got data and is about to ask for a slot:
        evicting it now would swap it straight back); else none for now (the
        pinned ranks ask, or say ``Taken``, and the coordinator pokes the
        scheduler). Every rank is granted in the end: a resident gang leaves
        the GPU when all of its ranks block."""
        for i, rank in enumerate(queue):
            if self.is_resident(rank):
                return i
        for i, rank in enumerate(queue):
            if self._fits_without_pinned(rank, sched):
                return i
        return None

    def _fits_without_pinned(self, rank: int, sched: Scheduler) -> bool:
        gpu = self._gpu(rank)
        res = self._resident.get(gpu, OrderedDict())
        own = self.gang_of.get(rank, ("rank", rank))
        need = 1 + sum(1 for m in self._gang(rank) if m != rank and m not in res and m in sched.started
                       and sched.state(m) != RankState.FINISHED)
        free = self.max_resident - len(res)
        if free >= need:
            return True
        for m in res:
            if (self.gang_of.get(m, ("rank", m)) != own and m not in self.pinned
                    and sched.state(m) != RankState.RUNNING
                    and not any(x in self.pinned or sched.state(x) == RankState.RUNNING
                                for x in self._gang(m) if x in res)):
                free += 1
        return free >= 1

    # --- wakes -------------------------------------------------------------

    def wake(self, rank: int, sched: Scheduler, pin: bool = True) -> list[Action]:
        """Data was delivered to ``rank``: bring it back if it is checkpointed.
        ``pin=False`` (the coordinator's rescue of a rank that may still have
        work): bring it back if there is room now, without pinning it."""
        if sched.state(rank) != RankState.BLOCKED or rank not in sched.started:
            return []
        if self.is_resident(rank):
            if pin:
                # It needs its GPU to take the data in: not the next one to go.
                self.pinned.add(rank)
            return []
        actions = self._bring_in(rank, sched, for_grant=False)
        if actions is None:
            if pin and rank not in self._wakes:
                self._wakes.append(rank)
            return []
        if pin:
            self.pinned.add(rank)
        return actions

    def taken(self, rank: int, sched: Scheduler) -> list[Action]:
        """``rank`` took its data in and still waits: it may go again (and
        a grant held back for it may go ahead)."""
        self.pinned.discard(rank)
        return sched.poke()

    def unpin_blocked(self, sched: Scheduler) -> list[Action]:
        """The coordinator's last resort after a quiet spell: forget the pins
        of blocked ranks (a rank that never asks again would otherwise hold
        back a grant for ever) and grant what can go."""
        stale = {r for r in self.pinned if sched.state(r) == RankState.BLOCKED}
        self.pinned -= stale
        return sched.poke() if stale else []

    def retry(self, sched: Scheduler) -> list[Action]:
        """Serve the queued wakes that fit now."""
        actions: list[Action] = []
        for _ in range(len(self._wakes)):
            rank = self._wakes.popleft()
            actions += self.wake(rank, sched)
        return actions

    def rescue(self, now: int, last_progress_ns: int, waiting_for: Callable[[int], object | None],
               sched: Scheduler) -> Iterator[Rescue]:
        """After ``RESCUE_QUIET_NS`` without progress (``last_progress_ns``:
        the last completion or swap), bring checkpointed ranks back as if
        data had reached them. A rank can be released without being blocked
        in communication (the stall monitor judges by CPU use; a GPU wait
        looks the same), and a checkpointed rank that still had work to do
        would otherwise hang the capture. First, if ranks wait for a slot,
        the pins of blocked ranks are dropped (a grant held back for a pinned
        rank that never asked again). A rescue counts as progress: the next
        one comes a quiet period later."""
        quiet = now - max(last_progress_ns, self._rescued_ns)
        if quiet < RESCUE_QUIET_NS:
            return
        self._rescued_ns = now
        if sched.waiting and (actions := self.unpin_blocked(sched)):
            yield Rescue(None, quiet, tuple(actions))
        for rank in sched.ranks:
            # Only checkpointed ranks that wait for no known operation (those
            # come back when their data arrives). A rescued rank is not pinned:
            # if it has nothing to do after all, it may go out again.
            if self.is_resident(rank) or waiting_for(rank) is not None:
                continue
            if (actions := self.wake(rank, sched, pin=False)):
                yield Rescue(rank, quiet, tuple(actions))

    # --- making room ---------------------------------------------------------

    def _bring_in(self, rank: int, sched: Scheduler, *, for_grant: bool) -> list[Action] | None:
        gpu = self._gpu(rank)
        res = self._resident.setdefault(gpu, OrderedDict())
        mates = [m for m in self._gang(rank) if m != rank and m not in res and m in sched.started
                 and sched.state(m) != RankState.FINISHED]
        want = ([] if rank in res else [rank]) + mates
        actions: list[Action] = []
        while want and len(res) + len(want) > self.max_resident:
            victims = self._victims(gpu, rank, sched, allow_pinned=for_grant)
            if victims is None:
                # Room for the rank itself is what matters; mates follow
                # later (each brings itself in when it is granted).
                if want[0] != rank:  # the rank is resident: only mates were wanted
                    return actions
                if len(want) > 1:
                    want = want[:1]
                    continue
                return None
            for v in victims:
                del res[v]
                actions.append(SwapOut(v))
                if v in self.pinned:
                    self.pinned.discard(v)
                    if v not in self._wakes:
                        self._wakes.append(v)
        for m in want:
            res[m] = None
            if m in sched.started:
                actions.append(SwapIn(m))
        return actions

    def _victims(self, gpu: int, rank: int, sched: Scheduler, *, allow_pinned: bool) -> list[int] | None:
        """The resident members of the gang to evict, or None. A gang with a
        running member never goes. An idle gang (every member blocked) goes
        first; a gang with members waiting for a slot only for a grant (they
        would be swapped straight back in; a wake waits for an idle gang
        instead). Only a grant may evict a pinned rank: two wakes evicting
        each other would never end."""
        res = self._resident[gpu]
        own = self.gang_of.get(rank, ("rank", rank))
        busy = pinned = None
        seen: set = set()
        for r in res:
            gang = self.gang_of.get(r, ("rank", r))
            if gang in seen or gang == own:
                continue
            seen.add(gang)
            members = [m for m in res if self.gang_of.get(m, ("rank", m)) == gang]
            states = [sched.state(m) for m in members]
            if RankState.RUNNING in states:
                continue
            if any(m in self.pinned for m in members):
                pinned = pinned or members
                continue
            if RankState.WAITING in states:
                busy = busy or members
                continue
            return members
        if not allow_pinned:
            return None
        return busy or pinned
