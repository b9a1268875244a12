"""Which physical GPU each rank uses: pure placement arithmetic, without
torch, so that the launching side (``prism capture``, ``prism emulate``,
agents) plans GPUs without importing torch (an import of 1.5-2 s that would
otherwise precede the fork server's own). ``prism.rank.devices`` re-exports
these for the rank side.
"""

from __future__ import annotations

from collections.abc import Sequence

from prism.rank.envnames import GPUS_ENV, NODE_RANKS_ENV


def choose_gpu(rank: int, world_size: int, gpus: Sequence[int]) -> int:
    """The physical GPU of ``rank``: contiguous blocks of ranks per GPU, so
    neighbours (a TP group, a pipeline) share a GPU and swap as a gang."""
    if not gpus:
        raise ValueError("no physical GPU to place ranks on: give --gpus or set " + GPUS_ENV)
    return gpus[rank * len(gpus) // world_size]


def node_rank_list(text: str, world_size: int) -> list[int]:
    """``PRISM_NODE_RANKS`` ("8-15" or "0,2,4-5") as a sorted list of ranks."""
    from prism.core.payloads import RecordPlan

    return sorted(RecordPlan.parse_ranks(text, world_size))


def choose_node_gpu(rank: int, world_size: int, gpus: Sequence[int], node_ranks: str | None) -> int:
    """``choose_gpu`` among one node's ranks (``PRISM_NODE_RANKS``, "8-15" or
    "0,2,4"; None: the whole world is this node's): the node's GPUs ``gpus``
    are shared by the ranks placed there, in contiguous blocks."""
    if not node_ranks:
        return choose_gpu(rank, world_size, gpus)
    ranks = node_rank_list(node_ranks, world_size)
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not among this node's ranks {NODE_RANKS_ENV}={node_ranks}")
    return choose_gpu(ranks.index(rank), len(ranks), gpus)


def parse_gpus(text: str) -> list[int]:
    """``"0,1,3"`` -> ``[0, 1, 3]``; ``"cuda:2"`` -> ``[2]``."""
    out = []
    for word in text.replace("cuda:", "").split(","):
        word = word.strip()
        if not word:
            continue
        if not word.isdigit():
            raise ValueError(f"GPU list {text!r}: {word!r} is not a GPU index (expected e.g. 0,1 or cuda:0)")
        out.append(int(word))
    return out
