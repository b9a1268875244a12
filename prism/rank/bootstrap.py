"""What a logical rank's process does around the user's script.

``child_main`` runs in each child of the fork server (``prism.rank.forkserver``):
it connects to the coordinator (Hello/Welcome), takes a slot, forces every
``init_process_group``/``new_group`` onto the Prism backend, runs the script
(``runpy``) and reports how it ended (trace flush, ``Goodbye``, exit code).

Forcing the backend: no environment variable selects a torch.distributed
backend and an explicit ``"nccl"`` always builds NCCL, so ``init_process_group``
and ``new_group`` are wrapped where scripts and torch find them
(``torch.distributed``, ``torch.distributed.distributed_c10d`` and
``torch.distributed.device_mesh``, which imports the names and calls them
bare). Whatever backend the script names ("nccl", "gloo", None,
"cpu:gloo,cuda:nccl") becomes "prism"; ``device_id`` is dropped (a Python
process group has no C++ backend to bind, and a bound device sends DeviceMesh
down the ``split_group`` path); the store is a private ``HashStore`` with the
rank and world size given explicitly, so no TCP rendezvous happens (the Prism
backend never uses the store).

Processes the script spawns: ``PRISM_SITE_DIR`` (``prism/rank/_site``) holds a
``sitecustomize`` that applies the same patch in any Python child that has it
on ``PYTHONPATH`` and ``PRISM_COORDINATOR`` set; such a child connects when it
calls ``init_process_group``, as the rank given by its arguments or by the
``RANK``/``WORLD_SIZE`` it inherits (see ``install_lazy``).
"""

from __future__ import annotations

import functools
import importlib
import os
import pathlib
import runpy
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from prism.core import protocol
from prism.rank import backend as _backend
from prism.rank import compat as _compat
from prism.rank import devices as _devices
from prism.rank import memstats as _memstats
from prism.rank import oom as _oom
from prism.rank import runtime as _rt

#: ``module:function`` replacing ``transport.client.BlockingClient.connect``
#: (same signature); tests use it to plug in a fake coordinator.
CLIENT_FACTORY_ENV = "PRISM_CLIENT_FACTORY"
COORDINATOR_ENV = "PRISM_COORDINATOR"
PRISM_SITE_DIR = str(pathlib.Path(__file__).resolve().parent / "_site")
CONNECT_TIMEOUT_S = 30.0


def connect(endpoint: str, hello: protocol.Hello, *, timeout: float = CONNECT_TIMEOUT_S) -> tuple[Any, protocol.Welcome]:
    """Connect to the coordinator: ``(client, welcome)``."""
    factory = os.environ.get(CLIENT_FACTORY_ENV)
    if factory:
        module, _, name = factory.partition(":")
        fn = getattr(importlib.import_module(module), name)
    else:
        from transport.client import BlockingClient
        from transport.curve import KEYS_ENV

        return BlockingClient.connect(endpoint, hello, timeout=timeout,
                                      heartbeat_timeout_s=heartbeat_timeout_s(hello.world_size),
                                      curve_keys=os.environ.get(KEYS_ENV) or None)
    return fn(endpoint, hello, timeout=timeout)


def heartbeat_timeout_s(world_size: int) -> float:
    """How long the rank's client waits for the coordinator's heartbeats
    before it counts as lost: ``PRISM_HEARTBEAT_TIMEOUT_S`` if set, else 10 s,
    more when the world has many ranks per core (1,024 ranks on 2 cores
    starve the coordinator's I/O thread for tens of seconds at a time)."""
    env = os.environ.get("PRISM_HEARTBEAT_TIMEOUT_S")
    if env:
        return float(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(10.0, 0.1 * world_size / max(cores, 1))


def start_runtime(endpoint: str, rank: int, world_size: int, local_rank: int) -> _rt.RankRuntime:
    """Connect, start the rank's runtime (slot held on return), install hooks."""
    if torch.cuda.is_available():
        device = f"cuda:{local_rank % torch.cuda.device_count()}"
    else:
        device = "cpu"
    dump = os.environ.get(STACK_DUMP_ENV)
    if dump:
        # a hang's stacks (every thread) in the rank's log, for diagnosis
        import faulthandler

        faulthandler.dump_traceback_later(float(dump), repeat=True)
    _switch_interval()
    probes = _rt.clock_probes_from_env()
    hello = _rt.make_hello(rank, world_size, local_rank, device)
    client, welcome = connect(endpoint, hello)
    rt = _rt.RankRuntime(client, welcome, hello, welcome_recv_ns=time.monotonic_ns(), clock_probes=probes)
    _backend.register()
    rt.start(physical_device=_devices.physical_name(device))
    _rt.install_step_hooks(rt)
    if device != "cpu":
        limit = os.environ.get(_oom.MEMORY_LIMIT_ENV)
        if limit:
            _oom.set_limit(int(limit))
        gpus = os.environ.get(_devices.GPUS_ENV)
        node = os.environ.get(_devices.NODE_RANKS_ENV)  # through an agent: the ranks sharing this node's GPUs
        sharing = len(_devices.node_rank_list(node, world_size)) if node else world_size
        _memstats.install(shared_gpu=bool(gpus) and sharing > len(_devices.parse_gpus(gpus)))
    return rt


def _switch_interval() -> float | None:
    """``PRISM_SWITCH_INTERVAL_US`` (``prism.rank.envnames``): the rank's
    thread switch interval; returns the one set (s), None if unchanged."""
    from prism.rank.envnames import SWITCH_INTERVAL_ENV

    raw = os.environ.get(SWITCH_INTERVAL_ENV)
    if not raw:
        return None
    try:
        us = float(raw)
        if not us > 0:
            raise ValueError
    except ValueError:
        raise SystemExit(f"prism: {SWITCH_INTERVAL_ENV}={raw!r}: give the thread switch interval in microseconds, "
                         "a number above 0 (Python's default is 5000)") from None
    sys.setswitchinterval(us / 1e6)
    return sys.getswitchinterval()


#: Seconds after which (and every as many after) a rank writes every thread's
#: Python stack to its log (``faulthandler``): to see where a hung rank is.
STACK_DUMP_ENV = "PRISM_STACK_DUMP_S"


# --- forcing the backend -------------------------------------------------------------


_PATCHED_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d", "torch.distributed.device_mesh")


def _ensure_runtime(rank: int, world_size: int) -> _rt.RankRuntime:
    if _rt._current is not None:
        return _rt._current
    # A process the rank spawned (sitecustomize): connect now.
    endpoint = os.environ.get(COORDINATOR_ENV)
    if not endpoint:
        raise RuntimeError(f"init_process_group under Prism needs {COORDINATOR_ENV}; start the script with prism")
    rank = rank if rank >= 0 else int(os.environ["RANK"])
    world_size = world_size if world_size > 0 else int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    return start_runtime(endpoint, rank, world_size, local)


def patch_torch_distributed() -> None:
    """Make every ``init_process_group``/``new_group`` use backend "prism" (idempotent)."""
    if getattr(c10d.init_process_group, "_prism_patched", False):
        return
    _backend.register()
    original_init = c10d.init_process_group
    original_new_group = c10d.new_group

    @functools.wraps(original_init)
    def init_process_group(backend: Any = None, init_method: Any = None, timeout: Any = None,
                           world_size: int = -1, rank: int = -1, store: Any = None, group_name: str = "",
                           pg_options: Any = None, device_id: Any = None, **kwargs: Any) -> None:
        rt = _ensure_runtime(rank, world_size)
        if world_size not in (-1, rt.world_size) or rank not in (-1, rt.rank):
            raise ValueError(
                f"init_process_group(rank={rank}, world_size={world_size}) disagrees with Prism, which "
                f"started this process as rank {rt.rank} of {rt.world_size}; let Prism set RANK and "
                "WORLD_SIZE (your script's or launch command's fault)"
            )
        _compat.note_requested_backend(backend)
        kw = {"timeout": timeout} if timeout is not None else {}
        return original_init(_backend.BACKEND_NAME, store=dist.HashStore(), rank=rt.rank,
                             world_size=rt.world_size, group_name=group_name, **kw)

    @functools.wraps(original_new_group)
    def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, pg_options: Any = None,
                  *args: Any, **kwargs: Any) -> Any:
        return original_new_group(ranks, timeout, None, None, *args, **kwargs)

    init_process_group._prism_patched = True  # type: ignore[attr-defined]
    new_group._prism_patched = True  # type: ignore[attr-defined]
    for name in _PATCHED_MODULES:
        mod = importlib.import_module(name)
        if hasattr(mod, "init_process_group"):
            mod.init_process_group = init_process_group
        if hasattr(mod, "new_group"):
            mod.new_group = new_group
    for device in ("cpu", "cuda"):
        dist.Backend.default_device_backend_map[device] = _backend.BACKEND_NAME
    if os.environ.get(FRONT_END_ENV) == "1":
        _wrap_front_end()
    _compat.install()


#: ``PRISM_FRONT_END_IN_COMM=1``: count torch.distributed's Python front end
#: as part of each call (``_front_end``), not of the compute around it. Off
#: by default until measured on the device (``bench/comm_share.py`` compares).
FRONT_END_ENV = "PRISM_FRONT_END_IN_COMM"

#: torch.distributed's Python calls whose whole time counts as communication.
FRONT_END_CALLS = ("all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                   "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "send",
                   "recv", "isend", "irecv", "batch_isend_irecv", "gather", "scatter")


def _front_end(fn: Any) -> Any:
    """``fn`` with its whole run inside a communication call of the recorder.

    A call through torch.distributed's Python functions reaches Prism's
    backend after torch's own dispatch (argument checks, the C++ trampoline
    into a Python backend), and a blocking call returns through it and its
    ``work.wait()``. Without this those stretches would be cut into the
    compute segments around the call (about 0.3 ms per call on the 2-core VM,
    measured with ``bench/comm_share.py``), while the cost model's measured
    points already contain the real backend's own dispatch: the replay would
    count it twice. The backend's call starts where the front end did (its
    issue time; in an emulation the sandbox's arrival), and in an emulation
    the way back from a blocking call's release to the caller is Prism's
    (dilated out), so a sandbox pays the front end once, in the profile's
    time, as the capture's graph does. Calls that C++ makes by itself (DDP's reducer, functional
    collectives) do not pass here; their segments are cut where the backend
    is entered, as before. On the 2-core VM the effect was within its noise
    (2026-12-02); the device's CPUs will say."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        rt = _rt._current
        if rt is None:
            return fn(*args, **kwargs)
        t0 = rt.recorder.comm_enter(front_end=True)
        try:
            return fn(*args, **kwargs)
        finally:
            end = time.monotonic_ns()
            rt.recorder.comm_exit(end)
            # Emulation: the call was released when the emulated job completes
            # it; the way back out through Prism and torch is the real
            # backend's in the profile's time, not more of the job's.
            resumed = rt.last_resumed_ns
            if rt.hybrid and resumed is not None and resumed >= t0:
                rt.add_dilation(end - resumed)

    call._prism_front_end = True
    return call


def _wrap_front_end() -> None:
    for name in FRONT_END_CALLS:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "_prism_front_end", False):
            continue
        wrapped = _front_end(fn)
        for modname in ("torch.distributed", "torch.distributed.distributed_c10d"):
            mod = importlib.import_module(modname)
            if getattr(mod, name, None) is fn:
                setattr(mod, name, wrapped)


def install_lazy() -> None:
    """The sitecustomize entry: patch now, connect at ``init_process_group``."""
    patch_torch_distributed()


# --- running the script ----------------------------------------------------------------


def run_command(command: Sequence[str]) -> None:
    """Run ``SCRIPT args...`` or ``-m MODULE args...`` as ``__main__``."""
    if not command:
        raise ValueError("no command to run: give a script path or -m MODULE")
    if command[0] == "-m":
        if len(command) < 2:
            raise ValueError("-m needs a module name")
        sys.argv = [command[1], *command[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        script = command[0]
        sys.argv = list(command)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


def _uses_cuda() -> bool:
    return "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def child_main(command: Sequence[str], *, rank: int, world_size: int, local_rank: int,
               endpoint: str | None) -> int:
    """A rank process's whole life; returns its exit code.

    With ``endpoint=None`` the script runs with plain torch.distributed (no
    patch, no coordinator): a ground-truth run under the same launcher.
    """
    rt = None
    status, message, code = "ok", "", 0
    end_ns = None
    try:
        if endpoint is not None:
            rt = start_runtime(endpoint, rank, world_size, local_rank)
            patch_torch_distributed()
        try:
            run_command(command)
        except SystemExit as e:
            code = _exit_code(e)
            if code != 0:
                status, message = "error", f"the script exited with status {code}"
    except BaseException as e:
        message = traceback.format_exc()
        traceback.print_exc()
        status, code = "error", 1
        report = _oom.describe(e, rank, rt.recorder.step if rt is not None else -1) if _uses_cuda() else None
        if report is not None:
            status, message = "oom", report + "\n\n" + message
            print(f"prism: {report}", file=sys.stderr)
    finally:
        end_ns = time.monotonic_ns()  # the script's end: what follows is Prism's (runtime.finish)
        if "prism.rank.devicepath" in sys.modules:
            try:
                sys.modules["prism.rank.devicepath"].report()
            except BaseException:  # noqa: BLE001 (a report, never the rank's outcome)
                traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
    if rt is not None:
        try:
            rt.finish(status, message, end_ns=end_ns)
            rt.client.close()
            # The fork server's children leave through os._exit, which skips
            # ZeroMQ's linger: terminating the context here blocks until the
            # last trace records and the Goodbye are on their way.
            import zmq

            zmq.Context.instance().term()
        except BaseException:
            traceback.print_exc()
            code = code or 1
    return code
