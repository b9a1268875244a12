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
