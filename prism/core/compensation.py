"""What virtual ranks contribute to a collective when nothing recorded it (sans-IO).

In hybrid emulation a group holds k sandbox ranks (real data) and N - k
virtual ranks. Where no recording covers a virtual member's contribution (it
was not recorded, the step lies beyond the recorded ones, or the world was
scaled out beyond the capture), its value is synthesised by the compensation
policy (docs/DESIGN.md, "Compensation policy"); shapes and dtypes are always
the recorded ones:

=================  =============================================  ===========================
reduce op          each virtual rank contributes                  folded (all N - k at once)
=================  =============================================  ===========================
SUM                the mean of the sandbox contributions          (N - k) x mean
PREMUL_SUM         the mean of the sandbox contributions          (N - k) x (factor x mean)
AVG                the mean of the sandbox contributions          (N - k) x mean, then / N
MIN / MAX          the min / max over the sandbox contributions   that min / max
PRODUCT            the leftmost sandbox's own value               its value ** (N - k)
BAND / BOR         the leftmost sandbox's own value               that value
BXOR               the leftmost sandbox's own value               that value if N - k is odd, else 0
=================  =============================================  ===========================

So an averaged gradient stays an average. The folded column is what "the
leftmost virtual rank compensates" means: one contribution stands for every
virtual member, so a collective among k sandboxes is computed over k + 1
inputs, not N (``fold`` and ``reduce_with_virtual``). Means are taken in
float64 and rounded once to the dtype; folding a sum of N - k equal terms into
one product rounds differently from adding them one by one, so for floating
dtypes the folded result equals the materialised world's up to rounding
(``tests/unit/test_compensation.py`` bounds it per dtype), and exactly for
integers.

Data-moving ops (all_gather, all_to_all, broadcast or scatter from a virtual
root) take a virtual member's recorded tensor where there is one, else fill
its slot from the leftmost sandbox's own data with the recorded shape
(``virtual_shard``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from prism.core.collectives import (FLOAT_DTYPES, _divide, _scale, bf16_to_f32, check_reduce_op, f32_to_bf16,
                                    reduce_arrays, storage_dtype)

__all__ = ["virtual_contribution", "fold", "reduce_with_virtual", "virtual_shard"]


def _values(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` as numbers (bfloat16's raw bits decoded)."""
    return bf16_to_f32(a) if dtype == "bfloat16" else a


def _stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """Numbers back in ``dtype``'s storage, rounded once."""
    if dtype == "bfloat16":
        return f32_to_bf16(np.asarray(values, dtype=np.float32))
    return np.asarray(values).astype(storage_dtype(dtype))


def _check(reduce_op: str, dtype: str, sandbox: Sequence[np.ndarray]) -> None:
    why = check_reduce_op(reduce_op, dtype)
    if why:
        raise ValueError(why)
    if not sandbox:
        raise ValueError("compensation needs at least one sandbox contribution")
    shape = sandbox[0].shape
    for i, a in enumerate(sandbox):
        if a.shape != shape:
            raise ValueError(f"sandbox contribution {i} has shape {a.shape}, contribution 0 has {shape}")


def virtual_contribution(reduce_op: str, dtype: str, sandbox: Sequence[np.ndarray]) -> np.ndarray:
    """What one virtual rank is assumed to contribute (before a PREMUL_SUM's factor)."""
    _check(reduce_op, dtype, sandbox)
    if reduce_op in ("SUM", "AVG", "PREMUL_SUM"):
        mean = np.mean(np.stack([_values(a, dtype).astype(np.float64) for a in sandbox]), axis=0)
        if dtype not in FLOAT_DTYPES:
            mean = np.rint(mean)  # integer tensors: the nearest integer mean
        return _stored(mean, dtype)
    if reduce_op in ("MIN", "MAX"):
        return reduce_arrays(list(sandbox), reduce_op, dtype)
    return np.array(sandbox[0], copy=True)


def fold(reduce_op: str, dtype: str, sandbox: Sequence[np.ndarray], n_virtual: int,
         premul: float | None = None) -> np.ndarray:
    """The one input that stands for all ``n_virtual`` virtual members: reducing
    it with the sandbox inputs under ``reduce_op`` (AVG: as a SUM, then divided
    by the whole group's size) gives the whole group's result."""
    if n_virtual < 1:
        raise ValueError(f"fold needs at least one virtual member, got {n_virtual}")
    each = virtual_contribution(reduce_op, dtype, sandbox)
    m = n_virtual
    if reduce_op in ("SUM", "AVG", "PREMUL_SUM"):
        if reduce_op == "PREMUL_SUM":
            if premul is None:
                raise ValueError("PREMUL_SUM needs its factor (premul), got None")
            # each member's input is scaled in its dtype before the sum, as the world's are
            each = _scale(each, premul, dtype)
        if dtype not in FLOAT_DTYPES:
            with np.errstate(over="ignore"):
                return (each.astype(np.int64) * m).astype(each.dtype)  # wraps as m additions do
        return _stored(_values(each, dtype).astype(np.float64) * m, dtype)
    if reduce_op == "PRODUCT":
        if dtype in FLOAT_DTYPES:
            return _stored(np.power(_values(each, dtype).astype(np.float64), m), dtype)
        out = np.ones_like(each)
        with np.errstate(over="ignore"):
            for _ in range(m):  # integer powers wrap as repeated products do
                out = out * each
        return out.astype(each.dtype)
    if reduce_op == "BXOR":
        return each if m % 2 else np.zeros_like(each)
    return each  # MIN, MAX, BAND, BOR: idempotent


def reduce_with_virtual(reduce_op: str, dtype: str, sandbox: Mapping[int, np.ndarray], group_size: int,
                        premul: float | None = None,
                        recorded: Mapping[int, np.ndarray] | None = None) -> np.ndarray:
    """The reduction a group of ``group_size`` computes, given the sandbox
    members' inputs (group rank -> array) and the recorded inputs of some
    virtual members; the others are compensated, folded into one input.
    Members keep group-rank order, the folded input standing at the first
    compensated member's place."""
    recorded = dict(recorded or {})
    clash = set(sandbox) & set(recorded)
    if clash:
        raise ValueError(f"group rank(s) {sorted(clash)} are both sandbox and recorded")
    for r in [*sandbox, *recorded]:
        if not 0 <= r < group_size:
            raise ValueError(f"group rank {r} is outside the group of {group_size}")
    ordered = sorted(sandbox)
    sand = [sandbox[r] for r in ordered]
    _check(reduce_op, dtype, sand)
    missing = [r for r in range(group_size) if r not in sandbox and r not in recorded]
    inputs: list[tuple[int, np.ndarray]] = [(r, a) for r, a in sandbox.items()] + list(recorded.items())
    op = reduce_op
    if reduce_op == "PREMUL_SUM":
        if premul is None:
            raise ValueError("PREMUL_SUM needs its factor (premul), got None")
        # The folded input carries the factor already: scale the others, then add.
        inputs = [(r, _scale(np.asarray(a, dtype=storage_dtype(dtype)), premul, dtype)) for r, a in inputs]
        op = "SUM"
    if missing:
        inputs.append((missing[0], fold(reduce_op, dtype, sand, len(missing), premul)))
    arrays = [a for _, a in sorted(inputs, key=lambda x: x[0])]
    if reduce_op == "AVG":
        return _divide(reduce_arrays(arrays, "SUM", dtype), group_size, dtype)
    return reduce_arrays(arrays, op, dtype)


def virtual_shard(shape: Sequence[int], dtype: str, sandbox_own: np.ndarray,
                  recorded: np.ndarray | None = None) -> np.ndarray:
    """A virtual member's tensor in a data-moving op (its all_gather shard, its
    all_to_all chunk, a virtual root's broadcast): the recorded tensor when
    there is one, else the leftmost sandbox's own data cut or tiled to the
    recorded ``shape``."""
    shape = tuple(shape)
    dt = storage_dtype(dtype)
    if recorded is not None:
        if tuple(recorded.shape) != shape:
            raise ValueError(f"recorded tensor of shape {tuple(recorded.shape)} where the graph has {shape}")
        return np.asarray(recorded, dtype=dt)
    n = int(np.prod(shape)) if shape else 1
    flat = np.asarray(sandbox_own, dtype=dt).reshape(-1)
    if flat.size == 0:
        return np.zeros(shape, dt)
    reps = -(-n // flat.size)
    return np.tile(flat, reps)[:n].reshape(shape)
