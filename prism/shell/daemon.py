"""The job daemon (``prism coordinator --daemon``): a trio service over the
sans-IO job logic of ``prism.core.jobs``, and the blocking client that talks
to it.

The daemon owns a *state directory*::

    STATE/daemon.json        where it listens, its pid (written when it listens)
    STATE/daemon.lock        held (flock) while a daemon uses STATE
    STATE/daemon.sock        its default endpoint, ipc://STATE/daemon.sock
    STATE/jobs/ID/job.json   the job's record, rewritten atomically at every change
    STATE/jobs/ID/log        the job's stdout and stderr

One trio loop owns every record. Requests (orjson dicts of the messages in
``prism.core.jobs``) arrive on a ROUTER socket and are answered at once; each
running job is a child ``python -m prism KIND ARGV`` in its own session and
process group, watched by one task. The daemon signals a job's *leader* with
SIGTERM (the command's coordinator stops its ranks and keeps the trace valid,
``prism.shell.coordinator.default_stop_signals``) and, after a grace period,
the whole group with SIGKILL (its fork server; the ranks die with it).

A restart loses nothing finished: the records are on disk before the state
they describe is reported. A job the previous daemon was running is marked
``interrupted`` and its process group killed if that very process (same pid,
same start time) is still alive; queued jobs stay queued and run.

With ``keys`` (``make_keys``), the socket is a CURVE server and a ZAP handler
(``zmq.auth.thread.ThreadAuthenticator``) lets in only the client public keys
in ``KEYS/authorized/``; only then may it listen beyond loopback
(``transport.endpoints.check_listen_endpoint``). The client watches its
socket's handshake events, so a client without keys, or with keys the daemon
does not know, gets a clear error instead of a hang.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson
import trio
import zmq

from prism.core import jobs as J
from transport import curve as C
from transport.endpoints import MAX_IPC_PATH_BYTES

log = logging.getLogger("prism.shell.daemon")

_ROOT = str(Path(__file__).resolve().parents[2])
DAEMON_FILE = "daemon.json"
LOCK_FILE = "daemon.lock"
SOCKET_FILE = "daemon.sock"
JOBS_DIR = "jobs"
JOB_FILE = "job.json"
LOG_FILE = "log"
#: Key files of ``make_keys`` (``transport.curve``).
SERVER_PUBLIC, SERVER_SECRET = C.SERVER_PUBLIC, C.SERVER_SECRET
CLIENT_PUBLIC, CLIENT_SECRET = C.CLIENT_PUBLIC, C.CLIENT_SECRET
AUTHORIZED_DIR = C.AUTHORIZED_DIR
KeyFiles = C.KeyFiles
#: A job's leader gets this long after SIGTERM before its group is killed.
DEFAULT_GRACE_S = 20.0
MAX_REQUEST_BYTES = 1 << 20


class DaemonError(Exception):
    """The daemon cannot start or a client cannot reach it; the text says why
    and what to do (the library turns it into a ``PrismError``)."""


# --- the state directory ------------------------------------------------------------


def job_dir(state: Path, job_id: str) -> Path:
    return state / JOBS_DIR / job_id


def log_path(state: Path, job_id: str) -> Path:
    return job_dir(state, job_id) / LOG_FILE


def _write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename, so a
    reader (or a crash) sees the old contents or the new, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def write_job(state: Path, job: J.Job) -> None:
    d = job_dir(state, job.id)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    _write_atomic(d / JOB_FILE, orjson.dumps(J.job_to_dict(job), option=orjson.OPT_INDENT_2) + b"\n")


def read_jobs(state: Path) -> tuple[list[J.Job], list[str]]:
    """Every job record under ``state`` and a problem line for each record
    that cannot be read (it is left alone, not deleted)."""
    jobs, problems = [], []
    root = state / JOBS_DIR
    if not root.is_dir():
        return jobs, problems
    for d in sorted(root.iterdir()):
        path = d / JOB_FILE
        if not path.is_file():
            continue
        try:
            job = J.job_from_dict(orjson.loads(path.read_bytes()), str(path))
        except (OSError, orjson.JSONDecodeError, J.JobError) as e:
            problems.append(f"{path}: {e}; the record is skipped")
            continue
        if job.id != d.name:
            problems.append(f"{path}: its id {job.id!r} is not its folder's name; the record is skipped")
            continue
        jobs.append(job)
    return jobs, problems


def tail(path: Path, max_bytes: int) -> tuple[str, bool]:
    """The last ``max_bytes`` of ``path`` as text and whether it was cut."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except FileNotFoundError:
        return "", False
    return data.decode("utf-8", "replace"), size > max_bytes


def last_line(path: Path) -> str:
    """The last non-empty line of a log (a progress line rewritten with \\r
    counts as its last rewrite)."""
    text, _ = tail(path, 4096)
    for line in reversed(text.replace("\r", "\n").splitlines()):
        if line.strip():
            return line.strip()[:300]
    return ""


def default_state_dir() -> Path:
    """``$PRISM_STATE``, else ``~/.cache/prism/daemon``."""
    env = os.environ.get("PRISM_STATE")
    return Path(env) if env else Path.home() / ".cache" / "prism" / "daemon"


def default_daemon_endpoint(state: Path) -> str:
    """``ipc://STATE/daemon.sock``; ``DaemonError`` when that path is too long
    for a Unix socket."""
    path = os.path.join(os.path.abspath(state), SOCKET_FILE)
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise DaemonError(f"the state directory gives an ipc path of {len(os.fsencode(path))} bytes ({path}), "
                          f"over the {MAX_IPC_PATH_BYTES}-byte limit of Unix sockets: choose a shorter --state "
                          "or pass --listen tcp://127.0.0.1:PORT")
    return f"ipc://{path}"


# --- processes ----------------------------------------------------------------------


def process_start(pid: int) -> int:
    """``pid``'s start time in clock ticks since boot (``/proc/PID/stat``
    field 22), 0 if it is gone or a zombie: with the pid it names one process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[-1].split()
    except OSError:
        return 0
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return 0
    return int(fields[19])


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Signal process group ``pgid``; False when it has no member left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def kill_leftover(job: J.Job) -> bool:
    """Kill the process group of ``job`` if its leader is still the process
    the record names (a daemon that died left it running)."""
    if job.pid and job.pid_start and process_start(job.pid) == job.pid_start:
        return kill_group(job.pid)
    return False


def _job_env() -> dict[str, str]:
    env = dict(os.environ)
    # The job runs in the submitter's directory, where ``prism`` may not be importable.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
    return env


# --- CURVE keys -------------------------------------------------------------------


def make_keys(directory: str | os.PathLike[str]) -> KeyFiles:
    """Write a CURVE keypair for the daemon and one for a client into
    ``directory`` (``transport.curve.make_keys``: the daemon needs
    ``server.key_secret`` and ``authorized/``; a client ``server.key`` and
    ``client.key_secret``). Refuses to overwrite keys."""
    try:
        return C.make_keys(directory)
    except C.CurveKeyError as e:
        raise DaemonError(str(e)) from None


# --- the service --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    state: Path
    endpoint: str
    capacity: J.Capacity
    keys: Path | None = None
    grace_s: float = DEFAULT_GRACE_S


class Daemon:
    """The service: ``await Daemon(config).run()`` serves until SIGTERM or
    SIGINT, then stops every running job (SIGTERM, then SIGKILL after
    ``grace_s``), marks them interrupted and returns."""

    def __init__(self, config: ServiceConfig, *, on_listening: Callable[[str], None] | None = None,
                 on_note: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.state = config.state
        self.capacity = config.capacity
        self.on_listening = on_listening
        self.on_note = on_note or (lambda text: log.warning("%s", text))
        self.jobs: dict[str, J.Job] = {}
        self.bound_endpoint = ""
        self._seq = 0
        self._procs: dict[str, trio.Process] = {}
        self._cancelling: set[str] = set()
        self._stopping = False
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._lock_fd: int | None = None

    # --- lifetime ------------------------------------------------------------

    def _lock(self) -> None:
        self.state.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.state / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            other = _read_daemon_file(self.state).get("pid", "?")
            raise DaemonError(f"another daemon (pid {other}) uses the state directory {self.state}: stop it "
                              "(kill -TERM PID) or choose another --state") from None
        self._lock_fd = fd

    def _recover(self) -> None:
        jobs, problems = read_jobs(self.state)
        for p in problems:
            self.on_note(p)
        now = time.time()
        for old in jobs:
            if old.state == "running" and kill_leftover(old):
                self.on_note(f"job {old.id}: killed its process group {old.pid}, left by a daemon that died")
        before = {j.id: j for j in jobs}
        for j in J.recover(jobs, now):
            if j != before[j.id]:
                write_job(self.state, j)
            self.jobs[j.id] = j
            self._seq = max(self._seq, j.seq)
        self._wake.set()  # queued jobs of the previous daemon start now

    async def run(self) -> None:
        self._lock()
        try:
            self._recover()
            await self._serve()
        finally:
            if self._lock_fd is not None:
                (self.state / DAEMON_FILE).unlink(missing_ok=True)
                os.close(self._lock_fd)

    async def _serve(self) -> None:
        from transport.trio_socket import AsyncSocket

        ctx = zmq.Context.instance()
        auth = None
        sock = AsyncSocket.create(zmq.ROUTER, context=ctx, max_message_bytes=MAX_REQUEST_BYTES)
        try:
            if self.config.keys is not None:
                try:
                    auth = C.serve_curve(sock.socket, self.config.keys, ctx, "prism.shell.daemon.zap")
                except C.CurveKeyError as e:
                    raise DaemonError(str(e).replace("the server", "the daemon")) from None
            try:
                self.bound_endpoint = sock.bind(self.config.endpoint, authenticated=auth is not None)
            except zmq.ZMQError as e:
                raise DaemonError(f"cannot listen on {self.config.endpoint}: {e}") from None
            _write_atomic(self.state / DAEMON_FILE, orjson.dumps({
                "endpoint": self.bound_endpoint, "pid": os.getpid(), "started_at": time.time(),
                "curve": auth is not None}))
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._answer, sock)
                nursery.start_soon(self._schedule)
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    if self.on_listening is not None:
                        self.on_listening(self.bound_endpoint)
                    async for signum in signals:
                        self.on_note(f"{signal.Signals(signum).name}: stopping; running jobs are stopped "
                                     "and marked interrupted")
                        break
                # Stop accepting, stop the jobs, wait for their tasks to record them.
                self._stopping = True
                sock.close()
                await self._stop_all()
                nursery.cancel_scope.cancel()
        finally:
            sock.close()
            if auth is not None:
                auth.stop()
            if self.bound_endpoint.startswith("ipc://"):
                Path(self.bound_endpoint.removeprefix("ipc://")).unlink(missing_ok=True)

    # --- requests ------------------------------------------------------------

    async def _answer(self, sock: Any) -> None:
        while True:
            try:
                frames = await sock.recv_multipart(copy=True)
            except trio.ClosedResourceError:
                return
            if len(frames) < 2:
                continue
            envelope, body = frames[:-1], frames[-1]
            try:
                reply = self.handle(J.decode_message(orjson.loads(body)))
            except (orjson.JSONDecodeError, J.JobError) as e:
                reply = J.Refused(str(e))
            try:
                sock.send_multipart_nowait([*envelope, orjson.dumps(J.encode_message(reply))])
            except (trio.WouldBlock, trio.ClosedResourceError, zmq.ZMQError) as e:
                log.debug("could not answer: %s", e)

    def handle(self, msg: Any) -> Any:
        """The reply to one request (sans waiting: every answer is at hand)."""
        if isinstance(msg, J.Submit):
            return J.Submitted(self.submit(msg))
        if isinstance(msg, J.Jobs):
            if msg.job_id:
                return self._list([self._job(msg.job_id)])
            return self._list(sorted(self.jobs.values(), key=lambda j: j.seq))
        if isinstance(msg, J.Cancel):
            return self._list([self.cancel(msg.job_id)])
        if isinstance(msg, J.Resume):
            return self._list([self.resume(msg.job_id)])
        if isinstance(msg, J.Logs):
            job = self._job(msg.job_id)
            path = log_path(self.state, job.id)
            text, cut = tail(path, max(1, min(msg.max_bytes, MAX_REQUEST_BYTES - 4096)))
            return J.LogText(job.id, text, str(path), cut)
        return J.Refused(f"a client may not send {type(msg).__name__}")

    def _job(self, job_id: str) -> J.Job:
        job = self.jobs.get(job_id)
        if job is None:
            known = ", ".join(sorted(self.jobs, key=lambda i: self.jobs[i].seq)[-10:]) or "none"
            raise J.JobError(f"no job {job_id!r} (recent jobs: {known}); `prism jobs` lists them")
        return job

    def _list(self, jobs: Sequence[J.Job]) -> J.JobList:
        out = []
        for j in jobs:
            if j.state == "running":
                j = replace(j, progress=last_line(log_path(self.state, j.id)))
            out.append(j)
        busy = sum(j.slots for j in self.jobs.values() if j.state == "running")
        return J.JobList(tuple(out), self.capacity.slots, busy, self.capacity.gpus)

    def _save(self, job: J.Job) -> J.Job:
        write_job(self.state, job)
        self.jobs[job.id] = job
        return job

    def submit(self, req: J.Submit) -> J.Job:
        if self._stopping:
            raise J.JobError("the daemon is stopping; submit again once it has restarted")
        need = J.need_of(req.kind, req.argv, self.capacity)
        for dep in req.after:
            self._job(dep)
        if not os.path.isabs(req.cwd):
            raise J.JobError(f"cwd {req.cwd!r} must be an absolute path")
        self._seq += 1
        job = J.Job(id=str(self._seq), seq=self._seq, kind=req.kind, argv=req.argv, cwd=req.cwd,
                    name=req.name, slots=need.slots, gpus=need.gpus, after=req.after, submitted_at=time.time(),
                    env=J.check_env(req.env),
                    run_dir=J.run_dir_of(req.kind, req.argv, req.cwd))
        self._save(job)
        self._wake.set()
        return job

    def cancel(self, job_id: str) -> J.Job:
        job = self._job(job_id)
        if job.state == "queued":
            job = self._save(J.transition(job, "cancelled", ended_at=time.time(), message="cancelled before it started"))
            self._wake.set()
            return job
        if job.state != "running":
            raise J.JobError(f"job {job.id} is {job.state} already; only queued or running jobs can be cancelled")
        if job.id not in self._cancelling:
            self._cancelling.add(job.id)
            assert self._nursery is not None
            self._nursery.start_soon(self._terminate, job.id)
        return job

    def resume(self, job_id: str) -> J.Job:
        if self._stopping:
            raise J.JobError("the daemon is stopping; resume the job once it has restarted")
        job = self._job(job_id)
        self._seq += 1
        job = self._save(J.resume(job, self._seq))
        self._wake.set()
        return job

    # --- running jobs ----------------------------------------------------------

    async def _schedule(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            if self._stopping:
                return
            now = time.time()
            for job, why in J.blocked_by_failure(self.jobs.values()):
                self._save(J.transition(job, "cancelled", ended_at=now, message=f"not run: {why}"))
            assert self._nursery is not None
            for job in J.startable(self.jobs.values(), self.capacity):
                await self._start(job)

    async def _start(self, job: J.Job) -> None:
        d = job_dir(self.state, job.id)
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        logf = open(log_path(self.state, job.id), "ab")
        try:
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "prism", *job.command], cwd=job.cwd, stdin=subprocess.DEVNULL,
                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                env=J.job_env(_job_env(), job))
        except OSError as e:
            logf.write(f"prism daemon: cannot start the job: {e}\n".encode())
            logf.close()
            now = time.time()
            self._save(J.transition(J.transition(job, "running", started_at=now), "failed", ended_at=now,
                                    message=f"cannot start: {e}"))
            self._wake.set()
            return
        logf.close()  # the child holds its own copy
        self._procs[job.id] = proc
        self._save(J.transition(job, "running", started_at=time.time(), pid=proc.pid,
                                pid_start=process_start(proc.pid)))
        assert self._nursery is not None
        self._nursery.start_soon(self._watch, job.id, proc)

    async def _watch(self, job_id: str, proc: trio.Process) -> None:
        try:
            code = await proc.wait()
        except trio.Cancelled:
            # The daemon is failing (a normal stop waits for every job first).
            kill_group(proc.pid)
            raise
        # What the leader started in its group (a fork server) goes with it.
        kill_group(proc.pid)
        self._procs.pop(job_id, None)
        job = self.jobs[job_id]
        progress = last_line(log_path(self.state, job_id))
        now = time.time()
        if job_id in self._cancelling:
            self._cancelling.discard(job_id)
            job = J.transition(job, "cancelled", ended_at=now, exit_code=code, progress=progress,
                               message="cancelled while it ran (prism cancel)")
        elif self._stopping:
            job = J.transition(job, "interrupted", ended_at=now, exit_code=code, progress=progress,
                               message="the daemon stopped while it ran (SIGTERM); submit it again to rerun")
        elif code == 0:
            job = J.transition(job, "done", ended_at=now, exit_code=code, progress=progress)
        else:
            job = J.transition(job, "failed", ended_at=now, exit_code=code, progress=progress,
                               message=f"exited with status {code}; `prism jobs {job_id} --logs` shows why")
        self._save(job)
        self._wake.set()

    async def _terminate(self, job_id: str) -> None:
        """SIGTERM to the job's leader; SIGKILL to its group after the grace period."""
        proc = self._procs.get(job_id)
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(self.config.grace_s):
            while job_id in self._procs:  # until its watcher has seen it exit
                await trio.sleep(0.05)
        if job_id in self._procs:
            self.on_note(f"job {job_id} did not stop within {self.config.grace_s:g} s of SIGTERM: killed")
            kill_group(proc.pid)

    async def _stop_all(self) -> None:
        running = list(self._procs)
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as n:
                for job_id in running:
                    n.start_soon(self._terminate, job_id)
            # Each job's watcher records it; wait for the records.
            while any(self.jobs[j].state == "running" for j in running):
                await trio.sleep(0.02)


def _read_daemon_file(state: Path) -> dict[str, Any]:
    try:
        data = orjson.loads((state / DAEMON_FILE).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


# --- the client ---------------------------------------------------------------------


def resolve_endpoint(daemon: str | None) -> str:
    """The endpoint to reach: ``daemon`` (an endpoint, or a state directory
    whose ``daemon.json`` says), else ``$PRISM_DAEMON``, else the default
    state directory's."""
    where = daemon or os.environ.get("PRISM_DAEMON") or ""
    if "://" in where:
        return where
    state = Path(where) if where else default_state_dir()
    info = _read_daemon_file(state)
    if not info.get("endpoint"):
        how = f"--daemon {where}" if daemon else ("PRISM_DAEMON" if where else f"the default state {state}")
        raise DaemonError(f"no daemon runs for {how} ({state / DAEMON_FILE} is missing): start one with "
                          f"`python -m prism coordinator --daemon --state {state}` or pass --daemon ENDPOINT")
    return str(info["endpoint"])


def request(endpoint: str, msg: Any, *, keys: Path | None = None, timeout_s: float = 10.0) -> Any:
    """Send one request to the daemon at ``endpoint`` and return its reply;
    ``DaemonError`` with a clear text when nobody answers within
    ``timeout_s``, or the daemon refuses the handshake (CURVE keys missing
    or unknown)."""
    from zmq.utils.monitor import recv_monitor_message

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    mon = None
    try:
        if keys is not None:
            try:
                C.connect_curve(sock, keys)
            except C.CurveKeyError as e:
                raise DaemonError(str(e)) from None
        mon = sock.get_monitor_socket(C.HANDSHAKE_FAILED_EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            raise DaemonError(f"cannot connect to the daemon at {endpoint}: {e}") from None
        sock.send(orjson.dumps(J.encode_message(msg)))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        cut = 0  # handshakes failed without detail, in a row
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(timeout=math.ceil(left * 1000)))
            if sock in ready:
                try:
                    return J.decode_message(orjson.loads(sock.recv()))
                except (orjson.JSONDecodeError, J.JobError) as e:
                    raise DaemonError(f"the daemon at {endpoint} sent a reply this client cannot read ({e}): "
                                      "are both the same Prism version?") from None
            if mon in ready:
                event = recv_monitor_message(mon)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    cut = 0
                    continue
                if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                    # A daemon restarting (or anything closing the connection
                    # mid-handshake) gives this once or twice; a wrong server
                    # key every time. ZeroMQ reconnects and the request, not
                    # delivered yet, waits on the socket.
                    cut += 1
                    if cut < C.HANDSHAKE_TRIES:
                        continue
                raise DaemonError(_handshake_text(endpoint, event, keys))
        raise DaemonError(f"no daemon answered at {endpoint} within {timeout_s:g} s: start one with "
                          "`python -m prism coordinator --daemon` (or check --daemon / PRISM_DAEMON)"
                          + ("" if keys is not None or not endpoint.startswith("tcp://") else
                             "; a daemon that uses CURVE needs --keys DIR"))
    finally:
        if mon is not None:
            sock.disable_monitor()
            mon.close(linger=0)
        sock.close(linger=0)


def _handshake_text(endpoint: str, event: int, keys: Path | None) -> str:
    return C.handshake_text("the daemon", endpoint, event, keys).replace("the server's", "the daemon's")
