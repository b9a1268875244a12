"""Two ranks exchange a tensor each step with ``batch_isend_irecv``, the
receive listed before the send (argv: [STEPS]), then all_reduce a loss."""

import sys

import torch
import torch.distributed as dist

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
dist.init_process_group("nccl")
rank = dist.get_rank()
peer = 1 - rank
torch.manual_seed(rank)
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(steps):
    x = model(torch.randn(4, 16))
    got = torch.empty_like(x)
    ops = [dist.P2POp(dist.irecv, got, peer), dist.P2POp(dist.isend, x.detach().contiguous(), peer)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    loss = (x * got).mean()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item()!r}", flush=True)
