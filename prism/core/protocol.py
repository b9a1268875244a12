"""The wire protocol between rank processes and the coordinator (sans-IO).

Specified in ``docs/PROTOCOL.md``. A message is one ZeroMQ multipart message:
frame 0 is an orjson header ``{"t": TYPE, "v": PROTOCOL_VERSION, ...fields}``,
frames 1.. are raw payloads (tensor bytes, trace lines), never copied into the
header. ``encode`` turns a message into frames, ``decode`` turns frames back
into a message and raises ``ProtocolError`` (naming the type, field and value)
on anything malformed: a receiver must never crash on a peer's bytes.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from prism.core import codec

#: 2: results carry ``release_ns`` (emulation: when the call completes).
#: 9: a rank on another host syncs its clock (``ClockProbe``, ``ClockEcho``, ``ClockOffset``).
#: 11: a GPU sandbox may release through shared memory (``ReleaseShared``, ``CollectiveArrive.release_slot``).
PROTOCOL_VERSION = 12
#: Largest message (all frames together) a peer may send. Tensors staged
#: through the coordinator in phase 1 are gradient buckets and activations:
#: 1 GiB leaves room for a 25 MiB DDP bucket many times over while stopping a
#: corrupted length from exhausting host memory. Configurable per socket.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
MAX_HEADER_BYTES = 1 << 20

Buffer = bytes | bytearray | memoryview


class ProtocolError(Exception):
    """A peer sent something this protocol does not allow (the peer's fault).

    A socket that received the bad message sets ``identity`` to the sending
    peer's routing identity (None where the socket has no identities), so the
    receiver can answer that peer with an ``Error(code="bad_message")``.
    """

    identity: bytes | None = None


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version."""


# --- rank -> coordinator ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """First message of a rank: who it is and which protocol it speaks."""

    TYPE: ClassVar[str] = "hello"
    protocol_version: int
    rank: int
    world_size: int
    local_rank: int
    pid: int
    hostname: str
    device: str
    #: The rank's monotonic clock when it sent Hello (for the clock offset).
    t_ns: int


@dataclass(frozen=True, slots=True)
class ClockProbe:
    """Clock sync (protocol 9; ``prism.core.clocksync``): right after its
    ``Welcome``, a rank whose coordinator is on another host sends a few of
    these, one at a time; the coordinator answers each at once (``ClockEcho``)."""

    TYPE: ClassVar[str] = "clock_probe"
    rank: int
    #: The probe's number (0, 1, ...): the echo's routing key.
    seq: int
    #: The rank's monotonic clock when it sent the probe.
    t_ns: int


@dataclass(frozen=True, slots=True)
class ClockOffset:
    """The clock offset the rank settled on after its probes, which the
    coordinator takes as its own for this rank (both sides then convert
    with the same one)."""

    TYPE: ClassVar[str] = "clock_offset"
    rank: int
    #: coordinator_ns = rank_ns + offset_ns (``RankStart.clock_offset_ns``).
    offset_ns: int
    #: The round trip of the probe it kept (the offset is off by at most half of it).
    rtt_ns: int


@dataclass(frozen=True, slots=True)
class GroupCreate:
    """The rank created a communicator (``index`` in creation order)."""

    TYPE: ClassVar[str] = "group_create"
    rank: int
    gid: str
    index: int
    ranks: tuple[int, ...]
    name: str


@dataclass(frozen=True, slots=True)
class CollectiveArrive:
    """The rank reached collective ``(gid, seq)``; payloads hold its input tensors."""

    TYPE: ClassVar[str] = "coll"
    rank: int
    gid: str
    seq: int
    op: str
    reduce_op: str
    dtype: str
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    root: int = -1
    in_splits: tuple[int, ...] = ()
    out_splits: tuple[int, ...] = ()
    premul: float | None = None
    async_op: bool = False
    issue_ns: int = 0
    #: Emulation, a GPU sandbox alone among virtual members of its group: the
    #: data stays on the rank's GPU (no payloads) and the rank forms its
    #: outputs there; the reply carries only the release.
    on_device: bool = False
    #: With ``on_device``: ``issue_ns`` is only when the CPU issued the call;
    #: a ``Reached`` follows with the moment the rank's stream got there,
    #: the call's arrival in the emulated job.
    reach_follows: bool = False
    #: With ``on_device``: the rank delivers the capture's recorded outputs
    #: from its prefetch pool (``prism.rank.devicepath.RecordedFeed``), not
    #: compensated ones (protocol 7).
    recorded: bool = False
    #: Emulation, a sandbox among other sandbox members of its group
    #: (``prism emulate --pruned``): the members run the call among
    #: themselves for real and each folds the virtual members' contribution
    #: in (``prism.rank.pruned``); no payloads, and the reply carries only the
    #: release, or the recorded outputs (``in_digests``) (protocol 10).
    pruned: bool = False
    #: With ``pruned``: the BLAKE2b digests (``payloads.digest``) of the
    #: rank's inputs, for the coordinator to check against the recording,
    #: when it has one (then the reply carries the recorded outputs, which the
    #: rank puts in place of its own once the real call has finished).
    in_digests: tuple[str, ...] = ()
    #: With ``on_device`` and the rank's ``ReleaseShared`` file (protocol 11):
    #: the flag slot and value its stream waits on, which the coordinator
    #: writes as the result goes out (-1: none, the rank flips it itself).
    release_slot: int = -1
    release_value: int = 0
    #: With ``reach_follows`` (protocol 12): the stream's reach, known as the
    #: rank sent the arrival (it leaves from the reach watcher, at the reach),
    #: on the rank's dilated clock; no ``Reached`` follows. 0: not known yet.
    reach_ns: int = 0
    payloads: tuple[Buffer, ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True)
class ReleaseShared:
    """Emulation, a GPU sandbox (protocol 11): its release flags live in the
    shared-memory file ``path`` of ``slots`` flags (``transport.shared_release``);
    the coordinator may map it and release a device-path collective by writing
    its flag (``CollectiveArrive.release_slot``) as the result goes out. Sent
    before the first call that names a slot; on one host only."""

    TYPE: ClassVar[str] = "release_shared"
    rank: int
    path: str
    slots: int


@dataclass(frozen=True, slots=True)
class Reached:
    """Emulation, a GPU sandbox's device-path collective ``(gid, seq)``
    (``CollectiveArrive.reach_follows``): its stream reached the call at
    ``reach_ns`` (the GPU's clock, converted to the rank's dilated clock).
    For a device-path receive (``RecvPost.reach_follows``) ``gid`` is
    ``recv_reach_gid(src, tag)`` and ``seq`` its ``pseq``."""

    TYPE: ClassVar[str] = "reached"
    rank: int
    gid: str
    seq: int
    reach_ns: int


@dataclass(frozen=True, slots=True)
class Send:
    """A send (eager: the payload travels with it). ``on_device``: a GPU
    sandbox's send to a virtual rank; the data stays on its GPU (no payload,
    no copy to the host). ``reach_follows``: a ``Reached`` with ``gid``
    ``send_reach_gid(dst, tag)`` and ``seq`` its ``pseq`` gives the moment
    the sandbox's stream got to the send (a wait released in advance, which
    only stamps the GPU's clock): the send's arrival, as a collective's."""

    TYPE: ClassVar[str] = "send"
    rank: int
    gid: str
    dst: int
    tag: int
    pseq: int
    dtype: str
    shape: tuple[int, ...]
    issue_ns: int = 0
    payloads: tuple[Buffer, ...] = field(default=(), compare=False)
    on_device: bool = False
    reach_follows: bool = False
    #: As ``CollectiveArrive.reach_ns`` (protocol 12): sent at the reach, with it; no ``Reached`` follows.
    reach_ns: int = 0


@dataclass(frozen=True, slots=True)
class RecvPost:
    """The rank posted a receive; the coordinator answers with ``P2PData``.
    ``on_device``: a GPU sandbox's receive from a virtual rank, formed on its
    GPU behind a stream-ordered release (the answer carries no payload);
    ``reach_follows`` as ``CollectiveArrive``'s (a ``Reached`` follows)."""

    TYPE: ClassVar[str] = "recv"
    rank: int
    gid: str
    src: int
    tag: int
    pseq: int
    dtype: str
    shape: tuple[int, ...]
    issue_ns: int = 0
    on_device: bool = False
    reach_follows: bool = False
    #: As ``CollectiveArrive.recorded``: the recorded data, not zeros, behind the release.
    recorded: bool = False
    #: As ``CollectiveArrive.reach_ns`` (protocol 12): sent at the reach, with it; no ``Reached`` follows.
    reach_ns: int = 0


def recv_reach_gid(src: int, tag: int) -> str:
    """The ``Reached.gid`` of a device-path receive from ``src`` with ``tag``
    (no group id looks like it: they never hold a colon)."""
    return f"recv:{src}:{tag}"


def send_reach_gid(dst: int, tag: int) -> str:
    """The ``Reached.gid`` of a device-path send to ``dst`` with ``tag``."""
    return f"send:{dst}:{tag}"


@dataclass(frozen=True, slots=True)
class Wait:
    """The rank started to wait for an async operation (for the trace and the
    deadlock report: what the rank waits for)."""

    TYPE: ClassVar[str] = "wait"
    rank: int
    what: str
    t_ns: int


@dataclass(frozen=True, slots=True)
class TraceRecords:
    """Encoded PrismTrace lines for the coordinator's writer; payloads are
    lines (bytes, no newline)."""

    TYPE: ClassVar[str] = "trace"
    rank: int
    payloads: tuple[Buffer, ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True)
class SlotRequest:
    """The rank wants to compute (it holds no slot)."""

    TYPE: ClassVar[str] = "slot_req"
    rank: int


@dataclass(frozen=True, slots=True)
class SlotRelease:
    """The rank gives its slot back (it is about to block)."""

    TYPE: ClassVar[str] = "slot_rel"
    rank: int


@dataclass(frozen=True, slots=True)
class Taken:
    """The rank took delivered data in but still waits (for another call):
    it does not need its GPU until it asks for a slot. Sent only when the
    coordinator swaps ranks (``Welcome.swapping``)."""

    TYPE: ClassVar[str] = "taken"
    rank: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    TYPE: ClassVar[str] = "hb"
    rank: int
    t_ns: int
    step: int


@dataclass(frozen=True, slots=True)
class Goodbye:
    """Last message of a rank: how it ended ("ok", "error") and why."""

    TYPE: ClassVar[str] = "bye"
    rank: int
    status: str
    message: str = ""
    #: When it ended, on its clock (an emulation's sandbox: the dilated one); 0: not said.
    t_ns: int = 0


# --- coordinator -> rank ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Welcome:
    """The coordinator accepted the rank."""

    TYPE: ClassVar[str] = "welcome"
    protocol_version: int
    run_id: str
    #: Coordinator's monotonic clock when it handled Hello.
    t_ns: int
    #: Tensors up to this many bytes have their values recorded.
    small_tensor_limit: int
    #: Ranks are swapped out of their GPU while blocked: say ``Taken``.
    swapping: bool = False
    #: An emulation: the rank keeps a *dilated* clock for the times it sends
    #: (``RankRuntime.dilation_ns``: Prism's own delay in the rank's waits
    #: taken out), and results carry ``release_ns`` on that clock.
    hybrid: bool = False


@dataclass(frozen=True, slots=True)
class ClockEcho:
    """The coordinator's answer to ``ClockProbe`` ``seq``."""

    TYPE: ClassVar[str] = "clock_echo"
    seq: int
    #: The probe's ``t_ns`` (the rank's clock), sent back.
    probe_ns: int
    #: The coordinator's monotonic clock when it handled the probe.
    t_ns: int


@dataclass(frozen=True, slots=True)
class CollectiveResult:
    """Result of ``(gid, seq)`` for one member; payloads hold output tensors."""

    TYPE: ClassVar[str] = "coll_res"
    gid: str
    seq: int
    payloads: tuple[Buffer, ...] = field(default=(), compare=False)
    #: Emulation: the rank's monotonic time (ns) at which the call completes
    #: (the rank holds the result until then); 0: at once.
    release_ns: int = 0
    #: Emulation: the modelled time of the call itself (ns), from its last
    #: member's arrival to its completion. A GPU sandbox on the device path
    #: (``CollectiveArrive.on_device``) announces a call when its CPU issues
    #: it; its stream may get there later, and then completes it no sooner
    #: than this long after it got there.
    tail_ns: int = 0


@dataclass(frozen=True, slots=True)
class P2PData:
    """The data of a receive, paired with its send."""

    TYPE: ClassVar[str] = "p2p_data"
    src: int
    dst: int
    tag: int
    pseq: int
    payloads: tuple[Buffer, ...] = field(default=(), compare=False)
    #: As ``CollectiveResult.release_ns``.
    release_ns: int = 0


@dataclass(frozen=True, slots=True)
class SlotGrant:
    TYPE: ClassVar[str] = "slot_grant"
    rank: int


@dataclass(frozen=True, slots=True)
class Error:
    """A failure the receiver must act on (either direction).

    ``code``: "version" (handshake refused), "mismatch" (collective mismatch),
    "deadlock", "peer_failed" (another rank died), "bad_message",
    "internal" (a Prism bug: please report it).
    """

    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    rank: int = -1
    gid: str = ""
    seq: int = -1


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The coordinator asks the rank to exit (``reason`` is printed)."""

    TYPE: ClassVar[str] = "shutdown"
    reason: str


MESSAGE_TYPES: tuple[type, ...] = (
    Hello,
    ClockProbe,
    ClockOffset,
    GroupCreate,
    CollectiveArrive,
    ReleaseShared,
    Reached,
    Send,
    RecvPost,
    Wait,
    TraceRecords,
    SlotRequest,
    SlotRelease,
    Taken,
    Heartbeat,
    Goodbye,
    Welcome,
    ClockEcho,
    CollectiveResult,
    P2PData,
    SlotGrant,
    Error,
    Shutdown,
)
_BY_TYPE: dict[str, type] = {m.TYPE: m for m in MESSAGE_TYPES}

Message = (
    Hello | ClockProbe | ClockOffset | ClockEcho | GroupCreate | CollectiveArrive | ReleaseShared | Reached | Send
    | RecvPost | Wait | TraceRecords | SlotRequest | SlotRelease | Taken | Heartbeat | Goodbye | Welcome
    | CollectiveResult | P2PData | SlotGrant | Error | Shutdown
)


#: Per type: its fields (payloads travel as frames, not in the header),
#: compiled by the shared codec, and the header keys it may carry.
_SCHEMAS: dict[type, codec.Schema] = {m: codec.schema(m, skip=("payloads",)) for m in MESSAGE_TYPES}
_ALLOWED_KEYS = {m: frozenset({"t", "v", *_SCHEMAS[m].names}) for m in MESSAGE_TYPES}
#: Per type: the header fields, and those that may hold a float.
_ENCODE_SPECS = {m: (_SCHEMAS[m].names, codec.float_fields(_SCHEMAS[m])) for m in MESSAGE_TYPES}
_HAS_PAYLOADS = {m for m in MESSAGE_TYPES if "payloads" in {f.name for f in dataclasses.fields(m)}}


def _expected(hint: Any, reason: str) -> str:
    """What a header value of ``hint`` must be, in this protocol's words."""
    inner = codec.optional_of(hint)
    if inner is not None:
        return _expected(inner, reason)
    words = {int: "an integer", str: "a string", bool: "true/false", float: "a number", bytes: "base64 text"}
    if hint in words:
        return words[hint]
    if reason == codec.LENGTH:
        return f"{len(typing.get_args(hint))} items"
    return "a list"


def _json_default(value: Any) -> Any:
    # Shapes arrive as torch.Size (a tuple subclass orjson refuses) and sizes
    # as numpy integers; both are plain JSON once converted.
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "__index__"):
        return value.__index__()
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def encode(msg: Message, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[Buffer]:
    """Frames for ``msg``: the orjson header, then its payloads (not copied)."""
    cls = type(msg)
    if cls not in _SCHEMAS:
        raise TypeError(f"{cls.__name__} is not a Prism protocol message")
    names, float_names = _ENCODE_SPECS[cls]
    header: dict[str, Any] = {"t": cls.TYPE, "v": PROTOCOL_VERSION}
    for name in names:
        header[name] = getattr(msg, name)
    for name in float_names:
        value = header[name]
        # orjson writes NaN and infinities as null, which would decode as
        # None (or fail): refuse them here, where the sender can be named.
        if type(value) is float and not math.isfinite(value):
            raise ValueError(f"{cls.__name__}.{name} must be a finite number, got {value!r}")
    try:
        head = orjson.dumps(header, default=_json_default)
    except orjson.JSONEncodeError as e:
        raise ValueError(
            f"cannot encode {cls.__name__} ({e}): fields must be ints within 64 bits, "
            f"finite floats, valid UTF-8 strings, or tuples of those; got {msg!r}"
        ) from None
    if cls not in _HAS_PAYLOADS:
        if len(head) > max_bytes:
            raise ProtocolError(
                f"{cls.TYPE} message of {len(head)} bytes exceeds the maximum of {max_bytes} bytes"
            )
        return [head]
    payloads = msg.payloads  # type: ignore[union-attr]
    total = len(head)
    for p in payloads:
        total += memoryview(p).nbytes
    if total > max_bytes:
        raise ProtocolError(
            f"{cls.TYPE} message of {total} bytes exceeds the maximum of {max_bytes} bytes; "
            "raise max_message_bytes on both sides if this tensor is expected"
        )
    return [head, *payloads]


def header_template(msg: Message) -> dict[str, Any]:
    """``msg``'s header frame as ``encode`` writes it, as a dict, for a sender
    of many alike messages with no payloads: it copies the dict, sets the
    fields that change (names as the message's) and encodes the copy with
    ``encode_header``, a dict copy and one ``orjson.dumps`` where building
    and encoding the message takes ten times as long. Fields set so must be
    ints, bools or strings (``encode`` checked the rest, here)."""
    if getattr(msg, "payloads", ()):
        raise ValueError(f"header_template: {type(msg).__name__} carries payloads")
    return orjson.loads(bytes(encode(msg)[0]))


def encode_header(header: dict[str, Any]) -> list[bytes]:
    """The frames of a message from its ``header_template`` (modified)."""
    return [orjson.dumps(header)]


def decode(frames: Sequence[Buffer], *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """The message carried by ``frames``; ``ProtocolError`` if malformed."""
    if not frames:
        raise ProtocolError("empty message: expected a header frame")
    # zmq.Frame supports the buffer protocol but neither slicing nor orjson.
    head = memoryview(frames[0])
    head_len = head.nbytes
    if head_len > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame of {head_len} bytes exceeds {MAX_HEADER_BYTES} bytes")
    total = head_len
    for f in frames[1:]:
        total += memoryview(f).nbytes
    if total > max_bytes:
        raise ProtocolError(f"message of {total} bytes exceeds the maximum of {max_bytes} bytes")
    try:
        header = orjson.loads(head)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"header frame is not valid JSON ({e}): {bytes(head[:80])!r}") from None
    if type(header) is not dict:
        raise ProtocolError(f"header must be a JSON object, got {type(header).__name__}")
    mtype = header.get("t")
    cls = _BY_TYPE.get(mtype) if type(mtype) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message type {mtype!r}; known: {sorted(_BY_TYPE)}")
    version = header.get("v")
    # type() check: true == 1 and 1.0 == 1 in Python, but not on the wire.
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"{mtype} message in protocol version {version!r}, this side speaks "
            f"{PROTOCOL_VERSION}: run the same Prism version on every side"
        )
    kwargs: dict[str, Any] = {}
    for name, plain, required, _, dec in _SCHEMAS[cls].rows:
        if name not in header:
            if required:
                raise ProtocolError(f"{mtype} message lacks field {name!r}")
            continue
        value = header[name]
        if type(value) is plain:
            kwargs[name] = value
            continue
        try:
            kwargs[name] = dec(value)
        except codec.Mismatch as e:
            raise ProtocolError(
                f"{mtype}.{name}{e.path}: expected {_expected(e.hint, e.reason)}, got {e.value!r}"
            ) from None
    extra = header.keys() - _ALLOWED_KEYS[cls]
    if extra:
        raise ProtocolError(f"{mtype} message has unknown fields {sorted(extra)}")
    if cls in _HAS_PAYLOADS:
        kwargs["payloads"] = tuple(frames[1:])
    elif len(frames) > 1:
        raise ProtocolError(f"{mtype} message carries no payload, got {len(frames) - 1} extra frames")
    return cls(**kwargs)


def check_hello(hello: Hello, *, world_size: int | None = None) -> None:
    """The coordinator's side of the handshake: raise with a message to send back."""
    if hello.protocol_version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"rank {hello.rank} (pid {hello.pid} on {hello.hostname}) speaks Prism protocol "
            f"{hello.protocol_version}, this coordinator speaks {PROTOCOL_VERSION}: "
            "install the same Prism version for the coordinator and the ranks"
        )
    if world_size is not None:
        if hello.world_size != world_size:
            raise ProtocolError(
                f"rank {hello.rank} says world size {hello.world_size}, "
                f"this coordinator runs world size {world_size}"
            )
        if not 0 <= hello.rank < world_size:
            raise ProtocolError(f"rank must be in [0, {world_size}), got {hello.rank}")


def routing_key(msg: Message) -> tuple[Any, ...] | None:
    """The key under which a rank waits for ``msg`` (coordinator -> rank
    replies); None for messages that fail every waiter (Error, Shutdown)."""
    if isinstance(msg, CollectiveResult):
        return ("coll", msg.gid, msg.seq)
    if isinstance(msg, P2PData):
        return ("p2p", msg.src, msg.dst, msg.tag, msg.pseq)
    if isinstance(msg, SlotGrant):
        return ("slot",)
    if isinstance(msg, Welcome):
        return ("welcome",)
    if isinstance(msg, ClockEcho):
        return ("clock", msg.seq)
    return None
