"""prism.rank.devicepath: a GPU sandbox's in-place compensated outputs equal
what the coordinator computes for it (prism.core.compensation.hybrid_outputs)
for one sandbox among virtual members. The formulas are pure torch, so they
run on CPU tensors here; on a GPU they run on the caller's stream."""

import numpy as np
import pytest
import torch

from prism.core import protocol as P
from prism.core.compensation import hybrid_outputs
from prism.rank import devicepath


def _arrive(op, dtype, x_shape, out_shape, reduce_op="", premul=None, splits=()):
    return P.CollectiveArrive(rank=0, gid="g", seq=0, op=op, reduce_op=reduce_op, dtype=dtype,
                              in_shapes=(x_shape,), out_shapes=(out_shape,), premul=premul,
                              in_splits=splits, out_splits=splits)


CASES = [
    ("all_reduce", "SUM", None), ("all_reduce", "AVG", None), ("all_reduce", "MIN", None),
    ("all_reduce", "MAX", None), ("all_reduce", "PREMUL_SUM", 0.25),
    ("reduce_scatter_tensor", "SUM", None), ("reduce_scatter_tensor", "AVG", None),
    ("all_gather_into_tensor", "", None), ("all_to_all_single", "", None),
]


@pytest.mark.parametrize("op,reduce_op,premul", CASES)
@pytest.mark.parametrize("g", [0, 2])
def test_device_outputs_equal_the_coordinators_compensation(op, reduce_op, premul, g):
    n, c = 4, 6
    x = torch.randn(n * c if op in ("reduce_scatter_tensor", "all_to_all_single") else c, generator=torch.Generator().manual_seed(g))
    out = {"all_reduce": x, "reduce_scatter_tensor": torch.empty(c), "all_gather_into_tensor": torch.empty(n * c),
           "all_to_all_single": torch.empty(n * c)}[op]
    splits = (c,) * n if op == "all_to_all_single" else ()
    msg = _arrive(op, "float32", tuple(x.shape), tuple(out.shape), reduce_op, premul, splits)
    want = hybrid_outputs({g: msg}, {g: [x.numpy().copy()]}, n)[g][0]
    devicepath.form_outputs(op, reduce_op, premul, n, g, [x], [out])
    got = out.numpy()
    if reduce_op == "PREMUL_SUM":
        np.testing.assert_allclose(got, np.asarray(want).reshape(got.shape), rtol=1e-6)
    else:
        assert np.array_equal(got, np.asarray(want).reshape(got.shape))


def test_eligibility_keeps_the_host_path_where_it_must(monkeypatch):
    monkeypatch.setenv(devicepath.GPU_SANDBOX_ENV, "1")
    monkeypatch.setattr(devicepath, "_sandbox", frozenset({0, 1}))
    monkeypatch.setattr(devicepath, "releaser", lambda: object())
    t = torch.zeros(4)
    assert not devicepath.eligible("all_reduce", (0, 2), 0, [t], (), (), "SUM")  # a CPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert devicepath.eligible("all_reduce", (0, 2), 0, [t], (), (), "SUM")
    assert not devicepath.eligible("all_reduce", (0, 1), 0, [t], (), (), "SUM")  # another sandbox in the group
    assert not devicepath.eligible("send", (0, 2), 0, [t], (), (), "")
    assert not devicepath.eligible("all_to_all_single", (0, 2), 0, [t], (1, 3), (1, 3), "")  # uneven
    assert not devicepath.eligible("all_reduce", (0, 2), 0, [t], (), (), "PRODUCT")
    monkeypatch.delenv(devicepath.GPU_SANDBOX_ENV)
    assert not devicepath.eligible("all_reduce", (0, 2), 0, [t], (), (), "SUM")
