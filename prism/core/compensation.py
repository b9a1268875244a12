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

from prism.core.collectives import (FLOAT_DTYPES, CallLike, _divide, _scale, bf16_to_f32, check_reduce_op,
                                    f32_to_bf16, reduce_arrays, run_collective, storage_dtype)

__all__ = ["virtual_contribution", "fold", "reduce_with_virtual", "virtual_shard", "hybrid_outputs"]


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


def hybrid_outputs(calls: Mapping[int, CallLike], inputs: Mapping[int, Sequence[np.ndarray]], group_size: int, *,
                   gid: str = "", seq: int = -1, ranks: Sequence[int] = ()) -> dict[int, list[np.ndarray]]:
    """What each sandbox member of a collective receives when its virtual
    members are compensated: ``calls`` and ``inputs`` by group rank (the
    sandbox members only, inputs as ``collectives.run_collective`` takes
    them), ``group_size`` the whole group's. Returns group rank -> outputs
    (the module table's rules; an empty list means "leave your tensors as
    they are", as in ``run_collective``).

    Reductions fold the virtual members into one input
    (``reduce_with_virtual``: k + 1 inputs, whatever the group's size); a
    broadcast or scatter from a virtual root leaves the sandbox's tensors as
    they are, a gather or reduce to one gives nothing; all_gather and gather
    fill the virtual shards from the member's own (``virtual_shard``); an
    all_to_all's chunk from a virtual member is the member's own chunk for
    that member, cut or tiled to the size it expects."""
    if not calls:
        raise ValueError("hybrid_outputs needs at least one sandbox member")
    members = sorted(calls)
    first = calls[members[0]]
    op, dtype = first.op, first.dtype
    n = group_size
    if len(members) == n:
        outs = run_collective([calls[g] for g in members], [list(inputs[g]) for g in members], gid=gid, seq=seq,
                              ranks=ranks or members)
        return dict(zip(members, outs))
    flat = {g: [np.asarray(a).reshape(-1) for a in inputs[g]] for g in members}

    def reduce(arrs: Mapping[int, np.ndarray]) -> np.ndarray:
        return reduce_with_virtual(first.reduce_op, dtype, arrs, n, first.premul)

    if op == "barrier":
        return {g: [] for g in members}
    if op == "all_reduce":
        r = reduce({g: flat[g][0] for g in members})
        return {g: [r] for g in members}
    if op == "all_reduce_coalesced":
        r = reduce({g: np.concatenate(flat[g]) if flat[g] else np.zeros(0, storage_dtype(dtype)) for g in members})
        cuts = np.cumsum([a.size for a in flat[members[0]]])[:-1]
        parts = np.split(r, cuts)
        return {g: list(parts) for g in members}
    if op == "reduce":
        if first.root not in calls:
            return {g: [] for g in members}
        r = reduce({g: flat[g][0] for g in members})
        return {g: [r] if g == first.root else [] for g in members}
    if op == "reduce_scatter":
        return {g: [reduce({m: flat[m][g] for m in members})] for g in members}
    if op == "reduce_scatter_tensor":
        out = {g: [] for g in members}
        for k in range(len(flat[members[0]])):
            r = reduce({m: flat[m][k] for m in members})
            part = r.size // n
            for g in members:
                out[g].append(r[g * part:(g + 1) * part])
        return out
    if op in ("broadcast", "scatter", "gather") and first.root not in calls:
        return {g: [] for g in members}
    if op == "all_to_all":
        out = {}
        for g in members:
            c = calls[g]
            row = []
            for j in range(n):
                shape = tuple(c.out_shapes[j]) if j < len(c.out_shapes) else tuple(c.in_shapes[j])
                row.append(inputs[j][g] if j in calls else virtual_shard(shape, dtype, inputs[g][j]))
            out[g] = row
        return out
    if op == "all_to_all_single":
        out = {}
        for g in members:
            c = calls[g]
            own = np.asarray(inputs[g][0])
            rows = own.shape[0] if own.ndim else 0
            tail = own.shape[1:]
            ins = list(c.in_splits) or [rows // n] * n
            outs_ = list(c.out_splits) or [rows // n] * n
            starts = np.concatenate([[0], np.cumsum(ins)]).astype(int)
            chunks = []
            for j in range(n):
                if j in calls:
                    cj = calls[j]
                    rj = np.asarray(inputs[j][0])
                    sj = list(cj.in_splits) or [rj.shape[0] // n] * n
                    a = int(sum(sj[:g]))
                    chunks.append(rj[a:a + sj[g]])
                else:
                    mine = own[starts[j]:starts[j + 1]]
                    chunks.append(virtual_shard((outs_[j], *tail), dtype, mine if mine.size else own))
            out[g] = [np.concatenate(chunks, axis=0) if chunks else own[:0]]
        return out
    root = first.root
    if op == "broadcast":
        return {g: [] if g == root else [np.asarray(inputs[root][0]).reshape(-1)] for g in members}
    if op == "scatter":
        return {g: [np.asarray(inputs[root][g])] for g in members}
    if op == "gather":
        own = inputs[root][0]
        row = [inputs[j][0] if j in calls else virtual_shard(np.shape(own), dtype, own) for j in range(n)]
        return {g: row if g == root else [] for g in members}
    if op not in ("all_gather", "all_gather_into_tensor"):
        raise ValueError(f"hybrid_outputs: unknown collective {op!r}")
    # The group materialised (the output holds every member's shard anyway):
    # each virtual member a copy of the leftmost sandbox's call with its data.
    template = calls[members[0]]
    full_calls, full_inputs = [], []
    for j in range(n):
        if j in calls:
            full_calls.append(calls[j])
            full_inputs.append(list(inputs[j]))
        else:
            full_calls.append(template)
            full_inputs.append([virtual_shard(np.shape(a), dtype, a) for a in inputs[members[0]]])
    outs = run_collective(full_calls, full_inputs, gid=gid, seq=seq)
    return {g: outs[g] for g in members}
