"""CUDA tensors through the Prism backend (staged through host memory) and one
optimizer step for the per-step memory sample. Usage: cuda_worker.py OUT_DIR"""

import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank, n = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", rank % torch.cuda.device_count())
torch.cuda.set_device(dev)
res = {}
t = torch.full((1024,), float(rank + 1), device=dev) * 2  # pending kernel before the call
dist.all_reduce(t)
res["all_reduce"] = t.cpu()
outs = [torch.zeros(3, device=dev) for _ in range(n)]
dist.all_gather(outs, torch.arange(3, device=dev, dtype=torch.float32) + rank)
res["all_gather"] = [o.cpu() for o in outs]
w = dist.all_reduce(torch.ones(2, device=dev), async_op=True)
res["future"] = w.get_future().wait()[0].cpu()
r = torch.zeros(4, device=dev)
ops = [dist.P2POp(dist.isend, torch.full((4,), float(rank), device=dev), (rank + 1) % n),
       dist.P2POp(dist.irecv, r, (rank - 1) % n)]
for work in dist.batch_isend_irecv(ops):
    work.wait()
res["p2p"] = r.cpu()
model = torch.nn.Linear(8, 8).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(4, 8, device=dev)).sum().backward()
opt.step()
torch.save(res, os.path.join(sys.argv[1], f"rank{rank}.pt"))
