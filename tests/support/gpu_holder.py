"""A process holding GIB GiB on the GPU (tests and bench/gpu_capture.py swap
it): prints "ready PID", then answers each stdin line "check" with "ok SUM"
after recomputing a checksum on the GPU."""

import sys

import torch

gib = float(sys.argv[1])
n = int(gib * 2**30) // 4
x = torch.arange(n, device="cuda", dtype=torch.float32).remainder_(1021.0)
want = float(x.double().sum())
torch.cuda.synchronize()
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "check":
        got = float(x.double().sum())
        print(("ok" if got == want else "BAD"), got, want, flush=True)
