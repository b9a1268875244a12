"""Rank 0 calls all_reduce where rank 1 calls barrier: a collective mismatch."""

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(2))
else:
    dist.barrier()
