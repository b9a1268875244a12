"""DTensor tensor parallelism (``parallelize_module``), written as users write it.

    torchrun --nproc-per-node 4 prism/workloads/frameworks/dtensor_tp.py --steps 3

A small residual MLP over sequences, parallelised Megatron-style on a 1-D
``init_device_mesh`` mesh of all ranks: the input projection is
``RowwiseParallel`` (its output sharded on the sequence dimension), each
block's ``LayerNorm`` is ``SequenceParallel``, its up projection
``ColwiseParallel`` and its down projection ``RowwiseParallel`` (back to
sequence shards), the output projection ``ColwiseParallel`` with a replicated
output. ``--no-sequence-parallel`` keeps activations replicated between
blocks instead (plain Colwise/Rowwise pairs). Every rank sees the same batch.
The collectives come from DTensor redistributions, i.e. through the
``_c10d_functional`` ops.

Output: rank 0 prints ``step K loss X`` (``repr`` of the loss, identical on
every rank) and ``param checksum X`` at the end.
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


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


def tp_plan(model: Net, sequence_parallel: bool) -> dict:
    """The layer-wise plan: module path -> ParallelStyle."""
    if not sequence_parallel:
        plan = {"inp": ColwiseParallel(output_layouts=Replicate()),
                "out": ColwiseParallel(output_layouts=Replicate())}
        for i in range(len(model.blocks)):
            plan[f"blocks.{i}.up"] = ColwiseParallel()
            plan[f"blocks.{i}.down"] = RowwiseParallel()
        return plan
    plan = {"inp": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.norm"] = SequenceParallel()
        plan[f"blocks.{i}.up"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"blocks.{i}.down"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def main():
    parser = argparse.ArgumentParser(description="DTensor tensor-parallel training on synthetic data")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8, help="sequence length (a multiple of the world size)")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-sequence-parallel", action="store_true")
    args = parser.parse_args()

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("tp",))
    rank = mesh.get_rank()

    torch.manual_seed(args.seed)
    model = Net(args.dim, args.hidden, args.layers).to(device_type)
    parallelize_module(model, mesh, tp_plan(model, not args.no_sequence_parallel))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 1000 + step)
        x = torch.randn(args.batch, args.seq, args.dim, generator=g).to(device_type)
        y = torch.randn(args.batch, args.seq, args.dim, generator=g).to(device_type)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item()!r}", flush=True)

    # Parameters outside the plan (the norms without sequence parallelism)
    # stay plain tensors, replicated by construction.
    total = sum((p.full_tensor() if isinstance(p, DTensor) else p).double().sum() for p in model.parameters())
    if rank == 0:
        print(f"param checksum {total.item()!r}", flush=True)


if __name__ == "__main__":
    main()
