"""The job daemon's library API: serve a daemon, and submit, list, cancel
and read jobs of one (``prism coordinator --daemon``, ``prism submit``,
``prism jobs``, ``prism cancel``, ``prism keys``).

The service and the wire live in ``prism.shell.daemon`` over the sans-IO
``prism.core.jobs``; here each function takes plain arguments or a config
and returns a result (``Job``, ``JobList``, ``LogText``, ``KeyFiles``), and a
problem the caller can fix raises ``DaemonError`` (a ``PrismError``, exit
status 1; ``UsageError`` for bad options): no daemon answers, the daemon
wants CURVE keys or refused them, it refused the request.

Where the client finds the daemon (``daemon=``): an endpoint
(``ipc://...``, ``tcp://HOST:PORT``) or a state directory whose
``daemon.json`` names it; else ``$PRISM_DAEMON``; else the default state
directory (``$PRISM_STATE`` or ``~/.cache/prism/daemon``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prism.app.errors import PrismError, UsageError
from prism.core import jobs as J
from prism.core.jobs import Job, JobList, LogText
from prism.shell import daemon as D
from prism.shell.daemon import KeyFiles

__all__ = [
    "DaemonConfig", "DaemonError", "Job", "JobList", "KeyFiles", "LogText", "cancel", "jobs", "logs",
    "make_keys", "prism_env", "resume", "serve", "submit", "wait",
]


class DaemonError(PrismError):
    """No daemon answers, it refused the handshake or the request (exit status 1)."""

    exit_code = 1


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """``prism coordinator --daemon``: ``state`` holds the job records and
    logs (None: ``$PRISM_STATE`` or ``~/.cache/prism/daemon``); ``listen`` the
    endpoint (None: ``ipc://STATE/daemon.sock``; beyond loopback only with
    ``keys``); ``slots`` the slots it owns (None: the number of cores);
    ``gpus`` the GPUs it owns ("0,1"; None: none); ``keys`` a directory made
    by ``make_keys`` (CURVE on); ``grace_s`` how long a job has after SIGTERM."""

    state: str | os.PathLike[str] | None = None
    listen: str | None = None
    slots: int | None = None
    gpus: str | None = None
    keys: str | os.PathLike[str] | None = None
    grace_s: float = D.DEFAULT_GRACE_S


def _gpus(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return J.gpu_list(text, "coordinator --daemon")
    except J.JobError as e:
        raise UsageError(str(e)) from None


def service_config(config: DaemonConfig) -> D.ServiceConfig:
    """The shell's configuration for ``config``, checked (``UsageError``)."""
    from transport.endpoints import UnsafeEndpointError, check_listen_endpoint

    state = Path(config.state) if config.state is not None else D.default_state_dir()
    slots = config.slots if config.slots is not None else (os.cpu_count() or 1)
    if slots < 1:
        raise UsageError(f"--slots {slots}: the daemon needs at least 1 slot")
    if config.grace_s < 0:
        raise UsageError(f"grace period {config.grace_s}: must be 0 or more seconds")
    keys = Path(config.keys) if config.keys is not None else None
    if keys is not None and not (keys / D.SERVER_SECRET).is_file():
        raise UsageError(f"--keys {keys}: no {D.SERVER_SECRET} there; make keys with `prism keys {keys}`")
    try:
        endpoint = config.listen or D.default_daemon_endpoint(state)
    except D.DaemonError as e:
        raise UsageError(str(e)) from None
    try:
        check_listen_endpoint(endpoint, authenticated=keys is not None)
    except UnsafeEndpointError as e:
        raise UsageError(str(e)) from None
    return D.ServiceConfig(state, endpoint, J.Capacity(slots, _gpus(config.gpus)), keys, config.grace_s)


def serve(config: DaemonConfig, *, on_listening: Callable[[str], None] | None = None,
          on_note: Callable[[str], None] | None = None) -> None:
    """Run the daemon until SIGTERM or SIGINT (then its running jobs are
    stopped and marked interrupted); ``on_listening(endpoint)`` once it
    listens, ``on_note(text)`` for what it has to say (a record it skipped,
    a leftover it killed)."""
    import trio

    from prism.shell.launcher import warm_forkserver

    service = service_config(config)
    try:
        with warm_forkserver():  # the jobs' launches fork their fork servers from it
            trio.run(D.Daemon(service, on_listening=on_listening, on_note=on_note).run)
    except D.DaemonError as e:
        raise DaemonError(str(e)) from None


def _request(msg: object, daemon: str | None, keys: str | os.PathLike[str] | None, timeout_s: float) -> object:
    try:
        endpoint = D.resolve_endpoint(daemon)
        reply = D.request(endpoint, msg, keys=Path(keys) if keys is not None else None, timeout_s=timeout_s)
    except D.DaemonError as e:
        raise DaemonError(str(e)) from None
    if isinstance(reply, J.Refused):
        raise DaemonError(reply.message)
    return reply


def submit(command: Sequence[str], *, daemon: str | None = None, keys: str | os.PathLike[str] | None = None,
           name: str = "", after: Sequence[str] = (), cwd: str | os.PathLike[str] | None = None,
           env: Sequence[str] = (), timeout_s: float = 10.0) -> Job:
    """Queue ``python -m prism COMMAND...`` (``command[0]`` one of
    ``prism.core.jobs.JOB_KINDS``) to run in ``cwd`` (default: here) once the
    jobs ``after`` are done, with ``env`` (``NAME=VALUE``) on top of the
    daemon's environment; returns its record (state ``queued``)."""
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("give the command to run after --, e.g. `prism submit -- capture -n 4 -- train.py`")
    if command[0] not in J.JOB_KINDS:
        raise UsageError(f"{command[0]!r} is not a job: submit one of {', '.join(J.JOB_KINDS)}")
    where = os.path.abspath(cwd if cwd is not None else os.getcwd())
    try:
        env = J.check_env(env)
    except J.JobError as e:
        raise UsageError(str(e)) from None
    reply = _request(J.Submit(command[0], tuple(command[1:]), where, name, tuple(after), env), daemon, keys,
                     timeout_s)
    assert isinstance(reply, J.Submitted)
    return reply.job


#: The submitter's variables ``prism submit`` does not forward (they say
#: where the daemon is, not how the job runs).
_NOT_FORWARDED = ("PRISM_DAEMON", "PRISM_STATE")


def prism_env(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The submitter's ``PRISM_*`` variables as ``NAME=VALUE`` (Prism's own
    knobs, e.g. ``PRISM_DEVICE_REACH``): a job runs as it would from here."""
    environ = os.environ if environ is None else environ
    return tuple(f"{k}={v}" for k, v in sorted(environ.items())
                 if k.startswith("PRISM_") and k not in _NOT_FORWARDED)


def jobs(job_id: str = "", *, daemon: str | None = None, keys: str | os.PathLike[str] | None = None,
         timeout_s: float = 10.0) -> JobList:
    """Every job the daemon knows, in submission order (or the one ``job_id``),
    with the slots it owns and holds."""
    reply = _request(J.Jobs(job_id), daemon, keys, timeout_s)
    assert isinstance(reply, J.JobList)
    return reply


def cancel(job_id: str, *, daemon: str | None = None, keys: str | os.PathLike[str] | None = None,
           timeout_s: float = 10.0) -> Job:
    """Cancel ``job_id``: a queued job is dropped; a running one gets SIGTERM
    (its trace is kept valid), SIGKILL after the daemon's grace period. The
    record returned is the job as the daemon holds it now (a running job
    becomes ``cancelled`` once it has stopped)."""
    reply = _request(J.Cancel(job_id), daemon, keys, timeout_s)
    assert isinstance(reply, J.JobList)
    return reply.jobs[0]


def wait(job_id: str = "", *, daemon: str | None = None, keys: str | os.PathLike[str] | None = None,
         timeout_s: float = 10.0, poll_s: float = 0.5, limit_s: float | None = None,
         on_poll: Callable[[JobList], None] | None = None) -> JobList:
    """Poll until ``job_id`` (default: every job the daemon knows) has ended
    (done, failed, cancelled, interrupted) and return the listing then.
    ``limit_s``: give up after that many seconds with a ``DaemonError``
    naming the jobs still active; ``on_poll(listing)`` sees each poll."""
    start = time.monotonic()
    while True:
        listing = jobs(job_id, daemon=daemon, keys=keys, timeout_s=timeout_s)
        if on_poll is not None:
            on_poll(listing)
        active = [j for j in listing.jobs if j.state not in J.TERMINAL]
        if not active:
            return listing
        if limit_s is not None and time.monotonic() - start > limit_s:
            raise DaemonError(f"still active after {limit_s:g} s: " + ", ".join(f"job {j.id} ({j.state})"
                                                                             for j in active))
        time.sleep(poll_s)


def resume(job_id: str, *, daemon: str | None = None, keys: str | os.PathLike[str] | None = None,
           timeout_s: float = 10.0) -> Job:
    """Queue an interrupted or cancelled campaign again (it skips the points
    it finished), behind the jobs already queued."""
    reply = _request(J.Resume(job_id), daemon, keys, timeout_s)
    assert isinstance(reply, J.JobList)
    return reply.jobs[0]


def logs(job_id: str, *, max_bytes: int = 1 << 20, daemon: str | None = None,
         keys: str | os.PathLike[str] | None = None, timeout_s: float = 10.0) -> LogText:
    """The last ``max_bytes`` of ``job_id``'s log (its stdout and stderr)."""
    reply = _request(J.Logs(job_id, max_bytes), daemon, keys, timeout_s)
    assert isinstance(reply, J.LogText)
    return reply


def make_keys(directory: str | os.PathLike[str]) -> KeyFiles:
    """Write the daemon's and a client's CURVE keypairs into ``directory``
    (``prism.shell.daemon.make_keys`` says which file goes where)."""
    try:
        return D.make_keys(directory)
    except D.DaemonError as e:
        raise UsageError(str(e)) from None
