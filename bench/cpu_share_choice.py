"""How should a GPU rank's segment take its CPU share? Replays the kept GPU
captures of the sets ``share-chosen`` and ``share-check``
(``prism.validation.fidelity``; bench/results/traces/) with each estimator of
``prism.core.graph.two_clock_columns`` and compares with the truths measured
in the same device calls. Needs no GPU.

    python bench/cpu_share_choice.py [--net PROFILE] [--json OUT.json]

The estimators: ``own`` (each segment its own share), ``median`` and ``min``
over the segment's occurrences in the uncalibrated steps. ``min`` is the
default; it was chosen on ``share-chosen`` (13 captures), and ``share-check``
(22 captures taken after the choice) is its check. The default profile is
the 4-GPU machine's, which the captures were predicted with live.
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

from prism.core.graph import CPU_SHARES  # noqa: E402
from prism.validation import fidelity  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--net", default=fidelity.NET_H200X4, help="cost profile (default: the 4-GPU machine's, as measured live)")
    a = ap.parse_args()
    model = fidelity.load_model(a.net)
    out: dict = {"net": a.net}
    with tempfile.TemporaryDirectory() as tmp:
        for label in ("share-chosen", "share-check"):
            archives, table = fidelity.SETS[label]
            fidelity.extract(tmp, archives)
            rows = [{"capture": name, "workload": what, "truth_ms": truth} for name, (what, truth) in table.items()]
            for est in CPU_SHARES:
                for row, r in zip(rows, fidelity.replay(tmp, table, model, a.warmup, cpu_share=est)):
                    row[est] = {"ms": r["prism_ms"], "error_pct": r["error_pct"]}
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
