"""FSDP2 over DTensor tensor parallelism on a 2-D mesh, written as users write it.

    torchrun --nproc-per-node 4 prism/workloads/frameworks/fsdp2_tp.py --tp 2 --steps 3

``init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))``; the model
of ``dtensor_tp.py`` is first parallelised over ``mesh["tp"]`` (sequence
parallel), then every block and the root are sharded with ``fully_shard``
over ``mesh["dp"]`` (torchtitan's order). Each step draws a global batch of
``dp * --batch`` sequences; data-parallel rank d trains on the d-th share,
and the ranks of one tensor-parallel group see the same share.

``--mixed`` adds ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``.

Output: rank 0 prints ``step K loss X`` (``repr`` of the global-batch mean
loss) and ``param checksum X`` at the end.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from dtensor_tp import Net, tp_plan


def main():
    parser = argparse.ArgumentParser(description="FSDP2 + tensor parallelism on a 2-D mesh")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (dp = WORLD_SIZE / tp)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank per step")
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mixed", action="store_true")
    args = parser.parse_args()

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world = int(os.environ["WORLD_SIZE"])
    if world % args.tp:
        raise SystemExit(f"WORLD_SIZE={world} is not a multiple of --tp {args.tp}")
    dp = world // args.tp
    mesh = init_device_mesh(device_type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    rank, dp_rank = dist.get_rank(), mesh["dp"].get_local_rank()

    torch.manual_seed(args.seed)
    model = Net(args.dim, args.hidden, args.layers).to(device_type)
    parallelize_module(model, mesh["tp"], tp_plan(model, sequence_parallel=True))
    kwargs = {"mesh": mesh["dp"]}
    if args.mixed:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 1000 + step)
        x = torch.randn(dp * args.batch, args.seq, args.dim, generator=g)
        y = torch.randn(dp * args.batch, args.seq, args.dim, generator=g)
        share = slice(dp_rank * args.batch, (dp_rank + 1) * args.batch)
        x, y = x[share].to(device_type), y[share].to(device_type)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=mesh["dp"].get_group())
        if rank == 0:
            print(f"step {step} loss {(reported / dp).item()!r}", flush=True)

    total = sum(p.full_tensor().double().sum() for p in model.parameters())
    if rank == 0:
        print(f"param checksum {total.item()!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
