"""The per-process state of a logical rank: its coordinator client, its slot,
its trace recorder and the completion thread of its communication calls.

One ``RankRuntime`` exists per rank process (``current()``); the backend and
the bootstrap reach it through this module.

Slots: the rank holds a slot whenever user code runs. ``start()`` sends
``SlotRequest`` and waits for ``SlotGrant``; ``block_on()`` (a wait on a
communication call that is not done) releases the slot first and requests it
again before returning to user code.

Waits the rank cannot see: DDP's reducer (and other C++ callers) wait on a
Work's torch Future inside C++, where no Python code of Prism runs, so such a
rank would sit on its slot while the member it waits for queues for one. A
*stall monitor* thread watches the main thread's CPU clock: when the rank holds
its slot, has communication in flight and its main thread has used (almost)
no CPU for ``STALL_NS`` and is not runnable (Linux: not in state R, so a
thread merely waiting for a busy CPU keeps its slot), the rank is taken to be blocked: it tells the
coordinator what it waits for (``Wait``) and releases its slot. The completion
thread then takes a slot again *before* it completes the operation, so the
main thread resumes only with a slot, as after an explicit wait. A call's own
message goes out through ``send_call``, under the monitor's lock, so a stall
between taking the slot back and sending cannot send it without one.

Completion: replies resolve ``concurrent.futures.Future`` objects in the
transport's I/O thread. That thread must never block or run user callbacks,
so a done future only queues its operation; the rank's completion thread
copies the results into the output tensors, records the trace event and then
completes the torch Future (running DDP's comm-hook callbacks there, as NCCL's
watchdog thread would).

Iteration ends (``install_step_hooks``): a global optimizer step post hook.
Rule with several optimizers: an iteration ends when every live optimizer has
stepped once since the previous end (ChainedOptimizer, ZeroRedundancyOptimizer
and its inner optimizer); if some optimizer steps a second time before the
others did, the iteration is taken to have ended at the previous step's end.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import queue
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from prism.core import clocksync, protocol, trace
from prism.rank.recorder import RankRecorder
from transport.endpoints import on_one_host

#: Before blocking, a trace batch older than this goes out, and any batch once
#: the rank has been blocked this long, so the coordinator knows what a rank did
#: before a hang (a deadlock's ranks are stopped; an unsent batch was lost, 1 in
#: many runs of ``test_deadlock_is_reported_rank_by_rank``).
FLUSH_BEFORE_BLOCK_NS = 100_000_000
#: The stall monitor's sampling period and how long the main thread must stay
#: (nearly) idle with communication in flight before it counts as blocked.
STALL_PERIOD_S = 0.005
STALL_NS = 10_000_000
#: "Nearly idle": under this share of one CPU over a sampling period.
STALL_BUSY_SHARE = 0.2
#: How many clock probes a rank whose coordinator is on another host sends
#: after its Welcome (``prism.core.clocksync``): ``PRISM_CLOCK_PROBES``, else
#: ``DEFAULT_CLOCK_PROBES``; 0: none, the Hello's round trip alone gives the
#: offset (as before protocol 9). A rank on the coordinator's host sends none.
CLOCK_PROBES_ENV = "PRISM_CLOCK_PROBES"
DEFAULT_CLOCK_PROBES = 8
#: How long a rank waits for the answer to one clock probe.
CLOCK_PROBE_TIMEOUT_S = 30.0


class Client(Protocol):
    """What the rank needs from ``transport.client.BlockingClient``."""

    def send(self, msg: Any) -> None: ...
    def send_frames(self, frames: list[Any]) -> Any: ...
    def future(self, key: tuple[Any, ...]) -> concurrent.futures.Future: ...
    def close(self) -> None: ...


class PrismRankError(RuntimeError):
    """A communication call failed: the coordinator reported an error (a
    mismatch, a peer failure, a deadlock) or shut the run down."""


_current: RankRuntime | None = None


def current() -> RankRuntime:
    """The runtime of this rank process; raises if Prism did not start it."""
    if _current is None:
        raise RuntimeError(
            "the Prism backend is used outside a Prism rank process: start the script "
            "with `python -m prism run ...`, or call prism.rank.runtime.RankRuntime.start() first"
        )
    return _current


class RankRuntime:
    """State of one logical rank process (see the module docstring)."""

    def __init__(
        self,
        client: Client,
        welcome: protocol.Welcome,
        hello: protocol.Hello,
        *,
        welcome_recv_ns: int | None = None,
        clock_probes: int = 0,
    ) -> None:
        self.client = client
        self.welcome = welcome
        self.rank = hello.rank
        self.world_size = hello.world_size
        self.local_rank = hello.local_rank
        self.device = hello.device
        recv = welcome_recv_ns if welcome_recv_ns is not None else hello.t_ns
        endpoint = str(getattr(client, "endpoint", ""))
        #: The clock sync's kept round trip and how long the probes took
        #: (None: no probes were sent).
        self.clock_rtt_ns: int | None = None
        self.clock_sync_ns: int | None = None
        if on_one_host(endpoint):
            # One host: CLOCK_MONOTONIC is system-wide on Linux, so the clocks
            # are the same one; a midpoint estimate would only add the
            # handshake's jitter (tenths of a second while ranks start).
            self.clock_offset_ns = 0
        elif clock_probes > 0 and endpoint.startswith("tcp://"):
            # Another host: the Hello's round trip holds the connect and the
            # CURVE handshake (tens of ms); probe with small messages.
            t = time.monotonic_ns()
            best = sync_clock(client, self.rank, clock_probes)
            self.clock_sync_ns = time.monotonic_ns() - t
            self.clock_offset_ns, self.clock_rtt_ns = best.offset_ns, best.rtt_ns
        else:
            # no probes wanted, or a client with no tcp endpoint (a test's fake coordinator)
            self.clock_offset_ns = welcome.t_ns - (hello.t_ns + recv) // 2
        self.recorder = RankRecorder(self.rank, client.send, small_tensor_limit=welcome.small_tensor_limit)
        #: Emulation (``Welcome.hybrid``): how long Prism itself has held this
        #: rank in its waits beyond the emulated release (staging, messages,
        #: the coordinator's turn). The times the rank sends are its monotonic
        #: clock less this (``emu_ns``), so the emulated timeline is what the
        #: real job's would be, without Prism's overhead; the rank's own trace
        #: keeps the wall clock. The main thread adds its waits' excess, a GPU
        #: sandbox's reach watcher its stream's (``add_dilation``).
        self.dilation_ns = 0
        #: Told the new dilation as it moves (a GPU sandbox's shared release flags).
        self.on_dilation: Callable[[int], None] | None = None
        self._dilation_lock = threading.Lock()
        #: When the main thread last came back from a blocking wait
        #: (``waited``; emulation only): the front-end wrapper dilates out
        #: the way from there back to the caller.
        self.last_resumed_ns: int | None = None
        self.hybrid = bool(getattr(welcome, "hybrid", False))
        self._slot_lock = threading.Lock()
        #: Device-path arrivals waiting to leave with their reach (``defer_arrival``; protocol 12):
        #: ((gid, seq), header), in issue order.
        self._deferred: collections.deque = collections.deque()
        # reentrant: a send dispatches the replies that came meanwhile, whose callbacks may send too
        self._defer_lock = threading.RLock()
        self._holds_slot = False
        self._blocked = 0
        #: What the main thread waits for in ``block_on`` (None: not waiting).
        self._awaited: threading.Event | None = None
        self._completions: queue.SimpleQueue = queue.SimpleQueue()
        self._completer = threading.Thread(target=self._complete_loop, name="prism-completer", daemon=True)
        self._pseq: dict[tuple[int, int, int], int] = {}
        self._pseq_lock = threading.Lock()
        self.groups_created = 0
        self._finished = False
        #: Operations in flight (id -> op), oldest first, for the stall monitor.
        self._pending: dict[int, Any] = {}
        #: The stall monitor released the slot on the main thread's behalf.
        self._implicit = False
        self._main_ident = threading.main_thread().ident
        self._main_native_id = threading.main_thread().native_id
        self._pending_cond = threading.Condition(self._slot_lock)
        self._monitor = threading.Thread(target=self._stall_loop, name="prism-stall-monitor", daemon=True)

    # --- lifecycle ---------------------------------------------------------

    def start(self, *, physical_device: str | None = None) -> None:
        """Become the process's runtime, emit RankStart and take a slot."""
        global _current
        _current = self
        self._completer.start()
        self._monitor.start()
        t = time.monotonic_ns()
        self.recorder.emit(
            trace.RankStart(
                rank=self.rank,
                world_size=self.world_size,
                local_rank=self.local_rank,
                pid=os.getpid(),
                hostname=socket.gethostname(),
                device=self.device,
                physical_device=physical_device or self.device,
                clock_offset_ns=self.clock_offset_ns,
                start_ns=t,
            )
        )
        from prism.rank import devices

        if devices.installed() and not self.hybrid:
            # (an emulation's GPU sandbox runs as the real job: no per-segment
            # GPU timing, which synchronises the device at every call)
            from prism.rank import gputime

            timing = gputime.from_env(devices.mode(), swapping=self.welcome.swapping)
            if timing is not None:
                timing.install()
                self.recorder.attach_gpu(timing)
        with self._slot_lock:
            self._acquire_locked()
        self.recorder.start_segment(time.monotonic_ns())

    def finish(self, status: str, message: str = "", end_ns: int | None = None) -> None:
        """Flush the trace (RankEnd) and say Goodbye; idempotent. ``end_ns``:
        when the script ended (monotonic; default now). The Goodbye carries it
        on the dilated clock, so Prism's own work after the script (the device
        path's report and call log, the trace's last flush) is not the job's:
        an emulation closes the sandbox's last segment there, and counted it
        in the last step before (2026-12-08: 3-5 ms on a GPU sandbox whose
        call log was written)."""
        if self._finished:
            return
        with self._slot_lock:
            self._finished = True
            self._pending_cond.notify()
        step_tracker = _step_tracker
        if step_tracker is not None:
            step_tracker.flush_pending()
        self.recorder.finish(time.monotonic_ns(), status, message)
        self.flush_arrivals()
        self.client.send(protocol.Goodbye(rank=self.rank, status=status, message=message,
                                          t_ns=self.emu_ns(time.monotonic_ns() if end_ns is None else end_ns)))

    # --- the dilated clock (emulation) -----------------------------------------

    def emu_ns(self, t_ns: int) -> int:
        """``t_ns`` (monotonic) on the dilated clock the emulation's coordinator keeps for this rank."""
        return t_ns - self.dilation_ns

    def add_dilation(self, ns: int) -> None:
        """Prism delayed this rank by ``ns`` more (any thread)."""
        with self._dilation_lock:
            self.dilation_ns += ns
            if self.on_dilation is not None:
                self.on_dilation(self.dilation_ns)

    def waited(self, release_mono_ns: int, wait_start_ns: int, resumed_ns: int) -> None:
        """The main thread waited from ``wait_start_ns`` to ``resumed_ns`` for a
        result the emulated job releases at ``release_mono_ns`` (monotonic):
        what it waited past the release is Prism's, not the job's."""
        if not self.hybrid or not release_mono_ns:
            return
        self.last_resumed_ns = resumed_ns
        late = resumed_ns - max(release_mono_ns, wait_start_ns)
        if late > 0:
            self.add_dilation(late)

    # --- slots -------------------------------------------------------------

    def _acquire_locked(self) -> None:
        fut = self.client.future(("slot",))
        self.client.send(protocol.SlotRequest(rank=self.rank))
        try:
            fut.result()
        except Exception as e:  # CoordinatorError, or the client closing
            raise PrismRankError(f"rank {self.rank}: waiting for a slot failed: {e}") from e
        self._holds_slot = True
        self._pending_cond.notify()  # the stall monitor may have something to watch again

    def block_on(self, done: threading.Event, what: str, t_ns: int) -> None:
        """Wait for ``done`` without holding the slot (see the module docstring).

        ``t_ns`` is when the rank started to wait. Returns holding the slot.
        """
        self.recorder.flush_if_old(FLUSH_BEFORE_BLOCK_NS)
        self.flush_arrivals()
        self.client.send(protocol.Wait(rank=self.rank, what=what, t_ns=self.emu_ns(t_ns)))
        with self._slot_lock:
            self._blocked += 1
            self._awaited = done
            if self._holds_slot:
                self.client.send(protocol.SlotRelease(rank=self.rank))
                self._holds_slot = False
        try:
            if not done.wait(FLUSH_BEFORE_BLOCK_NS / 1e9):
                # Blocked a while (a hang, maybe): what the rank did before goes
                # out now, not with a batch a killed rank never sends.
                self.recorder.flush()
                done.wait()
        finally:
            with self._slot_lock:
                self._blocked -= 1
                self._awaited = None
                if not self._holds_slot:
                    self._acquire_locked()
                self._pending_cond.notify()

    # --- waits inside C++ (see the module docstring) --------------------------

    def track(self, op: Any) -> None:
        """``op`` (with ``wait_key``, ``issue_ns``, ``wait_ns``, ``lock``) is in flight."""
        with self._slot_lock:
            self._pending[id(op)] = op
            self._pending_cond.notify()

    def untrack(self, op: Any) -> None:
        with self._slot_lock:
            self._pending.pop(id(op), None)

    def ensure_slot(self) -> None:
        """Called as a communication call starts: if the stall monitor gave the
        slot away while the main thread was in fact about to go on (it waited
        for the GIL, say), take it back before the call goes out."""
        with self._slot_lock:
            if not self._implicit or self._holds_slot:
                return
            self._implicit = False
            self._acquire_locked()
        self.recorder.comm_exit(time.monotonic_ns())

    def send_call(self, msg: Any, frames: list[Any] | None = None) -> None:
        """Send a communication call's message (``CollectiveArrive``, ``Send``,
        ``RecvPost``) holding the slot. The stall monitor may have given the
        slot away after ``ensure_slot`` while the main thread staged the
        payload (it waited for the GIL or a device copy with no CPU use):
        take it back first, under the lock the monitor takes, so the message
        can never leave without a slot. ``frames``: the message already
        encoded (``BlockingClient.send_frames``; ``msg`` is then None)."""
        with self._slot_lock:
            retaken = self._implicit and not self._holds_slot
            if retaken:
                self._implicit = False
                self._acquire_locked()
            self.flush_arrivals()
            if frames is None:
                self.client.send(msg)
            else:
                self.client.send_frames(frames)
        if retaken:
            self.recorder.comm_exit(time.monotonic_ns())

    # --- arrivals sent at the reach (protocol 12) ------------------------------

    def defer_arrival(self, key: tuple[str, int], arrival: Any) -> None:
        """A device-path call ``key`` (its ``Reached``'s (gid, seq)) whose
        stream's reach is watched: its arrival (a ``protocol.header_template``
        filled in, or a ``Send``/``RecvPost``) leaves with the reach
        (``reached``), one message where an arrival at issue and a
        ``Reached`` were two, and none on the calling thread; or, without its
        reach, before the next message the coordinator takes in order
        (``flush_arrivals``)."""
        with self._defer_lock:
            self._deferred.append((key, arrival))

    def _send_arrival(self, arrival: Any, reach_ns: int = 0) -> None:
        if isinstance(arrival, dict):
            if reach_ns:
                arrival["reach_ns"] = reach_ns
            self.client.send_frames(protocol.encode_header(arrival))
        else:
            self.client.send(dataclasses.replace(arrival, reach_ns=reach_ns) if reach_ns else arrival)

    def flush_arrivals(self) -> None:
        """Send, in issue order, the arrivals still waiting for their reach
        (each announces it later with a ``Reached``): before any call, wait or
        goodbye message, so the coordinator takes the rank's calls in the
        order the rank made them."""
        # Always under the lock: another thread may have popped the last one
        # and not yet handed it to the client (an empty deque then says nothing).
        with self._defer_lock:
            while self._deferred:
                self._send_arrival(self._deferred.popleft()[1])

    def reached(self, key: tuple[str, int], at_mono_ns: int) -> None:
        """The stream reached the device-path call ``key`` at ``at_mono_ns``:
        its arrival leaves now with the reach in it if it still waits (those
        issued before it first, without theirs), else a ``Reached`` says it."""
        at = self.emu_ns(at_mono_ns)
        if self._deferred:
            with self._defer_lock:
                if any(k == key for k, _ in self._deferred):
                    while self._deferred:  # (a reply's callback, sending, may have flushed the rest meanwhile)
                        k, arrival = self._deferred.popleft()
                        if k == key:
                            self._send_arrival(arrival, at)
                            return
                        self._send_arrival(arrival)
        self.client.send(protocol.Reached(self.rank, key[0], key[1], at))

    def before_complete(self, op: Any) -> None:
        """Called by the completion thread before it completes ``op``: if the
        monitor released the slot, take one again first."""
        with self._slot_lock:
            self._pending.pop(id(op), None)
            implicit, self._implicit = self._implicit, False
            if implicit and not self._holds_slot:
                self._acquire_locked()
            self._pending_cond.notify()
        if implicit:
            self.recorder.comm_exit(time.monotonic_ns())

    def _watchable(self) -> bool:
        """Whether the stall monitor has something to watch (``_slot_lock`` held):
        a call in flight while the main thread holds the slot and is not in
        an explicit wait."""
        return bool(self._pending) and self._holds_slot and self._blocked == 0 and not self._implicit

    def _stall_loop(self) -> None:
        try:
            clock = time.pthread_getcpuclockid(self._main_ident)
        except (OSError, AttributeError):  # no per-thread CPU clocks here
            return
        period_ns = int(STALL_PERIOD_S * 1e9)
        last = time.clock_gettime_ns(clock)
        idle_since: int | None = None
        while not self._finished:
            with self._slot_lock:
                if not self._watchable():
                    # Nothing to watch (no call in flight, or the rank waits
                    # without its slot): sleep until that changes, rather than
                    # waking every period in every rank of a large world (in a
                    # world of 512 on 2 cores nearly every rank waits in a call).
                    self._pending_cond.wait_for(lambda: self._watchable() or self._finished)
                    try:
                        last = time.clock_gettime_ns(clock)
                    except OSError:  # the main thread is gone
                        return
                    idle_since = None
            time.sleep(STALL_PERIOD_S)
            try:
                cpu = time.clock_gettime_ns(clock)
            except OSError:  # the main thread is gone
                return
            busy, last = cpu - last, cpu
            now = time.monotonic_ns()
            with self._slot_lock:
                eligible = self._holds_slot and self._blocked == 0 and bool(self._pending) and not self._implicit
            if not eligible or busy > STALL_BUSY_SHARE * period_ns:
                idle_since = None
                continue
            if idle_since is None:
                idle_since = now - period_ns
            if now - idle_since < STALL_NS or _thread_runnable(self._main_native_id):
                # A runnable main thread that got no CPU was descheduled on a
                # busy machine, not blocked: it keeps its slot.
                continue
            with self._slot_lock:
                if not (self._holds_slot and self._blocked == 0 and self._pending and not self._implicit):
                    continue
                op = next(iter(self._pending.values()))
                self._implicit = True
                self._holds_slot = False
                self.recorder.comm_enter(idle_since, settle=False)
                with op.lock:
                    if op.wait_ns is None:
                        # The main thread may have gone idle before this op was issued.
                        op.wait_ns = max(idle_since, op.issue_ns)
                key = op.wait_key
                # No reference past this point: this frame lives on while the
                # monitor sleeps, and an op held here keeps the call's tensors
                # (the program's GPU memory) alive after the program dropped
                # them, raising its peak (+4 KiB on one rank of GPT tp2 dp2
                # through agents on an H200, 2026-12-04).
                del op
                self.flush_arrivals()
                self.client.send(protocol.Wait(rank=self.rank, what=key, t_ns=self.emu_ns(idle_since)))
                self.client.send(protocol.SlotRelease(rank=self.rank))
            idle_since = None

    # --- p2p sequence numbers ------------------------------------------------

    def next_pseq(self, src: int, dst: int, tag: int) -> int:
        """Sequence number of the next message from ``src`` to ``dst`` with ``tag``."""
        with self._pseq_lock:
            key = (src, dst, tag)
            n = self._pseq.get(key, 0)
            self._pseq[key] = n + 1
            return n

    # --- completion --------------------------------------------------------

    def on_done(self, fut: concurrent.futures.Future, handler: Callable[[concurrent.futures.Future], None]) -> None:
        """Run ``handler(fut)`` in the completion thread once ``fut`` is done."""
        fut.add_done_callback(lambda f: self._completions.put((handler, f)))

    def _complete_loop(self) -> None:
        from prism.rank import devices

        bound = False
        while True:
            handler, fut = self._completions.get()
            if not bound:
                try:
                    bound = devices.bind_thread()
                except Exception as e:  # noqa: BLE001 (a second context costs memory; a skipped handler would hang)
                    bound = True
                    print(f"Prism (rank {self.rank}): could not select this rank's GPU in the completion thread "
                          f"({e}); results are still delivered", file=sys.stderr)
            try:
                handler(fut)
            except BaseException:
                # The thread must survive, or every later call would hang.
                print(f"Prism (rank {self.rank}): completing a call failed; this is a Prism bug, "
                      "please report it with this traceback:", file=sys.stderr)
                traceback.print_exc()
            if self.welcome.swapping:
                self._say_taken()
            # Drop the finished call before waiting for the next: the handler
            # holds the op and its output tensors, which would otherwise stay
            # alive (GPU memory the real run has freed) until the next reply.
            del handler, fut

    def _say_taken(self) -> None:
        """After a delivery: if the main thread still waits (for another
        call), tell the coordinator the data is in, so this rank's GPU state
        may be swapped out again (it was brought back to take the data)."""
        with self._slot_lock:
            waiting = (self._awaited is not None and not self._awaited.is_set() and not self._holds_slot
                       and not self._finished)
        if waiting:
            self.client.send(protocol.Taken(rank=self.rank))


def _thread_runnable(native_id: int | None) -> bool:
    """Whether the thread is running or waiting for a CPU (Linux: state "R"
    in /proc); False where that cannot be read, leaving the CPU-time test."""
    if native_id is None:
        return False
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # The state follows the parenthesised command name, which may hold spaces.
    return stat[stat.rfind(b")") + 2: stat.rfind(b")") + 3] == b"R"


def clock_probes_from_env() -> int:
    """``PRISM_CLOCK_PROBES`` (``CLOCK_PROBES_ENV``), else ``DEFAULT_CLOCK_PROBES``."""
    raw = os.environ.get(CLOCK_PROBES_ENV, "").strip()
    if not raw:
        return DEFAULT_CLOCK_PROBES
    try:
        n = int(raw)
        if n < 0:
            raise ValueError
    except ValueError:
        raise SystemExit(f"prism: {CLOCK_PROBES_ENV}={raw!r}: give how many clock probes a rank on another host "
                         f"sends, an integer >= 0 (default {DEFAULT_CLOCK_PROBES}; 0: none)") from None
    return n


def sync_clock(client: Client, rank: int, probes: int, *,
               timeout: float = CLOCK_PROBE_TIMEOUT_S) -> clocksync.ClockSample:
    """Right after the Welcome: send ``probes`` ``ClockProbe`` messages, one
    at a time, keep the sample with the shortest round trip
    (``clocksync.best_sample``) and tell the coordinator its offset
    (``ClockOffset``), so both sides convert with the same one."""
    samples = []
    for seq in range(probes):
        echo = client.future(("clock", seq))
        sent = time.monotonic_ns()
        client.send(protocol.ClockProbe(rank, seq, sent))
        try:
            reply = echo.result(timeout)
        except concurrent.futures.TimeoutError:
            raise PrismRankError(f"rank {rank}: the coordinator did not answer clock probe {seq} within "
                                 f"{timeout:g} s") from None
        samples.append(clocksync.ClockSample(sent, reply.t_ns, time.monotonic_ns()))
    best = clocksync.best_sample(samples)
    client.send(protocol.ClockOffset(rank, best.offset_ns, best.rtt_ns))
    return best


def make_hello(rank: int, world_size: int, local_rank: int, device: str) -> protocol.Hello:
    """The Hello this process sends (its monotonic clock now)."""
    return protocol.Hello(
        protocol_version=protocol.PROTOCOL_VERSION,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        pid=os.getpid(),
        hostname=socket.gethostname(),
        device=device,
        t_ns=time.monotonic_ns(),
    )


# --- iteration ends and memory ------------------------------------------------


class _StepTracker:
    """Marks iteration ends from optimizer steps (rule in the module docstring)."""

    def __init__(self, runtime: RankRuntime, clock: Callable[[], int] = time.monotonic_ns,
                 resume_clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.runtime = runtime
        self.clock = clock
        #: When the next step's first segment opens (after Prism's step-end work).
        self.resume_clock = resume_clock
        self.live: weakref.WeakSet = weakref.WeakSet()
        self._stepped: set[int] = set()
        self._pending_end: int | None = None
        self._lock = threading.Lock()

    def on_init(self, optimizer: Any) -> None:
        self.live.add(optimizer)

    def on_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        t = self.clock()
        with self._lock:
            self.live.add(optimizer)
            if id(optimizer) in self._stepped and self._pending_end is not None:
                self._end(self._pending_end)
            self._stepped.add(id(optimizer))
            self._pending_end = t
            if all(id(o) in self._stepped for o in self.live):
                self._end(t)

    def flush_pending(self) -> None:
        with self._lock:
            if self._pending_end is not None:
                self._end(self._pending_end)

    def _end(self, end_ns: int) -> None:
        self._stepped.clear()
        self._pending_end = None
        self.runtime.recorder.end_step(end_ns, extra=_cuda_memory_sample, resume_clock=self.resume_clock)


def _cuda_memory_sample(t_ns: int, step: int) -> trace.Memory | None:
    """Memory event for the current CUDA device (peak since the last sample);
    None where CUDA was never initialised. The script's own readings are not
    affected (``prism.rank.memstats``)."""
    import torch

    from prism.rank import memstats

    if not torch.cuda.is_initialized():
        return None
    memstats.install()
    dev = torch.cuda.current_device()  # the script's (logical) index names the device in the trace
    allocated, reserved, peak = memstats.step_sample(torch._C._cuda_getDevice())  # the in-process one reads it
    return trace.Memory(t_ns=t_ns, device=f"cuda:{dev}", allocated=allocated, reserved=reserved,
                        peak_allocated=peak, step=step)


_step_tracker: _StepTracker | None = None


def install_step_hooks(runtime: RankRuntime) -> None:
    """Mark iteration ends on optimizer steps, without touching the script."""
    global _step_tracker
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    if _step_tracker is not None:
        _step_tracker.runtime = runtime
        return
    tracker = _StepTracker(runtime)
    original_init = torch.optim.Optimizer.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        tracker.on_init(self)

    # Counting live optimizers needs their construction; the global hooks only
    # see steps.
    torch.optim.Optimizer.__init__ = __init__  # type: ignore[method-assign]
    register_optimizer_step_post_hook(tracker.on_step)
    _step_tracker = tracker
