"""The worker of ``bench/compute_probe.py``: a fixed compute loop between
small all_reduces over gloo; each rank writes its loops' mean wall and
main-thread CPU time (us, after the first two steps) to
``$PROBE_DIR/{truth,capture}-RANK.txt``. Runs as is under plain
torch.distributed (the truth, under the step clock) and under ``prism capture``."""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
torch.manual_seed(0)
p = torch.nn.Parameter(torch.zeros(1))
opt = torch.optim.SGD([p], lr=0.1)
a = torch.randn(256, 256)
mode = os.environ.get("PROBE_MODE", "py")
loops, steps = int(os.environ.get("PROBE_LOOPS", "10")), int(os.environ.get("PROBE_STEPS", "8"))
wall, cpu = [], []
for step in range(steps):
    for _ in range(loops):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        if mode == "mm":
            for _ in range(8):
                a @ a
        else:
            x = 0
            for j in range(20000):
                x += j
        wall.append(time.perf_counter_ns() - w0)
        cpu.append(time.thread_time_ns() - c0)
        dist.all_reduce(torch.ones(1024))
    opt.step()
side = "truth" if "PRISM_STEPCLOCK_DIR" in os.environ else "capture"
keep = slice(2 * loops, None)
with open(os.path.join(os.environ["PROBE_DIR"], f"{side}-{dist.get_rank()}.txt"), "w") as f:
    f.write(f"{sum(wall[keep]) / len(wall[keep]) / 1e3:.2f} {sum(cpu[keep]) / len(cpu[keep]) / 1e3:.2f}\n")
dist.destroy_process_group()
