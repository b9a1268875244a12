"""How well the two-clock capture removes the logical-device mode's cost.

GPU ranks run the script under ``LogicalDeviceMode`` (a TorchFunctionMode
that maps ``cuda:N`` to the rank's GPU); it costs CPU on every torch call, and
``prism.rank.gputime`` subtracts ``calls x probe`` from each segment's CPU
share, the probe being measured once per rank (``measure_mode_overhead``).
This bench runs a small-op training step (a 4-layer ``nn.TransformerEncoder``
and AdamW, CPU tensors, one thread) with and without the mode, interleaved,
and prints what the correction leaves:

    python bench/mode_correction.py [--rounds 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.overrides import _pop_mode_temporarily

from prism.rank.devices import LogicalDeviceMode
from prism.rank.gputime import measure_mode_overhead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=3, help="independent measurements (each with its own probe)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    head = torch.nn.Linear(64, 100)
    opt = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-3)
    x, y = torch.randn(4, 16, 64), torch.randint(0, 100, (4, 16))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(head(model(x)).reshape(-1, 100), y.reshape(-1))
        loss.backward()
        opt.step()

    for _ in range(5):
        step()
    rows = []
    mode = LogicalDeviceMode()
    with mode:
        for _ in range(a.repeats):
            probe = measure_mode_overhead(mode)
            plain, withm, calls = [], [], []
            for _ in range(a.rounds):
                c0 = mode.calls
                t0 = time.perf_counter_ns()
                step()
                withm.append(time.perf_counter_ns() - t0)
                calls.append(mode.calls - c0)
                with _pop_mode_temporarily():
                    t0 = time.perf_counter_ns()
                    step()
                    plain.append(time.perf_counter_ns() - t0)
            p, m, n = statistics.median(plain), statistics.median(withm), statistics.median(calls)
            rows.append({"plain_ms": p / 1e6, "mode_ms": m / 1e6, "calls": n, "actual_ns_per_call": (m - p) / n,
                         "probe_ns_per_call": probe, "corrected_ms": (m - n * probe) / 1e6,
                         "residual": (m - n * probe - p) / p, "uncorrected": (m - p) / p})
    print(f"{'plain ms':>9} {'mode ms':>8} {'calls':>6} {'actual ns/call':>15} {'probe ns/call':>14} "
          f"{'uncorrected':>12} {'after correction':>17}")
    for r in rows:
        print(f"{r['plain_ms']:>9.2f} {r['mode_ms']:>8.2f} {r['calls']:>6} {r['actual_ns_per_call']:>15.0f} "
              f"{r['probe_ns_per_call']:>14.0f} {r['uncorrected']:>+12.1%} {r['residual']:>+17.1%}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
