"""The launching side of a CPU run does not import torch.

``prism capture``, ``emulate`` and ``predict`` run in a process of their own
that plans the run and hosts the coordinator; the ranks import torch in the
fork server. Importing torch in the launching process too cost 1-1.5 s per
capture on the 2-core VM (a tiny two-rank capture: 4.1-4.7 s before, 3.2-3.6 s
after), before the fork server's own import began.
"""

import subprocess
import sys

PROBE = r"""
import sys
from prism.app.capture import CaptureConfig, plan_capture
from prism.shell.gpu_plan import plan_gpus
plan = plan_capture(CaptureConfig(command=["-m", "prism.workloads.gpt", "--tp", "2"], world_size=2, out=sys.argv[1]))
assert plan_gpus(2, {}, uses_cuda=False, gpus=None, resident=None, gang=None, slots=None) is None
print("torch" in sys.modules)
"""


def test_planning_a_cpu_capture_leaves_torch_unimported(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False", "planning a CPU capture imported torch: " + proc.stdout


def test_the_rank_side_still_finds_the_placement_functions():
    from prism.rank import devices, placement

    assert devices.choose_gpu is placement.choose_gpu and devices.parse_gpus is placement.parse_gpus
