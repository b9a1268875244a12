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


# --- hybrid_outputs: what the sandbox members of a collective receive ------------

from dataclasses import dataclass as _dataclass  # noqa: E402

from prism.core.collectives import run_collective  # noqa: E402
from prism.core.compensation import hybrid_outputs  # noqa: E402


@_dataclass(frozen=True)
class _Call:
    op: str
    reduce_op: str
    dtype: str
    in_shapes: tuple
    out_shapes: tuple
    root: int = -1
    in_splits: tuple = ()
    out_splits: tuple = ()
    premul: float | None = None


def _world(n, sandbox, call, own, virtual):
    """run_collective over the materialised group: sandbox members their own
    inputs, virtual members what compensation assumes (``virtual(j)``)."""
    calls = [call] * n
    inputs = [own[j] if j in sandbox else virtual(j) for j in range(n)]
    return run_collective(calls, inputs)


@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX"])
def test_hybrid_all_reduce_equals_the_world_with_compensated_members(op):
    n, sandbox = 6, (1, 4)
    call = _Call("all_reduce", op, "int64" if op != "AVG" else "float64", ((5,),), ((5,),))
    dt = np.int64 if op != "AVG" else np.float64
    own = {j: [np.arange(5, dtype=dt) * (j + 1)] for j in sandbox}
    got = hybrid_outputs({j: call for j in sandbox}, own, n)
    each = virtual_contribution(op, call.dtype, [own[j][0] for j in sandbox])
    want = _world(n, sandbox, call, own, lambda j: [each])
    for j in sandbox:
        np.testing.assert_allclose(got[j][0], want[j][0], rtol=1e-12)


def test_hybrid_reduce_scatter_tensor_gives_each_member_its_part():
    n, sandbox = 4, (0, 3)
    call = _Call("reduce_scatter_tensor", "SUM", "int32", ((8,),), ((2,),))
    own = {j: [np.arange(8, dtype=np.int32) + 10 * j] for j in sandbox}
    got = hybrid_outputs({j: call for j in sandbox}, own, n)
    each = virtual_contribution("SUM", "int32", [own[j][0] for j in sandbox])
    want = _world(n, sandbox, call, own, lambda j: [each])
    for j in sandbox:
        assert got[j][0].tolist() == want[j][0].reshape(-1).tolist()


def test_hybrid_all_gather_fills_virtual_shards_from_the_members_own():
    n = 4
    call = _Call("all_gather_into_tensor", "", "float32", ((3,),), ((12,),))
    own = {2: [np.array([1, 2, 3], np.float32)]}
    got = hybrid_outputs({2: call}, own, n)
    assert got[2][0].reshape(-1).tolist() == [1, 2, 3] * 4


def test_hybrid_rooted_ops_at_a_virtual_root_leave_tensors_as_they_are():
    call = _Call("broadcast", "", "float32", ((3,),), ((3,),), root=0)
    assert hybrid_outputs({2: call}, {2: []}, 4) == {2: []}
    call = _Call("broadcast", "", "float32", ((3,),), ((3,),), root=2)
    got = hybrid_outputs({2: call, 3: call}, {2: [np.ones(3, np.float32)], 3: []}, 4)
    assert got[2] == [] and got[3][0].tolist() == [1, 1, 1]


def test_hybrid_all_to_all_single_takes_sandbox_rows_and_fills_virtual_ones():
    n = 4
    call = _Call("all_to_all_single", "", "float32", ((4, 2),), ((4, 2),))
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    b = a + 100
    got = hybrid_outputs({1: call, 2: call}, {1: [a], 2: [b]}, n)
    # member 1 gets row 1 of member 2's input at slot 2, its own row 1 at slot 1
    assert got[1][0][2].tolist() == b[1].tolist() and got[1][0][1].tolist() == a[1].tolist()
    # a virtual member's chunk is the member's own chunk for it
    assert got[1][0][0].tolist() == a[0].tolist()


def test_hybrid_with_every_member_a_sandbox_is_the_plain_collective():
    call = _Call("all_reduce", "SUM", "float32", ((3,),), ((3,),))
    own = {j: [np.full(3, j + 0.5, np.float32)] for j in range(3)}
    got = hybrid_outputs({j: call for j in range(3)}, own, 3)
    want = run_collective([call] * 3, [own[j] for j in range(3)])
    assert all(got[j][0].tolist() == want[j][0].tolist() for j in range(3))
