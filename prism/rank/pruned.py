"""Pruned collectives: sandbox members of one group run it among themselves.

With ``prism emulate --pruned`` (``PRUNED_ENV`` names a folder the sandbox
ranks share), an all_reduce, all_gather_into_tensor or reduce_scatter_tensor
whose group holds two or more sandbox ranks is
not staged through the coordinator: those members run the real collective
among themselves on a gloo communicator of the members only (created on
their first such call on that group, from a ``FileStore`` in that folder:
every member reaches the call in the same order, as in the real job), and
the virtual members' part is folded in afterwards, as
``prism.core.compensation`` defines it for k sandbox contributions standing
in for N members ("the leftmost virtual rank compensates"):

===========  =================================  ==============================
reduce op    the members run                    then each applies
===========  =================================  ==============================
SUM          SUM of the k inputs (S)            S x N / k
AVG          SUM                                S / k
PREMUL_SUM   SUM                                S x factor x N / k
MIN / MAX    MIN / MAX                          nothing (the virtual min/max is theirs)
===========  =================================  ==============================

A reduce_scatter_tensor runs over the members' own parts only (each member's
input packed as the members' parts in member order: the real traffic of k
ranks), then folds the same way. An all_gather_into_tensor gathers the k
members' shards and fills each virtual member's slot with the leftmost
member's shard (``compensation.virtual_shard``'s rule: a virtual member is a
copy of the leftmost sandbox).

The result equals the host path's compensated one up to rounding (the host
path reduces the k inputs and the folded one in gloo's ring order; here the
members reduce k, then one multiply). The
coordinator still paces the call: the arrival carries no payloads
(``CollectiveArrive.pruned``; with a recording, its inputs' digests), the
reply only the release (or the recorded outputs, where the inputs are the
recorded ones: they replace the members' result), and the rank
returns the result no sooner than both (the real traffic and the emulated
release) are done. Floating CPU tensors only (gloo); everything else keeps
the host path. The GPU counterpart (NCCL among sandbox GPUs) is not built.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

from prism.rank.envnames import PRUNED_DIGESTS_ENV, PRUNED_ENV, SANDBOX_ENV

__all__ = ["members", "start", "fold", "OPS", "REAL_OP", "SUPPORTED"]

#: The reduce op the members run for each supported op.
REAL_OP = {"SUM": "SUM", "AVG": "SUM", "PREMUL_SUM": "SUM", "MIN": "MIN", "MAX": "MAX"}
SUPPORTED = frozenset(REAL_OP)
_FLOATS = frozenset({"float32", "float64"})

_lock = threading.Lock()
_groups: dict[tuple[str, int], Any] = {}
_group_locks: dict[tuple[str, int], threading.Lock] = {}
#: How long the members wait for each other while they set up a communicator.
SETUP_TIMEOUT_S = 120


def _strided() -> Any:
    import torch

    return torch.strided


def _sandbox() -> frozenset[int]:
    text = os.environ.get(SANDBOX_ENV, "")
    return frozenset(int(r) for r in text.split(",") if r.strip())


OPS = frozenset({"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"})


def members(op: str, reduce_name: str, dtype: str, group_ranks: Sequence[int], rank: int,
            tensors: Sequence[Any]) -> tuple[int, ...] | None:
    """The group's sandbox members (global ranks, ascending) when this call
    is pruned; else None (the host path)."""
    if not os.environ.get(PRUNED_ENV) or op not in OPS or dtype not in _FLOATS:
        return None
    if op != "all_gather_into_tensor" and reduce_name not in SUPPORTED:
        return None
    if not tensors or any(t.device.type != "cpu" or t.layout != _strided() or not t.is_contiguous()
                          or t.numel() == 0 for t in tensors):
        return None  # gloo reads a dense buffer; views with gaps and empty calls keep the host path
    sandbox = _sandbox()
    ours = tuple(sorted(r for r in group_ranks if r in sandbox))
    return ours if len(ours) >= 2 and rank in ours else None


def digests_wanted() -> bool:
    """Whether the coordinator has recordings to check a pruned call's inputs against."""
    return os.environ.get(PRUNED_DIGESTS_ENV) == "1"


def _communicator(gid: str, ours: tuple[int, ...], rank: int) -> Any:
    key = (gid, rank)  # by rank too: tests run two members in one process
    with _lock:
        lock = _group_locks.setdefault(key, threading.Lock())
    with lock:
        pg = _groups.get(key)
        if pg is None:
            import torch.distributed as dist
            from torch._C._distributed_c10d import ProcessGroupGloo

            folder = os.environ[PRUNED_ENV]
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", gid)
            store = dist.FileStore(os.path.join(folder, f"group-{name}"), len(ours))
            store.set_timeout(datetime.timedelta(seconds=SETUP_TIMEOUT_S))
            pg = _groups[key] = ProcessGroupGloo(store, ours.index(rank), len(ours),
                                                 datetime.timedelta(seconds=SETUP_TIMEOUT_S))
        return pg


def start(gid: str, ours: tuple[int, ...], rank: int, op: str, inp: Any, out: Any, reduce_name: str,
          premul: float | None, group_ranks: Sequence[int]) -> tuple[Any, Any]:
    """Issue the members' real call (``inp`` into ``out``; the same tensor for
    an all_reduce). Returns its work and what to run once it has finished
    (the fold, or the virtual members' shards)."""
    import torch
    import torch.distributed as dist

    pg = _communicator(gid, ours, rank)
    n, k = len(group_ranks), len(ours)
    if op == "all_reduce":
        opts = dist.AllreduceOptions()
        opts.reduceOp = getattr(dist.ReduceOp, REAL_OP[reduce_name])
        return pg.allreduce([out], opts), lambda: fold(out, reduce_name, premul, n, k)
    slots = [group_ranks.index(r) for r in ours]  # each member's place in the group
    if op == "reduce_scatter_tensor":
        parts = inp.reshape(n, inp.numel() // n)
        packed = torch.cat([parts[g] for g in slots]).contiguous()  # the members' own parts, in member order
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = getattr(dist.ReduceOp, REAL_OP[reduce_name])
        mine = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)

        def after_rs() -> None:
            fold(mine, reduce_name, premul, n, k)
            if mine is not out:
                out.copy_(mine)

        return pg._reduce_scatter_base(mine.reshape(-1), packed, opts), after_rs
    # all_gather_into_tensor
    got = torch.empty(k * inp.numel(), dtype=inp.dtype)
    src = inp.contiguous().reshape(-1)

    lead = min(range(k), key=slots.__getitem__)  # the member of the lowest group rank (hybrid_outputs' leftmost)

    def after_ag() -> None:
        shards = got.view(k, src.numel())
        full = torch.empty(n, src.numel(), dtype=src.dtype)
        for g in range(n):
            full[g].copy_(shards[slots.index(g)] if g in slots else shards[lead])  # a virtual member: the leftmost's
        out.copy_(full.reshape(out.shape))

    return pg._allgather_base(got, src), after_ag


def fold(tensor: Any, reduce_name: str, premul: float | None, group_size: int, k: int) -> None:
    """Fold the N - k virtual members' contribution into the members' result
    ``tensor`` (in place), per the table above."""
    if reduce_name == "SUM":
        scale = group_size / k
    elif reduce_name == "AVG":
        tensor.div_(k)  # as the host path divides
        return
    elif reduce_name == "PREMUL_SUM":
        scale = (premul if premul is not None else 1.0) * group_size / k
    else:  # MIN / MAX: the virtual members' value is the members' min / max
        return
    if scale != 1.0:
        tensor.mul_(scale)
