"""A GPU sandbox's collectives without a host round trip (emulation).

In ``prism emulate`` on a GPU (``PRISM_GPU_SANDBOX=1``, set by the emulator's
launch), a collective of CUDA tensors whose group has no other sandbox member
(``PRISM_SANDBOX_RANKS``) is answered by virtual ranks only, so its data never
needs to leave the GPU. The backend then, instead of staging through host
memory and synchronising:

1. enqueues on the caller's stream a wait for a release flag
   (``cuda_ext.ReleaseFlags``: pinned host memory the GPU polls, a spinning
   kernel or ``cuStreamWaitValue32``),
2. enqueues behind it the compensated outputs, computed in place on the GPU
   (``form_outputs``: the rules of ``prism/core/compensation.py`` for one
   sandbox, whose virtual members contribute what it does),
3. sends the call's shapes (``CollectiveArrive.on_device``, no payloads) and
   returns at once, as NCCL does;

and the completion thread flips the flag at the emulated release. The GPU
thus runs the program's kernels back to back and waits only where the
emulated job's communication would hold it. Prism allocates no device memory
here (the outputs are the program's own tensors, changed in place).

For one sandbox among N members, compensated (``compensation.hybrid_outputs``):

=======================  ==============================================
op                       output
=======================  ==============================================
all_reduce SUM           N x own               (rounded once, float32 math)
all_reduce PREMUL_SUM    N x factor x own
all_reduce AVG/MIN/MAX   own (unchanged)
reduce_scatter_tensor    its chunk of own, x N (SUM) or x N x factor
all_gather_into_tensor   own in every slot
all_to_all_single        the chunk from a virtual member j is its own chunk
                         for j, cut or tiled to the rows j sends (uneven
                         splits too); its own chunk comes back as it is
broadcast / barrier      nothing changes
send to a virtual rank   the data never leaves the GPU (no copy to the
                         host, which would wait for the stream: NCCL's send
                         does not hold the CPU either); a wait released in
                         advance stamps the stream's reach, the send's
                         arrival (protocol 8)
recv from a virtual rank zeros, behind the release (the host path's
                         compensation of a receive)
=======================  ==============================================

Other ops (gather, scatter, point-to-point with another sandbox, groups
with two sandbox members) keep the host path.

The hazard: while the GPU waits on a flag, anything that needs the whole
GPU idle before it returns blocks the thread that asked, and if that thread
holds the GIL the release (a Python thread) cannot come. CUDA's lazy module
loading is one such thing (a kernel's first launch may synchronise the
context: CUDA programming guide, "Lazy Loading", potential hazards), so a
device-path sandbox runs with ``CUDA_MODULE_LOADING=EAGER`` (set by
``prism emulate``; the module images then sit in GPU memory from the start,
outside torch's allocator, whose figures do not change). ``cudaFree`` under
memory pressure and ``torch.cuda.empty_cache()`` are others, not handled yet.
The call's message is sent before the wait is queued, so the release never
depends on what the main thread does after it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from prism.core import latecarry
from prism.core.latecarry import NCCL_ISSUE_NS
from prism.rank.envnames import GPU_SANDBOX_ENV, SANDBOX_ENV  # noqa: F401 (their home for torch-free readers)
#: Release flags in the ring (a flag is reused after this many calls, with a higher value).
SLOTS = 4096

_OPS = frozenset({"all_reduce", "all_reduce_coalesced", "reduce_scatter_tensor", "all_gather_into_tensor",
                  "all_to_all_single", "broadcast", "barrier"})
_lock = threading.Lock()
_releaser: "Releaser | None" = None
_sandbox: frozenset[int] | None = None


_issued = [0, 0, 0]  # calls, total ns, max ns: the host time Prism's backend spends issuing a call
#: Each call's issue time (ns), for the median (the first ``_ISSUE_SAMPLES``).
_issue_samples: list[int] = []
_ISSUE_SAMPLES = 100_000


def count_issue(ns: int) -> None:
    """Account one device-path call's issue time on the host: for a
    collective from the backend's entry (before it decides the call takes
    the device path) to its return; for a send or receive from its start."""
    if _issued[0] == 0:
        import atexit

        atexit.register(_report_issue)
    _issued[0] += 1
    _issued[1] += ns
    _issued[2] = max(_issued[2], ns)
    if len(_issue_samples) < _ISSUE_SAMPLES:
        _issue_samples.append(ns)


from prism.rank.envnames import CALL_LOG_ENV  # noqa: E402 (beside its use; the coordinator reads it too)
#: ``PRISM_DEVICE_CALL_LOG=PATH`` (a diagnostic): every device-path call's
#: host and GPU moments, one JSON line each, written to PATH (``{rank}`` is
#: filled in) when the rank ends: ``step`` the program's step at the call
#: (a collective's; since 2026-12-08), ``t0`` the backend's entry, ``t_msg`` the
#: message built (before it is sent), ``t_sent`` the call's message out,
#: ``t_wait`` the release wait queued, ``t_out`` the outputs' delivery or
#: compensation queued, ``t1`` its return (monotonic ns); ``busy0``/``busy1``
#: whether the caller's stream still had work queued at entry and return
#: (``query()``: False means the GPU had drained and waited for this host);
#: ``reach`` the GPU's reach (monotonic ns), ``due`` the release the emulated
#: job asked for, ``tail`` the call's time after the reach, ``late`` how late
#: the wait ended past its due moment, ``t_flip`` when its result arrived and
#: its flag was flipped, ``t_res`` when the rank's completion thread took it; a recorded delivery adds its steps
#: (``RecordedFeed.deliver``: ``f_lock``, ``f_adv0``, ``f_copy``, ``f_adv1``,
#: ``f_staged``). Where the host time went: ``t_on``, ``t_feed``, ``t_op``
#: (the device path entered; the releaser and the feed asked; the message and
#: the op made), ``t_rec`` (the record made), ``t_ret`` (after the return's
#: bookkeeping), each ``t_x`` / ``f_x`` with the calling thread's CPU time
#: then as ``c_x`` / ``cf_x``, and its context switches at the record and the
#: return (``v_rec``/``i_rec``, ``v1``/``i1``); beside the log,
#: ``PATH.threads.json``: each thread's CPU time and switches
#: (``bench/host_time.py`` reads both). The release's round trip: ``t_seen``
#: the reach watcher saw the reach, ``t_rsent`` its ``Reached`` handed to the
#: transport; the coordinator writes its side as rank ``coord`` (``c_in`` the
#: ``Reached`` taken, ``c_out`` the result sent), then ``t_flip`` above.
_call_log: list[dict] | None = None


def _thread_marks() -> tuple[int, int, int]:
    """The calling thread's CPU time (ns) and its voluntary and involuntary
    context switches so far (``getrusage(RUSAGE_THREAD)``; zeros where the
    platform has none)."""
    try:
        import resource

        ru = resource.getrusage(resource.RUSAGE_THREAD)
        return time.thread_time_ns(), ru.ru_nvcsw, ru.ru_nivcsw
    except (ImportError, AttributeError, OSError):
        return time.thread_time_ns(), 0, 0


class _EnvFlags:
    """The device path's switches, read from the environment once, at a
    rank's first call that asks (its environment is fixed by then; a test
    that changes it in process calls ``reset_env``). Each call read them
    anew before: five environment reads a call, 2-7 us each inside a rank
    (cold; 0.3 in a hot loop; 2026-12-08, the 2-core VM)."""

    __slots__ = ("enabled", "cpu_test", "call_log", "reach_gpu", "side_stream", "arrive_at_reach", "carry_delivery",
                 "threaded_reach")

    def __init__(self) -> None:
        env = os.environ
        mode = env.get(GPU_SANDBOX_ENV)
        self.enabled = mode in ("1", "cpu-test")
        self.cpu_test = mode == "cpu-test"
        self.call_log = bool(env.get(CALL_LOG_ENV))
        self.reach_gpu = env.get(REACH_ENV, "gpu") != "issue"
        self.side_stream = env.get(SIDE_STREAM_ENV, "1") != "0"
        # an early release needs the arrival at issue (the coordinator's PRISM_EARLY_RELEASE)
        self.arrive_at_reach = env.get(ARRIVE_AT_REACH_ENV, "0") == "1" and env.get("PRISM_EARLY_RELEASE") != "1"
        self.carry_delivery = env.get(CARRY_DELIVERY_ENV, "0") == "1"
        self.threaded_reach = env.get(THREADED_REACH_ENV) == "1"


_env: _EnvFlags | None = None


def _flags() -> _EnvFlags:
    f = _env
    return f if f is not None else _read_env()


def _read_env() -> _EnvFlags:
    global _env
    _env = _EnvFlags()
    return _env


def reset_env() -> None:
    """Forget what was read from the environment (the switches and the
    sandbox ranks): for tests that change it in process."""
    global _env, _sandbox
    _env = None
    _sandbox = None


# A fork server's child gets its own environment after the fork: it reads it anew.
os.register_at_fork(after_in_child=reset_env)


def entry_marks() -> dict | None:
    """Moments of a device-path call before its record exists (``call_record``
    takes them: ``marks=``), or None unless the call log is on."""
    return {} if _flags().call_log else None


def call_record(**fields: Any) -> dict | None:
    """A new record of the call log (None unless ``PRISM_DEVICE_CALL_LOG`` is
    set). It notes when it was made (``t_rec``) with the thread's CPU time
    and context switches then (``c_rec``, ``v_rec``, ``i_rec``): with the
    same at the return (``c_ret``, ``v1``, ``i1``, ``mark_return``) they say
    whether a call's host time was spent on the CPU or waiting off it (the
    GIL, a lock, the driver)."""
    global _call_log, _threads_at_start
    if not _flags().call_log:
        return None
    if _call_log is None:
        _call_log = []
        _threads_at_start = thread_times()
    marks = fields.pop("marks", None)
    rec = dict(fields)
    if marks:
        rec.update(marks)
    rec["t_rec"] = time.monotonic_ns()
    rec["c_rec"], rec["v_rec"], rec["i_rec"] = _thread_marks()
    _call_log.append(rec)
    return rec


def stamp(rec: dict | None, key: str) -> None:
    """Note moment ``key`` of a call-log record, and the thread's CPU time
    then (``t_msg`` -> ``c_msg``, ``f_copy`` -> ``cf_copy``)."""
    if rec is not None:
        rec[key] = time.monotonic_ns()
        rec[("c" + key[1:]) if key.startswith("t_") else "c" + key] = time.thread_time_ns()


def mark_return(rec: dict | None, t1: int, busy1: bool | None) -> None:
    """The return of a logged call: ``t1``, ``busy1``, and the thread marks
    taken now (``t_ret`` with ``c_ret``, ``v1``, ``i1``: after the return's
    bookkeeping, so that a call's CPU and wall times span the same moments)."""
    if rec is not None:
        rec["t1"], rec["busy1"] = t1, busy1
        rec["c_ret"], rec["v1"], rec["i1"] = _thread_marks()
        rec["t_ret"] = time.monotonic_ns()


_threads_at_start: dict[int, dict] | None = None


def thread_times() -> dict[int, dict]:
    """Every thread of this process: ``{tid: {name, cpu_ns, vcsw, ivcsw}}``
    (``/proc/self/task``; CPU time at the clock tick's resolution; the
    Python threads by their ``threading`` names, the others by ``comm``);
    empty where there is no ``/proc``."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    names.setdefault(os.getpid(), "MainThread")  # a forked rank's program thread is the process's first
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, dict] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid_s in tids:
        try:
            tid = int(tid_s)
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except (OSError, ValueError):
            continue  # ended meanwhile
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) * 1_000_000_000 // tick  # utime, stime
        sw = {k: int(v) for k, v in (ln.split(":\t") for ln in status.splitlines()
                                      if ln.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))}
        out[tid] = {"name": names.get(tid, comm), "cpu_ns": cpu, "vcsw": sw.get("voluntary_ctxt_switches", 0),
                    "ivcsw": sw.get("nonvoluntary_ctxt_switches", 0)}
    return out


def thread_deltas(start: dict[int, dict] | None, end: dict[int, dict]) -> list[dict]:
    """Per thread, what ``end`` adds to ``start`` (a thread begun since counts from zero), busiest first."""
    start = start or {}
    rows = []
    for tid, e in end.items():
        s = start.get(tid, {})
        rows.append({"tid": tid, "name": e["name"], "cpu_ns": e["cpu_ns"] - s.get("cpu_ns", 0),
                     "vcsw": e["vcsw"] - s.get("vcsw", 0), "ivcsw": e["ivcsw"] - s.get("ivcsw", 0)})
    return sorted(rows, key=lambda r: -r["cpu_ns"])


def stream_busy(device: Any) -> bool | None:
    """Whether the current stream of ``device`` still has queued work (None off a GPU).
    Through cuda_ext where it is built (``stream_busy``: one call; torch's
    ``current_stream(device).query()`` makes a Stream object each time)."""
    if device is None or getattr(device, "type", "") != "cuda":
        return None
    busy = _native_stream_busy()
    if busy is not None:
        return bool(busy(device.index if device.index is not None else torch.cuda.current_device()))
    return not torch.cuda.current_stream(device).query()


_stream_busy_fn: Any = False  # False: not looked up yet; None: not built (or an older build)


def _native_stream_busy() -> Any:
    global _stream_busy_fn
    fn = _stream_busy_fn
    if fn is False:
        import cuda_ext

        mod = cuda_ext.kernels()
        fn = _stream_busy_fn = getattr(mod, "stream_busy", None) if mod is not None else None
    return fn


#: How long the call log's writer waits for the completion thread to stamp
#: the last released calls' ``t_res`` (seconds).
_T_RES_WAIT_S = 1.0


def _write_call_log(rank: int) -> None:
    global _call_log
    path = os.environ.get(CALL_LOG_ENV)
    if not path or not _call_log:
        return
    import json
    import time

    # A released call's GPU went on at the flag's flip (the transport's
    # thread); the completion thread stamps ``t_res`` a little later and the
    # program may end in between: give it a moment (bounded) to do so.
    deadline = time.monotonic() + _T_RES_WAIT_S
    while any("t_flip" in r and "t_res" not in r for r in _call_log) and time.monotonic() < deadline:
        time.sleep(0.005)
    with open(path.format(rank=rank), "w") as f:
        for rec in _call_log:
            f.write(json.dumps(rec) + "\n")
    _call_log = None
    # beside it: each thread's CPU time and context switches over the logged calls
    with open(path.format(rank=rank) + ".threads.json", "w") as f:
        json.dump(thread_deltas(_threads_at_start, thread_times()), f)


def issue_stats() -> tuple[int, float, int]:
    """(calls, mean ns, max ns) of the device-path calls issued so far."""
    n, total, top = _issued
    return n, (total / n if n else 0.0), top


def report() -> None:
    """Print what the device path did in this process (once; the rank's
    bootstrap calls it before the fork server's ``os._exit``, which skips
    ``atexit``)."""
    _report_issue()
    try:
        _write_call_log(int(os.environ.get("RANK", "0")))
    except OSError as e:
        import sys

        print(f"prism: device path: the call log ({CALL_LOG_ENV}) could not be written: {e}", file=sys.stderr)
    if isinstance(_feed, RecordedFeed):
        _feed._report()


def _report_issue() -> None:
    import sys

    if _issued[0] < 0:
        return
    n, mean, top = issue_stats()
    _issued[0] = -1
    if n == 0:
        return
    p50 = sorted(_issue_samples)[len(_issue_samples) // 2] if _issue_samples else 0
    print(f"prism: device path: {n} calls issued, {mean / 1e3:.1f} us of CPU each in Prism's backend "
          f"(median {p50 / 1e3:.1f} us, max {top / 1e3:.1f} us)", file=sys.stderr, flush=True)
    hc = _host_charge
    if hc is not None and hc.charges:
        print(f"prism: device path: the GPU waited {hc.charged_ns / 1e6:.2f} ms in all for Prism's issue time "
              f"({hc.charges} charges beyond NCCL's {hc.nominal_ns / 1e3:.0f} us a call), taken out of the "
              f"emulated time ({HOST_CHARGE_ENV}=0: kept)", file=sys.stderr, flush=True)


REACH_ENV = "PRISM_DEVICE_REACH"


def reach_from_gpu() -> bool:
    """Whether a device-path call's arrival is the GPU's reach (the default)
    or, with ``PRISM_DEVICE_REACH=issue``, the CPU's issue (for comparison:
    the engine then sees the CPU's lead over its stream as early arrivals)."""
    return _flags().reach_gpu


def enabled() -> bool:
    return _flags().enabled


from prism.rank.envnames import ARRIVE_AT_REACH_ENV  # noqa: E402 (beside its use; ``prism emulate`` sets it)


#: "1" (an experiment, opt-in until a GPU A/B says): a device-path call's
#: outputs' forming on the stream (the pool's copy, or the compensation's
#: kernels) counts as Prism's delay of the stream, as a late release does:
#: the rank stamps the stream after it (``ReleaseFlags.mark_delivered``) and
#: the reach watcher carries it with the lateness (``_Watcher``). NCCL's
#: kernel writes a collective's output itself within the time the emulated
#: call takes; the sandbox's copy comes after (GPT tp2 on an H100: 32 copies
#: of 8 MiB a step, an estimated 0.3 ms, 0.7% of the step; 2026-12-08).
CARRY_DELIVERY_ENV = "PRISM_DEVICE_CARRY_DELIVERY"


def carry_delivery() -> bool:
    return _flags().carry_delivery


def arrive_at_reach() -> bool:
    """Whether a device-path call whose reach is watched sends its arrival at
    the reach (from the reach watcher, with the reach: one message, none on
    the calling thread) rather than at its issue. Opt-in
    (``PRISM_DEVICE_ARRIVE_AT_REACH=1``), and never where early releases are
    asked for (``PRISM_EARLY_RELEASE=1``: the coordinator releases a call
    before its reach, so it must know of it at issue). Measured on the VM
    (2026-12-08, ``bench/call_cost.py``): the calling thread's send is gone,
    but with the reach reported from another thread, as on a GPU, that
    thread's send holds the GIL while the calling thread queues the outputs,
    and the call took 1.11x the time at the median; the coordinator's CPU
    0.84-0.97x. On a GPU: not measured yet."""
    return _flags().arrive_at_reach


def _cpu_test() -> bool:
    """``PRISM_GPU_SANDBOX=cpu-test``: the device path's protocol and in-place
    outputs on CPU tensors, with no stream to wait on (the outputs are formed
    at the call, not at the release): for tests of the path without a GPU."""
    return _flags().cpu_test


def sandbox_ranks() -> frozenset[int]:
    global _sandbox
    if _sandbox is None:
        text = os.environ.get(SANDBOX_ENV, "")
        _sandbox = frozenset(int(x) for x in text.split(",") if x.strip())
    return _sandbox


_REDUCES = frozenset({"SUM", "AVG", "PREMUL_SUM", "MIN", "MAX"})


def eligible(op: str, members: Sequence[int], rank: int, tensors: Sequence[torch.Tensor],
             in_splits: Sequence[int], out_splits: Sequence[int], reduce_name: str) -> bool:
    """Whether this call takes the device path (see the module docstring)."""
    return group_eligible(members, rank) and call_eligible(op, tensors, reduce_name)


def group_eligible(members: Sequence[int], rank: int) -> bool:
    """The part of ``eligible`` that depends on the group alone (a backend
    keeps it per group): the device path is on, and no other member is a
    sandbox (whose real data the host path exchanges)."""
    return enabled() and not any(m in sandbox_ranks() for m in members if m != rank)


def call_eligible(op: str, tensors: Sequence[torch.Tensor], reduce_name: str) -> bool:
    """The part of ``eligible`` that depends on the call: its op, its tensors
    (on the GPU, contiguous), its reduction, and a releaser to be had."""
    if op not in _OPS:
        return False
    if tensors:
        cpu = _flags().cpu_test
        for t in tensors:
            if not ((cpu or t.is_cuda) and t.is_contiguous()):
                return False
    if reduce_name and reduce_name not in _REDUCES:
        return False
    return _releaser is not None or releaser() is not None


def eligible_p2p(peer: int, tensor: torch.Tensor) -> bool:
    """Whether a send to or receive from ``peer`` takes the device path: the
    peer is virtual (another sandbox needs the real data: the host path)."""
    if not enabled() or peer in sandbox_ranks():
        return False
    if not ((tensor.is_cuda or _cpu_test()) and tensor.is_contiguous()):
        return False
    return releaser() is not None


class Releaser:
    """The process's ring of release flags (``cuda_ext.ReleaseFlags``).

    In ``kernel`` mode the wait kernel stamps the GPU's globaltimer as its
    stream reaches it; ``watch`` hands the call to a watcher thread that
    polls those stamps (pinned host memory) and reports each reach, on this
    host's monotonic clock, to the backend's callback: the emulated job's
    arrival at the call is when the GPU got there, not when the CPU issued it.
    The same thread reads how late each wait ended past the moment its
    release asked for (``ReleaseFlags.late_ns``: the release reached the GPU
    after it was due, Prism's delay) and hands the part that delayed the
    stream's next call to ``on_late`` (see ``_Watcher``)."""

    #: The watcher's poll period while calls are in flight (s); ``POLL_ENV``
    #: (microseconds) overrides it. Each poll takes the GIL, which the
    #: sandbox's main thread then waits for after each CUDA call that released
    #: it: a longer period may cut the host time of every call (the recorded
    #: path's dear CUDA calls, bench/results/gpu_sandbox-2026-12-06-h100.md),
    #: and reports reaches later by up to that much. Not yet measured on a GPU.
    POLL_S = 20e-6

    def __init__(self) -> None:
        import cuda_ext

        self.flags = None
        #: ``SHARED_RELEASE_ENV``: the flags in a file the coordinator releases through (``shared_path``).
        self.shared_path: str | None = None
        if os.environ.get(SHARED_RELEASE_ENV, "0") == "1":
            path = _shared_release_path()
            try:
                self.flags = cuda_ext.ReleaseFlags(SLOTS, "cuda", shared=path)
                self.shared_path = path
                import atexit

                atexit.register(_unlink_quietly, path)
            except (OSError, RuntimeError, ValueError) as e:
                _unlink_quietly(path)
                print(f"prism: device path: shared release flags not available ({e}); releasing through "
                      "messages", file=sys.stderr, flush=True)
        if self.flags is None:
            self.flags = cuda_ext.ReleaseFlags(SLOTS, "cuda")
        #: Whether the coordinator has been told of ``shared_path`` (``protocol.ReleaseShared``).
        self.announced = False
        self.mode = self.flags.default_mode()
        if self.mode != "kernel" and self.shared_path is not None:
            self.shared_path = None  # a memop wait cannot take a deadline: the rank times its release itself
        if os.environ.get(cuda_ext.HOLD_GIL_ENV, "0") == "1" and cuda_ext.hold_gil(True):
            # An experiment (sandbox-ab's -holdgil): safe where the coordinator releases the collectives
            # through shared memory; a receive's release still needs this rank's transport thread.
            risk = "" if self.shared_path else "; without the shared release a launch blocked by a wait can deadlock"
            print(f"prism: device path: the GIL stays held in cuda_ext's stream calls ({cuda_ext.HOLD_GIL_ENV}=1"
                  f"{risk})", file=sys.stderr, flush=True)
        self._n = 0
        self._lock = threading.Lock()
        #: Whether the stream's reach is stamped as it happens (and on this host's clock).
        self.reports_reach = self.mode == "kernel"
        self._watcher: _Watcher | None = None

    def watch(self, slot: int, issue_mono_ns: int, on_reach: Any, on_late: Any, rec: dict | None = None,
              drained: bool = False, step: int | None = None) -> None:
        """Report the reach of the wait just queued on ``slot`` (issued by the
        CPU at ``issue_mono_ns``): ``on_reach(reach_mono_ns)`` from the
        watcher thread; ``on_late(ns)`` for Prism's delay it carried; ``rec``
        (the call log's record, if any) gets ``reach`` and ``late``;
        ``drained``: the stream had drained when the call came (the GPU
        waited for Prism's issue: ``HostCharge.pre``); ``step``: the
        program's step at the call (the ``step`` carry rule)."""
        if self._watcher is None:
            self._watcher = _Watcher(self.flags, poll_s())
        self._watcher.add(slot, issue_mono_ns, on_reach, on_late, rec, drained, step)

    def spend_excess(self, slot: int, ns: int) -> None:
        """``ns`` of the call on ``slot``'s excess was charged by ``HostCharge``."""
        if self._watcher is not None:
            self._watcher.spend_excess(slot, ns)

    def note_return(self, slot: int, host_ns: int) -> None:
        """The call waiting on ``slot`` returned after ``host_ns`` in Prism:
        what beyond NCCL's issue time may have made the host's next call late
        (``_Watcher``'s ``excess`` carry)."""
        if self._watcher is not None:
            self._watcher.note_excess(slot, max(0, host_ns - NCCL_ISSUE_NS))

    def moments(self, slot: int) -> Any:
        """A reader of the GPU's (reach, wait end) of the wait on ``slot``, on
        this host's clock (0 while not known; read before the slot comes round again)."""
        flags = self.flags
        return lambda: (flags.reached_mono_ns(slot), flags.ended_mono_ns(slot))

    def prepare(self, slot: int) -> None:
        """Before a wait on ``slot`` is queued: clear its stamps (a reach seen later is this call's)."""
        if self.reports_reach:
            self.flags.clear_stamps(slot)

    def reserve(self) -> tuple[int, int]:
        """The next (slot, value) to wait on."""
        with self._lock:
            n, self._n = self._n, self._n + 1
        return n % SLOTS, n // SLOTS + 1

    def enqueue_wait(self, slot: int, value: int) -> None:
        """Make the current stream wait until ``slot`` reaches ``value``."""
        self.flags.wait(slot, value, mode=self.mode)

    def mark_delivered(self, slot: int) -> None:
        """The call on ``slot`` has its outputs' forming queued: stamp the
        stream after it (``CARRY_DELIVERY_ENV``; kernel mode only)."""
        if self.reports_reach and carry_delivery():
            self.flags.mark_delivered(slot)

    def release(self, slot: int, value: int, at_ns: int = 0, tail_ns: int = 0) -> None:
        """Flip the flag now; the wait itself ends at ``max(at_ns, reached + tail_ns)``
        (``cuda_ext.ReleaseFlags.release``)."""
        self.flags.release(slot, value, at_ns, tail_ns)


HOST_CHARGE_ENV = "PRISM_DEVICE_HOST_CHARGE"


def host_charge_enabled() -> bool:
    """Whether Prism's host time a drained stream waited for is taken out of
    the sandbox's clock (``HostCharge``; ``PRISM_DEVICE_HOST_CHARGE=0``: not;
    ``=drained``: only where the next call found the stream drained, the rule
    before 2026-12-06)."""
    return os.environ.get(HOST_CHARGE_ENV, "1") != "0"


class HostCharge:
    """Prism's issue time on the host that the GPU waited for (sans-IO).

    A device-path call costs the host a few hundred microseconds in Prism's
    backend where NCCL's costs ``NCCL_ISSUE_NS``. While the GPU is ahead (its
    stream still busy when the next call comes) that time is hidden, as in
    the real job; where the host is the bottleneck (MoE's token counts read
    back every layer, the stream found drained at a call's entry) it delays
    the GPU and everything after it, so it is Prism's, not the job's, and
    comes out of the rank's dilated clock. Two parts:

    - a call entered with the stream drained: from its entry to the GPU's
      reach, less ``nominal`` (``pre``: the watcher carries it, as it learns
      the reach);
    - at the next drained entry, the previous call's overhead that may have
      left the stream idle (``on_entry``): for a call entered busy, its whole
      time in Prism less ``nominal``; for one entered drained, its time in
      Prism after the GPU passed it; either bounded by the time from the GPU
      passing the previous call to this entry (no more than the stream can
      have idled)."""

    def __init__(self, nominal_ns: int = NCCL_ISSUE_NS, busy: bool = True) -> None:
        self.nominal_ns = nominal_ns
        #: also charge a synchronous call entered busy whose wait the GPU
        #: passed before Prism returned from it (``on_entry``)
        self.busy = busy
        self._prev: tuple[int, int, bool, Any, bool, Any] | None = None
        self.charged_ns = 0
        self.charges = 0

    def pre(self, issue_ns: int, reach_ns: int) -> int:
        """The charge of a call entered drained, once its reach is known."""
        return max(0, reach_ns - issue_ns - self.nominal_ns)

    def on_entry(self, t0: int, drained: bool | None) -> int:
        """A call enters at ``t0`` with its stream ``drained`` (None: unknown):
        what to charge now for the previous call.

        Drained: the stream idled before this entry, for at most ``t0`` less
        the GPU passing the previous call. Busy (``busy``, the previous call
        synchronous): where the GPU passed the previous call's wait before
        Prism returned from it, the stream had nothing after it until the host
        came back (the program's next kernels are issued after the return),
        so it idled from the wait's end to the return: the previous call's
        time in Prism beyond ``nominal`` (after the GPU's reach, for one
        entered drained) delayed it by that much at most. Measured on an
        H100 (2026-12-06, GPT tp2, early releases): with the GPU's waits no
        longer late, the host is the bottleneck a few hundred microseconds a
        call while the next call still finds the stream busy."""
        prev, self._prev = self._prev, None
        if prev is None or drained is None:
            return 0
        p0, p1, p_drained, moments, p_sync, spent = prev
        reach, end = moments()
        if drained:
            gpu_past = max(reach, end)  # (reach, wait end) of the previous call on this host's clock; 0: unknown
            if not gpu_past:
                return 0
            until = t0  # the stream found drained here: it can have idled until now
        elif self.busy and p_sync and end and end < p1:
            gpu_past, until = end, p1  # busy here: the host's next kernels kept it busy after the return
        else:
            return 0
        pend = p1 - gpu_past if p_drained else p1 - p0 - self.nominal_ns
        charge = max(0, min(pend, until - gpu_past))
        if charge:
            self.charged_ns += charge
            self.charges += 1
            if spent is not None:
                spent(charge)
        return charge

    def on_return(self, t0: int, t1: int, drained: bool | None, moments: Any, sync: bool = False,
                  spent: Any = None) -> None:
        """The call entered at ``t0`` returns at ``t1``; ``moments()`` gives its
        GPU reach and wait end later (0 while unknown); ``sync``: it waits on
        the caller's stream (an async call's runs on a side stream);
        ``spent(ns)``: told what of its time in Prism is charged here, so the
        reach watcher does not take the same time out again (its ``excess``
        carry)."""
        self._prev = (t0, t1, bool(drained), moments, sync, spent)

    def add_pre(self, ns: int) -> None:
        if ns:
            self.charged_ns += ns
            self.charges += 1


_host_charge: HostCharge | None = None


def host_charge() -> HostCharge | None:
    """The process's ``HostCharge`` (None where it is off)."""
    global _host_charge
    if _host_charge is None and host_charge_enabled():
        _host_charge = HostCharge(busy=os.environ.get(HOST_CHARGE_ENV, "1") != "drained")
    return _host_charge


#: How the reach watcher carries a late release into the rank's dilated
#: clock: ``prism.core.latecarry``'s rules, "excess" by default. Chosen on the
#: call logs of 12 runs on an H100 and 4 on an H200 (2026-12-06;
#: ``bench/results/gpu_sandbox-2026-12-06-h100.md``): "min" left the GPT tp2
#: and MoE recorded runs +3..+15% over their captures, the host's issue of a
#: step's first calls being late by Prism's own time.
LATE_CARRY_ENV = "PRISM_DEVICE_LATE_CARRY"
POLL_ENV = "PRISM_DEVICE_POLL_US"


def poll_s() -> float:
    """The reach watcher's poll period: ``POLL_ENV`` in microseconds, else
    ``Releaser.POLL_S``; a bad value stops the rank with what to give."""
    raw = os.environ.get(POLL_ENV)
    if not raw:
        return Releaser.POLL_S
    try:
        us = float(raw)
    except ValueError:
        us = -1.0
    if not 0 < us <= 100_000:
        raise SystemExit(f"prism: {POLL_ENV}={raw!r}: give the reach watcher's poll period in microseconds, "
                         "more than 0 and at most 100000 (default 20)")
    return us / 1e6


#: "0": the reach watcher polls in Python (``time.sleep`` between checks, the
#: GIL taken at each), as before 2026-12-07, for an A/B.
POLL_NATIVE_ENV = "PRISM_DEVICE_POLL_NATIVE"
#: The native wait's bound (ns): the watcher's Python looks again at least this often.
NATIVE_WAIT_TIMEOUT_NS = 100_000_000


def _native_wait() -> Any:
    """cuda_ext's ``wait_stamps`` (polls the stamps with the GIL released),
    or None: no compiled module, a build without it, or ``POLL_NATIVE_ENV=0``.

    Measured 2026-12-07 (``bench/gil_poll.py``): a thread that wakes every
    20 us to look at the stamps in Python makes each small torch op of the
    main thread dearer (each op lets the GIL go and must take it back from
    the poller): 1.26x for CPU ops on the 2-core VM, 1.08x for CUDA ops on an
    H100's host, where beside ``wait_stamps`` it is 1.01x."""
    if os.environ.get(POLL_NATIVE_ENV, "1") == "0":
        return None
    import cuda_ext

    mod = cuda_ext.kernels()
    return getattr(mod, "wait_stamps", None) if mod is not None else None


class _Watcher:
    """The thread behind ``Releaser.watch``.

    Lateness: a wait that ended ``late`` ns after it was due delayed its
    stream, but what follows it was only delayed where the stream would
    otherwise have been busy: the next call's reach, had the release been on
    time, is ``max(reach - late, its CPU issue)`` (a stream cannot get to a
    call its CPU has not issued). So the next reach carries
    ``min(late, reach - issue)`` of it into ``on_late`` (the rank's dilated
    clock), and the rest, absorbed while the stream waited for its CPU
    anyway, is dropped. But the CPU's issue was itself late by the time the
    calls before it spent in Prism beyond NCCL's (``note_excess``), which the
    real job's CPU would not have spent: had the release been on time, the
    reach would have been ``max(reach - late, issue - excess)``, so
    ``min(late, reach - issue + excess)`` is carried (``LATE_CARRY_ENV``)."""

    def __init__(self, flags: Any, poll_s: float) -> None:
        import collections

        self.flags = flags
        self.poll_s = poll_s
        self.carry = os.environ.get(LATE_CARRY_ENV) or latecarry.RULES[0]
        if self.carry not in latecarry.RULES:
            raise SystemExit(f"prism: {LATE_CARRY_ENV}={self.carry!r}: give {', '.join(latecarry.RULES)} (the first "
                             "is the default)")
        #: slot -> the call's time in Prism beyond NCCL's (``note_excess``), and
        #: the slots whose lateness ``_late`` holds
        self._excess: dict[int, int] = {}
        self._late_slots: list[int] = []
        self._late_recs: list[dict | None] = []  # their call-log records, beside them
        self._late_steps: list[int | None] = []  # and the program's steps they were called in
        self.carry_delivery = carry_delivery()
        self._calls: collections.deque = collections.deque()  # (slot, issue, on_reach, on_late, rec, drained)
        self._reached: collections.deque = collections.deque()  # (slot, rec, step) reached, lateness not yet read
        self._late = 0
        self._cond = threading.Condition()
        #: Bumped by ``add``: the native wait (``_native_wait``) returns when it moves.
        self._gen = torch.zeros(1, dtype=torch.int64)
        self._gen_np = self._gen.numpy()
        self._wait = _native_wait()
        import atexit
        import sys

        how = ("waited in cuda_ext.wait_stamps (the GIL released)" if self._wait is not None else
               f"polled in Python every {poll_s * 1e6:g} us")
        atexit.register(lambda: print(f"prism: reach watcher: {how}", file=sys.stderr, flush=True))
        threading.Thread(target=self._loop, name="prism-reach", daemon=True).start()

    def note_excess(self, slot: int, ns: int) -> None:
        self._excess[slot] = ns

    def _delivery(self) -> int:
        """With ``CARRY_DELIVERY_ENV``: the stream's time forming the outputs
        of the calls whose lateness is held (stamped before this reach where
        they are on its stream; one on another stream not stamped yet counts
        0), carried as their lateness is; the call log's ``deliver``. 0
        otherwise."""
        if not self.carry_delivery:
            return 0
        total = 0
        for s, rec in zip(self._late_slots, self._late_recs):
            d = self.flags.delivery_ns(s)
            total += d
            if rec is not None:
                rec["deliver"] = d
        return total

    def spend_excess(self, slot: int, ns: int) -> None:
        if slot in self._excess:
            self._excess[slot] = max(0, self._excess[slot] - ns)

    def add(self, slot: int, issue_mono_ns: int, on_reach: Any, on_late: Any, rec: dict | None = None,
            drained: bool = False, step: int | None = None) -> None:
        self._excess.pop(slot, None)  # an earlier call's on this slot, never read (a drained carry)
        with self._cond:
            if not self._calls:  # the watcher waits on no reach: wake it (else it waits on the first's)
                self._gen_np[0] += 1
            self._calls.append((slot, issue_mono_ns, on_reach, on_late, rec, drained, step))
            self._cond.notify()

    def _loop(self) -> None:
        import time

        flags = self.flags
        period_ns = int(self.poll_s * 1e9)
        while True:
            with self._cond:
                while not self._calls and not self._reached:
                    self._cond.wait()
                seen = int(self._gen_np[0])  # before the checks: a call added after them moves it
            moved = False
            while True:
                # the waits before (their ends precede the next reach on a stream) ...
                while self._reached and (late := flags.late_ns(self._reached[0][0])) is not None:
                    s, done, st = self._reached.popleft()
                    self._late += late
                    self._late_slots.append(s)
                    self._late_recs.append(done)
                    self._late_steps.append(st)
                    if done is not None:
                        done["late"] = late
                if not self._calls:
                    break
                slot, issue, on_reach, on_late, rec, drained, step = self._calls[0]
                reach = flags.reached_mono_ns(slot)  # ... then the next call's reach
                if not reach:
                    break
                with self._cond:
                    self._calls.popleft()
                hc = _host_charge if drained else None
                if hc is not None:
                    # The stream had drained: it waited for this host from the
                    # call's entry, so the lateness before was absorbed and
                    # what delays it is Prism's issue time.
                    carried = hc.pre(issue, reach)
                    hc.add_pre(carried)
                else:
                    # The host's issue of this call came late by the previous
                    # calls' time in Prism beyond NCCL's: not the job's, so the
                    # lateness it hid was not absorbed by a slow host.
                    own = sum(self._excess.pop(s, 0) for s in self._late_slots)
                    held = self._late + self._delivery()
                    new_step = step is not None and any(st is not None and st < step for st in self._late_steps)
                    carried = latecarry.carried(self.carry, held, reach - issue, own, new_step)
                self._late = 0
                self._late_slots.clear()
                self._late_recs.clear()
                self._late_steps.clear()
                if carried:
                    on_late(carried)
                if rec is not None:
                    rec["reach"] = reach
                    rec["t_seen"] = time.monotonic_ns()  # the watcher saw the reach (the round trip's first leg)
                on_reach(reach)
                if rec is not None:
                    rec["t_rsent"] = time.monotonic_ns()  # its Reached handed to the transport
                self._reached.append((slot, rec, step))
                moved = True
            if not moved:
                if self._wait is None:
                    time.sleep(self.poll_s)
                    continue
                # Until the oldest reached wait ends or the next call's stream
                # reaches it (or a call is added), with the GIL released.
                end = 2 * self._reached[0][0] + 1 if self._reached else -1
                reach = 2 * self._calls[0][0] if self._calls else -1
                self._wait(flags.stamps, end, reach, self._gen, seen, period_ns, NATIVE_WAIT_TIMEOUT_NS)


#: ``PRISM_DEVICE_SHARED_RELEASE=1`` (opt-in, an experiment): the release flags
#: live in a shared-memory file the emulating coordinator maps
#: (``transport.shared_release``) and releases a device-path collective by
#: writing its flag and deadline there as the result goes out, so the GPU
#: goes on without the result's trip to the rank and its transport thread
#: (290-400 us of a ~900 us round trip on an H100's host, 2026-12-08,
#: ``bench/results/gpu_sandbox-2026-12-08-h100.md``). The rank still flips
#: the same flag when the result arrives.
SHARED_RELEASE_ENV = "PRISM_DEVICE_SHARED_RELEASE"


def _shared_release_path() -> str:
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"prism-release-{os.getpid()}-{id(object()):x}")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


#: "1" with ``PRISM_GPU_SANDBOX=cpu-test`` (for benchmarks): the "stream"'s
#: reach is reported from a thread of its own, as the GPU's reach watcher
#: does, not on the calling thread (``bench/call_cost.py --threaded-reach``).
THREADED_REACH_ENV = "PRISM_CPU_TEST_THREADED_REACH"


class _NullReleaser:
    """``cpu-test``: nothing to wait on; the "stream" reaches a call as it is
    issued (the protocol of a reported reach is exercised all the same). With
    ``THREADED_REACH_ENV`` the reach is reported from another thread, as on a
    GPU (what a call's host time is then, on the calling thread, is the GPU
    path's arrangement; a rank may end before the last reaches are reported,
    so it is for benchmarks)."""

    mode = "cpu-test"
    reports_reach = True
    shared_path = None
    announced = True

    _reaches: Any = None  # the threaded reach's queue (THREADED_REACH_ENV), made at its first call

    def watch(self, slot: int, issue_mono_ns: int, on_reach: Any, on_late: Any, rec: dict | None = None,
              drained: bool = False, step: int | None = None) -> None:
        import time

        at = time.monotonic_ns()
        if rec is not None:
            rec["reach"] = at
        if _flags().threaded_reach:
            if self._reaches is None:
                import queue

                self._reaches = queue.SimpleQueue()
                threading.Thread(target=self._report, name="prism-reach", daemon=True).start()
            self._reaches.put((on_reach, at))
            return
        on_reach(at)

    def _report(self) -> None:
        while True:
            on_reach, at = self._reaches.get()
            on_reach(at)

    def prepare(self, slot: int) -> None:
        pass

    def moments(self, slot: int) -> Any:
        return lambda: (0, 0)

    def note_return(self, slot: int, host_ns: int) -> None:
        pass

    def spend_excess(self, slot: int, ns: int) -> None:
        pass

    def reserve(self) -> tuple[int, int]:
        return 0, 0

    def enqueue_wait(self, slot: int, value: int) -> None:
        pass

    def mark_delivered(self, slot: int) -> None:
        pass

    def release(self, slot: int, value: int, at_ns: int = 0, tail_ns: int = 0) -> None:
        pass


def releaser() -> Releaser | None:
    """The process's releaser, or None where the GPU cannot wait on a flag
    (no compiled wait kernel and no cuda-python): the host path runs."""
    global _releaser
    with _lock:
        if _releaser is None and _cpu_test():
            _releaser = _NullReleaser()
        if _releaser is None:
            try:
                r = Releaser()
            except Exception:  # noqa: BLE001 (no CUDA, no pinned memory: the host path)
                return None
            if r.mode == "host":
                return None
            _releaser = r
        return _releaser


@torch.no_grad()
def form_outputs(op: str, reduce_name: str, premul: float | None, n: int, g: int,
                 inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                 in_splits: Sequence[int] = (), out_splits: Sequence[int] = ()) -> None:
    """Enqueue on the current stream the compensated outputs of a call of a
    sandbox (group rank ``g`` of ``n``) whose other members are all virtual,
    in place (the module docstring's table)."""
    scale = float(n) * (premul if reduce_name == "PREMUL_SUM" and premul is not None else 1.0)
    scaled = reduce_name in ("SUM", "PREMUL_SUM")
    if op in ("all_reduce", "all_reduce_coalesced"):
        if scaled:
            for t in inputs:
                t.mul_(scale)
        return
    if op == "reduce_scatter_tensor":
        (x,), (out,) = inputs, outputs
        c = out.numel()
        chunk = x.reshape(-1)[g * c:(g + 1) * c].view(out.shape)
        if scaled:
            torch.mul(chunk, scale, out=out)
        else:
            out.copy_(chunk)
        return
    if op == "all_gather_into_tensor":
        (x,), (out,) = inputs, outputs
        out.view(n, -1).copy_(x.reshape(1, -1).expand(n, -1))
        return
    if op == "all_to_all_single":
        (x,), (out,) = inputs, outputs
        if not in_splits and not out_splits:
            out.copy_(x)
            return
        _all_to_all_uneven(x, out, n, g, list(in_splits), list(out_splits))
        return
    # broadcast (the root keeps its tensor; from a virtual root the tensor is
    # left as it is, as compensation does), barrier: nothing to form


def _all_to_all_uneven(x: torch.Tensor, out: torch.Tensor, n: int, g: int, ins: list[int], outs: list[int]) -> None:
    """``compensation.hybrid_outputs`` for ``all_to_all_single`` with splits,
    one sandbox: the rows from a virtual member j are the sandbox's own chunk
    for j (its whole input where that chunk is empty), cut or tiled to the
    rows j sends; its own chunk comes back as it is. Copies only, into the
    program's output tensor (no memory of Prism's own)."""
    rows = x.shape[0] if x.dim() else 0
    ins = ins or [rows // n] * n
    outs = outs or [rows // n] * n
    row = int(x[0].numel()) if rows else int(out[0].numel()) if out.dim() and out.shape[0] else 1
    src_flat, dst_flat = x.reshape(-1), out.reshape(-1)
    a = b = 0
    for j in range(n):
        mine = src_flat[a * row:(a + ins[j]) * row]
        dst = dst_flat[b * row:(b + outs[j]) * row]
        a += ins[j]
        b += outs[j]
        if j == g:
            dst.copy_(mine)
            continue
        src = mine if mine.numel() else src_flat
        m, k = src.numel(), dst.numel()
        if m == 0:
            dst.zero_()
            continue
        for at in range(0, k, m):  # tiled; splits are near-balanced, so once or twice
            dst[at:at + m].copy_(src[:min(m, k - at)])


# --- recorded outputs through the prefetch pool --------------------------------------------

from prism.rank.envnames import POOL_ENV, RECORDING_ENV  # noqa: E402 (beside their use)

DEFAULT_POOL_BYTES = 256 << 20

_feed: "RecordedFeed | None | bool" = False  # False: not looked for yet


class RecordedFeed:
    """A device-path sandbox's recorded outputs (``prism capture --record``),
    delivered from a ``cuda_ext.PrefetchPool`` so that the sandbox receives
    what the real job gave it (its losses are the capture's) with no host
    round trip on its critical path.

    The rank's payload records (``RUN/payloads/rank-N.jsonl``) list what it
    received in the order it received it: the order its calls come. Where
    the whole recording fits ``host_budget`` (``preloaded``), it is read
    once, at the first call, into pinned host memory, and each call queues
    on the pool's side stream the host-to-device copies of the blocks that
    come next, as many as the pool has room for without waiting (the GPU
    fills them while the sandbox computes). Else a thread reads them
    ahead, in that order, from the side file into the pool's pinned host
    mirror and queues each block's copy (measured on an H200, 2026-12-03:
    a 16 MiB block per call at 32 calls per 44 ms step outran one reading
    thread; the stream waited for its fills). A call then enqueues, behind
    its release wait on the caller's stream, a wait for its block's fill and
    a device-to-device copy into the output (``deliver``); the block returns
    to the pool once the stream has passed the copy. A call whose block is
    not staged (the pool full of blocks not consumed yet, or the reader
    behind) copies its bytes from the host directly, on the caller's stream
    behind the release (``direct``: counted). The bytes are not checked against their digests here (the
    coordinator's host path does; a damaged side file shows in the losses).
    The pool and its mirror are Prism's own memory, outside torch's
    allocator: ``torch.cuda.memory_allocated`` stays the program's."""

    def __init__(self, index_path: str, pool_bytes: int, device: torch.device,
                 host_budget: int | None = None) -> None:
        import collections
        import pathlib

        import cuda_ext
        from prism.core.trace import parse_rank_file

        path = pathlib.Path(index_path)
        events, _, _ = parse_rank_file(path.read_bytes(), str(path), expect_end=False)
        self.run_dir = str(path.parent.parent)  # the records name their data files relative to the run
        self.records = {e.ref: e for e in events if getattr(e, "KIND", "") == "payload" and e.role == "recv"
                        and e.file}
        self._order = collections.deque(self.records.values())
        self._queued = set(self.records)  # the refs the reader will still get to
        self._fds: dict[str, int] = {}
        total = sum(r.nbytes for r in self.records.values())
        self.preloaded = total <= (default_host_budget() if host_budget is None else host_budget)
        self.pool = cuda_ext.PrefetchPool(pool_bytes, device, host_mirror=not self.preloaded)
        self.pool_bytes = self.pool.nbytes
        self.host_bytes = total if self.preloaded else self.pool_bytes
        self._host: dict[str, torch.Tensor] = {}
        self._host_ptr: dict[str, int] = {}  # each one's address (the native pool takes addresses)
        if self.preloaded:
            host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
            base = host.data_ptr()
            off = 0
            for rec in self._order:
                self._host[rec.ref] = host[off:off + rec.nbytes]
                self._host_ptr[rec.ref] = base + off
                self._read_into(rec, self._host[rec.ref])
                off += rec.nbytes
        self.device = device
        self._cond = threading.Condition()
        self._taken: set[str] = set()  # delivered directly before the reader got to them
        self._reading: str | None = None
        self._full = False
        self.delivered = 0
        self.direct = 0
        self.missing = 0
        self.error: BaseException | None = None
        self._reported = False
        import atexit

        atexit.register(self._report)
        if self.preloaded:
            with self._cond:
                self._advance()
        else:
            threading.Thread(target=self._loop, name="prism-prefetch", daemon=True).start()

    def _advance(self) -> None:
        """Preloaded: queue the fills of the blocks that come next, as far as
        the pool has room without waiting (under the lock)."""
        while self._order:
            rec = self._order[0]
            if rec.ref in self._taken:
                self._taken.discard(self._order.popleft().ref)
                continue
            if not self.pool.fits(rec.nbytes):
                return
            # a slice of the whole recording: contiguous uint8, pinned for a GPU
            self.pool.stage(rec.ref, self._host[rec.ref], block=False, ready=True, ptr=self._host_ptr[rec.ref])
            self._order.popleft()
            self._queued.discard(rec.ref)

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(os.path.join(self.run_dir, name), os.O_RDONLY)
        return fd

    def _read_into(self, rec: Any, buf: torch.Tensor) -> None:
        view = memoryview(buf.numpy()).cast("B")
        got = os.preadv(self._fd(rec.file), [view], rec.offset)
        if got != rec.nbytes:
            raise RuntimeError(f"prism: the recorded bytes of {rec.ref} in {self.run_dir}/{rec.file} end after "
                               f"{got} of {rec.nbytes} bytes (the side file is truncated)")

    def _loop(self) -> None:
        from cuda_ext import PoolFull

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            while True:
                with self._cond:
                    while self._order and self._order[0].ref in self._taken:
                        self._taken.discard(self._order.popleft().ref)
                    if not self._order:
                        self._reading = None
                        self._cond.notify_all()
                        return
                    rec = self._order[0]
                    try:
                        buf = self.pool.reserve(rec.ref, rec.nbytes)
                    except PoolFull:
                        self._full = True
                        self._cond.notify_all()
                        self._cond.wait(0.001)  # a delivery or the stream passing one makes room
                        continue
                    self._full = False
                    self._reading = rec.ref
                self._read_into(rec, buf)  # outside the lock (preadv releases the GIL)
                with self._cond:
                    self.pool.commit(rec.ref)
                    self._order.popleft()
                    self._queued.discard(rec.ref)
                    if rec.ref in self._taken:  # refused while it was read: its block goes back
                        self._taken.discard(rec.ref)
                        self.pool.done(rec.ref)
                    self._reading = None
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 (reported at the next delivery; those read directly)
            with self._cond:
                self.error = e
                self._reading = None
                self._order.clear()
                self._queued.clear()
                self._cond.notify_all()

    def can_deliver(self, ref: str, out: torch.Tensor) -> bool:
        """Whether ``deliver(ref, out)`` will deliver the recording (it holds
        ``ref`` at ``out``'s size; the recorded bytes of a data-sized call
        such as an uneven all_to_all match only where the sandbox routes as
        the capture did)."""
        rec = self.records.get(ref)
        return rec is not None and rec.nbytes == out.numel() * out.element_size() and self.error is None

    def deliver(self, ref: str, out: torch.Tensor, log: dict | None = None) -> bool:
        """Enqueue on the current stream the copy of ``ref``'s recorded bytes
        into ``out`` (behind whatever the stream waits on already); False
        when nothing is recorded for it or its size is not ``out``'s (the
        caller compensates). ``log`` (a call-log record): the moments of the
        preloaded path's steps (``f_lock`` the feed's lock taken, ``f_adv0``
        the fills ahead queued, ``f_copy`` the copy queued and its block
        retired, ``f_adv1`` the fills after it) and ``f_staged``, the blocks
        the fill queue advanced by in this call (monotonic ns; summed over a call's outputs)."""
        rec = self.records.pop(ref, None)
        nbytes = out.numel() * out.element_size()
        if rec is None or rec.nbytes != nbytes:
            self.missing += 1
            if rec is not None:
                with self._cond:
                    self._drop(rec)
                    if ref in self.pool:  # staged already: its block goes back
                        self.pool.done(ref)
            return False
        if self.preloaded:
            with self._cond:
                stamp(log, "f_lock")
                staged = len(self._order)
                if ref not in self.pool:  # room made since the last call may hold it now
                    self._advance()
                stamp(log, "f_adv0")
                if ref in self.pool:
                    self._deliver_staged(ref, out)  # after its fill, on the current stream; the block goes back after
                else:  # not staged (the pool is full of what comes later): from the host, behind the release
                    self._drop(rec)
                    out.copy_(_as(self._host[ref], out), non_blocking=out.is_cuda)
                    self.direct += 1
                self.delivered += 1
                stamp(log, "f_copy")
                self._advance()
                stamp(log, "f_adv1")
                if log is not None:
                    log["f_staged"] = log.get("f_staged", 0) + staged - len(self._order)
            return True
        with self._cond:
            while ref not in self.pool and (self._reading == ref or (not self._full and self._ahead(ref))):
                self._cond.wait(0.01)
            if ref in self.pool:
                self._deliver_staged(ref, out)
                self.delivered += 1
                self._cond.notify_all()
                return True
            self._drop(rec)
        # The reader has not got to it and will not soon: read it here.
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=out.is_cuda)
        self._read_into(rec, host)
        out.copy_(_as(host, out), non_blocking=out.is_cuda)
        self.direct += 1
        self.delivered += 1
        return True

    def _deliver_staged(self, ref: str, out: torch.Tensor) -> None:
        """The pool's delivery of ``ref`` into ``out`` (under the lock); if it
        fails, the block is refused, so that the ring does not stop at it."""
        try:
            self.pool.deliver(ref, out)
        except BaseException:
            if ref in self.pool:
                self.pool.done(ref)
            raise

    def _ahead(self, ref: str) -> bool:
        """Whether the reader will still get to ``ref`` (under the lock)."""
        return ref in self._queued

    def _drop(self, rec: Any) -> None:
        """The reader is to skip ``rec`` (delivered or refused here)."""
        if rec.ref in self._queued:
            self._queued.discard(rec.ref)
            self._taken.add(rec.ref)

    def stats(self) -> dict[str, int]:
        return {"pool_bytes": self.pool_bytes, "pool_peak_bytes": self.pool.pool.peak,
                "native": int(self.pool.native),
                "host_bytes": self.host_bytes, "preloaded": int(self.preloaded),
                "staged_bytes": self.pool.staged_bytes, "delivered": self.delivered, "direct": self.direct,
                "missing": self.missing}

    def _report(self) -> None:
        import sys

        if self._reported:
            return
        self._reported = True
        s = self.stats()
        print(f"prism: prefetch pool: {s['pool_bytes'] / 2**20:.0f} MiB on {self.device} (Prism's own, outside "
              f"torch's allocator; peak use {s['pool_peak_bytes'] / 2**20:.1f} MiB; "
              f"{s['host_bytes'] / 2**20:.1f} MiB of pinned host memory, "
              f"{'the whole recording' if self.preloaded else 'a mirror of the pool'}; "
              f"{'native copies' if s['native'] else 'copies through torch'}), {s['delivered']} recorded "
              f"outputs delivered ({s['direct']} not staged ahead), {s['staged_bytes'] / 2**20:.1f} MiB "
              f"staged ahead" + (f"; reader failed: {self.error}" if self.error else ""),
              file=sys.stderr, flush=True)


def _as(raw: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Recorded bytes (uint8, contiguous) as ``out``'s dtype and shape, its
    elements in order: ``out.copy_`` of it fills a non-contiguous ``out`` too."""
    return raw.view(out.dtype).view(out.shape)


#: ``RecordedFeed``'s pinned host memory for a whole recording (bytes; default
#: a quarter of the machine's memory, at most 16 GiB); a larger recording streams.
HOST_BUDGET_ENV = "PRISM_PREFETCH_HOST_BYTES"


def default_host_budget() -> int:
    if os.environ.get(HOST_BUDGET_ENV):
        return int(os.environ[HOST_BUDGET_ENV])
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 16 << 30
    return min(16 << 30, ram // 4)


def recorded_feed(rank: int, device: torch.device | None) -> RecordedFeed | None:
    """This sandbox rank's recorded outputs, or None (no recording given, or
    none kept for this rank): its device-path calls are compensated. The
    pool is made on ``device`` at the first call that names one."""
    global _feed
    with _lock:
        if _feed is False and device is not None:
            _feed = None
            template = os.environ.get(RECORDING_ENV)  # RUN/payloads/rank-{rank:06d}.jsonl
            path = template.format(rank=rank) if template else ""
            if path and os.path.isfile(path):
                size = int(os.environ.get(POOL_ENV) or DEFAULT_POOL_BYTES)
                _feed = RecordedFeed(path, size, device)
        return _feed or None


# --- async calls on a side stream ---------------------------------------------------------

#: "0": async device-path calls wait on the caller's stream, as before (for comparison).
SIDE_STREAM_ENV = "PRISM_DEVICE_SIDE_STREAM"
_sides: dict[Any, "SideStream"] = {}


class StreamDone:
    """The event after an async call's outputs on the side stream, and a
    stream that waits for it (``follower``: for the torch future's
    completion, on the completion thread)."""

    __slots__ = ("event", "device", "_follower")

    def __init__(self, event: Any, device: torch.device) -> None:
        self.event, self.device, self._follower = event, device, None

    def follower(self) -> Any:
        s = _follower_stream(self.device)
        s.wait_event(self.event)
        return s


_followers: dict[Any, Any] = {}


def _follower_stream(device: torch.device) -> Any:
    key = (threading.get_ident(), device)
    s = _followers.get(key)
    if s is None:
        s = _followers[key] = torch.cuda.Stream(device=device)
    return s


class SideStream:
    """An async device-path collective runs as NCCL's does: on a stream of
    its own (one per device, like NCCL's communicator stream), which first
    waits for the caller's stream to reach the call, then for the release,
    then forms the outputs; the caller's stream goes on computing (the
    overlap of DDP's buckets and FSDP's prefetch). ``Work.wait()`` (or the
    torch future) orders the consumer's stream behind the call's event, and
    the call's tensors are held until then so that the caller's stream
    cannot reuse their memory early (NCCL's stash, its default without
    ``recordStream``). The wait kernel's reach is the side stream's: when
    the caller's stream had got to the call and the calls before it on the
    side stream were done, as NCCL's kernel starts."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    @contextlib.contextmanager
    def run(self, pending: Any, tensors: Sequence[torch.Tensor]):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
            ev = torch.cuda.Event()
            ev.record(self.stream)
        pending.stream_done = StreamDone(ev, self.device)
        pending.stash = list(tensors)


def side_stream(device: torch.device) -> SideStream | None:
    """The side stream for ``device``'s async device-path calls; None on
    CPU tensors (``cpu-test``) or with ``PRISM_DEVICE_SIDE_STREAM=0``."""
    if device.type != "cuda" or not _flags().side_stream:
        return None
    with _lock:
        s = _sides.get(device)
        if s is None:
            s = _sides[device] = SideStream(device)
        return s


def describe() -> dict[str, Any]:
    r = _releaser
    return {"enabled": enabled(), "mode": r.mode if r is not None else None}
