"""Pruned all_reduces (``prism.rank.pruned``): which calls the sandbox members
run among themselves, and that their fold gives the compensated result the
host path computes (``prism.core.compensation.reduce_with_virtual``)."""

import numpy as np
import pytest
import torch

from prism.core.compensation import reduce_with_virtual
from prism.rank import pruned
from prism.rank.envnames import PRUNED_ENV, SANDBOX_ENV


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.setenv(PRUNED_ENV, str(tmp_path))
    monkeypatch.setenv(SANDBOX_ENV, "0,1,5")


def test_which_calls_are_pruned(env, monkeypatch):
    t = [torch.zeros(4)]
    assert pruned.members("all_reduce", "SUM", "float32", (0, 1, 2, 3), 1, t) == (0, 1)
    assert pruned.members("all_reduce", "AVG", "float64", (1, 5, 9), 5, t) == (1, 5)
    assert pruned.members("all_reduce", "SUM", "float32", (0, 2), 0, t) is None  # one sandbox member: host path
    assert pruned.members("all_reduce", "SUM", "float32", (0, 1), 2, t) is None  # not a member
    assert pruned.members("all_gather_into_tensor", "", "float32", (0, 1), 0, t) == (0, 1)
    assert pruned.members("reduce_scatter_tensor", "AVG", "float32", (0, 1, 2), 1, t) == (0, 1)
    assert pruned.members("all_to_all_single", "", "float32", (0, 1), 0, t) is None  # the host path
    assert pruned.members("broadcast", "", "float32", (0, 1), 0, t) is None
    assert pruned.members("all_reduce", "PRODUCT", "float32", (0, 1), 0, t) is None
    assert pruned.members("all_reduce", "SUM", "int64", (0, 1), 0, t) is None  # integer means: host path
    assert pruned.members("all_reduce", "SUM", "bfloat16", (0, 1), 0, t) is None
    monkeypatch.delenv(PRUNED_ENV)
    assert pruned.members("all_reduce", "SUM", "float32", (0, 1), 0, t) is None  # not asked for


@pytest.mark.parametrize("op,premul", [("SUM", None), ("AVG", None), ("PREMUL_SUM", 0.25), ("MIN", None),
                                       ("MAX", None)])
@pytest.mark.parametrize("n,k", [(2, 2), (4, 2), (8, 2), (6, 3)])
def test_fold_gives_the_compensated_result(op, premul, n, k):
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(64).astype(np.float64) for _ in range(k)]
    want = reduce_with_virtual(op, "float64", dict(enumerate(xs)), n, premul=premul)
    real = {"SUM": np.sum, "MIN": np.min, "MAX": np.max}[pruned.REAL_OP[op]](np.stack(xs), axis=0)
    t = torch.from_numpy(real.copy())
    pruned.fold(t, op, premul, n, k)
    np.testing.assert_allclose(t.numpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op,reduce_name", [("all_reduce", "SUM"), ("all_reduce", "AVG"),
                                            ("reduce_scatter_tensor", "AVG"), ("reduce_scatter_tensor", "SUM"),
                                            ("all_gather_into_tensor", "")])
def test_two_members_of_an_unsorted_group_get_the_host_paths_result(env, monkeypatch, op, reduce_name):
    """Members 1 and 3 of the group (3, 0, 2, 1): group ranks 3 and 0, real gloo between two threads."""
    import threading

    monkeypatch.setenv(SANDBOX_ENV, "1,3")
    group = (3, 0, 2, 1)
    n, ours = len(group), (1, 3)
    rng = np.random.default_rng(3)
    size = 6 if op == "all_gather_into_tensor" else 6 * n
    x = {r: rng.standard_normal(size) for r in ours}
    outs, errors = {}, []

    def member(r: int) -> None:
        try:
            inp = torch.from_numpy(x[r].copy())
            out = inp if op == "all_reduce" else torch.empty(6 * n if op == "all_gather_into_tensor" else 6,
                                                             dtype=torch.float64)
            work, after = pruned.start(f"g-{op}-{reduce_name}", ours, r, op, inp, out, reduce_name, None, group)
            work.wait()
            after()
            outs[r] = out.numpy()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in ours]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    by_group_rank = {group.index(r): x[r] for r in ours}  # {3: x[1], 0: x[3]}
    for r in ours:
        g = group.index(r)
        if op == "all_gather_into_tensor":  # a virtual member's shard: the leftmost member's (group rank 0: rank 3)
            want = np.concatenate([by_group_rank.get(j, x[3]) for j in range(n)])
        else:
            full = reduce_with_virtual(reduce_name, "float64", by_group_rank, n)
            want = full if op == "all_reduce" else full.reshape(n, -1)[g]
        np.testing.assert_allclose(outs[r], want, rtol=1e-12, atol=1e-12)


def test_views_with_gaps_and_empty_calls_keep_the_host_path(env):
    t = torch.zeros(4, 4)
    assert pruned.members("all_reduce", "SUM", "float32", (0, 1), 0, [t[:, 0]]) is None
    assert pruned.members("all_reduce", "SUM", "float32", (0, 1), 0, [torch.zeros(0)]) is None
    assert pruned.members("all_reduce", "SUM", "float32", (0, 1), 0, [t]) == (0, 1)
