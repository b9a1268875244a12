"""Sharded checkpointing with ``torch.distributed.checkpoint``, written as users write it.

    torchrun --nproc-per-node 4 prism/workloads/frameworks/dcp_save.py --checkpoint-dir /tmp/ckpt

The FSDP2 model of ``fsdp2.py`` (every block and the root under
``fully_shard``) trains for ``--steps`` steps; then its sharded model and
optimizer state (``get_state_dict``) is saved with ``dcp.save`` (or
``dcp.async_save`` with ``--async-save``) to a local directory, loaded back into a freshly initialised copy with ``dcp.load`` and
compared. Around it, the object collectives scripts use for bookkeeping:
rank 0 chooses the checkpoint directory and sends it to everyone
(``broadcast_object_list``), and every rank reports how many parameter
elements it holds (``all_gather_object``). ``dcp.save`` itself plans through
``gather_object``, ``scatter_object_list``, ``broadcast_object_list`` and
``all_gather_object``.

Output: rank 0 prints ``step K loss X`` per step, ``shard sizes [...]``,
``checkpoint files N`` (the ``.distcp`` files written) and
``reloaded checksum X`` (the sum of every parameter after ``dcp.load``, equal
to the saved one or the script fails).
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from fsdp2 import Net


def build(args, device):
    torch.manual_seed(args.seed)
    model = Net(args.dim, args.hidden, args.layers).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def checksum(model) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        total += p.to_local().detach().double().sum().cpu()
    dist.all_reduce(total)
    return total.item()


def main():
    parser = argparse.ArgumentParser(description="FSDP2 training, then a sharded checkpoint save and load")
    parser.add_argument("--checkpoint-dir", default=None, help="default: a new temporary directory")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-save", action="store_true", help="dcp.async_save instead of dcp.save")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    # Rank 0 decides where the checkpoint goes; everyone must use its choice.
    where = [args.checkpoint_dir or (tempfile.mkdtemp(prefix="dcp-") if rank == 0 else None)]
    dist.broadcast_object_list(where, src=0)
    checkpoint_dir = where[0]

    model, opt = build(args, device)
    sizes = [None] * world
    dist.all_gather_object(sizes, sum(p.to_local().numel() for p in model.parameters()))
    if rank == 0:
        print(f"shard sizes {sizes}", flush=True)

    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 1000 + step)
        x = torch.randn(world * args.batch, args.dim, generator=g)
        y = torch.randn(world * args.batch, args.dim, generator=g)
        share = slice(rank * args.batch, (rank + 1) * args.batch)
        loss = F.mse_loss(model(x[share].to(device)), y[share].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        if rank == 0:
            print(f"step {step} loss {(reported / world).item()!r}", flush=True)

    saved = checksum(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    if args.async_save:
        # Staged to host memory, written by a background thread; wait for it here.
        dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_dir).result()
    else:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_dir)
    if rank == 0:
        files = [f for f in os.listdir(checkpoint_dir) if f.endswith(".distcp")]
        print(f"checkpoint files {len(files)}", flush=True)

    args.seed += 1  # a different initialisation, so the load has something to overwrite
    fresh, fresh_opt = build(args, device)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    reloaded = checksum(fresh)
    if reloaded != saved:
        raise SystemExit(f"rank {rank}: reloaded checksum {reloaded!r} differs from the saved {saved!r}")
    if rank == 0:
        print(f"reloaded checksum {reloaded!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
