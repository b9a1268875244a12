"""Which GPUs hold memory of this process after CUDA collectives through
Prism: one rank per GPU in the script's own numbering (nothing remapped), the
way a real job runs. Writes OUT/rank{R}.json: {GPU index: MiB} from NVML.
Usage: contexts_worker.py OUT_DIR (world 2, 2 GPUs)."""

import json
import os
import sys

import pynvml
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank, n = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(dev)
t = torch.ones(1 << 20, device=dev)
for _ in range(3):
    dist.all_reduce(t)
dist.all_reduce(t, async_op=True).wait()
dist.all_reduce(t, async_op=True).get_future().wait()
r = torch.zeros(4, device=dev)
for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(4, device=dev), (rank + 1) % n),
                                 dist.P2POp(dist.irecv, r, (rank - 1) % n)]):
    w.wait()
model = torch.nn.Linear(64, 64).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(8, 64, device=dev)).sum().backward()
opt.step()
torch.cuda.synchronize()
dist.barrier()
pynvml.nvmlInit()
held = {}
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    mib = sum((p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
              if p.pid == os.getpid()) >> 20
    if mib:
        held[i] = mib
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"device": dev.index, "held": held}, f)
dist.barrier()
dist.destroy_process_group()
