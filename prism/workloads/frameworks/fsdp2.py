"""FSDP2 (``fully_shard``) training, written as users write it.

    torchrun --nproc-per-node 4 prism/workloads/frameworks/fsdp2.py --steps 3

A small residual MLP; every block is sharded with ``fully_shard`` and then the
root, so each block's parameters are all-gathered before its forward and
backward and its gradients reduce-scattered after its backward. Each step
draws a global batch of ``WORLD_SIZE * --batch`` samples (seeded by
``--seed`` and the step); rank r trains on the r-th share.

Flags that change the collectives FSDP2 issues:

``--mixed``            ``MixedPrecisionPolicy(param_dtype=bfloat16,
                       reduce_dtype=float32)``: bfloat16 all-gathers.
``--divide-factor F``  ``set_gradient_divide_factor(F)`` on every FSDP
                       module: reduce-scatters under ``PREMUL_SUM(1/F)``
                       instead of ``AVG`` (F other than the world size).
``--sum``              ``set_force_sum_reduction_for_comms(True)`` on every
                       FSDP module: SUM reduce-scatters, the division done
                       locally (what backends without AVG or PREMUL_SUM need).
``--no-reshard``       ``reshard_after_forward=False``.
``--replicate R``      HSDP: ``fully_shard(mesh=...)`` over a 2-D
                       ``init_device_mesh`` mesh ``(R, WORLD_SIZE / R)``
                       (replicate, shard): reduce-scatters inside each shard
                       group, then all-reduces across the replicas.

Output: rank 0 prints ``step K loss X`` (X: ``repr`` of the global-batch mean
loss, all-reduced) and ``param checksum X`` at the end.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int, hidden: int, layers: int):
        super().__init__()
        self.inp = nn.Linear(dim, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, dim)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def main():
    parser = argparse.ArgumentParser(description="FSDP2 training on synthetic regression data")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mixed", action="store_true", help="bfloat16 params, float32 gradient reduction")
    parser.add_argument("--divide-factor", type=float, default=None)
    parser.add_argument("--sum", action="store_true", help="force SUM reductions (divide locally)")
    parser.add_argument("--no-reshard", action="store_true")
    parser.add_argument("--replicate", type=int, default=1, help="HSDP replicas (1: plain FSDP)")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    torch.manual_seed(args.seed)
    model = Net(args.dim, args.hidden, args.layers).to(device)
    kwargs = {"reshard_after_forward": not args.no_reshard}
    if args.replicate > 1:
        if world % args.replicate:
            raise SystemExit(f"WORLD_SIZE={world} is not a multiple of --replicate {args.replicate}")
        kwargs["mesh"] = init_device_mesh(device.type, (args.replicate, world // args.replicate),
                                          mesh_dim_names=("replicate", "shard"))
    if args.mixed:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # Both settings are per FSDP module (the root's does not reach the blocks).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            if args.divide_factor is not None:
                module.set_gradient_divide_factor(args.divide_factor)
            if args.sum:
                module.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 1000 + step)
        x = torch.randn(world * args.batch, args.dim, generator=g)
        y = torch.randn(world * args.batch, args.dim, generator=g)
        share = slice(rank * args.batch, (rank + 1) * args.batch)
        x, y = x[share].to(device), y[share].to(device)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        reported = loss.detach().clone()
        dist.all_reduce(reported, op=dist.ReduceOp.SUM)
        if rank == 0:
            print(f"step {step} loss {(reported / world).item()!r}", flush=True)

    # Every parameter, gathered whole: one number per run.
    total = sum(p.full_tensor().double().sum() for p in model.parameters())
    if rank == 0:
        print(f"param checksum {total.item()!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
