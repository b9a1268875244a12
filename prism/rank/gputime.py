"""Two-clock timing of a GPU rank's compute segments (docs/GPU-TIMING.md).

A real NCCL run never waits for the GPU at a collective: the CPU queues the
next kernels while the GPU runs the current ones. A capture must (it copies
CUDA tensors to host), so each segment's wall time is CPU issue time plus the
GPU's tail. This module gives the recorder, per segment:

- ``cpu_ns``: from the segment's start to where the rank began waiting for
  the GPU, minus Prism's own per-call cost (the logical-device
  ``TorchFunctionMode``: its calls are counted and its per-call overhead is
  measured once, in this process, against the same loop without the mode);
- ``gpu_ns``: the GPU's busy time for the segment's kernels, on calibration
  steps only (``PRISM_GPU_CALIBRATE``, default steps 1 and 2). At the start
  of such a segment the GPU is idle (the capture drained it), so a spin kernel
  (``torch.cuda._sleep``) is queued first, longer than the CPU will take to
  issue the segment, then a timing event: the segment's kernels then run back
  to back and the event pair around them measures their busy time without
  the gaps in which the GPU waited for the CPU. If the spin ended before the
  CPU finished issuing (the event had completed when the segment closed), the
  measurement is discarded (``-2``) and later spins are longer. Scripts that
  run kernels on streams of their own (FSDP2's copy-in, all-gather and
  reduce-scatter streams) are covered: every stream the script makes current
  (``torch.cuda.set_stream``, which ``torch.cuda.stream(...)`` uses) is
  remembered; on a calibrated segment each waits for the spin's event, and
  the closing event, on the spin's stream, waits for each of them. (A closing
  event on whatever stream is current, FSDP2's side stream at its calls,
  would give negative or partial busy times);
- exclusive GPU: ranks that share a physical GPU take turns on it (a
  per-GPU ``flock``, held while the rank computes a segment and while its
  completion thread copies results in), so no segment's times include
  another process's kernels or copies time-sliced in (``PRISM_GPU_EXCLUSIVE=0``
  turns it off);
- ``join``: the segment ended where the script waited for the GPU:
  ``torch.cuda.synchronize``, and every operation torch's sync debug mode
  reports (``.item()``, ``.tolist()``, copies to host, ``nonzero``...; the
  mode is set to ``warn`` and the warnings are taken here, not shown), and
  the step's end. A join segment's CPU share ends where the waiting call
  began (``torch.cuda.synchronize``: its call; a sync debug warning: the
  start of the last torch call through the logical-device mode, which the
  mode stamps), else at the wait's end.

- ``free_ns`` (PrismTrace 1.2): on uncalibrated segments, the wall time less
  Prism's per-call cost: the segment started on an idle GPU (the capture
  drained it), so this is its finish with nothing queued ahead, which the
  replay keeps as a floor (a pipeline's backward after ``.item()`` issues
  its first kernels one at a time while the GPU waits);
- ``cold_ns`` (1.2): segments that follow a communication call start with a
  cold CPU (the rank waited for the coordinator; the real job's CPU does not
  wait there): ``measure_cold_start`` times it once, when CUDA is up, and
  the replay takes it off.

Only ranks that drive a GPU use it; CPU ranks keep one clock.
"""

from __future__ import annotations

import fcntl
import os
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

#: Steps whose segments are calibrated ("1,2"; "" or "none": none).
CALIBRATE_ENV = "PRISM_GPU_CALIBRATE"
DEFAULT_CALIBRATE = "2,3"
#: Set to 0 to record one clock on GPU ranks (as before PrismTrace 1.1).
TWO_CLOCK_ENV = "PRISM_GPU_TWO_CLOCK"
#: Set to 0 to let ranks that share a GPU run GPU work at the same time.
EXCLUSIVE_ENV = "PRISM_GPU_EXCLUSIVE"
#: Set to 0 to skip the cold-start probe (``cold_ns`` then stays 0).
COLD_ENV = "PRISM_GPU_COLD"
#: The probe's wait before a cold segment (a communication call's round trip
#: through the coordinator takes about this long on one host).
COLD_WAIT_S = 0.001

_SYNC_MESSAGE = "called a synchronizing CUDA operation"
#: Spin bounds (ns) for a calibrated segment.
MIN_SPIN_NS = 500_000
MAX_SPIN_NS = 200_000_000


def parse_steps(text: str) -> frozenset[int]:
    text = text.strip()
    if text in ("", "none"):
        return frozenset()
    out = set()
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            a, b = part.split("-", 1)
            out.update(range(int(a), int(b) + 1))
        elif part:
            out.add(int(part))
    if any(s < 0 for s in out):
        raise ValueError(f"{CALIBRATE_ENV}={text!r}: steps are 0-based and >= 0")
    return frozenset(out)


class GpuTiming:
    """Per-segment CPU share, GPU busy time and joins for one rank's recorder.

    ``open(step)`` at a segment's start (waits for the rank's turn on its GPU,
    returns when the segment starts), ``close(start_ns, script_join)`` at its
    end (waits for the GPU; returns ``(cpu_end_ns, end_ns, cpu_ns, gpu_ns)``),
    ``disarm()`` for a segment closed without waiting; called by the recorder
    under its lock. ``on_script_sync`` is set by the recorder: it is called
    after the script waited for the GPU.
    """

    def __init__(self, calibrate: frozenset[int], mode: Any = None, exclusive: str | None = None) -> None:
        self.calibrate = calibrate
        self.mode = mode  # LogicalDeviceMode with a ``calls`` counter, or None
        self.per_call_ns = 0.0
        self.on_script_sync: Callable[[int], None] | None = None
        self._sync = torch.cuda.synchronize  # the original, for Prism's own waits
        self._ns_per_cycle: float | None = None
        self._armed: Any = None  # the event after the spin, on a calibrated segment
        self._armed_stream: Any = None  # the stream it is on
        #: Streams the script made current (other than the default), by id
        self._streams: dict[tuple[int, int], Any] = {}
        self._segment_open = False
        self._issue_end: int | None = None  # of the script's wait that ends the segment
        self._calls0 = 0
        # Spins are sized from the wall time of the segment at the same
        # position in the last step that was not calibrated.
        self._step = -1
        self._walls: list[int] = []  # this step's segment walls, in order
        self._walls_prev: list[int] = []
        self._factor = 2.0
        #: The cold start after a wait, measured once CUDA is up (None: not yet;
        #: see ``measure_cold_start``); the segment being recorded pays it if it
        #: follows a communication call.
        self.cold_ns: int | None = None if os.environ.get(COLD_ENV, "1") != "0" else 0
        self._after_comm = False
        self._local = threading.local()
        #: Only the script's main thread makes joins (the completion thread's
        #: copies into CUDA outputs also synchronise).
        self._main = threading.get_ident()
        # exclusive use of the physical GPU: a process-wide hold count over a flock
        self._fd: int | None = None
        #: The lock file behind the turns on the GPU, or None.
        self.exclusive: str | None = None
        self._hold = 0
        self._mutex = threading.Lock()
        if exclusive:
            self.exclusive = exclusive
            self._fd = os.open(exclusive, os.O_RDWR | os.O_CREAT, 0o666)

    # --- set-up --------------------------------------------------------------

    def install(self) -> None:
        """Measure the mode's per-call cost and hook the script's GPU waits."""
        if self.mode is not None:
            self.per_call_ns = measure_mode_overhead(self.mode)
        orig = torch.cuda.synchronize
        timing = self

        def synchronize(device: Any = None) -> None:
            t0 = time.monotonic_ns()
            orig(device)
            timing._script_synced(t0)

        synchronize.__doc__ = orig.__doc__
        synchronize.__wrapped__ = orig  # type: ignore[attr-defined]
        torch.cuda.synchronize = synchronize
        set_stream = torch.cuda.set_stream

        def set_stream_seen(stream: Any) -> None:
            timing.saw_stream(stream)
            set_stream(stream)

        set_stream_seen.__doc__ = set_stream.__doc__
        set_stream_seen.__wrapped__ = set_stream  # type: ignore[attr-defined]
        torch.cuda.set_stream = set_stream_seen
        # torch's sync debug mode warns at every synchronising op (after it
        # returns to Python); take those warnings as join points.
        warnings.filterwarnings("always", message=_SYNC_MESSAGE)
        shown = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if _SYNC_MESSAGE in str(message):
                timing._script_synced()
                return
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        self._set_debug_mode()

    def saw_stream(self, stream: Any) -> None:
        """The script made ``stream`` current: calibrated segments cover it."""
        try:
            key = (int(stream.device_index), int(stream.stream_id))
        except (AttributeError, TypeError):
            return
        if key not in self._streams:
            self._streams[key] = stream

    def _side_streams(self, main: Any) -> list[Any]:
        return [s for s in self._streams.values()
                if s.device_index == main.device_index and s.stream_id != main.stream_id]

    def _set_debug_mode(self) -> None:
        try:
            # torch warns once that the mode is a prototype: Prism's doing,
            # not the script's, so it stays out of the rank's log.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
                torch.cuda.set_sync_debug_mode("warn")
        except Exception:  # noqa: BLE001 (older torch or no CUDA: joins then come from synchronize only)
            pass

    def _script_synced(self, issue_end: int | None = None) -> None:
        """The script waited for the GPU; ``issue_end``: when the waiting call
        began (a sync debug warning arrives after the op: then the start of
        the last torch call through the mode, which is that op or holds it)."""
        if threading.get_ident() != self._main or getattr(self._local, "internal", False):
            return
        cb = self.on_script_sync
        if cb is not None:
            if issue_end is None and self.mode is not None:
                issue_end = self.mode.call_ns
            self._issue_end = issue_end
            cb(time.monotonic_ns())

    # --- exclusive GPU -----------------------------------------------------------

    def acquire(self) -> None:
        """Take this process's turn on its GPU (re-entrant across threads)."""
        if self._fd is None:
            return
        with self._mutex:
            if self._hold == 0:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._hold += 1

    def release(self) -> None:
        if self._fd is None:
            return
        with self._mutex:
            if self._hold > 0:
                self._hold -= 1
                if self._hold == 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    # --- segments --------------------------------------------------------------

    def open(self, step: int, after_comm: bool = False) -> int:
        """A segment starts; returns when it may (after the GPU turn).
        ``after_comm``: it follows a communication call (not a join, not a
        step's start), so its CPU starts cold where the real job's would not."""
        self.acquire()
        self._segment_open = True
        if self.cold_ns is None and torch.cuda.is_initialized():
            self._local.internal = True
            try:
                self.cold_ns = int(measure_cold_start(self.mode))
            except Exception:  # noqa: BLE001 (a probe that fails leaves the shares as measured)
                self.cold_ns = 0
            finally:
                self._local.internal = False
        self._after_comm = after_comm
        t = time.monotonic_ns()
        self._begin(step)
        return t

    def _begin(self, step: int) -> None:
        """Per-segment bookkeeping; on a calibration step, the spin and its event."""
        if self.mode is not None:
            self._calls0 = self.mode.calls
        self._armed = None
        if step != self._step:
            if self._walls and self._step not in self.calibrate:
                self._walls_prev = self._walls
            self._walls = []
            self._step = step
        if step not in self.calibrate or not torch.cuda.is_initialized():
            return
        self._local.internal = True
        try:
            if self._ns_per_cycle is None:
                self._ns_per_cycle = self._measure_clock()
            prev = self._walls_prev
            pos = len(self._walls)
            base = prev[pos] if pos < len(prev) else max(prev, default=0)
            spin = min(max(int(base * self._factor), MIN_SPIN_NS), MAX_SPIN_NS)
            torch.cuda._sleep(max(int(spin / self._ns_per_cycle), 1))
            ev = torch.cuda.Event(enable_timing=True)
            main = torch.cuda.current_stream()
            ev.record(main)
            for side in self._side_streams(main):  # their work queues behind the spin too
                side.wait_event(ev)
            self._armed, self._armed_stream = ev, main
        finally:
            self._local.internal = False

    def disarm(self) -> None:
        self._armed = self._armed_stream = None
        self._end_segment()

    def _end_segment(self) -> None:
        if self._segment_open:
            self._segment_open = False
            self.release()

    def close(self, start_ns: int, script_join: bool) -> tuple[int, int, int, int, int, int]:
        """End the segment: wait for the GPU; returns (cpu_end, end, cpu_ns,
        gpu_ns, free_ns, cold_ns) (the last two: ``trace.Compute``'s)."""
        cpu_end = time.monotonic_ns()
        calls = (self.mode.calls - self._calls0) if self.mode is not None else 0
        gpu_ns = -1
        if not torch.cuda.is_initialized():
            end = cpu_end
        else:
            self._local.internal = True
            try:
                a, self._armed = self._armed, None
                main, self._armed_stream = self._armed_stream, None
                b = None
                starved = False
                if a is not None:
                    for side in self._side_streams(main):
                        main.wait_stream(side)  # the closing event follows every stream's work
                    b = torch.cuda.Event(enable_timing=True)
                    b.record(main)
                    # the spin ended before the CPU issued everything: gaps
                    starved = not script_join and a.query()
                self._sync()
                end = time.monotonic_ns()
                if a is not None:
                    if starved:
                        gpu_ns = -2
                        self._factor *= 2
                    else:
                        gpu_ns = int(a.elapsed_time(b) * 1e6)
            finally:
                self._local.internal = False
        self._end_segment()
        issue_end, self._issue_end = self._issue_end, None
        if not script_join:
            wall_cpu = cpu_end - start_ns
        elif issue_end is not None and start_ns <= issue_end <= cpu_end:
            wall_cpu = issue_end - start_ns  # the CPU's share ends where the waiting call began
        else:
            wall_cpu = end - start_ns  # unknown: the wait for its own kernels stays in
        self._walls.append(end - start_ns)
        overhead = calls * self.per_call_ns
        cpu_ns = max(int(wall_cpu - overhead), 0)
        # the GPU was idle at the start (drained at the boundary before): on an
        # uncalibrated segment the wall is the finish with nothing queued ahead
        free_ns = max(int(end - start_ns - overhead), 0) if gpu_ns == -1 and torch.cuda.is_initialized() else -1
        cold_ns = (self.cold_ns or 0) if self._after_comm else 0
        self._after_comm = False
        return cpu_end, end, cpu_ns, gpu_ns, free_ns, cold_ns

    def _measure_clock(self) -> float:
        """ns per ``torch.cuda._sleep`` cycle on this GPU."""
        cycles = 2_000_000
        best = None
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
            b.synchronize()
            ns = a.elapsed_time(b) * 1e6 / cycles
            best = ns if best is None else min(best, ns)
        return max(best or 0.5, 0.05)


def measure_mode_overhead(mode: Any, n: int = 1000, rounds: int = 5) -> float:
    """ns that one torch call costs with ``mode`` pushed on this thread versus
    the same call with it popped (median of interleaved rounds; >= 0)."""
    from torch.overrides import _pop_mode_temporarily

    calls = mode.calls
    x = torch.zeros(4)
    add = torch.add

    def loop() -> int:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            add(x, 1)
        return time.perf_counter_ns() - t0

    with_mode, without = [], []
    for _ in range(rounds):
        with_mode.append(loop())
        with _pop_mode_temporarily():
            without.append(loop())
    mode.calls = calls  # the probe's calls are not the script's
    return max((statistics.median(with_mode) - statistics.median(without)) / n, 0.0)


def measure_cold_start(mode: Any = None, rounds: int = 15, wait_s: float = COLD_WAIT_S) -> float:
    """ns that a short segment of GPU work (a transformer MLP's five calls on
    small tensors) takes longer to issue after a wait, woken by another
    thread as a capture's main thread is at every communication call, than
    issued back to back (medians over interleaved rounds; >= 0).

    A capture's CPU shares all start this way; the real job's CPU does not
    wait at its communication calls (NCCL's calls only enqueue), so the
    replay takes this off segments that follow one. On an H200 host the
    same five calls on 2048 x 1024 tensors took 97-124 us back to back and
    154-320 us after a 0.3-2 ms wait (``python bench/drain_effect.py --gpt``
    measures it); no RNG is drawn (the script's random stream is untouched).
    """
    import torch.nn.functional as F

    calls = mode.calls if mode is not None else 0
    x = torch.full((64, 256), 0.5, device="cuda")
    w1 = torch.full((512, 256), 0.01, device="cuda")
    w2 = torch.full((256, 512), 0.01, device="cuda")
    gamma, beta = torch.ones(256, device="cuda"), torch.zeros(256, device="cuda")

    def segment() -> int:
        t0 = time.perf_counter_ns()
        h = F.linear(F.gelu(F.linear(F.layer_norm(x, (256,), gamma, beta), w1)), w2)
        h.add_(x)
        return time.perf_counter_ns() - t0

    for _ in range(5):
        segment()
    woken: list[int] = []
    ahead: list[int] = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        ev = threading.Event()
        timer = threading.Timer(wait_s, ev.set)
        timer.start()
        ev.wait()
        woken.append(segment())
        ahead.extend(segment() for _ in range(3))
    torch.cuda.synchronize()
    if mode is not None:
        mode.calls = calls  # the probe's calls are not the script's
    return max(statistics.median(woken) - statistics.median(ahead), 0.0)


def from_env(mode: Any, swapping: bool = False) -> GpuTiming | None:
    """The rank's GpuTiming, or None when two clocks are switched off.

    No turns on the GPU when the coordinator swaps ranks: a checkpointed
    rank's completion thread would take its turn, block in its copy onto the
    GPU until restored and keep every other rank of that GPU waiting, the
    ones that would have to block for it to be restored included."""
    if os.environ.get(TWO_CLOCK_ENV, "1") == "0":
        return None
    exclusive = None
    if os.environ.get(EXCLUSIVE_ENV, "1") != "0" and not swapping:
        # The machine's id of this rank's GPU (with one GPU per rank in the
        # script's own numbering, CUDA_VISIBLE_DEVICES is left unset).
        gpu = (os.environ.get("PRISM_PHYSICAL_DEVICE", "").strip()
               or os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() or "0")
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        exclusive = os.path.join(base, f"prism-gpu-{os.getuid()}-{gpu.replace('/', '_')}.lock")
    return GpuTiming(parse_steps(os.environ.get(CALIBRATE_ENV, DEFAULT_CALIBRATE)), mode, exclusive)
