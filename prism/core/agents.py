"""Agents: one ``prism agent`` per node serves a capture's or an emulation's coordinator
(sans-IO: the messages, the placement of ranks on agents, and discovery from
a launcher's environment).

An agent says ``AgentHello`` (its node, host, slots, GPUs, pid, protocol
version); once the coordinator has every agent it expects it sends each a
``Launch`` with its block of ranks (for device-path sandboxes it first
checks cuda_ext's kernels on its node and says ``Prepared``, beating while
a build runs; protocol 2). The agent starts them with its own fork
server and reports ``Exits`` as they end, with an ``AgentBeat`` every
``BEAT_S``; the coordinator beats back (``CoordinatorBeat``) and may send
``KillAll``. A capture that swaps ranks on GPUs (``--resident``) names the
driver in its ``Launch`` (``swap``); the agent checks it loads on its node
(``Prepared`` with ``stage`` "swaps"), then carries out each ``Swap`` of one
of its ranks and answers ``Swapped`` (protocol 3). Messages are plain dicts (``encode``/``decode``; the shell
serialises them with orjson) tagged ``"t"`` and carrying ``"v"``: another
version is refused at the hello with both versions named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["AGENT_PROTOCOL_VERSION", "BEAT_S", "AgentProtocolError", "AgentHello", "Launch", "Exits",
           "Prepared", "Swap", "Swapped", "AgentBeat", "CoordinatorBeat", "KillAll", "Refused", "encode", "decode",
           "SWAP_DRIVERS", "swap_spec", "node_gpu_of", "assign_blocks",
           "place_ranks", "check_placement",
           "Discovery", "discover", "expand_nodelist", "rank_span"]

AGENT_PROTOCOL_VERSION = 3
#: How often agents and the coordinator beat; an agent silent for
#: ``LOST_AFTER_S`` counts as lost (its node died or its process was killed).
BEAT_S = 0.5
LOST_AFTER_S = 5.0
#: The swap drivers a ``Launch.swap`` may name.
SWAP_DRIVERS = ("checkpoint", "simulated")


class AgentProtocolError(ValueError):
    """Bytes from an agent or coordinator that are no valid message."""


@dataclass(frozen=True, slots=True)
class AgentHello:
    node: str
    host: str
    slots: int
    gpus: tuple[int, ...]
    pid: int
    #: The launcher's node rank (-1: none given); agents are placed in its order.
    node_rank: int = -1
    version: int = AGENT_PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class Launch:
    """Start ``ranks`` of a world of ``world_size``: ``command`` in ``cwd``,
    ranks connect to ``endpoint`` (CURVE with the agent's keys unless
    ``insecure``), logs and trace paths under ``run_dir`` (a shared path)."""

    ranks: tuple[int, ...]
    world_size: int
    endpoint: str
    run_dir: str
    command: tuple[str, ...]
    cwd: str
    nproc_per_node: int
    env: dict[str, str] = field(default_factory=dict)
    show_ranks: tuple[int, ...] = ()
    insecure: bool = False
    #: GPU swapping of these ranks (empty: every rank stays resident):
    #: ``{"driver": "checkpoint"}`` (the CUDA driver's checkpoint API) or
    #: ``{"driver": "simulated", "delay_s": S}`` (SIGSTOP/SIGCONT, ``--simulate-swaps``).
    swap: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Exits:
    """Ranks that ended since the last ``Exits``: rank -> exit code
    (``-signal`` if killed), and rank -> its process's peak resident memory
    in bytes where the node knows it (an emulation reports it per sandbox)."""

    codes: dict[int, int]
    rss: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A node checked, before starting its ranks, what they need there:
    ``stage`` "kernels": cuda_ext's kernels for device-path sandboxes
    (``cuda_ext.info()`` as a dict, with ``checked_s``); "swaps": the swap
    driver its ``Launch`` names. ``error``: the check failed (its ranks do
    not start and the run ends naming it)."""

    kernels: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    stage: str = "kernels"


@dataclass(frozen=True, slots=True)
class Swap:
    """Swap ``rank`` (its process ``pid`` on the agent's node, as the rank
    said in its Hello: the process that holds its CUDA context) ``direction``
    "out" (checkpoint its GPU state to host memory) or "in" (restore it);
    ``step``: the capture's slowest rank's step; ``token`` pairs the answer.
    The agent carries it out only for one of its own ranks still running."""

    token: int
    rank: int
    pid: int
    direction: str
    step: int = -1

    def __post_init__(self) -> None:
        if self.direction not in ("out", "in"):
            raise ValueError(f"swap direction {self.direction!r}: expected 'out' or 'in'")


@dataclass(frozen=True, slots=True)
class Swapped:
    """The answer to ``Swap`` ``token``: its ``prism.shell.swap.SwapRecord``
    fields (``status`` "ok"/"skipped", ``t_start`` in seconds on the agent's
    node's CLOCK_MONOTONIC, the clock its ranks stamp, ``seconds``,
    ``bytes``), or ``error``: the swap failed (the capture stops)."""

    token: int
    status: str = ""
    t_start: float = 0.0
    seconds: float = 0.0
    bytes: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class AgentBeat:
    running: int


@dataclass(frozen=True, slots=True)
class CoordinatorBeat:
    pass


@dataclass(frozen=True, slots=True)
class KillAll:
    reason: str


@dataclass(frozen=True, slots=True)
class Refused:
    """The coordinator will not use this agent (``reason`` says why);
    ``retry``: it is busy with a run of its own (it has its agents), so an
    agent that serves several runs tries again once it is gone."""

    reason: str
    retry: bool = False


_TYPES: dict[str, type] = {c.__name__: c for c in (AgentHello, Launch, Exits, Prepared, Swap, Swapped, AgentBeat,
                                                    CoordinatorBeat, KillAll, Refused)}
_TUPLES = {"gpus", "ranks", "command", "show_ranks"}


def encode(msg: Any) -> dict[str, Any]:
    """The dict form of ``msg`` (JSON-ready: int keys become strings)."""
    d = asdict(msg)
    if isinstance(msg, Exits):
        d["codes"] = {str(k): v for k, v in msg.codes.items()}
        d["rss"] = {str(k): v for k, v in msg.rss.items()}
    return {"t": type(msg).__name__, "v": AGENT_PROTOCOL_VERSION, **d}


def decode(d: Any) -> Any:
    """The message of ``encode``'s dict; ``AgentProtocolError`` if it is none
    (another version is named as such)."""
    if not isinstance(d, dict) or not isinstance(d.get("t"), str):
        raise AgentProtocolError(f"not an agent message: {str(d)[:200]}")
    if d.get("v") != AGENT_PROTOCOL_VERSION:
        raise AgentProtocolError(f"agent protocol version {d.get('v')!r}, this side speaks "
                                 f"{AGENT_PROTOCOL_VERSION}: run the same Prism version on every node")
    cls = _TYPES.get(d["t"])
    if cls is None:
        raise AgentProtocolError(f"unknown agent message type {d['t']!r}")
    args: dict[str, Any] = {}
    try:
        for f in fields(cls):
            if f.name in d:
                v = d[f.name]
                if f.name in _TUPLES:
                    v = tuple(v)
                elif f.name in ("codes", "rss"):
                    v = {int(k): int(c) for k, c in v.items()}
                args[f.name] = v
        return cls(**args)
    except (TypeError, ValueError, AttributeError) as e:
        raise AgentProtocolError(f"bad {d['t']} message: {e}") from None


def swap_spec(spec: Mapping[str, Any]) -> tuple[str, float]:
    """``(driver, delay_s)`` of a ``Launch.swap``; ``ValueError`` naming what
    is wrong (an unknown driver, a bad delay)."""
    driver = spec.get("driver")
    if driver not in SWAP_DRIVERS:
        raise ValueError(f"swap driver {driver!r}: expected one of {', '.join(SWAP_DRIVERS)}")
    delay = spec.get("delay_s", 0.0)
    if driver == "checkpoint" and delay:
        raise ValueError("the checkpoint driver takes no delay_s (that is --simulate-swaps's)")
    if not isinstance(delay, (int, float)) or isinstance(delay, bool) or delay < 0:
        raise ValueError(f"swap delay_s {delay!r}: expected seconds, 0 or more")
    return driver, float(delay)


def node_gpu_of(blocks: Sequence[Sequence[int]], gpus: Sequence[Sequence[int]]) -> dict[int, int]:
    """``rank -> GPU`` for a swap policy over several nodes: node ``i``'s
    ranks ``blocks[i]`` share its GPUs ``gpus[i]`` in contiguous blocks (as
    each rank picks its GPU, ``prism.rank.placement.choose_node_gpu``); every
    (node, GPU) pair gets an index of its own, in node order. ``ValueError``
    for a node with ranks and no GPU."""
    if len(blocks) != len(gpus):
        raise ValueError(f"{len(blocks)} blocks of ranks for {len(gpus)} nodes")
    out: dict[int, int] = {}
    base = 0
    for i, (block, node) in enumerate(zip(blocks, gpus)):
        ranks = sorted(block)
        if ranks and not node:
            raise ValueError(f"node {i} has ranks {rank_span(ranks)} but no GPU")
        for k, r in enumerate(ranks):
            out[r] = base + k * len(node) // len(ranks)
        base += len(node)
    return out


def assign_blocks(world_size: int, agents: int, gang: int = 1) -> list[list[int]]:
    """Contiguous blocks of ranks, one per agent, as a real job's placement:
    whole gangs (``gang`` ranks: a TP group, or TP*PP) stay on one node, and
    the blocks differ by at most one gang. ``ValueError`` when the world does
    not split into whole gangs or there are more agents than gangs."""
    if agents < 1:
        raise ValueError(f"--agents must be at least 1, got {agents}")
    if gang < 1 or world_size % gang:
        raise ValueError(f"a world of {world_size} ranks does not split into gangs of {gang}")
    gangs = world_size // gang
    if agents > gangs:
        raise ValueError(f"{agents} agents for {gangs} gang(s) of {gang} rank(s): some agent would get no ranks; "
                         "use fewer agents")
    out, start = [], 0
    for a in range(agents):
        n = (gangs // agents + (1 if a < gangs % agents else 0)) * gang
        out.append(list(range(start, start + n)))
        start += n
    return out


def check_placement(blocks: Sequence[Sequence[int]], ranks: Sequence[int], agents: int) -> list[list[int]]:
    """A placement given block by block (``blocks[i]``: the ranks for the
    ``i``-th agent in node order; a calibration's slices, one per node):
    checked to hold each of ``ranks`` exactly once on at most ``agents``
    agents, padded with empty blocks to ``agents``; ``ValueError`` saying
    what is wrong otherwise."""
    if agents < 1:
        raise ValueError(f"--agents must be at least 1, got {agents}")
    if len(blocks) > agents:
        raise ValueError(f"the placement has {len(blocks)} blocks for {agents} agent(s)")
    seen: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for r in block:
            if int(r) in seen:
                raise ValueError(f"rank {r} is placed on agents {seen[int(r)]} and {i}")
            seen[int(r)] = i
    want = sorted(set(int(r) for r in ranks))
    if sorted(seen) != want:
        missing = sorted(set(want) - set(seen))
        extra = sorted(set(seen) - set(want))
        raise ValueError("the placement does not hold the ranks it places"
                         + (f": ranks {missing} are on no agent" if missing else "")
                         + (f": ranks {extra} are not among them" if extra else ""))
    return [sorted(int(r) for r in b) for b in blocks] + [[] for _ in range(agents - len(blocks))]


def place_ranks(ranks: Sequence[int], agents: int, gang: int = 1) -> list[list[int]]:
    """Some ranks of a world (an emulation's sandbox) on ``agents`` agents:
    the ranks of one gang (``r // gang``: a TP group) stay on one agent, as
    ``assign_blocks`` keeps them in the whole world; the gangs go in rank
    order, in contiguous runs, each agent taking gangs while it has fewer
    than its even share of what is left (for a whole world: exactly
    ``assign_blocks``). With more agents than gangs the last agents get an
    empty block: the run has nothing for them (an agent serving several
    runs goes on to the next); ``ValueError`` when there is no rank at all."""
    if agents < 1:
        raise ValueError(f"--agents must be at least 1, got {agents}")
    if gang < 1:
        raise ValueError(f"a gang has at least 1 rank, got {gang}")
    units: list[list[int]] = []
    for r in sorted(set(int(r) for r in ranks)):
        if r < 0:
            raise ValueError(f"rank {r} is negative")
        if units and units[-1][0] // gang == r // gang:
            units[-1].append(r)
        else:
            units.append([r])
    if not units:
        raise ValueError("no rank to place on the agents")
    out: list[list[int]] = []
    i = 0
    busy = min(agents, len(units))
    for a in range(busy):
        left_agents = busy - a
        left = sum(len(u) for u in units[i:])
        share = left / left_agents
        block = list(units[i])
        i += 1
        # The next gang too while the block is short of its share and a gang
        # is left for each agent still to come.
        while len(units) - i > left_agents - 1 and (left_agents == 1 or len(block) < share):
            block += units[i]
            i += 1
        out.append(block)
    return out + [[] for _ in range(agents - busy)]


def rank_span(ranks: Sequence[int]) -> str:
    """``"8-15"`` for a contiguous block, else the list."""
    rs = sorted(ranks)
    if rs and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}" if len(rs) > 1 else str(rs[0])
    return ",".join(map(str, rs))


# --- discovery ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Discovery:
    """What the launcher's environment says: this node's rank among
    ``nnodes``, and the host the coordinator runs on (node 0)."""

    node_rank: int
    nnodes: int
    coordinator_host: str
    port: int | None
    source: str


#: The coordinator's port when the launcher names none (SLURM).
DEFAULT_AGENT_PORT = 29431


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compact host list (``node[01-03,07],gpu5``) as host names."""
    hosts, depth, cur = [], 0, ""
    parts = []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    for part in parts:
        if "[" not in part:
            hosts.append(part)
            continue
        prefix, _, rest = part.partition("[")
        body, _, suffix = rest.partition("]")
        for item in body.split(","):
            lo, dash, hi = item.partition("-")
            if not dash:
                hosts.append(prefix + lo + suffix)
                continue
            width = len(lo)
            for n in range(int(lo), int(hi) + 1):
                hosts.append(f"{prefix}{n:0{width}d}{suffix}")
    return hosts


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not a whole number") from None


def discover(env: Mapping[str, str]) -> Discovery:
    """Read the node rank and the coordinator's host from torchrun's
    (``NODE_RANK``/``GROUP_RANK``, ``NNODES``, ``MASTER_ADDR``,
    ``MASTER_PORT``) or SLURM's (``SLURM_NODEID``, ``SLURM_NNODES``,
    ``SLURM_JOB_NODELIST``: the first node is the coordinator's) variables;
    ``ValueError`` naming what is missing."""
    if "MASTER_ADDR" in env:
        rank_var = "NODE_RANK" if "NODE_RANK" in env else "GROUP_RANK" if "GROUP_RANK" in env else None
        if rank_var is None:
            raise ValueError("MASTER_ADDR is set but neither NODE_RANK nor GROUP_RANK: launch with torchrun "
                             "--nnodes N --node-rank R (or pass --node-rank)")
        nnodes_text = env.get("NNODES") or env.get("GROUP_WORLD_SIZE") or env.get("PET_NNODES") or ""
        nnodes = int(nnodes_text.split(":")[-1]) if nnodes_text.split(":")[-1].isdigit() else 0
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
        return Discovery(_int(env, rank_var), nnodes, env["MASTER_ADDR"], port, "torchrun")
    if "SLURM_NODEID" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise ValueError("SLURM_NODEID is set but SLURM_JOB_NODELIST is not: run `prism agent` under srun")
        hosts = expand_nodelist(nodelist)
        nnodes = _int(env, "SLURM_NNODES") if "SLURM_NNODES" in env else len(hosts)
        return Discovery(_int(env, "SLURM_NODEID"), nnodes, hosts[0], None, "slurm")
    raise ValueError("no launcher environment found (SLURM_NODEID or MASTER_ADDR/NODE_RANK): pass "
                     "--coordinator tcp://HOST:PORT")
