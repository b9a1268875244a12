"""``prism netprofile``'s measurement itself (prism.app.netprofile.measure):
two rank processes time all_reduce and send over gloo on this machine, or
over NCCL where 2 GPUs are present, and the alpha-beta fit of the points is
sane (the fit alone: tests/unit/test_netprofile.py)."""

import numpy as np
import pytest

from prism.app.netprofile import measure
from prism.core.netfit import fit_points, relative_errors


@pytest.mark.slow
def test_tiny_real_measurement_and_fit():
    pts = measure([1 << 10, 1 << 16, 1 << 20], [2], ["all_reduce", "send"], timeout=120)
    assert [(p.op, p.nbytes) for p in pts] == [(op, b) for op in ("all_reduce", "send")
                                               for b in (1 << 10, 1 << 16, 1 << 20)]
    assert all(0 < p.seconds < 1 for p in pts)
    fit = fit_points(pts)
    assert fit.bandwidth > 0 and np.isfinite(relative_errors(fit, pts)).all()


@pytest.mark.gpu(2, reason="NCCL between processes")
def test_tiny_real_nccl_measurement_and_fit():
    pts = measure([1 << 10, 1 << 20, 1 << 24], [2], ["all_reduce", "send"], timeout=300, backend="nccl")
    assert len(pts) == 6 and all(0 < p.seconds < 1 for p in pts)
    assert fit_points(pts).bandwidth > 1e9  # NVLink/PCIe, not a socket
    # collectives: GPU time and the CPU's issue time per call, measured apart
    assert all(0 < p.issue_seconds < 1e-3 for p in pts if p.op != "send")
    assert all(p.issue_seconds is None for p in pts if p.op == "send")


@pytest.mark.slow
def test_concurrent_measurement_times_every_block_at_once():
    # 4 processes cut into 2 blocks of 2 (and one block of 4): every block runs
    # the op (a block that did not would leave the world's barrier hanging).
    pts = measure([1 << 10], [2, 4], ["all_reduce", "send"], timeout=180, concurrent=4)
    assert [(p.op, p.n) for p in pts] == [("all_reduce", 2), ("send", 2), ("all_reduce", 4)]
    assert all(0 < p.seconds < 1 for p in pts)
    # beside the slowest member's time per call, the median member's (a typical group's), never above it
    assert all(0 < p.median_rank_seconds <= p.seconds for p in pts)
    with pytest.raises(ValueError, match="divide the world 4"):
        measure([1 << 10], [3], ["all_reduce"], concurrent=4)


@pytest.mark.slow
def test_a_gapped_measurement_times_each_call_after_the_callers_own_work():
    # each call after 20 ms of spinning: the points are the calls' own times (well under a millisecond
    # on a quiet host, a few on a loaded 2-core VM), not the gap's
    pts = measure([1 << 10, 1 << 16], [2], ["all_reduce", "send"], timeout=120, gap_us=20_000)
    assert [(p.op, p.nbytes) for p in pts] == [(op, b) for op in ("all_reduce", "send") for b in (1 << 10, 1 << 16)]
    assert all(0 < p.median_rank_seconds <= p.seconds < 0.015 for p in pts), pts
    with pytest.raises(ValueError, match="gloo only"):
        measure([1 << 10], [2], ["all_reduce"], backend="nccl", gap_us=100)
