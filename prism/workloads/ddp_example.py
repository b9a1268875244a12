"""A plain DistributedDataParallel training script, written as users write it.

An ordinary ``torch.distributed`` program (it never imports Prism)::

    torchrun --nproc-per-node 4 prism/workloads/ddp_example.py --steps 5

Each step draws a global batch of ``WORLD_SIZE * --batch`` samples from a
generator seeded by ``--seed`` and the step; rank r trains on the r-th share
(what ``DistributedSampler`` does), so the run follows the same trajectory at
any world size with the same global batch. DDP averages the gradients.

Output: rank 0 prints ``step K loss X`` per step (K from 0; X is ``repr`` of
the loss averaged over ranks, i.e. the global-batch mean).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self, dim: int, hidden: int, layers: int):
        super().__init__()
        self.inp = nn.Linear(dim, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(),
                          nn.Linear(4 * hidden, hidden))
            for _ in range(layers)
        )
        self.out = nn.Linear(hidden, dim)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def main():
    parser = argparse.ArgumentParser(description="plain DDP training on synthetic regression data")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts them)
    model = Net(args.dim, args.hidden, args.layers).to(device)
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    teacher = torch.randn(args.dim, args.dim, generator=torch.Generator().manual_seed(args.seed + 1))

    for step in range(args.steps):
        gen = torch.Generator().manual_seed(args.seed * 100_003 + step)
        x = torch.randn(world * args.batch, args.dim, generator=gen)
        y = torch.tanh(x @ teacher)
        mine = slice(rank * args.batch, (rank + 1) * args.batch)
        x, y = x[mine].to(device), y[mine].to(device)

        loss = F.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        logged = loss.detach().clone()
        dist.all_reduce(logged)
        logged /= world
        if rank == 0:
            print(f"step {step} loss {logged.item()!r}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
