"""What every torch.distributed collective computes, in numpy (sans-IO).

The coordinator of phase 1 stages every collective: each member sends its
input tensors (``protocol.CollectiveArrive``), and when the last member has
arrived the coordinator computes every member's outputs here and sends them
back (``protocol.CollectiveResult``). Results must be what the ground truth
(gloo on CPU) computes, bit for bit where we can, so a captured run's losses
match a real run's.

Reduction order (measured against torch 2.13's gloo, see
``tests/integration/test_gloo_collectives.py::test_matches_real_gloo``): gloo's all_reduce is a
ring reduce-scatter. The flat buffer of ``n`` elements is cut into ``W``
chunks (``W`` = group size), chunk ``c`` is accumulated along the ring
starting at group rank ``c-1`` and going down: ``x[c-1], x[c-2], ..., x[c]``
(indices mod ``W``), each step computing ``op(local, accumulated)`` in the
tensor's dtype (bfloat16 and float16 round after every step). Chunk ``c``
spans ``segments_per_rank * ceil(n / num_segments)`` elements where
``num_segments`` is the number of 1 MiB segments rounded up to a multiple of
``W`` and at least ``2 W``. torch's gloo ``reduce`` and
``reduce_scatter_tensor`` give the same values as that all_reduce over the
whole input, ``all_reduce_coalesced`` as one all_reduce over the concatenation
of its tensors, and list ``reduce_scatter`` as one all_reduce per list entry;
``reduce_arrays`` does all of these. gloo's MIN and MAX are ``std::min`` and
``std::max``, which keep the local value when either is NaN (numpy's
minimum would propagate it). AVG is that SUM divided by ``W`` in the
tensor's dtype (torch raises for integer tensors: see ``CollectiveError``).
Checked bit for bit for float32/float64/float16/bfloat16 at group sizes 3
and 4, from 1 element to 12 MB. One deliberate difference: gloo leaves
partial sums in a reduce's non-root tensors (torch calls them undefined);
Prism leaves them unchanged.
PREMUL_SUM (which gloo refuses; NCCL supports it and FSDP2 uses it) scales
each input by the factor in the tensor's dtype, then sums.

Dtypes are named as torch names them (``DTYPES``); bfloat16 is stored as its
raw 16 bits in ``uint16`` arrays and converted with ``bf16_to_f32`` and
``f32_to_bf16`` (round to nearest even, NaN kept quiet, as c10::BFloat16).

Per-op contract (shared with the rank backend, ``prism/rank/backend.py``):
``in_shapes`` are the tensors a member sends, one payload each, except that a
broadcast's receivers send no payload (they may declare the tensor in
``in_shapes``, or only in ``out_shapes``); ``out_shapes`` are the tensors it
gets back. The outputs for a member are one array per declared output, in
order, or none, which means "leave your tensors as they are" (the broadcast
root, a reduce's or gather's non-root members). ``n`` is the group size,
``i`` the member's group rank, ``x_j`` member ``j``'s inputs.

=========================  ==========================  ======================================
op                         in (payloads sent)          outputs returned to member i
=========================  ==========================  ======================================
all_reduce                 [t]                         [reduced]
all_reduce_coalesced       [t_1 .. t_k]                [reduced_1 .. reduced_k]
broadcast                  root: [t]; others: none     root: none; others: [root's t]
reduce                     [t]                         root: [reduced]; others: none
all_gather                 [t_1 .. t_k]                for each input t: x_0[t] .. x_{n-1}[t]
all_gather_into_tensor     [t_1 .. t_k]                for each input t: concat_j x_j[t]
gather                     [t]                         root: [x_0 .. x_{n-1}]; others: none
scatter                    root: n tensors; others []  [root's tensor i]
reduce_scatter             n tensors                   [reduction of the members' i-th]
reduce_scatter_tensor      [T_1 .. T_k]                for each input: part i of its reduction
all_to_all                 n tensors                   [x_0[i] .. x_{n-1}[i]]
all_to_all_single          [T] (rows split in_splits)  [rows from each member (out_splits)]
barrier                    []                          []
=========================  ==========================  ======================================

Outputs are reshaped to the member's ``out_shapes`` (equal element counts
are required). all_to_all_single splits dim 0 by ``in_splits``/``out_splits``
(rows; both empty means equal splits). PREMUL_SUM inputs arrive unscaled with
the factor in ``premul``. Outputs are numpy arrays, often shared between
members and views of the inputs; ``from_array`` turns each into payload bytes.

Public API
----------
``DTYPES``, ``to_array(buf, dtype, shape)``, ``from_array(arr)``,
``nbytes(dtype, shape)``, ``bf16_to_f32``, ``f32_to_bf16``,
``storage_dtype(dtype)``, ``FLOAT_DTYPES``,
``reduce_arrays(arrays, reduce_op, dtype, premul=None, *, max_segment_bytes=GLOO_MAX_SEGMENT_BYTES)``,
``check_reduce_op(reduce_op, dtype) -> str | None``,
``run_collective(calls, inputs, *, gid="", seq=-1, ranks=()) -> list[list[np.ndarray]]``,
``signature(call)``, ``describe(call)``, ``payload_shapes(call, group_rank)``,
``CollectiveError`` (``.gid``, ``.seq``, ``.op``, ``.rank``), ``CallLike``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from .protocol import Buffer
from .trace import COLLECTIVE_OPS, REDUCE_OPS

#: torch dtype name -> numpy dtype of the stored elements.
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),  # raw bits
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}
FLOAT_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16"})
#: The C++ scalar type names torch prints in its errors.
_TORCH_TYPE_NAMES = {
    "int8": "Char", "int16": "Short", "int32": "Int", "int64": "Long",
    "uint8": "Byte", "bool": "Bool",
}
#: gloo's maximum ring segment (``AllreduceOptionsImpl::kMaxSegmentSize``).
GLOO_MAX_SEGMENT_BYTES = 1 << 20

#: Chunks of at least this many elements are reduced slice by slice
#: (world**2 numpy calls); smaller ones in one gather per ring step (world
#: calls over all elements). Slices win on large chunks, gathers on many
#: small ones (float32 SUM, best of 3 on a 2-core VM): 8 ranks x 26 MB, slices
#: 0.04 s vs gathers 0.80 s; 512 ranks x 64 KB (chunks of 32 elements), slices
#: 0.26 s vs gathers 0.12 s.
_SLICE_MIN_CHUNK = 256

_REDUCING_OPS = frozenset(
    {"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor"}
)
_ROOTED_OPS = frozenset({"broadcast", "reduce", "gather", "scatter"})


class CollectiveError(Exception):
    """A collective call that torch would reject or that cannot be computed
    from what the members sent: the user script's fault (the message says what
    to change). ``gid``, ``seq``, ``op`` and ``rank`` (global, -1 when the
    whole call is wrong) say where."""

    def __init__(self, message: str, *, gid: str = "", seq: int = -1, op: str = "", rank: int = -1):
        super().__init__(message)
        self.gid = gid
        self.seq = seq
        self.op = op
        self.rank = rank


class CallLike(Protocol):
    """The fields of ``protocol.CollectiveArrive`` this module reads."""

    op: str
    reduce_op: str
    dtype: str
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    root: int
    in_splits: tuple[int, ...]
    out_splits: tuple[int, ...]
    premul: float | None


# --- payload bytes <-> arrays --------------------------------------------


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype storing torch dtype ``dtype``; ValueError if unknown."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype!r} is not supported by Prism's collectives; supported: {sorted(DTYPES)}"
        ) from None


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a contiguous tensor of ``dtype`` and ``shape``."""
    return storage_dtype(dtype).itemsize * math.prod(shape)


def to_array(buf: Buffer, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """A read-only array over ``buf`` (no copy); ValueError if sizes differ."""
    dt = storage_dtype(dtype)
    mv = memoryview(buf).cast("B")
    want = dt.itemsize * math.prod(shape)
    if mv.nbytes != want:
        raise ValueError(
            f"payload of {mv.nbytes} bytes does not hold a {dtype} tensor of shape "
            f"{tuple(shape)} ({want} bytes)"
        )
    arr = np.frombuffer(mv, dtype=dt).reshape(tuple(shape))
    arr.flags.writeable = False
    return arr


def from_array(arr: np.ndarray) -> bytes:
    """The raw little-endian bytes of ``arr`` in C order."""
    return np.ascontiguousarray(arr).tobytes()


# --- bfloat16 -----------------------------------------------------------


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 raw bits (exact)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """bfloat16 raw bits of float32 values, rounded to nearest even as
    c10::BFloat16 does (NaN becomes the quiet NaN 0x7FC0)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((u + (((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF))) >> np.uint32(16))
    out = rounded.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = 0x7FC0
    return out


# --- reductions -----------------------------------------------------------


def _step_fn(reduce_op: str, dtype: str):
    """``f(local, acc)`` for one ring step, computed as gloo does in ``dtype``.

    gloo's min/max are ``std::min(local, acc)``/``std::max(local, acc)``, which
    return ``local`` when either is NaN; np.minimum would propagate the NaN."""
    if reduce_op in ("SUM", "AVG", "PREMUL_SUM"):
        fn = np.add
    elif reduce_op == "PRODUCT":
        fn = np.multiply
    elif reduce_op == "MIN":
        def fn(a, b):
            return np.where(b < a, b, a)
    elif reduce_op == "MAX":
        def fn(a, b):
            return np.where(a < b, b, a)
    elif reduce_op == "BAND":
        fn = np.bitwise_and
    elif reduce_op == "BOR":
        fn = np.bitwise_or
    elif reduce_op == "BXOR":
        fn = np.bitwise_xor
    else:
        raise ValueError(f"unknown reduce op {reduce_op!r}; known: {list(REDUCE_OPS)}")
    if dtype == "bfloat16":
        def bf(a, b):
            return f32_to_bf16(fn(bf16_to_f32(a), bf16_to_f32(b)))
        return bf
    return fn


def _ring_chunk_elems(n: int, itemsize: int, world: int, max_segment_bytes: int) -> int:
    """Elements per chunk of gloo's ring all_reduce (see the module docstring)."""
    total = n * itemsize
    max_segment_bytes = itemsize * max(1, max_segment_bytes // itemsize)
    segs = max(-(-total // max_segment_bytes), 2 * world)
    segs = -(-segs // world) * world
    return (segs // world) * -(-n // segs)


def check_reduce_op(reduce_op: str, dtype: str) -> str | None:
    """Why torch refuses ``reduce_op`` on ``dtype`` (its own words), or None."""
    if reduce_op not in REDUCE_OPS:
        return f"unknown reduce op {reduce_op!r}; known: {list(REDUCE_OPS)}"
    if reduce_op in ("BAND", "BOR", "BXOR") and dtype in FLOAT_DTYPES:
        return f"Cannot use ReduceOp.{reduce_op} with non-integral dtype"
    if reduce_op == "AVG" and dtype not in FLOAT_DTYPES:
        return (
            f"result type Float can't be cast to the desired output type "
            f"{_TORCH_TYPE_NAMES[dtype]} (ReduceOp.AVG needs a floating-point tensor)"
        )
    return None


def reduce_arrays(
    arrays: Sequence[np.ndarray],
    reduce_op: str,
    dtype: str,
    premul: float | None = None,
    *,
    max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES,
) -> np.ndarray:
    """Element-wise reduction of the members' arrays (group-rank order, equal
    shapes) in gloo's ring order. ValueError on an op torch refuses for the
    dtype (``check_reduce_op``) or on unequal shapes. ``max_segment_bytes`` is
    gloo's segment limit (``setMaxSegmentSize``; tests shrink it)."""
    why = check_reduce_op(reduce_op, dtype)
    if why:
        raise ValueError(why)
    world = len(arrays)
    if world == 0:
        raise ValueError("nothing to reduce: no arrays")
    shape = arrays[0].shape
    for i, a in enumerate(arrays):
        if a.shape != shape:
            raise ValueError(f"array {i} has shape {a.shape}, array 0 has {shape}")
    dt = storage_dtype(dtype)
    flat = [np.asarray(a, dtype=dt).reshape(-1) for a in arrays]
    n = flat[0].size
    with np.errstate(all="ignore"):
        if reduce_op == "PREMUL_SUM":
            if premul is None:
                raise ValueError("PREMUL_SUM needs its factor (premul), got None")
            flat = [_scale(a, premul, dtype) for a in flat]
        if world == 1 or n == 0:
            out = flat[0].copy()
        else:
            fn = _step_fn(reduce_op, dtype)
            chunk = _ring_chunk_elems(n, dt.itemsize, world, max_segment_bytes)
            if chunk >= _SLICE_MIN_CHUNK:
                out = np.empty(n, dt)
                for c in range(world):
                    lo, hi = c * chunk, min((c + 1) * chunk, n)
                    if lo >= n:
                        break
                    acc = flat[(c - 1) % world][lo:hi]
                    for k in range(2, world + 1):
                        acc = fn(flat[(c - k) % world][lo:hi], acc)
                    out[lo:hi] = acc
            else:
                stacked = np.stack(flat)
                cols = np.arange(n)
                chunk_of = cols // chunk
                acc = stacked[(chunk_of - 1) % world, cols]
                for k in range(2, world + 1):
                    acc = fn(stacked[(chunk_of - k) % world, cols], acc)
                out = np.asarray(acc, dtype=dt)
        if reduce_op == "AVG":
            out = _divide(out, world, dtype)
    return out.reshape(shape)


def _scale(a: np.ndarray, factor: float, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return f32_to_bf16(bf16_to_f32(a) * np.float32(factor))
    if dtype == "float16":
        return (a.astype(np.float32) * np.float32(factor)).astype(np.float16)
    dt = storage_dtype(dtype)
    return (a * dt.type(factor)).astype(dt)


def _divide(out: np.ndarray, world: int, dtype: str) -> np.ndarray:
    # torch's gloo AVG is SUM then ``tensor.div_(world)``; half types divide in float32.
    if dtype == "bfloat16":
        return f32_to_bf16(bf16_to_f32(out) / np.float32(world))
    if dtype == "float16":
        return (out.astype(np.float32) / np.float32(world)).astype(np.float16)
    return (out / out.dtype.type(world)).astype(out.dtype)


# --- call signatures -------------------------------------------------------


def _shapes(shapes: Sequence[Sequence[int]]) -> str:
    return "[" + ", ".join(str(tuple(s)) for s in shapes) + "]"


def _broadcast_shapes(call: CallLike) -> tuple:
    """The broadcast tensor's shape as a member declares it: receivers declare
    it in ``in_shapes`` (sending no payload) or only in ``out_shapes``."""
    return tuple(call.in_shapes) or tuple(call.out_shapes)


def payload_shapes(call: CallLike, group_rank: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of the payloads member ``group_rank`` sends with ``call``:
    its ``in_shapes``, except that a broadcast's receivers send nothing."""
    if call.op == "broadcast" and group_rank != call.root:
        return ()
    return tuple(tuple(s) for s in call.in_shapes)


def describe(call: CallLike) -> str:
    """A call as the script wrote it, e.g. ``all_reduce(SUM, float32, [(4, 4)])``."""
    if call.op == "barrier":
        return "barrier()"
    parts = []
    if call.op in _REDUCING_OPS:
        parts.append(call.reduce_op if call.reduce_op != "PREMUL_SUM" else f"PREMUL_SUM({call.premul})")
    parts.append(call.dtype)
    parts.append(_shapes(_broadcast_shapes(call) if call.op == "broadcast" else call.in_shapes))
    if call.op in _ROOTED_OPS:
        parts.append(f"root={call.root}")
    if call.op == "all_to_all_single" and (call.in_splits or call.out_splits):
        parts.append(f"in_splits={list(call.in_splits)}, out_splits={list(call.out_splits)}")
    return f"{call.op}({', '.join(parts)})"


def signature(call: CallLike) -> tuple:
    """What must be equal on every member of one collective instance (checked
    as each member arrives; per-member shapes are checked by
    ``run_collective`` once all have arrived)."""
    op = call.op
    sig: tuple = (op,)
    if op in _REDUCING_OPS:
        sig += (call.reduce_op, call.premul if call.reduce_op == "PREMUL_SUM" else None)
    if op != "barrier":
        sig += (call.dtype,)
    if op in _ROOTED_OPS:
        sig += (call.root,)
    if op == "broadcast":
        sig += (_broadcast_shapes(call),)
    if op in ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
              "reduce_scatter_tensor", "all_gather_into_tensor", "gather"):
        sig += (tuple(call.in_shapes),)
    if op in ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "scatter"):
        sig += (tuple(call.out_shapes),)
    return sig


# --- the collectives ----------------------------------------------------------


def run_collective(
    calls: Sequence[CallLike],
    inputs: Sequence[Sequence[np.ndarray]],
    *,
    gid: str = "",
    seq: int = -1,
    ranks: Sequence[int] = (),
) -> list[list[np.ndarray]]:
    """Every member's outputs of one collective instance.

    ``calls[i]`` and ``inputs[i]`` are group rank ``i``'s call and input
    arrays (``to_array`` of its payloads, shaped as its ``in_shapes``);
    ``ranks[i]`` is its global rank (for messages; defaults to ``i``). Returns
    ``outputs[i]`` per the table in the module docstring. Raises
    ``CollectiveError`` (the user script's fault) on calls that disagree or
    that torch would reject.
    """
    world = len(calls)
    ranks = tuple(ranks) if ranks else tuple(range(world))
    if world == 0 or len(inputs) != world or len(ranks) != world:
        raise ValueError(f"{world} calls, {len(inputs)} inputs and {len(ranks)} ranks: need one each per member")
    first = calls[0]
    op = first.op

    def fail(msg: str, i: int = -1) -> CollectiveError:
        who = f"rank {ranks[i]} " if i >= 0 else ""
        where = f"{op} on group {gid} (ranks {list(ranks)}) at sequence {seq}"
        return CollectiveError(f"{where}: {who}{msg}", gid=gid, seq=seq, op=op, rank=ranks[i] if i >= 0 else -1)

    if op not in COLLECTIVE_OPS:
        raise fail(f"called unknown collective {op!r}; known: {list(COLLECTIVE_OPS)}")
    sig = signature(first)
    for i, c in enumerate(calls):
        if signature(c) != sig:
            raise fail(f"called {describe(c)} but rank {ranks[0]} called {describe(first)}", i)
    if op == "barrier":
        return [[] for _ in range(world)]
    dtype = first.dtype
    if dtype not in DTYPES:
        raise fail(f"passed a {dtype} tensor; Prism supports {sorted(DTYPES)}")
    if op in _ROOTED_OPS and not 0 <= first.root < world:
        raise fail(f"names root {first.root} (a group rank), which must be in [0, {world})")
    if op in _REDUCING_OPS:
        why = check_reduce_op(first.reduce_op, dtype)
        if why:
            raise fail(why)
    for i, (c, arrs) in enumerate(zip(calls, inputs)):
        got = tuple(a.shape for a in arrs)
        want = payload_shapes(c, i)
        if got != want:
            raise fail(f"sent tensors of shapes {_shapes(got)} but declared {_shapes(want)}; "
                       "this is a Prism bug, please report it", i)
    outs = _compute(op, first, calls, inputs, world, ranks, fail)
    # Reshape each shared result once, so members keep sharing one array.
    reshaped: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}
    for i, c in enumerate(calls):
        declared = [tuple(s) for s in c.out_shapes]
        if not outs[i]:
            continue  # "leave your tensors as they are", whatever the member declared
        if len(outs[i]) != len(declared):
            raise fail(f"passed {len(declared)} output tensors where {op} returns {len(outs[i])} "
                       f"(shapes {_shapes([a.shape for a in outs[i]])})", i)
        for k, (a, shape) in enumerate(zip(outs[i], declared)):
            if a.shape != shape:
                if a.size != math.prod(shape):
                    raise fail(f"passed output tensor {k} of shape {shape} for a result of shape "
                               f"{a.shape}; size the output to match", i)
                key = (id(a), shape)
                if key not in reshaped:
                    reshaped[key] = a.reshape(shape)
                outs[i][k] = reshaped[key]
    return outs


def _compute(op, first, calls, inputs, world, ranks, fail) -> list[list[np.ndarray]]:
    dtype = first.dtype

    def one(i: int, k: int) -> np.ndarray:
        return inputs[i][k]

    def reduce(arrays: Sequence[np.ndarray]) -> np.ndarray:
        return reduce_arrays(arrays, first.reduce_op, dtype, first.premul)

    def need_count(i: int, shapes: Sequence, count: int, what: str) -> None:
        if len(shapes) != count:
            per = f" in a group of {world}" if count == world else ""
            raise fail(f"passed {len(shapes)} {what} tensors where {op} takes {count}{per}", i)

    root = first.root
    if op in ("all_reduce", "reduce"):
        need_count(0, first.in_shapes, 1, "input")
        result = reduce([one(i, 0) for i in range(world)])
        if op == "reduce":
            return [[result] if i == root else [] for i in range(world)]
        return [[result] for _ in range(world)]
    if op == "all_reduce_coalesced":
        flat = [np.concatenate([a.reshape(-1) for a in inputs[i]]) if inputs[i] else
                np.empty(0, storage_dtype(dtype)) for i in range(world)]
        red = reduce(flat)
        outs, at = [], 0
        for s in first.in_shapes:
            size = math.prod(s)
            outs.append(red[at:at + size].reshape(s))
            at += size
        return [list(outs) for _ in range(world)]
    if op == "broadcast":
        need_count(root, calls[root].in_shapes, 1, "broadcast input")
        value = one(root, 0)
        return [[] if i == root else [value] for i in range(world)]
    if op == "all_gather":
        k = len(first.in_shapes)
        for i, c in enumerate(calls):
            need_count(i, c.in_shapes, k, "input")
        # n outputs per input: input t's shard from group rank 0, 1, ...
        return [[one(j, t) for t in range(k) for j in range(world)] for _ in range(world)]
    if op == "gather":
        for i, c in enumerate(calls):
            need_count(i, c.in_shapes, 1, "input")
        shards = [one(i, 0) for i in range(world)]
        return [list(shards) if i == root else [] for i in range(world)]
    if op == "all_gather_into_tensor":
        cats = [np.concatenate([one(j, t).reshape(-1) for j in range(world)])
                for t in range(len(first.in_shapes))]
        return [list(cats) for _ in range(world)]
    if op == "scatter":
        need_count(root, calls[root].in_shapes, world, "scatter input")
        return [[one(root, i)] for i in range(world)]
    if op == "reduce_scatter":
        for i, c in enumerate(calls):
            need_count(i, c.in_shapes, world, "input")
        return [[reduce([one(j, i) for j in range(world)])] for i in range(world)]
    if op == "reduce_scatter_tensor":
        parts = []
        for t, in_shape in enumerate(first.in_shapes):
            size = math.prod(in_shape)
            if size % world:
                raise fail(f"passed input tensor {t} of shape {tuple(in_shape)}, which does not split "
                           f"into {world} equal parts", 0)
            red = reduce([one(j, t).reshape(-1) for j in range(world)])
            part = size // world
            parts.append([red[i * part:(i + 1) * part] for i in range(world)])
        return [[p[i] for p in parts] for i in range(world)]
    if op == "all_to_all":
        for i, c in enumerate(calls):
            need_count(i, c.in_shapes, world, "input")
        return [[one(j, i) for j in range(world)] for i in range(world)]
    if op == "all_to_all_single":
        return _all_to_all_single(fail, calls, inputs, world, ranks)
    raise fail("is not implemented by Prism yet; please report this")


def _splits(fail, i: int, splits: Sequence[int], rows: int, world: int, what: str) -> list[int]:
    if not splits:
        if rows % world:
            raise fail(f"passed an {what} tensor of {rows} rows with no split sizes; "
                       f"equal splits need a multiple of the group size {world}", i)
        return [rows // world] * world
    if len(splits) != world:
        raise fail(f"passed {len(splits)} {what} split sizes {list(splits)}; a group of {world} needs {world}", i)
    if any(s < 0 for s in splits) or sum(splits) != rows:
        raise fail(f"passed {what} split sizes {list(splits)} (sum {sum(splits)}) for a tensor of "
                   f"{rows} rows; they must be non-negative and sum to the rows", i)
    return list(splits)


def _all_to_all_single(fail, calls, inputs, world, ranks):
    ins, outs = [], []
    for i, c in enumerate(calls):
        if len(c.in_shapes) != 1 or len(c.out_shapes) != 1:
            raise fail(f"passed {len(c.in_shapes)} inputs and {len(c.out_shapes)} outputs; "
                       "all_to_all_single takes one of each", i)
        in_shape, out_shape = tuple(c.in_shapes[0]), tuple(c.out_shapes[0])
        if len(in_shape) == 0 or in_shape[1:] != out_shape[1:]:
            raise fail(f"passed input {in_shape} and output {out_shape}; they need at least one "
                       "dimension and equal sizes beyond dim 0", i)
        ins.append(_splits(fail, i, c.in_splits, in_shape[0], world, "input"))
        outs.append(_splits(fail, i, c.out_splits, out_shape[0], world, "output"))
    row = tuple(calls[0].in_shapes[0][1:])
    for i, c in enumerate(calls):
        if tuple(c.in_shapes[0][1:]) != row:
            raise fail(f"sends rows of shape {tuple(c.in_shapes[0][1:])} but rank {ranks[0]} sends {row}", i)
    starts = [np.concatenate([[0], np.cumsum(s)]).astype(int) for s in ins]
    result = []
    for i in range(world):
        pieces = []
        for j in range(world):
            if ins[j][i] != outs[i][j]:
                raise fail(f"expects {outs[i][j]} rows from rank {ranks[j]}, which sends {ins[j][i]}; "
                           "the split sizes disagree between the two ranks", i)
            pieces.append(inputs[j][0][starts[j][i]:starts[j][i + 1]])
        result.append([np.concatenate(pieces) if pieces else inputs[i][0][:0]])
    return result
