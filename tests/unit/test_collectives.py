"""prism.core.collectives against plain numpy references and a literal
simulation of gloo's ring all_reduce (against real gloo processes:
tests/integration/test_gloo_collectives.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.core import collectives as C
from prism.core.collectives import (
    DTYPES,
    CollectiveError,
    bf16_to_f32,
    f32_to_bf16,
    from_array,
    reduce_arrays,
    run_collective,
    to_array,
)
from prism.core.protocol import CollectiveArrive


def call(op, dtype="float32", in_shapes=(), out_shapes=(), reduce_op="", root=-1, **kw):
    return CollectiveArrive(rank=0, gid="g", seq=0, op=op, reduce_op=reduce_op, dtype=dtype,
                            in_shapes=tuple(map(tuple, in_shapes)),
                            out_shapes=tuple(map(tuple, out_shapes)), root=root, **kw)


def rand(rng, dtype, shape):
    if dtype == "bfloat16":
        return f32_to_bf16(rng.standard_normal(shape).astype(np.float32))
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    dt = DTYPES[dtype]
    if dt.kind == "f":
        return rng.standard_normal(shape).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)


# --- bytes and bfloat16 --------------------------------------------------------


def test_to_array_round_trip_is_zero_copy_and_read_only():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    buf = from_array(a)
    b = to_array(buf, "int32", (3, 4))
    assert np.array_equal(a, b) and not b.flags.writeable
    assert np.shares_memory(b, np.frombuffer(buf, np.uint8))


def test_to_array_rejects_wrong_size_and_unknown_dtype():
    with pytest.raises(ValueError, match=r"payload of 8 bytes does not hold a float32 tensor of shape \(3,\)"):
        to_array(b"\0" * 8, "float32", (3,))
    with pytest.raises(ValueError, match="dtype 'complex64' is not supported"):
        to_array(b"", "complex64", (0,))


@pytest.mark.parametrize(
    "value, bits",
    [
        (1.0, 0x3F80),
        (1.0 + 2**-8, 0x3F80),  # halfway: ties to even (down)
        (1.0 + 3 * 2**-8, 0x3F82),  # halfway: ties to even (up)
        (1.0 + 2**-8 + 2**-20, 0x3F81),  # above halfway: up
        (-2.5, 0xC020),
        (float("inf"), 0x7F80),
        (3.4e38, 0x7F80),  # rounds past the largest bfloat16
        (float("nan"), 0x7FC0),
    ],
)
def test_f32_to_bf16_rounds_to_nearest_even(value, bits):
    assert int(f32_to_bf16(np.array([value], np.float32))[0]) == bits


def test_bf16_round_trip_is_exact():
    bits = np.arange(0, 1 << 16, dtype=np.uint16)
    finite = ~np.isnan(bf16_to_f32(bits))
    assert np.array_equal(f32_to_bf16(bf16_to_f32(bits))[finite], bits[finite])


# --- gloo's ring order, simulated literally -------------------------------------


def gloo_ring_allreduce(xs, fn, itemsize, max_segment_bytes=C.GLOO_MAX_SEGMENT_BYTES):
    """Each rank's buffer after gloo's ring all_reduce, following
    gloo/allreduce.cc step by step: reduce-scatter in segments passed to rank
    r-1, each receiver computing fn(local, received), then an all-gather."""
    world, n = len(xs), xs[0].size
    out = [x.copy() for x in xs]
    if world == 1 or n == 0:
        return out
    total = n * itemsize
    segs = max(-(-total // max_segment_bytes), 2 * world)
    segs = -(-segs // world) * world
    per_rank = segs // world
    seg_elems = -(-n // segs)

    def seg(i):
        s = (i % segs) * seg_elems
        return slice(min(s, n), min(s + seg_elems, n))

    for i in range(segs - per_rank):
        sent = [out[r][seg((r + 1) * per_rank + i)].copy() for r in range(world)]
        for r in range(world):
            sl = seg((r + 2) * per_rank + i)
            out[r][sl] = fn(out[r][sl], sent[(r + 1) % world])
    for i in range(segs - per_rank):
        sent = [out[r][seg(r * per_rank + i)].copy() for r in range(world)]
        for r in range(world):
            out[r][seg((r + 1) * per_rank + i)] = sent[(r + 1) % world]
    return out


REF_FN = {
    "SUM": np.add, "PRODUCT": np.multiply,
    "MIN": lambda a, b: np.where(b < a, b, a), "MAX": lambda a, b: np.where(a < b, b, a),
    "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor,
}


@settings(max_examples=150, deadline=None)
@given(
    world=st.integers(1, 6),
    n=st.integers(0, 70),
    dtype=st.sampled_from(sorted(DTYPES)),
    op=st.sampled_from(sorted(REF_FN)),
    seed=st.integers(0, 2**32 - 1),
    small_segments=st.booleans(),
)
def test_reduce_arrays_follows_gloo_ring(world, n, dtype, op, seed, small_segments):
    if C.check_reduce_op(op, dtype):
        return
    rng = np.random.default_rng(seed)
    xs = [rand(rng, dtype, (n,)) for _ in range(world)]
    itemsize = DTYPES[dtype].itemsize
    max_seg = 3 * itemsize if small_segments else C.GLOO_MAX_SEGMENT_BYTES
    fn = REF_FN[op]
    if dtype == "bfloat16":
        base = fn
        def fn(a, b):
            return f32_to_bf16(base(bf16_to_f32(a), bf16_to_f32(b)))
    with np.errstate(all="ignore"):
        want = gloo_ring_allreduce(xs, fn, itemsize, max_seg)
    got = reduce_arrays(xs, op, dtype, max_segment_bytes=max_seg)
    for r in range(world):  # every rank ends with the same bits
        assert want[r].tobytes() == got.tobytes()


def test_float_sum_order_differs_from_rank_order():
    # Chunk 0 of 4 ranks accumulates ranks 3, 2, 1, 0: (1e8 + -1e8) + 1 + 1 = 2,
    # while rank order gives ((1 + 1) + 1e8) + -1e8 = 0 in float32.
    xs = [np.array([v], np.float32) for v in (1.0, 1.0, -1e8, 1e8)]
    assert reduce_arrays(xs, "SUM", "float32")[0] == 2.0
    assert (xs[0] + xs[1] + xs[2] + xs[3])[0] == 0.0


def test_integer_ops_match_numpy():
    rng = np.random.default_rng(0)
    xs = [rand(rng, "int32", (5, 3)) for _ in range(4)]
    with np.errstate(all="ignore"):
        assert np.array_equal(reduce_arrays(xs, "SUM", "int32"), xs[0] + xs[1] + xs[2] + xs[3])
        assert np.array_equal(reduce_arrays(xs, "PRODUCT", "int32"), xs[0] * xs[1] * xs[2] * xs[3])
    assert np.array_equal(reduce_arrays(xs, "MAX", "int32"), np.maximum.reduce(xs))
    assert np.array_equal(reduce_arrays(xs, "BXOR", "int32"), np.bitwise_xor.reduce(xs))


def test_avg_and_premul_sum():
    xs = [np.full(4, v, np.float32) for v in (1.0, 2.0, 4.0)]
    assert np.array_equal(reduce_arrays(xs, "AVG", "float32"), np.full(4, 7 / 3, np.float32))
    assert np.array_equal(reduce_arrays(xs, "PREMUL_SUM", "float32", premul=0.5), np.full(4, 3.5, np.float32))
    bf = [f32_to_bf16(x) for x in xs]
    assert np.array_equal(bf16_to_f32(reduce_arrays(bf, "AVG", "bfloat16")), np.full(4, 2.328125, np.float32))


@pytest.mark.parametrize(
    "op, dtype, message",
    [
        ("AVG", "int64", "result type Float can't be cast to the desired output type Long"),
        ("AVG", "bool", "desired output type Bool"),
        ("BAND", "float32", "Cannot use ReduceOp.BAND with non-integral dtype"),
        ("MEAN", "float32", "unknown reduce op 'MEAN'"),
    ],
)
def test_refused_reduce_ops_name_the_call(op, dtype, message):
    c = call("all_reduce", dtype, [(2,)], [(2,)], reduce_op=op)
    x = np.zeros(2, DTYPES[dtype])
    with pytest.raises(CollectiveError, match=r"^all_reduce on group g7 \(ranks \[3, 5\]\) at sequence 4: .*" + message) as e:
        run_collective([c, c], [[x], [x]], gid="g7", seq=4, ranks=(3, 5))
    assert (e.value.gid, e.value.seq, e.value.op) == ("g7", 4, "all_reduce")


# --- every op against a plain reference -------------------------------------------


def test_all_reduce_and_coalesced():
    rng = np.random.default_rng(1)
    xs = [[rng.integers(0, 9, (2, 3)).astype(np.int64), rng.integers(0, 9, (4,)).astype(np.int64)] for _ in range(3)]
    c = call("all_reduce_coalesced", "int64", [(2, 3), (4,)], [(2, 3), (4,)], reduce_op="SUM")
    outs = run_collective([c] * 3, xs)
    for o in outs:
        assert np.array_equal(o[0], sum(x[0] for x in xs)) and np.array_equal(o[1], sum(x[1] for x in xs))
    c1 = call("all_reduce", "int64", [(4,)], [(4,)], reduce_op="MIN")
    outs = run_collective([c1] * 3, [[x[1]] for x in xs])
    assert all(np.array_equal(o[0], np.minimum.reduce([x[1] for x in xs])) for o in outs)


def test_broadcast_and_reduce_return_only_changed_tensors():
    x = np.arange(6, dtype=np.float64).reshape(2, 3)
    root = call("broadcast", "float64", [(2, 3)], [], root=1)
    other = call("broadcast", "float64", [], [(2, 3)], root=1)
    outs = run_collective([other, root, other], [[], [x], []])
    assert outs[1] == [] and all(np.array_equal(outs[i][0], x) for i in (0, 2))
    # Receivers may also declare the tensor as an input they do not send.
    declared = call("broadcast", "float64", [(2, 3)], [(2, 3)], root=1)
    outs = run_collective([declared, root, declared], [[], [x], []])
    assert outs[1] == [] and all(np.array_equal(outs[i][0], x) for i in (0, 2))
    root = call("reduce", "float64", [(2, 3)], [(2, 3)], reduce_op="SUM", root=2)
    other = call("reduce", "float64", [(2, 3)], [], reduce_op="SUM", root=2)
    outs = run_collective([other, other, root], [[x], [x], [x]])
    assert outs[0] == [] and outs[1] == [] and np.array_equal(outs[2][0], 3 * x)


def test_gathers_and_scatter():
    xs = [np.full((2,), i, np.int8) for i in range(3)]
    c = call("all_gather", "int8", [(2,)], [(2,)] * 3)
    assert all([a.tolist() for a in o] == [[0, 0], [1, 1], [2, 2]] for o in run_collective([c] * 3, [[x] for x in xs]))
    c = call("all_gather_into_tensor", "int8", [(2,)], [(3, 2)])
    outs = run_collective([c] * 3, [[x] for x in xs])
    assert all(o[0].tolist() == [[0, 0], [1, 1], [2, 2]] for o in outs)
    assert outs[0][0] is outs[2][0]  # one shared result, encoded once by the matcher
    root = call("gather", "int8", [(2,)], [(2,)] * 3, root=0)
    other = call("gather", "int8", [(2,)], [], root=0)
    outs = run_collective([root, other, other], [[x] for x in xs])
    assert [a.tolist() for a in outs[0]] == [[0, 0], [1, 1], [2, 2]] and outs[1] == outs[2] == []
    root = call("scatter", "int8", [(2,)] * 3, [(2,)], root=1)
    other = call("scatter", "int8", [], [(2,)], root=1)
    outs = run_collective([other, root, other], [[], xs, []])
    assert [o[0].tolist() for o in outs] == [[0, 0], [1, 1], [2, 2]]


def test_coalesced_gathers_and_reduce_scatter():
    # k inputs per member: outputs are grouped by input, then by group rank.
    xs = [[np.full(2, 10 * i, np.int32), np.full(3, 10 * i + 1, np.int32)] for i in range(2)]
    c = call("all_gather", "int32", [(2,), (3,)], [(2,), (2,), (3,), (3,)])
    outs = run_collective([c] * 2, xs)
    assert [a[0] for a in outs[1]] == [0, 10, 1, 11]
    c = call("all_gather_into_tensor", "int32", [(2,), (3,)], [(4,), (2, 3)])
    outs = run_collective([c] * 2, xs)
    assert outs[0][0].tolist() == [0, 0, 10, 10] and outs[0][1].tolist() == [[1, 1, 1], [11, 11, 11]]
    ys = [[np.arange(4, dtype=np.int32) * (i + 1), np.arange(6, dtype=np.int32).reshape(3, 2)] for i in range(2)]
    c = call("reduce_scatter_tensor", "int32", [(4,), (3, 2)], [(2,), (3,)], reduce_op="SUM")
    outs = run_collective([c] * 2, ys)
    assert outs[0][0].tolist() == [0, 3] and outs[1][0].tolist() == [6, 9]
    assert outs[0][1].tolist() == [0, 2, 4] and outs[1][1].tolist() == [6, 8, 10]


def test_reduce_scatter_both_forms():
    rng = np.random.default_rng(2)
    xs = [rng.integers(0, 100, (6, 2)).astype(np.int32) for _ in range(3)]
    total = sum(xs)
    c = call("reduce_scatter_tensor", "int32", [(6, 2)], [(2, 2)], reduce_op="SUM")
    outs = run_collective([c] * 3, [[x] for x in xs])
    assert all(np.array_equal(outs[i][0], total[2 * i:2 * i + 2]) for i in range(3))
    c = call("reduce_scatter", "int32", [(2, 2)] * 3, [(2, 2)], reduce_op="SUM")
    outs = run_collective([c] * 3, [[x[0:2], x[2:4], x[4:6]] for x in xs])
    assert all(np.array_equal(outs[i][0], total[2 * i:2 * i + 2]) for i in range(3))


def test_all_to_all_forms():
    xs = [[np.full((1, 2), 10 * i + j, np.int16) for j in range(3)] for i in range(3)]
    c = call("all_to_all", "int16", [(1, 2)] * 3, [(1, 2)] * 3)
    outs = run_collective([c] * 3, xs)
    assert [[int(a[0, 0]) for a in o] for o in outs] == [[0, 10, 20], [1, 11, 21], [2, 12, 22]]
    # rank i sends i+1 rows to each peer and receives j+1 rows from peer j
    ins = [np.repeat(np.arange(3) * 10 + i, i + 1).reshape(-1, 1).astype(np.int64) for i in range(3)]
    calls = [call("all_to_all_single", "int64", [(3 * (i + 1), 1)], [(6, 1)],
                  in_splits=(i + 1,) * 3, out_splits=(1, 2, 3)) for i in range(3)]
    outs = run_collective(calls, [[x] for x in ins])
    assert [o[0].ravel().tolist() for o in outs] == [[0, 1, 1, 2, 2, 2], [10, 11, 11, 12, 12, 12], [20, 21, 21, 22, 22, 22]]
    eq = call("all_to_all_single", "int64", [(3, 1)], [(3, 1)])
    outs = run_collective([eq] * 3, [[np.arange(3).reshape(3, 1) + 10 * i] for i in range(3)])
    assert [o[0].ravel().tolist() for o in outs] == [[0, 10, 20], [1, 11, 21], [2, 12, 22]]


def test_barrier_returns_nothing():
    assert run_collective([call("barrier", "")] * 2, [[], []]) == [[], []]


def test_all_to_all_single_split_disagreement_names_both_sides():
    a = call("all_to_all_single", "int64", [(2, 1)], [(2, 1)], in_splits=(1, 1), out_splits=(1, 1))
    b = call("all_to_all_single", "int64", [(2, 1)], [(2, 1)], in_splits=(0, 2), out_splits=(1, 1))
    x = np.zeros((2, 1), np.int64)
    with pytest.raises(CollectiveError, match=r"rank 8 expects 1 rows from rank 9, which sends 0; the split sizes disagree"):
        run_collective([a, b], [[x], [x]], gid="g", seq=0, ranks=(8, 9))


@pytest.mark.parametrize(
    "calls, inputs, message",
    [
        ([call("broadcast", "int8", [(2,)], [(2,)], root=3)] * 2, [[np.zeros(2, np.int8)], []],
         r"names root 3 \(a group rank\), which must be in \[0, 2\)"),
        ([call("all_gather_into_tensor", "int8", [(2,)], [(3,)])] * 2, [[np.zeros(2, np.int8)]] * 2,
         r"rank 0 passed output tensor 0 of shape \(3,\) for a result of shape \(4,\); size the output"),
        ([call("all_reduce", "int8", [(2,)], [(2,), (2,)], reduce_op="SUM")] * 2, [[np.zeros(2, np.int8)]] * 2,
         r"rank 0 passed 2 output tensors where all_reduce returns 1"),
        ([call("all_reduce", "int8", [(2,)], [(2,)], reduce_op="SUM"),
          call("all_reduce", "int8", [(3,)], [(3,)], reduce_op="SUM")],
         [[np.zeros(2, np.int8)], [np.zeros(3, np.int8)]],
         r"rank 1 called all_reduce\(SUM, int8, \[\(3,\)\]\) but rank 0 called all_reduce\(SUM, int8, \[\(2,\)\]\)"),
        ([call("all_to_all_single", "int8", [(3,)], [(3,)])] * 2, [[np.zeros(3, np.int8)]] * 2,
         r"tensor of 3 rows with no split sizes; equal splits need a multiple of the group size 2"),
    ],
)
def test_bad_calls_are_the_scripts_fault(calls, inputs, message):
    with pytest.raises(CollectiveError, match=message):
        run_collective(calls, inputs)


def test_describe():
    assert C.describe(call("all_reduce", "float32", [(4, 4)], [(4, 4)], reduce_op="SUM")) == "all_reduce(SUM, float32, [(4, 4)])"
    assert C.describe(call("broadcast", "int8", [(2,)], [], root=1)) == "broadcast(int8, [(2,)], root=1)"
    assert C.describe(call("broadcast", "int8", [], [(2,)], root=1)) == "broadcast(int8, [(2,)], root=1)"
