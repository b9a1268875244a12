"""A sandbox rank's groups matched to the graph's by members and creation order (sans-IO).

A sandbox rank names each group it creates ``group_id(index, ranks)``, with
``index`` torch's creation counter in its own run of the script. The graph's
ids come from the capture or, for a scaled-out run, from
``prism.core.scaleout``'s plan, whose creation order every rank agrees on
but which equals the script's only where the script creates its groups in
uniform nested loops. So ids are not compared. The sandbox's k-th group with
a given member list is the graph's k-th group with that member list, the
graph's groups taken in their creation order (the index in their id). A
script that creates its groups in another order than the plan assumed still
gets the right communicators; one that creates a group the graph lacks gets
no match, and its first collective there is a mismatch that names it.

``GroupMatcher.create`` takes each ``GroupCreate`` as it comes (per rank, in
creation order); ``to_graph`` and ``to_rank`` translate a rank's ids into the
graph's and back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

__all__ = ["GroupMatcher", "creation_index"]

_GID = re.compile(r"g(\d+)-[0-9a-f]+")


def creation_index(gid: str) -> int:
    """The creation index a ``group_id`` carries (``"world"``: 0)."""
    if gid == "world":
        return 0
    m = _GID.fullmatch(gid)
    if m is None:
        raise ValueError(f"group id {gid!r} is neither 'world' nor g<index>-<hash> (prism.core.trace.group_id)")
    return int(m.group(1))


class GroupMatcher:
    """The graph's groups by member list, each list's groups in creation order.

    ``groups``: (gid, ranks) pairs, such as ``ExecutionGraph.groups``.
    """

    def __init__(self, groups: Iterable[tuple[str, Sequence[int]]]) -> None:
        by_members: dict[tuple[int, ...], list[tuple[float, int, str]]] = {}
        for k, (gid, ranks) in enumerate(groups):
            try:
                index: float = creation_index(gid)
            except ValueError:  # not a group_id (synthetic graphs name their groups): the order given
                index = float("inf")
            by_members.setdefault(tuple(ranks), []).append((index, k, gid))
        self._by_members = {m: [gid for *_, gid in sorted(v)] for m, v in by_members.items()}
        #: (rank, member list) -> how many such groups the rank has created
        self._made: dict[tuple[int, tuple[int, ...]], int] = {}
        self._to_graph: dict[int, dict[str, str]] = {}
        self._to_rank: dict[int, dict[str, str]] = {}

    def create(self, rank: int, gid: str, ranks: Sequence[int]) -> str | None:
        """Rank ``rank`` created group ``gid`` of ``ranks``: the graph's group
        it is (None: the graph has no further group of these members)."""
        members = tuple(ranks)
        k = self._made.get((rank, members), 0)
        self._made[(rank, members)] = k + 1
        candidates = self._by_members.get(members, ())
        if k >= len(candidates):
            return None
        g = candidates[k]
        self._to_graph.setdefault(rank, {})[gid] = g
        self._to_rank.setdefault(rank, {})[g] = gid
        return g

    def to_graph(self, rank: int, gid: str) -> str:
        """The graph's id of ``rank``'s group ``gid`` (``gid`` itself when unmatched)."""
        return self._to_graph.get(rank, {}).get(gid, gid)

    def to_rank(self, rank: int, gid: str) -> str:
        """``rank``'s own id of the graph's group ``gid``."""
        return self._to_rank.get(rank, {}).get(gid, gid)

    def renamed(self, rank: int) -> int:
        """How many of ``rank``'s groups have another id in the graph."""
        return sum(1 for a, b in self._to_graph.get(rank, {}).items() if a != b)
