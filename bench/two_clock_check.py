"""Replays every kept GPU capture that has a measured truth with the current
two-clock model and prints the error per capture and per set. Needs no GPU.

    python bench/two_clock_check.py [--emulate-cold MS] [--net PROFILE]
                                    [--sets share-chosen,share-check,model-fit,holdout]
                                    [-v] [--json OUT.json]

After the per-set lines it prints, per workload and capture GPUs, the
truths' mean and their CV between runs, Prism's mean, the median |error|
with its 95% bootstrap CI over captures, and the mean signed error.

The sets, their archives (bench/results/traces/*.tgz) and truths are those
of ``prism.validation.fidelity``: ``share-chosen`` (13 captures of
2026-11-29, PrismTrace 1.1), ``share-check`` (22, 1.1), ``model-fit`` (12,
1.2: they carry ``free_ns`` and ``cold_ns``; the model's choices were made on
these and the 1.1 sets) and ``holdout`` (22, 1.2, taken with the model fixed:
the out-of-sample check). To check the model on new captures, add their
archive and a table of truths to ``prism.validation.fidelity.SETS``.

1.1 captures have no free finish and no cold start. ``--emulate-cold MS``
fills them in as a 1.2 capture would have (``fidelity.emulate_v12``):
``free_ns`` = the segment's wall time on uncalibrated segments and
``cold_ns`` = MS on segments that follow a communication call.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from prism.validation import fidelity  # noqa: E402


def by_workload(rows: list[dict]) -> dict:
    """Per workload and capture GPUs: captures, the truths' mean and CV over
    distinct runs (the noise floor between runs), Prism's mean, the median
    |error| with its 95% bootstrap CI over captures, the mean signed error."""
    from accuracy import bootstrap_median_ci

    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["workload"], []).append(r)
    out = {}
    for w in sorted(groups):
        g = groups[w]
        truths = sorted({r["truth_ms"] for r in g})
        errs = [abs(r["error_pct"]) for r in g]
        lo, hi = bootstrap_median_ci(errs)
        out[w] = {"n": len(g), "truths": len(truths), "truth_mean_ms": statistics.mean(truths),
                  "truth_cv_pct": 100 * statistics.stdev(truths) / statistics.mean(truths) if len(truths) > 1 else None,
                  "prism_mean_ms": statistics.mean(r["prism_ms"] for r in g),
                  "median_abs_error_pct": statistics.median(errs), "ci95": [lo, hi],
                  "signed_mean_pct": statistics.mean(r["error_pct"] for r in g)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emulate-cold", type=float, default=None, metavar="MS",
                    help="fill 1.1 captures' free_ns and cold_ns (MS after a call), as a 1.2 capture would")
    ap.add_argument("--net", default=fidelity.NET)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cpu-share", default="min", choices=("min", "median", "own"),
                    help="the graph's CPU-share estimator (prism.core.graph.two_clock_columns)")
    ap.add_argument("--sets", default=",".join(fidelity.SETS),
                    help="which sets to replay, comma-separated: " + ", ".join(fidelity.SETS) + " (default all)")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per capture")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if any(w not in fidelity.SETS for w in a.sets.split(",")):
        ap.error(f"--sets {a.sets}: known sets are {', '.join(fidelity.SETS)}")
    model = fidelity.load_model(a.net)
    cold = None if a.emulate_cold is None else int(a.emulate_cold * 1e6)
    out: dict = {"net": a.net, "emulate_cold_ms": a.emulate_cold, "sets": {}}
    every: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        fidelity.extract(tmp)
        for label in a.sets.split(","):
            rows = fidelity.replay(tmp, fidelity.SETS[label][1], model, a.warmup, a.cpu_share, cold)
            if a.verbose:
                for r in rows:
                    print(f"  {label:12s} {r['capture'].split('/')[-1]:28s} {r['workload']:34s} "
                          f"{r['truth_ms']:8.2f} {r['prism_ms']:8.2f} {r['error_pct']:+6.1f}%")
            errs = [abs(r["error_pct"]) for r in rows]
            every += errs
            s = {"n": len(rows), "median_abs_error_pct": statistics.median(errs), "max_abs_error_pct": max(errs),
                 "within_2pct": sum(e <= 2 for e in errs),
                 "mean_signed_error_pct": statistics.mean(r["error_pct"] for r in rows)}
            out["sets"][label] = {"rows": rows, "summary": s}
            print(f"{label:12s} {s['n']:2d} captures: median |error| {s['median_abs_error_pct']:.2f}%, "
                  f"max {s['max_abs_error_pct']:.1f}%, {s['within_2pct']} within 2%, "
                  f"mean signed {s['mean_signed_error_pct']:+.2f}%")
    out["all"] = {"n": len(every), "median_abs_error_pct": statistics.median(every),
                  "within_2pct": sum(e <= 2 for e in every)}
    print(f"{'all':12s} {len(every)} captures: median |error| {out['all']['median_abs_error_pct']:.2f}%, "
          f"{out['all']['within_2pct']} within 2%")
    out["by_workload"] = by_workload([r for st in out["sets"].values() for r in st["rows"]])
    print(f"\n{'workload, world, GPUs of the capture':38s}{'n':>3} {'truth ms (runs, CV)':>24} {'Prism ms':>9} "
          f"{'median |err| [95% CI]':>22} {'signed':>7}")
    for w, b in out["by_workload"].items():
        ci = f"{b['median_abs_error_pct']:.1f}% [{b['ci95'][0]:.1f}, {b['ci95'][1]:.1f}]"
        cv = f"{b['truth_cv_pct']:.1f}%" if b["truth_cv_pct"] is not None else "-"
        print(f"{w:38s}{b['n']:>3} {b['truth_mean_ms']:>9.2f} ({b['truths']:>2}, {cv:>5}) {b['prism_mean_ms']:>9.2f} "
              f"{ci:>22} {b['signed_mean_pct']:>+6.1f}%")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
