"""A hand-written script that exercises torch.distributed's collectives directly.

An ordinary ``torch.distributed`` program (it never imports Prism); needs a world
of at least 2::

    torchrun --nproc-per-node 4 prism/workloads/collectives_example.py

Per step, on a parameter ``w`` of ``--dim`` elements replicated on every rank:

- ``broadcast`` from rank 0 of the step's input ``x`` (drawn from ``--seed``, step);
- a p2p ring: ``isend`` of ``h = x * w * (rank + 1)`` to rank+1, ``irecv`` from rank-1;
- ``all_to_all_single`` with uneven splits: rank r sends ``(2r + j + step) % 3 + 1``
  elements, each of value ``10 r + j``, to rank j;
- ``all_gather_into_tensor`` of h inside this rank's subgroup (even ranks / odd
  ranks, both made with ``dist.new_group``, evens first);
- ``reduce_scatter_tensor`` (SUM) over the world of ``arange(2 * world) + rank + step``;
- ``all_gather`` (list form) over the world of ``h.sum()``;
- ``all_reduce`` AVG of h inside the subgroup, and MAX of h over the world;
- then a loss ``mean((x * w - target)^2)`` whose target mixes all those results,
  ``backward()``, an AVG ``all_reduce`` of ``w.grad`` over the world, and
  ``optimizer.step()`` (SGD).

Output: every rank prints, per step K, one line per value:
``rank R step K NAME X`` with NAME in broadcast, ring, all_to_all,
all_gather_into_tensor, reduce_scatter_tensor, all_gather, all_reduce_avg,
all_reduce_max, loss, w (each X is ``repr`` of the sum of that result, a float).
All values are deterministic given the world size and flags.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def main():
    parser = argparse.ArgumentParser(description="exercise torch.distributed collectives for a few steps")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        sys.exit(f"collectives_example.py: WORLD_SIZE is {world}, needs at least 2 "
                 f"(it builds an even-rank and an odd-rank subgroup); launch 2 or more ranks")
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    evens = dist.new_group(list(range(0, world, 2)))
    odds = dist.new_group(list(range(1, world, 2)))
    half = evens if rank % 2 == 0 else odds
    half_size = len(range(rank % 2, world, 2))

    w = nn.Parameter(torch.linspace(-1.0, 1.0, args.dim, device=device))
    optimizer = torch.optim.SGD([w], lr=args.lr)

    for step in range(args.steps):
        values = {}
        x = torch.empty(args.dim, device=device)
        if rank == 0:
            gen = torch.Generator().manual_seed(args.seed * 100_003 + step)
            x.copy_(torch.randn(args.dim, generator=gen))
        dist.broadcast(x, src=0)
        values["broadcast"] = x.sum()

        h = (x * w.detach() * (rank + 1)).contiguous()
        from_left = torch.empty_like(h)
        requests = [dist.isend(h, (rank + 1) % world), dist.irecv(from_left, (rank - 1) % world)]
        for request in requests:
            request.wait()
        values["ring"] = from_left.sum()

        in_splits = [(2 * rank + j + step) % 3 + 1 for j in range(world)]
        out_splits = [(2 * j + rank + step) % 3 + 1 for j in range(world)]
        send = torch.cat([torch.full((n,), float(10 * rank + j), device=device)
                          for j, n in enumerate(in_splits)])
        received = torch.empty(sum(out_splits), device=device)
        dist.all_to_all_single(received, send, out_splits, in_splits)
        values["all_to_all"] = received.sum()

        gathered = torch.empty(half_size * args.dim, device=device)
        dist.all_gather_into_tensor(gathered, h, group=half)
        values["all_gather_into_tensor"] = gathered.sum()

        scatter_in = torch.arange(2 * world, dtype=torch.float32, device=device) + rank + step
        scattered = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(scattered, scatter_in)
        values["reduce_scatter_tensor"] = scattered.sum()

        parts = [torch.empty(1, device=device) for _ in range(world)]
        dist.all_gather(parts, h.sum().reshape(1))
        values["all_gather"] = torch.cat(parts).sum()

        avg = h.clone()
        dist.all_reduce(avg, op=dist.ReduceOp.AVG, group=half)
        values["all_reduce_avg"] = avg.sum()
        peak = h.clone()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        values["all_reduce_max"] = peak.sum()

        target = (from_left + avg + peak + gathered.view(half_size, -1).mean(0)
                  + scattered.mean() + torch.cat(parts).mean() + received.mean()) / 8
        loss = ((x * w - target) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        dist.all_reduce(w.grad, op=dist.ReduceOp.AVG)
        optimizer.step()
        values["loss"] = loss.detach()
        values["w"] = w.detach().sum()

        for name, value in values.items():
            print(f"rank {rank} step {step} {name} {value.item()!r}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
