"""Does the CPU issue a segment more slowly right after the GPU was drained?

A Prism capture drains the GPU at every communication call (the data must
reach the host), so every compute segment's CPU share is measured right
after a wait; the real run's CPU never waits there. At world 2 on 2 H200s
the CPU shares moved by 30% between captures of one script while the GPU
times agreed within 3% (bench/results/archive/nccl_accuracy-2026-11.md, section 6). This
measures the effect on its own, in one process on one GPU:

- ``drained``: ``torch.cuda.synchronize()``, then time the CPU's issue of
  one segment (the launches returning, no wait at its end);
- ``ahead``: the same segment issued back to back, each timed the same way,
  the GPU kept behind the CPU (the segment is small-op: its GPU time is
  below its CPU time, so the launch queue never fills and no launch blocks).

Rounds alternate the two so machine noise hits both; the table gives the
median and quartiles per mode and their ratio; ``--json`` writes them.

    python bench/drain_effect.py [--ops 400] [--rounds 30] [--json OUT.json]
    python bench/drain_effect.py --gpt [--wait-ms 2] [--json OUT.json]   # which wait makes it cold

Needs a CUDA device. Run on an H200 (2026-11-29/30, bench/results/archive/nccl_accuracy-2026-11.md
section 7) with 400 ops of 256 x 256 (1.007) and 100 of 128 x 128 (1.061): in
both the GPU time was above the CPU's issue time, so "ahead" may have waited
on the launch queue. The defaults are now 200 ops of 64 x 64 (not yet run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=200, help="small ops per segment")
    ap.add_argument("--size", type=int, default=64, help="square matrix size (small: CPU-bound issue)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--gpt", action="store_true",
                    help="the segment is a GPT block's MLP half (layer norm, linear, GELU, linear, add: 5 ops "
                         "on --tokens x --hidden), as between two tensor-parallel all-reduces, and the waits "
                         "are compared: sleeping, spinning, a cross-thread wake")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--wait-ms", type=float, default=2.0, help="the wait before a cold segment (--gpt)")
    a = ap.parse_args()
    if a.gpt:
        return waits(a)
    if not torch.cuda.is_available():
        print("drain_effect: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    w = torch.randn(a.size, a.size, device=dev) / a.size ** 0.5
    x0 = torch.randn(a.size, a.size, device=dev)

    def segment() -> int:
        t0 = time.perf_counter_ns()
        x = x0
        for _ in range(a.ops // 2):
            x = torch.relu(x @ w)
        return time.perf_counter_ns() - t0

    # GPU time of one segment, to check that "ahead" keeps the queue short.
    for _ in range(5):
        segment()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    segment()
    e1.record()
    torch.cuda.synchronize()
    gpu_ms = e0.elapsed_time(e1)

    drained, ahead = [], []
    for _ in range(a.rounds):
        torch.cuda.synchronize()
        time.sleep(0.002)  # a wait, as for a collective's round trip
        drained.append(segment())
        torch.cuda.synchronize()
        segment()  # gets the CPU ahead of the GPU
        ahead += [segment() for _ in range(3)]
    torch.cuda.synchronize()

    def stats(v: list[int]) -> dict:
        q = statistics.quantiles(v, n=4)
        return {"median_us": statistics.median(v) / 1e3, "q1_us": q[0] / 1e3, "q3_us": q[2] / 1e3, "n": len(v)}

    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "ops": a.ops, "size": a.size,
           "gpu_ms_per_segment": gpu_ms, "drained": stats(drained), "ahead": stats(ahead)}
    out["ratio_drained_over_ahead"] = out["drained"]["median_us"] / out["ahead"]["median_us"]
    print(f"segment of {a.ops} ops on {out['device']}: GPU {gpu_ms:.3f} ms")
    print(f"{'mode':10s} {'median us':>10s} {'q1':>10s} {'q3':>10s} {'n':>5s}")
    for k in ("drained", "ahead"):
        s = out[k]
        print(f"{k:10s} {s['median_us']:10.1f} {s['q1_us']:10.1f} {s['q3_us']:10.1f} {s['n']:5d}")
    print(f"drained / ahead: {out['ratio_drained_over_ahead']:.3f}")
    if out["ahead"]["median_us"] / 1e3 < gpu_ms:
        print("note: the GPU time exceeds the CPU's issue time, so 'ahead' may block on a full queue; "
              "use fewer --ops or a smaller --size", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def waits(a: argparse.Namespace) -> int:
    """--gpt: a segment's CPU issue time after each kind of wait, against back to back."""
    import threading

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("drain_effect: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    x0 = torch.randn(a.tokens, a.hidden, device=dev)
    w1 = torch.randn(2 * a.hidden, a.hidden, device=dev) / a.hidden ** 0.5
    w2 = torch.randn(a.hidden, 2 * a.hidden, device=dev) / a.hidden ** 0.5
    ln = torch.nn.LayerNorm(a.hidden, device=dev)

    def segment() -> int:
        t0 = time.perf_counter_ns()
        h = F.linear(F.gelu(F.linear(ln(x0), w1)), w2)
        h.add_(x0)
        return time.perf_counter_ns() - t0

    wait_s = a.wait_ms / 1e3

    def slept() -> None:
        time.sleep(wait_s)

    def spun() -> None:  # the GIL let go at every turn, the core kept busy
        end = time.perf_counter() + wait_s
        while time.perf_counter() < end:
            time.sleep(0)

    def busy() -> None:
        end = time.perf_counter() + wait_s
        while time.perf_counter() < end:
            pass

    def woken() -> None:  # as a capture's main thread: another thread sets its event
        ev = threading.Event()
        threading.Timer(wait_s, ev.set).start()
        ev.wait()

    cycles = [0]

    def held(wait):  # the same wait with the GPU kept busy through it (a spin kernel)
        def f() -> None:
            torch.cuda._sleep(cycles[0])
            wait()
        return f

    # cycles of torch.cuda._sleep per wait (+10%: still busy when the segment is issued)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(1_000_000)
    e1.record()
    torch.cuda.synchronize()
    cycles[0] = int(1_000_000 * 1.1 * a.wait_ms / e0.elapsed_time(e1))
    tiny_gpu = torch.zeros(1, device=dev)
    tiny_cpu = torch.zeros(1)

    def warmed(wait, t, n=8):  # the wait, then n tiny calls before the segment (a capture could make them)
        def f() -> None:
            wait()
            for _ in range(n):
                t.add_(1)
        return f

    modes = {"slept": slept, "spun": spun, "busy": busy, "woken": woken, "synced": lambda: None,
             "slept+gpu": held(slept), "busy+gpu": held(busy), "woken+gpu": held(woken),
             "woken+w8g": warmed(woken, tiny_gpu), "woken+w8c": warmed(woken, tiny_cpu),
             "woken+w32g": warmed(woken, tiny_gpu, 32), "woken+w32c": warmed(woken, tiny_cpu, 32)}
    for _ in range(10):
        segment()
    torch.cuda.synchronize()
    res: dict[str, list[int]] = {k: [] for k in [*modes, "ahead"]}
    for _ in range(a.rounds):
        for name, wait in modes.items():
            torch.cuda.synchronize()
            wait()
            res[name].append(segment())
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # the GPU held: the launches never wait for a full queue
        segment()
        res["ahead"] += [segment() for _ in range(3)]
    torch.cuda.synchronize()
    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "tokens": a.tokens,
           "hidden": a.hidden, "wait_ms": a.wait_ms, "rounds": a.rounds, "modes": {}}
    base = statistics.median(res["ahead"])
    print(f"GPT MLP segment ({a.tokens} x {a.hidden}) issue time on {out['device']}, after a {a.wait_ms} ms wait")
    print(f"{'mode':10s} {'median us':>10s} {'q1':>8s} {'q3':>8s} {'/ ahead':>8s}")
    for name, v in res.items():
        q = statistics.quantiles(v, n=4)
        m = statistics.median(v)
        out["modes"][name] = {"median_us": m / 1e3, "q1_us": q[0] / 1e3, "q3_us": q[2] / 1e3, "n": len(v),
                              "over_ahead": m / base}
        print(f"{name:10s} {m / 1e3:10.1f} {q[0] / 1e3:8.1f} {q[2] / 1e3:8.1f} {m / base:8.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
