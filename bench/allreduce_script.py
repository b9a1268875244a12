"""An ordinary torch.distributed script (it never imports prism): times
``--iters`` all_reduce calls of ``--numel`` float32 elements and, on rank 0,
prints one JSON line ``RESULT {...}`` with the per-call latencies' p50/p99.

Used by bench/coordinator.py under real gloo and under ``prism capture``.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--numel", type=int, default=1024)
p.add_argument("--iters", type=int, default=50)
p.add_argument("--warmup", type=int, default=5)
args = p.parse_args()

# CPU tensors: gloo, also on a machine with GPUs (NCCL would refuse them).
dist.init_process_group("gloo")
x = torch.ones(args.numel)
lat = []
for i in range(args.warmup + args.iters):
    t0 = time.perf_counter()
    dist.all_reduce(x)
    t1 = time.perf_counter()
    if i >= args.warmup:
        lat.append(t1 - t0)
    x.fill_(1.0)
lat.sort()
if dist.get_rank() == 0:
    q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))]  # noqa: E731
    print("RESULT " + json.dumps({"p50_ms": q(0.5) * 1e3, "p99_ms": q(0.99) * 1e3,
                                  "mean_ms": sum(lat) / len(lat) * 1e3, "iters": len(lat)}), flush=True)
dist.destroy_process_group()
