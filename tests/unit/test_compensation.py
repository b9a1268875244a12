"""Compensation (prism.core.compensation): a collective over k sandbox inputs
plus the one folded virtual contribution equals the collective over the whole
materialised world when every virtual rank contributes what the policy
assumes, for every reduce op and dtype (exactly for integers, up to the
rounding of folding N - k equal terms into one for floats); recorded virtual
inputs reproduce the world's result bit for bit."""

import itertools

import numpy as np
import pytest

from prism.core.collectives import DTYPES, FLOAT_DTYPES, check_reduce_op, f32_to_bf16, reduce_arrays
from prism.core.compensation import fold, reduce_with_virtual, virtual_contribution, virtual_shard
from prism.core.trace import REDUCE_OPS

#: Unit roundoff per float dtype: folding N - k terms into one product rounds
#: once where the materialised world rounds at each of its N - 1 ring steps,
#: so the two may differ by about one rounding per step (the bound: 2 N eps).
EPS = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
PREMUL = 0.25


def _array(rng, dtype, shape=(5, 7)):
    if dtype == "bfloat16":
        return f32_to_bf16(rng.uniform(0.5, 2.0, shape).astype(np.float32))
    if dtype in FLOAT_DTYPES:
        return rng.uniform(0.5, 2.0, shape).astype(DTYPES[dtype])
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(np.bool_)
    return rng.integers(1, 4, shape).astype(DTYPES[dtype])


def _as_float(a, dtype):
    from prism.core.collectives import bf16_to_f32

    return bf16_to_f32(a).astype(np.float64) if dtype == "bfloat16" else a.astype(np.float64)


CASES = [(op, dt, k, n) for op in REDUCE_OPS for dt in DTYPES for k, n in ((1, 2), (1, 8), (2, 5), (3, 16))
         if check_reduce_op(op, dt) is None and not (op == "PRODUCT" and dt == "bool")]


@pytest.mark.parametrize("op,dtype,k,n", CASES, ids=lambda v: str(v))
def test_folded_equals_the_materialised_world(op, dtype, k, n):
    rng = np.random.default_rng(hash((op, dtype, k, n)) % 2**32)
    sandbox_ranks = sorted(rng.choice(n, size=k, replace=False).tolist())
    sandbox = {r: _array(rng, dtype) for r in sandbox_ranks}
    premul = PREMUL if op == "PREMUL_SUM" else None
    each = virtual_contribution(op, dtype, [sandbox[r] for r in sandbox_ranks])
    world = [sandbox.get(r, each) for r in range(n)]
    want = reduce_arrays(world, op, dtype, premul)
    got = reduce_with_virtual(op, dtype, sandbox, n, premul)
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype in FLOAT_DTYPES:
        np.testing.assert_allclose(_as_float(got, dtype), _as_float(want, dtype), rtol=2 * n * EPS[dtype])
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", ["SUM", "AVG", "PREMUL_SUM", "MAX", "PRODUCT", "BXOR"])
def test_recorded_virtual_inputs_reproduce_the_world_bit_for_bit(op):
    dtype = "float32" if op not in ("BXOR",) else "int32"
    rng = np.random.default_rng(7)
    n = 6
    full = [_array(rng, dtype) for _ in range(n)]
    premul = PREMUL if op == "PREMUL_SUM" else None
    want = reduce_arrays(full, op, dtype, premul)
    got = reduce_with_virtual(op, dtype, {1: full[1], 4: full[4]}, n, premul,
                              recorded={r: full[r] for r in (0, 2, 3, 5)})
    np.testing.assert_array_equal(got, want)


def test_an_average_stays_an_average():
    # Gradients averaged over a world of 1,024 from one sandbox: its own gradient.
    g = np.array([1.0, -2.0, 3.5], dtype=np.float32)
    np.testing.assert_array_equal(reduce_with_virtual("AVG", "float32", {0: g}, 1024), g)
    # a SUM of 1,024 copies of it
    np.testing.assert_allclose(reduce_with_virtual("SUM", "float32", {0: g}, 1024), 1024 * g)


def test_the_policy_for_each_op():
    a, b = np.array([1, 6], dtype=np.int64), np.array([3, 2], dtype=np.int64)
    assert virtual_contribution("SUM", "int64", [a, b]).tolist() == [2, 4]
    assert virtual_contribution("MIN", "int64", [a, b]).tolist() == [1, 2]
    assert virtual_contribution("MAX", "int64", [a, b]).tolist() == [3, 6]
    assert virtual_contribution("PRODUCT", "int64", [a, b]).tolist() == [1, 6]  # the leftmost's own
    assert fold("PRODUCT", "int64", [b], 3).tolist() == [27, 8]
    assert fold("BXOR", "int64", [b], 2).tolist() == [0, 0] and fold("BXOR", "int64", [b], 3).tolist() == [3, 2]
    assert fold("PREMUL_SUM", "float32", [np.float32([2.0])], 4, premul=0.5).tolist() == [4.0]


def test_bad_input_says_what_is_wrong():
    with pytest.raises(ValueError, match="at least one sandbox"):
        virtual_contribution("SUM", "float32", [])
    with pytest.raises(ValueError, match="Cannot use ReduceOp.BAND with non-integral dtype"):
        reduce_with_virtual("BAND", "float32", {0: np.ones(2, np.float32)}, 4)
    with pytest.raises(ValueError, match="outside the group of 4"):
        reduce_with_virtual("SUM", "float32", {4: np.ones(2, np.float32)}, 4)
    with pytest.raises(ValueError, match="both sandbox and recorded"):
        reduce_with_virtual("SUM", "float32", {0: np.ones(2, np.float32)}, 4, recorded={0: np.ones(2, np.float32)})
    with pytest.raises(ValueError, match="needs its factor"):
        reduce_with_virtual("PREMUL_SUM", "float32", {0: np.ones(2, np.float32)}, 4)
    with pytest.raises(ValueError, match="shape"):
        reduce_with_virtual("SUM", "float32", {0: np.ones(2, np.float32), 1: np.ones(3, np.float32)}, 4)


def test_a_virtual_shard_is_recorded_or_cut_from_the_sandboxs_own():
    own = np.arange(6, dtype=np.float32)
    assert virtual_shard((2, 2), "float32", own).tolist() == [[0, 1], [2, 3]]
    assert virtual_shard((8,), "float32", own).tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    rec = np.full((2, 2), 9, np.float32)
    assert virtual_shard((2, 2), "float32", own, rec).tolist() == [[9, 9], [9, 9]]
    with pytest.raises(ValueError, match="recorded tensor of shape"):
        virtual_shard((3,), "float32", own, rec)


def test_cases_cover_every_reduce_op_and_dtype():
    ops = {c[0] for c in CASES}
    dts = {c[1] for c in CASES}
    assert ops == set(REDUCE_OPS) and dts == set(DTYPES)
    assert len(list(itertools.product(ops, dts))) > 0
