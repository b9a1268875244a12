"""PrismTrace's codec: records <-> JSON lines, and a rank file's bytes -> records.

Specified in ``docs/TRACE.md``. One orjson object per record, tagged by
``"k"``; the fields are converted and checked by the shared reflective codec
(``prism.core.codec``) in both directions. ``parse_rank_file`` turns the
bytes of a whole rank file into its records and the damage found; the shell
(``prism.shell.runfolder``) reads the bytes.
"""

from __future__ import annotations

import typing
from typing import Any

import orjson

from prism.core import codec
from prism.core.trace.records import (
    EVENT_TYPES,
    TRACE_VERSION,
    TRACE_VERSION_MINOR,
    Event,
    Manifest,
    RankEnd,
    TraceWarning,
)

__all__ = [
    "TraceFormatError",
    "TraceVersionError",
    "UnknownKindError",
    "decode_event",
    "decode_manifest",
    "encode_event",
    "encode_manifest",
    "parse_rank_file",
]

#: Fields added by a minor version, with the minor that added them: a file of an
#: older minor lacks them and gets the field's default (docs/TRACE.md).
_ADDED_IN_MINOR: dict[tuple[str, str], int] = {
    ("compute", "cpu_ns"): 1,
    ("compute", "gpu_ns"): 1,
    ("compute", "join"): 1,
    ("compute", "free_ns"): 2,
    ("compute", "cold_ns"): 2,
    ("compute", "thread_cpu_ns"): 4,
}

_KINDS: dict[str, type] = {t.KIND: t for t in EVENT_TYPES}


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


def _describe(hint: Any) -> str:
    """PrismTrace's name for values of ``hint``: ``"list of int"``, ``"[str, int]"``."""
    names = {int: "int", str: "str", bool: "bool", float: "finite float", bytes: "bytes"}
    if hint in names:
        return names[hint]
    inner = codec.optional_of(hint)
    if inner is not None:
        return _describe(inner) + " or null"
    args = typing.get_args(hint)
    if args[-1] is Ellipsis:
        return "list of " + _describe(args[0])
    return "[" + ", ".join(_describe(a) for a in args) + "]"


def _expected(hint: Any, reason: str, encoding: bool) -> str:
    """What a value of ``hint`` must be, as the error message says it: the
    writer holds tuples and bytes, the file holds lists and base64 text."""
    if hint is int and reason == codec.RANGE:
        return "int in the 64-bit range"
    if hint is bytes:
        return "bytes" if encoding else "base64 str"
    inner = codec.optional_of(hint)
    if inner is not None:
        return _expected(inner, reason, encoding) + " or null"
    args = typing.get_args(hint)
    if args and args[-1] is Ellipsis:
        return ("tuple of " if encoding else "list of ") + _describe(args[0])
    if args:
        return ("tuple " if encoding else "list ") + _describe(hint)
    return _describe(hint)


_SCHEMAS: dict[type, codec.Schema] = {t: codec.schema(t) for t in (*EVENT_TYPES, Manifest)}
_MISSING = object()


def _encode_obj(obj: Any) -> dict[str, Any]:
    schema = _SCHEMAS.get(type(obj))
    if schema is None:
        raise TypeError(f"not a PrismTrace record: {_short(obj)} (a {type(obj).__name__})")
    out: dict[str, Any] = {"k": schema.cls.KIND}
    for name, plain, _, enc, _ in schema.rows:
        v = getattr(obj, name)
        if type(v) is plain and (plain is not int or -(2**63) <= v < 2**64):
            out[name] = v
            continue
        try:
            out[name] = enc(v)
        except codec.Mismatch as e:
            raise TraceFormatError(
                f"cannot encode {schema.cls.KIND} record: field {name}{e.path} must be "
                f"{_expected(e.hint, e.reason, True)}, got {_short(e.value)}; "
                "the code that built the record is at fault",
                field=name + e.path,
                value=e.value,
            ) from None
    return out


def _decode_obj(schema: codec.Schema, obj: dict[str, Any], *, ignore_unknown: bool,
                minor: int = TRACE_VERSION_MINOR) -> Any:
    kind = schema.cls.KIND
    kwargs: dict[str, Any] = {}
    for name, plain, _, _, dec in schema.rows:
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
        except codec.Mismatch as e:
            raise TraceFormatError(
                f"{kind} record: field {name}{e.path} must be {_expected(e.hint, e.reason, False)}, "
                f"got {_short(e.value)}",
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


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_rank_file(data: bytes, file: str, *, ignore_unknown: bool = False,
                    minor: int = TRACE_VERSION_MINOR,
                    expect_end: bool = True) -> tuple[list[Event], list[int], list[TraceWarning]]:
    """The records of a rank file's bytes, their 1-based line numbers, and
    the damage found; damage is reported, never raised.

    Parsing stops at the first line that is torn (no final newline), empty,
    not JSON or not a valid record, with a ``TraceWarning`` naming ``file``,
    the line and what is wrong; the records before it are returned intact. A
    file that ends without ``rank_end`` gets a warning too (the rank crashed,
    was killed, or is still running). ``ignore_unknown`` (for a manifest with
    a newer minor version) skips unknown record kinds and fields instead of
    stopping; ``minor`` is the file's minor version. ``expect_end=False``
    reads a file of records that has no ``rank_end`` (a payload file).
    """
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
                warnings.append(TraceWarning(file, i, f"{e}; stopped reading here"))
                damaged = True
                break
            if str(e.value) not in skipped_kinds:
                skipped_kinds.add(str(e.value))
                warnings.append(
                    TraceWarning(file, i, f"skipped records of unknown kind {e.value!r} (newer minor version)")
                )
            continue
        except TraceFormatError as e:
            warnings.append(TraceWarning(file, i, f"corrupted record: {e}; stopped reading here"))
            damaged = True
            break
        events.append(ev)
        lines.append(i)
    else:
        if tail:
            warnings.append(
                TraceWarning(
                    file,
                    len(whole) + 1,
                    f"torn last line ({len(tail)} bytes, no newline): the writer stopped mid-record; skipped",
                )
            )
            damaged = True
    if expect_end and not damaged and not (events and type(events[-1]) is RankEnd):
        warnings.append(
            TraceWarning(
                file,
                len(whole) + 1,
                "file ends without rank_end: the rank crashed, was killed, or is still running",
            )
        )
    return events, lines, warnings
