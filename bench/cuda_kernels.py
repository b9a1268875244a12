"""cuda_ext on one GPU: release latency, prefetch fill bandwidth, compensation
bandwidth, each beside its baseline in the same run.

    python bench/cuda_kernels.py [--out FILE.json] [--trials 2000] [--mib 256]

release latency
    per mode (the wait kernel, ``cuStreamWaitValue32``): the stream waits on
    a flag with nothing ahead of it; after it has certainly reached the wait
    the host flips the flag and spins until a stamp kernel queued behind the
    wait has written an ack to pinned memory. Flip to ack seen: the release
    plus the next kernel's start plus the ack's trip back (an upper bound of
    "flag flip to kernel start"). p50 / p99 / max over ``--trials``.
pool fill
    ``--mib`` from pinned host memory into a ``PrefetchPool`` on its side
    stream, against a plain ``tensor.copy_(pinned, non_blocking=True)`` into
    torch memory on a side stream; GB/s, median of 9, interleaved.
compensation
    ``combine("SUM"/"AVG", own, folded)`` of ``--mib`` per operand (reads two,
    writes one) against ``out.copy_(src)`` (reads one, writes one), each as
    bytes moved per second, and the pure-torch fallback beside them, for
    float32 and bfloat16.

Needs CUDA; prints a table and writes JSON (bench/README.md names the file).
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cuda_ext  # noqa: E402
from cuda_ext import reference  # noqa: E402

from _results import result_path, write_json  # noqa: E402


def release_latency(mode: str, trials: int) -> dict:
    mod = cuda_ext.kernels()
    flags = cuda_ext.ReleaseFlags(1, "cuda")
    acks = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    ack = acks.numpy()
    none = torch.empty(0, dtype=torch.int64)
    lat = []
    for i in range(1, trials + 1):
        flags.wait(0, i, mode=mode)
        mod.stamp(none, 0, acks, 0, i)
        t_end = time.perf_counter_ns() + 300_000
        while time.perf_counter_ns() < t_end:  # the stream is idle: it reaches the wait well within this
            pass
        t0 = time.perf_counter_ns()
        flags.release(0, i)
        while ack[0] != i:
            pass
        lat.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    a = np.array(lat[10:]) / 1e3  # the first few warm the path
    return {"mode": mode, "trials": len(a), "p50_us": float(np.percentile(a, 50)),
            "p99_us": float(np.percentile(a, 99)), "max_us": float(a.max()), "mean_us": float(a.mean())}


def _timed(fn, stream: torch.cuda.Stream) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        a.record()
        fn()
        b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def pool_fill(mib: int, reps: int = 9) -> dict:
    nbytes = mib << 20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    pp = cuda_ext.PrefetchPool(nbytes + (1 << 20), "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    fill, plain = [], []
    for i in range(reps):
        torch.cuda.synchronize()
        fill.append(_timed(lambda: pp.stage(i, host), pp.stream))  # stage queues its copy on the pool's stream
        pp.done(i)
        plain.append(_timed(lambda: dst.copy_(host, non_blocking=True), side))
    f, p = statistics.median(fill), statistics.median(plain)
    return {"bytes": nbytes, "pool_GBps": nbytes / f / 1e9, "plain_pinned_copy_GBps": nbytes / p / 1e9,
            "ratio": (nbytes / f) / (nbytes / p)}


def compensation(mib: int, dtype: torch.dtype, op: str, reps: int = 9) -> dict:
    n = (mib << 20) // torch.tensor([], dtype=dtype).element_size()
    own = torch.randn(n, device="cuda").to(dtype)
    folded = torch.randn(n, device="cuda").to(dtype)
    out = torch.empty_like(own)
    s = torch.cuda.current_stream()
    k, c, f = [], [], []
    for _ in range(reps):
        k.append(_timed(lambda: cuda_ext.combine(op, own, folded, n=8, out=out), s))
        c.append(_timed(lambda: out.copy_(own), s))
        f.append(_timed(lambda: reference.combine(op, own, folded, n=8, out=out), s))
    b = own.numel() * own.element_size()
    kern, copy, fb = 3 * b / statistics.median(k), 2 * b / statistics.median(c), 3 * b / statistics.median(f)
    return {"dtype": str(dtype).removeprefix("torch."), "op": op, "bytes_per_operand": b, "kernel_GBps": kern / 1e9,
            "device_copy_GBps": copy / 1e9, "fallback_GBps": fb / 1e9, "ratio_to_copy": kern / copy,
            "fallback_ratio_to_copy": fb / copy}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(result_path("cuda_kernels")))
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--mib", type=int, default=256)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_ext bench: needs a CUDA device")
    t0 = time.monotonic()
    inf = cuda_ext.info()
    if inf.path != "kernels":
        sys.exit(f"cuda_ext bench: the kernels are not built ({inf.reason})")
    res = {"benchmark": "cuda_kernels", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
           "versions": {"python": platform.python_version(), "torch": torch.__version__,
                        "cuda": torch.version.cuda},
           "build_s": inf.build_s, "release": [], "compensation": []}
    for mode in ("kernel", "memop"):
        try:
            res["release"].append(release_latency(mode, a.trials))
        except Exception as e:  # a mode this GPU or driver refuses is a result
            res["release"].append({"mode": mode, "error": str(e)})
    res["pool_fill"] = pool_fill(a.mib)
    for dtype in (torch.float32, torch.bfloat16):
        for op in ("SUM", "AVG"):
            res["compensation"].append(compensation(a.mib, dtype, op))
    res["wall_s"] = time.monotonic() - t0
    print(f"cuda_ext on {res['gpu']}, torch {torch.__version__}, {res['date_utc']} (build {inf.build_s or 0:.0f} s)")
    print(f"{'release (flip to ack)':<28} {'p50 us':>8} {'p99 us':>8} {'max us':>8}")
    for r in res["release"]:
        if "error" in r:
            print(f"  {r['mode']:<26} error: {r['error']}")
        else:
            print(f"  {r['mode']:<26} {r['p50_us']:>8.1f} {r['p99_us']:>8.1f} {r['max_us']:>8.1f}")
    pf = res["pool_fill"]
    print(f"pool fill {a.mib} MiB: {pf['pool_GBps']:.1f} GB/s vs plain pinned copy {pf['plain_pinned_copy_GBps']:.1f} "
          f"GB/s: ratio {pf['ratio']:.2f}")
    print(f"{'compensation':<22} {'kernel GB/s':>12} {'copy GB/s':>10} {'ratio':>6} {'fallback GB/s':>14} {'ratio':>6}")
    for c in res["compensation"]:
        print(f"  {c['dtype'] + ' ' + c['op']:<20} {c['kernel_GBps']:>12.0f} {c['device_copy_GBps']:>10.0f} "
              f"{c['ratio_to_copy']:>6.2f} {c['fallback_GBps']:>14.0f} {c['fallback_ratio_to_copy']:>6.2f}")
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
