"""Rank 0 prints and ends well, rank 1 raises, rank 2 calls sys.exit(3)."""

import sys

import torch.distributed as dist

dist.init_process_group("nccl")
rank = dist.get_rank()
for i in range(3):
    print(f"line {i} from rank {rank}", flush=True)
if rank == 1:
    raise ValueError("boom from rank 1")
if rank == 2:
    sys.exit(3)
