"""Runs every collective and p2p call the Prism backend supports and saves the
results (torch.save) to OUT_DIR/rank{R}.pt; the tests run it under Prism and
under gloo and compare. Usage: ops_worker.py OUT_DIR"""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

out_dir = sys.argv[1]
dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
PRISM = dist.get_backend() == "prism"
res = {}


def base(shape=(4,), dtype=torch.float32, k=0):
    return (torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64).reshape(shape) * (rank + 1) + k).to(dtype)


# all_reduce with every op gloo also has
for name, op in [("sum", dist.ReduceOp.SUM), ("product", dist.ReduceOp.PRODUCT), ("min", dist.ReduceOp.MIN),
                 ("max", dist.ReduceOp.MAX)]:
    t = base(k=1) - 3
    dist.all_reduce(t, op=op)
    res[f"all_reduce_{name}"] = t
for name, op in [("band", dist.ReduceOp.BAND), ("bor", dist.ReduceOp.BOR), ("bxor", dist.ReduceOp.BXOR)]:
    t = torch.tensor([rank + 5, 3 * rank + 1, 12], dtype=torch.int64)
    dist.all_reduce(t, op=op)
    res[f"all_reduce_{name}"] = t
t = base((2, 3), torch.int32)
dist.all_reduce(t)
res["all_reduce_int32"] = t
if PRISM:  # gloo lacks AVG and PREMUL_SUM: the test checks these by formula
    t = base()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    res["all_reduce_avg"] = t
    t = base()
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.5))
    res["all_reduce_premul"] = t
    t = base(dtype=torch.bfloat16)
    dist.all_reduce(t)
    res["all_reduce_bf16"] = t

# coalesced all_reduce through the coalescing manager
ts = [base(k=1), base((2, 2), k=2)]
with dist._coalescing_manager():
    for x in ts:
        dist.all_reduce(x)
res["all_reduce_coalesced"] = ts

# coalesced all_gather_single / reduce_scatter_single (split into instances)
outs = [torch.zeros(n * 2), torch.zeros(n * 3)]
with dist._coalescing_manager():
    dist.all_gather_single(outs[0], base((2,)))
    dist.all_gather_single(outs[1], base((3,), k=1))
res["all_gather_coalesced"] = outs
outs = [torch.zeros(2), torch.zeros(1)]
with dist._coalescing_manager():
    dist.reduce_scatter_single(outs[0], base((2 * n,)))
    dist.reduce_scatter_single(outs[1], base((n,), k=1))
res["reduce_scatter_coalesced"] = outs

t = base() if rank == 1 else torch.zeros(4)
dist.broadcast(t, src=1)
res["broadcast"] = t

t = base()
dist.reduce(t, dst=n - 1)
if rank == n - 1:
    res["reduce"] = t

outs = [torch.zeros(3) for _ in range(n)]
dist.all_gather(outs, base((3,)))
res["all_gather"] = outs

o = torch.zeros(n * 2, 3)
dist.all_gather_single(o, base((2, 3)))
res["all_gather_into_tensor"] = o

g = [torch.zeros(2) for _ in range(n)] if rank == 0 else None
dist.gather(base((2,)), g, dst=0)
if rank == 0:
    res["gather"] = g

t = torch.zeros(2)
dist.scatter(t, [base((2,), k=j) for j in range(n)] if rank == 0 else None, src=0)
res["scatter"] = t

t = torch.zeros(3)
dist.reduce_scatter(t, [base((3,), k=j) for j in range(n)])
res["reduce_scatter"] = t

t = torch.zeros(2, 2)
dist.reduce_scatter_single(t, base((2 * n, 2)))
res["reduce_scatter_tensor"] = t

outs = [torch.zeros(2) for _ in range(n)]
dist.all_to_all(outs, [base((2,), k=j) for j in range(n)])
res["all_to_all"] = outs

in_splits = [(rank + j) % 3 + 1 for j in range(n)]
out_splits = [(r + rank) % 3 + 1 for r in range(n)]
o = torch.zeros(sum(out_splits), 2)
dist.all_to_all_single(o, base((sum(in_splits), 2)), out_splits, in_splits)
res["all_to_all_single"] = o
# Split sizes as numpy arrays (Megatron's MoE token dispatcher passes them so).
o = torch.zeros(sum(out_splits), 2)
dist.all_to_all_single(o, base((sum(in_splits), 2)), np.array(out_splits), np.array(in_splits))
res["all_to_all_single_numpy_splits"] = o
o = torch.zeros(2 * n)
dist.all_to_all_single(o, base((2 * n,)))
res["all_to_all_single_even"] = o

# p2p: a ring with two tags, blocking and async, and a batch
nxt, prv = (rank + 1) % n, (rank - 1) % n
r0, r1 = torch.zeros(3), torch.zeros(3)
if rank % 2 == 0:
    dist.send(base((3,)), nxt, tag=7)
    dist.recv(r0, prv, tag=7)
else:
    dist.recv(r0, prv, tag=7)
    dist.send(base((3,)), nxt, tag=7)
reqs = [dist.irecv(r1, prv, tag=9), dist.isend(base((3,), k=5), nxt, tag=9)]
for w in reqs:
    w.wait()
res["p2p_blocking"], res["p2p_async"] = r0, r1
r2 = torch.zeros(2)
ops = [dist.P2POp(dist.isend, base((2,), k=7), nxt), dist.P2POp(dist.irecv, r2, prv)]
for w in dist.batch_isend_irecv(ops):
    w.wait()
res["p2p_batch"] = r2

# async ops overlap: issue three, wait in reverse order. Rank 0 issues its
# three first and only then lets the others issue theirs (a token on tag 11),
# so none of its three can complete before all three are issued.
ts = [base(k=j) for j in range(3)]
token = torch.zeros(1)
if rank != 0:
    dist.recv(token, src=0, tag=11)
works = [dist.all_reduce(x, async_op=True) for x in ts]
if rank == 0:
    for peer in range(1, n):
        dist.send(token, dst=peer, tag=11)
for w in reversed(works):
    w.wait()
res["async_all_reduce"] = ts
t = base()
fut = dist.all_reduce(t, async_op=True).get_future()
res["future_value"] = fut.wait()[0].clone()
t = base(k=5)
w = dist.all_reduce(t, async_op=True)
w.wait()
late = w.get_future()  # asked for after the call completed: done at once, with its result
res["late_future_value"] = late.wait()[0].clone() if late.done() else torch.full_like(t, float("nan"))

dist.barrier()

# subgroups
sub = dist.new_group([0, n - 1])
if rank in (0, n - 1):
    t = base()
    dist.all_reduce(t, group=sub)
    res["subgroup_all_reduce"] = t
me, _ = dist.new_subgroups(group_size=1)
t = base()
dist.all_reduce(t, group=me)
res["subgroups_single"] = t

# C++ callers: functional collectives (the _c10d_functional ops)
res["functional_all_reduce"] = fc.all_reduce(base(), "sum", dist.group.WORLD).wait()
res["functional_all_gather"] = fc.all_gather_single(base((2,)), 0, dist.group.WORLD).wait()
res["functional_reduce_scatter"] = fc.reduce_scatter_single(base((2 * n,)), "sum", 0, dist.group.WORLD).wait()

# object collectives
objs = [{"rank": rank}] if rank == 0 else [None]
dist.broadcast_object_list(objs, src=0)
res["broadcast_object"] = objs
gathered = [None] * n
dist.all_gather_object(gathered, ("r", rank))
res["all_gather_object"] = gathered

# DDP (C++ reducer) with an optimizer: two steps
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    opt.zero_grad()
    loss = model(base((3, 4), k=step)).pow(2).mean()
    loss.backward()
    opt.step()
res["ddp_params"] = [p.detach().clone() for p in model.parameters()]

torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
dist.destroy_process_group()
