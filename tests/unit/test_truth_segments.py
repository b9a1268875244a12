"""prism.validation.truthcut cuts a profiled truth step at its communication
calls the way a capture cuts it, and a GPU-only profile at its NCCL kernels
(synthetic Chrome traces: no GPU needed)."""

import pytest

from prism.validation import truthcut as ts


def _x(cat, name, t, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": t, "dur": dur, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_a_step_is_cut_at_its_calls_and_each_stretch_gets_the_gpu_work_it_launched():
    ev = [
        _x("cpu_op", "aten::mm", 0, 50),
        _x("cuda_runtime", "cudaLaunchKernel", 10, 5, corr=1),
        _x("cuda_runtime", "cudaLaunchKernel", 30, 5, corr=2),
        _x("cpu_op", "c10d::allreduce_", 100, 20),
        _x("cpu_op", "record_param_comms", 105, 10),  # nested in the call: not a boundary
        _x("cuda_runtime", "cudaLaunchKernel", 110, 5, corr=3),  # NCCL's, inside the call
        _x("cpu_op", "aten::add", 150, 30),
        _x("cuda_runtime", "cudaLaunchKernel", 160, 5, corr=4),
        _x("cpu_op", "c10d::broadcast_", 200, 10),
        _x("cpu_op", "aten::mul", 250, 20),
        _x("cpu_op", "aten::mul", 260, 5, tid=2),  # another thread
        # GPU: kernels 1 and 2 overlap (union 0..400), NCCL kernel, kernel 4
        _x("kernel", "sgemm", 20, 300, tid=7, corr=1),
        _x("kernel", "sgemm", 100, 300, tid=8, corr=2),
        _x("kernel", "ncclDevKernel_AllReduce", 400, 50, tid=9, corr=3),
        _x("gpu_memcpy", "Memcpy HtoD", 450, 25, tid=7, corr=4),
    ]
    out = ts.cut_profile({"traceEvents": ev})
    segs = out["segments"]
    assert [s["ended_by"] for s in segs] == ["c10d::allreduce_", "c10d::broadcast_", "step end"]
    assert [s["cpu_ms"] * 1e3 for s in segs] == pytest.approx([100, 80, 60])  # 0..100, 120..200, 210..270
    assert [s["gpu_ms"] * 1e3 for s in segs] == pytest.approx([380, 25, 0])
    assert [s["launches"] for s in segs] == [2, 1, 0]
    assert out["comm_gpu_ms"] * 1e3 == pytest.approx(50)
    assert out["gpu_ms"] * 1e3 == pytest.approx(405)


def test_a_profile_without_operators_is_refused():
    with pytest.raises(ValueError, match="no CPU operators"):
        ts.cut_profile({"traceEvents": [_x("kernel", "k", 0, 1)]})


def test_the_truth_timeline_is_cut_at_nccl_kernels_with_waits_and_cpu_lead():
    ev = [
        _x("cuda_runtime", "cudaLaunchKernel", 0, 5, corr=1),
        _x("kernel", "gemm", 10, 100, tid=7, corr=1),
        _x("cuda_driver", "cuLaunchKernelEx", 20, 5, corr=2),
        _x("kernel", "ncclDevKernel_AllReduce", 110, 40, tid=7, corr=2),
        _x("cuda_runtime", "cudaLaunchKernel", 60, 5, corr=3),  # launched 90 us before the stream is free
        _x("kernel", "gelu", 150, 20, tid=7, corr=3),
        _x("cuda_runtime", "cudaLaunchKernel", 200, 5, corr=4),  # the GPU waited 30 us for this one
        _x("kernel", "gemm", 200, 50, tid=7, corr=4),
    ]
    out = ts.timeline({"traceEvents": ev})
    first, second = out["segments"]
    assert first["busy_ms"] == pytest.approx(0.1) and first["cpu_ms"] == pytest.approx(0.02)
    assert second["free_ms"] == pytest.approx(0.15) and second["ahead_ms"] == pytest.approx(0.09)
    assert second["busy_ms"] == pytest.approx(0.07) and second["span_ms"] == pytest.approx(0.1)
    assert out["busy_ms"] == pytest.approx(0.17)
