"""The wire codec: every message survives encode/decode, and no peer's bytes
make decode raise anything but ProtocolError."""

import dataclasses
import math
import types
import typing

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prism.core import protocol
from prism.core.protocol import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    CollectiveArrive,
    CollectiveResult,
    Error,
    Hello,
    P2PData,
    ProtocolError,
    Send,
    SlotGrant,
    VersionMismatch,
    Welcome,
    check_hello,
    decode,
    encode,
    routing_key,
)

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
PAYLOADS = st.lists(st.binary(max_size=64), max_size=4).map(tuple)


def strategy_for(hint: typing.Any) -> st.SearchStrategy:
    """A strategy for a field's type hint (the hints the protocol uses)."""
    if hint is int:
        return INT64
    if hint is str:
        return st.text(max_size=20)
    if hint is bool:
        return st.booleans()
    if hint is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(
            *(st.none() if a is type(None) else strategy_for(a) for a in typing.get_args(hint))
        )
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0]), max_size=4).map(tuple)
        return st.tuples(*(strategy_for(a) for a in args))
    raise TypeError(f"no strategy for {hint!r}: extend strategy_for")


def message_strategy(cls: type) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        kwargs[f.name] = PAYLOADS if f.name == "payloads" else strategy_for(hints[f.name])
    return st.builds(cls, **kwargs)


ANY_MESSAGE = st.one_of(*(message_strategy(cls) for cls in MESSAGE_TYPES))


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.TYPE)
@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip(cls, data):
    msg = data.draw(message_strategy(cls))
    frames = encode(msg)
    out = decode([bytes(f) for f in frames])
    assert type(out) is cls
    assert out == msg
    assert [bytes(p) for p in getattr(out, "payloads", ())] == [
        bytes(p) for p in getattr(msg, "payloads", ())
    ]


def test_every_message_type_has_a_distinct_wire_name():
    names = [cls.TYPE for cls in MESSAGE_TYPES]
    assert len(set(names)) == len(names)


def test_payloads_are_not_copied_into_the_header():
    payload = bytearray(b"x" * 1000)
    frames = encode(CollectiveResult("g", 3, payloads=(payload,)))
    assert frames[1] is payload
    assert len(frames[0]) < 100


def test_decode_accepts_zmq_frames():
    import zmq
    frames = encode(Send(1, "g", 2, 0, 5, "float32", (2, 3), payloads=(b"abcdef",)))
    out = decode([zmq.Frame(bytes(f)) for f in frames])
    assert out.shape == (2, 3)
    assert bytes(memoryview(out.payloads[0])) == b"abcdef"
    with pytest.raises(ProtocolError, match="not valid JSON"):
        decode([zmq.Frame(b"\xff\xfe")])


def test_encode_converts_shape_like_tuples_and_numpy_ints():
    class Size(tuple):  # as torch.Size: a tuple subclass orjson refuses
        pass

    msg = Send(np.int64(1), "g", 2, 0, 5, "float32", Size((2, 3)))
    assert decode(encode(msg)).shape == (2, 3)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_encode_refuses_non_finite_floats(bad):
    msg = CollectiveArrive(0, "g", 0, "allreduce", "premul_sum", "float32", (), (), premul=bad)
    with pytest.raises(ValueError, match="CollectiveArrive.premul must be a finite number"):
        encode(msg)


def test_encode_refuses_out_of_range_ints_with_a_clear_message():
    with pytest.raises(ValueError, match="ints within 64 bits"):
        encode(SlotGrant(2**70))


def test_encode_refuses_oversized_messages():
    with pytest.raises(ProtocolError, match="exceeds the maximum of 100 bytes"):
        encode(CollectiveResult("g", 0, payloads=(b"x" * 200,)), max_bytes=100)


def test_decode_refuses_oversized_messages():
    frames = encode(CollectiveResult("g", 0, payloads=(b"x" * 200,)))
    with pytest.raises(ProtocolError, match="exceeds the maximum of 100 bytes"):
        decode(frames, max_bytes=100)


# --- malformed input: ProtocolError and nothing else ---------------------

JSON = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def decode_or_protocol_error(frames):
    try:
        msg = decode(frames)
    except ProtocolError:
        return None
    assert type(msg) in MESSAGE_TYPES
    return msg


@settings(max_examples=300)
@given(st.lists(st.binary(max_size=200), min_size=0, max_size=4))
def test_random_bytes_raise_only_protocol_error(frames):
    decode_or_protocol_error(frames)


@settings(max_examples=300)
@given(JSON, st.lists(st.binary(max_size=8), max_size=3))
def test_random_json_raises_only_protocol_error(obj, payloads):
    decode_or_protocol_error([orjson.dumps(obj), *payloads])


@st.composite
def mutated_headers(draw):
    """A valid message's header with one field dropped, retyped or added, or
    its type or version changed, and a random number of payload frames."""
    msg = draw(ANY_MESSAGE)
    header = orjson.loads(encode(msg)[0])
    key = draw(st.sampled_from(sorted(header)))
    action = draw(st.sampled_from(["drop", "retype", "add", "type", "version"]))
    if action == "drop":
        del header[key]
    elif action == "retype":
        header[key] = draw(JSON)
    elif action == "add":
        header[draw(st.text(max_size=8))] = draw(JSON)
    elif action == "type":
        header["t"] = draw(st.sampled_from([c.TYPE for c in MESSAGE_TYPES]) | JSON)
    else:
        header["v"] = draw(JSON)
    payloads = draw(st.lists(st.binary(max_size=8), max_size=3))
    return [orjson.dumps(header), *payloads]


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_headers())
def test_mutated_headers_raise_only_protocol_error(frames):
    decode_or_protocol_error(frames)


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "empty message"),
        ([b"\x16\x03\x01\x02\x00"], "not valid JSON"),  # start of a TLS Client Hello
        ([b"[1, 2]"], "must be a JSON object"),
        ([b'{"t": "nope", "v": V}'], "unknown message type 'nope'"),
        ([b'{"t": "slot_grant", "v": V}'], "lacks field 'rank'"),
        ([b'{"t": "slot_grant", "v": V, "rank": "0"}'], r"slot_grant.rank: expected an integer"),
        ([b'{"t": "slot_grant", "v": V, "rank": true}'], r"expected an integer, got True"),
        ([b'{"t": "slot_grant", "v": V, "rank": 0, "x": 1}'], r"unknown fields \['x'\]"),
        ([b'{"t": "slot_grant", "v": V, "rank": 0}', b"extra"], "carries no payload, got 1 extra"),
        ([b'{"t": "send", "v": V, "rank": 0, "gid": "g", "dst": 1, "tag": 0, "pseq": 0,'
          b' "dtype": "f", "shape": [1, "2"]}'], r"send.shape\[1\]: expected an integer"),
    ],
)
def test_malformed_messages_are_named(frames, match):
    # "V": this version's number, so only the fault named is wrong
    frames = [f.replace(b'"v": V', b'"v": %d' % PROTOCOL_VERSION) for f in frames]
    with pytest.raises(ProtocolError, match=match):
        decode(frames)


# --- the handshake ---------------------------------------------------------


def hello(version=PROTOCOL_VERSION, rank=3, world_size=8):
    return Hello(version, rank, world_size, rank, 4242, "node7", "cpu", 0)


def test_check_hello_accepts_the_same_version():
    check_hello(hello(), world_size=8)


def test_check_hello_names_both_versions_and_the_rank():
    with pytest.raises(
        VersionMismatch,
        match=r"rank 3 \(pid 4242 on node7\) speaks Prism protocol 4, this coordinator "
        rf"speaks {PROTOCOL_VERSION}: install the same Prism version",
    ):
        check_hello(hello(version=4))


def test_check_hello_refuses_a_rank_outside_the_world():
    with pytest.raises(ProtocolError, match=r"rank must be in \[0, 8\), got 9"):
        check_hello(hello(rank=9), world_size=8)
    with pytest.raises(ProtocolError, match="says world size 16, this coordinator runs world size 8"):
        check_hello(hello(world_size=16), world_size=8)


@pytest.mark.parametrize("version", [1, 2, 3, 4, PROTOCOL_VERSION + 1, 0, True, float(PROTOCOL_VERSION),
                                     str(PROTOCOL_VERSION), None])
def test_decode_refuses_another_framing_version(version):
    header = orjson.loads(encode(SlotGrant(0))[0])
    header["v"] = version
    with pytest.raises(VersionMismatch, match="run the same Prism version on every side"):
        decode([orjson.dumps(header)])


def test_routing_keys():
    assert routing_key(CollectiveResult("g", 4)) == ("coll", "g", 4)
    assert routing_key(P2PData(1, 2, 0, 7)) == ("p2p", 1, 2, 0, 7)
    assert routing_key(SlotGrant(5)) == ("slot",)
    assert routing_key(Welcome(PROTOCOL_VERSION, "r", 0, 0)) == ("welcome",)
    assert routing_key(Error("deadlock", "x")) is None
    assert protocol.routing_key(hello()) is None


def test_emulation_fields_round_trip():
    for msg in (CollectiveResult("g", 3, (b"ab",), release_ns=123), P2PData(1, 2, 0, 7, (b"x",), release_ns=5),
                Welcome(PROTOCOL_VERSION, "r", 0, 0, hybrid=True)):
        got = decode(encode(msg))
        assert got == msg and getattr(got, "release_ns", None) == getattr(msg, "release_ns", None)
    assert CollectiveResult("g", 3).release_ns == 0 and Welcome(PROTOCOL_VERSION, "r", 0, 0).hybrid is False


def test_a_pruned_arrival_round_trips_without_payloads():
    msg = CollectiveArrive(0, "g", 4, "all_reduce", "SUM", "float32", ((8,),), ((8,),), issue_ns=5, pruned=True)
    got = decode(encode(msg))
    assert got == msg and got.pruned is True and got.payloads == ()
    assert CollectiveArrive(0, "g", 4, "all_reduce", "SUM", "float32", (), ()).pruned is False


def test_a_header_template_encodes_as_the_message_does():
    # the device path sends its CollectiveArrives from a per-signature template
    P = protocol
    base = P.CollectiveArrive(rank=3, gid="g1-ab", seq=0, op="all_reduce", reduce_op="PREMUL_SUM", dtype="bfloat16",
                              in_shapes=((4, 8),), out_shapes=((4, 8),), premul=0.25, async_op=True, issue_ns=0,
                              on_device=True, reach_follows=True, recorded=False, release_slot=-1, release_value=0)
    tmpl = P.header_template(base)
    header = dict(tmpl)
    header.update(seq=17, issue_ns=123_456_789_012, recorded=True, release_slot=5, release_value=9)
    frames = P.encode_header(header)
    want = dataclasses.replace(base, seq=17, issue_ns=123_456_789_012, recorded=True, release_slot=5, release_value=9)
    assert frames == [bytes(P.encode(want)[0])]
    assert P.decode(frames) == want
    assert tmpl["seq"] == 0  # the template itself is left as it was
    with pytest.raises(ValueError, match="payloads"):
        P.header_template(dataclasses.replace(base, payloads=(b"\0" * 4,)))
