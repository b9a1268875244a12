"""Pipeline parallelism with ``torch.distributed.pipelining``, written as users write it.

    torchrun --nproc-per-node 4 prism/workloads/frameworks/pipeline_1f1b.py --steps 3
    torchrun --nproc-per-node 4 prism/workloads/frameworks/pipeline_1f1b.py --schedule gpipe

A residual MLP of ``--layers`` blocks split by hand into one stage per rank
(``PipelineStage`` over the rank's slice of the blocks; the first stage also
holds the input projection, the last the output projection), run with
``Schedule1F1B`` (default) or ``ScheduleGPipe`` over ``--micro-batches``
micro-batches. The stages are built without example inputs, so the first step
infers the activation shapes at run time (``send_object_list`` /
``recv_object_list`` between neighbouring stages). Every stage sees the same
global batch per step (seeded by ``--seed`` and the step).

Output: the last stage prints ``step K loss X`` (``repr`` of the mean of the
micro-batch losses) and, on every run, ``param checksum X`` (the sum of all
parameters over all stages) at the end.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class StageModule(nn.Module):
    """One pipeline stage: an optional input projection, some blocks, an optional output projection."""

    def __init__(self, dim: int, hidden: int, blocks: list[nn.Module], first: bool, last: bool):
        super().__init__()
        self.inp = nn.Linear(dim, hidden) if first else None
        self.blocks = nn.ModuleList(blocks)
        self.out = nn.Linear(hidden, dim) if last else None

    def forward(self, x):
        if self.inp is not None:
            x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        if self.out is not None:
            x = self.out(x)
        return x


def build_stage(dim: int, hidden: int, layers: int, stage: int, stages: int) -> StageModule:
    """The whole model is built on every rank from the same seed (so any split
    holds the same weights), then the rank keeps its slice."""
    inp = nn.Linear(dim, hidden)
    blocks = [Block(hidden) for _ in range(layers)]
    out = nn.Linear(hidden, dim)
    per, extra = divmod(layers, stages)
    start = stage * per + min(stage, extra)
    mine = blocks[start:start + per + (stage < extra)]
    module = StageModule(dim, hidden, mine, stage == 0, stage == stages - 1)
    if module.inp is not None:
        module.inp.load_state_dict(inp.state_dict())
    if module.out is not None:
        module.out.load_state_dict(out.state_dict())
    return module


def main():
    parser = argparse.ArgumentParser(description="pipeline-parallel training with torch.distributed.pipelining")
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="samples per step (split into micro-batches)")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if args.layers < world:
        raise SystemExit(f"--layers {args.layers} is fewer than the {world} pipeline stages")

    torch.manual_seed(args.seed)
    module = build_stage(args.dim, args.hidden, args.layers, rank, world).to(device)
    stage = PipelineStage(module, rank, world, device)
    schedule_cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_cls(stage, n_microbatches=args.micro_batches, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(module.parameters(), lr=args.lr, momentum=0.9)
    last = rank == world - 1

    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 1000 + step)
        x = torch.randn(args.batch, args.dim, generator=g).to(device)
        y = torch.randn(args.batch, args.dim, generator=g).to(device)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
        if last:
            print(f"step {step} loss {torch.stack(losses).mean().item()!r}", flush=True)

    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in module.parameters():
        total += p.detach().double().sum()
    dist.all_reduce(total)
    if last:
        print(f"param checksum {total.item()!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
