"""A small data-parallel loop whose rank FAIL_RANK raises at step FAIL_STEP
(argv: FAIL_RANK FAIL_STEP [STEPS [WHERE]]). WHERE "before" (default): before
the step's all_reduce, so the others wait in it; "after": after it, before the
optimizer step, so the others finish the step and wait in the next one."""

import sys
import time

import torch
import torch.distributed as dist

fail_rank, fail_step = int(sys.argv[1]), int(sys.argv[2])
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
where = sys.argv[4] if len(sys.argv) > 4 else "before"
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(steps):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    if rank == fail_rank and step == fail_step and where == "before":
        raise RuntimeError(f"rank {rank} fails at step {step}")
    for p in model.parameters():
        dist.all_reduce(p.grad)
    if rank == fail_rank and step == fail_step and where == "after":
        time.sleep(1.0)  # the others end the step meanwhile (they only step their optimizer)
        raise RuntimeError(f"rank {rank} fails at step {step}")
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item()!r}", flush=True)
