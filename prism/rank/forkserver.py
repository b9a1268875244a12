"""The fork server: one process that imports torch once and forks the ranks.

Started by ``prism.shell.launcher.launch_ranks`` as ``python -m prism.rank.forkserver``
so that the coordinator (trio, zmq) never forks itself: forking a process with
a live zmq context or trio loop is unsafe. It must not touch CUDA before
forking (a CUDA context does not survive fork), and it starts no threads.

Protocol (JSON lines): stdin receives one launch spec (see ``launch_ranks``),
then optionally ``{"cmd": "kill"}``; stdout reports ``{"ev": "started",
"rank": R, "pid": P}`` per child, ``{"ev": "exit", "rank": R, "status": S}``
(``S`` as ``subprocess`` return codes: the exit code, or ``-signal``) and
finally ``{"ev": "done"}``. EOF on stdin (the launcher went away) kills every
child, so no rank outlives its launcher.

Each child's stdout and stderr go to one pipe; the server appends them to
the log file the launcher names (``spec["log_path"]``, a pattern with a
``{rank}`` field: ``RUN/logs/rank-XXXXXX.log``) and copies the lines of the
shown ranks to its own stderr prefixed ``[rank N] ``; a rank that is not
shown but fails has the tail of its log printed when it exits.
"""

from __future__ import annotations

import collections
import gc
import ctypes
import os
import resource
import selectors
import signal
import socket
import sys
from typing import Any

#: This process's environment before torch's imports added to it (torch._dynamo
#: sets TORCHINDUCTOR_CACHE_DIR): what a zygote compares a launch's with.
_ENV_AT_START = dict(os.environ)

import orjson  # noqa: E402
# Imported once here, before any fork, so every child starts warm.
import torch  # noqa: E402

import prism.rank.bootstrap  # noqa: E402
import prism.rank.devices  # noqa: E402
from prism.rank.envnames import ZYGOTE_FREE_PREFIXES  # noqa: E402

try:
    # Every torch.optim optimizer imports torch._dynamo on construction (about
    # 1.5 s of CPU and tens of MB of Python objects per process): done once
    # here, the ranks inherit it, shared, instead of each paying for it.
    import torch._dynamo  # noqa: F401
except Exception:  # an optional speed-up; a torch without it still works
    pass

#: Lines of a hidden rank's output replayed on the console when it fails.
FAILURE_TAIL_LINES = 40
PR_SET_PDEATHSIG = 1


def child_env(spec: dict[str, Any], rank: int) -> dict[str, str]:
    """The environment torchrun would give ``rank``, plus Prism's."""
    env = dict(os.environ)
    env.update(spec.get("env") or {})
    world = spec["world_size"]
    per_node = spec["nproc_per_node"]
    node = rank // per_node
    env.update({
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank % per_node),
        "LOCAL_WORLD_SIZE": str(min(per_node, world - node * per_node)),
        "GROUP_RANK": str(node),
        "NODE_RANK": str(node),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(spec["master_port"]),
        "TORCHELASTIC_RUN_ID": spec["run_id"],
    })
    # torchrun's default: one thread per rank unless the user chose.
    env.setdefault("OMP_NUM_THREADS", "1")
    if spec.get("endpoint"):
        env["PRISM_COORDINATOR"] = spec["endpoint"]
        site = prism.rank.bootstrap.PRISM_SITE_DIR
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
    return env


#: "1": each rank on one CPU, rank r on the (r mod n)-th of the fork server's
#: CPUs (no migration between CPUs; for ground truth and capture alike, as an
#: experiment: ``bench/accuracy.py --pin``, ``bench/compute_probe.py --pin``).
PIN_ENV = "PRISM_PIN_CPUS"


def _pin(rank: int) -> None:
    if os.environ.get(PIN_ENV) != "1" or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


def _child(spec: dict[str, Any], rank: int, out_w: int) -> None:
    """Runs in the forked child; never returns."""
    code = 1
    profile = None
    try:
        os.setpgid(0, 0)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(out_w, 2)
        os.closerange(3, 1 << 16)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        # Computed before the clear: the rank inherits the launching
        # environment (CUDA_VISIBLE_DEVICES, NCCL_*, PATH ...), as under torchrun.
        env = child_env(spec, rank)
        os.environ.clear()
        os.environ.update(env)
        _pin(rank)
        # A forked child keeps the server's sys.path; give it the PYTHONPATH
        # entries a fresh interpreter would have put in front.
        entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [p for p in entries if p not in sys.path]
        if spec.get("cwd"):
            os.chdir(spec["cwd"])
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
        prism.rank.devices.install_if_requested(rank, spec["world_size"], spec["nproc_per_node"])
        profile = _start_profile(rank)
        code = prism.rank.bootstrap.child_main(
            spec["command"],
            rank=rank,
            world_size=spec["world_size"],
            local_rank=rank % spec["nproc_per_node"],
            endpoint=spec.get("endpoint"),
        )
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            if profile is not None:
                profile()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _start_profile(rank: int) -> Any:
    """``PRISM_PROFILE_RANK=DIR``: profile this rank's main thread; returns
    what writes ``DIR/rank-N.prof`` (None when unset)."""
    from prism.rank.envnames import PROFILE_RANK_ENV

    out = os.environ.get(PROFILE_RANK_ENV)
    if not out:
        return None
    import cProfile

    prof = cProfile.Profile()
    prof.enable()

    def dump() -> None:
        prof.disable()
        try:
            os.makedirs(out, exist_ok=True)
            prof.dump_stats(os.path.join(out, f"rank-{rank}.prof"))
        except OSError as e:
            print(f"prism: {PROFILE_RANK_ENV}: could not write the profile into {out}: {e}", file=sys.stderr)

    return dump


def _report(obj: dict[str, Any]) -> None:
    try:
        os.write(1, orjson.dumps(obj) + b"\n")
    except BrokenPipeError:
        pass  # the launcher is gone; EOF on stdin makes the loop kill the ranks


def serve(spec: dict[str, Any]) -> None:
    world = spec["world_size"]
    # The launcher names the log files (prism.shell.runfolder knows the run's
    # layout; the rank side imports no shell).
    log_pattern = spec["log_path"]
    os.makedirs(os.path.dirname(log_pattern), exist_ok=True)
    show = spec.get("show_ranks", [0])
    shown = set(range(world)) if show == "all" else set(show)
    # An emulation starts only its sandbox ranks, each still told the full world.
    launched = spec.get("ranks")
    launched = list(range(world)) if launched is None else [int(r) for r in launched]
    # One pipe per rank stays open here: raise the soft limit for large worlds.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * len(launched) + 64
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))

    sel = selectors.DefaultSelector()
    pids: dict[int, int] = {}
    pending: dict[int, bytes] = {}
    log_files: dict[int, Any] = {}
    tails: dict[int, collections.deque] = {}
    # Move everything imported so far (torch, prism) out of the collector's
    # reach: a child's collections would otherwise write to every tracked
    # object's header and copy the shared pages (host memory per rank).
    gc.freeze()
    for rank in launched:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _child(spec, rank, w)
        # The child makes its own process group too; setting it here as well
        # means it exists before a kill that comes at once (an EOF on stdin
        # already waiting: the launcher died while this server started),
        # which would otherwise miss a child that had not run setpgid yet.
        try:
            os.setpgid(pid, pid)
        except OSError:  # it has exited already
            pass
        os.close(w)
        pids[pid] = rank
        log_files[rank] = open(log_pattern.format(rank=rank), "ab", buffering=0)
        pending[rank] = b""
        tails[rank] = collections.deque(maxlen=FAILURE_TAIL_LINES)
        sel.register(r, selectors.EVENT_READ, rank)
        _report({"ev": "started", "rank": rank, "pid": pid})
    sel.register(0, selectors.EVENT_READ, None)

    def console(rank: int, line: bytes) -> None:
        os.write(2, f"[rank {rank}] ".encode() + line + (b"" if line.endswith(b"\n") else b"\n"))

    def kill_all() -> None:
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    open_pipes = len(launched)
    alive = dict(pids)
    exited: dict[int, int] = {}
    closed: set[int] = set()

    def show_failure(rank: int) -> None:
        # Once the rank has exited and all its output is read.
        status = exited.get(rank, 0)
        if status == 0 or rank in shown or rank not in closed:
            return
        os.write(2, f"[rank {rank}] exited with status {status}; last lines of its log:\n".encode())
        for line in tails[rank]:
            console(rank, line)
    while open_pipes or alive:
        for key, _ in sel.select(timeout=0.05):
            if key.data is None:
                data = os.read(0, 65536)
                if not data or b'"kill"' in data:
                    kill_all()
                    if not data:
                        sel.unregister(0)
                continue
            rank = key.data
            data = os.read(key.fd, 1 << 16)
            if not data:
                sel.unregister(key.fd)
                os.close(key.fd)
                open_pipes -= 1
                closed.add(rank)
                if pending[rank]:
                    data, pending[rank] = pending[rank], b""
                    tails[rank].append(data)
                    if rank in shown:
                        console(rank, data)
                show_failure(rank)
                continue
            log_files[rank].write(data)
            *lines, pending[rank] = (pending[rank] + data).split(b"\n")
            for line in lines:
                tails[rank].append(line + b"\n")
                if rank in shown:
                    console(rank, line + b"\n")
        while alive:
            try:
                pid, raw, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                alive.clear()
                break
            if pid == 0:
                break
            rank = alive.pop(pid, None)
            if rank is None:
                continue
            status = os.waitstatus_to_exitcode(raw)
            exited[rank] = status
            # ru_maxrss: the rank's peak resident memory in KiB (Linux)
            _report({"ev": "exit", "rank": rank, "status": status, "maxrss_kib": usage.ru_maxrss})
            show_failure(rank)
    _report({"ev": "done"})


def _zygote_refusal(env: dict[str, str], base: dict[str, str]) -> str | None:
    """Why a launch with ``env`` must not be forked from a zygote started
    with ``base`` (None: it may): only the variables Prism and pytest read
    at run time may differ."""
    differ = sorted(k for k in set(env) | set(base)
                    if env.get(k) != base.get(k) and not k.startswith(ZYGOTE_FREE_PREFIXES))
    if differ:
        return "the environment differs in " + ", ".join(differ[:5]) + (" ..." if len(differ) > 5 else "")
    return None


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One launch request: a JSON line with the fds it passed (SCM_RIGHTS)."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
    while data and not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            break
        data += more
    return orjson.loads(data), list(fds)


def _zygote_child(listener: socket.socket, conn: socket.socket, fds: list[int], env: dict[str, str],
                  cwd: str) -> None:
    """Runs in a child of the zygote: becomes one launch's fork server, with
    the launcher's pipes and stderr as its stdin, stdout and stderr; never returns."""
    code = 1
    try:
        listener.close()
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        # ``python -m`` put the zygote's working directory first on sys.path;
        # a fresh fork server started in ``cwd`` would have had that one.
        if sys.path and sys.path[0] in ("", os.getcwd()):
            sys.path[0] = cwd
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        serve_stdin()
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)


def note(log: str | None, line: str) -> None:
    """A zygote's request, one line in ``log`` (if set)."""
    if log:
        with open(log, "a") as f:
            f.write(line + "\n")


def zygote(path: str) -> None:
    """Serve launches on the Unix socket ``path`` until stdin closes: each
    launch's fork server is forked from this process, which has imported
    torch and Prism once, instead of started as a fresh interpreter (about
    3 s of CPU each).

    A launcher connects and sends ``{"env": ..., "cwd": ..., "executable":
    ...}`` (its ``sys.executable``: another interpreter is refused) with three
    fds: its end of the spec pipe, the event pipe's write end and its
    stderr; the reply is ``{"pid": P}`` (the child serves exactly as ``main``
    does) or ``{"refused": WHY}`` when the launch's environment differs from
    this process's outside ``ZYGOTE_FREE_PREFIXES`` (it then starts a fresh
    fork server). ``PRISM_FORKSERVER_ZYGOTE_LOG=FILE`` appends one line per
    request (served or refused: the test suite's count).
    """
    base = _ENV_AT_START
    # A launch's fork server gets this process's environment as its imports
    # left it (what a fresh one would have), with the launch's own values of
    # the variables that may differ.
    fixed = {k: v for k, v in os.environ.items() if not k.startswith(ZYGOTE_FREE_PREFIXES)}
    log = os.environ.get("PRISM_FORKSERVER_ZYGOTE_LOG")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # connectable once it exists
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "listen")
    sel.register(0, selectors.EVENT_READ, "stdin")
    gc.freeze()
    try:
        while True:
            for key, _ in sel.select(timeout=1.0):
                if key.data == "stdin":
                    if not os.read(0, 4096):
                        return
                    continue
                conn, _addr = listener.accept()
                fds: list[int] = []
                with conn:
                    try:
                        req, fds = _recv_request(conn)
                        why = (f"expected 3 fds, got {len(fds)}" if len(fds) != 3
                               else f"another interpreter ({req.get('executable')}, this one {sys.executable})"
                               if req.get("executable") != sys.executable
                               else _zygote_refusal(req["env"], base))
                        note(log, "served" if why is None else f"refused: {why}")  # before the launcher hears
                        if why is None:
                            sys.stdout.flush()
                            sys.stderr.flush()
                            pid = os.fork()
                            if pid == 0:
                                env = dict(fixed)
                                env.update((k, v) for k, v in req["env"].items()
                                           if k.startswith(ZYGOTE_FREE_PREFIXES))
                                _zygote_child(listener, conn, fds, env, req["cwd"])
                            conn.sendall(orjson.dumps({"pid": pid}) + b"\n")
                        else:
                            conn.sendall(orjson.dumps({"refused": why}) + b"\n")
                    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                        note(log, f"bad request: {e!r}")  # the launcher, hearing nothing, starts a fresh one
                    finally:
                        for fd in fds:
                            os.close(fd)
            while True:  # reap the launches' fork servers that ended
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def serve_stdin() -> None:
    """One launch: its spec from stdin, served (the fork server's protocol)."""
    line = sys.stdin.buffer.readline()
    if not line:
        return
    # No PDEATHSIG here: it fires when the launcher's *thread* exits (the
    # coordinator may launch from a worker thread); EOF on stdin marks the
    # launcher's death instead.
    serve(orjson.loads(line))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--zygote":
        zygote(sys.argv[2])
    else:
        serve_stdin()


if __name__ == "__main__":
    main()
