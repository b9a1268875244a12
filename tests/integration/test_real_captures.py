"""Real captures through ``python -m prism capture`` (GPT on CPU ranks): the
scale-out of a dp-2 capture to dp 4 has the structure and groups of a real
dp-4 capture (the one test_capture checks the groups and counts of,
tests/support/captures.py), and ``prism report`` of a real world-4 capture
writes a well-formed Perfetto trace, Chakra files and a plot (synthetic runs:
tests/unit/test_scaleout.py, tests/unit/test_report.py)."""

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest

from prism.core.graph import ExecutionGraph
from prism.core.scaleout import Layout, compare_structure, scale_events, structure
from prism.core.trace import Memory
from tests.support.captures import gpt_tiny
from tests.unit.test_report import check_trace, load, needs_matplotlib, needs_protobuf, report

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _capture(shared_captures, dp):
    proc, out = shared_captures.get(4 * dp, gpt_tiny(dp), "--slots", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_scaled_capture_matches_a_real_capture_at_that_size(shared_captures):
    from prism.shell.runfolder import read_run

    small, real = read_run(_capture(shared_captures, 2)), read_run(_capture(shared_captures, 4))
    lay = Layout.from_manifest(small.manifest)
    big = ExecutionGraph.from_events(scale_events(small.ranks, lay, 4))
    ref = ExecutionGraph.from_events(real.ranks)
    new = Layout.from_manifest(real.manifest)
    assert compare_structure(structure(big, new), structure(ref, new)) == []
    assert sorted(g.gid for g in big.groups) == sorted(g.gid for g in ref.groups)
    assert dataclasses.asdict(new) == dataclasses.asdict(lay.with_dp(4))


@pytest.mark.slow
@needs_protobuf
@needs_matplotlib
def test_report_of_a_real_capture(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cap = subprocess.run(
        [sys.executable, "-m", "prism", "capture", "-n", "4", "--out", str(run), "--progress", "off", "--",
         "-m", "prism.workloads.gpt", "--tp", "2", "--pp", "2", "--steps", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert cap.returncode == 0, cap.stderr[-2000:]
    from prism.shell.runfolder import read_run

    g = ExecutionGraph.from_events(read_run(run).ranks)
    for extra in ((), ("--recorded",)):
        t = tmp_path / f"t{len(extra)}.json"
        assert report(run, "--perfetto", t, "--plot", tmp_path / "g.png", "--chakra", tmp_path / "et", *extra) == 0
        trace = load(t)
        check_trace(trace, g, memory=any(isinstance(e, Memory) for evs in read_run(run).ranks.values() for e in evs))
        assert len(list((tmp_path / "et").glob("prism.*.et"))) == 4
        assert (tmp_path / "g.png").stat().st_size > 20_000
