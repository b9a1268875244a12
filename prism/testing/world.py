"""An emulated world: the real coordinator and scripted fake ranks in one
trio loop, on the in-memory transport.

``emulated_world(world_size, run_dir)`` starts ``prism.shell.coordinator.Coordinator``
(the one ``prism capture`` runs) in the test's nursery, serving on a
``transport.memory.MemoryRouter`` instead of a ZeroMQ socket, with a fake
process handle (``FakeProcesses``) so a killed rank is seen as a dead
process is. ``world.run(script)`` runs ``script(rank)`` as every rank (a
``FakeRank``, see ``prism.testing.rank``) and returns the coordinator's
``CaptureResult``; ``world.trace()`` reads the run folder back.

Everything happens inside the loop (no threads, no sockets), so under
pytest-trio's ``autojump_clock`` quiet periods, grace periods and injected
delays pass in no real time, and a run is deterministic.

Faults: ``world.kill(rank)`` (the process dies: its connection closes and
the handle reports the exit), ``world.drop(predicate)`` and
``world.delay(predicate, seconds)`` (messages on a rank's connection, either
way, lost or held back; ``prism.testing.message`` builds predicates).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

import prism
from prism.core import protocol as P
from prism.core import trace as T
from prism.shell import runfolder
from prism.shell.coordinator import DEFAULT_GRACE_S, DEFAULT_QUIET_S, CaptureResult, Coordinator
from prism.testing.rank import FakeRank, RankKilled, RankStopped
from prism.testing.trace import Trace
from transport.memory import MemoryRouter, MemorySocket

__all__ = ["EmulatedWorld", "Fault", "FakeProcesses", "emulated_world", "message"]

#: A rank's script: called with its ``FakeRank`` after ``init()``.
Script = Callable[[FakeRank], Awaitable[Any]]


def message(kind: type | tuple[type, ...] = object, **fields: Any) -> Callable[[P.Message], bool]:
    """A predicate for ``drop``/``delay``: messages of ``kind`` (protocol
    classes, e.g. ``P.CollectiveArrive``) whose ``fields`` equal the values
    given, e.g. ``message(P.CollectiveArrive, op="all_reduce", seq=1)``."""
    for name in fields:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if kind is not object and not any(name in getattr(k, "__dataclass_fields__", {}) for k in kinds):
            raise ValueError(f"message(): {kind} has no field {name!r}")

    def match(msg: P.Message) -> bool:
        return isinstance(msg, kind) and all(getattr(msg, k, object()) == v for k, v in fields.items())

    return match


@dataclass
class Fault:
    """An injected network fault: messages on ``rank``'s connection (None:
    every rank's) for which ``predicate`` holds are dropped (``seconds``
    None) or delayed by ``seconds``, at most ``times`` of them (None: all).
    ``hits`` counts the messages it took, so a test can check it fired."""

    predicate: Callable[[P.Message], bool]
    rank: int | None = None
    seconds: float | None = None
    times: int | None = None
    hits: int = 0
    active: bool = True

    def takes(self, rank: int, msg: P.Message) -> bool:
        if not self.active or (self.rank is not None and self.rank != rank):
            return False
        if self.times is not None and self.hits >= self.times:
            return False
        if not self.predicate(msg):
            return False
        self.hits += 1
        return True

    def remove(self) -> None:
        """Stop injecting this fault."""
        self.active = False


class FakeProcesses:
    """The launcher's handle (``prism.shell.coordinator.Processes``) for
    fake ranks: ``exit(rank, code)`` is a process ending; ``kill_all`` kills
    the ranks still running, as the launcher kills processes. The
    coordinator calls it in its loop (it never blocks)."""

    def __init__(self, world: EmulatedWorld) -> None:
        self._world = world
        self.codes: dict[int, int] = {}
        self.killed = False
        self.closed = False

    def exit(self, rank: int, code: int) -> None:
        self.codes.setdefault(rank, code)

    def poll(self) -> list[int | None]:
        return [self.codes.get(r) for r in range(self._world.world_size)]

    def kill_all(self) -> None:
        self.killed = True
        self._world._kill_running()

    def wait(self, timeout: float | None = None) -> list[int | None]:
        return self.poll()

    def close(self) -> None:
        self.closed = True
        self._world._kill_running()


@dataclass
class _Outcomes:
    returns: dict[int, Any] = field(default_factory=dict)
    stopped: dict[int, RankStopped] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)


class EmulatedWorld:
    """A world of ``world_size`` fake ranks around the real coordinator (see
    the module docstring). Made by ``emulated_world``; one capture each."""

    def __init__(self, world_size: int, run_dir: str | os.PathLike[str], *, slots: int | None = None,
                 quiet_s: float = DEFAULT_QUIET_S, grace_s: float = DEFAULT_GRACE_S,
                 register_stall_s: float | None = None, codec: bool = True, **coordinator: Any) -> None:
        self.world_size = world_size
        self.run_dir = Path(run_dir)
        self.router = MemoryRouter(codec=codec)
        self.processes = FakeProcesses(self)
        self.coordinator = Coordinator(self.run_dir, world_size, slots=slots or max(world_size, 1),
                                       endpoint=f"memory://{self.run_dir}", quiet_s=quiet_s, grace_s=grace_s,
                                       register_stall_s=register_stall_s, router=self.router,
                                       processes=self.processes, **coordinator)
        self.faults: list[Fault] = []
        self.outcomes = _Outcomes()
        self._ranks: dict[int, FakeRank] = {}
        self._result: CaptureResult | None = None
        self._done = trio.Event()
        self._ran = False

    # --- ranks and raw connections -------------------------------------------

    def connect(self, identity: bytes, *, rank: int = -1) -> MemorySocket:
        """A raw DEALER to the coordinator (protocol-level tests); faults
        given for ``rank`` apply to it."""
        return self.router.connect(identity, drop=lambda m: self._drop(rank, m),
                                   delay=lambda m: self._delay(rank, m))

    def rank(self, r: int) -> FakeRank:
        """Rank ``r``'s fake rank (connected on first use)."""
        if not 0 <= r < self.world_size:
            raise ValueError(f"rank {r} is outside the world of {self.world_size} (0..{self.world_size - 1})")
        fr = self._ranks.get(r)
        if fr is None:
            sock = self.connect(f"rank-{r}".encode(), rank=r)
            fr = self._ranks[r] = FakeRank(r, self.world_size, sock, on_die=self.processes.exit)
        return fr

    def _drop(self, rank: int, msg: P.Message) -> bool:
        return any(f.seconds is None and f.takes(rank, msg) for f in self.faults)

    def _delay(self, rank: int, msg: P.Message) -> float:
        return sum(f.seconds for f in self.faults if f.seconds is not None and f.takes(rank, msg))

    def _kill_running(self) -> None:
        for fr in self._ranks.values():
            if not fr.finished and not fr.killed:
                fr.kill(-9)

    # --- faults ------------------------------------------------------------------

    def kill(self, rank: int, code: int = -9) -> None:
        """Rank ``rank``'s process dies now (``-9``: SIGKILL; ``>= 0``: it
        exited without a goodbye); its pending call raises ``RankKilled``."""
        self.rank(rank).kill(code)

    def drop(self, predicate: Callable[[P.Message], bool], *, rank: int | None = None,
             times: int | None = None) -> Fault:
        """Lose the messages ``predicate`` takes (on ``rank``'s connection, or anyone's)."""
        fault = Fault(predicate, rank, None, times)
        self.faults.append(fault)
        return fault

    def delay(self, predicate: Callable[[P.Message], bool], seconds: float, *, rank: int | None = None,
              times: int | None = None) -> Fault:
        """Hold back the messages ``predicate`` takes by ``seconds`` (later
        messages on that connection wait behind them, as on ZeroMQ)."""
        if seconds < 0:
            raise ValueError(f"delay: seconds must be >= 0, got {seconds}")
        fault = Fault(predicate, rank, float(seconds), times)
        self.faults.append(fault)
        return fault

    # --- running -------------------------------------------------------------------

    async def _serve(self) -> None:
        try:
            self._result = await self.coordinator.run()
        finally:
            self._done.set()

    async def result(self) -> CaptureResult:
        """Wait for the coordinator to end; how it ended."""
        await self._done.wait()
        if self._result is None:
            raise RuntimeError("the coordinator ended without a result (it raised or was cancelled)")
        return self._result

    async def _rank_main(self, r: int, script: Script, init: bool, finish: bool) -> None:
        fr = self.rank(r)
        try:
            if init:
                await fr.init()
            self.outcomes.returns[r] = await script(fr)
            if finish:
                await fr.finish()
            self.processes.exit(r, 0)
        except RankStopped as e:
            # As a real rank's script would, it stops in the call; the
            # coordinator kills it after its grace period.
            self.outcomes.stopped[r] = e
        except RankKilled:
            pass
        except Exception as e:  # the test's script raised: report it as a rank's error, then re-raise
            self.outcomes.errors[r] = e
            with contextlib.suppress(RankKilled, RankStopped):
                if not fr.killed and not fr.finished:
                    await fr.fail("".join(traceback.format_exception(e)))
            self.processes.exit(r, 1)

    async def run(self, script: Script | Mapping[int, Script], *, init: bool = True, finish: bool = True,
                  timeout_s: float = 600.0) -> CaptureResult:
        """Run ``script(rank)`` as every rank (or ``{rank: script}`` for
        some: the others never start) and return the coordinator's result.

        Each rank runs ``init()`` first and ``finish()`` after (unless told
        not to). A call the coordinator stops raises ``RankStopped`` in the
        script, which ends that rank (``world.outcomes.stopped``); what a
        script returns is in ``world.outcomes.returns``. Any other exception
        of a script is reported to the coordinator as that rank's error and
        raised here once the run ended. ``timeout_s`` (virtual under
        ``autojump_clock``) bounds the whole run.
        """
        if self._ran:
            raise RuntimeError("an emulated world runs one capture; open another emulated_world")
        self._ran = True
        scripts = dict(script) if isinstance(script, Mapping) else {r: script for r in range(self.world_size)}
        with trio.fail_after(timeout_s):
            async with trio.open_nursery() as nursery:
                for r, fn in sorted(scripts.items()):
                    self.rank(r)  # raises for a rank outside the world
                    nursery.start_soon(self._rank_main, r, fn, init, finish)
                result = await self.result()
                # Ranks still running once the coordinator ended (one that
                # never registered, say) are processes that outlived it.
                nursery.cancel_scope.cancel()
        errors = list(self.outcomes.errors.values())
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup(f"{len(errors)} rank scripts raised", errors)
        return result

    async def run_script(self, scripts: Mapping[int, Iterable[Any]], **kw: Any) -> CaptureResult:
        """``run`` with declarative scripts: ``{rank: [Op("all_reduce", (1024,)), Op("step"), ...]}``."""
        def script_of(ops: list[Any]) -> Script:
            async def script(rank: FakeRank) -> list[Any]:
                return [await op.apply(rank) for op in ops]
            return script

        return await self.run({r: script_of(list(ops)) for r, ops in scripts.items()}, **kw)

    # --- reading back --------------------------------------------------------------

    def trace(self) -> Trace:
        """The run folder read back (after the run ended)."""
        if not self._done.is_set():
            raise RuntimeError("the trace is complete only once the run ended: await world.run(...) first")
        return Trace(runfolder.read_run(self.run_dir))


@dataclass(frozen=True)
class Op:
    """One step of a declarative script: ``FakeRank``'s method ``name``
    called with ``args``/``kwargs``, e.g. ``Op("all_reduce", (1024,))``,
    ``Op("barrier")``, ``Op("die")``."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
        if not callable(getattr(FakeRank, name, None)) or name.startswith("_"):
            raise ValueError(f"Op({name!r}): FakeRank has no such call")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "kwargs", tuple(kwargs.items()))

    async def apply(self, rank: FakeRank) -> Any:
        out = getattr(rank, self.name)(*self.args, **dict(self.kwargs))
        return await out if hasattr(out, "__await__") else out


def _manifest(run_dir: Path, world_size: int) -> T.Manifest:
    return T.Manifest(T.TRACE_VERSION, run_dir.name, world_size, time.time_ns(), ("prism.testing",), "cpu",
                      prism.__version__, "none", socket.gethostname(), notes=(("emulated_world", "prism.testing"),))


@contextlib.asynccontextmanager
async def emulated_world(world_size: int, run_dir: str | os.PathLike[str], **kw: Any) -> AsyncIterator[EmulatedWorld]:
    """``async with emulated_world(4, tmp_path) as world:`` the coordinator
    serving ``world_size`` fake ranks into ``run_dir`` (see the module
    docstring). Keywords: ``slots`` (default: one per rank), ``quiet_s``
    (deadlock report), ``grace_s``, ``register_stall_s``, ``codec``, and any
    other ``Coordinator`` keyword. Leaving the block stops the coordinator
    if it still runs."""
    world = EmulatedWorld(world_size, run_dir, **kw)
    runfolder.write_manifest(world.run_dir, _manifest(world.run_dir, world_size))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(world._serve)
            try:
                yield world
            finally:
                if not world._done.is_set():
                    nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The nursery wraps what the test's block raised: hand a lone
        # exception (a failed assert) back as itself.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
