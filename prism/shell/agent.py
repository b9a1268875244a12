"""``prism agent`` and the coordinator's handle on agents.

``AgentProcesses`` is the coordinator's side (a capture's or an
emulation's): a ROUTER socket (CURVE unless ``insecure``) where ``prism
agent`` processes say hello, a thread that owns it, and the coordinator's
``Processes`` protocol over the ranks the agents run (``poll`` from their
``Exits``, ``kill_all`` as ``KillAll``, ``peak_rss`` as they report it). A
capture places the whole world; an emulation only its sandbox ranks. An agent
whose beats stop for ``LOST_AFTER_S`` (its node died, its process was
killed) is *lost*: ``lost()`` names it and its ranks, which count as killed,
so the coordinator stops the run with that report instead of waiting out a
deadlock's quiet period. ``AgentSwapper`` is the coordinator's ``Swapper``
for a capture that swaps ranks on GPUs through agents: each swap goes to
the agent running the rank (``AgentProcesses.swap``).

``run_agent`` is the node side: connect, say hello, wait for a ``Launch``,
start the assigned ranks with this node's own fork server
(``prism.shell.launcher.launch_ranks``), report their exits and beat until
they have all ended; a ``KillAll``, or a coordinator silent for
``LOST_AFTER_S``, kills them. An agent serves ``runs`` runs (0: until it is
stopped): after each it connects again to the same address, where the next
run's coordinator (a new process, or the next slice of a calibration)
binds once the last one has closed; a coordinator still busy with its run
refuses it with ``retry`` and it tries again. A coordinator that closes
as an agent joins it takes the agent's hello with it, or cuts its
handshake; ZeroMQ would reconnect the socket to the next coordinator
without saying hello there, so before its ``Launch`` an agent whose
connection drops (or whose handshake fails without detail, fewer than
``transport.curve.HANDSHAKE_TRIES`` times in a row) starts over on a new socket with a new
hello. A run may have nothing for
an agent (an empty ``Launch``: fewer sandbox TP groups than agents). A
``Launch`` with ``swap`` makes the agent load that swap driver first
(``Prepared`` "swaps") and carry out each ``Swap`` of its ranks in a worker
thread, answering ``Swapped``.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import zmq

from prism.core import agents as A
from prism.rank.envnames import GPU_SANDBOX_ENV
from prism.shell.swap import SwapError, SwapLog, SwapRecord

__all__ = ["AgentError", "AgentInterrupted", "AgentProcesses", "AgentSwapper", "AgentConfig", "AgentOutcome",
           "run_agent"]

_POLL_MS = 50


class AgentError(Exception):
    """An agent or the agents' coordinator cannot go on (a refused handshake,
    missing agents, a bad endpoint): the message says what to do."""


@dataclass
class _Peer:
    identity: bytes
    hello: A.AgentHello
    ranks: list[int] = field(default_factory=list)
    last_seen: float = 0.0
    lost: bool = False

    def describe(self) -> str:
        return f"agent {self.hello.node} (host {self.hello.host}, pid {self.hello.pid}, ranks {A.rank_span(self.ranks)})"


class AgentProcesses:
    """Listen on ``endpoint`` for ``agents`` agents of a world of ``world_size``.

    ``wait_agents`` blocks until all have said hello; ``place`` puts the
    world (or, for an emulation, some of its ranks) on them and
    ``launch(...)`` sends each agent its ``Launch``; then it is the
    coordinator's ``Processes``: ``poll()`` has an entry per rank of the
    world, None for a rank that runs or was not placed. ``keys``: a ``prism
    keys`` directory (CURVE); ``insecure`` allows plaintext tcp (a private
    network only)."""

    def __init__(self, endpoint: str, agents: int, world_size: int, *, keys: str | os.PathLike[str] | None,
                 insecure: bool = False, lost_after_s: float = A.LOST_AFTER_S) -> None:
        from transport.endpoints import UnsafeEndpointError, check_listen_endpoint

        if keys is None and not insecure:
            raise AgentError("agents connect over tcp with CURVE: pass --keys DIR (made by `prism keys DIR`), or "
                             "--insecure on a private network")
        if not endpoint.startswith("tcp://"):
            raise AgentError(f"--listen {endpoint}: agents on other nodes need a tcp://HOST:PORT address")
        try:
            check_listen_endpoint(endpoint, authenticated=True)
        except UnsafeEndpointError as e:
            raise AgentError(str(e)) from None
        self.agents = agents
        self.world_size = world_size
        self.keys = Path(keys).resolve() if keys is not None else None
        self.insecure = insecure
        self.lost_after_s = lost_after_s
        self.returncodes: list[int | None] = [None] * world_size
        #: rank -> its process's peak resident memory (bytes), as its agent reported at its exit
        self.peak_rss: dict[int, int] = {}
        #: node -> its ``Prepared.kernels`` (device-path sandboxes: cuda_ext as checked on that node)
        self.kernels: dict[str, dict] = {}
        #: node -> its swap driver as it checked it (``Prepared`` stage "swaps")
        self.swap_drivers: dict[str, dict] = {}
        #: ``Swap`` token -> its ``Swapped`` answer (None while awaited)
        self._swaps: dict[int, A.Swapped | None] = {}
        self._next_token = 0
        self._peers: dict[bytes, _Peer] = {}
        #: Whether ``launch`` sent the Launches (``close`` refuses agents otherwise).
        self._launched = False
        self._cond = threading.Condition()
        self._outbox: queue.SimpleQueue[tuple[bytes, dict]] = queue.SimpleQueue()
        #: A byte here wakes the socket's thread for the outbox (a swap waits
        #: for its round trip; the poll's timeout would add up to ``_POLL_MS``).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lost_text = ""
        #: How the run ends for that report: "swap_failed" (an agent could not load its swap driver) or "node_lost".
        self._lost_status = "node_lost"
        self._stop = threading.Event()
        self._refused: list[str] = []
        ctx = zmq.Context.instance()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.linger = 1000
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._auth = None
        try:
            if self.keys is not None:
                from transport.curve import CurveKeyError, serve_curve

                try:
                    self._auth = serve_curve(self._sock, self.keys, ctx, "prism.shell.agent.zap")
                except CurveKeyError as e:
                    raise AgentError(str(e)) from None
            # The last run's coordinator (a calibration's previous slice) may
            # have closed this address a moment ago: ZeroMQ frees it a little later.
            bind_by = time.monotonic() + 3.0
            while True:
                try:
                    self._sock.bind(endpoint)
                    break
                except zmq.ZMQError as e:
                    if e.errno == zmq.EADDRINUSE and time.monotonic() < bind_by:
                        time.sleep(0.05)
                        continue
                    raise AgentError(f"cannot listen for agents on {endpoint}: {e}") from None
        except BaseException:
            self._close_socket()
            raise
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._serve, name="prism-agents", daemon=True)
        self._thread.start()

    # --- the socket's thread -----------------------------------------------------

    def _post(self, identity: bytes, msg: object) -> None:
        """Queue ``msg`` for an agent (any thread) and wake the socket's thread."""
        self._outbox.put((identity, A.encode(msg)))
        if (fd := self._wake_w) >= 0:
            try:
                os.write(fd, b"x")
            except OSError:
                pass  # a wake-up is pending already (a full pipe) or the handle just closed

    def _send(self, identity: bytes, msg: object) -> None:
        try:
            self._sock.send_multipart([identity, orjson.dumps(A.encode(msg))], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the agent is gone; its beats tell

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last_beat = 0.0
        while not self._stop.is_set():
            ready = dict(poller.poll(_POLL_MS))
            if self._wake_r in ready:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            if self._sock in ready:
                while True:
                    try:
                        identity, data = self._sock.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except ValueError:
                        continue
                    self._on_message(identity, data)
            while True:
                try:
                    identity, out = self._outbox.get_nowait()
                except queue.Empty:
                    break
                try:
                    self._sock.send_multipart([identity, orjson.dumps(out)], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the agent is gone; its beats tell
            now = time.monotonic()
            if now - last_beat >= A.BEAT_S:
                last_beat = now
                for peer in list(self._peers.values()):
                    if not peer.lost:
                        self._send(peer.identity, A.CoordinatorBeat())
            self._check_lost(now)

    def _on_message(self, identity: bytes, data: bytes) -> None:
        try:
            msg = A.decode(orjson.loads(data))
        except (orjson.JSONDecodeError, A.AgentProtocolError) as e:
            with self._cond:
                self._refused.append(f"an agent sent a message this coordinator cannot read: {e}")
            self._send(identity, A.Refused(str(e)))
            return
        with self._cond:
            peer = self._peers.get(identity)
            if isinstance(msg, A.AgentHello):
                if len(self._peers) >= self.agents:
                    self._send(identity, A.Refused(f"this run has its {self.agents} agents already", retry=True))
                    return
                self._peers[identity] = _Peer(identity, msg, last_seen=time.monotonic())
                self._cond.notify_all()
                return
            if peer is None:
                self._send(identity, A.Refused("say AgentHello first"))
                return
            peer.last_seen = time.monotonic()
            if isinstance(msg, A.Exits):
                for rank, code in msg.codes.items():
                    if rank in peer.ranks and self.returncodes[rank] is None:
                        self.returncodes[rank] = code
                        if rank in msg.rss:
                            self.peak_rss[rank] = msg.rss[rank]
                self._cond.notify_all()
            elif isinstance(msg, A.Prepared):
                if msg.error:
                    if not self._lost_text:
                        what = "its ranks (it cannot swap them)" if msg.stage == "swaps" else \
                            "its device-path sandboxes"
                        self._lost_text = f"{peer.describe()} could not start {what}: {msg.error} (on that node)"
                        if msg.stage == "swaps":
                            self._lost_status = "swap_failed"
                    for r in peer.ranks:
                        if self.returncodes[r] is None:
                            self.returncodes[r] = 1
                elif msg.stage == "swaps":
                    self.swap_drivers[peer.hello.node] = dict(msg.kernels)
                else:
                    self.kernels[peer.hello.node] = dict(msg.kernels)
                self._cond.notify_all()
            elif isinstance(msg, A.Swapped):
                if msg.token in self._swaps and self._swaps[msg.token] is None:
                    self._swaps[msg.token] = msg
                    self._cond.notify_all()

    def _check_lost(self, now: float) -> None:
        with self._cond:
            for peer in self._peers.values():
                if peer.lost or not peer.ranks or all(self.returncodes[r] is not None for r in peer.ranks):
                    continue
                if now - peer.last_seen > self.lost_after_s:
                    peer.lost = True
                    if not self._lost_text:
                        self._lost_text = (f"{peer.describe()} lost: no word from it for {self.lost_after_s:g} s "
                                           "(its node died or its process was killed); its ranks count as killed")
                    for r in peer.ranks:
                        if self.returncodes[r] is None:
                            self.returncodes[r] = -9
                    self._cond.notify_all()

    # --- the capture's side ------------------------------------------------------------

    def wait_agents(self, timeout_s: float) -> list[A.AgentHello]:
        """Block until every agent said hello (sorted by node rank, then host
        and pid); ``AgentError`` naming how many came after ``timeout_s``."""
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self._peers) >= self.agents, timeout_s)
            if not ok:
                seen = ", ".join(p.hello.node for p in self._peers.values()) or "none"
                extra = f"; {self._refused[0]}" if self._refused else ""
                raise AgentError(f"{len(self._peers)} of {self.agents} agents joined {self.endpoint} within "
                                 f"{timeout_s:g} s (joined: {seen}){extra}: start `python -m prism agent "
                                 f"--coordinator {self.endpoint} --keys DIR` on each node")
            return [p.hello for p in self._ordered()]

    def _ordered(self) -> list[_Peer]:
        return sorted(self._peers.values(), key=lambda p: (p.hello.node_rank, p.hello.host, p.hello.pid))

    def place(self, gang: int = 1, ranks: Sequence[int] | None = None,
              blocks: Sequence[Sequence[int]] | None = None) -> list[tuple[A.AgentHello, list[int]]]:
        """Place the world (``assign_blocks``) or only ``ranks`` of it (an
        emulation's sandbox: ``place_ranks``) on the agents, in node order,
        whole gangs on one agent: each agent and its ranks. ``blocks`` (with
        ``ranks``) gives the placement instead: ``blocks[i]`` on the ``i``-th
        agent (``check_placement``)."""
        peers = self._ordered()
        if ranks is None:
            blocks = A.assign_blocks(self.world_size, len(peers), gang)
        else:
            bad = [r for r in ranks if not 0 <= r < self.world_size]
            if bad:
                raise ValueError(f"ranks {bad} are not in the world of {self.world_size}")
            blocks = (A.place_ranks(ranks, len(peers), gang) if blocks is None
                      else A.check_placement(blocks, ranks, len(peers)))
        with self._cond:
            for peer, block in zip(peers, blocks):
                peer.ranks = block
                peer.last_seen = time.monotonic()
        return self.placement()

    def node_slots(self, gpus: bool = False) -> tuple[dict[int, int], list[int]]:
        """``(rank -> node index, each node's slots)`` of the placement, for
        the coordinator's scheduler: a node computes only on its own cores
        (``gpus``: a CUDA run, one rank computing per GPU of the node)."""
        placed = self.placement()
        nodes = {r: i for i, (_, ranks) in enumerate(placed) for r in ranks}
        return nodes, [max(len(h.gpus), 1) if gpus else h.slots for h, _ in placed]

    def launch(self, rank_endpoint: str, run_dir: str | os.PathLike[str], command: Sequence[str], *,
               nproc_per_node: int = 8, show_ranks: Sequence[int] = (),
               env: dict[str, str] | None = None, cwd: str | None = None,
               env_of: Callable[[A.AgentHello, list[int]], dict[str, str]] | None = None,
               swap: dict | None = None) -> AgentProcesses:
        """Send each agent its ``Launch`` (after ``place``); ``env_of(hello,
        ranks)``: more environment for one node's ranks (its GPUs); ``swap``:
        the swap driver (``Launch.swap``) when the capture swaps ranks on GPUs."""
        self._launched = True
        for peer in self._ordered():
            block = peer.ranks
            with self._cond:
                peer.last_seen = time.monotonic()
            node_env = {**(env or {}), **(env_of(peer.hello, list(block)) if env_of is not None and block else {})}
            msg = A.Launch(tuple(block), self.world_size, rank_endpoint, os.path.abspath(os.fspath(run_dir)),
                           tuple(command), cwd or os.getcwd(), nproc_per_node, node_env,
                           tuple(int(r) for r in show_ranks), self.insecure, dict(swap or {}))
            self._post(peer.identity, msg)
        return self

    def swap(self, rank: int, pid: int, direction: str, step: int = -1,
             timeout_s: float = 600.0) -> tuple[A.AgentHello, A.Swapped]:
        """Ask the agent that runs ``rank`` to swap its process ``pid``
        ``direction`` ("out"/"in") and wait for the answer: that agent and its
        ``Swapped`` (which may carry the agent's ``error``). ``SwapError``
        naming the agent, the rank and the direction when the agent is lost
        meanwhile, ends its run without answering, or does not answer within
        ``timeout_s``; blocks (call it from a worker thread)."""
        with self._cond:
            peer = next((p for p in self._peers.values() if rank in p.ranks), None)
            if peer is None:
                raise SwapError(f"rank {rank} is placed on no agent: cannot swap it {direction}; please report this")
            what = f"swapping rank {rank} (pid {pid}) {direction} at step {step} on {peer.describe()}"
            if peer.lost:
                raise SwapError(f"{what} failed: the agent is lost. {self._lost_text}")
            token = self._next_token
            self._next_token += 1
            self._swaps[token] = None
            self._post(peer.identity, A.Swap(token, rank, pid, direction, step))
            deadline = time.monotonic() + timeout_s
            ended_at = None
            try:
                while (answer := self._swaps[token]) is None:
                    now = time.monotonic()
                    if peer.lost:
                        raise SwapError(f"{what} failed: the agent was lost before it answered (no word from it "
                                        f"for {self.lost_after_s:g} s: its node died or its process was killed); "
                                        "the capture stops")
                    if self._stop.is_set():
                        raise SwapError(f"{what} failed: the run's connection to its agents closed before it "
                                        "answered")
                    if all(self.returncodes[r] is not None for r in peer.ranks):
                        # Its run ended there: it answers what it took on before it leaves.
                        ended_at = ended_at or now
                        if now - ended_at > self.lost_after_s:
                            raise SwapError(f"{what} failed: every rank of that agent ended and it never answered")
                    if now > deadline:
                        raise SwapError(f"{what} failed: no answer within {timeout_s:g} s although the agent "
                                        "still beats (the driver's call hangs on that node); the capture stops")
                    self._cond.wait(timeout=min(0.5, max(deadline - now, 0.01)))
            finally:
                del self._swaps[token]
            return peer.hello, answer

    def placement(self) -> list[tuple[A.AgentHello, list[int]]]:
        """Each agent and its ranks."""
        with self._cond:
            return [(p.hello, list(p.ranks)) for p in self._ordered()]

    # --- Processes ------------------------------------------------------------------

    def poll(self) -> list[int | None]:
        with self._cond:
            return list(self.returncodes)

    def lost(self) -> str:
        """The report of the first agent lost ("" while none is)."""
        with self._cond:
            return self._lost_text

    def lost_status(self) -> str:
        """The run's status for ``lost()``'s report: "swap_failed" where an
        agent could not load its swap driver, else "node_lost"."""
        with self._cond:
            return self._lost_status

    def kill_all(self) -> None:
        for peer in self._ordered():
            if not peer.lost:
                self._post(peer.identity, A.KillAll("the coordinator stops the run"))

    def _placed(self) -> list[int]:
        return [r for p in self._peers.values() for r in p.ranks]

    def running(self) -> list[int]:
        """The placed ranks whose exit is not known yet."""
        with self._cond:
            return [r for r in self._placed() if self.returncodes[r] is None]

    def wait(self, timeout: float | None = None) -> list[int | None]:
        """Wait until every placed rank exited (or ``timeout``); ``poll()``."""
        with self._cond:
            self._cond.wait_for(lambda: all(self.returncodes[r] is not None for r in self._placed()), timeout)
        return self.poll()

    def close(self, reason: str = "the run ended before it launched any rank") -> None:
        """Kill what still runs, wait for the agents' last exits (a lost agent's
        ranks count as killed after ``lost_after_s``) and close the socket.
        Before ``launch``, the agents are refused with ``reason`` instead."""
        with self._cond:
            launched = self._launched and any(p.ranks for p in self._peers.values())
        if not launched:
            for peer in self._ordered():
                self._post(peer.identity, A.Refused(reason, retry=True))
            time.sleep(3 * _POLL_MS / 1000)
        elif self.running():
            self.kill_all()
            self.wait(timeout=self.lost_after_s + 10)
        self._stop.set()
        self._thread.join(timeout=5)
        self._close_socket()

    def _close_socket(self) -> None:
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        self._sock.close(linger=500)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class AgentSwapper(SwapLog):
    """The coordinator's ``Swapper`` for ranks served by agents: each swap
    goes to the agent that runs the rank (``AgentProcesses.swap``), which
    carries it out with its node's ``prism.shell.swap.SwapExecutor`` and
    answers with the record. ``records``: a ``SwapRecord`` per swap, with
    ``t_start`` on the coordinator's clock (seconds of CLOCK_MONOTONIC, as
    the one-machine executor's ``perf_counter``): the agent's time plus
    ``offset_of(rank)``, the rank's clock offset in ns (``RankSession``'s:
    0 on one host; the rank runs on the agent's node, so its offset is that
    node's). A swap the agent could not carry out, or an agent lost while
    it swaps, raises ``SwapError`` naming the agent, the rank and the
    direction; the coordinator stops the capture with it. Each record is
    appended to ``log`` as it comes (``RUN/telemetry/swaps.jsonl``)."""

    def __init__(self, agents: AgentProcesses, *, log: str | os.PathLike[str] | None = None,
                 timeout_s: float = 600.0) -> None:
        super().__init__(log)
        self.agents = agents
        self.timeout_s = timeout_s
        self.offset_of: Callable[[int], int] = lambda rank: 0

    def swap_out(self, rank: int, pid: int, step: int = -1):
        return self._swap(rank, pid, "out", step)

    def swap_in(self, rank: int, pid: int, step: int = -1):
        return self._swap(rank, pid, "in", step)

    def _swap(self, rank: int, pid: int, direction: str, step: int):
        hello, answer = self.agents.swap(rank, pid, direction, step, self.timeout_s)
        if answer.error:
            raise SwapError(f"agent {hello.node} (host {hello.host}, pid {hello.pid}) could not swap rank {rank} "
                            f"{direction}: {answer.error}")
        rec = SwapRecord(rank, pid, direction, answer.status, answer.t_start + self.offset_of(rank) / 1e9,
                         answer.seconds, answer.bytes, step)
        return self._record(rec)


# --- the node's side -------------------------------------------------------------------


@dataclass(frozen=True)
class AgentConfig:
    """``prism agent``'s options: where the coordinator listens, the keys
    (None only with ``insecure``), this node's name and rank, its slots."""

    coordinator: str
    keys: str | os.PathLike[str] | None = None
    insecure: bool = False
    node: str = ""
    node_rank: int = -1
    slots: int | None = None
    gpus: tuple[int, ...] = ()
    #: How long to wait for the coordinator's Launch (an error only when
    #: this is the agent's last run to serve; otherwise a note, and it waits on).
    wait_s: float = 120.0
    #: Runs to serve, one after another (0: until stopped).
    runs: int = 1


@dataclass
class AgentOutcome:
    """What an agent ran: its ranks and their exit codes over all the runs it
    served (``runs``), and why it stopped early ("" if it did not)."""

    ranks: list[int]
    codes: dict[int, int]
    stopped: str = ""
    runs: int = 1
    failed: int = 0

    @property
    def ok(self) -> bool:
        return not self.stopped and not self.failed and all(c == 0 for c in self.codes.values())


class AgentInterrupted(KeyboardInterrupt):
    """SIGINT (or SIGTERM, which ``prism agent`` turns into it) stopped the
    agent; ``killed``: the ranks it was running, killed and reaped on the way out."""

    def __init__(self, signal_name: str, killed: list[int]) -> None:
        super().__init__(signal_name)
        self.killed = killed


class _Retry(Exception):
    """The coordinator is busy with a run of its own, or its run ended before
    it launched: connect again, for the next run."""


def run_agent(config: AgentConfig, on_note: Callable[[str], None] = lambda _: None) -> AgentOutcome:
    """Serve ``config.runs`` runs (0: until stopped) of the coordinator at
    ``config.coordinator``; raises ``AgentError`` when it cannot join
    (refused keys; no coordinator within ``wait_s`` for its last run)."""
    if config.runs < 0:
        raise AgentError(f"--runs must be 0 (serve until stopped) or more, got {config.runs}")
    if config.runs == 1:
        return _serve_run(config, on_note, last=True)
    from prism.shell.launcher import warm_forkserver

    with warm_forkserver():  # each run's launch forks its fork server from it
        return _serve_runs(config, on_note)


def _serve_runs(config: AgentConfig, on_note: Callable[[str], None]) -> AgentOutcome:
    total = AgentOutcome([], {}, runs=0)
    noted_busy = False
    while config.runs == 0 or total.runs < config.runs:
        last = config.runs and total.runs == config.runs - 1
        try:
            one = _serve_run(config, on_note, last=bool(last))
        except _Retry as e:
            if not noted_busy:
                on_note(f"the coordinator at {config.coordinator} says {e}: waiting for the next run")
                noted_busy = True
            time.sleep(0.3)
            continue
        noted_busy = False
        total.runs += 1
        total.ranks += one.ranks
        total.codes.update(one.codes)
        bad = one.stopped or any(c != 0 for c in one.codes.values())
        total.failed += bool(bad)
        of = f" of {config.runs}" if config.runs else ""
        on_note(f"run {total.runs}{of} ended: {len(one.ranks)} ranks, "
                f"{sum(c != 0 for c in one.codes.values())} failed{'; ' + one.stopped if one.stopped else ''}")
    return total


def _serve_run(config: AgentConfig, on_note: Callable[[str], None], last: bool) -> AgentOutcome:
    """Serve one run; a wait past ``wait_s`` is an ``AgentError`` when
    ``last``, else a note; ``_Retry`` when the coordinator is still busy
    (not ``last`` only: one run's agent is refused as before)."""
    from zmq.utils.monitor import recv_monitor_message

    from transport import curve as C

    if config.keys is None and not config.insecure:
        raise AgentError("pass --keys DIR (the `prism keys DIR` directory, on a shared path) or --insecure on a "
                         "private network")
    keys = Path(config.keys).resolve() if config.keys is not None else None
    ctx = zmq.Context.instance()
    host = socket.gethostname()
    hello = A.AgentHello(config.node or f"{host}:{os.getpid()}", host, config.slots or os.cpu_count() or 1,
                         tuple(config.gpus), os.getpid(), node_rank=config.node_rank)
    sock, mon = _join(ctx, config, keys, hello)
    procs = None
    swaps: _NodeSwaps | None = None
    try:
        send = lambda m: sock.send(orjson.dumps(A.encode(m)))  # noqa: E731
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        launch = None
        deadline = time.monotonic() + config.wait_s
        failed = 0  # handshakes failed without detail in a row
        noted = False
        while launch is None:
            left = deadline - time.monotonic()
            if left <= 0 and not last:
                on_note(f"no coordinator at {config.coordinator} for {config.wait_s:g} s: still waiting for the "
                        "next run")
                deadline = time.monotonic() + config.wait_s
                continue
            if left <= 0:
                raise AgentError(f"no Launch from the coordinator at {config.coordinator} within "
                                 f"{config.wait_s:g} s: is a `prism capture` or `prism emulate` with `--agents N "
                                 f"--listen {config.coordinator}` running?")
            ready = dict(poller.poll(min(int(left * 1000) + 1, 500)))
            again = False
            while mon in ready and mon.poll(0):
                event = recv_monitor_message(mon)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    failed = 0
                    continue
                if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                    # A coordinator closing its socket (the last run's, or a
                    # calibration's last slice) mid-handshake gives this once;
                    # a wrong server key gives it every time.
                    failed += 1
                    if failed >= C.HANDSHAKE_TRIES:
                        raise AgentError(C.handshake_text("the coordinator", config.coordinator, event, keys))
                    again = True
                elif event == zmq.EVENT_DISCONNECTED:
                    # The coordinator closed the connection before its Launch:
                    # our hello, if it went out on it, went with it; ZeroMQ
                    # would reconnect (to the next run's coordinator) but not
                    # say it again.
                    again = True
                elif event & C.HANDSHAKE_FAILED_EVENTS:
                    raise AgentError(C.handshake_text("the coordinator", config.coordinator, event, keys))
                if again:
                    break
            if again:
                if not noted:
                    on_note(f"the coordinator at {config.coordinator} closed the connection before its Launch: "
                            "saying hello again on a new one")
                    noted = True
                poller.unregister(sock)
                poller.unregister(mon)
                _close_join(sock, mon, linger=0)
                sock = mon = None
                time.sleep(0.1)
                sock, mon = _join(ctx, config, keys, hello)
                poller.register(sock, zmq.POLLIN)
                poller.register(mon, zmq.POLLIN)
                continue
            if sock in ready:
                msg = _recv(sock)
                if isinstance(msg, A.Refused) and msg.retry and config.runs != 1:
                    raise _Retry(msg.reason)
                if isinstance(msg, A.Refused):
                    raise AgentError(f"the coordinator at {config.coordinator} refused this agent: {msg.reason}")
                if isinstance(msg, A.Launch):
                    launch = msg
        # The run's connection stays; its monitor is only for joining.
        poller.unregister(mon)
        if not launch.ranks:
            on_note(f"this run (world {launch.world_size}) has no rank for this node")
            return AgentOutcome([], {})
        on_note(f"ranks {A.rank_span(launch.ranks)} of {launch.world_size}: {' '.join(launch.command)}")
        from prism.shell.launcher import launch_ranks

        env = dict(launch.env)
        if keys is not None and not launch.insecure:
            env[C.KEYS_ENV] = str(keys)
        if env.get(GPU_SANDBOX_ENV) == "1" and not _prepare_kernels(env, send, len(launch.ranks), on_note):
            return AgentOutcome(list(launch.ranks), {r: 1 for r in launch.ranks},
                                "cuda_ext's kernels could not be checked on this node")
        if launch.swap:
            swaps = _prepare_swaps(launch.swap, hello.node, send, on_note, ctx)
            if swaps is None:
                return AgentOutcome(list(launch.ranks), {r: 1 for r in launch.ranks},
                                    "the swap driver could not be loaded on this node")
        procs = launch_ranks(launch.world_size, launch.endpoint, launch.run_dir, list(launch.command),
                             nproc_per_node=launch.nproc_per_node, show_ranks=list(launch.show_ranks), env=env,
                             cwd=launch.cwd, ranks=list(launch.ranks))
        if swaps is not None:
            poller.register(swaps.wake, zmq.POLLIN)
        return _watch(sock, poller, procs, list(launch.ranks), send, on_note, swaps)
    except KeyboardInterrupt as e:
        if isinstance(e, AgentInterrupted) or procs is None:
            raise
        raise AgentInterrupted(str(e) or "SIGINT", [r for r in launch.ranks if procs.poll(r) is None]) from None
    finally:
        if procs is not None:
            procs.close()
        if swaps is not None:
            swaps.close()
        if sock is not None:
            _close_join(sock, mon)


def _join(ctx: zmq.Context, config: AgentConfig, keys: Path | None,
          hello: A.AgentHello) -> tuple[zmq.Socket, zmq.Socket]:
    """A new socket to the coordinator, with ``hello`` queued on it, and its
    monitor (handshakes, disconnections)."""
    from transport import curve as C

    sock = ctx.socket(zmq.DEALER)
    sock.linger = 2000
    if keys is not None:
        try:
            C.connect_curve(sock, keys)
        except C.CurveKeyError as e:
            sock.close(linger=0)
            raise AgentError(str(e)) from None
    mon = sock.get_monitor_socket(C.HANDSHAKE_FAILED_EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(config.coordinator)
    except zmq.ZMQError as e:
        _close_join(sock, mon, linger=0)
        raise AgentError(f"cannot connect to {config.coordinator}: {e}") from None
    sock.send(orjson.dumps(A.encode(hello)))
    return sock, mon


def _close_join(sock: zmq.Socket, mon: zmq.Socket, linger: int | None = None) -> None:
    sock.disable_monitor()
    mon.close(linger=0)
    sock.close(linger=linger)


def _prepare_kernels(env: dict[str, str], send: Callable[[object], None], ranks: int,
                     on_note: Callable[[str], None]) -> bool:
    """Device-path sandboxes on this node: build or load cuda_ext's kernels
    here first (``prism.shell.kernels``), beating while a build runs, and
    tell the coordinator (``Prepared``). False when the check failed."""
    from prism.shell.kernels import KernelCheckError, check_kernels, describe

    try:
        info = check_kernels(env, tick=lambda: send(A.AgentBeat(ranks)), tick_s=A.BEAT_S)
    except KernelCheckError as e:
        on_note(f"--device-path: {e}")
        send(A.Prepared({}, str(e)))
        return False
    if (line := describe(info)) is not None:
        on_note(line)
    send(A.Prepared(info))
    return True


def _prepare_swaps(spec: dict, node: str, send: Callable[[object], None], on_note: Callable[[str], None],
                   ctx: zmq.Context) -> _NodeSwaps | None:
    """A capture that swaps ranks on GPUs (``Launch.swap``): load its driver
    on this node and tell the coordinator (``Prepared`` "swaps"); None (the
    error sent) when it cannot load."""
    from prism.shell import swap, telemetry

    try:
        driver_name, delay_s = A.swap_spec(spec)
        t0 = time.monotonic()
        driver = swap.SimulatedDriver(delay_s) if driver_name == "simulated" else swap.CheckpointDriver()
    except (ValueError, swap.SwapError) as e:
        what = ("GPU swapping (--resident) needs the CUDA driver's checkpoint API on every node that runs ranks: "
                "update that node's NVIDIA driver (570 or newer), or capture with --simulate-swaps on CPU")
        text = f"cannot swap ranks on node {node}: {e}; {what}"
        on_note(text)
        send(A.Prepared({}, text, stage="swaps"))
        return None
    info = {"driver": driver_name, "delay_s": delay_s, "checked_s": round(time.monotonic() - t0, 6)}
    on_note(f"swapping this node's ranks with the {driver_name} driver"
            + (f" ({delay_s:g} s per swap)" if driver_name == "simulated" else ""))
    send(A.Prepared(info, stage="swaps"))
    # Times on CLOCK_MONOTONIC, the clock the ranks stamp: the coordinator
    # maps them with this node's clock offset.
    executor = swap.SwapExecutor(driver, memory_of=telemetry.process_memory, clock=time.monotonic)
    return _NodeSwaps(executor, ctx)


class _NodeSwaps:
    """This node's swaps: a worker thread carries out each ``Swap`` with the
    executor (a checkpoint blocks for up to seconds, and the agent must keep
    beating meanwhile) and queues the ``Swapped`` answers for the agent's
    loop, which owns the socket to the coordinator; the worker wakes that
    loop through an inproc socket (``wake``, in its poller)."""

    def __init__(self, executor: object, ctx: zmq.Context) -> None:
        self.executor = executor
        self._ctx = ctx
        self._jobs: queue.SimpleQueue[A.Swap | None] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[A.Swapped] = queue.SimpleQueue()
        self._addr = f"inproc://prism-agent-swaps-{os.getpid()}-{id(self)}"
        self.wake = ctx.socket(zmq.PULL)
        self.wake.linger = 0
        self.wake.bind(self._addr)
        self.pending = 0
        self._thread = threading.Thread(target=self._work, name="prism-agent-swaps", daemon=True)
        self._thread.start()

    def submit(self, msg: A.Swap) -> None:
        self.pending += 1
        self._jobs.put(msg)

    def _work(self) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.linger = 0
        push.connect(self._addr)
        try:
            while (job := self._jobs.get()) is not None:
                fn = self.executor.swap_out if job.direction == "out" else self.executor.swap_in
                try:
                    rec = fn(job.rank, job.pid, job.step)
                    answer = A.Swapped(job.token, rec.status, rec.t_start, rec.seconds, rec.bytes)
                except Exception as e:  # SwapError names the rank, pid and step; anything else too
                    answer = A.Swapped(job.token, error=str(e) or type(e).__name__)
                self._answers.put(answer)
                try:
                    push.send(b"", flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the loop polls the answers anyway
        finally:
            push.close()

    def answers(self) -> list[A.Swapped]:
        """The answers ready (clearing the wake-ups)."""
        while True:
            try:
                self.wake.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
        out = []
        while True:
            try:
                out.append(self._answers.get_nowait())
            except queue.Empty:
                break
        self.pending -= len(out)
        return out

    def finish(self, timeout_s: float) -> list[A.Swapped]:
        """Let the swaps submitted end (within ``timeout_s``): their answers."""
        self._jobs.put(None)
        self._thread.join(timeout=timeout_s)
        return self.answers()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self.wake.close(linger=0)


def _swap_refusal(msg: A.Swap, ranks: list[int], procs) -> str:
    """Why this node does not carry out ``msg`` ("" when it does)."""
    if msg.rank not in ranks:
        return (f"rank {msg.rank} does not run on this node (its ranks are {A.rank_span(ranks)}): "
                "the coordinator sent its swap to the wrong agent; please report this")
    code = procs.poll(msg.rank)
    if code is not None:
        return f"rank {msg.rank} (pid {msg.pid}) already exited (status {code}) when it was to be swapped {msg.direction}"
    return ""


def _recv(sock: zmq.Socket) -> object:
    try:
        return A.decode(orjson.loads(sock.recv()))
    except (orjson.JSONDecodeError, A.AgentProtocolError) as e:
        raise AgentError(f"the coordinator sent a message this agent cannot read: {e}") from None


def _watch(sock: zmq.Socket, poller: zmq.Poller, procs, ranks: list[int], send, on_note,
           swaps: _NodeSwaps | None = None) -> AgentOutcome:
    """Report exits and beat until every rank ended; obey ``KillAll``; kill the
    ranks when the coordinator falls silent; carry out ``Swap`` (in
    ``swaps``' worker thread) and answer ``Swapped``."""
    codes: dict[int, int] = {}
    stopped = ""
    last_beat = 0.0
    heard = time.monotonic()
    while len(codes) < len(ranks):
        ready = dict(poller.poll(_POLL_MS * 2))
        if swaps is not None and (swaps.wake in ready or swaps.pending):
            for answer in swaps.answers():
                send(answer)
        if sock in ready:
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                msg = _recv(sock)
                heard = time.monotonic()
                if isinstance(msg, A.KillAll) and not stopped:
                    stopped = f"killed by the coordinator: {msg.reason}"
                    procs.kill_all()
                elif isinstance(msg, A.Swap):
                    why = ("this capture's Launch named no swap driver; please report this" if swaps is None
                           else _swap_refusal(msg, ranks, procs))
                    if why:
                        send(A.Swapped(msg.token, error=why))
                    else:
                        swaps.submit(msg)
        now = time.monotonic()
        if now - heard > A.LOST_AFTER_S and not stopped:
            stopped = f"the coordinator fell silent for {A.LOST_AFTER_S:g} s: killing this node's ranks"
            on_note(stopped)
            procs.kill_all()
        new = {r: c for r in ranks if r not in codes and (c := procs.poll(r)) is not None}
        if new:
            codes.update(new)
            rss = getattr(procs, "peak_rss", {})
            send(A.Exits(new, {r: rss[r] for r in new if r in rss}))
        if now - last_beat >= A.BEAT_S:
            last_beat = now
            send(A.AgentBeat(len(ranks) - len(codes)))
    if swaps is not None and swaps.pending:
        # A swap the coordinator waits for: answer it before leaving.
        for answer in swaps.finish(timeout_s=A.LOST_AFTER_S):
            send(answer)
    return AgentOutcome(ranks, codes, stopped)
