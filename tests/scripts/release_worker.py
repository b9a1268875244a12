"""Prism must not keep a finished call's tensors alive: after the script drops
its last reference, the tensor is freed (GPU memory the real run has freed
would otherwise stay allocated in the capture). Writes rank{R}.txt: 'freed'
or 'alive'."""

import gc
import sys
import time
import weakref

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
x = torch.ones(1 << 16)
ref = weakref.ref(x)
dist.all_reduce(x)
work = dist.all_reduce(x, async_op=True)
work.wait()
del x, work
time.sleep(0.2)  # the completion thread is idle, waiting for the next reply
gc.collect()
with open(f"{sys.argv[1]}/rank{dist.get_rank()}.txt", "w") as f:
    f.write("freed" if ref() is None else "alive")
dist.barrier()
dist.destroy_process_group()
