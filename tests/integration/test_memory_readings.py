"""A script's own GPU memory readings are the same with and without Prism
(prism.rank.memstats): two ranks sharing one GPU, each printing its
max_memory_allocated / max_memory_reserved / memory_stats peaks every step
(with a reset_peak_memory_stats in the middle), under plain torch.distributed
and under ``prism capture --gpus 0``; and Prism's own per-step peaks in the
trace are still the per-step peaks."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prism.core import trace as T

from prism.shell import runfolder
from tests.support.truth import gloo_world

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "support" / "scripts" / "memory_readings.py")
LINE = re.compile(r"^step \d+ .*$", re.MULTILINE)


@pytest.mark.gpu
@pytest.mark.slow
def test_a_scripts_memory_readings_are_its_own_under_prism(tmp_path):
    truth = {r.rank: LINE.findall(r.stdout) for r in gloo_world([SCRIPT], 2, cwd=str(ROOT), timeout=300)}
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "prism", "capture", "-n", "2", "--gpus", "0", "--out", str(run),
                           "--progress", "off", "--show-ranks", "none", "--", SCRIPT],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {r: LINE.findall(runfolder.log_path(run, r).read_text()) for r in range(2)}
    assert all(len(v) == 5 for v in truth.values()), truth
    assert got == truth
    # Prism's per-step peaks: one Memory event per step per rank, each at most the script's running peak.
    for r, events in runfolder.read_run(run).ranks.items():
        mem = [e for e in events if isinstance(e, T.Memory)]
        assert [e.step for e in mem] == [0, 1, 2, 3, 4]
        assert all(e.peak_allocated >= e.allocated for e in mem)


@pytest.mark.gpu
@pytest.mark.slow
def test_an_oom_under_a_memory_limit_is_a_named_result(tmp_path):
    script = str(ROOT / "tests" / "support" / "scripts" / "oom_worker.py")
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "prism", "capture", "-n", "2", "--gpus", "0", "--out", str(run),
                           "--memory-limit", "4.6", "--progress", "off", "--show-ranks", "none", "--",
                           script, "0.5"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    # rank 1 asks for 1, 2, 3, 4 GiB: the 4 GiB of step 3 passes the 4.0 GiB budget (4.6 - 0.6)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "capture FAILED (oom)" in proc.stderr
    assert re.search(r"rank 1 ran out of GPU memory in step 3: it asked for 4\.00 GiB with [\d.]+ GiB allocated "
                     r"and [\d.]+ GiB reserved by torch's allocator, against the --memory-limit allocator budget of "
                     r"4\.00 GiB; at .*oom_worker\.py:\d+ in <module>: held = \[torch\.ones\(n, device=dev\)\]",
                     proc.stderr), proc.stderr[-3000:]
    ends = {r: [e for e in evs if isinstance(e, T.RankEnd)][-1] for r, evs in runfolder.read_run(run).ranks.items()}
    assert ends[1].status == "oom" and "ran out of GPU memory" in ends[1].message
    summary = subprocess.run([sys.executable, "-m", "prism", "trace", "summary", str(run)], env=env,
                             capture_output=True, text=True, timeout=120)
    assert "out of GPU memory:" in summary.stdout and "rank 1 ran out of GPU memory in step 3" in summary.stdout
    pred = subprocess.run([sys.executable, "-m", "prism", "predict", str(run), "--warmup", "0"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert pred.returncode == 0, pred.stderr
    assert "incomplete run: rank 1 ended oom: " in pred.stdout
