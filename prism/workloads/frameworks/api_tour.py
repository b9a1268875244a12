"""One call of each ``torch.distributed`` API a training stack uses, written as users write it.

    torchrun --nproc-per-node 4 prism/workloads/frameworks/api_tour.py

Not a training loop: a tour whose every result is printed, so that two runs
(gloo and Prism) can be compared line by line. Covers the tensor collectives
under the ReduceOps gloo implements, the point-to-point calls
(``send``/``recv``, ``isend``/``irecv``, ``batch_isend_irecv``), all_reduces,
all-gathers and reduce-scatters coalesced by ``_coalescing_manager()``, the object
collectives (``all_gather_object``, ``broadcast_object_list``,
``gather_object``, ``scatter_object_list``, ``send_object_list`` /
``recv_object_list``), subgroups (``new_group``, ``new_subgroups``), the
functional collectives of ``torch.distributed._functional_collectives``, coalesced ones included (the
C++ ``_c10d_functional`` dispatch path DTensor uses) and ``barrier`` /
``monitored_barrier``. Needs an even world of at least 2.

Output: every rank prints ``rank R NAME X`` per call (X: ``repr`` of a float
sum of the result, or of the object received), then ``rank R done``.
"""

import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# torch 2.13 renamed the single-tensor forms; older releases only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
funcol_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
funcol_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
funcol_all_gather_coalesced = getattr(funcol, "all_gather_single_coalesced", None) \
    or funcol.all_gather_into_tensor_coalesced
funcol_reduce_scatter_coalesced = getattr(funcol, "reduce_scatter_single_coalesced", None) \
    or funcol.reduce_scatter_tensor_coalesced


def main():
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2 or world % 2:
        raise SystemExit(f"api_tour needs an even world of at least 2, got WORLD_SIZE={world}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def show(name, value):
        if isinstance(value, torch.Tensor):
            value = value.double().sum().item()
        print(f"rank {rank} {name} {value!r}", flush=True)

    def mine(n=6, scale=1.0):
        return (torch.arange(n, dtype=torch.float32, device=device) * 0.37 + rank) * scale

    for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        t = mine(scale=0.5)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        show(f"all_reduce_{op}", t)
    a, b = mine(), mine(3, scale=2.0)
    with dist._coalescing_manager():  # one all_reduce_coalesced on the group
        dist.all_reduce(a)
        dist.all_reduce(b)
    show("coalesced_all_reduce", torch.cat([a, b]))
    x, y = torch.empty(6 * world, device=device), torch.empty(3 * world, device=device)
    with dist._coalescing_manager():  # one coalesced all-gather of two tensors
        all_gather_single(x, mine())
        all_gather_single(y, mine(3, scale=2.0))
    show("coalesced_all_gather", torch.cat([x, y]) * torch.arange(9 * world, device=device))
    x, y = torch.empty(6, device=device), torch.empty(3, device=device)
    with dist._coalescing_manager():
        reduce_scatter_single(x, mine(6 * world))
        reduce_scatter_single(y, mine(3 * world, scale=2.0))
    show("coalesced_reduce_scatter", torch.cat([x, y]) * torch.arange(9, device=device))
    t = mine()
    dist.broadcast(t, src=1)
    show("broadcast", t)
    t = mine()
    dist.reduce(t, dst=1)
    if rank == 1:  # the other ranks' tensors are unspecified afterwards (gloo leaves partial sums)
        show("reduce", t)
    parts = [torch.empty(6, device=device) for _ in range(world)]
    dist.all_gather(parts, mine())
    show("all_gather", torch.stack(parts) * torch.arange(world, device=device)[:, None])
    out = torch.empty(6 * world, device=device)
    all_gather_single(out, mine())
    show("all_gather_into_tensor", out * torch.arange(6 * world, device=device))
    gathered = [torch.empty(6, device=device) for _ in range(world)] if rank == 0 else None
    dist.gather(mine(), gathered, dst=0)
    if rank == 0:
        show("gather", torch.stack(gathered) * torch.arange(world, device=device)[:, None])
    t = torch.empty(6, device=device)
    dist.scatter(t, [mine() * (j + 1) for j in range(world)] if rank == 2 % world else None, src=2 % world)
    show("scatter", t)
    out = torch.empty(6, device=device)
    dist.reduce_scatter(out, [mine() * (j + 1) for j in range(world)])
    show("reduce_scatter", out)
    out = torch.empty(6, device=device)
    reduce_scatter_single(out, mine(6 * world))
    show("reduce_scatter_tensor", out)
    out = torch.empty(6 * world, device=device)
    reduce_scatter_single(out[:6], mine(6 * world), op=dist.ReduceOp.AVG)
    show("reduce_scatter_tensor_AVG", out[:6])
    outs = [torch.empty(2, device=device) for _ in range(world)]
    ins = [mine(2) + 10 * j for j in range(world)]
    try:
        dist.all_to_all(outs, ins)
    except RuntimeError as e:
        # gloo on torch 2.11 has no list all_to_all ("Backend gloo does not
        # support alltoall"); the same exchange through all_to_all_single.
        if "does not support alltoall" not in str(e):
            raise
        flat = torch.empty(2 * world, device=device)
        dist.all_to_all_single(flat, torch.cat(ins))
        outs = list(flat.view(world, 2))
    show("all_to_all", torch.stack(outs) * torch.arange(world, device=device)[:, None])
    send_splits = [(rank + j) % 3 + 1 for j in range(world)]
    recv_splits = [(j + rank) % 3 + 1 for j in range(world)]
    out = torch.empty(sum(recv_splits), device=device)
    dist.all_to_all_single(out, mine(sum(send_splits)), recv_splits, send_splits)
    show("all_to_all_single", out * torch.arange(out.numel(), device=device))

    nxt, prv = (rank + 1) % world, (rank - 1) % world
    buf = torch.empty(6, device=device)
    if rank % 2 == 0:
        dist.send(mine(), dst=nxt)
        dist.recv(buf, src=prv)
    else:
        dist.recv(buf, src=prv)
        dist.send(mine(), dst=nxt)
    show("send_recv", buf)
    buf = torch.empty(6, device=device)
    reqs = [dist.isend(mine(scale=2.0), dst=nxt, tag=7), dist.irecv(buf, src=prv, tag=7)]
    for r in reqs:
        r.wait()
    show("isend_irecv", buf)
    buf = torch.empty(6, device=device)
    ops = [dist.P2POp(dist.isend, mine(scale=3.0), nxt), dist.P2POp(dist.irecv, buf, prv)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    show("batch_isend_irecv", buf)

    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "tokens": [rank] * (rank + 1)})
    show("all_gather_object", objs)
    lst = [f"config from {rank}", rank * 1.5] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    show("broadcast_object_list", lst)
    got = [None] * world if rank == 0 else None
    dist.gather_object(("hello", rank), got, dst=0)
    if rank == 0:
        show("gather_object", got)
    out_obj = [None]
    dist.scatter_object_list(out_obj, [{"shard": j} for j in range(world)] if rank == 0 else None, src=0)
    show("scatter_object_list", out_obj)
    if rank % 2 == 0:
        dist.send_object_list([{"from": rank, "shape": [2, rank]}], dst=rank + 1)
    else:
        recv = [None]
        dist.recv_object_list(recv, src=rank - 1)
        show("recv_object_list", recv)

    evens = dist.new_group(list(range(0, world, 2)))
    odds = dist.new_group(list(range(1, world, 2)))
    mine_group = evens if rank % 2 == 0 else odds
    t = mine()
    dist.all_reduce(t, group=mine_group)
    show("all_reduce_new_group", t)
    sub, _ = dist.new_subgroups(group_size=2)
    t = mine()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=sub)
    show("all_reduce_new_subgroups", t)

    show("funcol_all_reduce", funcol.all_reduce(mine(), "sum", dist.group.WORLD))
    show("funcol_all_gather_tensor", funcol_all_gather(mine(), 0, dist.group.WORLD)
         * torch.arange(6 * world, device=device))
    show("funcol_reduce_scatter_tensor", funcol_reduce_scatter(mine(6 * world), "sum", 0, dist.group.WORLD))
    show("funcol_all_to_all_single", funcol.all_to_all_single(mine(2 * world), None, None, dist.group.WORLD)
         * torch.arange(2 * world, device=device))
    show("funcol_broadcast", funcol.broadcast(mine(), 1, dist.group.WORLD))
    gathered = funcol_all_gather_coalesced([mine(), mine(3, scale=2.0)], dist.group.WORLD)
    show("funcol_all_gather_coalesced", sum((g * torch.arange(g.numel(), device=device)).sum() for g in gathered))
    scattered = funcol_reduce_scatter_coalesced([mine(6 * world), mine(3 * world)], "sum", [0, 0], dist.group.WORLD)
    show("funcol_reduce_scatter_coalesced",
         sum((g * torch.arange(g.numel(), device=device)).sum() for g in scattered))
    show("funcol_all_reduce_coalesced",
         sum(x.double().sum() for x in funcol.all_reduce_coalesced([mine(), mine(3)], "max", dist.group.WORLD)))

    dist.barrier()
    if not torch.cuda.is_available():  # gloo only
        dist.monitored_barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
