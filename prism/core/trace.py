"""PrismTrace v1: the event types of a captured run (sans-IO).

Specified in ``docs/TRACE.md``. Times are integer nanoseconds on the recording
rank's monotonic clock; ``RankStart.clock_offset_ns`` converts them to the
coordinator's clock (``coordinator_ns = rank_ns + clock_offset_ns``).

Every event is a frozen, slotted dataclass whose ``KIND`` class attribute is
its tag on disk. Tuples (never lists) hold sequences so events stay hashable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

TRACE_VERSION = 1
#: Tensors up to this many bytes have their values kept (the small-tensor
#: store) so replay can return them exactly: MoE token counts, split sizes,
#: loss and grad-norm scalars.
DEFAULT_SMALL_TENSOR_LIMIT = 64 * 1024

#: Collective ops, named as torch.distributed's Python front end names them.
COLLECTIVE_OPS = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",  # list output
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",  # list input
    "reduce_scatter_tensor",
    "all_to_all",  # list in/out
    "all_to_all_single",
    "barrier",
)
REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
P2P_OPS = ("send", "recv")


@dataclass(frozen=True, slots=True)
class Manifest:
    """``RUN/manifest.json``: what was run, by whom, on what."""

    KIND: ClassVar[str] = "manifest"
    version: int
    run_id: str
    world_size: int
    #: Unix wall-clock time (ns) at which the coordinator created the run.
    created_unix_ns: int
    #: The user's command after ``--`` (script or ``-m module`` and its args).
    command: tuple[str, ...]
    #: "cpu" or "cuda".
    device_kind: str
    prism_version: str
    torch_version: str
    hostname: str
    small_tensor_limit: int = DEFAULT_SMALL_TENSOR_LIMIT
    #: Parallel layout when known (e.g. {"tp": 2, "pp": 2, "dp": 4}); free form.
    layout: tuple[tuple[str, int], ...] = ()
    #: Free-form notes (slots, CLI flags), never interpreted by readers.
    notes: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class RankStart:
    """First record of every rank file."""

    KIND: ClassVar[str] = "rank_start"
    rank: int
    world_size: int
    local_rank: int
    pid: int
    hostname: str
    #: Logical device the script sees, e.g. "cpu" or "cuda:3".
    device: str
    #: Physical device the rank ran on, e.g. "cpu" or "cuda:0".
    physical_device: str
    #: coordinator_ns = rank_ns + clock_offset_ns
    clock_offset_ns: int
    start_ns: int


@dataclass(frozen=True, slots=True)
class GroupCreated:
    """A communicator as this rank knows it.

    ``gid`` is stable across ranks: derived from the creation index (groups are
    created in the same order on every rank, as torch.distributed requires)
    and the member ranks; see ``group_id``.
    """

    KIND: ClassVar[str] = "group"
    gid: str
    #: Global ranks of the members, in group-rank order.
    ranks: tuple[int, ...]
    #: 0 for the default (WORLD) group, then 1, 2, ... in creation order.
    index: int
    #: The name torch gave the group (informational).
    name: str
    t_ns: int


@dataclass(frozen=True, slots=True)
class Compute:
    """A scheduling unit: what the rank did between two communication calls."""

    KIND: ClassVar[str] = "compute"
    start_ns: int
    end_ns: int
    #: Iteration (0-based) in which the segment ran.
    step: int


@dataclass(frozen=True, slots=True)
class Collective:
    """One rank's participation in one collective instance ``(gid, seq)``."""

    KIND: ClassVar[str] = "coll"
    gid: str
    #: Per-group sequence number (0-based), equal on every member.
    seq: int
    op: str
    #: One of REDUCE_OPS for reducing ops, else "".
    reduce_op: str
    dtype: str
    #: Shapes of the input tensors (one per tensor for list/coalesced forms).
    in_shapes: tuple[tuple[int, ...], ...]
    #: Shapes of the output tensors.
    out_shapes: tuple[tuple[int, ...], ...]
    #: Bytes this rank contributes (sum over input tensors).
    bytes: int
    #: Group rank of the root for broadcast/reduce/gather/scatter, else -1.
    root: int = -1
    #: all_to_all(_single) split sizes along dim 0 (elements in dim-0 rows).
    in_splits: tuple[int, ...] = ()
    out_splits: tuple[int, ...] = ()
    #: PREMUL_SUM's scale factor, when it is a Python number.
    premul: float | None = None
    async_op: bool = False
    #: When the call was issued, when the rank started to wait for it (equal to
    #: issue_ns for a blocking call), and when it completed on this rank.
    issue_ns: int = 0
    wait_ns: int = 0
    end_ns: int = 0
    step: int = 0


@dataclass(frozen=True, slots=True)
class P2P:
    """One send or receive. Sends match receives by ``(src, dst, tag, pseq)``."""

    KIND: ClassVar[str] = "p2p"
    op: str  # "send" | "recv"
    #: Group the call was made on and the peer's *global* rank.
    gid: str
    peer: int
    tag: int
    #: Per (src, dst, tag) sequence number, equal on sender and receiver.
    pseq: int
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    async_op: bool = False
    issue_ns: int = 0
    wait_ns: int = 0
    end_ns: int = 0
    step: int = 0


@dataclass(frozen=True, slots=True)
class Iteration:
    """The rank's optimizer step for iteration ``step`` returned at ``end_ns``."""

    KIND: ClassVar[str] = "iter"
    step: int
    end_ns: int


@dataclass(frozen=True, slots=True)
class Memory:
    """A device-memory sample (bytes), e.g. at the end of each step."""

    KIND: ClassVar[str] = "mem"
    t_ns: int
    device: str
    allocated: int
    reserved: int
    peak_allocated: int
    step: int = 0


@dataclass(frozen=True, slots=True)
class TensorValue:
    """A small tensor's value (the small-tensor store).

    ``ref`` names what it belongs to: ``"coll:{gid}:{seq}:{role}"`` or
    ``"p2p:{src}:{dst}:{tag}:{pseq}"``; role is "in", "out" or "out{i}".
    ``data`` holds the raw little-endian bytes.
    """

    KIND: ClassVar[str] = "value"
    ref: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True, slots=True)
class RankEnd:
    """Last record of a rank file that closed normally."""

    KIND: ClassVar[str] = "rank_end"
    t_ns: int
    #: "ok", "error" (the script raised), "killed" (stopped by Prism), ...
    status: str
    message: str = ""


EVENT_TYPES: tuple[type, ...] = (
    RankStart,
    GroupCreated,
    Compute,
    Collective,
    P2P,
    Iteration,
    Memory,
    TensorValue,
    RankEnd,
)

Event = RankStart | GroupCreated | Compute | Collective | P2P | Iteration | Memory | TensorValue | RankEnd
