"""A tp x dp loop that creates its groups in an order no nested loop gives:
TP groups for the last DP replica first, then the DP groups (argv: --tp T
--dp D [--steps S]). Scale-out's plan then numbers the groups otherwise than
the script at a larger dp does, so an emulation at scale must match the
sandbox's groups by members and creation order, not by id."""

import argparse

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, default=2)
p.add_argument("--dp", type=int, default=2)
p.add_argument("--steps", type=int, default=3)
a = p.parse_args()
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
if world != a.tp * a.dp:
    raise SystemExit(f"--tp {a.tp} x --dp {a.dp} != WORLD_SIZE {world}")
tp_group = dp_group = None
for d in reversed(range(a.dp)):
    ranks = [t + a.tp * d for t in range(a.tp)]
    g = dist.new_group(ranks)
    if rank in ranks:
        tp_group = g
for t in range(a.tp):
    ranks = [t + a.tp * d for d in range(a.dp)]
    g = dist.new_group(ranks)
    if rank in ranks:
        dp_group = g
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(a.steps):
    h = model(torch.randn(4, 8))
    dist.all_reduce(h, group=tp_group)
    loss = h.pow(2).mean()
    loss.backward()
    for q in model.parameters():
        dist.all_reduce(q.grad, group=dp_group)
        q.grad /= a.dp
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item()!r}", flush=True)
