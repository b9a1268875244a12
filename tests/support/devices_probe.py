"""Run in a fresh process (tests/integration/test_devices.py starts it): installs logical
devices as rank RANK of WORLD_SIZE on an emulated node of NPROC ranks, then
exercises every call a script written for that node makes, printing one JSON
object of results. Needs a CUDA device."""

import json
import os
import sys

import torch

from prism.rank import devices

rank, world, nproc = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "NPROC"))
local = rank % nproc
physical = devices.install(rank, world, nproc)
out = {"physical": physical, "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
out["device_count"] = torch.cuda.device_count()
out["physical_name"] = devices.physical_name(f"cuda:{local}")
torch.cuda.set_device(local)
out["current_after_set"] = torch.cuda.current_device()
with torch.cuda.device((local + 1) % nproc):
    out["current_in_ctx"] = torch.cuda.current_device()
out["current_after_ctx"] = torch.cuda.current_device()
cpu = torch.arange(4.0)
out["to_int"] = str(cpu.to(local).device)
out["to_str"] = str(cpu.to(f"cuda:{local}").device)
out["cuda_int"] = str(cpu.cuda(local).device)
out["factory_device"] = str(torch.zeros(3, device=torch.device("cuda", local)).device)
out["factory_str"] = str(torch.ones(3, device=f"cuda:{local}").device)
out["module_to"] = str(next(torch.nn.Linear(2, 2).to(f"cuda:{local}").parameters()).device)
out["props_name"] = torch.cuda.get_device_properties(local).name
free, total = torch.cuda.mem_get_info(local)
out["mem_get_info_ok"] = 0 < free <= total
x = torch.empty(1 << 20, device=f"cuda:{local}")
out["max_allocated"] = torch.cuda.max_memory_allocated(local)
out["sum"] = float((cpu.to(local) * 2).sum())


class _AllocInBackward(torch.autograd.Function):
    """As Megatron's _AllToAll: backward (run by autograd's device thread)
    allocates on ``torch.cuda.current_device()``, the script's logical index."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        buf = g.new_empty(g.shape, device=torch.cuda.current_device())
        out["backward_alloc"] = str(buf.device)
        out["backward_zeros"] = str(torch.zeros(1, device=torch.cuda.current_device()).device)
        return buf.copy_(g) * 2


w = torch.ones(3, device=f"cuda:{local}", requires_grad=True)
_AllocInBackward.apply(w).sum().backward()
out["backward_grad"] = w.grad.tolist()
(g,) = torch.autograd.grad(_AllocInBackward.apply(w).sum(), w)
out["grad_grad"] = g.tolist()
try:
    torch.cuda.set_device(nproc)
    out["bad_index"] = "no error"
except RuntimeError as e:
    out["bad_index"] = str(e)
if os.environ.get("PROBE_MESH"):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torch.testing._internal.distributed.fake_pg import FakeStore

    # A fake process group of the whole world, as on a real 8-GPU node.
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    mesh = init_device_mesh("cuda", (world,))
    out["mesh"] = str(mesh.device_type)
    out["current_after_mesh"] = torch.cuda.current_device()
    dist.destroy_process_group()
json.dump(out, sys.stdout)
