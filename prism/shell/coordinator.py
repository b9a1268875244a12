"""The phase-1 coordinator: a trio shell around the sans-IO matcher and
scheduler (``prism.core.matcher``, ``prism.core.scheduler``).

One task reads the ROUTER socket, one watches the rank processes (when the
coordinator launched them), one ticks the watchdog; each feeds a single
*event channel*, and one loop owns every piece of state and is the only
sender on the socket. So the state needs no locks, and a thousand ranks cost
a thousand dictionary entries, not a thousand tasks.

The capture stops at the first failure, which becomes the result instead of a
hang: a collective mismatch (reported at the arrival that shows it), a
deadlock (after a quiet period), a rank that raised or died. Every rank that
is still alive is told why (``protocol.Error`` or ``protocol.Shutdown``), is
given a grace period to flush its trace, and is then killed; the trace files
are closed with a ``rank_end`` record for every rank, so the run stays valid.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import zmq

from prism.core import matcher as M
from prism.core import protocol as P
from prism.core import scheduler as S
from prism.core import trace as T
from prism.shell import runfolder
from transport.trio_socket import AsyncSocket

log = logging.getLogger("prism.shell.coordinator")

#: The issue asks for a stop within 5 s of the last member's arrival; the
#: matcher reports a mismatch at that very arrival, so this only bounds how
#: long ranks get to flush their traces before they are killed.
DEFAULT_GRACE_S = 3.0
#: DESIGN.md: deadlocks are reported after a configurable quiet period.
DEFAULT_QUIET_S = 30.0
#: With ranks checkpointed, this long without progress (nor a swap) restores
#: them (``Coordinator._rescue``): well above one swap (about 1 s per GB out).
RESCUE_QUIET_NS = 5_000_000_000


@dataclass(frozen=True, slots=True)
class CaptureResult:
    """How a capture ended. ``status`` is "ok", "mismatch", "deadlock",
    "rank_failed", "swap_failed", "invalid" or "internal"; ``exit_code`` is non-zero unless ok."""

    status: str
    message: str
    exit_code: int
    #: Ranks that raised or died, with their last words (traceback text).
    failed_ranks: dict[int, str] = field(default_factory=dict)
    steps_done: int = 0
    wall_s: float = 0.0


@dataclass
class _RankInfo:
    identity: bytes
    hello: P.Hello
    writer: runfolder.TraceWriter
    done: bool = False
    status: str = ""
    message: str = ""
    wrote_end: bool = False
    step: int = -1
    #: coordinator_ns - rank_ns, from the Hello (one host: the transit time).
    clock_offset_ns: int = 0


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

    ``processes`` (optional; may be set after ``run`` started) is the
    launcher's handle on the rank processes (``poll() -> list`` of exit
    codes, None while a rank runs; ``kill_all()``); without it (a standalone coordinator) a dead rank is
    noticed by its silence: the deadlock watchdog names it.
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
        processes: Any = None,
        progress: Progress | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        authenticated: bool = False,
        policy: S.SwapPolicy | None = None,
        swapper: Any = None,
        register_stall_s: float | None = None,
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
        self.processes = processes
        self.progress = progress
        self.clock = clock
        self.authenticated = authenticated
        self.matcher = M.Matcher(world_size)
        self.scheduler = S.Scheduler(slots, range(world_size), policy)
        #: Carries out SwapOut/SwapIn (``prism.shell.swap.SwapExecutor``); None on CPU.
        self.swapper = swapper
        self._last_swap_ns = 0
        #: Ranks restored by ``_rescue`` (each after a quiet spell).
        self.rescues = 0
        self.ranks: dict[int, _RankInfo] = {}
        self.by_identity: dict[bytes, int] = {}
        self.colls_done = 0
        self.bound_endpoint = ""
        self._sock: AsyncSocket | None = None
        self._result: CaptureResult | None = None
        self._failed: dict[int, str] = {}
        #: Exits seen before the rank's Goodbye was handled: rank -> (code, when).
        self._exits: dict[int, tuple[int, int]] = {}
        self._t0 = 0
        #: When the last rank registered (registration stalls end the run).
        self._last_hello = 0

    # --- the event loop -----------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> CaptureResult:
        """Serve until every rank has ended or the capture failed; returns how
        it ended. ``task_status.started`` gets the bound endpoint."""
        self._t0 = self.clock()
        self._last_hello = self._t0
        self.matcher.last_progress_ns = self._t0
        runfolder.make_run_dir(self.run_dir)
        _raise_open_files_limit(self.world_size)
        sock = AsyncSocket.create(zmq.ROUTER)
        self._sock = sock
        try:
            sock.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.bound_endpoint = sock.bind(self.endpoint, authenticated=self.authenticated)
            send, recv = trio.open_memory_channel[tuple](math.inf)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_socket, sock, send.clone())
                nursery.start_soon(self._tick, send.clone())
                nursery.start_soon(self._watch_processes, send.clone())
                send.close()
                task_status.started(self.bound_endpoint)
                async for event in recv:
                    await self._handle(event)
                    if self._finished() or self._result is not None:
                        break
                if self._result is not None and not self._finished():
                    await self._stop(recv)
                nursery.cancel_scope.cancel()
        finally:
            self._close_writers()
            sock.close()
            if self.progress is not None:
                self.progress.close()
        result = self._result or CaptureResult("ok", f"all {self.world_size} ranks finished", 0)
        steps = min((r.step for r in self.ranks.values()), default=-1) + 1
        return CaptureResult(result.status, result.message, result.exit_code, dict(self._failed),
                             steps, (self.clock() - self._t0) / 1e9)

    async def _read_socket(self, sock: AsyncSocket, out: trio.MemorySendChannel) -> None:
        async with out:
            while True:
                try:
                    identity, msg = await sock.recv_message()
                except P.ProtocolError as e:
                    await out.send(("bad", getattr(e, "identity", None), e))
                    continue
                await out.send(("msg", identity, msg))

    async def _tick(self, out: trio.MemorySendChannel) -> None:
        async with out:
            while True:
                await trio.sleep(0.5)
                await out.send(("tick", None, None))

    async def _watch_processes(self, out: trio.MemorySendChannel) -> None:
        seen: set[int] = set()
        async with out:
            while True:
                await trio.sleep(0.1)
                if self.processes is None:
                    continue
                for rank, code in enumerate(self.processes.poll()):
                    if code is not None and rank not in seen:
                        seen.add(rank)
                        await out.send(("exit", rank, code))

    def _finished(self) -> bool:
        return len(self.ranks) == self.world_size and all(r.done for r in self.ranks.values())

    async def _handle(self, event: tuple) -> None:
        kind, a, b = event
        now = self.clock()
        if kind == "msg":
            await self._on_message(a, b, now)
        elif kind == "bad":
            await self._on_bad_message(a, b)
        elif kind == "exit":
            await self._on_exit(a, b, now)
        elif kind == "tick":
            self._on_tick(now)
            await self._rescue(now)
            await self._judge_exits(now)

    async def _send(self, rank_or_identity: int | bytes, msg: P.Message) -> None:
        if isinstance(rank_or_identity, int):
            info = self.ranks.get(rank_or_identity)
            if info is None or info.done:
                return
            identity = info.identity
        else:
            identity = rank_or_identity
        try:
            await self._sock.send_message(msg, identity=identity)
        except zmq.ZMQError as e:
            # EHOSTUNREACH: the peer disconnected; its exit is handled elsewhere.
            log.debug("could not send %s: %s", type(msg).__name__, e)

    async def _on_bad_message(self, identity: bytes | None, err: Exception) -> None:
        rank = self.by_identity.get(identity, -1) if identity else -1
        who = f"rank {rank}" if rank >= 0 else "an unregistered peer"
        text = f"malformed message from {who}: {err}"
        if identity is not None:
            await self._send(identity, P.Error("bad_message", text, rank=rank))
        if rank >= 0:
            self._fail("invalid", f"{text}\nThis is a Prism bug or a version mismatch; please report it.", 1)

    async def _on_message(self, identity: bytes, msg: P.Message, now: int) -> None:
        if isinstance(msg, P.Hello):
            await self._on_hello(identity, msg, now)
            return
        rank = self.by_identity.get(identity)
        if rank is None:
            await self._send(identity, P.Error("bad_message", f"{type(msg).__name__} before Hello: say Hello first"))
            return
        info = self.ranks[rank]
        if isinstance(msg, P.TraceRecords):
            for line in msg.payloads:
                line = bytes(line)
                if line.startswith(b'{"k":"rank_end"'):
                    info.wrote_end = True
                elif line.startswith(b'{"k":"iter"'):
                    info.step = max(info.step, T.decode_event(line).step)
                info.writer.write_line(line)
            return
        if isinstance(msg, P.CollectiveArrive):
            await self._outcomes(self.matcher.arrive(msg, now), now)
        elif isinstance(msg, P.Send):
            await self._outcomes(self.matcher.send(msg, now), now)
        elif isinstance(msg, P.RecvPost):
            await self._outcomes(self.matcher.recv_post(msg, now), now)
        elif isinstance(msg, P.Wait):
            await self._outcomes(self.matcher.wait(msg, now), now)
        elif isinstance(msg, P.GroupCreate):
            await self._outcomes(self.matcher.group_create(msg, now), now)
        elif isinstance(msg, P.SlotRequest):
            await self._actions(self.scheduler.request(rank))
        elif isinstance(msg, P.SlotRelease):
            returning = getattr(self.scheduler.policy, "returning", None)
            if (returning is not None and self.scheduler.state(rank) == S.RankState.RUNNING
                    and self.matcher.waiting_for(rank) is None):
                # What it waits for completed while its Wait and release were
                # on their way: it asks again once it has taken the data in,
                # and must not be swapped out before (it could not ask).
                returning(rank)
            await self._actions(self.scheduler.release(rank))
        elif isinstance(msg, P.Taken):
            taken = getattr(self.scheduler.policy, "taken", None)
            # Only a rank that still waits for something incomplete may go:
            # if what it waits for has completed, it asks for a slot at once
            # (a Taken for other data can cross that completion).
            if taken is not None and self.matcher.waiting_for(rank) is not None:
                await self._actions(taken(rank, self.scheduler))
        elif isinstance(msg, P.Heartbeat):
            info.step = max(info.step, msg.step)
        elif isinstance(msg, P.Goodbye):
            await self._on_goodbye(rank, msg, now)
        else:
            await self._send(identity, P.Error("bad_message", f"a rank may not send {type(msg).__name__}", rank=rank))

    async def _on_hello(self, identity: bytes, hello: P.Hello, now: int) -> None:
        try:
            P.check_hello(hello, world_size=self.world_size)
            if hello.rank in self.ranks and not self.ranks[hello.rank].done:
                raise P.ProtocolError(
                    f"rank {hello.rank} registered twice (pids {self.ranks[hello.rank].hello.pid} and "
                    f"{hello.pid}): two launches are using the same coordinator")
        except P.ProtocolError as e:
            code = "version" if isinstance(e, P.VersionMismatch) else "bad_message"
            await self._send(identity, P.Error(code, str(e), rank=hello.rank))
            return
        writer = runfolder.TraceWriter(self.run_dir, hello.rank)
        # On one host (ipc or loopback) the monotonic clocks are the same one.
        local = self.bound_endpoint.startswith(("ipc://", "inproc://", "tcp://127.", "tcp://[::1]"))
        self.ranks[hello.rank] = _RankInfo(identity, hello, writer, clock_offset_ns=0 if local else now - hello.t_ns)
        self._last_hello = now
        self.by_identity[identity] = hello.rank
        await self._send(identity, P.Welcome(P.PROTOCOL_VERSION, self.run_id, now, self.small_tensor_limit,
                                                  swapping=self.swapper is not None))

    async def _on_goodbye(self, rank: int, msg: P.Goodbye, now: int) -> None:
        info = self.ranks[rank]
        info.status, info.message = msg.status, msg.message
        info.done = True
        info.writer.flush()
        await self._actions(self.scheduler.finish(rank))
        if msg.status == "ok":
            await self._outcomes(self.matcher.rank_finished(rank, now), now)
        else:
            self._failed[rank] = msg.message
            await self._outcomes(self.matcher.rank_failed(rank, msg.message, now), now)
            if self._result is None:
                self._fail("rank_failed", f"rank {rank} failed:\n{msg.message.rstrip()}", 1)

    async def _on_exit(self, rank: int, code: int, now: int) -> None:
        info = self.ranks.get(rank)
        if info is None or not info.done:
            # Its last messages (Goodbye, a failure report) may still be on
            # the way: the process watcher and the sockets are separate
            # sources, and under load the exit can be seen first. Judge it
            # after a grace period.
            self._exits[rank] = (code, now)
            return
        await self._judge_exit(rank, code, now)

    async def _judge_exits(self, now: int) -> None:
        for rank, (code, seen) in list(self._exits.items()):
            info = self.ranks.get(rank)
            if (info is not None and info.done) or now - seen >= EXIT_GRACE_NS:
                del self._exits[rank]
                await self._judge_exit(rank, code, now)

    async def _judge_exit(self, rank: int, code: int, now: int) -> None:
        info = self.ranks.get(rank)
        if info is not None and info.done:
            if code != 0 and info.status == "ok" and self._result is None:
                self._failed[rank] = f"exited with status {code} after saying goodbye"
                self._fail("rank_failed", f"rank {rank} exited with status {code} after its script ended", 1)
            return
        what = _describe_exit(code)
        if info is not None:
            info.done, info.status, info.message = True, "died", what
            info.writer.flush()
        self._failed[rank] = what
        await self._actions(self.scheduler.finish(rank))
        await self._outcomes(self.matcher.rank_failed(rank, what, now), now)
        if self._result is None:
            self._fail("rank_failed", f"rank {rank} {what} (see {runfolder.log_path(self.run_dir, rank)})", 1)

    def _on_tick(self, now: int) -> None:
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
        live = [r for r, info in self.ranks.items() if not info.done]
        report = self.matcher.deadlock_report(live, now)
        if report is not None:
            self._fail("deadlock", report.text, 1)

    async def _outcomes(self, outcomes: list[M.Outcome], now: int) -> None:
        for out in outcomes:
            if isinstance(out, M.CollectiveDone):
                self.colls_done += 1
                for rank, payloads in out.outputs.items():
                    await self._send(rank, P.CollectiveResult(out.gid, out.seq, payloads=payloads))
                await self._wake(out.outputs)
            elif isinstance(out, M.P2PDone):
                await self._send(out.dst, P.P2PData(out.src, out.dst, out.tag, out.pseq, payloads=out.payloads))
                await self._wake((out.dst,))
            else:
                for rank in out.ranks:
                    await self._send(rank, P.Error(out.code, out.message, rank=rank, gid=out.gid, seq=out.seq))
                if self._result is None:
                    status = {"mismatch": "mismatch", "deadlock": "deadlock", "peer_failed": "rank_failed"}.get(out.code, "invalid")
                    self._fail(status, out.message, 1)

    async def _actions(self, actions: list[S.Action]) -> None:
        for act in actions:
            if isinstance(act, S.Grant):
                await self._send(act.rank, P.SlotGrant(act.rank))
            elif self.swapper is None:
                # Only a GPU swap policy asks for swaps, and it comes with an executor.
                raise S.SchedulerError(f"{act!r}: no swap executor is configured; please report this")
            elif not await self._swap(act):
                return
        retry = getattr(self.scheduler.policy, "retry", None)
        if retry is not None and self._result is None and (more := retry(self.scheduler)):
            await self._actions(more)

    async def _swap(self, act: S.SwapOut | S.SwapIn) -> bool:
        """Run one swap in a worker thread (it blocks for up to seconds); a
        failure stops the capture. Whether it succeeded."""
        step = min((r.step for r in self.ranks.values()), default=-1)
        fn = self.swapper.swap_out if isinstance(act, S.SwapOut) else self.swapper.swap_in
        try:
            await trio.to_thread.run_sync(fn, act.rank, step)
        except Exception as e:  # SwapError, or the driver vanished
            self._fail("swap_failed", str(e), 1)
            return False
        finally:
            self._last_swap_ns = self.clock()
        return True

    async def _wake(self, ranks: Any) -> None:
        """Data went to ``ranks``: a checkpointed one must come back to copy
        it onto its GPU (see ``prism.core.residency``)."""
        wake = getattr(self.scheduler.policy, "wake", None)
        if wake is None or self._result is not None:
            return
        for rank in ranks:
            if (actions := wake(rank, self.scheduler)):
                await self._actions(actions)

    async def _rescue(self, now: int) -> None:
        """Nothing progressed for ``RESCUE_QUIET_NS`` although ranks are
        checkpointed: bring them back as if data had reached them. A rank can
        be released without being blocked in communication (the stall monitor
        judges by CPU use; a GPU wait looks the same), and a checkpointed rank
        that still had work to do would otherwise hang the capture. First,
        pins of blocked ranks are dropped if ranks wait for a slot (a grant
        held back for a pinned rank that never asked again)."""
        wake = getattr(self.scheduler.policy, "wake", None)
        quiet = now - max(self.matcher.last_progress_ns, self._last_swap_ns)
        if wake is None or self._result is not None or quiet < RESCUE_QUIET_NS:
            return
        self._last_swap_ns = now
        unpin = getattr(self.scheduler.policy, "unpin_blocked", None)
        if unpin is not None and self.scheduler.waiting and (actions := unpin(self.scheduler)):
            # A grant was held back for a pinned rank that never asked again.
            self.rescues += 1
            log.warning("rescue: granting after %.1f s without progress, pins of blocked ranks dropped",
                        quiet / 1e9)
            await self._actions(actions)
        is_resident = getattr(self.scheduler.policy, "is_resident", lambda rank: True)
        for rank in range(self.world_size):
            # Only checkpointed ranks that wait for no known operation (those
            # come back when their data arrives). A rescued rank is not pinned:
            # if it has nothing to do after all, it may go out again.
            if is_resident(rank) or self.matcher.waiting_for(rank) is not None:
                continue
            if (actions := wake(rank, self.scheduler, pin=False)):
                self.rescues += 1
                log.info("rescue: restoring rank %d after %.1f s without progress", rank, quiet / 1e9)
                await self._actions(actions)

    def _fail(self, status: str, message: str, code: int) -> None:
        if self._result is None:
            self._result = CaptureResult(status, message, code)

    async def _stop(self, events: trio.MemoryReceiveChannel) -> None:
        """Tell every live rank why the capture stops, keep recording what they
        flush for ``grace_s``, then kill what is left."""
        reason = self._result.message.splitlines()[0] if self._result else "stopped"
        for rank, info in self.ranks.items():
            if not info.done:
                await self._send(rank, P.Shutdown(f"capture stopped: {reason}"))
        with trio.move_on_after(self.grace_s):
            async for event in events:
                await self._handle(event)
                if all(i.done for i in self.ranks.values()):
                    break
        if self.processes is not None:
            await trio.to_thread.run_sync(self.processes.kill_all)

    def _close_writers(self) -> None:
        now = self.clock()
        for rank, info in self.ranks.items():
            if not info.wrote_end:
                status = info.status or "killed"
                message = info.message or ("stopped by Prism: " + self._result.message.splitlines()[0]
                                           if self._result else "")
                info.writer.write(T.RankEnd(now - info.clock_offset_ns,
                                            status if status in ("ok", "error", "died") else "killed",
                                            message[:4000]))
            info.writer.close()


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


#: How long a rank's exit waits for its Goodbye before it counts as a crash.
EXIT_GRACE_NS = 3_000_000_000


def _describe_exit(code: int) -> str:
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code} without saying goodbye (it crashed or called os._exit)"
