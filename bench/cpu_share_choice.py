"""How should a GPU rank's segment take its CPU share? Replays the GPU
captures kept on 2026-11-29 (bench/results/traces/) with each estimator of
``prism.core.graph.two_clock_columns`` and compares with the truths measured
in the same device calls (bench/results/nccl-2026-11-29.md, sections 5 and 6;
the numbers below are copied from there). Needs no GPU.

    python bench/cpu_share_choice.py [--json OUT.json]

The estimators: ``own`` (each segment its own share; the behaviour before
2026-11-29 23:00 UTC), ``median`` and ``min`` over the segment's occurrences in
the uncalibrated steps. ``min`` became the default from this comparison: it is
chosen on these 13 captures ("chosen on"), so new captures must confirm it.
The 22 captures with truths of the next session's four device calls (2026-11-29/30,
``nccl-h200x2-fifth-captures-2026-11-30.tgz``, section 7 of the report) are
that check ("new"; its two FSDP2 captures from before the calibration
covered FSDP2's own streams are left out).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prism.shell import runfolder  # noqa: E402
from prism.core.graph import CPU_SHARES, ExecutionGraph  # noqa: E402
from prism.core.replay import replay_batch  # noqa: E402
from prism.app.predict import resolve_profile  # noqa: E402

TRACES = ROOT / "bench" / "results" / "traces"
NET = str(ROOT / "bench" / "results" / "nccl-h200x4-profile.toml")
#: folder in the archive -> (workload, truth ms). The runs of call 2 are told
#: apart by the predictions the call printed (the "own" column reproduces
#: them): c2-*-0 is run 0, c2-gpt-*-1 run 1; c2-moe-1gpu-0 is run 1's 1-GPU
#: capture, whose truth was lost with the call's time limit: left out.
TRUTHS = {
    "nccl-h200x2/c1-gpt-1gpu-0": ("GPT tp2, world 2, 1 GPU", 43.61),
    "nccl-h200x2/c1-gpt-2gpu-0": ("GPT tp2, world 2, 2 GPUs", 43.61),
    "nccl-h200x2/c2-gpt-1gpu-0": ("GPT tp2, world 2, 1 GPU", 44.23),
    "nccl-h200x2/c2-gpt-1gpu-1": ("GPT tp2, world 2, 1 GPU", 44.03),
    "nccl-h200x2/c2-gpt-2gpu-0": ("GPT tp2, world 2, 2 GPUs", 44.23),
    "nccl-h200x2/c2-gpt-2gpu-1": ("GPT tp2, world 2, 2 GPUs", 44.03),
    "nccl-h200x2/c1-moe-1gpu-0": ("MoE dp2 ep2, world 2, 1 GPU", 114.76),
    "nccl-h200x2/c1-moe-2gpu-0": ("MoE dp2 ep2, world 2, 2 GPUs", 114.76),
    "nccl-h200x2/c2-moe-1gpu-1": ("MoE dp2 ep2, world 2, 1 GPU", 117.58),
    "nccl-h200x2/c2-moe-2gpu-0": ("MoE dp2 ep2, world 2, 2 GPUs", 117.58),
    "traces/gpt1F": ("GPT tp2 dp2, world 4, 1 GPU", 46.76),
    "traces/gpt2F": ("GPT tp2 dp2, world 4, 2 GPUs", 46.76),
    "traces/moeF": ("MoE tp2 dp2 ep2, world 4, 2 GPUs", 85.58),
}
#: The check: captured after ``min`` was chosen (truths from section 7 of the
#: report; a-/b-/c- are the session's three calls, -0/-1 the runs).
NEW = {
    "nccl-h200x2-fifth/a-gpt-1gpu-0": ("GPT tp2, world 2, 1 GPU", 44.28),
    "nccl-h200x2-fifth/a-gpt-2gpu-0": ("GPT tp2, world 2, 2 GPUs", 44.28),
    "nccl-h200x2-fifth/a-gpt-1gpu-1": ("GPT tp2, world 2, 1 GPU", 43.99),
    "nccl-h200x2-fifth/a-gpt-2gpu-1": ("GPT tp2, world 2, 2 GPUs", 43.99),
    "nccl-h200x2-fifth/a-moe-1gpu-0": ("MoE dp2 ep2, world 2, 1 GPU", 114.79),
    "nccl-h200x2-fifth/a-moe-2gpu-0": ("MoE dp2 ep2, world 2, 2 GPUs", 114.79),
    "nccl-h200x2-fifth/b-pp2-1gpu-0": ("GPT pp2, world 2, 1 GPU", 52.86),
    "nccl-h200x2-fifth/b-pp2-2gpu-0": ("GPT pp2, world 2, 2 GPUs", 52.86),
    "nccl-h200x2-fifth/c-fsdp2-1gpu-0": ("FSDP2, world 2, 1 GPU", 122.82),
    "nccl-h200x2-fifth/c-fsdp2-2gpu-0": ("FSDP2, world 2, 2 GPUs", 122.82),
    "nccl-h200x2-fifth/c-fsdp2-1gpu-1": ("FSDP2, world 2, 1 GPU", 125.99),
    "nccl-h200x2-fifth/c-fsdp2-2gpu-1": ("FSDP2, world 2, 2 GPUs", 125.99),
    "nccl-h200x2-fifth/c-moe-1gpu-0": ("MoE dp2 ep2, world 2, 1 GPU", 114.22),
    "nccl-h200x2-fifth/c-moe-2gpu-0": ("MoE dp2 ep2, world 2, 2 GPUs", 114.22),
    "nccl-h200x2-fifth/c-pp2-1gpu-0": ("GPT pp2, world 2, 1 GPU", 52.80),
    "nccl-h200x2-fifth/c-pp2-2gpu-0": ("GPT pp2, world 2, 2 GPUs", 52.80),
    "nccl-h200x2-fifth/d-pp2-1gpu-0": ("GPT pp2, world 2, 1 GPU", 53.01),
    "nccl-h200x2-fifth/d-pp2-2gpu-0": ("GPT pp2, world 2, 2 GPUs", 53.01),
    "nccl-h200x2-fifth/d-pp2-1gpu-1": ("GPT pp2, world 2, 1 GPU", 53.18),
    "nccl-h200x2-fifth/d-pp2-2gpu-1": ("GPT pp2, world 2, 2 GPUs", 53.18),
    "nccl-h200x2-fifth/d-gpt-1gpu-0": ("GPT tp2, world 2, 1 GPU", 44.71),
    "nccl-h200x2-fifth/d-gpt-2gpu-0": ("GPT tp2, world 2, 2 GPUs", 44.71),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--net", default=NET, help="cost profile (default: the 4-GPU machine's, as measured live)")
    a = ap.parse_args()
    model, _ = resolve_profile(a.net, None)
    out: dict = {"net": a.net}
    with tempfile.TemporaryDirectory() as tmp:
        for tgz in sorted(TRACES.glob("*.tgz")):
            with tarfile.open(tgz) as tf:
                tf.extractall(tmp, filter="data")
        for label, table in (("chosen on", TRUTHS), ("new", NEW)):
            rows = []
            for name, (what, truth) in table.items():
                ranks = runfolder.read_run(pathlib.Path(tmp) / name).ranks
                row = {"capture": name, "workload": what, "truth_ms": truth}
                for est in CPU_SHARES:
                    res = replay_batch(ExecutionGraph.from_events(ranks, cpu_share=est), cost_model=model)
                    ms = res.mean_iteration_time(a.warmup) / 1e6
                    row[est] = {"ms": round(ms, 3), "error_pct": round(100 * (ms - truth) / truth, 2)}
                rows.append(row)
            print(f"{label} ({len(rows)} captures)")
            print(f"{'capture':34s} {'truth':>8s}" + "".join(f" {e:>16s}" for e in CPU_SHARES))
            for r in rows:
                print(f"{r['capture'].split('/')[-1]:34s} {r['truth_ms']:8.2f}"
                      + "".join(f" {r[e]['ms']:8.2f} {r[e]['error_pct']:+6.1f}%" for e in CPU_SHARES))
            summary = {e: statistics.median(abs(r[e]["error_pct"]) for r in rows) for e in CPU_SHARES}
            print("median |error|: " + ", ".join(f"{e} {v:.1f}%" for e, v in summary.items()) + "\n")
            out[label] = {"rows": rows, "median_abs_error_pct": summary}
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
