"""prism.validation.cpunoise's plain-run path: the FSDP2 workload as a plain
gloo job of two rank processes (Prism's launcher, no coordinator) under the
step clock reports each rank's step times, CPU time and CPUs (the parsers:
tests/unit/test_cpu_noise.py)."""

import pathlib

import pytest

from prism.validation import cpunoise as noise

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_plain_runs_report_steps_cpu_time_and_cpus(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    runs = noise.truth_runs(1, 2, [str(ROOT / "prism" / "workloads" / "frameworks" / "fsdp2.py"),
                                   "--dim", "16", "--hidden", "32", "--batch", "64", "--steps", "5"], 120.0)
    (run,) = runs
    assert len(run["ranks"]) == 2
    for rank in run["ranks"]:
        assert len(rank["step_ms"]) == 4 and all(s > 0 for s in rank["step_ms"])
        assert len(rank["run_ms"]) == 4 and all(r > 0 for r in rank["run_ms"])
        assert rank["cpus"] and all(c >= 0 for c in rank["cpus"])
