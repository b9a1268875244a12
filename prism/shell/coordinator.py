"""The phase-1 coordinator: a trio shell around the sans-IO matcher and
scheduler (``prism.core.matcher``, ``prism.core.scheduler``).

One task reads the ROUTER socket, one launches and watches the rank processes
(when the coordinator is given a ``launch``), one ticks the watchdog; each
feeds typed events (``Received``, ``Malformed``, ``RankExited``, ``Tick``)
into a single *event channel*, and one loop owns every piece of state and is
the only sender on the socket. So the state needs no locks, and a thousand
ranks cost a thousand dictionary entries, not a thousand tasks. The loop
dispatches by table: event type -> handler, message type -> handler.

The members of the world are *participants* (``Participant``): each one is a
``RankSession``, a rank process behind the socket (an emulation's subclass,
``prism.shell.emulator``, has only the sandbox ranks as sessions). Residency (GPU
swaps) is the ``SwapPolicy``'s: the coordinator tells it what ranks do and
carries out the actions it returns, through the swap executor.

Time comes from trio (``trio.current_time()``), mapped onto the ranks'
``time.monotonic_ns()`` by an anchor taken when ``run`` starts: real runs keep
the ranks' timestamps, and under a virtual clock (``trio.testing.MockClock``)
the coordinator's quiet periods and grace periods pass without waiting.

The capture stops at the first failure, which becomes the result instead of a
hang: a collective mismatch (reported at the arrival that shows it), a
deadlock (after a quiet period), a rank that raised or died. Every rank that
is still alive is told why (``protocol.Error`` or ``protocol.Shutdown``), is
given a grace period to flush its trace, and is then killed; the trace files
are closed with a ``rank_end`` record for every rank, so the run stays valid.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio
import zmq

from prism.core import matcher as M
from prism.core import payloads as PL
from prism.core import protocol as P
from prism.core import scheduler as S
from prism.core import trace as T
from prism.shell import runfolder
from transport.endpoints import on_one_host
from transport.trio_socket import AsyncSocket

log = logging.getLogger("prism.shell.coordinator")

#: The issue asks for a stop within 5 s of the last member's arrival; the
#: matcher reports a mismatch at that very arrival, so this only bounds how
#: long ranks get to flush their traces before they are killed.
DEFAULT_GRACE_S = 3.0
#: docs/DESIGN.md: deadlocks are reported after a configurable quiet period.
DEFAULT_QUIET_S = 30.0
#: How long a rank's exit waits for its Goodbye before it counts as a crash.
EXIT_GRACE_NS = 3_000_000_000
#: Exit status of a capture a rank ended by running out of GPU memory (1 is
#: every other failure, 2 bad arguments).
EXIT_OOM = 3
#: Exit status of a run stopped by a signal (``stop_signals``): 128 + SIGTERM,
#: as a shell reports a process that SIGTERM ended.
EXIT_INTERRUPTED = 143


@dataclass(frozen=True, slots=True)
class CaptureResult:
    """How a capture ended. ``status`` is "ok", "mismatch", "deadlock", "oom"
    (exit code ``EXIT_OOM``), "rank_failed", "swap_failed", "invalid",
    "interrupted" (a stop signal, exit code ``EXIT_INTERRUPTED``) or
    "internal", or "node_lost" (an agent died); ``exit_code`` is non-zero unless ok."""

    status: str
    message: str
    exit_code: int
    #: Ranks that raised or died, with their last words (traceback text).
    failed_ranks: dict[int, str] = field(default_factory=dict)
    steps_done: int = 0
    wall_s: float = 0.0


# --- events on the coordinator's channel ---------------------------------------


@dataclass(frozen=True, slots=True)
class Received:
    """A message read from the socket, from the peer ``identity``."""

    identity: bytes
    msg: P.Message


@dataclass(frozen=True, slots=True)
class Malformed:
    """Bytes from ``identity`` (None: unknown) that are no valid message."""

    identity: bytes | None
    error: P.ProtocolError


@dataclass(frozen=True, slots=True)
class RankExited:
    """The launcher saw ``rank``'s process end with ``code`` (``-signal`` if killed)."""

    rank: int
    code: int


@dataclass(frozen=True, slots=True)
class Tick:
    """The watchdog's beat: progress line, deadlock and registration checks,
    rescues, exits waiting for their Goodbye."""


@dataclass(frozen=True, slots=True)
class Interrupted:
    """This process received ``signum`` (one of ``stop_signals``)."""

    signum: int


@dataclass(frozen=True, slots=True)
class NodeLost:
    """The process handle lost a node (an agent): ``message`` names it and its
    ranks; ``status`` is how the run ends ("swap_failed": its swap driver would
    not load)."""

    message: str
    status: str = "node_lost"


Event = Received | Malformed | RankExited | Tick | Interrupted | NodeLost


# --- participants -----------------------------------------------------------------


class Participant(Protocol):
    """A member of the world, as the coordinator sees it: its rank, whether
    it is done, how results and errors reach it (``deliver``), and its trace
    (``writer``, ended by ``end`` and ``close``).

    Every participant is a ``RankSession``: a rank process behind the
    ROUTER socket. In an emulation (``prism.shell.emulator.Emulator``) the
    sessions are the sandbox ranks; the virtual ranks are not participants
    but cursors inside the core's hybrid engine (``prism/core/hybrid.py``),
    which answers the sandboxes' calls in the matcher's place.
    """

    rank: int
    done: bool
    #: "ok", "error" or "died" once ended ("" before).
    status: str
    #: The last step it completed (-1: none yet).
    step: int
    writer: runfolder.TraceWriter

    async def deliver(self, msg: P.Message) -> None:
        """Give ``msg`` (a result, a grant, an error, a shutdown) to it."""
        ...

    def end(self, status: str, message: str) -> None:
        """It ended (said goodbye or died): it gets nothing more."""
        ...

    def close(self, now: int, stopped: str) -> None:
        """Close its trace at ``now``; ``stopped`` says why the capture
        stopped it ("" if it did not)."""
        ...


class RankSession:
    """A real rank: a process that said ``Hello`` on the socket as ``identity``."""

    def __init__(self, sock: RouterSocket, identity: bytes, hello: P.Hello, writer: runfolder.TraceWriter,
                 clock_offset_ns: int) -> None:
        self._sock = sock
        self.identity = identity
        self.hello = hello
        self.rank = hello.rank
        self.writer = writer
        #: coordinator_ns - rank_ns (one host: the same clock, 0). Another
        #: host's: first a one-way estimate from the Hello (late by its
        #: connect and handshake), then the offset the rank settled on by
        #: probing (``ClockOffset``, protocol 9), which its own trace has.
        self.clock_offset_ns = clock_offset_ns
        self.done = False
        self.status = ""
        self.message = ""
        self.wrote_end = False
        #: Whether the rank has sent any trace line (its first is its rank_start).
        self.wrote_any = False
        self.step = -1

    @property
    def pid(self) -> int:
        """The rank's process (the swap executor checkpoints it)."""
        return self.hello.pid

    async def deliver(self, msg: P.Message) -> None:
        try:
            await self._sock.send_message(msg, identity=self.identity)
        except zmq.ZMQError as e:
            # EHOSTUNREACH: the peer disconnected; its exit is handled elsewhere.
            log.debug("could not send %s to rank %d: %s", type(msg).__name__, self.rank, e)

    def record(self, lines: Iterable[bytes]) -> None:
        """Write trace lines the rank sent, noting its end record and steps."""
        for line in lines:
            line = bytes(line)
            self.wrote_any = True
            if line.startswith(b'{"k":"rank_end"'):
                self.wrote_end = True
            elif line.startswith(b'{"k":"iter"'):
                self.step = max(self.step, T.decode_event(line).step)
            self.writer.write_line(line)

    def end(self, status: str, message: str) -> None:
        self.done, self.status, self.message = True, status, message
        self.writer.flush()

    def close(self, now: int, stopped: str) -> None:
        if not self.wrote_any:
            # Stopped before its first flush (a rank computing or sleeping
            # since it registered): its rank_start comes from its Hello, so
            # the file still opens as every rank file must.
            h = self.hello
            self.writer.write(T.RankStart(h.rank, h.world_size, h.local_rank, h.pid, h.hostname, h.device, h.device,
                                          self.clock_offset_ns, h.t_ns))
        if not self.wrote_end:
            status = self.status or "killed"
            self.writer.write(T.RankEnd(now - self.clock_offset_ns,
                                        status if status in ("ok", "error", "died", "oom") else "killed",
                                        (self.message or stopped)[:4000]))
        self.writer.close()


#: Handles a registered rank's message: (its session, the message, now).
_MessageHandler = Callable[[RankSession, Any, int], Awaitable[None]]


class RouterSocket(Protocol):
    """What the coordinator serves on: a ZeroMQ ROUTER (``AsyncSocket``) or,
    in tests, ``transport.memory.MemoryRouter`` (``prism.testing``)."""

    async def recv_message(self) -> tuple[bytes | None, P.Message]: ...

    async def send_message(self, msg: P.Message, identity: bytes | None = None) -> None: ...

    def close(self) -> None: ...


class Processes(Protocol):
    """The launcher's handle on the rank processes (``prism.shell.launcher.RankProcesses``)."""

    def poll(self) -> list[int | None]:
        """Exit code of every rank, None while it runs."""
        ...

    def kill_all(self) -> None: ...

    def wait(self, timeout: float | None = None) -> Any: ...

    def close(self) -> None:
        """Kill what still runs and reap."""
        ...


class Swapper(Protocol):
    """Carries out the policy's swaps of a rank's process (``prism.shell.swap.SwapExecutor``).
    Both block for up to seconds: the coordinator calls them in a worker thread."""

    def swap_out(self, rank: int, pid: int, step: int) -> Any: ...

    def swap_in(self, rank: int, pid: int, step: int) -> Any: ...


class Progress:
    """Ranks registered, steps done, collectives per second: one line, on a
    terminal rewritten in place, elsewhere printed every ``every_s``."""

    def __init__(self, world_size: int, *, stream: Any = None, mode: str = "auto", every_s: float = 5.0):
        self.world_size = world_size
        self.stream = stream if stream is not None else sys.stderr
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = mode != "off"
        self.inplace = tty
        self.every_ns = int((0.5 if tty else every_s) * 1e9)
        self._last_ns = 0
        self._last_colls = 0

    def update(self, now: int, registered: int, min_step: int, max_step: int, colls: int, *, force: bool = False) -> None:
        if not self.enabled or (not force and now - self._last_ns < self.every_ns):
            return
        dt = max(now - self._last_ns, 1) / 1e9 if self._last_ns else None
        rate = (colls - self._last_colls) / dt if dt else 0.0
        self._last_ns, self._last_colls = now, colls
        line = (f"prism: ranks {registered}/{self.world_size} registered | steps done "
                f"{max(min_step + 1, 0)} (fastest rank {max(max_step + 1, 0)}) | "
                f"{colls} collectives, {rate:.0f}/s")
        if self.inplace:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.inplace and self._last_ns:
            self.stream.write("\n")
            self.stream.flush()


class Coordinator:
    """Serves one capture of ``world_size`` ranks into ``run_dir``.

    ``launch(bound_endpoint)`` (optional) starts the rank processes; it is
    called in a worker thread once the socket is bound and returns their
    handle (``Processes``), which the coordinator watches, kills when the
    capture fails and reaps at the end. Without it (a standalone coordinator;
    ranks launched elsewhere) a dead rank is noticed by its silence: the
    deadlock watchdog names it. ``on_listening(bound_endpoint)`` is called in
    the loop once the socket is bound. ``policy`` decides GPU residency
    (default ``NoSwap``); ``swapper`` carries out its ``SwapOut``/``SwapIn``
    with the pid from each rank's Hello; None on CPU. ``router`` (tests:
    ``transport.memory.MemoryRouter``, see ``prism.testing``) is an open
    ROUTER-like socket to serve on instead of binding ``endpoint``, which
    then only names it (``memory://...``: one host, one clock).
    ``processes`` is the handle of ranks started by the caller (tests: fake
    processes), watched, killed and reaped as a launch's, but called in the
    loop, not a worker thread: it must not block (so a virtual clock never
    jumps while it runs).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        world_size: int,
        *,
        slots: int,
        endpoint: str,
        quiet_s: float = DEFAULT_QUIET_S,
        grace_s: float = DEFAULT_GRACE_S,
        small_tensor_limit: int = T.DEFAULT_SMALL_TENSOR_LIMIT,
        run_id: str = "",
        launch: Callable[[str], Processes] | None = None,
        on_listening: Callable[[str], None] | None = None,
        progress: Progress | None = None,
        authenticated: bool = False,
        policy: S.SwapPolicy | None = None,
        swapper: Swapper | None = None,
        register_stall_s: float | None = None,
        record: PL.RecordPlan | None = None,
        router: RouterSocket | None = None,
        processes: Processes | None = None,
        stop_signals: Sequence[int] = (),
        curve_keys: str | os.PathLike[str] | None = None,
        node_slots: tuple[dict[int, int], list[int]] | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world size must be at least 1, got {world_size}")
        if slots < 1:
            raise ValueError(f"--slots must be at least 1, got {slots}")
        self.run_dir = Path(run_dir)
        self.world_size = world_size
        self.endpoint = endpoint
        self.quiet_ns = int(quiet_s * 1e9)
        #: Registration fails once no rank has said Hello for this long
        #: (default: twice the quiet period, at least two minutes).
        self.register_stall_ns = int((register_stall_s if register_stall_s is not None
                                      else max(quiet_s, 60.0) * 2) * 1e9)
        self.grace_s = grace_s
        self.small_tensor_limit = small_tensor_limit
        self.run_id = run_id or self.run_dir.name
        self.launch = launch
        self.on_listening = on_listening
        self.progress = progress
        #: ``prism keys`` directory: the socket is a CURVE server letting in
        #: only its authorized keys (ranks started by ``prism agent``).
        self.curve_keys = Path(curve_keys) if curve_keys is not None else None
        self.authenticated = authenticated or self.curve_keys is not None
        #: Signals that stop the run as a failure would (SIGTERM from ``prism
        #: cancel`` or a daemon stopping): every rank is told, flushes its
        #: trace and is killed; the trace stays valid. Main thread only (trio).
        self.stop_signals = tuple(stop_signals)
        #: An emulation's coordinator (``prism.shell.emulator``): ranks keep a dilated clock.
        self.hybrid = False
        #: What this coordinator serves, in messages to the ranks, and what it calls a rank in its reports.
        self.what = "capture"
        self.rank_word = "rank"
        self.matcher = M.Matcher(world_size)
        #: ``(rank -> node, each node's slots)`` for ranks served by agents.
        nodes, per_node = node_slots if node_slots is not None else (None, None)
        self.scheduler = S.Scheduler(slots, range(world_size), policy, nodes=nodes, node_slots=per_node)
        self.policy: S.SwapPolicy = self.scheduler.policy
        self.swapper = swapper
        #: ``--record``: what the chosen ranks receive and send (None: nothing recorded).
        self.payloads = PL.PayloadBook(record, {r: runfolder.payload_data_name(r) for r in record.ranks}) \
            if record is not None else None
        self._payload_writers: dict[int, runfolder.PayloadWriter] = {}
        self._record_warned = False
        self._last_swap_ns = 0
        #: Ranks restored by the policy's rescue (each after a quiet spell).
        self.rescues = 0
        #: Every member of the world, by rank.
        self.ranks: dict[int, Participant] = {}
        #: The real ranks among them (processes behind the socket), by rank and by identity.
        self.sessions: dict[int, RankSession] = {}
        self.by_identity: dict[bytes, int] = {}
        self.colls_done = 0
        self.bound_endpoint = ""
        self._router = router
        self._sock: RouterSocket | None = None
        self._processes: Processes | None = processes
        self._processes_inline = processes is not None
        self._result: CaptureResult | None = None
        self._failed: dict[int, str] = {}
        #: Exits seen before the rank's Goodbye was handled: rank -> (code, when).
        self._exits: dict[int, tuple[int, int]] = {}
        #: trio's clock and the ranks' clock at the same instant (set by ``run``).
        self._anchor_s = 0.0
        self._anchor_ns = 0
        self._t0 = 0
        #: When the last rank registered (registration stalls end the run).
        self._last_hello = 0
        self._event_handlers: dict[type, Callable[[Any, int], Awaitable[None]]] = {
            Received: self._on_received,
            Malformed: self._on_malformed,
            RankExited: self._on_exit,
            Tick: self._on_tick,
            Interrupted: self._on_interrupted,
            NodeLost: self._on_node_lost,
        }
        #: Messages a registered rank may send (Hello is the one that comes before a session).
        self._message_handlers: dict[type, _MessageHandler] = {
            P.TraceRecords: self._on_trace,
            P.CollectiveArrive: self._matched(self.matcher.arrive),
            P.Send: self._matched(self.matcher.send),
            P.RecvPost: self._matched(self.matcher.recv_post),
            P.Wait: self._matched(self.matcher.wait),
            P.GroupCreate: self._matched(self.matcher.group_create),
            P.SlotRequest: self._on_slot_request,
            P.SlotRelease: self._on_slot_release,
            P.Taken: self._on_taken,
            P.Heartbeat: self._on_heartbeat,
            P.Goodbye: self._on_goodbye,
            P.ClockProbe: self._on_clock_probe,
            P.ClockOffset: self._on_clock_offset,
        }

    def _now(self) -> int:
        """The coordinator's time in integer nanoseconds on the ranks' clock.
        trio's clock is ``perf_counter`` plus a random offset (or virtual
        under a ``MockClock``); the ranks stamp ``time.monotonic_ns()``. On
        Linux both read CLOCK_MONOTONIC, so the anchor maps one onto the
        other without drift and the trace's times stay the ranks'."""
        return self._anchor_ns + round((trio.current_time() - self._anchor_s) * 1e9)

    # --- the event loop -----------------------------------------------------

    def _finished_message(self) -> str:
        return f"all {self.world_size} ranks finished"

    async def run(self) -> CaptureResult:
        """Serve until every rank has ended or the capture failed; returns how
        it ended (and, after a capture that went well, once the launched
        processes have exited)."""
        self._anchor_s, self._anchor_ns = trio.current_time(), time.monotonic_ns()
        self._t0 = self._now()
        self._last_hello = self._t0
        self.matcher.last_progress_ns = self._t0
        runfolder.make_run_dir(self.run_dir)
        _raise_open_files_limit(self.world_size)
        try:
            await self._serve()
            result = self._result or CaptureResult("ok", self._finished_message(), 0)
            steps = min((r.step for r in self.ranks.values()), default=-1) + 1
            result = CaptureResult(result.status, result.message, result.exit_code, dict(self._failed),
                                   steps, (self._now() - self._t0) / 1e9)
            if self._processes is not None and result.status == "ok":
                # Every rank said goodbye; let them finish tearing down (ZeroMQ
                # flushing, interpreter exit) rather than killing them mid-exit.
                await self._call_processes(functools.partial(self._processes.wait, timeout=30))
            return result
        finally:
            if self._processes is not None:
                with trio.CancelScope(shield=True):
                    await self._call_processes(self._processes.close)

    async def _serve(self) -> None:
        sock = self._router if self._router is not None else AsyncSocket.create(zmq.ROUTER)
        self._sock = sock
        auth = None
        try:
            if isinstance(sock, AsyncSocket):
                sock.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
                if self.curve_keys is not None:
                    from transport.curve import serve_curve

                    auth = serve_curve(sock.socket, self.curve_keys, log_name="prism.shell.coordinator.zap")
                self.bound_endpoint = sock.bind(self.endpoint, authenticated=self.authenticated)
            else:
                self.bound_endpoint = self.endpoint
            send, recv = trio.open_memory_channel[Event](math.inf)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_socket, sock, send.clone())
                nursery.start_soon(self._tick, send.clone())
                if self.stop_signals:
                    nursery.start_soon(self._watch_signals, send.clone())
                if self.launch is not None or self._processes is not None:
                    nursery.start_soon(self._launch_and_watch, self.launch, send.clone())
                send.close()
                if self.on_listening is not None:
                    self.on_listening(self.bound_endpoint)
                async for event in recv:
                    await self._handle(event)
                    if self._finished() or self._result is not None:
                        break
                if self._result is not None and not self._finished():
                    await self._stop(recv)
                nursery.cancel_scope.cancel()
        finally:
            self._close_traces()
            sock.close()
            if auth is not None:
                auth.stop()
            if self.bound_endpoint.startswith("ipc://"):
                # libzmq leaves the socket file behind; a run directory should
                # hold only files (copying one with it fails).
                Path(self.bound_endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
            if self.progress is not None:
                self.progress.close()

    async def _read_socket(self, sock: AsyncSocket, out: trio.MemorySendChannel[Event]) -> None:
        async with out:
            while True:
                try:
                    identity, msg = await sock.recv_message()
                except P.ProtocolError as e:
                    await out.send(Malformed(getattr(e, "identity", None), e))
                    continue
                await out.send(Received(identity, msg))

    async def _tick(self, out: trio.MemorySendChannel[Event]) -> None:
        async with out:
            while True:
                await trio.sleep(0.5)
                await out.send(Tick())

    async def _watch_signals(self, out: trio.MemorySendChannel[Event]) -> None:
        async with out:
            with trio.open_signal_receiver(*self.stop_signals) as signals:
                async for signum in signals:
                    await out.send(Interrupted(signum))

    async def _launch_and_watch(self, launch: Callable[[str], Processes] | None,
                                out: trio.MemorySendChannel[Event]) -> None:
        async with out:
            if self._processes is None:
                # Starting a world of processes blocks for seconds: not in the loop.
                self._processes = await trio.to_thread.run_sync(launch, self.bound_endpoint)
            seen: set[int] = set()
            # A handle over remote processes (``prism.shell.agent.AgentProcesses``)
            # says when a whole node is lost; that is the run's report, before
            # the exits of the ranks it took along.
            lost = getattr(self._processes, "lost", None)
            reported = False
            while True:
                await trio.sleep(0.1)
                if lost is not None and not reported and (why := lost()):
                    reported = True
                    status = getattr(self._processes, "lost_status", lambda: "node_lost")()
                    await out.send(NodeLost(why, status))
                for rank, code in enumerate(self._processes.poll()):
                    if code is not None and rank not in seen:
                        seen.add(rank)
                        await out.send(RankExited(rank, code))

    async def _call_processes(self, fn: Callable[[], Any]) -> Any:
        """Call the process handle: a launch's blocks (a worker thread), a given one does not."""
        if self._processes_inline:
            return fn()
        return await trio.to_thread.run_sync(fn)

    def _finished(self) -> bool:
        return len(self.ranks) == self.world_size and all(r.done for r in self.ranks.values())

    async def _handle(self, event: Event) -> None:
        try:
            await self._event_handlers[type(event)](event, self._now())
        except S.SchedulerError as e:
            # Prism's own slot or swap bookkeeping went wrong: the run stops
            # with what was recorded kept, not with a traceback.
            why = str(e) if "report" in str(e) else f"{e}; this is a Prism bug, please report it"
            self._fail("invalid", f"Prism's scheduler stopped the {self.what}: {why}\n(The trace so far is kept.)", 1)

    async def _send(self, rank: int, msg: P.Message) -> None:
        """Deliver ``msg`` to participant ``rank`` unless it has ended."""
        member = self.ranks.get(rank)
        if member is not None and not member.done:
            await member.deliver(msg)

    async def _reply(self, identity: bytes, msg: P.Message) -> None:
        """Answer a peer that has no session (yet): a refused Hello, a message before Hello."""
        try:
            await self._sock.send_message(msg, identity=identity)
        except zmq.ZMQError as e:
            log.debug("could not send %s: %s", type(msg).__name__, e)

    # --- events -----------------------------------------------------------------

    async def _on_malformed(self, ev: Malformed, now: int) -> None:
        rank = self.by_identity.get(ev.identity, -1) if ev.identity else -1
        who = f"rank {rank}" if rank >= 0 else "an unregistered peer"
        text = f"malformed message from {who}: {ev.error}"
        if ev.identity is not None:
            await self._reply(ev.identity, P.Error("bad_message", text, rank=rank))
        if rank >= 0:
            self._fail("invalid", f"{text}\nThis is a Prism bug or a version mismatch; please report it.", 1)

    async def _on_received(self, ev: Received, now: int) -> None:
        msg = ev.msg
        if isinstance(msg, P.Hello):
            await self._on_hello(ev.identity, msg, now)
            return
        rank = self.by_identity.get(ev.identity)
        if rank is None:
            await self._reply(ev.identity, P.Error("bad_message",
                                                   f"{type(msg).__name__} before Hello: say Hello first"))
            return
        handler = self._message_handlers.get(type(msg))
        if handler is None:
            await self._reply(ev.identity, P.Error("bad_message", f"a rank may not send {type(msg).__name__}",
                                                   rank=rank))
            return
        await handler(self.sessions[rank], msg, now)

    async def _on_hello(self, identity: bytes, hello: P.Hello, now: int) -> None:
        try:
            P.check_hello(hello, world_size=self.world_size)
            if hello.rank in self.ranks and not self.ranks[hello.rank].done:
                raise P.ProtocolError(
                    f"rank {hello.rank} registered twice (pids {self.sessions[hello.rank].pid} and "
                    f"{hello.pid}): two launches are using the same coordinator")
        except P.ProtocolError as e:
            code = "version" if isinstance(e, P.VersionMismatch) else "bad_message"
            await self._reply(identity, P.Error(code, str(e), rank=hello.rank))
            return
        writer = runfolder.TraceWriter(self.run_dir, hello.rank)
        # On one host (ipc or loopback) the monotonic clocks are the same one.
        local = on_one_host(self.bound_endpoint)
        session = RankSession(self._sock, identity, hello, writer, 0 if local else now - hello.t_ns)
        self.sessions[hello.rank] = session
        self.by_identity[identity] = hello.rank
        self._admit(session, now)
        await session.deliver(P.Welcome(P.PROTOCOL_VERSION, self.run_id, now, self.small_tensor_limit,
                                        swapping=self.swapper is not None, hybrid=self.hybrid))

    async def _on_clock_probe(self, session: RankSession, msg: P.ClockProbe, now: int) -> None:
        # At once: the rank takes this stamp to lie halfway through its round trip.
        await session.deliver(P.ClockEcho(msg.seq, msg.t_ns, now))

    async def _on_clock_offset(self, session: RankSession, msg: P.ClockOffset, now: int) -> None:
        log.debug("rank %d: clock offset %d ns (round trip %d ns; the Hello's estimate was %d ns)",
                  session.rank, msg.offset_ns, msg.rtt_ns, session.clock_offset_ns)
        session.clock_offset_ns = msg.offset_ns

    def _admit(self, member: Participant, now: int) -> None:
        """``member`` joins the world: a rank session at its Hello."""
        self.ranks[member.rank] = member
        self._last_hello = now

    # --- messages of a registered rank ------------------------------------------

    def _matched(self, event: Callable[[Any, int], list[M.Outcome]]) -> _MessageHandler:
        """A handler that gives the message to the matcher and carries out its outcomes."""
        async def handle(session: RankSession, msg: P.Message, now: int) -> None:
            if self.payloads is not None and self.payloads.records(session.rank):
                self._record_call(session, msg)
            await self._outcomes(event(msg, now), now)
        return handle

    # --- recorded payloads (--record) ---------------------------------------------

    def _payload_writer(self, rank: int) -> runfolder.PayloadWriter:
        w = self._payload_writers.get(rank)
        if w is None:
            w = self._payload_writers[rank] = runfolder.PayloadWriter(self.run_dir, rank)
        return w

    def _record_call(self, session: RankSession, msg: P.Message) -> None:
        """A recorded rank made a call: note its step and what it sends."""
        step = session.step + 1  # its iteration records arrive before its next step's calls
        book = self.payloads
        if isinstance(msg, P.CollectiveArrive):
            sent = book.called(session.rank, ("coll", msg.gid, msg.seq), step, msg.dtype, msg.in_shapes,
                               msg.payloads, msg.out_shapes)
        elif isinstance(msg, P.Send):
            sent = book.called(session.rank, ("p2p", msg.rank, msg.dst, msg.tag, msg.pseq), step, msg.dtype,
                               (msg.shape,), msg.payloads)
        elif isinstance(msg, P.RecvPost):
            sent = book.called(session.rank, ("p2p", msg.src, msg.rank, msg.tag, msg.pseq), step, msg.dtype,
                               (), (), (msg.shape,))
        else:
            return
        if sent:
            self._payload_writer(session.rank).sent(sent)

    def _record_delivery(self, rank: int, key: tuple, payloads: Sequence[Any], what: str) -> None:
        book = self.payloads
        if book is None or not book.records(rank):
            return
        pairs = book.delivered(rank, key, payloads, what)
        if pairs:
            self._payload_writer(rank).received(pairs)
        elif book.stopped and not self._record_warned:
            self._record_warned = True
            log.warning("%s", book.stopped)

    def _close_payloads(self) -> None:
        if self.payloads is None:
            return
        for w in self._payload_writers.values():
            w.close()
        runfolder.write_payload_summary(self.run_dir, self.payloads.summary())

    async def _on_trace(self, session: RankSession, msg: P.TraceRecords, now: int) -> None:
        session.record(msg.payloads)

    async def _on_heartbeat(self, session: RankSession, msg: P.Heartbeat, now: int) -> None:
        session.step = max(session.step, msg.step)

    async def _on_slot_request(self, session: RankSession, msg: P.SlotRequest, now: int) -> None:
        await self._actions(self.scheduler.request(session.rank))

    async def _on_slot_release(self, session: RankSession, msg: P.SlotRelease, now: int) -> None:
        rank = session.rank
        if self.scheduler.state(rank) == S.RankState.RUNNING and self.matcher.waiting_for(rank) is None:
            # What it waits for completed while its Wait and release were
            # on their way: it asks again once it has taken the data in,
            # and must not be swapped out before (it could not ask).
            self.policy.returning(rank)
        await self._actions(self.scheduler.release(rank))

    async def _on_taken(self, session: RankSession, msg: P.Taken, now: int) -> None:
        # Only a rank that still waits for something incomplete may go:
        # if what it waits for has completed, it asks for a slot at once
        # (a Taken for other data can cross that completion).
        if self.matcher.waiting_for(session.rank) is not None:
            await self._actions(self.policy.taken(session.rank, self.scheduler))

    async def _on_goodbye(self, session: RankSession, msg: P.Goodbye, now: int) -> None:
        rank = session.rank
        session.end(msg.status, msg.message)
        await self._actions(self.scheduler.finish(rank))
        if msg.status == "ok":
            await self._outcomes(self.matcher.rank_finished(rank, now), now)
        else:
            self._failed[rank] = msg.message
            if msg.status == "oom" and self._result is None:
                # A named result before the peers' failures it causes.
                report = msg.message.split("\n\n", 1)[0]
                self._fail("oom", f"{report}\n(the traceback is in {runfolder.log_path(self.run_dir, rank)})", EXIT_OOM)
            await self._outcomes(self.matcher.rank_failed(rank, msg.message, now), now)
            if self._result is None:
                self._fail("rank_failed", f"rank {rank} failed:\n{msg.message.rstrip()}", 1)

    # --- process exits ------------------------------------------------------------

    async def _on_exit(self, ev: RankExited, now: int) -> None:
        session = self.sessions.get(ev.rank)
        if session is None or not session.done:
            # Its last messages (Goodbye, a failure report) may still be on
            # the way: the process watcher and the sockets are separate
            # sources, and under load the exit can be seen first. Judge it
            # after a grace period.
            self._exits[ev.rank] = (ev.code, now)
            return
        await self._judge_exit(ev.rank, ev.code, now)

    async def _judge_exits(self, now: int) -> None:
        for rank, (code, seen) in list(self._exits.items()):
            session = self.sessions.get(rank)
            if (session is not None and session.done) or now - seen >= EXIT_GRACE_NS:
                del self._exits[rank]
                await self._judge_exit(rank, code, now)

    async def _judge_exit(self, rank: int, code: int, now: int) -> None:
        session = self.sessions.get(rank)
        if session is not None and session.done:
            if code != 0 and session.status == "ok" and self._result is None:
                self._failed[rank] = f"exited with status {code} after saying goodbye"
                self._fail("rank_failed", f"{self.rank_word} {rank} exited with status {code} after its script "
                           "ended", 1)
            return
        what = _describe_exit(code)
        if session is not None:
            session.end("died", what)
        self._failed[rank] = what
        await self._rank_died(rank, what, now)
        if self._result is None:
            self._fail("rank_failed", f"{self.rank_word} {rank} {what} (see {runfolder.log_path(self.run_dir, rank)})",
                       1)

    async def _rank_died(self, rank: int, what: str, now: int) -> None:
        """A rank died without its goodbye: its slot is freed and its peers in
        the matcher's open calls fail (an emulation has neither)."""
        await self._actions(self.scheduler.finish(rank))
        await self._outcomes(self.matcher.rank_failed(rank, what, now), now)

    # --- the watchdog -------------------------------------------------------------

    async def _on_tick(self, ev: Tick, now: int) -> None:
        self._watchdog(now)
        await self._rescue(now)
        await self._judge_exits(now)

    def _watchdog(self, now: int) -> None:
        if self.progress is not None:
            steps = [r.step for r in self.ranks.values()] or [-1]
            self.progress.update(now, len(self.ranks), min(steps), max(steps), self.colls_done)
        if now - self.matcher.last_progress_ns < self.quiet_ns or len(self.ranks) < self.world_size:
            # A large world on a small machine takes minutes to start: give up
            # only when registration stalls, not after a fixed time.
            if len(self.ranks) < self.world_size and now - self._last_hello > self.register_stall_ns:
                missing = sorted(set(range(self.world_size)) - set(self.ranks))
                self._fail("deadlock", f"only {len(self.ranks)} of {self.world_size} ranks registered, none in the "
                           f"last {(now - self._last_hello) / 1e9:.0f} s; missing: {_ranks_text(missing)}. Are they "
                           f"launched against {self.bound_endpoint}?", 1)
            return
        live = [r for r, member in self.ranks.items() if not member.done]
        report = self.matcher.deadlock_report(live, now)
        if report is not None:
            self._fail("deadlock", report.text, 1)

    async def _rescue(self, now: int) -> None:
        """Carry out the policy's rescue of ranks after a quiet spell
        (``SwapPolicy.rescue``; a swap counts as progress)."""
        if self._result is not None:
            return
        last = max(self.matcher.last_progress_ns, self._last_swap_ns)
        for step in self.policy.rescue(now, last, self.matcher.waiting_for, self.scheduler):
            self.rescues += 1
            if step.rank is None:
                log.warning("rescue: granting after %.1f s without progress, pins of blocked ranks dropped",
                            step.quiet_ns / 1e9)
            else:
                log.info("rescue: restoring rank %d after %.1f s without progress", step.rank, step.quiet_ns / 1e9)
            await self._actions(step.actions)

    # --- carrying out what the core decided -------------------------------------

    async def _outcomes(self, outcomes: list[M.Outcome], now: int) -> None:
        for out in outcomes:
            if isinstance(out, M.CollectiveDone):
                self.colls_done += 1
                for rank, payloads in out.outputs.items():
                    if self.payloads is not None:
                        self._record_delivery(rank, ("coll", out.gid, out.seq), payloads,
                                              f"{out.op} on group {out.gid} (seq {out.seq})")
                    await self._send(rank, P.CollectiveResult(out.gid, out.seq, payloads=payloads))
                await self._wake(out.outputs)
            elif isinstance(out, M.P2PDone):
                if self.payloads is not None:
                    self._record_delivery(out.dst, ("p2p", out.src, out.dst, out.tag, out.pseq), out.payloads,
                                          f"recv from rank {out.src} tag {out.tag} (pseq {out.pseq})")
                await self._send(out.dst, P.P2PData(out.src, out.dst, out.tag, out.pseq, payloads=out.payloads))
                await self._wake((out.dst,))
            else:
                for rank in out.ranks:
                    await self._send(rank, P.Error(out.code, out.message, rank=rank, gid=out.gid, seq=out.seq))
                if self._result is None:
                    status = {"mismatch": "mismatch", "deadlock": "deadlock", "peer_failed": "rank_failed"}.get(out.code, "invalid")
                    self._fail(status, out.message, 1)

    async def _actions(self, actions: Sequence[S.Action]) -> None:
        for act in actions:
            if isinstance(act, S.Grant):
                await self._send(act.rank, P.SlotGrant(act.rank))
            elif self.swapper is None:
                # Only a GPU swap policy asks for swaps, and it comes with an executor.
                raise S.SchedulerError(f"{act!r}: no swap executor is configured; please report this")
            elif not await self._swap(act):
                return
        if self._result is None and (more := self.policy.retry(self.scheduler)):
            await self._actions(more)

    async def _swap(self, act: S.SwapOut | S.SwapIn) -> bool:
        """Run one swap in a worker thread (it blocks for up to seconds); a
        failure stops the capture. Whether it succeeded."""
        step = min((r.step for r in self.ranks.values()), default=-1)
        fn = self.swapper.swap_out if isinstance(act, S.SwapOut) else self.swapper.swap_in
        try:
            await trio.to_thread.run_sync(fn, act.rank, self.sessions[act.rank].pid, step)
        except Exception as e:  # SwapError, or the driver vanished
            self._fail("swap_failed", str(e), 1)
            return False
        finally:
            self._last_swap_ns = self._now()
        return True

    async def _wake(self, ranks: Iterable[int]) -> None:
        """Data went to ``ranks``: a checkpointed one must come back to copy
        it onto its GPU (``SwapPolicy.wake``)."""
        if self._result is not None:
            return
        for rank in ranks:
            if (actions := self.policy.wake(rank, self.scheduler)):
                await self._actions(actions)

    # --- stopping -------------------------------------------------------------------

    async def _on_interrupted(self, ev: Interrupted, now: int) -> None:
        import signal

        try:
            name = signal.Signals(ev.signum).name
        except ValueError:
            name = f"signal {ev.signum}"
        self._fail("interrupted", f"{self.what} stopped by {name} (the trace so far is kept)", EXIT_INTERRUPTED)

    async def _on_node_lost(self, ev: NodeLost, now: int) -> None:
        self._fail(ev.status, ev.message, 1)

    def _fail(self, status: str, message: str, code: int) -> None:
        if self._result is None:
            self._result = CaptureResult(status, message, code)

    async def _stop(self, events: trio.MemoryReceiveChannel[Event]) -> None:
        """Tell every live rank why the capture stops, keep recording what they
        flush for ``grace_s``, then kill what is left."""
        reason = self._result.message.splitlines()[0] if self._result else "stopped"
        for rank, member in self.ranks.items():
            if not member.done:
                await self._send(rank, P.Shutdown(f"{self.what} stopped: {reason}"))
        with trio.move_on_after(self.grace_s):
            async for event in events:
                await self._handle(event)
                if all(m.done for m in self.ranks.values()):
                    break
        if self._processes is not None:
            await self._call_processes(self._processes.kill_all)

    def _close_traces(self) -> None:
        now = self._now()
        stopped = "stopped by Prism: " + self._result.message.splitlines()[0] if self._result else ""
        for member in self.ranks.values():
            member.close(now, stopped)
        if self._result is not None and not self.hybrid:
            self._close_unregistered(now, stopped)
        self._close_payloads()

    def _close_unregistered(self, now: int, stopped: str) -> None:
        """A capture stopped before some ranks said Hello (a node lost while
        they started): each still gets a file, a ``rank_start`` with what is
        known and a ``rank_end`` "killed", so the run stays valid."""
        for rank in range(self.world_size):
            if rank in self.ranks or runfolder.rank_path(self.run_dir, rank).exists():
                continue
            writer = runfolder.TraceWriter(self.run_dir, rank)
            writer.write(T.RankStart(rank, self.world_size, -1, 0, "", "", "", 0, self._t0))
            writer.write(T.RankEnd(now, "killed", f"never registered; {stopped}"[:4000]))
            writer.close()


def default_stop_signals() -> tuple[int, ...]:
    """``(SIGTERM,)`` when called on the main thread (where trio can catch
    signals), else none: what a command's coordinator stops cleanly on, so
    ``kill -TERM`` (``prism cancel``, a daemon stopping) keeps the trace valid."""
    import signal
    import threading

    return (signal.SIGTERM,) if threading.current_thread() is threading.main_thread() else ()


def _raise_open_files_limit(world_size: int) -> None:
    """One trace file and one connection per rank: a world of 1,024 ranks
    passes the usual soft limit of 1,024 descriptors."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 3 * world_size + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, new), hard))


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:20])) + (f" and {len(ranks) - 20} more" if len(ranks) > 20 else "")


def _describe_exit(code: int) -> str:
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code} without saying goodbye (it crashed or called os._exit)"
