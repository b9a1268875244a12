"""Prism must not keep a finished call's tensors alive: once the script drops
its last reference, the tensor is freed at once, without Python's cyclic
collector (which is off here): GPU memory the real run has freed would
otherwise stay allocated in the capture until the collector happens to run
(it did: +16 MiB per step in a GPT capture on H200s). Writes rank{R}.txt:
one line per call, 'NAME freed' or 'NAME alive'. World 2."""

import gc
import sys
import time
import weakref

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

gc.disable()
dist.init_process_group("gloo")
r, n = dist.get_rank(), dist.get_world_size()
peer = 1 - r
lines = []


def check(name, call):
    x = torch.ones(1 << 16)
    ref = weakref.ref(x)
    call(x)
    del x
    time.sleep(0.05)  # the completion thread is idle, waiting for the next reply
    lines.append(f"{name} {'freed' if ref() is None else 'alive'}")


def coalesced(x):
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(x)
        dist.all_reduce(torch.ones(10))
    cm.wait()


check("all_reduce", lambda x: dist.all_reduce(x))
check("all_reduce_async", lambda x: dist.all_reduce(x, async_op=True).wait())
check("future", lambda x: dist.all_reduce(x, async_op=True).get_future().wait())
check("all_gather_into_tensor", lambda x: dist.all_gather_into_tensor(torch.empty(x.numel() * n), x))
check("reduce_scatter_tensor", lambda x: dist.reduce_scatter_tensor(x[: x.numel() // n], torch.ones(x.numel())))
check("broadcast", lambda x: dist.broadcast(x, 0))
check("send_recv", lambda x: dist.send(x, peer) if r == 0 else dist.recv(x, peer))
check("batch_isend_irecv", lambda x: [w.wait() for w in dist.batch_isend_irecv(
    [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, torch.empty(x.numel()), peer)])])
check("coalesced", coalesced)
check("functional", lambda x: funcol.all_reduce(x, "sum", dist.group.WORLD) + 1)
with open(f"{sys.argv[1]}/rank{r}.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
dist.barrier()
dist.destroy_process_group()
