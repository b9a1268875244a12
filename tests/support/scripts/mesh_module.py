"""Run as ``-m mesh_module OUT_DIR``: a 2 x 2 DeviceMesh (implicit
init_process_group, new_group per dimension) and an all_reduce on each axis."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
rank = dist.get_rank()
sums = {}
for name in ("dp", "tp"):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.get_group(name))
    sums[name] = t.item()
with open(os.path.join(sys.argv[1], f"mesh{rank}.json"), "w") as f:
    json.dump({"backend": dist.get_backend(), "sums": sums, "argv0": sys.argv[0], "name": __name__}, f)
