"""Records what a rank sees (torchrun's environment, threads, backend) to
OUT_DIR/env{RANK}.json. Each rank asks for a different backend; all must end
up on Prism. Usage: env_worker.py OUT_DIR"""

import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

out_dir = sys.argv[1]
rank = int(os.environ["RANK"])
asked = ["nccl", None, "cpu:gloo,cuda:nccl", "gloo"][rank % 4]
if asked is None:
    dist.init_process_group()
else:
    dist.init_process_group(asked, init_method="env://", device_id=None)
t = torch.ones(1)
dist.all_reduce(t)
record = {
    "env": {k: os.environ.get(k) for k in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "PRISM_COORDINATOR", "PRISM_GPUS",
        "PRISM_NODE_RANKS", "PRISM_MEMORY_LIMIT_BYTES")},
    "threads": torch.get_num_threads(),
    "cpus": sorted(os.sched_getaffinity(0)),
    "backend": dist.get_backend(),
    "sum": t.item(),
    "argv": sys.argv,
}
if rank == 0:
    # A Python child of the rank inherits the patch (sitecustomize).
    code = ("import torch.distributed.distributed_c10d as c; "
            "print(getattr(c.init_process_group, '_prism_patched', False))")
    record["child_patched"] = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             check=True).stdout.strip()
with open(os.path.join(out_dir, f"env{rank}.json"), "w") as f:
    json.dump(record, f)
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
