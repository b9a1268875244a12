"""bench/late_carry.py: what each late-release carry rule would have carried,
on a hand-made call log whose figures are worked out below."""

import json

from prism.testing.bench import load_bench


def _module():
    return load_bench("late_carry")


# Call 0: 2,000 late, 30,700 ns in Prism (700 beyond NCCL's 30,000); call 1 issued 100
# before its reach: min 100, excess min(2,000, 100 + 700) = 800, all 2,000. Call 1: 50
# late, call 2 issued 5,000 before its reach: every rule carries its 50.
CALLS = [
    {"t0": 0, "t1": 30_700, "reach": 10, "late": 2000},
    {"t0": 37_900, "t1": 37_960, "reach": 38_000, "late": 50},
    {"t0": 39_000, "t1": 39_100, "reach": 44_000, "late": 0},
]


def test_each_rule_carries_what_the_watcher_would():
    lc = _module()
    assert lc.carried(CALLS, 0) == {"min": 150, "excess": 850, "all": 2050, "step": 850}
    assert lc.carried(CALLS, 1) == {"min": 50, "excess": 50, "all": 50, "step": 50}


def test_the_step_rule_carries_all_into_a_later_step():
    # call 1 in a later step than call 0: its whole 2,000 (the host waited on the late GPU at the step's
    # end); the log's own steps, or the collectives counted two at a time for an older log
    lc = _module()
    stepped = [dict(c, step=s) for c, s in zip(CALLS, (0, 1, 1))]
    assert lc.carried(stepped, 0)["step"] == 2050
    assert lc.carried(CALLS, 0, calls_per_step=1)["step"] == 2050
    assert lc.carried(CALLS, 0, calls_per_step=2)["step"] == 850 + 0  # calls 0, 1 in step 0; call 2 in step 1


def test_the_emulated_mean_moves_by_the_difference_per_step(tmp_path):
    lc = _module()
    log = tmp_path / "calls.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in CALLS))
    r = lc.analyse(lc.read_calls(str(log)), emulated_ms=10.0, predicted_ms=10.0, ran="min", steps=1, warmup=0)
    # one step: excess carries 700 ns more than min, all 1,900 more
    assert abs(r["emulated_ms_by_rule"]["excess"] - (10.0 - 700e-6)) < 1e-12
    assert abs(r["emulated_ms_by_rule"]["all"] - (10.0 - 1900e-6)) < 1e-12
    assert r["error_by_rule"]["min"] == 0.0
