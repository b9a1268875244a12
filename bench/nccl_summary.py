"""Every truth/Prism pair of a set of ``bench/nccl_accuracy.py`` results, and
their summary: the live errors as each device call predicted them.

    python bench/nccl_summary.py [FILES...] [--exclude SUBSTRING ...] [--json OUT]

Default files: the world-2 results of the PrismTrace-1.1 captures of
2026-11-30 (the ``share-check`` set of ``prism.validation.fidelity``:
``bench/results/nccl_accuracy-2026-11-30-h200x2-*.json``, the first runs of
each workload) without ``fsdp2-1``, captured before the calibration covered
FSDP2's own streams (section 7 of
``bench/results/archive/nccl_accuracy-2026-11.md``). Needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT = [str(ROOT / "bench" / "results" / f"nccl_accuracy-2026-11-30-h200x2-{v}.json")
           for v in ("fsdp2-1", "fsdp2-2", "gpt-pp2-1", "gpt-pp2-2", "gpt-pp2-3", "gpt-tp2-1", "gpt-tp2-2",
                     "moe-1", "moe-2")]


def pairs(path: str) -> list[dict]:
    d = json.loads(pathlib.Path(path).read_text())
    out = []
    for row in d["configs"]:
        for i, t in enumerate(row["truth"]):
            for gpus, runs in row["prism"].items():
                if i < len(runs):
                    p = runs[i]
                    n, _, variant = gpus.partition("@")  # "2" or "2@cal" (nccl_accuracy --variant)
                    out.append({"file": pathlib.Path(path).name, "config": row["config"] + (f"@{variant}" if variant else ""),
                                "run": i, "gpus": int(n), "truth_ms": t["mean_ns"] / 1e6, "prism_ms": p["mean_ns"] / 1e6,
                                "error_pct": 100 * (p["mean_ns"] - t["mean_ns"]) / t["mean_ns"]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--exclude", action="append", default=None, help="leave out files whose name holds this")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    files = a.files or DEFAULT
    exclude = a.exclude if a.exclude is not None else (["-fsdp2-1."] if not a.files else [])
    rows = [r for f in files if not any(x in f for x in exclude) for r in pairs(f)]
    if not rows:
        print("no pairs in " + ", ".join(files), file=sys.stderr)
        return 2
    print(f"{'file':40s} {'config':12s} {'run':>3s} {'GPUs':>4s} {'truth ms':>9s} {'prism ms':>9s} {'error':>7s}")
    for r in rows:
        print(f"{r['file']:40s} {r['config']:12s} {r['run']:3d} {r['gpus']:4d} {r['truth_ms']:9.2f} "
              f"{r['prism_ms']:9.2f} {r['error_pct']:+6.1f}%")
    errs = [abs(r["error_pct"]) for r in rows]
    summary = {"pairs": len(rows), "median_abs_error_pct": statistics.median(errs), "max_abs_error_pct": max(errs),
               "within_2pct": sum(e < 2 for e in errs), "signed_mean_pct": statistics.mean(r["error_pct"] for r in rows)}
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(f"{r['config']} @{r['gpus']} GPU", []).append(r["error_pct"])
    print(f"\n{summary['pairs']} pairs: median |error| {summary['median_abs_error_pct']:.1f}%, max "
          f"{summary['max_abs_error_pct']:.1f}%, {summary['within_2pct']} within 2%, signed mean "
          f"{summary['signed_mean_pct']:+.1f}%")
    for k, v in sorted(by.items()):
        print(f"  {k:24s} " + " ".join(f"{x:+.1f}%" for x in v))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"files": files, "excluded": exclude, "rows": rows,
                                                    "summary": summary, "by_config": by}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
