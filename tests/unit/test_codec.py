"""The shared reflective codec (prism.core.codec) on its own; the trace's and
the protocol's tests pin the messages each format words from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from prism.core import codec


@dataclass(frozen=True, slots=True)
class Rec:
    n: int
    shapes: tuple[tuple[int, ...], ...]
    pair: tuple[str, int]
    scale: float | None = None
    blob: bytes = b""
    extra: tuple[bytes, ...] = field(default=(), compare=False)


S = codec.schema(Rec, skip=("extra",))
BY_NAME = {f.name: f for f in S.fields}


def test_schema_reads_fields_from_type_hints():
    assert S.names == ("n", "shapes", "pair", "scale", "blob")
    assert [f.required for f in S.fields] == [True, True, True, False, False]
    assert BY_NAME["n"].plain is int and BY_NAME["shapes"].plain is None
    assert codec.float_fields(S) == ("scale",)


def test_converters_round_trip():
    rec = Rec(3, ((2, 3), ()), ("tp", 2), 0.5, b"\x00\xff")
    wire = {f.name: f.encode(getattr(rec, f.name)) for f in S.fields}
    assert wire == {"n": 3, "shapes": [[2, 3], []], "pair": ["tp", 2], "scale": 0.5, "blob": "AP8="}
    assert Rec(**{f.name: f.decode(wire[f.name]) for f in S.fields}) == rec


@pytest.mark.parametrize(
    ("name", "value", "path", "bad", "hint", "reason"),
    [
        ("n", True, "", True, int, codec.TYPE),
        ("n", 2**64, "", 2**64, int, codec.RANGE),
        ("shapes", [[1], [2, "x"]], "[1][1]", "x", int, codec.TYPE),
        ("shapes", [3], "[0]", 3, tuple[int, ...], codec.TYPE),
        ("pair", ["tp"], "", ["tp"], tuple[str, int], codec.LENGTH),
        ("scale", "2", "", "2", float | None, codec.TYPE),
        ("blob", "!!", "", "!!", bytes, codec.TYPE),
    ],
)
def test_mismatch_names_path_value_hint_and_reason(name, value, path, bad, hint, reason):
    with pytest.raises(codec.Mismatch) as e:
        BY_NAME[name].decode(value)
    assert (e.value.path, e.value.value, e.value.hint, e.value.reason) == (path, bad, hint, reason)


def test_encode_refuses_lists_and_non_finite_floats():
    with pytest.raises(codec.Mismatch):
        BY_NAME["shapes"].encode([(1,)])
    with pytest.raises(codec.Mismatch):
        BY_NAME["scale"].encode(float("nan"))


def test_unsupported_hint_names_the_class_and_field():
    @dataclass
    class Bad:
        x: dict[str, int]

    with pytest.raises(TypeError, match=r"Bad\.x: Prism's codec has no converter for dict\[str, int\]"):
        codec.schema(Bad)
