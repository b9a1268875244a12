"""PrismTrace's records: the event types, the manifest and the group identity.

Specified in ``docs/TRACE.md``. Times are integer nanoseconds on the
recording rank's monotonic clock; ``RankStart.clock_offset_ns`` converts them
to the coordinator's clock (``coordinator_ns = rank_ns + clock_offset_ns``).

Every event is a frozen, slotted dataclass whose ``KIND`` class attribute is
its tag on disk. Tuples (never lists) hold sequences so events stay hashable.
``RankTrace``, ``Run`` and ``TraceWarning`` are what a reader hands back; the
shell's ``prism.shell.runfolder`` reads them from a run directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

#: Major version: a reader refuses a major it does not know.
TRACE_VERSION = 1
#: Minor version: a newer minor only adds optional fields and event kinds, so
#: older readers skip what they do not know (see ``docs/TRACE.md``).
TRACE_VERSION_MINOR = 4
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
    #: Minor format version of the writer (``version`` is the major).
    version_minor: int = TRACE_VERSION_MINOR


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
    #: GPU ranks only (PrismTrace 1.1), -1 elsewhere: the CPU's share of the
    #: segment, from its start to where the rank began waiting for the GPU
    #: (Prism's own per-call overhead removed); ``end_ns - start_ns`` also
    #: holds that wait. See docs/GPU-TIMING.md.
    cpu_ns: int = -1
    #: GPU busy time of the kernels the segment queued, measured on
    #: calibration steps only; -1 elsewhere, -2 on a calibration step whose
    #: measurement was discarded (the GPU ran out of queued work).
    gpu_ns: int = -1
    #: The segment ended where the script waited for the GPU (``.item()``,
    #: a copy to host, ``torch.cuda.synchronize``, the step's end): the
    #: CPU resumes only when the GPU is idle.
    join: bool = False
    #: GPU ranks (PrismTrace 1.2), uncalibrated segments: from the segment's
    #: start to the end of its GPU work, which started idle (the capture
    #: drains the GPU at every boundary), Prism's per-call overhead removed:
    #: the segment's finish when nothing is queued ahead of it. -1 elsewhere.
    free_ns: int = -1
    #: GPU ranks (PrismTrace 1.2): the part of ``cpu_ns`` (and ``free_ns``)
    #: estimated to be the cold start after Prism's own wait at the
    #: communication call before the segment, which the real job's CPU, never
    #: waiting there, does not pay (measured per rank; 0 after a join or at
    #: the step's start). The replay takes it off.
    cold_ns: int = 0
    #: CPU ranks (PrismTrace 1.4), one-clock segments: the CPU time the
    #: rank's main thread used over the segment; well under ``end_ns -
    #: start_ns`` when the thread was descheduled or waited for the GIL (a
    #: polluted measurement, which ``prism calibrate`` replaces). -1 when not
    #: measured (GPU ranks, older traces).
    thread_cpu_ns: int = -1


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
    ``"p2p:{src}:{dst}:{tag}:{pseq}"``; role is "in", "out", "in{i}" or "out{i}".
    ``data`` holds the raw little-endian bytes.
    """

    KIND: ClassVar[str] = "value"
    ref: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True, slots=True)
class Payload:
    """A recorded communication tensor (PrismTrace 1.3, ``prism capture --record``).

    Payload records live beside the trace, in ``payloads/rank-NNNNNN.jsonl``
    (never in a rank file): for each recorded rank, every tensor it
    *received* (``role="recv"``: a collective's outputs, a receive), its
    bytes at ``offset`` in ``file`` (relative to the run directory), and
    the digest of every tensor it *sent* (``role="sent"``: a collective's
    inputs, a send; ``file`` "" and ``offset`` -1). ``ref`` addresses the
    trace record it belongs to, in the small-tensor store's vocabulary
    (``"coll:{gid}:{seq}:{in|out}[i]"``, ``"p2p:{src}:{dst}:{tag}:{pseq}"``).
    ``digest`` is BLAKE2b-128 of the raw little-endian bytes, in hex.
    """

    KIND: ClassVar[str] = "payload"
    ref: str
    role: str  # "recv" | "sent"
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    digest: str
    #: The recorded rank's iteration (0-based) when it made the call.
    step: int
    file: str = ""
    offset: int = -1


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
    Payload,
    RankEnd,
)

Event = RankStart | GroupCreated | Compute | Collective | P2P | Iteration | Memory | TensorValue | Payload | RankEnd

#: Bytes per element of every dtype a record may name. Names are torch's
#: without the ``torch.`` prefix (``str(t.dtype).removeprefix("torch.")``).
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "uint16": 2,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "uint32": 4,
    "int32": 4,
    "float32": 4,
    "complex32": 4,
    "uint64": 8,
    "int64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}

#: Ops that reduce and therefore carry a ``reduce_op``; the others carry "".
REDUCING_OPS = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor")
#: Ops with a root (``Collective.root`` is a group rank); the others carry -1.
ROOTED_OPS = ("broadcast", "reduce", "gather", "scatter")

def group_id(index: int, ranks: Sequence[int]) -> str:
    """The stable id of a communicator, equal on every rank that creates it.

    ``index`` is the group's creation index (0 for the default WORLD group,
    then 1, 2, ... in creation order, which torch.distributed makes equal on
    every rank) and ``ranks`` its global member ranks in group-rank order.
    WORLD is ``"world"``; any other group is ``f"g{index}-{h}"`` where ``h`` is
    the first 8 hex digits of BLAKE2b over the ranks written as decimal
    numbers joined by commas (``"0,2,4"``). The index keeps ids distinct when
    the same members form several groups; the hash makes ranks that disagree
    about a group's members produce different ids, which the validator sees.
    """
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"group_id: index must be an int >= 0, got {index!r}")
    members = tuple(ranks)
    if not members or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in members):
        raise ValueError(f"group_id: ranks must be a non-empty sequence of ints >= 0, got {members!r}")
    if index == 0:
        return "world"
    digest = hashlib.blake2b(",".join(map(str, members)).encode("ascii"), digest_size=4).hexdigest()
    return f"g{index}-{digest}"




@dataclass(frozen=True, slots=True)
class TraceWarning:
    """Damage found while reading: the records from ``line`` on were not read."""

    file: str
    #: 1-based line number; 0 when the warning is about the whole file or run.
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


@dataclass(frozen=True, slots=True)
class RankTrace:
    """One rank file as read: its records up to the first damage."""

    path: str
    rank: int
    events: list[Event]
    #: ``lines[i]`` is the 1-based line number of ``events[i]``.
    lines: list[int]
    warnings: list[TraceWarning]


@dataclass(frozen=True, slots=True)
class Run:
    """A run directory as read (or a synthetic run built in memory).

    ``ranks`` maps each rank to its records. ``lines`` gives their line
    numbers (missing for synthetic runs: the validator then numbers records
    from 1). ``path`` is the run directory. ``manifest_file`` and
    ``rank_files`` (every rank of the world, whether its file exists or not)
    name the files in messages; ``prism.shell.runfolder`` fills them from the
    run directory's layout, and a run built without them is named by rank.
    """

    path: str
    manifest: Manifest
    ranks: dict[int, list[Event]]
    warnings: list[TraceWarning] = dataclasses.field(default_factory=list)
    lines: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    manifest_file: str = ""
    rank_files: dict[int, str] = dataclasses.field(default_factory=dict)
    #: Recorded payloads (PrismTrace 1.3, ``--record``): each recorded rank's
    #: ``Payload`` records, and the files that hold them (for messages).
    payloads: dict[int, list[Payload]] = dataclasses.field(default_factory=dict)
    payload_files: dict[int, str] = dataclasses.field(default_factory=dict)
