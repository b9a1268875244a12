"""PrismTrace v1: the records of a captured run and how they are stored.

Specified in ``docs/TRACE.md``. This module holds the event types, the group
identity (``group_id``), the codec (``encode_event``/``decode_event``,
``encode_manifest``/``decode_manifest``), the run directory layout
(``rank_path`` ...), the streaming ``TraceWriter``, the reader
(``read_rank_file``, ``read_run``) and the validator (``validate_run``). It
stays sans-IO in the project's sense: plain file I/O through ``os`` and
``pathlib``, no sockets, no clock, no trio, zmq or torch.

Times are integer nanoseconds on the recording rank's monotonic clock;
``RankStart.clock_offset_ns`` converts them to the coordinator's clock
(``coordinator_ns = rank_ns + clock_offset_ns``).

Every event is a frozen, slotted dataclass whose ``KIND`` class attribute is
its tag on disk. Tuples (never lists) hold sequences so events stay hashable.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import math
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import orjson

__all__ = [
    "COLLECTIVE_OPS",
    "CALIBRATION_DIR",
    "DEFAULT_SMALL_TENSOR_LIMIT",
    "DTYPE_ITEMSIZE",
    "EMULATION_DIR",
    "EVENT_TYPES",
    "LOGS_DIR",
    "MANIFEST_NAME",
    "P2P",
    "P2P_OPS",
    "PREDICTIONS_DIR",
    "RANKS_DIR",
    "REDUCE_OPS",
    "REDUCING_OPS",
    "ROOTED_OPS",
    "RUN_SUBDIRS",
    "TELEMETRY_DIR",
    "TRACE_VERSION",
    "TRACE_VERSION_MINOR",
    "Collective",
    "Compute",
    "Event",
    "GroupCreated",
    "Iteration",
    "Manifest",
    "Memory",
    "Problem",
    "RankEnd",
    "RankStart",
    "RankTrace",
    "Run",
    "TensorValue",
    "TraceFormatError",
    "TraceVersionError",
    "TraceWarning",
    "TraceWriter",
    "UnknownKindError",
    "decode_event",
    "decode_manifest",
    "encode_event",
    "encode_manifest",
    "group_id",
    "log_path",
    "make_run_dir",
    "manifest_path",
    "rank_of_path",
    "rank_path",
    "read_rank_file",
    "read_run",
    "validate_run",
    "write_manifest",
    "write_run",
]

#: Major version: a reader refuses a major it does not know.
TRACE_VERSION = 1
#: Minor version: a newer minor only adds optional fields and event kinds, so
#: older readers skip what they do not know (see ``docs/TRACE.md``).
TRACE_VERSION_MINOR = 2
#: Fields added by a minor version, with the minor that added them: a file of an
#: older minor lacks them and gets the field's default (docs/TRACE.md).
_ADDED_IN_MINOR: dict[tuple[str, str], int] = {
    ("compute", "cpu_ns"): 1,
    ("compute", "gpu_ns"): 1,
    ("compute", "join"): 1,
    ("compute", "free_ns"): 2,
    ("compute", "cold_ns"): 2,
}
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

_KINDS: dict[str, type] = {t.KIND: t for t in EVENT_TYPES}


# --------------------------------------------------------------------------
# Group identity
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# Codec: one orjson object per record, tagged by "k"
# --------------------------------------------------------------------------


class TraceFormatError(ValueError):
    """A record or manifest does not follow PrismTrace.

    The fault is in the file (or in the code that wrote it); the message names
    the record kind, the field and the offending value. ``field`` is the field
    path (e.g. ``"in_shapes[1][0]"``) or ``None`` when the whole record is bad.
    """

    def __init__(self, message: str, *, field: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


class TraceVersionError(TraceFormatError):
    """The manifest names a major version this reader does not know."""


class UnknownKindError(TraceFormatError):
    """A record's kind ``"k"`` is not one this reader knows."""


def _short(value: object) -> str:
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


class _Bad(Exception):
    """Internal: a value failed its type. ``path`` is relative to the value
    being converted (``""``, ``"[1][0]"``); containers prepend their index."""

    def __init__(self, path: str, value: object, expected: str) -> None:
        self.path, self.value, self.expected = path, value, expected


# A converter is (describe, encode(value), decode(value)); both directions
# check the type so the writer never emits what the reader rejects.
_Fn = Callable[[Any], Any]
_Conv = tuple[str, _Fn, _Fn]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _scalar(expected: str, ok: Callable[[Any], bool]) -> _Conv:
    def check(v: Any) -> Any:
        if not ok(v):
            raise _Bad("", v, expected)
        return v

    return expected, check, check


def _check_int(v: Any) -> int:
    if not _is_int(v):
        raise _Bad("", v, "int")
    # orjson's range: signed or unsigned 64-bit.
    if not -(2**63) <= v < 2**64:
        raise _Bad("", v, "int in the 64-bit range")
    return v


def _enc_float(v: Any) -> float:
    # JSON does not tell 2 from 2.0, so an int is a valid float; NaN and
    # infinities have no JSON form (orjson would write null).
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _Bad("", v, "finite float")
    return float(v)


def _enc_bytes(v: Any) -> str:
    if not isinstance(v, bytes):
        raise _Bad("", v, "bytes")
    return base64.b64encode(v).decode("ascii")


def _dec_bytes(v: Any) -> bytes:
    if not isinstance(v, str):
        raise _Bad("", v, "base64 str")
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise _Bad("", v, "base64 str") from None


def _optional(conv: _Fn) -> _Fn:
    def run(v: Any) -> Any:
        if v is None:
            return None
        try:
            return conv(v)
        except _Bad as e:
            raise _Bad(e.path, e.value, e.expected + " or null" if not e.path else e.expected) from None

    return run


def _items(conv: _Fn, plain: type | None, v: Any) -> list[Any]:
    if plain is not None and all(type(x) is plain for x in v):
        return list(v)
    out = []
    for i, x in enumerate(v):
        try:
            out.append(conv(x))
        except _Bad as e:
            raise _Bad(f"[{i}]{e.path}", e.value, e.expected) from None
    return out


def _conv_for(tp: Any) -> _Conv:
    if tp is int:
        return "int", _check_int, _check_int
    if tp is str:
        return _scalar("str", lambda v: isinstance(v, str))
    if tp is bool:
        return _scalar("bool", lambda v: isinstance(v, bool))
    if tp is float:
        return "finite float", _enc_float, _enc_float
    if tp is bytes:
        return "bytes", _enc_bytes, _dec_bytes
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        desc, enc, dec = _conv_for(next(a for a in args if a is not type(None)))
        return f"{desc} or null", _optional(enc), _optional(dec)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        desc, enc, dec = _conv_for(args[0])
        # Plain ints are checked in one pass (most sequences are shapes).
        plain = int if args[0] is int else None

        def enc_seq(v: Any) -> Any:
            # Tuples, never lists: events must stay hashable.
            if not isinstance(v, tuple):
                raise _Bad("", v, f"tuple of {desc}")
            return _items(enc, plain, v)

        def dec_seq(v: Any) -> Any:
            if not isinstance(v, list):
                raise _Bad("", v, f"list of {desc}")
            return tuple(_items(dec, plain, v))

        return f"list of {desc}", enc_seq, dec_seq
    if origin is tuple and args and Ellipsis not in args:
        convs = [_conv_for(a) for a in args]
        desc = "[" + ", ".join(c[0] for c in convs) + "]"

        def fixed(i_conv: int, kind: type, what: str) -> _Fn:
            def run(v: Any) -> Any:
                if not isinstance(v, kind) or len(v) != len(convs):
                    raise _Bad("", v, f"{what} {desc}")
                out = []
                for i, (c, x) in enumerate(zip(convs, v)):
                    try:
                        out.append(c[i_conv](x))
                    except _Bad as e:
                        raise _Bad(f"[{i}]{e.path}", e.value, e.expected) from None
                return out if kind is tuple else tuple(out)

            return run

        return desc, fixed(1, tuple, "tuple"), fixed(2, list, "list")
    raise TypeError(f"PrismTrace codec has no converter for {tp!r}; please report this")


@dataclass(frozen=True, slots=True)
class _Schema:
    cls: type
    names: tuple[str, ...]
    convs: tuple[_Conv, ...]
    #: Per field: int, str or bool when a value of exactly that type needs no
    #: conversion (the common case, checked inline for speed), else None.
    plain: tuple[type | None, ...]


def _schema(cls: type) -> _Schema:
    hints = typing.get_type_hints(cls)
    fs = dataclasses.fields(cls)
    return _Schema(
        cls,
        tuple(f.name for f in fs),
        tuple(_conv_for(hints[f.name]) for f in fs),
        tuple(hints[f.name] if hints[f.name] in (int, str, bool) else None for f in fs),
    )


_SCHEMAS: dict[type, _Schema] = {t: _schema(t) for t in (*EVENT_TYPES, Manifest)}
_MISSING = object()


def _encode_obj(obj: Any) -> dict[str, Any]:
    schema = _SCHEMAS.get(type(obj))
    if schema is None:
        raise TypeError(f"not a PrismTrace record: {_short(obj)} (a {type(obj).__name__})")
    out: dict[str, Any] = {"k": schema.cls.KIND}
    for name, plain, (_, enc, _) in zip(schema.names, schema.plain, schema.convs):
        v = getattr(obj, name)
        if type(v) is plain and (plain is not int or -(2**63) <= v < 2**64):
            out[name] = v
            continue
        try:
            out[name] = enc(v)
        except _Bad as e:
            raise TraceFormatError(
                f"cannot encode {schema.cls.KIND} record: field {name}{e.path} must be {e.expected}, "
                f"got {_short(e.value)}; the code that built the record is at fault",
                field=name + e.path,
                value=e.value,
            ) from None
    return out


def _decode_obj(schema: _Schema, obj: dict[str, Any], *, ignore_unknown: bool,
                minor: int = TRACE_VERSION_MINOR) -> Any:
    kind = schema.cls.KIND
    kwargs: dict[str, Any] = {}
    for name, plain, (_, _, dec) in zip(schema.names, schema.plain, schema.convs):
        v = obj.get(name, _MISSING)
        if type(v) is plain:
            kwargs[name] = v
            continue
        if v is _MISSING:
            # Writers write every field, defaults included, so a missing one is
            # damage, unless the file's minor predates the field (it then
            # gets the field's default; see docs/TRACE.md).
            if _ADDED_IN_MINOR.get((kind, name), 0) > minor:
                continue
            raise TraceFormatError(f"{kind} record is missing field {name!r}", field=name)
        try:
            kwargs[name] = dec(v)
        except _Bad as e:
            raise TraceFormatError(
                f"{kind} record: field {name}{e.path} must be {e.expected}, got {_short(e.value)}",
                field=name + e.path,
                value=e.value,
            ) from None
    if not ignore_unknown and len(obj) != len(kwargs) + 1:  # + 1: "k"
        for name in obj:
            if name != "k" and name not in kwargs:
                raise TraceFormatError(
                    f"{kind} record has unknown field {name!r} (value {_short(obj[name])}); "
                    f"PrismTrace {TRACE_VERSION}.{TRACE_VERSION_MINOR} has no such field",
                    field=name,
                    value=obj[name],
                )
    return schema.cls(**kwargs)


def _load(data: bytes | str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(data, dict):
        return data
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise TraceFormatError(f"not JSON ({e}): {_short(data)}", value=data) from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"a record must be a JSON object, got {_short(obj)}", value=obj)
    return obj


def encode_event(ev: Event) -> bytes:
    """One record as a single JSON line (no trailing newline).

    Keys: ``"k"`` (the event's ``KIND``) then every field in declaration
    order; ``bytes`` as base64 strings, tuples as lists. Raises
    ``TraceFormatError`` naming the field when a value has the wrong type
    (e.g. a list where a tuple belongs, a bool where an int belongs, NaN).
    """
    if type(ev) is Manifest:
        raise TypeError("encode_event got a Manifest; use encode_manifest")
    return orjson.dumps(_encode_obj(ev))


def decode_event(data: bytes | str | dict[str, Any], *, ignore_unknown: bool = False,
                 minor: int = TRACE_VERSION_MINOR) -> Event:
    """Parse one record (a JSON line, or an already parsed object).

    Strict: an unknown kind (``UnknownKindError``), a missing or extra field
    or a value of the wrong type raises ``TraceFormatError`` naming the field
    and the value. ``ignore_unknown=True`` drops extra fields; readers pass it
    only for files whose manifest has a newer minor version than they know;
    ``minor`` is the file's minor version (fields added after it get their
    defaults).
    """
    obj = _load(data)
    kind = obj.get("k")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        if "k" not in obj:
            raise TraceFormatError(f"record has no kind field 'k': {_short(obj)}", field="k")
        raise UnknownKindError(
            f"unknown record kind {kind!r}; PrismTrace {TRACE_VERSION}.{TRACE_VERSION_MINOR} knows "
            + ", ".join(_KINDS),
            field="k",
            value=kind,
        )
    return _decode_obj(_SCHEMAS[cls], obj, ignore_unknown=ignore_unknown, minor=minor)


def encode_manifest(manifest: Manifest) -> bytes:
    """``manifest.json``'s content: indented JSON with a trailing newline."""
    if type(manifest) is not Manifest:
        raise TypeError(f"encode_manifest needs a Manifest, got {type(manifest).__name__}")
    return orjson.dumps(_encode_obj(manifest), option=orjson.OPT_INDENT_2) + b"\n"


def decode_manifest(data: bytes | str | dict[str, Any], *, file: str = "manifest.json") -> Manifest:
    """Parse a manifest, applying the version policy (see ``docs/TRACE.md``).

    A major ``version`` other than ``TRACE_VERSION`` raises
    ``TraceVersionError`` naming ``file`` and both versions. A newer
    ``version_minor`` is accepted and its unknown fields are ignored; with the
    same or an older minor, unknown fields are errors.
    """
    obj = _load(data)
    if obj.get("k") != Manifest.KIND:
        raise TraceFormatError(f"{file}: not a manifest (kind {_short(obj.get('k'))}, expected 'manifest')", field="k")
    major, minor = obj.get("version"), obj.get("version_minor")
    if not _is_int(major) or not _is_int(minor):
        raise TraceFormatError(
            f"{file}: version and version_minor must be ints, got {_short(major)} and {_short(minor)}",
            field="version",
            value=(major, minor),
        )
    if major != TRACE_VERSION:
        raise TraceVersionError(
            f"{file} was written with PrismTrace {major}.{minor}; this reader knows only major "
            f"version {TRACE_VERSION} (up to {TRACE_VERSION}.{TRACE_VERSION_MINOR}). "
            + ("Upgrade Prism to read it." if major > TRACE_VERSION else "Re-capture the run with this Prism."),
            field="version",
            value=major,
        )
    try:
        return _decode_obj(_SCHEMAS[Manifest], obj, ignore_unknown=minor > TRACE_VERSION_MINOR)
    except TraceFormatError as e:
        raise TraceFormatError(f"{file}: {e}", field=e.field, value=e.value) from None


# --------------------------------------------------------------------------
# Run directory layout
# --------------------------------------------------------------------------

#: ``RUN/manifest.json``: the Manifest, written once, atomically.
MANIFEST_NAME = "manifest.json"
#: ``RUN/ranks/rank-000012.jsonl``: one append-only record file per rank.
RANKS_DIR = "ranks"
#: ``RUN/logs/rank-000012.log``: the rank's stdout and stderr (the launcher).
LOGS_DIR = "logs"
#: Reserved for later stages (see docs/TRACE.md, "Run directory").
CALIBRATION_DIR = "calibration"
PREDICTIONS_DIR = "predictions"
EMULATION_DIR = "emulation"
TELEMETRY_DIR = "telemetry"
RUN_SUBDIRS = (RANKS_DIR, LOGS_DIR, CALIBRATION_DIR, PREDICTIONS_DIR, EMULATION_DIR, TELEMETRY_DIR)

_RANK_FILE = re.compile(r"rank-(\d+)\.jsonl")


def manifest_path(run_dir: str | os.PathLike[str]) -> Path:
    """``RUN/manifest.json``."""
    return Path(run_dir) / MANIFEST_NAME


def rank_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """``RUN/ranks/rank-000012.jsonl`` (six digits at least, wider past 999999)."""
    return Path(run_dir) / RANKS_DIR / f"rank-{rank:06d}.jsonl"


def log_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """``RUN/logs/rank-000012.log``: where the launcher puts the rank's output."""
    return Path(run_dir) / LOGS_DIR / f"rank-{rank:06d}.log"


def rank_of_path(path: str | os.PathLike[str]) -> int | None:
    """The rank a rank file's name encodes, or None if it is not a rank file."""
    name = Path(path).name
    m = _RANK_FILE.fullmatch(name)
    # Only the canonical spelling, so two names cannot claim one rank.
    if m is None or name != rank_path("", int(m.group(1))).name:
        return None
    return int(m.group(1))


def make_run_dir(run_dir: str | os.PathLike[str]) -> Path:
    """Create ``run_dir`` and all its subdirectories (existing ones are kept)."""
    root = Path(run_dir)
    for sub in RUN_SUBDIRS:
        (root / sub).mkdir(parents=True, exist_ok=True)
    return root


def write_manifest(run_dir: str | os.PathLike[str], manifest: Manifest) -> Path:
    """Create the run directory's layout and write ``manifest.json`` atomically.

    The manifest goes to a temporary file that is then renamed over the final
    name, so a reader sees either no manifest or a whole one.
    """
    make_run_dir(run_dir)
    path = manifest_path(run_dir)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(encode_manifest(manifest))
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------
# Streaming writer
# --------------------------------------------------------------------------


class TraceWriter:
    """Appends one rank's records to ``RUN/ranks/rank-NNNNNN.jsonl``.

    Lines are buffered in memory and handed to the OS in one ``write`` every
    ``flush_every`` records, on ``flush()`` and on ``close()``; the file is
    unbuffered underneath, so after a crash of the process at any point the
    file holds whole lines followed by at most one torn line, which readers
    report and skip. (``flush`` does not fsync: a power loss may lose more.)
    Shells should ``flush()`` before a rank blocks, so a hang or kill loses
    nothing that happened before it.
    """

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, *, flush_every: int = 64) -> None:
        if flush_every < 1:
            raise ValueError(f"TraceWriter: flush_every must be >= 1, got {flush_every}")
        self.path = rank_path(run_dir, rank)
        self.rank = rank
        self._flush_every = flush_every
        self._lines: list[bytes] = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (closed by close())
        try:
            self._refuse_torn_tail()
        except BaseException:
            self._file.close()
            raise

    def _refuse_torn_tail(self) -> None:
        size = os.fstat(self._file.fileno()).st_size
        if size == 0:
            return
        with open(self.path, "rb") as f:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                raise TraceFormatError(
                    f"{self.path} ends with a torn line (an earlier writer crashed); appending would "
                    "bury the damage in the middle of the file. Capture into a fresh run directory."
                )

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run."""
        return self._file.closed

    def write(self, ev: Event) -> None:
        """Queue one record; it reaches the file by the next flush."""
        if self._file.closed:
            raise ValueError(f"TraceWriter for rank {self.rank} ({self.path}) is closed")
        self._lines.append(encode_event(ev) + b"\n")
        if len(self._lines) >= self._flush_every:
            self.flush()

    def write_line(self, line: bytes) -> None:
        """Queue one record already encoded by ``encode_event`` (as a rank
        ships them to the coordinator); it must be a single line."""
        if self._file.closed:
            raise ValueError(f"TraceWriter for rank {self.rank} ({self.path}) is closed")
        if b"\n" in line or not line.startswith(b'{"k":'):
            raise TraceFormatError(
                f"rank {self.rank} sent a trace record that is not one encoded line: {line[:80]!r}; "
                "this is a Prism bug, please report it"
            )
        self._lines.append(line + b"\n")
        if len(self._lines) >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        """Hand every queued line to the OS (survives a crash of this process)."""
        if not self._lines or self._file.closed:
            return
        view = memoryview(b"".join(self._lines))
        self._lines.clear()
        # An unbuffered file may write less than asked (rare on regular files).
        while view:
            n = self._file.write(view)
            view = view[n:]

    def close(self) -> None:
        """Flush and close; closing twice is harmless."""
        if self._file.closed:
            return
        try:
            self.flush()
        finally:
            self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------


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


def read_rank_file(path: str | os.PathLike[str], *, ignore_unknown: bool = False,
                   minor: int = TRACE_VERSION_MINOR) -> RankTrace:
    """Read one rank file; damage is reported, never raised.

    Reading stops at the first line that is torn (no final newline), empty,
    not JSON or not a valid record, with a ``TraceWarning`` naming the file,
    the line and what is wrong; the records before it are returned intact. A
    file that ends without ``rank_end`` gets a warning too (the rank crashed,
    was killed, or is still running). The rank comes from the file name
    (``rank-NNNNNN.jsonl``), else from the first record if it is
    ``rank_start``. ``ignore_unknown`` (for a manifest with a newer minor
    version) skips unknown record kinds and fields instead of stopping.
    """
    p = Path(path)
    data = p.read_bytes()
    events: list[Event] = []
    lines: list[int] = []
    warnings: list[TraceWarning] = []
    skipped_kinds: set[str] = set()
    chunks = data.split(b"\n")
    # After the last newline comes either b"" (clean end) or a torn line.
    whole, tail = chunks[:-1], chunks[-1]
    damaged = False
    for i, raw in enumerate(whole, start=1):
        try:
            if not raw.strip():
                raise TraceFormatError("empty line")
            ev = decode_event(raw, ignore_unknown=ignore_unknown, minor=minor)
        except UnknownKindError as e:
            if not ignore_unknown:
                warnings.append(TraceWarning(str(p), i, f"{e}; stopped reading here"))
                damaged = True
                break
            if str(e.value) not in skipped_kinds:
                skipped_kinds.add(str(e.value))
                warnings.append(
                    TraceWarning(str(p), i, f"skipped records of unknown kind {e.value!r} (newer minor version)")
                )
            continue
        except TraceFormatError as e:
            warnings.append(TraceWarning(str(p), i, f"corrupted record: {e}; stopped reading here"))
            damaged = True
            break
        events.append(ev)
        lines.append(i)
    else:
        if tail:
            warnings.append(
                TraceWarning(
                    str(p),
                    len(whole) + 1,
                    f"torn last line ({len(tail)} bytes, no newline): the writer stopped mid-record; skipped",
                )
            )
            damaged = True
    if not damaged and not (events and type(events[-1]) is RankEnd):
        warnings.append(
            TraceWarning(
                str(p),
                len(whole) + 1,
                "file ends without rank_end: the rank crashed, was killed, or is still running",
            )
        )
    rank = rank_of_path(p)
    if rank is None:
        if events and type(events[0]) is RankStart:
            rank = events[0].rank
        else:
            raise ValueError(
                f"{p}: cannot tell which rank this file belongs to: name it rank-NNNNNN.jsonl "
                "or start it with a rank_start record"
            )
    return RankTrace(str(p), rank, events, lines, warnings)


@dataclass(frozen=True, slots=True)
class Run:
    """A run directory as read (or a synthetic run built in memory).

    ``ranks`` maps each rank to its records. ``lines`` gives their line
    numbers (missing for synthetic runs: the validator then numbers records
    from 1). ``path`` is the run directory (used to name files in messages).
    """

    path: str
    manifest: Manifest
    ranks: dict[int, list[Event]]
    warnings: list[TraceWarning] = dataclasses.field(default_factory=list)
    lines: dict[int, list[int]] = dataclasses.field(default_factory=dict)


def read_run(run_dir: str | os.PathLike[str]) -> Run:
    """Read a run directory: the manifest and every ``ranks/rank-*.jsonl``.

    Raises ``TraceFormatError`` (``TraceVersionError`` for an unknown major
    version) when the manifest is missing or invalid: without it nothing can
    be interpreted. Damage in rank files becomes warnings (``read_rank_file``).
    """
    root = Path(run_dir)
    mpath = manifest_path(root)
    try:
        raw = mpath.read_bytes()
    except FileNotFoundError:
        raise TraceFormatError(
            f"{mpath} not found: {root} is not a Prism run directory, or the capture stopped before writing it"
        ) from None
    manifest = decode_manifest(raw, file=str(mpath))
    newer = manifest.version_minor > TRACE_VERSION_MINOR
    warnings: list[TraceWarning] = []
    if newer:
        warnings.append(
            TraceWarning(
                str(mpath),
                0,
                f"written by PrismTrace {manifest.version}.{manifest.version_minor}, this reader knows "
                f"{TRACE_VERSION}.{TRACE_VERSION_MINOR}: unknown fields and record kinds are ignored",
            )
        )
    ranks: dict[int, list[Event]] = {}
    lines: dict[int, list[int]] = {}
    rdir = root / RANKS_DIR
    files = sorted(rdir.iterdir()) if rdir.is_dir() else []
    for f in files:
        rank = rank_of_path(f)
        if rank is None:
            warnings.append(TraceWarning(str(f), 0, "not a rank file (expected rank-NNNNNN.jsonl); ignored"))
            continue
        rt = read_rank_file(f, ignore_unknown=newer, minor=manifest.version_minor)
        ranks[rank] = rt.events
        lines[rank] = rt.lines
        warnings.extend(rt.warnings)
    return Run(str(root), manifest, dict(sorted(ranks.items())), warnings, dict(sorted(lines.items())))


def write_run(run_dir: str | os.PathLike[str], manifest: Manifest, ranks: Mapping[int, Iterable[Event]]) -> Path:
    """Write a whole run at once (tests, converters): manifest and rank files."""
    root = write_manifest(run_dir, manifest).parent
    for rank, events in ranks.items():
        with TraceWriter(root, rank) as w:
            for ev in events:
                w.write(ev)
    return root


# --------------------------------------------------------------------------
# Validator
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Problem:
    """A rule of PrismTrace that a run breaks (the writer's fault, or Prism's).

    ``line`` is 1-based, 0 for the whole file; ``rank`` is None for problems
    of the run as a whole; ``field`` is the offending field ("" if none).
    """

    file: str
    line: int
    rank: int | None
    field: str
    message: str

    def __str__(self) -> str:
        who = "-" if self.rank is None else str(self.rank)
        return f"{self.file}:{self.line} rank {who} {self.field or '-'}: {self.message}"


_COLL_REF = re.compile(r"coll:([^:]+):(\d+):((?:in|out)\d*)")
_P2P_REF = re.compile(r"p2p:(\d+):(\d+):(-?\d+):(\d+)")


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


class _RankChecker:
    """The per-rank rules; one instance per rank file."""

    def __init__(self, run: Run, rank: int, out: list[Problem]) -> None:
        self.run, self.rank, self.out = run, rank, out
        self.file = str(rank_path(run.path, rank))
        self.ws = run.manifest.world_size
        self.groups: dict[str, GroupCreated] = {}
        self.seqs: dict[str, dict[int, int]] = {}  # gid -> seq -> line
        self.pseqs: dict[tuple[str, int, int], dict[int, int]] = {}  # (op, peer, tag) -> pseq -> line
        self.last_step: tuple[int, int] | None = None  # (step, line)

    def bad(self, line: int, field: str, message: str) -> None:
        self.out.append(Problem(self.file, line, self.rank, field, message))

    def check(self, events: list[Event], lines: list[int]) -> None:
        if not 0 <= self.rank < self.ws:
            self.bad(0, "rank", f"rank file for rank {self.rank}, outside the world of {self.ws} ranks")
        if not events:
            self.bad(1, "k", "first record must be rank_start; the file has no records")
        ended_at: int | None = None
        for i, ev in enumerate(events):
            line = lines[i] if i < len(lines) else i + 1
            if ended_at is not None:
                self.bad(line, "k", f"{ev.KIND} record after rank_end (line {ended_at}); rank_end must be last")
            if i == 0:
                self.check_first(ev, line)
            elif type(ev) is RankStart:
                self.bad(line, "k", "rank_start again; it must be the first record only")
            if type(ev) is RankEnd and ended_at is None:
                ended_at = line
            step = getattr(ev, "step", None)
            if step is not None:
                self.check_step(step, line)
            method = self._BY_KIND.get(type(ev))
            if method is not None:
                method(self, ev, line)
        self.check_contiguous()

    def check_first(self, ev: Event, line: int) -> None:
        if type(ev) is not RankStart:
            self.bad(line, "k", f"first record must be rank_start, got {ev.KIND}")
            return
        if ev.rank != self.rank:
            self.bad(line, "rank", f"rank_start says rank {ev.rank} in the file of rank {self.rank}")
        if ev.world_size != self.ws:
            self.bad(line, "world_size", f"rank_start says world_size {ev.world_size}, the manifest {self.ws}")

    def check_step(self, step: int, line: int) -> None:
        if step < 0:
            self.bad(line, "step", f"step {step} is negative")
        if self.last_step is not None and step < self.last_step[0]:
            self.bad(
                line, "step", f"step went back from {self.last_step[0]} (line {self.last_step[1]}) to {step}"
            )
        if self.last_step is None or step > self.last_step[0]:
            self.last_step = (step, line)

    def check_times(self, ev: Collective | P2P, line: int, what: str) -> None:
        if not ev.issue_ns <= ev.wait_ns <= ev.end_ns:
            self.bad(
                line,
                "issue_ns" if ev.issue_ns > ev.wait_ns else "wait_ns",
                f"{what}: times must satisfy issue_ns <= wait_ns <= end_ns, got "
                f"{ev.issue_ns}, {ev.wait_ns}, {ev.end_ns}",
            )

    def check_dtype(self, dtype: str, line: int, what: str) -> int | None:
        size = DTYPE_ITEMSIZE.get(dtype)
        if size is None:
            self.bad(line, "dtype", f"{what}: unknown dtype {dtype!r} (known: {', '.join(DTYPE_ITEMSIZE)})")
        return size

    def member_group(self, gid: str, line: int, what: str) -> GroupCreated | None:
        g = self.groups.get(gid)
        if g is None:
            self.bad(line, "gid", f"{what}: group {gid!r} was not declared by a group record before this line")
            return None
        if self.rank not in g.ranks:
            self.bad(line, "gid", f"{what}: rank {self.rank} is not a member of {gid} (ranks {list(g.ranks)})")
        return g

    def check_group(self, ev: GroupCreated, line: int) -> None:
        try:
            expected = group_id(ev.index, ev.ranks)
        except ValueError as e:
            self.bad(line, "ranks", f"group {ev.gid!r}: {e}")
            return
        if ev.gid != expected:
            self.bad(
                line, "gid", f"group gid {ev.gid!r} should be {expected!r} (index {ev.index}, ranks {list(ev.ranks)})"
            )
        if ev.index == 0 and ev.ranks != tuple(range(self.ws)):
            self.bad(line, "ranks", f"world group (index 0) must hold ranks 0..{self.ws - 1}, got {list(ev.ranks)}")
        outside = [r for r in ev.ranks if r >= self.ws]
        if outside or len(set(ev.ranks)) != len(ev.ranks):
            self.bad(
                line, "ranks", f"group {ev.gid}: ranks {list(ev.ranks)} repeat or fall outside the world of {self.ws}"
            )
        old = self.groups.get(ev.gid)
        if old is not None and (old.ranks, old.index) != (ev.ranks, ev.index):
            self.bad(line, "gid", f"group {ev.gid} declared again with other members or index")
        self.groups.setdefault(ev.gid, ev)

    def check_compute(self, ev: Compute, line: int) -> None:
        if ev.start_ns > ev.end_ns:
            self.bad(line, "end_ns", f"compute ends ({ev.end_ns}) before it starts ({ev.start_ns})")

    def check_coll(self, ev: Collective, line: int) -> None:
        what = f"{ev.op} on {ev.gid} seq {ev.seq}"
        self.seqs.setdefault(ev.gid, {})
        if ev.seq < 0:
            self.bad(line, "seq", f"{what}: seq must be >= 0")
        elif ev.seq in self.seqs[ev.gid]:
            self.bad(line, "seq", f"{what}: seq {ev.seq} already used on line {self.seqs[ev.gid][ev.seq]}")
        else:
            self.seqs[ev.gid][ev.seq] = line
        self.check_times(ev, line, what)
        g = self.member_group(ev.gid, line, what)
        if ev.op not in COLLECTIVE_OPS:
            self.bad(line, "op", f"{what}: unknown collective op {ev.op!r} (known: {', '.join(COLLECTIVE_OPS)})")
            return
        if ev.op in REDUCING_OPS:
            if ev.reduce_op not in REDUCE_OPS:
                allowed = ", ".join(REDUCE_OPS)
                self.bad(line, "reduce_op", f"{what}: reduce_op must be one of {allowed}, got {ev.reduce_op!r}")
        elif ev.reduce_op != "":
            self.bad(line, "reduce_op", f"{what}: a non-reducing op must have reduce_op \"\", got {ev.reduce_op!r}")
        if ev.premul is not None and ev.reduce_op != "PREMUL_SUM":
            self.bad(line, "premul", f"{what}: premul {ev.premul} is only meaningful with PREMUL_SUM")
        if any(d < 0 for s in (*ev.in_shapes, *ev.out_shapes) for d in s):
            self.bad(line, "in_shapes", f"{what}: negative dimension in shapes {ev.in_shapes} -> {ev.out_shapes}")
        size = self.check_dtype(ev.dtype, line, what)
        if ev.bytes < 0:
            self.bad(line, "bytes", f"{what}: bytes must be >= 0, got {ev.bytes}")
        elif size is not None:
            expected = size * sum(_numel(s) for s in ev.in_shapes)
            if ev.bytes != expected:
                self.bad(
                    line,
                    "bytes",
                    f"{what}: bytes {ev.bytes} != {expected}, the size of in_shapes {list(ev.in_shapes)} in {ev.dtype}",
                )
        if g is None:
            return
        n = len(g.ranks)
        if ev.op in ROOTED_OPS:
            if not 0 <= ev.root < n:
                self.bad(line, "root", f"{what}: root {ev.root} is not a group rank of {ev.gid} (size {n})")
        elif ev.root != -1:
            self.bad(line, "root", f"{what}: root must be -1 for {ev.op}, got {ev.root}")
        if ev.op == "all_to_all_single":
            self.check_splits(line, what, n, "in_splits", ev.in_splits, ev.in_shapes)
            self.check_splits(line, what, n, "out_splits", ev.out_splits, ev.out_shapes)
        elif ev.op != "all_to_all" and (ev.in_splits or ev.out_splits):
            self.bad(
                line, "in_splits", f"{what}: only all_to_all ops have splits, got {ev.in_splits} / {ev.out_splits}"
            )

    def check_splits(
        self, line: int, what: str, n: int, name: str, splits: tuple[int, ...], shapes: tuple[tuple[int, ...], ...]
    ) -> None:
        if len(shapes) != 1 or not shapes[0]:
            self.bad(line, name, f"{what}: all_to_all_single needs one tensor of rank >= 1, got shapes {list(shapes)}")
            return
        rows = shapes[0][0]
        if not splits:
            if rows % n:
                self.bad(line, name, f"{what}: no {name}, so dim 0 ({rows}) must divide evenly among {n} ranks")
        elif len(splits) != n or any(x < 0 for x in splits) or sum(splits) != rows:
            self.bad(
                line, name, f"{what}: {name} {list(splits)} must be {n} sizes >= 0 summing to dim 0 of {list(shapes[0])}"
            )

    def check_p2p(self, ev: P2P, line: int) -> None:
        what = f"{ev.op} with peer {ev.peer} tag {ev.tag} pseq {ev.pseq}"
        key = (ev.op, ev.peer, ev.tag)
        seen = self.pseqs.setdefault(key, {})
        if ev.pseq < 0:
            self.bad(line, "pseq", f"{what}: pseq must be >= 0")
        elif ev.pseq in seen:
            self.bad(line, "pseq", f"{what}: pseq {ev.pseq} already used on line {seen[ev.pseq]}")
        else:
            seen[ev.pseq] = line
        if ev.op not in P2P_OPS:
            self.bad(line, "op", f"{what}: p2p op must be one of {', '.join(P2P_OPS)}, got {ev.op!r}")
        self.check_times(ev, line, what)
        g = self.member_group(ev.gid, line, what)
        if g is not None and (ev.peer == self.rank or ev.peer not in g.ranks):
            self.bad(line, "peer", f"{what}: peer {ev.peer} must be another member of {ev.gid} (ranks {list(g.ranks)})")
        size = self.check_dtype(ev.dtype, line, what)
        if ev.bytes < 0 or (size is not None and ev.bytes != size * _numel(ev.shape)):
            self.bad(line, "bytes", f"{what}: bytes {ev.bytes} does not match shape {list(ev.shape)} in {ev.dtype}")

    def check_value(self, ev: TensorValue, line: int) -> None:
        what = f"value {ev.ref}"
        if not (_COLL_REF.fullmatch(ev.ref) or _P2P_REF.fullmatch(ev.ref)):
            self.bad(line, "ref", f"{what}: ref must be coll:GID:SEQ:ROLE or p2p:SRC:DST:TAG:PSEQ")
        size = self.check_dtype(ev.dtype, line, what)
        if size is not None and len(ev.data) != size * _numel(ev.shape):
            need = size * _numel(ev.shape)
            got = len(ev.data)
            self.bad(line, "data", f"{what}: {got} bytes of data, but shape {list(ev.shape)} in {ev.dtype} needs {need}")
        limit = self.run.manifest.small_tensor_limit
        if len(ev.data) > limit:
            self.bad(line, "data", f"{what}: {len(ev.data)} bytes exceed the manifest's small_tensor_limit {limit}")

    _BY_KIND: ClassVar[dict[type, Callable[..., None]]] = {
        GroupCreated: check_group,
        Compute: check_compute,
        Collective: check_coll,
        P2P: check_p2p,
        TensorValue: check_value,
    }

    def check_contiguous(self) -> None:
        for gid, seqs in self.seqs.items():
            self.check_gaps(seqs, "seq", f"collectives on {gid}")
        for (op, peer, tag), pseqs in self.pseqs.items():
            self.check_gaps(pseqs, "pseq", f"{op}s with peer {peer} tag {tag}")

    def check_gaps(self, seqs: dict[int, int], field: str, what: str) -> None:
        for expected, got in enumerate(sorted(seqs)):
            if got != expected:
                self.bad(
                    seqs[got], field, f"{what}: {field} {expected} is missing (numbers must run 0, 1, 2, ...; next is {got})"
                )
                return


def validate_run(run: Run) -> list[Problem]:
    """Check every rule of PrismTrace on a run; an empty list means valid.

    Per rank: the first record is ``rank_start`` for the file's rank; nothing
    follows ``rank_end``; ``issue_ns <= wait_ns <= end_ns`` and compute
    ``start_ns <= end_ns``; collective fields are legal (op, reduce_op, root,
    premul, bytes against in_shapes and dtype, all_to_all_single splits
    against shapes and group size); per-group ``seq`` and per-(op, peer, tag)
    ``pseq`` run 0, 1, 2, ... without gaps or repeats; every gid used was
    declared earlier by a group record (with the id ``group_id`` gives) and
    holds the rank; values' sizes match dtype and shape and fit the small-
    tensor limit; steps never decrease. Across ranks: one gid means the same
    members and index everywhere; every rank of the world has a file.
    Collective matching across ranks is the graph's job, not this one's.
    """
    out: list[Problem] = []
    m = run.manifest
    mfile = str(manifest_path(run.path))
    if m.world_size < 1:
        out.append(Problem(mfile, 0, None, "world_size", f"world_size must be >= 1, got {m.world_size}"))
    if m.small_tensor_limit < 0:
        out.append(Problem(mfile, 0, None, "small_tensor_limit", f"must be >= 0, got {m.small_tensor_limit}"))
    for r in range(m.world_size):
        if r not in run.ranks:
            missing = f"no rank file for rank {r} (world_size {m.world_size})"
            out.append(Problem(str(rank_path(run.path, r)), 0, r, "", missing))
    seen: dict[str, tuple[GroupCreated, int, str, int]] = {}
    for rank, events in run.ranks.items():
        checker = _RankChecker(run, rank, out)
        lines = run.lines.get(rank, [])
        checker.check(events, lines)
        for i, ev in enumerate(events):
            if type(ev) is not GroupCreated:
                continue
            line = lines[i] if i < len(lines) else i + 1
            first = seen.setdefault(ev.gid, (ev, rank, checker.file, line))
            g0, r0, f0, l0 = first
            if (g0.ranks, g0.index) != (ev.ranks, ev.index):
                out.append(
                    Problem(
                        checker.file,
                        line,
                        rank,
                        "ranks",
                        f"group {ev.gid} has index {ev.index} ranks {list(ev.ranks)} here but index {g0.index} "
                        f"ranks {list(g0.ranks)} on rank {r0} ({f0}:{l0})",
                    )
                )
    return out
