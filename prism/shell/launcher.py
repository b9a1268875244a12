"""Launching the logical ranks of a run (the coordinator's side).

``launch_ranks`` starts the fork server (``python -m prism.rank.forkserver``)
as a subprocess, hands it the run's spec and returns a ``RankProcesses``
handle. The coordinator process never forks itself (see the fork server's
docstring); ranks die with the fork server, which dies (killing them) when
this process goes away.

``prestart_forkserver`` starts that process ahead of the launch (``python -m
prism capture``, ``emulate``, ``run`` and ``calibrate`` do it first thing), so
its import of torch (about 3 s of CPU: torch and ``torch._dynamo``) overlaps
with the launching process's own start and set-up instead of following them;
``launch_ranks`` takes it when this process's environment and working
directory are still those it was started with, else starts one as before.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import orjson

from prism.rank.envnames import ZYGOTE_ENV
from prism.shell import runfolder

#: As torchrun's ``--nproc-per-node`` default in Prism's bundled workloads.
DEFAULT_NPROC_PER_NODE = 8
_ROOT = str(pathlib.Path(__file__).resolve().parents[2])


#: A fork server started ahead of its launch: (process, its environment, its working directory).
_early: tuple[subprocess.Popen, dict[str, str], str] | None = None
_early_lock = threading.Lock()


def _server_env() -> dict[str, str]:
    env = dict(os.environ)
    entries = [_ROOT, *env.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in entries if p))  # once each, in order
    return env


def _start_server(env: dict[str, str], cwd: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "prism.rank.forkserver"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, cwd=cwd)


def _stop_server(server: subprocess.Popen) -> None:
    """An unused fork server (it has forked nothing): gone at once."""
    server.kill()
    server.wait()
    for f in (server.stdin, server.stdout):
        if f is not None:
            f.close()


def prestart_forkserver() -> None:
    """Start the next launch's fork server now (see the module's docstring);
    one that no launch takes is killed when this process exits."""
    global _early
    if os.environ.get(ZYGOTE_ENV):
        return  # the launch forks its fork server from the zygote
    with _early_lock:
        if _early is not None:
            return
        env, cwd = _server_env(), os.getcwd()
        _early = (_start_server(env, cwd), env, cwd)


def discard_prestarted() -> None:
    """Kill the fork server ``prestart_forkserver`` started, if no launch took it."""
    global _early
    with _early_lock:
        early, _early = _early, None
    if early is not None:
        _stop_server(early[0])


atexit.register(discard_prestarted)  # a prestarted fork server that no launch took goes with this process


class _ZygoteServer:
    """A launch's fork server forked from a zygote (``PRISM_FORKSERVER_ZYGOTE``):
    what ``RankProcesses`` uses of a ``subprocess.Popen``. It is the zygote's
    child, not this process's: its end is seen in /proc, not by waitpid."""

    def __init__(self, pid: int, stdin: Any, stdout: Any) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not _alive(self.pid):
            self.returncode = 0  # its status went to the zygote
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout or 0)
            time.sleep(0.005)
        return 0

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_zygote(path: str) -> subprocess.Popen:
    """Start a zygote serving launches on the Unix socket ``path`` (see
    ``prism.rank.forkserver.zygote``); it serves launches from processes that
    set ``PRISM_FORKSERVER_ZYGOTE=path`` once its socket exists (before that,
    a launch starts a fresh fork server) and exits when its stdin closes."""
    return subprocess.Popen([sys.executable, "-m", "prism.rank.forkserver", "--zygote", path],
                            stdin=subprocess.PIPE, env=_server_env(), cwd=os.path.dirname(path) or ".")


#: "0": ``warm_forkserver`` starts no zygote (each launch starts a fresh fork
#: server, as a lone ``prism capture`` does).
WARM_ENV = "PRISM_WARM_FORKSERVER"


@contextlib.contextmanager
def warm_forkserver() -> Iterator[str | None]:
    """For the block, this process's launches and those of the processes it
    starts (through the environment) fork their fork servers from one zygote
    (``start_zygote``): a daemon's jobs, a campaign's points and an agent's
    runs pay torch's import once. Yields the socket's path, or None where a
    zygote is set already or ``PRISM_WARM_FORKSERVER=0``. The zygote warms up
    beside the block; launches before it is ready start fresh fork servers."""
    if os.environ.get(ZYGOTE_ENV) or os.environ.get(WARM_ENV) == "0":
        yield None
        return
    try:
        folder = tempfile.mkdtemp(prefix="prism-zygote-")  # short: a Unix socket's path has 107 bytes
    except OSError:  # no writable temporary folder: every launch starts its own fork server, as without
        yield None
        return
    path = os.path.join(folder, "sock")
    try:
        zygote = start_zygote(path)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        yield None
        return
    os.environ[ZYGOTE_ENV] = path
    try:
        yield path
    finally:
        if os.environ.get(ZYGOTE_ENV) == path:
            del os.environ[ZYGOTE_ENV]
        assert zygote.stdin is not None
        zygote.stdin.close()  # it exits; the fork servers it forked serve on
        try:
            zygote.wait(timeout=30)
        except subprocess.TimeoutExpired:
            zygote.kill()
            zygote.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _from_zygote(env: dict[str, str], cwd: str) -> _ZygoteServer | None:
    """A fork server forked by the zygote at ``PRISM_FORKSERVER_ZYGOTE``, or
    None (none set, gone, or it refused this environment: start a fresh one)."""
    path = os.environ.get(ZYGOTE_ENV)
    if not path:
        return None
    spec_r, spec_w = os.pipe()
    ev_r, ev_w = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            request = orjson.dumps({"env": env, "cwd": cwd, "executable": sys.executable}) + b"\n"
            socket.send_fds(s, [request], [spec_r, ev_w, 2])
            reply = b""
            while not reply.endswith(b"\n"):
                more = s.recv(4096)
                if not more:
                    break
                reply += more
        answer = orjson.loads(reply) if reply else {}
    except (OSError, ValueError):
        answer = {}
    finally:
        os.close(spec_r)
        os.close(ev_w)
    if "pid" not in answer:
        os.close(spec_w)
        os.close(ev_r)
        return None
    return _ZygoteServer(int(answer["pid"]), os.fdopen(spec_w, "wb"), os.fdopen(ev_r, "rb"))


def _server_for(cwd: str) -> subprocess.Popen | _ZygoteServer:
    """The prestarted fork server if it suits a launch from ``cwd`` now, else
    one forked from a zygote if one is set, else a new one."""
    global _early
    env = _server_env()
    forked = _from_zygote(env, cwd)
    if forked is not None:
        return forked
    with _early_lock:
        early, _early = _early, None
    if early is not None:
        server, env0, cwd0 = early
        if env0 == env and cwd0 == cwd and server.poll() is None:
            return server
        _stop_server(server)
    return _start_server(env, cwd)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankProcesses:
    """Handle on the rank processes of one launch.

    ``pids[r]`` is rank r's pid; ``returncodes[r]`` its exit status once known
    (the exit code, or ``-signal`` as in ``subprocess``), else None.
    """

    def __init__(self, server: subprocess.Popen | _ZygoteServer, world_size: int, ranks: Sequence[int] | None = None) -> None:
        self._server = server
        self.world_size = world_size
        #: The ranks this launch started (an emulation starts only its sandbox ranks).
        self.ranks = list(range(world_size)) if ranks is None else sorted(int(r) for r in ranks)
        self.pids: list[int] = [0] * world_size
        self.returncodes: list[int | None] = [None] * world_size
        #: rank -> its process's peak resident memory (bytes), once it exited
        self.peak_rss: dict[int, int] = {}
        self._cond = threading.Condition()
        self._started = 0
        self._done = False
        self._reader = threading.Thread(target=self._read_events, name="prism-forkserver-events", daemon=True)
        self._reader.start()

    def _read_events(self) -> None:
        assert self._server.stdout is not None  # Popen(stdout=PIPE)
        for line in self._server.stdout:
            ev = orjson.loads(line)
            with self._cond:
                if ev["ev"] == "started":
                    self.pids[ev["rank"]] = ev["pid"]
                    self._started += 1
                elif ev["ev"] == "exit":
                    self.returncodes[ev["rank"]] = ev["status"]
                    if "maxrss_kib" in ev:
                        self.peak_rss[ev["rank"]] = int(ev["maxrss_kib"]) * 1024
                self._cond.notify_all()
        self._server.stdout.close()
        self._server.wait()
        with self._cond:
            # A fork server that died leaves its ranks dead too (PDEATHSIG).
            for r in self.ranks:
                if self.returncodes[r] is None:
                    self.returncodes[r] = -signal.SIGKILL
            self._done = True
            self._cond.notify_all()

    def wait_started(self, timeout: float | None = None) -> bool:
        """Wait until every rank is forked (``pids`` complete)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._started == len(self.ranks) or self._done, timeout)

    def poll(self, rank: int | None = None) -> int | None | list[int | None]:
        """Exit status of ``rank`` (None while it runs), or the list for all ranks."""
        with self._cond:
            return list(self.returncodes) if rank is None else self.returncodes[rank]

    def wait(self, rank: int | None = None, timeout: float | None = None) -> int | None | list[int | None]:
        """Wait for ``rank`` (or all ranks and the fork server) to exit; returns
        ``poll(rank)`` (None entries if ``timeout`` expired)."""
        with self._cond:
            if rank is None:
                self._cond.wait_for(lambda: self._done, timeout)
            else:
                self._cond.wait_for(lambda: self.returncodes[rank] is not None or self._done, timeout)
        if rank is None and self._done:
            self._reader.join()
        return self.poll(rank)

    def kill_all(self) -> None:
        """SIGKILL every rank (and what it spawned: each rank leads its own
        process group), then let the fork server exit."""
        for pid, code in zip(self.pids, self.returncodes):
            if pid and code is None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        stdin = self._server.stdin
        if stdin is not None and not stdin.closed:
            try:
                stdin.write(b'{"cmd": "kill"}\n')
                stdin.close()
            except BrokenPipeError:
                pass

    def close(self) -> None:
        """Kill what still runs, reap the fork server and wait until the killed
        ranks are gone (a rank the fork server did not live to reap is
        still exiting when it ends; a caller that returns then would leave
        it behind for a moment)."""
        self.kill_all()
        self.wait(timeout=30)
        deadline = time.monotonic() + 10
        for pid in self.pids:
            while pid and _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.005)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:  # no /proc (not Linux): signal 0 says whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in (b"Z", b"X")


def launch_ranks(
    world_size: int,
    endpoint: str | None,
    run_dir: str | os.PathLike,
    command: Sequence[str],
    *,
    nproc_per_node: int = DEFAULT_NPROC_PER_NODE,
    show_ranks: Literal["all"] | Sequence[int] = (0,),
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    run_id: str | None = None,
    ranks: Sequence[int] | None = None,
) -> RankProcesses:
    """Start ``world_size`` rank processes running ``command``.

    ``command`` is ``[SCRIPT, args...]`` or ``["-m", MODULE, args...]``.
    ``endpoint`` is the coordinator's; None runs the script with plain
    torch.distributed (no Prism backend, a real TCP rendezvous on
    ``MASTER_PORT``): the ground truth under the same launcher. Output goes to
    ``runfolder.log_path`` (``run_dir/logs/rank-XXXXXX.log``); the ranks in ``show_ranks`` ("all" or a
    list) also print to this process's stderr prefixed ``[rank N] ``, and
    failing ranks print the tail of their log. ``env`` is added to the ranks'
    environment (it wins over this process's; torchrun's variables win over it).
    ``ranks`` starts only those ranks (an emulation's sandbox), each with the
    environment of its rank in the world of ``world_size``; None starts all.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be at least 1, got {nproc_per_node}")
    if not command:
        raise ValueError("command is empty: give [SCRIPT, args...] or ['-m', MODULE, args...]")
    if ranks is not None:
        ranks = sorted({int(r) for r in ranks})
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad or not ranks:
            raise ValueError(f"ranks {bad or '[]'}: give ranks in [0, {world_size})")
    run_dir = os.fspath(run_dir)
    spec = {
        "world_size": world_size,
        "endpoint": endpoint,
        "log_path": runfolder.log_path_pattern(run_dir),
        "command": list(command),
        "nproc_per_node": nproc_per_node,
        "show_ranks": show_ranks if show_ranks == "all" else [int(r) for r in show_ranks],
        "env": dict(env or {}),
        "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
        "master_port": _free_port(),
        "run_id": run_id or os.path.basename(os.path.abspath(run_dir)) or "prism",
        "ranks": ranks,
    }
    server = _server_for(spec["cwd"])
    assert server.stdin is not None  # Popen(stdin=PIPE)
    server.stdin.write(orjson.dumps(spec) + b"\n")
    server.stdin.flush()
    return RankProcesses(server, world_size, ranks)
