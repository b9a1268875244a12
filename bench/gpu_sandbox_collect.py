"""Collect what `bash bench/device.sh gpu-sandbox` left: one table row per
emulation (against its own capture's prediction and against the stored
two-H200 NCCL truth), the split of each call log's device-path call times,
and the raw rows as JSON.

    python bench/gpu_sandbox_collect.py DIR [DIR ...] [--labels A,B] [--out FILE.json]

Each DIR is the unpacked `$OUT` of a device call (it holds `r/cap-*/emulation/
*/summary.json` and, with `CALLLOG=1`, `r/calls-*-r0.jsonl`). The truths are
the stored real NCCL runs on two H200s (`results/nccl_accuracy-2026-11-30-
h200x2-*.json`, the mean of every run's steps; `results/gpu_sandbox-2026-12-06.md`
gives their spread): comparing with them only means something for a call
that ran on an H200."""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

#: The stored two-H200 NCCL truths, ms (runs, CV): GPT tp2 6 runs 1.4%, pp2 8 runs 1.0%, MoE 8 runs 1.8%.
TRUTH_MS = {"gpt-tp2": 43.89, "pp2": 52.68, "moe": 114.33}
#: A call's host moments in order (the call log's fields; `f_*`: a recorded delivery's own steps).
SPLITS = [("t0", "t_msg"), ("t_msg", "t_sent"), ("t_sent", "t_wait"), ("t_wait", "t_out"), ("t_out", "t1"),
          ("t_wait", "f_lock"), ("f_lock", "f_adv0"), ("f_adv0", "f_copy"), ("f_copy", "f_adv1"), ("t0", "t1")]


def rows_of(root: str, label: str) -> list[dict]:
    rows = []
    for f in sorted(glob.glob(os.path.join(root, "r", "cap-*", "emulation", "*", "summary.json"))):
        wl = f.split(os.sep + "cap-")[1].split(os.sep)[0]
        name = f.split(os.sep + "emulation" + os.sep)[1].split(os.sep)[0]
        with open(f) as fh:
            s = json.load(fh)
        r0 = s["ranks"][str(s["sandbox"][0])] if s.get("sandbox") else next(iter(s["ranks"].values()))
        e, p = s.get("emulated_mean_ns"), s.get("predicted_mean_ns")
        t = TRUTH_MS.get(wl)
        steps = r0.get("iteration_ns", [])[s.get("warmup", 0):]
        rows.append({
            "call": label, "workload": wl, "variant": name, "status": s.get("status"),
            "emulated_ms": e / 1e6 if e else None, "predicted_ms": p / 1e6 if p else None, "truth_ms": t,
            "vs_prediction": e / p - 1 if e and p else None, "vs_truth": e / 1e6 / t - 1 if e and t else None,
            "step_sd_ms": statistics.stdev(steps) / 1e6 if len(steps) > 1 else None,
            "losses_equal": r0.get("losses_equal"), "max_loss_rel_diff": r0.get("max_loss_rel_diff"),
            "peaks_equal": r0.get("peaks_equal"), "peak_allocated": r0.get("peak_allocated"),
            "capture_peak_allocated": r0.get("capture_peak_allocated"), "calls": s.get("calls"),
        })
    return rows


def splits_of(root: str, label: str) -> list[dict]:
    out = []
    for f in sorted(glob.glob(os.path.join(root, "r", "calls-*-r0.jsonl"))):
        with open(f) as fh:
            recs = [json.loads(line) for line in fh if line.strip()]
        recs = [c for c in recs if "t_out" in c and "t1" in c]
        recs = recs[len(recs) // 4:]  # the first steps (the recording's read, warm-up) apart
        if not recs:
            continue
        row = {"call": label, "log": os.path.basename(f), "calls": len(recs)}
        for a, b in SPLITS:
            d = [(c[b] - c[a]) / 1e3 for c in recs if a in c and b in c]
            if d:
                row[f"{a}->{b}"] = statistics.median(d)
        staged = [c["f_staged"] for c in recs if "f_staged" in c]
        if staged:
            row["f_staged_mean"] = sum(staged) / len(staged)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="unpacked $OUT folders of device calls")
    ap.add_argument("--labels", default=None, help="a label per folder (default A, B, ...)")
    ap.add_argument("--out", default=None, help="write the rows here as JSON")
    a = ap.parse_args(argv)
    labels = a.labels.split(",") if a.labels else [chr(ord("A") + i) for i in range(len(a.dirs))]
    if len(labels) != len(a.dirs):
        ap.error(f"--labels has {len(labels)} labels for {len(a.dirs)} folders")
    rows, splits = [], []
    for d, label in zip(a.dirs, labels):
        if not os.path.isdir(os.path.join(d, "r")):
            print(f"gpu_sandbox_collect: {d} has no r/ folder (give the unpacked $OUT of a device call)",
                  file=sys.stderr)
            return 2
        rows += rows_of(d, label)
        splits += splits_of(d, label)

    def pct(x: float | None) -> str:
        return f"{100 * x:+.1f}%" if x is not None else "-"

    print(f"{'call':4} {'workload':8} {'variant':16} {'emulated':>9} {'predicted':>9} {'vs pred':>8} "
          f"{'vs truth':>8} {'sd ms':>6}  losses  peaks")
    for r in rows:
        print(f"{r['call']:4} {r['workload']:8} {r['variant']:16} {r['emulated_ms'] or 0:9.2f} "
              f"{r['predicted_ms'] or 0:9.2f} {pct(r['vs_prediction']):>8} {pct(r['vs_truth']):>8} "
              f"{r['step_sd_ms'] or 0:6.2f}  {str(r['losses_equal']):6}  {r['peaks_equal']}")
    if splits:
        print("\ncall-log medians per device-path call, us (steps after the first quarter):")
        for s in splits:
            parts = " ".join(f"{k} {v:.0f}" for k, v in s.items() if "->" in k)
            extra = f" staged/call {s['f_staged_mean']:.2f}" if "f_staged_mean" in s else ""
            print(f"  {s['call']} {s['log']} ({s['calls']} calls): {parts}{extra}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"benchmark": "gpu_sandbox", "truth_ms": TRUTH_MS, "rows": rows, "call_logs": splits}, fh,
                      indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
