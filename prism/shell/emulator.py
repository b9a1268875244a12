"""The coordinator in hybrid mode: real sandbox ranks against the graph's virtual ranks.

``Emulator`` is the phase-1 ``Coordinator`` (the socket, the rank sessions,
their traces, the launcher, failure handling and stopping) with the matcher
replaced by the core's hybrid engine (``prism.core.hybrid.HybridReplay``):
only the sandbox ranks are processes; every other rank of the world is a
virtual rank inside the engine. A sandbox's call is fed to the engine as it
arrives (at the rank's own ``issue_ns``); what the graph does not have there
stops the emulation (``Mismatch``: rank, op, group, sequence, what the graph
expected).

Time: every time a sandbox sends is taken onto the coordinator's clock as
it arrives (``clock_offsets``: 0 on one host, where CLOCK_MONOTONIC is one
clock; for a sandbox on another node, served by ``prism agent``: the offset
the rank measured with its clock probes right after its Welcome and sent in
``ClockOffset``, protocol 9, ``prism.core.clocksync``; with the probes off,
``PRISM_CLOCK_PROBES=0``, the coordinator's clock when it took a message
less the rank's when it sent it, the least of that for the Hello and the
rank's first timed message, whose clock has no dilation yet: too late by
one message's transit and its wait in a loop that is idle then, a constant
per rank; the Hello's alone was seen 90 ms late, its connect and handshake
included), and each release goes out
on the rank's own clock. The engine's 0 is placed so that the first
sandbox arrival falls where the batch replay puts it (``_anchor``); emulated
time and the coordinator's clock then differ by that one offset. A call's data go out when
the engine knows its completion (a collective's last arrival plus the cost
model's time; a receive's transfer), held in a heap until ``LEAD_NS``
before that moment on trio's clock and sent with ``release_ns``: the rank's
completion thread holds the result until then (``prism.rank.backend``), so
the release is exact to well under a millisecond although trio's timers are
not. The engine works ahead between events (``work_ahead``, exact).

Data: a collective among sandbox members exchanges their real tensors; the
virtual members' part comes from the capture's recording (``--record``) when
every sandbox member sent what the capture recorded for that call (then the
recorded outputs are exactly what the full job computes), else from
compensation (``prism.core.compensation.hybrid_outputs``). A receive from a
virtual rank gets the recorded tensor, else zeros of its shape.

Groups: a sandbox's group is the graph's group with the same members and
the same place among the groups of those members in creation order
(``prism.core.groupmatch``), not the one with the same id: a scaled-out
graph's ids follow the scale-out's guess of the script's creation order.
Messages from a sandbox are translated into the graph's ids on arrival, its
results back into its own.

Waits: a sandbox that passed an async op's wait without blocking sends no
``Wait``; the graph's wait node is then passed when the rank's next call
shows it went on (at the op's delivery, or the call's time if later).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from prism.core import collectives as C
from prism.core import payloads as PL
from prism.core import protocol as P
from prism.core.compensation import hybrid_outputs
from prism.core.graph import COLL, WAIT
from prism.core.groupmatch import GroupMatcher
from prism.core.hybrid import Call, HybridError, HybridReplay
from prism.core.matcher import wait_key_coll
from prism.shell import runfolder
from prism.shell.coordinator import Coordinator, Processes, Progress, RankSession

log = logging.getLogger("prism.shell.emulator")

#: Results go out this long before their release and wait in the rank.
LEAD_NS = 3_000_000
#: Collectives whose sizes follow the data (MoE token dispatch): a size other
#: than the capture's is noted, not a mismatch.
_DATA_SIZED = frozenset({"all_to_all_single", "all_to_all"})
#: Engine events per turn of the loop (the loop stays responsive), in slices of SLICE.
WORK_BUDGET = 20_000
SLICE = 256
#: "1": release a device-path collective before its reach where the engine
#: knows its completion (``Emulator._release_early``). Off by default: on an
#: H100 (2026-12-06, GPT tp2) it ran the sandbox 25% faster in wall time but
#: left the host as the bottleneck, and the emulated time moved with the CPU
#: (compensated GPT tp2: +2.4% to +11.5% of the capture's prediction over four
#: runs, against +1.3% and +2.1% with the release at the reach in the same
#: calls); ``bench/results/gpu_sandbox-2026-12-06-h100.md``.
EARLY_RELEASE_ENV = "PRISM_EARLY_RELEASE"


@dataclass(frozen=True, slots=True)
class Due:
    """The pacer's wake-up: a release is due, or the engine has work left."""


@dataclass
class Recording:
    """A capture's recorded payloads for one rank: ``(role, ref) -> Payload``."""

    index: dict[tuple[str, str], Any]
    load: Callable[[Any], bytes]


@dataclass
class EmulationStats:
    """What the emulator measured of itself."""

    deliveries: int = 0
    recorded_calls: int = 0
    compensated_calls: int = 0
    #: of the compensated, formed on a GPU sandbox's device (``CollectiveArrive.on_device``)
    device_calls: int = 0
    #: sends to virtual ranks whose data stayed on a GPU sandbox's device (``Send.on_device``)
    device_sends: int = 0
    #: collectives the sandbox members ran among themselves (``CollectiveArrive.pruned``, ``--pruned``)
    pruned_calls: int = 0
    #: rank -> the first call where it sent something other than the recording
    divergence: dict[int, str] = field(default_factory=dict)
    groups_created: set[str] = field(default_factory=set)
    implicit_waits: int = 0
    #: sandbox rank -> the first data-sized call whose size differed from the capture's
    resized: dict[int, str] = field(default_factory=dict)
    #: sandbox rank -> Prism's own delay in its waits, taken out of its emulated clock (at its goodbye)
    dilation_ns: dict[int, int] = field(default_factory=dict)
    #: ns from taking a sandbox's call to its result going out
    turnaround_ns: list[int] = field(default_factory=list)
    #: device-path calls whose arrival is the GPU's reach (``P.Reached``), and
    #: per such call how far the stream reached it after the CPU issued it (ns)
    reached_calls: int = 0
    reach_lag_ns: list[int] = field(default_factory=list)
    #: of those, the calls (collectives, sends, receives) whose arrival came at the reach with it (protocol 12)
    arrived_with_reach: int = 0
    #: ns each result went out after its emulated release on its rank's clock (negative: ahead;
    #: the rank holds it until then); positive lag is a wait the rank's dilated clock absorbs
    lag_ns: list[int] = field(default_factory=list)
    #: sandbox groups whose id differs from the graph's group they were matched to
    renamed_groups: int = 0
    #: device-path collectives released before their reach came (``Emulator._release_early``),
    #: and of those, how many the engine then completed at another time than released (a bug if any)
    early_releases: int = 0
    early_off: int = 0
    #: device-path collectives' round trip through the coordinator (host monotonic ns): per
    #: ``(rank, the rank's gid, seq)`` when its ``Reached`` came in and when its result went out
    #: (kept only where ``keep_trips``: the call log is on, ``PRISM_DEVICE_CALL_LOG``)
    keep_trips: bool = False
    reach_in_ns: dict[tuple[int, str, int], int] = field(default_factory=dict)
    trips: list[dict] = field(default_factory=list)
    #: sandbox ranks whose release flags the coordinator maps (``P.ReleaseShared``), and the
    #: device-path collectives it released by writing their flag there
    shared_release_ranks: list[int] = field(default_factory=list)
    shared_releases: int = 0


class Emulator(Coordinator):
    """Serves one emulation of ``engine.graph``'s world with the sandbox ranks
    ``engine.sandbox`` as processes; traces and logs go to ``run_dir``
    (``RUN/emulation/<id>``). ``recordings``: per sandbox rank, its recorded
    payloads from the capture (missing: compensated)."""

    def __init__(self, run_dir, engine: HybridReplay, *, endpoint: str,
                 recordings: Mapping[int, Recording] | None = None,
                 launch: Callable[[str], Processes] | None = None, quiet_s: float = 30.0,
                 grace_s: float = 3.0, progress: Progress | None = None,
                 first_call_ns: Mapping[int, int] | None = None, stop_signals: Sequence[int] = (),
                 curve_keys: Any = None, authenticated: bool = False) -> None:
        # curve_keys/authenticated: sandboxes started by ``prism agent`` on
        # other nodes reach the socket over tcp, as a capture's ranks do.
        super().__init__(run_dir, engine.graph.world_size, slots=max(len(engine.sandbox), 1), endpoint=endpoint,
                         quiet_s=quiet_s, grace_s=grace_s, launch=launch, progress=progress,
                         stop_signals=stop_signals, curve_keys=curve_keys, authenticated=authenticated)
        self.hybrid = True
        self.what = "emulation"
        self.rank_word = "sandbox rank"
        self.engine = engine
        self.graph = engine.graph
        self.sandbox = frozenset(engine.sandbox)
        self.recordings = dict(recordings or {})
        self.stats = EmulationStats()
        #: where the batch replay starts each sandbox rank's first call (the anchor)
        self._first_call_ns = dict(first_call_ns or {})
        #: coordinator ns (the ranks' monotonic clock on one host) = engine ns + offset (None until the first arrival)
        self.offset_ns: int | None = None
        #: sandbox rank -> coordinator ns less the rank's monotonic ns (0 on one host; the Hello's
        #: estimate until the rank's ClockOffset, or without probes its first timed message, fixes it)
        self.clock_offsets: dict[int, int] = {}
        self._clock_fixed: set[int] = set()
        self._gid_index = {grp.gid: i for i, grp in enumerate(self.graph.groups)}
        self.groups = GroupMatcher((grp.gid, grp.ranks) for grp in self.graph.groups)
        #: sandbox rank -> its monotonic clock less its dilated one, as its last call showed
        self._dilation: dict[int, int] = {}
        #: per sandbox rank, what it sent that the engine has not taken yet
        self._queue: dict[int, collections.deque] = {r: collections.deque() for r in self.sandbox}
        #: (gid, seq) -> group rank -> the sandbox member's CollectiveArrive
        self._calls: dict[tuple[str, int], dict[int, P.CollectiveArrive]] = {}
        #: outputs computed for an instance, by group rank, until every sandbox member took its own
        self._outputs: dict[tuple[str, int], dict[int, list[Any]]] = {}
        #: (gid, seq) -> whether every sandbox member's inputs matched the recording
        self._on_record: dict[tuple[str, int], bool] = {}
        #: (src, dst, tag, pseq) -> a sandbox's send to another sandbox
        self._sent: dict[tuple[int, int, int, int], P.Send] = {}
        #: engine node -> (rank, what to deliver once its end is known)
        self._await_end: dict[int, tuple[int, tuple]] = {}
        #: engine node -> engine time its data were delivered (for implicit waits)
        self._delivered_at: dict[int, int] = {}
        #: (release ns on the rank's dilated clock, tie, rank, message, engine node)
        self._heap: list[tuple[int, int, int, P.Message, int]] = []
        self._tie = 0
        self._due_at = math.inf
        self._rearm = trio.Event()
        self._finished_ranks: set[int] = set()
        #: engine node -> when the coordinator took the sandbox's call (for the turnaround figure)
        self._taken_at: dict[int, int] = {}
        #: (rank, gid, seq) -> the reach (rank's dilated ns) of a device-path call not yet fed to the engine
        self._reach: dict[tuple[int, str, int], int] = {}
        #: (rank, gid, seq) -> (after, cost) of a device-path collective released early
        self._early: dict[tuple[int, str, int], tuple[int, int]] = {}
        self._early_on = os.environ.get(EARLY_RELEASE_ENV, "0") == "1"
        #: rank -> its shared release flags (``P.ReleaseShared``, ``transport.shared_release``), and
        #: (rank, the graph's gid, seq) -> (slot, value) of a device-path collective waiting on one
        self._shared: dict[int, Any] = {}
        self._slots: dict[tuple[int, str, int], tuple[int, int]] = {}
        self._last_activity = 0
        self._message_handlers.update({
            P.CollectiveArrive: self._on_coll,
            P.Reached: self._on_reached,
            P.ReleaseShared: self._on_release_shared,
            P.Send: self._on_send,
            P.RecvPost: self._on_recv,
            P.Wait: self._on_wait,
            P.GroupCreate: self._on_group,
            P.SlotRequest: self._on_slot_request,
            P.SlotRelease: self._ignore,
            P.Taken: self._ignore,
        })
        self._event_handlers[Due] = self._on_due

    # --- the pacer (replaces the coordinator's tick task) ---------------------

    async def _tick(self, out) -> None:
        from prism.shell.coordinator import Tick

        async with out:
            next_tick = trio.current_time() + 0.5
            while True:
                self._rearm = trio.Event()
                with trio.move_on_at(min(next_tick, self._due_at)):
                    await self._rearm.wait()
                now = trio.current_time()
                if now >= self._due_at:
                    self._due_at = math.inf
                    await out.send(Due())
                if now >= next_tick:
                    next_tick = now + 0.5
                    await out.send(Tick())

    def _finished_message(self) -> str:
        n = len(self.sandbox)
        return f"all {n} sandbox rank{'s' if n != 1 else ''} finished (of a world of {self.world_size})"

    def _wake_at(self, when_s: float) -> None:
        if when_s < self._due_at:
            self._due_at = when_s
            self._rearm.set()

    def _mono_to_trio(self, mono_ns: int) -> float:
        return self._anchor_s + (mono_ns - self._anchor_ns) / 1e9

    # --- sessions -----------------------------------------------------------------

    async def _on_hello(self, identity: bytes, hello: P.Hello, now: int) -> None:
        if hello.rank not in self.sandbox and 0 <= hello.rank < self.world_size:
            await self._reply(identity, P.Error(
                "bad_message", f"rank {hello.rank} is not a sandbox rank of this emulation (sandbox: "
                f"{sorted(self.sandbox)}): a launch of the full world is using an emulation's coordinator",
                rank=hello.rank))
            return
        await super()._on_hello(identity, hello, now)
        session = self.sessions.get(hello.rank)
        if session is not None and session.identity == identity:
            self.clock_offsets[hello.rank] = session.clock_offset_ns
            if not session.clock_offset_ns:
                self._clock_fixed.add(hello.rank)  # one host: one clock

    async def _on_clock_offset(self, session: RankSession, msg: P.ClockOffset, now: int) -> None:
        await super()._on_clock_offset(session, msg, now)
        # the rank's probes measured it (protocol 9): its first timed message cannot do better
        self.clock_offsets[session.rank] = session.clock_offset_ns
        self._clock_fixed.add(session.rank)

    #: The fields of a sandbox's messages that are times on its clock.
    _TIMES = {P.CollectiveArrive: "issue_ns", P.Send: "issue_ns", P.RecvPost: "issue_ns", P.Wait: "t_ns",
              P.Goodbye: "t_ns", P.Reached: "reach_ns"}

    async def _on_received(self, ev, now: int) -> None:
        self._last_activity = now  # the quiet watchdog counts what the sandboxes say, not the pacer
        msg = ev.msg
        field_name = self._TIMES.get(type(msg))
        if field_name is not None and getattr(msg, field_name) and msg.rank not in self._clock_fixed \
                and msg.rank in self.clock_offsets:
            # The rank's first time: its clock has no dilation yet, so this
            # message bounds the offset as the Hello did, usually closer.
            self.clock_offsets[msg.rank] = min(self.clock_offsets[msg.rank], now - getattr(msg, field_name))
            self._clock_fixed.add(msg.rank)
        if field_name is not None and (off := self.clock_offsets.get(msg.rank, 0)) and getattr(msg, field_name):
            # onto the coordinator's clock (0 stays "not said"); an arrival sent at its reach carries
            # that time too (protocol 12)
            moved = {field_name: getattr(msg, field_name) + off}
            if getattr(msg, "reach_ns", 0):
                moved["reach_ns"] = msg.reach_ns + off
            msg = dataclasses.replace(msg, **moved)
            ev = dataclasses.replace(ev, msg=msg)
        if isinstance(msg, (P.CollectiveArrive, P.Send, P.RecvPost)):
            if msg.issue_ns:
                # the rank's dilation, and the message's transit: an upper bound (the pacing lag's
                # reference); an arrival sent at its reach (protocol 12) left then, not at its issue
                self._dilation[msg.rank] = self._now() - (msg.reach_ns or msg.issue_ns)
            gid = self.groups.to_graph(msg.rank, msg.gid)
            if gid != msg.gid:
                ev = dataclasses.replace(ev, msg=dataclasses.replace(msg, gid=gid))
        elif isinstance(msg, P.Wait) and msg.what.startswith("coll:"):
            _, gid, seq = msg.what.rsplit(":", 2)
            new = self.groups.to_graph(msg.rank, gid)
            if new != gid:
                ev = dataclasses.replace(ev, msg=dataclasses.replace(msg, what=wait_key_coll(new, int(seq))))
        await super()._on_received(ev, now)

    def _finished(self) -> bool:
        return (len(self.ranks) == len(self.sandbox) and all(r.done for r in self.ranks.values())
                and not self._heap)

    async def _ignore(self, session: RankSession, msg: P.Message, now: int) -> None:
        pass

    async def _on_slot_request(self, session: RankSession, msg: P.SlotRequest, now: int) -> None:
        # A sandbox rank runs as it would on its own device: it never waits for a slot.
        await session.deliver(P.SlotGrant(session.rank))

    async def _on_group(self, session: RankSession, msg: P.GroupCreate, now: int) -> None:
        gid = self.groups.create(msg.rank, msg.gid, msg.ranks)
        if gid is None:
            log.warning("sandbox rank %d created group %s (creation index %d, ranks %s), which the graph does not "
                        "have (no further group of these members)", msg.rank, msg.gid, msg.index, list(msg.ranks))
            gid = msg.gid
        elif gid != msg.gid:
            self.stats.renamed_groups += 1
        self.stats.groups_created.add(gid)

    async def _on_goodbye(self, session: RankSession, msg: P.Goodbye, now: int) -> None:
        rank = session.rank
        session.end(msg.status, msg.message)
        if msg.status == "ok":
            self._queue[rank].append(("end", msg, None, msg.t_ns or now))
            if msg.t_ns:
                self.stats.dilation_ns[rank] = now - msg.t_ns
            await self._pump()
            return
        self._failed[rank] = msg.message
        if msg.status == "oom":
            report = msg.message.split("\n\n", 1)[0]
            self._fail("oom", f"sandbox rank {rank} ran out of memory: {report}\n(the traceback is in "
                       f"{runfolder.log_path(self.run_dir, rank)})", 3)
        self._fail("rank_failed", f"sandbox rank {rank} failed:\n{msg.message.rstrip()}", 1)

    async def _rank_died(self, rank: int, what: str, now: int) -> None:
        pass  # no slots and no matcher: the failure itself ends the emulation

    def _watchdog(self, now: int) -> None:
        if self.progress is not None:
            steps = [r.step for r in self.ranks.values()] or [-1]
            self.progress.update(now, len(self.ranks), min(steps), max(steps), self.stats.deliveries)
        if len(self.ranks) < len(self.sandbox):
            if now - self._last_hello > self.register_stall_ns:
                missing = sorted(self.sandbox - set(self.ranks))
                self._fail("deadlock", f"only {len(self.ranks)} of {len(self.sandbox)} sandbox ranks registered; "
                           f"missing: {missing}", 1)
            return
        if self._last_activity and now - self._last_activity > self.quiet_ns and not self._heap:
            lines = []
            for r in sorted(self.sandbox):
                member = self.ranks.get(r)
                if member is None or member.done:
                    continue
                q = self._queue.get(r)
                if q and q[0][3] is None:  # its next call came, its GPU stream's reach did not
                    kind, msg, _, _ = q[0]
                    lines.append(f"sandbox rank {r} issued {kind} {getattr(msg, 'op', '')} (group "
                                 f"{getattr(msg, 'gid', '')}, seq {getattr(msg, 'seq', getattr(msg, 'pseq', ''))})"
                                 " but its GPU stream never reached it (held up before it on the GPU)")
                elif r in self.engine.computing:
                    nd, _ = self.engine.computing[r]
                    cn = self.engine.next_call_node(r, nd)
                    nxt = (self.engine._expected(cn) if cn < self.graph.rank_ptr[r + 1]
                           else "the end of its script")
                    hint = ("; a device-path call's arrival leaves when its GPU stream reaches it (protocol "
                            "12): its stream may be held up before it" if self.stats.reached_calls else "")
                    lines.append(f"sandbox rank {r} has not called anything; the graph has {nxt} next{hint}")
                else:
                    lines.append(f"sandbox rank {r} waits for its call at graph node {self.engine._pos[r]}, "
                                 "which the emulated job never completes")
            self._fail("deadlock", f"no progress for {(now - self._last_activity) / 1e9:.0f} s:\n  "
                       + "\n  ".join(lines or ["(no live sandbox rank)"]), 1)

    # --- calls --------------------------------------------------------------------

    def _group_rank(self, gid: str, rank: int) -> tuple[int, tuple[int, ...]]:
        ranks = self.graph.groups[self._gid_index[gid]].ranks if gid in self._gid_index else ()
        return (ranks.index(rank) if rank in ranks else -1), ranks

    def _check_sent(self, rank: int, key: str, payloads, n: int, role_ref, digests=None) -> bool | None:
        """Whether what ``rank`` sent equals the recording (None: nothing recorded
        for it); ``digests``: the rank's own digests of what it did not send
        (a pruned call's inputs) in place of ``payloads``."""
        rec = self.recordings.get(rank)
        if rec is None:
            return None
        same = True
        known = False
        for i, p in enumerate(payloads if digests is None else digests):
            want = rec.index.get(("sent", role_ref(i, n)))
            if want is None:
                continue
            known = True
            if (PL.digest(memoryview(p).cast("B")) if digests is None else p) != want.digest:
                same = False
                if rank not in self.stats.divergence:
                    self.stats.divergence[rank] = (
                        f"rank {rank} first sent something other than the capture at step {want.step}: "
                        f"{want.ref} ({want.dtype} {list(want.shape)}); from there its calls are compensated")
        return same if known else None

    async def _on_coll(self, session: RankSession, msg: P.CollectiveArrive, now: int) -> None:
        rank = session.rank
        key = (msg.gid, msg.seq)
        g, _ = self._group_rank(msg.gid, rank)
        if msg.on_device or (msg.pruned and not msg.in_digests):  # the data stayed with the sandbox: compensated there
            ok = False
        elif msg.pruned:  # the members ran it; with their inputs as recorded, the recorded outputs replace theirs
            same = self._check_sent(rank, msg.gid, (), len(msg.in_digests),
                                    lambda i, n: PL.coll_ref(msg.gid, msg.seq, "in", i, n), digests=msg.in_digests)
            ok = rank in self.recordings and same is not False
        else:
            same = self._check_sent(rank, msg.gid, msg.payloads, len(msg.payloads),
                                    lambda i, n: PL.coll_ref(msg.gid, msg.seq, "in", i, n))
            ok = rank in self.recordings and same is not False
        self._on_record[key] = self._on_record.get(key, True) and ok
        self._calls.setdefault(key, {})[g] = msg
        if msg.release_slot >= 0 and rank in self._shared:
            if msg.release_slot < self._shared[rank].layout.slots:
                self._slots[(rank, msg.gid, msg.seq)] = (msg.release_slot, msg.release_value)
            else:  # the rank's bug, not the run's: it still flips its own flag when the result comes
                log.warning("rank %d: %s on group %s (seq %d) names release slot %d, its file has %d; released "
                            "through the message", rank, msg.op, msg.gid, msg.seq, msg.release_slot,
                            self._shared[rank].layout.slots)
        # A device-path call whose reach follows waits in the queue (and holds
        # the rank's later calls behind it) until ``Reached`` gives its arrival,
        # or came with it (``reach_ns``, protocol 12: sent at the reach).
        self._note_reach(rank, msg)
        t = None if msg.reach_follows else (msg.issue_ns or now)
        self._queue[rank].append(("coll", msg, Call("coll", msg.op, msg.gid, msg.seq), t))
        await self._pump()

    async def _on_release_shared(self, session: RankSession, msg: P.ReleaseShared, now: int) -> None:
        from transport.shared_release import SharedRelease

        try:
            self._shared[session.rank] = SharedRelease.open(msg.path, msg.slots)
            self.stats.shared_release_ranks.append(session.rank)
        except (ValueError, OSError) as e:  # the rank still flips its flags itself: note it and go on
            log.warning("rank %d: %s; its releases go through messages", session.rank, e)
            return
        try:  # both sides hold their mappings now: no file is left behind, whatever ends the rank
            os.unlink(msg.path)
        except OSError:
            pass

    async def _on_reached(self, session: RankSession, msg: P.Reached, now: int) -> None:
        self._reach[(session.rank, msg.gid, msg.seq)] = msg.reach_ns
        if self.stats.keep_trips:
            self.stats.reach_in_ns[(session.rank, msg.gid, msg.seq)] = time.monotonic_ns()
        await self._pump()

    def _note_reach(self, rank: int, msg: Any) -> None:
        """A device-path call's arrival that came with its reach (protocol 12)."""
        if msg.reach_follows and msg.reach_ns:
            key = self._reach_key(rank, msg)
            self._reach[key] = msg.reach_ns
            self.stats.arrived_with_reach += 1
            if self.stats.keep_trips and isinstance(msg, P.CollectiveArrive):
                self.stats.reach_in_ns[key] = time.monotonic_ns()

    @staticmethod
    def _reach_key(rank: int, msg: Any) -> tuple[int, str, int]:
        """The ``Reached`` that gives a device-path call's arrival."""
        if isinstance(msg, P.RecvPost):
            return (rank, P.recv_reach_gid(msg.src, msg.tag), msg.pseq)
        if isinstance(msg, P.Send):
            return (rank, P.send_reach_gid(msg.dst, msg.tag), msg.pseq)
        return (rank, msg.gid, msg.seq)

    async def _on_send(self, session: RankSession, msg: P.Send, now: int) -> None:
        rank = session.rank
        if msg.on_device:  # to a virtual rank, the data stayed on the sandbox's GPU: nothing to compare
            self.stats.device_sends += 1
        else:
            self._check_sent(rank, "", msg.payloads, 1,
                             lambda i, n: PL.p2p_ref(msg.rank, msg.dst, msg.tag, msg.pseq))
        if msg.dst in self.sandbox:
            self._sent[(msg.rank, msg.dst, msg.tag, msg.pseq)] = msg
        self._note_reach(rank, msg)
        t = None if msg.reach_follows else (msg.issue_ns or now)  # as a device-path collective's
        self._queue[rank].append(("send", msg, Call("send", peer=msg.dst, tag=msg.tag), t))
        await self._pump()

    async def _on_recv(self, session: RankSession, msg: P.RecvPost, now: int) -> None:
        self._note_reach(session.rank, msg)
        t = None if msg.reach_follows else (msg.issue_ns or now)  # as a device-path collective's
        self._queue[session.rank].append(("recv", msg, Call("recv", peer=msg.src, tag=msg.tag), t))
        await self._pump()

    async def _on_wait(self, session: RankSession, msg: P.Wait, now: int) -> None:
        self._queue[session.rank].append(("wait", msg, Call("wait"), msg.t_ns))
        await self._pump()

    # --- driving the engine -------------------------------------------------------

    def _anchor(self, rank: int, t_ns: int) -> None:
        if self.offset_ns is None:
            self.offset_ns = t_ns - self._first_call_ns.get(rank, 0)

    def _settle(self, rank: int) -> bool:
        """Work the engine until ``rank`` computes again (its last call released); whether it does."""
        eng = self.engine
        budget = WORK_BUDGET
        while rank not in eng.computing and budget > 0:
            if eng.work_ahead(1000) is None:
                break
            budget -= 1000
        return rank in eng.computing

    async def _pump(self) -> None:
        """Feed the sandboxes' queued calls to the engine and work it, until
        neither moves: what one sandbox's call completes can let another's
        queued call in."""
        while self._result is None:
            fed = sum([self._drain(r) for r in sorted(self.sandbox) if self._queue[r]])
            await self._progress()
            if not fed and not any(self._ready(r) and r in self.engine.computing for r in self.sandbox):
                break

    def _ready(self, rank: int) -> bool:
        """Whether ``rank`` has a call queued that the engine can take (a
        device-path call's only once its reach came)."""
        q = self._queue[rank]
        if not q:
            return False
        kind, msg, _, t = q[0]
        return t is not None or self._reach_key(rank, msg) in self._reach

    def _drain(self, rank: int) -> int:
        """Feed ``rank``'s queued calls to the engine while it can take them; how many it took."""
        taken = 0
        eng = self.engine
        q = self._queue[rank]
        end = int(self.graph.rank_ptr[rank + 1])
        while q and self._result is None:
            kind, msg, call, t = q[0]
            if t is None:  # a device-path call: its arrival is the stream's reach
                t = self._reach.pop(self._reach_key(rank, msg), None)
                if t is None:
                    break
                self.stats.reached_calls += 1
                self.stats.reach_lag_ns.append(t - msg.issue_ns)
                q[0] = (kind, msg, call, t)
            if kind != "wait":
                self._anchor(rank, t)
            if not self._settle(rank):
                break
            taken += 1
            nd, start = eng.computing[rank]
            cn = eng.next_call_node(rank, nd)
            e = max(t - (self.offset_ns or 0), start)
            at_wait = cn < end and eng._kind[cn] == WAIT
            if kind == "wait":
                q.popleft()
                if at_wait and self._wait_matches(cn, msg.what):
                    eng.arrive(rank, Call("wait"), e)
                continue
            if at_wait:
                # The rank went on past an async op's wait without blocking.
                op = int(eng._wait_of[cn])
                d = self._delivered_at.pop(op, None)
                tw = max(start, min(d, e)) if d is not None else e
                self.stats.implicit_waits += 1
                eng.arrive(rank, Call("wait"), tw)
                continue
            if kind == "end":
                q.popleft()
                try:
                    eng.finish(rank, e)
                except HybridError as err:
                    self._fail("mismatch", f"{err} (the script took another path than in the capture)", 1)
                self._finished_ranks.add(rank)
                continue
            if cn < end and eng._matches(cn, call):
                why = self._size_mismatch(rank, msg, cn)
                if why is not None:
                    self._fail("mismatch", why, 1)
                    return taken
            mismatch = eng.arrive(rank, call, e)
            if mismatch is not None:
                self._fail("mismatch", mismatch.message, 1)
                return taken
            q.popleft()
            if kind == "coll":
                self._await_end[cn] = (rank, ("coll", msg.gid, msg.seq))
            elif kind == "recv":
                self._await_end[cn] = (rank, ("recv", msg))
            if cn in self._await_end:
                self._taken_at[cn] = self._now()
        return taken

    def _size_mismatch(self, rank: int, msg: Any, cn: int) -> str | None:
        """The graph's node ``cn`` is the call ``msg`` makes (op, group,
        sequence); a message when its dtype, reduce op or sizes differ (the
        script's arguments changed since the capture)."""
        g = self.graph
        if isinstance(msg, P.CollectiveArrive):
            if msg.on_device or msg.pruned:
                got = sum(C.nbytes(msg.dtype, s) for s in msg.in_shapes)
            else:
                got = (sum(memoryview(p).nbytes for p in msg.payloads) if msg.payloads or msg.op != "broadcast"
                       else sum(C.nbytes(msg.dtype, s) for s in msg.out_shapes))
            reduce_op, dtype, shapes = g.sig_table[g.sig[cn]]
            what = f"{msg.op} on group {msg.gid} at sequence {msg.seq}"
            sized = got != int(g.nbytes[cn])
            if sized and msg.op in _DATA_SIZED:
                # How many tokens go where is data: a sandbox on compensated
                # values routes differently. Noted, not a mismatch.
                self.stats.resized.setdefault(rank, f"{what}: {got:,} bytes, the capture {int(g.nbytes[cn]):,}")
                sized = False
            if (reduce_op, dtype) != (msg.reduce_op, msg.dtype) or sized:
                return (f"sandbox rank {rank} called {what} with {msg.reduce_op + ' ' if msg.reduce_op else ''}"
                        f"{msg.dtype} tensors of shapes {[list(s) for s in msg.in_shapes or msg.out_shapes]} "
                        f"({got:,} bytes), but the captured graph has it with "
                        f"{reduce_op + ' ' if reduce_op else ''}{dtype}"
                        f"{' shapes ' + str([list(x) for x in shapes]) if shapes else ''} ({int(g.nbytes[cn]):,} bytes) "
                        "(the script's arguments, e.g. the model's width, changed since the capture)")
            return None
        if isinstance(msg, (P.Send, P.RecvPost)):
            got = C.nbytes(msg.dtype, msg.shape)
            if got != int(g.nbytes[cn]):
                verb = "send to" if isinstance(msg, P.Send) else "recv from"
                peer = msg.dst if isinstance(msg, P.Send) else msg.src
                return (f"sandbox rank {rank} called {verb} rank {peer} tag {msg.tag} with {msg.dtype} "
                        f"{list(msg.shape)} ({got:,} bytes), but the captured graph has {int(g.nbytes[cn]):,} bytes "
                        "(the script's arguments changed since the capture)")
        return None

    def _wait_matches(self, node: int, what: str) -> bool:
        op = int(self.engine._wait_of[node])
        if self.engine._kind[op] == COLL:
            c = self.engine.call_of(op)
            return what == wait_key_coll(c.gid, c.seq)
        return True

    async def _progress(self) -> None:
        """Engine work in small slices, each followed by what became known:
        completions into the delivery heap, due deliveries out (a release
        found early in a slice is not held back by the rest of the work)."""
        eng = self.engine
        if self.offset_ns is None:
            return
        budget = WORK_BUDGET
        more = True
        while budget > 0:
            more = eng.work_ahead(SLICE) is not None
            budget -= SLICE
            eng.take_released()
            if self._await_end:
                self._collect_ends()
            if self._early_on:
                await self._release_early()
            await self._send_due()
            if not more or any(self._ready(r) and r in eng.computing for r in self.sandbox):
                break
        if more:
            self._wake_at(trio.current_time())

    def _collect_ends(self) -> None:
        ends = self.engine._end
        for node in [n for n in self._await_end if ends[n] >= 0]:
            rank, what = self._await_end.pop(node)
            t_end = int(ends[node])
            if self.graph.is_async[node]:  # only an async op's wait asks when its data came
                self._delivered_at[node] = t_end
            early = self._early.pop((rank, what[1], what[2]), None) if what[0] == "coll" else None
            if early is not None:  # its result went out already (``_release_early``)
                self._taken_at.pop(node, None)
                after, cost = early
                if t_end != max(after, int(self.engine._start[node])) + cost:
                    self.stats.early_off += 1
                continue
            msg = self._message(rank, what)
            if isinstance(msg, P.CollectiveResult):
                msg = dataclasses.replace(msg, tail_ns=int(self.engine.costs.inst[self.graph.ref[node]]))
            if msg is not None:
                self._tie += 1
                heapq.heappush(self._heap, (t_end + self.offset_ns, self._tie, rank, msg, node))

    async def _release_early(self) -> None:
        """Release a GPU sandbox's device-path collective before its reach
        comes, where the engine knows its completion already
        (``HybridReplay.known_completion``: every other member has arrived,
        so it completes at ``max(after, reach) + cost``): the result goes out
        now with ``release_ns`` at ``after + cost`` and ``tail_ns`` the cost,
        and the wait on the sandbox's GPU ends at ``max(that, its reach +
        cost)``, the engine's time, with no round trip from the reach through
        this coordinator on the stream's critical path (measured on an H100,
        2026-12-06: about 1 ms a call, which the rank's dilated clock then has
        to take out). Opt-in (``EARLY_RELEASE_ENV``). The engine still takes
        the call at its reach, as before; ``_collect_ends`` then sends nothing
        more."""
        eng = self.engine
        for rank in self.sandbox:
            q = self._queue[rank]
            if not q:
                continue
            kind, msg, call, t = q[0]
            if kind != "coll" or t is not None or not msg.on_device:
                continue
            key = (rank, msg.gid, msg.seq)
            if key in self._early:
                continue
            got = eng.known_completion(rank, call)
            if got is None:
                continue
            after, cost, node = got
            if self._size_mismatch(rank, msg, node) is not None:
                continue  # ``_drain`` reports it at the reach
            out = self._message(rank, ("coll", msg.gid, msg.seq))
            if out is None:
                continue
            self._early[key] = (after, cost)
            self.stats.early_releases += 1
            await self._deliver(rank, dataclasses.replace(out, tail_ns=cost), after + cost + (self.offset_ns or 0),
                                self._now())

    async def _send_due(self) -> None:
        heap = self._heap
        now = self._now()
        while heap and heap[0][0] - LEAD_NS <= now:
            release, _, rank, msg, node = heapq.heappop(heap)
            taken = self._taken_at.pop(node, None)
            if taken is not None:
                self.stats.turnaround_ns.append(now - taken)
            await self._deliver(rank, msg, release, now)
        if heap:
            self._wake_at(self._mono_to_trio(heap[0][0] - LEAD_NS))

    async def _deliver(self, rank: int, msg: P.Message, release: int, now: int) -> None:
        """Send a sandbox its result, due at ``release`` (coordinator ns), on its own clock and group id."""
        self.stats.lag_ns.append(now - release - self._dilation.get(rank, 0))
        self.stats.deliveries += 1
        release -= self.clock_offsets.get(rank, 0)  # on the rank's own clock
        if isinstance(msg, P.CollectiveResult):
            slot = self._slots.pop((rank, msg.gid, msg.seq), None)  # the graph's gid, as ``_on_coll`` keyed it
            msg = P.CollectiveResult(self.groups.to_rank(rank, msg.gid), msg.seq, payloads=msg.payloads,
                                     release_ns=release, tail_ns=msg.tail_ns)
            if slot is not None:  # the GPU goes on now; the message follows for the rank's bookkeeping
                self._shared[rank].release(slot[0], slot[1], release, msg.tail_ns)
                self.stats.shared_releases += 1
            if self.stats.keep_trips:
                got = self.stats.reach_in_ns.pop((rank, msg.gid, msg.seq), None)
                self.stats.trips.append({"rank": rank, "gid": msg.gid, "seq": msg.seq, "c_in": got,
                                         "c_out": time.monotonic_ns()})
        else:
            msg = P.P2PData(msg.src, msg.dst, msg.tag, msg.pseq, payloads=msg.payloads, release_ns=release)
        await self._send(rank, msg)

    async def _on_due(self, ev: Due, now: int) -> None:
        await self._pump()

    # --- what a call delivers -----------------------------------------------------

    def _message(self, rank: int, what: tuple) -> P.Message | None:
        if what[0] == "coll":
            _, gid, seq = what
            outs = self._outputs.get((gid, seq))
            if outs is None:
                outs = self._outputs[(gid, seq)] = self._coll_outputs(gid, seq)
            g, _ = self._group_rank(gid, rank)
            payloads = outs.pop(g)
            if not outs:
                del self._outputs[(gid, seq)]
            return P.CollectiveResult(gid, seq, payloads=tuple(payloads))
        msg: P.RecvPost = what[1]
        key = (msg.src, msg.rank, msg.tag, msg.pseq)
        if msg.src in self.sandbox:
            sent = self._sent.pop(key)
            payloads = tuple(sent.payloads)
        elif msg.on_device:  # formed on the sandbox's GPU (the recording or zeros, behind the release)
            payloads = ()
            if msg.recorded:
                self.stats.recorded_calls += 1
            else:
                self.stats.compensated_calls += 1
            self.stats.device_calls += 1
        else:
            rec = self.recordings.get(rank)
            p = rec.index.get(("recv", PL.p2p_ref(*key))) if rec is not None else None
            if p is not None:
                payloads = (rec.load(p),)
                self.stats.recorded_calls += 1
            else:
                payloads = (bytes(C.nbytes(msg.dtype, msg.shape)),)
                self.stats.compensated_calls += 1
        return P.P2PData(msg.src, msg.rank, msg.tag, msg.pseq, payloads=payloads)

    def _coll_outputs(self, gid: str, seq: int) -> dict[int, list[Any]]:
        calls = self._calls.pop((gid, seq))
        on_record = self._on_record.pop((gid, seq), False)
        pruned = any(m.pruned for m in calls.values())
        if pruned:
            if not all(m.pruned for m in calls.values()):
                self._fail("invalid", f"{next(iter(calls.values())).op} on group {gid} at sequence {seq}: some "
                           "sandbox members ran it among themselves (--pruned) and some sent their data; every "
                           "sandbox rank must run with the same Prism and environment", 1)
                return {g: [] for g in calls}
            self.stats.pruned_calls += 1
        if on_record:
            out = {}
            for g, msg in calls.items():
                rec = self.recordings[msg.rank]
                n = len(msg.out_shapes)
                got = []
                for i in range(n):
                    p = rec.index.get(("recv", PL.coll_ref(gid, seq, "out", i, n)))
                    if p is None:
                        break
                    got.append(rec.load(p))
                else:
                    out[g] = got
                    continue
                if n and not got and msg.op in ("broadcast", "reduce", "gather", "scatter"):
                    out[g] = []  # "leave as it is": the recording has nothing for it either
                    continue
                break
            else:
                self.stats.recorded_calls += 1
                return out
        if pruned:
            return {g: [] for g in calls}  # formed by the members themselves: leave their tensors as they are
        if any(m.on_device for m in calls.values()):
            # a GPU sandbox alone in its group formed its outputs on its
            # device: the capture's recorded ones from its prefetch pool, or compensated
            if all(m.recorded for m in calls.values()):
                self.stats.recorded_calls += 1
            else:
                self.stats.compensated_calls += 1
            self.stats.device_calls += 1
            return {g: [] for g in calls}
        self.stats.compensated_calls += 1
        _, ranks = self._group_rank(gid, next(iter(calls.values())).rank)
        inputs = {g: self.matcher._arrays(msg, g) for g, msg in calls.items()}
        try:
            arrays = hybrid_outputs(calls, inputs, len(ranks), gid=gid, seq=seq, ranks=())
        except (C.CollectiveError, ValueError) as e:
            self._fail("invalid", f"cannot compute {next(iter(calls.values())).op} on group {gid} at sequence "
                       f"{seq} for the sandbox: {e}", 1)
            return {g: [] for g in calls}
        out = {}
        for g, arrs in arrays.items():
            msg = calls[g]
            res = []
            for a, shape in zip(arrs, msg.out_shapes):
                a = np.ascontiguousarray(a)
                res.append(C.from_array(a.reshape(tuple(shape)) if a.size == math.prod(shape) else a))
            out[g] = res
        return out
