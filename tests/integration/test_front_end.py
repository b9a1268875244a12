"""``PRISM_FRONT_END_IN_COMM=1``: torch.distributed's Python dispatch counts
inside each call, so a blocking call no longer leaves a compute segment of
its own between its issue and its wait (prism/rank/bootstrap.py::_front_end)."""

import collections
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prism.shell.runfolder import read_run

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.ones(64)
p = torch.nn.Parameter(torch.zeros(1)); opt = torch.optim.SGD([p], lr=0.1)
for step in range(3):
    for i in range(4):
        x = torch.tanh(x * 0.5)
        dist.all_reduce(x)
    opt.step()
dist.destroy_process_group()
"""


def _segments_per_step(tmp_path: Path, front_end: str) -> dict[int, int]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    run = tmp_path / f"run-{front_end}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PRISM_FRONT_END_IN_COMM=front_end)
    proc = subprocess.run([sys.executable, "-m", "prism", "capture", "-n", "2", "--out", str(run), "--progress", "off",
                           "--", str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts = collections.Counter(e.step for e in read_run(run).ranks[0] if type(e).__name__ == "Compute")
    return {s: counts[s] for s in (1, 2)}


def test_a_blocking_call_is_one_communication_stretch(tmp_path):
    # before each of the 4 calls and before the step's end; without the
    # wrapper a blocking call's issue and wait are cut apart (9 per step,
    # measured 2026-12-02; not run here to keep the suite's time)
    assert _segments_per_step(tmp_path, "1") == {1: 5, 2: 5}
