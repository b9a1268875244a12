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
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_view  # noqa: E402

#: The stored two-H200 NCCL truths, ms (runs, CV): GPT tp2 6 runs 1.4%, pp2 8 runs 1.0%, MoE 8 runs 1.8%.
TRUTH_MS = {"gpt-tp2": 43.89, "pp2": 52.68, "moe": 114.33}
#: A call's host moments in order (the call log's fields; `f_*`: a recorded delivery's own steps).
SPLITS = [("t0", "t_msg"), ("t_msg", "t_sent"), ("t_sent", "t_wait"), ("t_wait", "t_out"), ("t_out", "t1"),
          ("t_wait", "f_lock"), ("f_lock", "f_adv0"), ("f_adv0", "f_copy"), ("f_copy", "f_adv1"), ("t0", "t1")]


def rows_of(root: str, label: str) -> list[dict]:
    rows = []
    for f in sorted(glob.glob(os.path.join(root, "r", "cap-*", "emulation", "*", "summary.json"))):
        cap = f.split(os.sep + "cap-")[1].split(os.sep)[0]
        wl = re.sub(r"-c[0-9]+$", "", cap)  # CAPS=N: cap-WL-c2, ... are more captures of WL
        name = f.split(os.sep + "emulation" + os.sep)[1].split(os.sep)[0]
        with open(f) as fh:
            s = json.load(fh)
        r0 = s["ranks"][str(s["sandbox"][0])] if s.get("sandbox") else next(iter(s["ranks"].values()))
        e, p = s.get("emulated_mean_ns"), s.get("predicted_mean_ns")
        t = TRUTH_MS.get(wl)
        steps = r0.get("iteration_ns", [])[s.get("warmup", 0):]
        rows.append({
            "call": label, "workload": wl, "capture": cap, "variant": name, "status": s.get("status"),
            "emulated_ms": e / 1e6 if e else None, "predicted_ms": p / 1e6 if p else None, "truth_ms": t,
            "vs_prediction": e / p - 1 if e and p else None, "vs_truth": e / 1e6 / t - 1 if e and t else None,
            "step_sd_ms": statistics.stdev(steps) / 1e6 if len(steps) > 1 else None,
            # the last measured step less the others' median (3-5 ms with a call log before 28c41ee)
            "last_step_excess_ms": (steps[-1] - statistics.median(steps[:-1])) / 1e6 if len(steps) > 2 else None,
            "losses_equal": r0.get("losses_equal"), "max_loss_rel_diff": r0.get("max_loss_rel_diff"),
            "peaks_equal": r0.get("peaks_equal"), "peak_allocated": r0.get("peak_allocated"),
            "capture_peak_allocated": r0.get("capture_peak_allocated"), "calls": s.get("calls"),
        })
    return rows


#: Student's t, two-sided 95%, by degrees of freedom (1..10; beyond, 2.0).
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}


def path_of(variant: str) -> str:
    """An emulation's path from its name (gpu-sandbox's ``device``, ``device-2``,
    ``device-comp``...; sandbox-ab's ``rec-1``, ``comp-2``...)."""
    v = re.sub(r"-[0-9]+$", "", variant)
    return {"device": "recorded", "rec": "recorded", "device-comp": "compensated", "comp": "compensated"}.get(v, v)


def cells_of(rows: list[dict]) -> list[dict]:
    """Per workload and path, every emulation against the truth: n, median,
    mean with its 95% t-interval (n >= 2), and the captures it came from.
    The emulations of one capture share that capture's error, so the
    interval is the spread of these runs, not of independent captures."""
    cells: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r["vs_truth"] is not None:
            cells.setdefault((r["workload"], path_of(r["variant"])), []).append(r)
    out = []
    for (wl, path), rs in sorted(cells.items()):
        xs = [r["vs_truth"] for r in rs]
        n = len(xs)
        mean = statistics.fmean(xs)
        half = T95.get(n - 1, 2.0) * statistics.stdev(xs) / n ** 0.5 if n > 1 else None
        out.append({"workload": wl, "path": path, "n": n, "captures": len({r["capture"] for r in rs}),
                    "median_vs_truth": statistics.median(xs), "mean_vs_truth": mean,
                    "ci95": [mean - half, mean + half] if half is not None else None,
                    "min": min(xs), "max": max(xs), "within_2pct": abs(statistics.median(xs)) <= 0.02,
                    "losses_equal": sorted({str(r["losses_equal"]) for r in rs}),
                    "peaks_equal": sorted({str(r["peaks_equal"]) for r in rs})})
    return out


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
        # the GPU's view of its steps (bench/gpu_view.py): T - late, median over the steps after the first
        with open(f) as fh:
            steps = gpu_view.view([json.loads(line) for line in fh if line.strip()]) if "step" in recs[0] else []
        if len(steps) > 1:
            row["gpu_view_ms"] = statistics.median(r["T_less_late_ms"] for r in steps[1:])
            row["carry_dropped_ms"] = statistics.median(r["dropped_ms"] for r in steps[1:])
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
          f"{'vs truth':>8} {'sd ms':>6} {'last+':>6}  losses  peaks")
    for r in rows:
        last = r.get("last_step_excess_ms")
        print(f"{r['call']:4} {r['workload']:8} {r['variant']:16} {r['emulated_ms'] or 0:9.2f} "
              f"{r['predicted_ms'] or 0:9.2f} {pct(r['vs_prediction']):>8} {pct(r['vs_truth']):>8} "
              f"{r['step_sd_ms'] or 0:6.2f} {last if last is not None else 0:6.2f}  {str(r['losses_equal']):6}  "
              f"{r['peaks_equal']}")
    cells = cells_of(rows)
    if cells:
        print("\nagainst the stored truth, per workload and path (all calls' emulations):")
        print(f"  {'workload':8} {'path':12} {'n':>2} {'caps':>4} {'median':>7} {'mean':>7} {'95% CI of mean':>17} "
              f"{'range':>17}  within 2%")
        for c in cells:
            ci = f"[{pct(c['ci95'][0])}, {pct(c['ci95'][1])}]" if c["ci95"] else "-"
            print(f"  {c['workload']:8} {c['path']:12} {c['n']:2d} {c['captures']:4d} {pct(c['median_vs_truth']):>7} "
                  f"{pct(c['mean_vs_truth']):>7} {ci:>17} {'[' + pct(c['min']) + ', ' + pct(c['max']) + ']':>17}  "
                  f"{'yes' if c['within_2pct'] else 'no'}")
    if splits:
        print("\ncall-log medians per device-path call, us (steps after the first quarter):")
        for s in splits:
            parts = " ".join(f"{k} {v:.0f}" for k, v in s.items() if "->" in k)
            extra = f" staged/call {s['f_staged_mean']:.2f}" if "f_staged_mean" in s else ""
            if "gpu_view_ms" in s:
                extra += (f"; GPU view (T - late) {s['gpu_view_ms']:.2f} ms a step, carry dropped "
                          f"{s['carry_dropped_ms']:.2f}")
            print(f"  {s['call']} {s['log']} ({s['calls']} calls): {parts}{extra}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"benchmark": "gpu_sandbox", "truth_ms": TRUTH_MS, "rows": rows, "cells": cells,
                       "call_logs": splits}, fh,
                      indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
