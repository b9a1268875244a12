"""prism.core.align: Myers' alignment finds a longest common subsequence."""

from __future__ import annotations

import random

import pytest

from prism.core.align import matched_pairs


def _lcs_len(a, b) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def _check(a, b, pairs) -> None:
    assert all(a[i] == b[j] for i, j in pairs)
    assert all(i1 < i2 and j1 < j2 for (i1, j1), (i2, j2) in zip(pairs, pairs[1:]))


@pytest.mark.parametrize("seed", range(200))
def test_pairs_form_a_longest_common_subsequence(seed):
    rng = random.Random(seed)
    alphabet = "abc"[: rng.randint(1, 3)] + "de"[: rng.randint(0, 2)]
    a = [rng.choice(alphabet) for _ in range(rng.randint(0, 30))]
    b = [rng.choice(alphabet) for _ in range(rng.randint(0, 30))]
    pairs = matched_pairs(a, b)
    _check(a, b, pairs)
    assert len(pairs) == _lcs_len(a, b)


def test_a_step_with_inserted_segments_keeps_its_program_points():
    layer = [("join", 1), ("coll", "a2a"), ("coll", "a2a"), ("coll", "ar")]
    ref = layer * 250
    mine = list(ref)
    for pos in (990, 700, 400, 13):  # data-dependent joins inserted
        mine.insert(pos, ("join", 2))
    pairs = matched_pairs(ref, mine)
    _check(ref, mine, pairs)
    assert len(pairs) == len(ref)  # every reference segment found its counterpart
    assert [j for _, j in pairs if j < 13] == list(range(13))


def test_too_many_differences_fall_back_to_difflib():
    rng = random.Random(1)
    a = [rng.randrange(4) for _ in range(300)]
    b = [rng.randrange(4) for _ in range(300)]
    pairs = matched_pairs(a, b, max_d=8)
    _check(a, b, pairs)
    assert 0 < len(pairs) <= _lcs_len(a, b)


def test_tuples_and_empty_sequences():
    assert matched_pairs([], [(1, 2)]) == []
    assert matched_pairs([(1, 2)], [(1, 2)]) == [(0, 0)]
    assert matched_pairs(["x", "y"], ["y"]) == [(1, 0)]
