"""One reflective codec between frozen dataclasses and JSON-able values (sans-IO).

The trace's records (``docs/TRACE.md``) and the wire protocol's messages
(``docs/PROTOCOL.md``) are frozen, slotted dataclasses whose type hints say
what each field holds. ``schema(cls)`` reads the hints once and compiles, per
field, a checked converter each way: ``encode`` turns a field's value into
what orjson writes (tuples become lists, bytes become base64 text) and
``decode`` turns what orjson read back into the field's type (lists become
tuples). Both directions check the type, so a writer never emits what the
reader rejects.

A value of the wrong type raises ``Mismatch``, which carries the path inside
the field (``"[1][0]"``), the offending value, the type hint it failed and
why; each format words its own error message from it, because those
messages are part of each format's contract.

Supported hints: ``int`` (within orjson's 64-bit range), ``str``, ``bool``,
``float`` (finite; an int is accepted, JSON does not tell 2 from 2.0),
``bytes`` (base64 text), ``X | None``, ``tuple[X, ...]`` and fixed tuples
``tuple[X, Y]``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LENGTH", "RANGE", "TYPE", "Field", "Mismatch", "Schema", "converters", "float_fields", "optional_of", "schema",
]

Fn = Callable[[Any], Any]

#: ``Mismatch.reason``: the value has the wrong type, an int falls outside
#: 64 bits, or a fixed tuple has the wrong number of items.
TYPE, RANGE, LENGTH = "type", "range", "length"


class Mismatch(Exception):
    """A value failed its type. ``path`` is relative to the value being
    converted (``""``, ``"[1][0]"``); containers prepend their index, so the
    caller adds the field's name in front."""

    def __init__(self, path: str, value: object, hint: Any, reason: str = TYPE) -> None:
        super().__init__(path, value, hint, reason)
        self.path, self.value, self.hint, self.reason = path, value, hint, reason


def optional_of(hint: Any) -> Any:
    """``X`` for a hint ``X | None``, else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None))
    return None


def _check_int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise Mismatch("", v, int)
    # orjson's range: signed or unsigned 64-bit.
    if not -(2**63) <= v < 2**64:
        raise Mismatch("", v, int, RANGE)
    return v


def _check_str(v: Any) -> str:
    if not isinstance(v, str):
        raise Mismatch("", v, str)
    return v


def _check_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise Mismatch("", v, bool)
    return v


def _check_float(v: Any) -> float:
    # NaN and infinities have no JSON form (orjson would write null).
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise Mismatch("", v, float)
    return float(v)


def _enc_bytes(v: Any) -> str:
    if not isinstance(v, bytes):
        raise Mismatch("", v, bytes)
    return base64.b64encode(v).decode("ascii")


def _dec_bytes(v: Any) -> bytes:
    if not isinstance(v, str):
        raise Mismatch("", v, bytes)
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise Mismatch("", v, bytes) from None


def _optional(conv: Fn, hint: Any) -> Fn:
    def run(v: Any) -> Any:
        if v is None:
            return None
        try:
            return conv(v)
        except Mismatch as e:
            if e.path:
                raise
            raise Mismatch("", e.value, hint, e.reason) from None

    return run


def _items(conv: Fn, plain: type | None, v: Sequence[Any]) -> list[Any]:
    # Plain ints are checked in one pass (most sequences are shapes).
    if plain is not None and all(type(x) is plain for x in v):
        return list(v)
    out = []
    for i, x in enumerate(v):
        try:
            out.append(conv(x))
        except Mismatch as e:
            raise Mismatch(f"[{i}]{e.path}", e.value, e.hint, e.reason) from None
    return out


def converters(hint: Any) -> tuple[Fn, Fn]:
    """``(encode, decode)`` for values of ``hint``; TypeError if unsupported."""
    if hint is int:
        return _check_int, _check_int
    if hint is str:
        return _check_str, _check_str
    if hint is bool:
        return _check_bool, _check_bool
    if hint is float:
        return _check_float, _check_float
    if hint is bytes:
        return _enc_bytes, _dec_bytes
    inner = optional_of(hint)
    if inner is not None:
        enc, dec = converters(inner)
        return _optional(enc, hint), _optional(dec, hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        enc, dec = converters(args[0])
        plain = int if args[0] is int else None

        def enc_seq(v: Any) -> Any:
            # Tuples, never lists: records must stay hashable.
            if not isinstance(v, tuple):
                raise Mismatch("", v, hint)
            return _items(enc, plain, v)

        def dec_seq(v: Any) -> Any:
            if not isinstance(v, list):
                raise Mismatch("", v, hint)
            if plain is not None and all(type(x) is plain for x in v):
                return tuple(v)
            return tuple(_items(dec, None, v))

        return enc_seq, dec_seq
    if origin is tuple and args and Ellipsis not in args:
        convs = [converters(a) for a in args]

        def fixed(direction: int, kind: type) -> Fn:
            def run(v: Any) -> Any:
                if not isinstance(v, kind):
                    raise Mismatch("", v, hint)
                if len(v) != len(convs):
                    raise Mismatch("", v, hint, LENGTH)
                out = []
                for i, (c, x) in enumerate(zip(convs, v)):
                    try:
                        out.append(c[direction](x))
                    except Mismatch as e:
                        raise Mismatch(f"[{i}]{e.path}", e.value, e.hint, e.reason) from None
                return out if kind is tuple else tuple(out)

            return run

        return fixed(0, tuple), fixed(1, list)
    raise TypeError(f"Prism's codec has no converter for {hint!r}; please report this bug")


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a record: its name and hint, whether a value must be
    given, and its converters. ``plain`` is int, str or bool when a value of
    exactly that type needs no conversion (the common case, which callers
    check inline for speed), else None."""

    name: str
    hint: Any
    required: bool
    plain: type | None
    encode: Fn
    decode: Fn


@dataclass(frozen=True, slots=True)
class Schema:
    """The fields of ``cls`` in declaration order; ``rows`` holds each as a
    plain tuple ``(name, plain, required, encode, decode)`` because unpacking
    a tuple is the fastest way through a hot loop."""

    cls: type
    fields: tuple[Field, ...]
    rows: tuple[tuple[str, type | None, bool, Fn, Fn], ...]
    names: tuple[str, ...]


def schema(cls: type, *, skip: Iterable[str] = ()) -> Schema:
    """Compile ``cls``'s fields (all but ``skip``) from its type hints."""
    hints = typing.get_type_hints(cls)
    skipped = set(skip)
    fields = []
    for f in dataclasses.fields(cls):
        if f.name in skipped:
            continue
        hint = hints[f.name]
        try:
            enc, dec = converters(hint)
        except TypeError as e:
            raise TypeError(f"{cls.__name__}.{f.name}: {e}") from None
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        fields.append(Field(f.name, hint, required, hint if hint in (int, str, bool) else None, enc, dec))
    return Schema(
        cls,
        tuple(fields),
        tuple((f.name, f.plain, f.required, f.encode, f.decode) for f in fields),
        tuple(f.name for f in fields),
    )


def float_fields(s: Schema) -> tuple[str, ...]:
    """The fields of ``s`` that may hold a float (``float`` or ``float | None``)."""
    return tuple(f.name for f in s.fields if f.hint is float or optional_of(f.hint) is float)
