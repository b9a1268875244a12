"""The step clock's call timer (``PRISM_STEPCLOCK_CALLS=1``): a plain gloo job
run by it logs each communication call (op, group size, bytes, how long it
held the caller) under the step it belongs to, and ``parse`` still reads the
step ends (``bench/comm_share.py`` splits a truth's step with them)."""

import pytest

from prism.shell.launcher import launch_ranks
from prism.validation import stepclock
from prism.validation.truthrun import STEPCLOCK

pytestmark = pytest.mark.slow

SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
p = torch.nn.Parameter(torch.zeros(256))
opt = torch.optim.SGD([p], lr=0.1)
pair = dist.new_group([0, 1])
for step in range(3):
    x = torch.ones(256)
    dist.all_reduce(x)
    dist.all_reduce(x, group=pair)
    work = dist.broadcast(x, src=0, async_op=True)
    work.wait()
    p.grad = x.clone()
    opt.step()
dist.destroy_process_group()
"""


def test_calls_are_timed_per_step(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    h = launch_ranks(2, None, tmp_path, [STEPCLOCK, str(script)], show_ranks=(),
                     env={"PRISM_STEPCLOCK_DIR": str(tmp_path), "PRISM_STEPCLOCK_CALLS": "1", "OMP_NUM_THREADS": "1"})
    try:
        assert h.wait(timeout=120) == [0, 0]
    finally:
        h.close()
    text = (tmp_path / "rank-1.txt").read_text()
    ends, _ = stepclock.parse(text)
    assert len(ends) == 3
    calls = stepclock.parse_calls(text)
    assert [(s, op, n, b, a) for s, op, n, b, _, _, a in calls] == [
        (s, op, 2, 1024, a) for s in range(3) for op, a in (("all_reduce", False), ("all_reduce", False),
                                                           ("broadcast", True))]
    assert all(0 <= t1 - t0 < 10**10 for _, _, _, _, t0, t1, _ in calls)
    # a step's calls happen before its optimizer step ends
    assert all(t1 <= ends[s] for s, _, _, _, _, t1, _ in calls)
    # the calling thread's CPU clock at each call's ends and at each step end, in order
    cpu = stepclock.call_cpu(text)
    assert cpu is not None
    ccalls, csteps = cpu
    assert len(ccalls) == len(calls) and len(csteps) == len(ends)
    seq = [c for pair in ccalls for c in pair]
    assert all(0 < c0 <= c1 for c0, c1 in ccalls) and seq == sorted(seq)
    assert csteps == sorted(csteps) and csteps[-1] >= seq[-1]
    assert stepclock.parse_call_groups(text) == [(0, 1)] * len(calls)  # each call's group: both ranks


def test_files_without_cpu_clocks_still_parse():
    text = "call 0 all_reduce 2 1024 10 20 0\n0 30\n"
    assert stepclock.parse_calls(text) == [(0, "all_reduce", 2, 1024, 10, 20, False)]
    assert stepclock.call_cpu(text) is None
    assert stepclock.call_cpu("call 0 all_reduce 2 1024 10 20 0 5 6\n0 30 7\n") == ([(5, 6)], [7])
    assert stepclock.parse_call_groups(text) == [None]
    text = "call 0 all_reduce 2 1024 10 20 0 5 6 2,3\ncall 0 barrier 4 0 21 22 0 7 8 -\n0 30 9\n"
    assert stepclock.parse_call_groups(text) == [(2, 3), None]
    assert stepclock.call_cpu(text) == ([(5, 6), (7, 8)], [9])
