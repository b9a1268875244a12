"""bench/gpu_view.py: a GPU sandbox's steps as its GPU saw them, from a call log."""

from prism.testing.bench import load_bench

NCCL = 40_000  # beyond NCCL_ISSUE_NS: a call's own time in Prism, not carried


def _call(step, t0, reach, dur, late, t1=None):
    return {"op": "all_reduce", "step": step, "t0": t0, "t1": t1 if t1 is not None else t0 + 10_000,
            "reach": reach, "due": reach + dur, "late": late}


def test_each_step_is_its_gpu_time_less_the_lateness_and_the_dropped_carry_is_named():
    gv = load_bench("gpu_view")
    # two calls a step; the GPU reaches each call 1 ms after its issue (the host well ahead) but the
    # second call of step 1 is followed by a call reached 100 us after its issue: of its 500 us of
    # lateness the excess rule carries only those 100 us (the host was not ahead there).
    rows = [
        _call(0, 0, 1_000_000, 200_000, 300_000),
        _call(0, 2_000_000, 3_000_000, 200_000, 300_000),
        _call(1, 9_000_000, 10_000_000, 200_000, 300_000),
        _call(1, 11_000_000, 12_000_000, 200_000, 500_000),
        _call(2, 12_950_000, 13_050_000, 200_000, 0),
        _call(2, 14_000_000, 15_000_000, 200_000, 0),
        _call(3, 20_000_000, 21_000_000, 200_000, 0),
    ]
    v = gv.view(rows)
    assert [r["step"] for r in v] == [0, 1, 2]
    s0, s1 = v[0], v[1]
    assert s0["T_ms"] == 9.0 and s0["late_ms"] == 0.6 and abs(s0["T_less_late_ms"] - 8.4) < 1e-9
    assert s0["waits_ms"] == 0.4
    # between: the GPU from each wait's end to the next reach
    assert abs(s0["between_ms"] - ((3_000_000 - 1_500_000) + (10_000_000 - 3_500_000)) / 1e6) < 1e-9
    assert s0["dropped_ms"] == 0
    assert abs(s1["dropped_ms"] - 0.4) < 1e-9  # 500 late, 100 carried (excess 0: 10 us in Prism)
    # a log from before the step field: grouped by count
    bare = [{k: v for k, v in r.items() if k != "step"} for r in rows]
    assert [r["T_ms"] for r in gv.view(bare, per_step=2)] == [r["T_ms"] for r in v]


def test_sends_and_receives_go_with_the_collective_before_them_and_pair_its_lateness():
    gv = load_bench("gpu_view")
    rows = [
        _call(0, 0, 1_000_000, 200_000, 300_000),
        {"op": "recv", "t0": 1_500_000, "t1": 1_510_000, "reach": 1_600_000, "due": 1_700_000, "late": 50_000},
        {"op": "send", "t0": 2_000_000, "t1": 2_010_000, "reach": 2_100_000},
        _call(1, 9_000_000, 10_000_000, 200_000, 0),
        _call(2, 19_000_000, 20_000_000, 200_000, 0),
    ]
    v = gv.view(rows)
    assert [(r["step"], r["calls"]) for r in v] == [(0, 3), (1, 1)]
    assert abs(v[0]["late_ms"] - 0.35) < 1e-9  # the receive's lateness counts in its step
    # the collective's lateness (300 us) is paired with the receive's reach 100 us after its issue: 200 dropped
    assert abs(v[0]["dropped_ms"] - 0.2) < 1e-9
    assert [r["calls"] for r in gv.view(rows, per_step=1)] == [3, 1]
