"""Prints, every step, the memory readings a training script makes of its own
GPU (max_memory_allocated, max_memory_reserved, memory_stats peaks, after a
reset_peak_memory_stats at step 2); the same with and without Prism. The only
collective is on a CPU tensor, so no backend's staging buffers enter the
readings."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
torch.cuda.set_device(dev)
torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(5):
    batch = 64 * (1 + (step + rank) % 3)  # peaks that rise and fall between steps
    loss = model(torch.randn(batch, 512, device=dev)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = torch.tensor([loss.item()])
    dist.all_reduce(total)
    if step == 2:
        torch.cuda.reset_peak_memory_stats(dev)
    s = torch.cuda.memory_stats(dev)
    print(f"step {step} max_allocated {torch.cuda.max_memory_allocated(dev)} max_reserved "
          f"{torch.cuda.max_memory_reserved(dev)} active_peak {s['active_bytes.all.peak']} "
          f"allocated {torch.cuda.memory_allocated(dev)}", flush=True)
dist.destroy_process_group()
