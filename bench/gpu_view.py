"""A GPU sandbox's steps as its GPU saw them, from a device-path call log: is
an emulation's error on the GPU (more time between calls than the capture's
compute) or in how the engine took the sandbox's times (lateness not carried,
the last step's end)? No GPU, seconds.

    python bench/gpu_view.py CALLS.jsonl [CALLS ...] [--calls-per-step N] [--predicted-ms P] [--json OUT]
    python bench/gpu_view.py bench/results/gpu_sandbox-2026-12-08-h100-roundtrip-calllogs.json.gz:1/calls-gpt-tp2-rec-r0.jsonl \
        --calls-per-step 32 --predicted-ms 43.61

Per step (a log's ``step`` field, written since 2026-12-08; older logs need
``--calls-per-step``), from the collectives' GPU stamps on the host's clock:

- ``T``: from the step's first reach to the next step's first reach;
- ``late``: the sum of the step's releases' lateness (each wait's end past
  its due moment: Prism's delay of the GPU);
- ``T - late``: the step as the GPU would have run it had every release come
  on time, the figure to set beside the capture's prediction (``--predicted-ms``);
- ``waits``: the sum of ``due - reach`` (the emulated calls' own time on the
  GPU's path) and ``between``: the sum of the GPU's time from each wait's end
  to the next reach (the program's kernels, the outputs' delivery, and any
  idle the host caused);
- ``deliver``: the sum of the outputs' forming on the stream after each wait
  (the call log's ``deliver``, written with ``PRISM_DEVICE_CARRY_DELIVERY=1``;
  else 0), Prism's time as lateness is;
- ``dropped``: the lateness the ``excess`` carry rule (the default) leaves in
  the emulated time because the next call's reach came soon after its issue
  (``prism.core.latecarry``): where a host synchronisation hands the GPU's
  delay to the host (a step's end), it is not absorbed, and the emulated
  step is that much long.

The emulated figure (the engine's) less ``T - late`` is what the engine adds
beyond the GPU's view: ``dropped``, and before 2026-12-08 the last step's
Prism work after the script (the call log's writing: fixed by 28c41ee).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import write_json  # noqa: E402
from late_carry import read_calls  # noqa: E402

from prism.core.latecarry import NCCL_ISSUE_NS, carried  # noqa: E402 (sans-IO: no torch)


def reached(rows: list[dict]) -> list[dict]:
    """The device-path calls whose reach the log has (collectives, sends,
    receives), in issue order: the watcher pairs each call's lateness with
    the next of them."""
    return [r for r in rows if r.get("reach")]


def steps_of(calls: list[dict], per_step: int | None) -> list[list[dict]]:
    """The calls grouped by step: the collectives' ``step`` (a send or receive
    goes with the collective before it), else ``per_step`` collectives at a time."""
    out: list[list[dict]] = []
    if per_step:
        n = 0
        for r in calls:
            if r.get("op") not in ("send", "recv"):
                if n % per_step == 0:
                    out.append([])
                n += 1
            if out:
                out[-1].append(r)
        return out
    colls = [r for r in calls if r.get("op") not in ("send", "recv")]
    if not colls or "step" not in colls[0]:
        raise SystemExit("gpu_view: this log has no 'step' field (written before 2026-12-08): give --calls-per-step")
    step = None
    for r in calls:
        if r.get("op") not in ("send", "recv") and r["step"] != step:
            step = r["step"]
            out.append([])
        if out:
            out[-1].append(r)
    return out


def view(rows: list[dict], per_step: int | None = None) -> list[dict]:
    """One row per step that has a next step (``T`` needs the next first reach)."""
    calls = reached(rows)
    steps = steps_of(calls, per_step)
    index = {id(r): i for i, r in enumerate(calls)}
    out = []
    for s, (cur, nxt) in enumerate(zip(steps, steps[1:])):
        if not cur or not nxt:
            continue

        def end(r: dict) -> int | None:
            return r["due"] + r["late"] if r.get("due") is not None and r.get("late") is not None else None

        late = sum(r.get("late") or 0 for r in cur)
        deliver = sum(r.get("deliver") or 0 for r in cur)  # PRISM_DEVICE_CARRY_DELIVERY=1's logs only
        waits = sum(r["due"] - r["reach"] for r in cur if r.get("due") is not None)
        between = dropped = 0
        for r in cur:
            i = index[id(r)]
            if i + 1 >= len(calls):
                continue
            b = calls[i + 1]
            e = end(r)
            if e is not None:
                between += b["reach"] - e
            excess = max(0, r.get("t1", r["t0"]) - r["t0"] - NCCL_ISSUE_NS)
            lt = r.get("late") or 0
            dropped += lt - carried("excess", lt, b["reach"] - b["t0"], excess)
        t = nxt[0]["reach"] - cur[0]["reach"]  # a step's first call is a collective (steps_of)
        first = next((r for r in cur if "step" in r), cur[0])
        out.append({"step": first.get("step", s), "calls": len(cur), "T_ms": t / 1e6, "late_ms": late / 1e6,
                    "T_less_late_ms": (t - late) / 1e6, "waits_ms": waits / 1e6, "between_ms": between / 1e6,
                    "dropped_ms": dropped / 1e6, "deliver_ms": deliver / 1e6})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="call logs (.jsonl, .jsonl.gz, or BUNDLE.json.gz:NAME)")
    ap.add_argument("--calls-per-step", type=int, default=None, help="for logs without 'step' (before 2026-12-08)")
    ap.add_argument("--predicted-ms", type=float, default=None, help="the capture's predicted iteration time")
    ap.add_argument("--skip", type=int, default=1, help="leading steps left out of the medians (default 1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    doc = {"benchmark": "gpu_view", "logs": {}}
    for path in args.logs:
        rows = view(read_calls(path), args.calls_per_step)
        doc["logs"][path] = rows
        print(f"\n{path}")
        print(f"  {'step':>4} {'calls':>5} {'T':>8} {'late':>8} {'T-late':>8} {'waits':>7} {'between':>8} {'dropped':>8}"
              f" {'deliver':>8}  (ms)")
        for r in rows:
            print(f"  {r['step']:>4} {r['calls']:>5} {r['T_ms']:8.2f} {r['late_ms']:8.2f} {r['T_less_late_ms']:8.2f} "
                  f"{r['waits_ms']:7.2f} {r['between_ms']:8.2f} {r['dropped_ms']:8.2f} {r['deliver_ms']:8.2f}")
        kept = rows[args.skip:]
        if kept:
            m = statistics.median(r["T_less_late_ms"] for r in kept)
            d = statistics.median(r["dropped_ms"] for r in kept)
            vs = f", {100 * (m / args.predicted_ms - 1):+.2f}% of the prediction {args.predicted_ms:.2f}" \
                if args.predicted_ms else ""
            print(f"  median over steps {kept[0]['step']}..{kept[-1]['step']}: T - late {m:.2f} ms{vs}; "
                  f"dropped by the carry {d:.2f} ms a step")
    if args.json:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
