"""Context switching on GPUs: the swap executor behind the scheduler's
``SwapOut``/``SwapIn`` actions (``prism.core.residency`` decides them).

A rank's GPU state (device memory and context) is moved to host memory and
back with the CUDA driver's checkpoint API, driven from the coordinator's
process by the rank's pid (``libcuda``, driver 570+): ``cuCheckpointProcessLock``
then ``...Checkpoint`` to swap out, ``...Restore`` then ``...Unlock`` to swap
in. Restore puts every allocation back at its old address, so the rank's
tensors survive untouched. The rank's host threads keep running while it is
checkpointed; its CUDA calls block until the restore (so the coordinator
restores a rank before it delivers work that needs its GPU, see
``GangResidency.wake``).

The calls block for up to seconds, so the coordinator runs them in a worker
thread (``trio.to_thread``). Failures raise ``SwapError`` naming the rank, the
pid, the step and the driver's error; the coordinator stops the capture with it.

A process that never created a CUDA context has nothing to swap: the driver
answers ``cuCheckpointProcessGetState`` with an error for it, and the swap is
recorded as ``skipped``.

Public API: ``CheckpointDriver`` (ctypes binding; ``available()``),
``SimulatedDriver`` (SIGSTOP/SIGCONT, for ``--simulate-swaps`` on CPU),
``SwapExecutor(driver, memory_of=None)`` with ``swap_out(rank, pid,
step)``/``swap_in(rank, pid, step)`` and ``records``; ``SwapRecord``;
``SwapError``; ``summarize(records, steps)`` and ``write_report(run_dir,
records, steps)`` (``RUN/telemetry/swaps.json``).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from prism.shell import runfolder

#: CUprocessState
STATE_NAMES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}
#: How long a lock may wait for the rank's submitted work (ms).
LOCK_TIMEOUT_MS = 60_000


class SwapError(RuntimeError):
    """A checkpoint call failed: the capture cannot go on safely."""


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class CheckpointDriver:
    """The driver's checkpoint calls by pid. Each raises ``SwapError`` with the
    driver's error name and text on failure."""

    def __init__(self, lib: str = "libcuda.so.1") -> None:
        try:
            self._cuda = ctypes.CDLL(lib)
        except OSError as e:
            raise SwapError(f"cannot load the CUDA driver ({lib}): {e}; GPU swapping needs an NVIDIA driver") from e
        for name in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                     "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState"):
            if not hasattr(self._cuda, name):
                raise SwapError(f"the CUDA driver has no {name}: GPU swapping needs driver 570 or newer")
        self._check("cuInit", self._cuda.cuInit(0), pid=os.getpid())

    @staticmethod
    def available() -> bool:
        """Whether a driver with the checkpoint API can be loaded."""
        try:
            CheckpointDriver()
        except SwapError:
            return False
        return True

    def _error(self, code: int) -> str:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self._cuda.cuGetErrorName(code, ctypes.byref(name))
        self._cuda.cuGetErrorString(code, ctypes.byref(text))
        return f"{(name.value or b'?').decode()} ({code}): {(text.value or b'').decode()}"

    def _check(self, call: str, code: int, *, pid: int) -> None:
        if code != 0:
            raise SwapError(f"{call}(pid {pid}) failed: {self._error(code)}")

    def state(self, pid: int) -> str | None:
        """``running``/``locked``/``checkpointed``/``failed``, or None when the
        process has no CUDA context (nothing to swap)."""
        st = ctypes.c_int(-1)
        if self._cuda.cuCheckpointProcessGetState(ctypes.c_int(pid), ctypes.byref(st)) != 0:
            return None
        return STATE_NAMES.get(st.value, f"state {st.value}")

    def lock(self, pid: int, timeout_ms: int = LOCK_TIMEOUT_MS) -> None:
        args = _LockArgs(timeoutMs=timeout_ms)
        self._check("cuCheckpointProcessLock", self._cuda.cuCheckpointProcessLock(ctypes.c_int(pid), ctypes.byref(args)), pid=pid)

    def checkpoint(self, pid: int) -> None:
        self._check("cuCheckpointProcessCheckpoint", self._cuda.cuCheckpointProcessCheckpoint(ctypes.c_int(pid), None), pid=pid)

    def restore(self, pid: int) -> None:
        self._check("cuCheckpointProcessRestore", self._cuda.cuCheckpointProcessRestore(ctypes.c_int(pid), None), pid=pid)

    def unlock(self, pid: int) -> None:
        self._check("cuCheckpointProcessUnlock", self._cuda.cuCheckpointProcessUnlock(ctypes.c_int(pid), None), pid=pid)


class SimulatedDriver:
    """A stand-in for the checkpoint API on machines without a GPU
    (``prism capture --simulate-swaps``): "checkpointing" a process stops it
    outright (SIGSTOP, host threads included, stricter than the driver, which
    only blocks CUDA calls) until it is "restored" (SIGCONT). It runs the
    swap policy on real rank processes, so a CPU capture shows the swaps per
    iteration a GPU capture would make with the same options (not their
    cost: ``seconds`` is the signal's latency plus ``delay_s``)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.states: dict[int, str] = {}

    def state(self, pid: int) -> str | None:
        return self.states.get(pid, "running")

    def _signal(self, call: str, pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            raise SwapError(f"{call}(pid {pid}) failed: no such process (the rank exited)") from None
        if self.delay_s:
            time.sleep(self.delay_s)

    def lock(self, pid: int, timeout_ms: int = LOCK_TIMEOUT_MS) -> None:
        self.states[pid] = "locked"

    def checkpoint(self, pid: int) -> None:
        self._signal("checkpoint", pid, signal.SIGSTOP)
        self.states[pid] = "checkpointed"

    def restore(self, pid: int) -> None:
        self._signal("restore", pid, signal.SIGCONT)
        self.states[pid] = "locked"

    def unlock(self, pid: int) -> None:
        self.states[pid] = "running"


@dataclass(frozen=True, slots=True)
class SwapRecord:
    """One swap: ``direction`` "out"/"in", ``status`` "ok"/"skipped" (no CUDA
    context), ``bytes`` the process's GPU memory before it went out (NVML;
    0 where unknown), ``step`` the capture's slowest rank's step then."""

    rank: int
    pid: int
    direction: str
    status: str
    t_start: float
    seconds: float
    bytes: int
    step: int


class SwapLog:
    """The swaps carried out so far (``records``), each also appended as it
    happens to ``log`` (``RUN/telemetry/swaps.jsonl``), so a capture that is
    killed keeps what it did. Any thread may ``record``."""

    def __init__(self, log: str | os.PathLike[str] | None = None) -> None:
        self.records: list[SwapRecord] = []
        self._lock = threading.Lock()
        self._log = None
        if log is not None:
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            self._log = open(log, "a", buffering=1)

    def _record(self, rec: SwapRecord) -> SwapRecord:
        with self._lock:
            self.records.append(rec)
            if self._log is not None:
                self._log.write(json.dumps(asdict(rec)) + "\n")
        return rec

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class SwapExecutor(SwapLog):
    """Carries out swaps of a rank's process, by the pid the coordinator
    gives with each call (it learns them as ranks say Hello, after the
    executor exists); ``memory_of(pid)`` is the process's GPU memory in bytes
    (for the GB/s figures)."""

    def __init__(self, driver: CheckpointDriver, memory_of: Callable[[int], int] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 log: str | os.PathLike[str] | None = None) -> None:
        super().__init__(log)
        self.driver = driver
        self.memory_of = memory_of or (lambda pid: 0)
        self.clock = clock
        self._out_bytes: dict[int, int] = {}

    def _fail(self, rank: int, pid: int, what: str, step: int, err: Exception) -> SwapError:
        return SwapError(f"swapping rank {rank} (pid {pid}) {what} at step {step} failed: {err}. The capture "
                         "stops: a rank whose GPU state could not be saved or restored cannot go on. If this "
                         "repeats, capture with more resident ranks (--resident) or on CPU.")

    def swap_out(self, rank: int, pid: int, step: int = -1) -> SwapRecord:
        """Lock and checkpoint ``rank``'s process ``pid`` (its GPU memory moves to host)."""
        t0 = self.clock()
        try:
            if self.driver.state(pid) is None:
                return self._record(SwapRecord(rank, pid, "out", "skipped", t0, 0.0, 0, step))
            size = self.memory_of(pid)
            self.driver.lock(pid)
            self.driver.checkpoint(pid)
        except SwapError as e:
            raise self._fail(rank, pid, "out", step, e) from e
        self._out_bytes[rank] = size
        return self._record(SwapRecord(rank, pid, "out", "ok", t0, self.clock() - t0, size, step))

    def swap_in(self, rank: int, pid: int, step: int = -1) -> SwapRecord:
        """Restore and unlock ``rank``'s process ``pid`` (same addresses as before)."""
        t0 = self.clock()
        try:
            if self.driver.state(pid) != "checkpointed":
                return self._record(SwapRecord(rank, pid, "in", "skipped", t0, 0.0, 0, step))
            self.driver.restore(pid)
            self.driver.unlock(pid)
        except SwapError as e:
            raise self._fail(rank, pid, "in", step, e) from e
        return self._record(SwapRecord(rank, pid, "in", "ok", t0, self.clock() - t0,
                                       self._out_bytes.get(rank, 0), step))



def summarize(records: Sequence[SwapRecord], steps: int) -> dict:
    """Totals, GB/s each way and swaps per step (records with ``step`` k count
    towards step k; -1 is before the first step ended)."""
    done = [r for r in records if r.status == "ok"]
    out = {"swaps": len(done), "skipped": len(records) - len(done), "steps": steps}
    for d in ("out", "in"):
        rs = [r for r in done if r.direction == d]
        secs = sum(r.seconds for r in rs)
        nbytes = sum(r.bytes for r in rs)
        out[f"swaps_{d}"] = len(rs)
        out[f"seconds_{d}"] = round(secs, 6)
        out[f"bytes_{d}"] = nbytes
        out[f"gb_per_s_{d}"] = round(nbytes / secs / 1e9, 3) if secs > 0 and nbytes else None
    out["seconds_total"] = round(out["seconds_out"] + out["seconds_in"], 6)
    per_step: dict[int, int] = {}
    for r in done:
        per_step[r.step + 1] = per_step.get(r.step + 1, 0) + 1
    out["swaps_per_step"] = {str(k): v for k, v in sorted(per_step.items())}
    out["swaps_per_iteration"] = round(len(done) / steps, 3) if steps else None
    return out


def write_report(run_dir: str | os.PathLike[str], records: Sequence[SwapRecord], steps: int,
                 settings: dict | None = None, rescues: int = 0) -> dict:
    """Write ``RUN/telemetry/swaps.json`` (summary, settings and every swap);
    returns the summary. ``rescues``: ranks the coordinator restored after a
    quiet spell (each such spell cost ``prism.core.residency.RESCUE_QUIET_NS``)."""
    summary = summarize(records, steps)
    summary["rescues"] = rescues
    path = runfolder.swap_report_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"summary": summary, "settings": settings or {}, "records": [asdict(r) for r in records]}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return summary


def format_summary(summary: dict) -> str:
    """One line for the end of a capture."""
    def rate(x):
        return f"{x:.2f} GB/s" if x else "n/a"

    return (f"prism: {summary['swaps']} swaps ({summary['swaps_out']} out, {summary['swaps_in']} in), "
            f"{summary['swaps_per_iteration']} per iteration, {summary['seconds_total']:.2f} s swapping "
            f"(out {rate(summary['gb_per_s_out'])}, in {rate(summary['gb_per_s_in'])})"
            + (f"; {summary['rescues']} ranks restored after a quiet spell" if summary.get("rescues") else ""))
