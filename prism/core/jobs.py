"""The job daemon's logic, sans-IO: job records, their states, what a job
needs, which queued jobs may start, and the daemon's wire messages.

``prism coordinator --daemon`` (``prism.shell.daemon``) is a long-lived
service that runs Prism commands (capture, predict, emulate, calibrate,
campaign) as *jobs* with the slots and GPUs it owns. Everything here is pure:
times enter as arguments (Unix seconds, floats), bytes as arguments, and the
shell does the processes, files and sockets.

A job moves through these states::

    queued -> running -> done | failed | cancelled | interrupted
    queued -> cancelled            (dropped before it started)

``interrupted`` is what a running job becomes when the daemon stops (SIGTERM)
or died under it; a restart finds it so in its record and never runs it again
on its own (its run folder holds what it kept; ``prism submit`` runs it anew).
A job of a kind that resumes by itself (``RESUMABLE``: a campaign skips the
points it has finished) goes back to the queue with ``prism resume ID``
(``resume``), after the jobs already queued::

    interrupted | cancelled -> queued   (resumable kinds only)

Resources: the daemon owns ``slots`` (ranks that may compute at once, the
project's word) and a set of GPUs. A job's need is read from its argv
(``need_of``), and queued jobs start in submission order while their need
fits (``startable``): the first ready job that does not fit blocks those
behind it, so a large job is never starved by a stream of small ones.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prism.core import codec

__all__ = [
    "ACTIVE", "JOB_KINDS", "blocked_by_failure", "job_from_dict", "job_to_dict", "STATES", "TERMINAL", "Cancel", "Capacity", "Job", "JobError", "JobList", "Jobs",
    "Logs", "LogText", "Need", "Refused", "Submit", "Submitted", "decode_message", "encode_message",
    "check_env", "gpu_list", "job_env", "need_of", "recover", "resume", "Resume", "RESUMABLE", "run_dir_of", "startable", "transition",
]

#: The commands a job may run (``python -m prism KIND ARGS``).
JOB_KINDS = ("capture", "predict", "emulate", "calibrate", "campaign")
STATES = ("queued", "running", "done", "failed", "cancelled", "interrupted")
#: Kinds whose rerun continues where the last one stopped (``prism resume``).
RESUMABLE = frozenset({"campaign"})
TERMINAL = frozenset({"done", "failed", "cancelled", "interrupted"})
ACTIVE = frozenset({"queued", "running"})

#: Allowed moves between states (see the module docstring).
_MOVES: dict[str, frozenset[str]] = {
    "queued": frozenset({"running", "cancelled"}),
    "running": frozenset({"done", "failed", "cancelled", "interrupted"}),
    "done": frozenset(),
    "failed": frozenset(),
    "cancelled": frozenset({"queued"}),  # ``resume`` only (resumable kinds)
    "interrupted": frozenset({"queued"}),
}


class JobError(ValueError):
    """A request the daemon refuses: an unknown command, a need it cannot
    meet, an illegal state change, an unknown job id. The text says what to do."""


@dataclass(frozen=True, slots=True)
class Need:
    """What a job holds while it runs: ``slots`` of the daemon's and the
    GPUs it names (``gpus``, physical indices; empty: none)."""

    slots: int
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Capacity:
    """What the daemon owns: ``slots`` and the GPUs ``gpus``."""

    slots: int
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Job:
    """One job's record, as ``STATE/jobs/ID/job.json`` holds it and as the
    daemon reports it. ``seq`` orders jobs by submission; times are Unix
    seconds (0: not yet); ``exit_code`` is the process's status (``-N``: killed
    by signal N; None while it has none); ``pid``/``pid_start`` name the job's
    process (its process group leader) and its start time, so a restarted
    daemon kills a leftover only if it is that very process; ``progress`` is
    the last line of the log when the record was last written or read."""

    id: str
    seq: int
    kind: str
    argv: tuple[str, ...]
    cwd: str
    name: str = ""
    state: str = "queued"
    slots: int = 1
    gpus: tuple[int, ...] = ()
    after: tuple[str, ...] = ()
    submitted_at: float = 0.0
    started_at: float = 0.0
    ended_at: float = 0.0
    exit_code: int | None = None
    pid: int = 0
    pid_start: int = 0
    run_dir: str = ""
    message: str = ""
    progress: str = ""
    #: ``NAME=VALUE`` on top of the daemon's environment (``Submit.env``).
    env: tuple[str, ...] = ()

    @property
    def need(self) -> Need:
        return Need(self.slots, self.gpus)

    @property
    def command(self) -> tuple[str, ...]:
        """What the job runs after ``python -m prism``."""
        return (self.kind, *self.argv)


def transition(job: Job, state: str, **changes: Any) -> Job:
    """``job`` in ``state`` (with ``changes``); ``JobError`` if the move is
    not allowed (a finished job cannot run again, a queued one cannot be
    interrupted)."""
    if state not in _MOVES:
        raise JobError(f"unknown job state {state!r}; states are {', '.join(STATES)}")
    if state not in _MOVES[job.state]:
        raise JobError(f"job {job.id} is {job.state}; it cannot become {state}")
    return replace(job, state=state, **changes)


# --- what a job needs ---------------------------------------------------------------


def _options(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """The ``--opt VALUE`` / ``--opt=VALUE`` / ``-n VALUE`` options and the
    positionals of a Prism command line, up to ``--`` (the script's own
    arguments are not Prism's). A flag followed by another option counts as
    a flag with the value ""."""
    opts: dict[str, str] = {}
    pos: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            break
        if a.startswith("--") and "=" in a:
            k, _, v = a.partition("=")
            opts[k] = v
        elif a.startswith("-") and len(a) > 1 and not _is_number(a):
            if len(a) > 2 and not a.startswith("--"):  # -n2
                opts[a[:2]] = a[2:]
            elif i + 1 < len(argv) and (not argv[i + 1].startswith("-") or _is_number(argv[i + 1])):
                opts[a] = argv[i + 1]
                i += 1
            else:
                opts[a] = ""
        else:
            pos.append(a)
        i += 1
    return opts, pos


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _int_option(opts: Mapping[str, str], names: Iterable[str], kind: str) -> int | None:
    for n in names:
        if n in opts:
            try:
                value = int(opts[n])
            except ValueError:
                raise JobError(f"{kind} {n} {opts[n]!r}: expected an integer") from None
            if value < 1:
                raise JobError(f"{kind} {n} {value}: must be at least 1")
            return value
    return None


def gpu_list(text: str, kind: str) -> tuple[int, ...]:
    """``"1,0"`` as sorted GPU indices; ``JobError`` naming ``kind`` for bad text."""
    try:
        gpus = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise JobError(f"{kind} --gpus {text!r}: expected a list of GPU indices like 0 or 0,1") from None
    if any(g < 0 for g in gpus):
        raise JobError(f"{kind} --gpus {text!r}: GPU indices are 0 or more")
    return gpus


def _count_ranks(text: str, kind: str) -> int:
    """How many ranks ``0,5`` or ``0-3,8`` names."""
    n = 0
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            n += int(hi) - int(lo) + 1 if dash else 1
        except ValueError:
            raise JobError(f"{kind} --sandbox {text!r}: expected ranks like 0,5 or 0-3") from None
    return max(n, 1)


def need_of(kind: str, argv: Sequence[str], capacity: Capacity) -> Need:
    """What a job of ``kind`` with ``argv`` holds while it runs, read from its
    options: ``--slots K`` wherever given; else a capture takes
    ``min(--world-size, the daemon's slots)`` (a capture without ``--slots``
    uses every core), an emulation one slot per sandbox rank, a calibration
    or campaign every slot (their timing must be faithful: one rank per core),
    a prediction one slot. ``--gpus LIST`` holds those GPUs. ``JobError`` when
    the daemon can never meet it (more slots than it owns, a GPU it does not
    own), so the job is refused at submission instead of waiting forever."""
    if kind not in JOB_KINDS:
        raise JobError(f"unknown job command {kind!r}: a job runs one of {', '.join(JOB_KINDS)}")
    opts, _ = _options(argv)
    slots = _int_option(opts, ("--slots",), kind)
    if slots is None:
        if kind == "capture":
            world = _int_option(opts, ("--world-size", "-n"), kind)
            slots = min(world or capacity.slots, capacity.slots)
        elif kind == "emulate":
            sandbox = opts.get("--sandbox")
            slots = min(_count_ranks(sandbox, kind), capacity.slots) if sandbox else 1
        elif kind in ("calibrate", "campaign"):
            slots = capacity.slots
        else:
            slots = 1
    gpus = gpu_list(opts["--gpus"], kind) if opts.get("--gpus") else ()
    if slots > capacity.slots:
        raise JobError(f"{kind} --slots {slots}: the daemon owns {capacity.slots} slots; ask for at most "
                       f"{capacity.slots} or start the daemon with more (--slots)")
    missing = [g for g in gpus if g not in capacity.gpus]
    if missing:
        owned = ",".join(map(str, capacity.gpus)) or "none"
        raise JobError(f"{kind} --gpus {','.join(map(str, gpus))}: the daemon does not own GPU "
                       f"{','.join(map(str, missing))} (it owns {owned}; start it with --gpus)")
    return Need(slots, gpus)


def run_dir_of(kind: str, argv: Sequence[str], cwd: str) -> str:
    """The run folder a job writes or reads, when its argv says (a capture's
    ``--out``, the run of predict/emulate/calibrate); "" when unknown."""
    opts, pos = _options(argv)
    if kind == "capture":
        path = opts.get("--out") or opts.get("-o") or ""
    elif kind in ("predict", "emulate", "calibrate"):
        path = pos[0] if pos else ""
    else:
        path = opts.get("--out") or opts.get("-o") or ""
    if not path:
        return ""
    return path if path.startswith("/") else f"{cwd.rstrip('/')}/{path}"


# --- the queue ----------------------------------------------------------------------


def _in_use(running: Iterable[Job]) -> tuple[int, set[int]]:
    slots, gpus = 0, set()
    for j in running:
        slots += j.slots
        gpus.update(j.gpus)
    return slots, gpus


def startable(jobs: Iterable[Job], capacity: Capacity) -> list[Job]:
    """The queued jobs to start now, in submission order: each whose
    dependencies (``after``) are done, while its need fits beside what runs
    and what starts before it. The first ready job that does not fit stops
    the walk (no job overtakes a waiting one)."""
    jobs = sorted(jobs, key=lambda j: j.seq)
    by_id = {j.id: j for j in jobs}
    used, gpus = _in_use(j for j in jobs if j.state == "running")
    out: list[Job] = []
    for j in jobs:
        if j.state != "queued":
            continue
        if any(by_id.get(d) is None or by_id[d].state != "done" for d in j.after):
            continue
        if used + j.slots > capacity.slots or gpus.intersection(j.gpus):
            break
        out.append(j)
        used += j.slots
        gpus.update(j.gpus)
    return out


def blocked_by_failure(jobs: Iterable[Job]) -> list[tuple[Job, str]]:
    """Queued jobs whose dependency ended other than done (or is unknown),
    with the reason: they can never start, so the daemon cancels them."""
    by_id = {j.id: j for j in jobs}
    out = []
    for j in sorted(by_id.values(), key=lambda j: j.seq):
        if j.state != "queued":
            continue
        for d in j.after:
            dep = by_id.get(d)
            if dep is None:
                out.append((j, f"it waits for job {d}, which the daemon does not know"))
                break
            if dep.state in TERMINAL and dep.state != "done":
                out.append((j, f"job {d}, which it waits for, ended {dep.state}"))
                break
    return out


def recover(jobs: Iterable[Job], now: float) -> list[Job]:
    """Records as a restarted daemon must hold them: ``running`` ones become
    ``interrupted`` (the daemon that ran them is gone), queued ones stay
    queued, finished ones as they were."""
    out = []
    for j in sorted(jobs, key=lambda j: j.seq):
        if j.state == "running":
            j = transition(j, "interrupted", ended_at=now,
                           message=j.message or "the daemon stopped while it ran (restart found it running)")
        out.append(j)
    return out


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def check_env(items: Iterable[str]) -> tuple[str, ...]:
    """``items`` as ``NAME=VALUE`` strings; ``JobError`` naming a bad one."""
    out = []
    for item in items:
        name, eq, _ = item.partition("=")
        if not eq or not _ENV_NAME.match(name):
            raise JobError(f"environment entry {item!r} is not NAME=VALUE (NAME: letters, digits, _)")
        out.append(item)
    return tuple(out)


def job_env(base: Mapping[str, str], job: Job) -> dict[str, str]:
    """The environment ``job`` runs with: ``base`` (the daemon's) with the
    job's own entries on top."""
    env = dict(base)
    for item in job.env:
        name, _, value = item.partition("=")
        env[name] = value
    return env


def resume(job: Job, seq: int) -> Job:
    """``job`` queued again, behind everything queued (``seq``: the next
    submission number); ``JobError`` unless it is an interrupted or cancelled
    job of a ``RESUMABLE`` kind."""
    if job.kind not in RESUMABLE:
        raise JobError(f"job {job.id} is a {job.kind}, which does not resume where it stopped (only "
                       f"{', '.join(sorted(RESUMABLE))} jobs do); `prism submit` runs it anew")
    if job.state not in ("interrupted", "cancelled"):
        raise JobError(f"job {job.id} is {job.state}; only an interrupted or cancelled job can be resumed")
    return transition(job, "queued", seq=seq, started_at=0.0, ended_at=0.0, exit_code=None, pid=0, pid_start=0,
                      message=f"resumed after it was {job.state}", progress="")


# --- wire messages ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Submit:
    """Run ``python -m prism KIND ARGV`` in ``cwd`` once ``after`` are done."""

    kind: str
    argv: tuple[str, ...]
    cwd: str
    name: str = ""
    after: tuple[str, ...] = ()
    #: ``NAME=VALUE`` set for the job on top of the daemon's environment
    #: (``prism submit`` sends the submitter's ``PRISM_*`` and its ``--env``).
    env: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Jobs:
    """List every job (``job_id`` "") or one."""

    job_id: str = ""


@dataclass(frozen=True, slots=True)
class Cancel:
    job_id: str


@dataclass(frozen=True, slots=True)
class Resume:
    job_id: str


@dataclass(frozen=True, slots=True)
class Logs:
    """The last ``max_bytes`` of a job's log."""

    job_id: str
    max_bytes: int = 1 << 20


@dataclass(frozen=True, slots=True)
class Submitted:
    job: Job


@dataclass(frozen=True, slots=True)
class JobList:
    jobs: tuple[Job, ...]
    #: What the daemon owns and holds now, for ``prism jobs``.
    slots: int = 0
    slots_busy: int = 0
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LogText:
    job_id: str
    text: str
    path: str = ""
    truncated: bool = False


@dataclass(frozen=True, slots=True)
class Refused:
    """The daemon refused the request; ``message`` says why and what to do."""

    message: str


REQUESTS = (Submit, Jobs, Cancel, Resume, Logs)
REPLIES = (Submitted, JobList, LogText, Refused)
_BY_NAME = {c.__name__: c for c in (*REQUESTS, *REPLIES)}
_JOB_SCHEMA = codec.schema(Job)
#: Fields that hold jobs travel through the job schema, not the message's.
_JOB_FIELDS = {Submitted: "job", JobList: "jobs"}
_SCHEMAS = {c: codec.schema(c, skip=(_JOB_FIELDS[c],) if c in _JOB_FIELDS else ()) for c in _BY_NAME.values()}


def job_to_dict(job: Job) -> dict[str, Any]:
    """``job`` as JSON-able values (``job.json``, the wire)."""
    return {f.name: f.encode(getattr(job, f.name)) for f in _JOB_SCHEMA.fields}


def job_from_dict(d: Mapping[str, Any], where: str = "job record") -> Job:
    """The job ``d`` holds; ``JobError`` naming ``where`` and the field if it
    is not a valid record (unknown fields are ignored: newer daemons may add)."""
    if not isinstance(d, Mapping):
        raise JobError(f"{where}: expected a JSON object, got {type(d).__name__}")
    kw = _decode_fields(_JOB_SCHEMA, d, where)
    if kw.get("state", "queued") not in STATES:
        raise JobError(f"{where}: state {kw['state']!r} is not one of {', '.join(STATES)}")
    return Job(**kw)


def _decode_fields(schema: Any, d: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The fields of ``schema`` that ``d`` holds, decoded; ``JobError``
    naming ``where`` and the field for a missing or invalid one."""
    kw: dict[str, Any] = {}
    for f in schema.fields:
        if f.name not in d:
            if f.required:
                raise JobError(f"{where}: field {f.name!r} is missing")
            continue
        try:
            kw[f.name] = f.decode(d[f.name])
        except codec.Mismatch as e:
            raise JobError(f"{where}: field {f.name}{e.path} = {e.value!r} is not a valid {e.hint}") from None
    return kw


def encode_message(msg: Any) -> dict[str, Any]:
    """A request or reply as a JSON-able dict with its type under ``"t"``."""
    cls = type(msg)
    if cls not in _SCHEMAS:
        raise TypeError(f"{cls.__name__} is not a daemon message")
    out: dict[str, Any] = {"t": cls.__name__}
    for f in _SCHEMAS[cls].fields:
        value = getattr(msg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{cls.__name__}.{f.name} must be finite, got {value!r}")
        out[f.name] = f.encode(value)
    if cls in _JOB_FIELDS:
        name = _JOB_FIELDS[cls]
        value = getattr(msg, name)
        out[name] = [job_to_dict(j) for j in value] if isinstance(value, tuple) else job_to_dict(value)
    return out


def decode_message(d: Any) -> Any:
    """The message ``d`` holds; ``JobError`` if it is none."""
    if not isinstance(d, Mapping) or not isinstance(d.get("t"), str):
        raise JobError("not a daemon message: expected a JSON object with a type under 't'")
    cls = _BY_NAME.get(d["t"])
    if cls is None:
        raise JobError(f"unknown daemon message type {d['t']!r}")
    kw = _decode_fields(_SCHEMAS[cls], d, cls.__name__)
    if cls in _JOB_FIELDS:
        name = _JOB_FIELDS[cls]
        value = d.get(name)
        if cls is JobList:
            if not isinstance(value, list):
                raise JobError("JobList: field 'jobs' must be a list")
            kw[name] = tuple(job_from_dict(j, f"JobList.jobs[{i}]") for i, j in enumerate(value))
        else:
            kw[name] = job_from_dict(value, f"{cls.__name__}.{name}")
    return cls(**kw)
