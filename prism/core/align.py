"""Aligning two sequences of segment signatures: which positions match.

``two_clock_columns`` (graph.py) pairs each step's compute segments with a
reference step's by the signatures of the calls that end them. Steps of a
data-dependent script (MoE) insert or drop a few segments among a thousand;
``matched_pairs`` finds a longest common subsequence by Myers' O((N+M)D)
greedy algorithm (E. Myers, "An O(ND) difference algorithm and its
variations", Algorithmica 1986), after trimming the common prefix and suffix.
Its cost grows with the number of differences D, not with N x M as
``difflib.SequenceMatcher`` does on long sequences with repeated elements
(measured by ``python bench/align_cost.py``). When the sequences differ in
more than ``max_d`` places (unrelated steps, where a minimal edit script means
little anyway) it falls back to difflib's matching blocks.

Pure Python, sans-IO.
"""

from __future__ import annotations

import difflib
from collections.abc import Hashable, Sequence

#: Beyond this many insertions plus deletions, fall back to difflib (Myers'
#: memory grows with D squared and its time with (N+M)D).
MAX_D = 512


def matched_pairs(a: Sequence[Hashable], b: Sequence[Hashable], *,
                  max_d: int = MAX_D) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)`` with ``a[i] == b[j]`` of a longest common
    subsequence of ``a`` and ``b``, increasing in both; difflib's matching
    blocks when they differ in more than ``max_d`` insertions and deletions."""
    n, m = len(a), len(b)
    lo = 0
    while lo < n and lo < m and a[lo] == b[lo]:
        lo += 1
    hi = 0
    while hi < n - lo and hi < m - lo and a[n - 1 - hi] == b[m - 1 - hi]:
        hi += 1
    head = [(i, i) for i in range(lo)]
    tail = [(n - hi + i, m - hi + i) for i in range(hi)]
    x_mid, y_mid = a[lo:n - hi], b[lo:m - hi]
    if not x_mid or not y_mid:
        return head + tail
    mid = _myers(x_mid, y_mid, max_d)
    if mid is None:
        sm = difflib.SequenceMatcher(None, x_mid, y_mid, autojunk=False)
        mid = [(i + k, j + k) for i, j, size in sm.get_matching_blocks() for k in range(size)]
    return head + [(i + lo, j + lo) for i, j in mid] + tail


def _myers(a: Sequence[Hashable], b: Sequence[Hashable], max_d: int) -> list[tuple[int, int]] | None:
    # Intern to small ints: comparing ints is cheaper than comparing tuples.
    ids: dict[Hashable, int] = {}
    x = [ids.setdefault(s, len(ids)) for s in a]
    y = [ids.setdefault(s, len(ids)) for s in b]
    n, m = len(x), len(y)
    off = n + m + 1
    v = [0] * (2 * off + 1)  # v[off + k]: furthest x on diagonal k = x - y
    history: list[list[int]] = []
    for d in range(min(n + m, max_d) + 1):
        history.append(v[off - d - 1:off + d + 2])  # diagonals -d-1 .. d+1, before this round
        for k in range(-d, d + 1, 2):
            if k == -d or (k != d and v[off + k - 1] < v[off + k + 1]):
                i = v[off + k + 1]  # down: an insertion from b
            else:
                i = v[off + k - 1] + 1  # right: a deletion from a
            j = i - k
            while i < n and j < m and x[i] == y[j]:
                i += 1
                j += 1
            v[off + k] = i
            if i >= n and j >= m:
                return _backtrack(history, n, m, d)
    return None


def _backtrack(history: list[list[int]], n: int, m: int, last: int) -> list[tuple[int, int]]:
    pairs: list[tuple[int, int]] = []
    i, j = n, m
    for d in range(last, 0, -1):
        prev = history[d]  # diagonals -d-1 .. d+1 as they stood before round d

        def at(k: int) -> int:
            return prev[k + d + 1]

        k = i - j
        pk = k + 1 if (k == -d or (k != d and at(k - 1) < at(k + 1))) else k - 1
        pi = at(pk)
        pj = pi - pk
        # the snake of round d started where the step from (pi, pj) landed
        si, sj = (pi, pj + 1) if pk == k + 1 else (pi + 1, pj)
        while i > si and j > sj:
            i -= 1
            j -= 1
            pairs.append((i, j))
        i, j = pi, pj
    while i > 0 and j > 0:  # round 0's snake from (0, 0)
        i -= 1
        j -= 1
        pairs.append((i, j))
    pairs.reverse()
    return pairs
