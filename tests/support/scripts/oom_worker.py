"""Each step every rank holds a bigger CUDA tensor (argv: GIB per step); rank 1
grows twice as fast, so it is the one that runs out of memory first."""

import os
import sys

import torch
import torch.distributed as dist

gib_per_step = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
dist.init_process_group("nccl")
rank = dist.get_rank()
dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
torch.cuda.set_device(dev)
w = torch.nn.Parameter(torch.zeros(1, device=dev))
opt = torch.optim.SGD([w], lr=0.1)
held = []
for step in range(8):
    n = int(gib_per_step * (2 if rank == 1 else 1) * (step + 1) * 2**30 / 4)
    held.clear()
    held = [torch.ones(n, device=dev)]
    (w * held[0][:1]).sum().backward()
    opt.step()
    opt.zero_grad()
    total = torch.tensor([float(step)])
    dist.all_reduce(total)
    print(f"step {step} holds {torch.cuda.memory_allocated(dev)}", flush=True)
