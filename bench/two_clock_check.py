"""Replays every kept GPU capture that has a measured truth with the current
two-clock model and prints the error per capture and per set. Needs no GPU.

    python bench/two_clock_check.py [--emulate-cold MS] [--net PROFILE] [--sets old,new,sixth,seventh]
                                    [-v] [--json OUT.json]

After the per-set lines it prints, per workload and capture GPUs, the
truths' mean and their CV between runs, Prism's mean, the median |error|
with its 95% bootstrap CI over captures, and the mean signed error.

Sets (bench/results/traces/*.tgz; truths from bench/results/nccl-2026-11-29.md):

- ``old``: the 13 captures of 2026-11-29 (sections 5 and 6), PrismTrace 1.1;
- ``new``: the 22 of the fifth session (section 7), PrismTrace 1.1;
- ``sixth``: the 12 of the sixth session with truths (section 8), PrismTrace 1.2:
  they carry ``free_ns`` and ``cold_ns``;
- ``seventh``: the 22 of the seventh session (section 9), PrismTrace 1.2,
  taken with the model unchanged: the out-of-sample check of its choices.

1.1 captures have no free finish and no cold start. ``--emulate-cold MS``
fills them in as a 1.2 capture would have: ``free_ns`` = the segment's wall
time on uncalibrated segments (exact on 2 GPUs; on 1 GPU it keeps the
logical-device mode's cost, which a 1.2 capture takes off) and ``cold_ns`` =
MS on segments that follow a communication call (the sixth session's probes
measured 51-199 us per rank).

The model's three choices of 2026-11-30 (the free finish, the alignment of
segments across steps, the largest calibrated GPU time a segment's wall
allows) were made on these 47 captures: this script is how the next session
checks them on new ones (add the new set's truths to ``SIXTH``'s like).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cpu_share_choice import NEW, TRACES, TRUTHS  # noqa: E402

from prism.core import trace as T  # noqa: E402
from prism.shell import runfolder  # noqa: E402
from prism.core.graph import ExecutionGraph  # noqa: E402
from prism.core.replay import replay_batch  # noqa: E402
from prism.app.predict import resolve_profile  # noqa: E402

NET = str(ROOT / "bench" / "results" / "nccl-h200x2-issue-profile.toml")
#: The sixth session's captures (nccl-h200x2-sixth-captures-2026-11-30.tgz):
#: a- from the call of 01:58 UTC, b- from 02:05 (section 8 of the report).
#: a-gpt-tp2-run1-1gpu has no truth (the call's time limit cut that run).
SIXTH = {
    "nccl-h200x2-sixth/a-gpt-pp2-run0-1gpu": ("GPT pp2, world 2, 1 GPU", 52.91),
    "nccl-h200x2-sixth/a-gpt-pp2-run0-2gpu": ("GPT pp2, world 2, 2 GPUs", 52.91),
    "nccl-h200x2-sixth/a-gpt-pp2-run1-1gpu": ("GPT pp2, world 2, 1 GPU", 52.87),
    "nccl-h200x2-sixth/a-gpt-pp2-run1-2gpu": ("GPT pp2, world 2, 2 GPUs", 52.87),
    "nccl-h200x2-sixth/a-gpt-tp2-run0-1gpu": ("GPT tp2, world 2, 1 GPU", 44.03),
    "nccl-h200x2-sixth/a-gpt-tp2-run0-2gpu": ("GPT tp2, world 2, 2 GPUs", 44.03),
    "nccl-h200x2-sixth/a-moe-dp2-ep2-run0-1gpu": ("MoE dp2 ep2, world 2, 1 GPU", 116.10),
    "nccl-h200x2-sixth/a-moe-dp2-ep2-run0-2gpu": ("MoE dp2 ep2, world 2, 2 GPUs", 116.10),
    "nccl-h200x2-sixth/b-fsdp2-run0-1gpu": ("FSDP2, world 2, 1 GPU", 139.23),
    "nccl-h200x2-sixth/b-fsdp2-run0-2gpu": ("FSDP2, world 2, 2 GPUs", 139.23),
    "nccl-h200x2-sixth/b-moe-dp2-ep2-run0-1gpu": ("MoE dp2 ep2, world 2, 1 GPU", 113.54),
    "nccl-h200x2-sixth/b-moe-dp2-ep2-run0-2gpu": ("MoE dp2 ep2, world 2, 2 GPUs", 113.54),
}

#: The seventh session's captures (nccl-h200x2-seventh-captures-2026-11-30.tgz),
#: taken with the sixth session's final model unchanged: the out-of-sample
#: check. Calls a 03:04 (GPT tp2, pp2, MoE), b 03:09 (FSDP2), c 03:21 (MoE),
#: d 03:26 UTC (FSDP2 x2, MoE; its MoE run 1 lost its truth to the limit),
#: e 03:36 UTC (MoE).
SEVENTH = {
    "nccl-h200x2-seventh/a-gpt-tp2-run0-1gpu": ("GPT tp2, world 2, 1 GPU", 43.24),
    "nccl-h200x2-seventh/a-gpt-tp2-run0-2gpu": ("GPT tp2, world 2, 2 GPUs", 43.24),
    "nccl-h200x2-seventh/a-gpt-tp2-run1-1gpu": ("GPT tp2, world 2, 1 GPU", 43.10),
    "nccl-h200x2-seventh/a-gpt-tp2-run1-2gpu": ("GPT tp2, world 2, 2 GPUs", 43.10),
    "nccl-h200x2-seventh/a-gpt-pp2-run0-1gpu": ("GPT pp2, world 2, 1 GPU", 51.66),
    "nccl-h200x2-seventh/a-gpt-pp2-run0-2gpu": ("GPT pp2, world 2, 2 GPUs", 51.66),
    "nccl-h200x2-seventh/a-gpt-pp2-run1-1gpu": ("GPT pp2, world 2, 1 GPU", 52.15),
    "nccl-h200x2-seventh/a-gpt-pp2-run1-2gpu": ("GPT pp2, world 2, 2 GPUs", 52.15),
    "nccl-h200x2-seventh/a-moe-dp2-ep2-run0-1gpu": ("MoE dp2 ep2, world 2, 1 GPU", 109.92),
    "nccl-h200x2-seventh/a-moe-dp2-ep2-run0-2gpu": ("MoE dp2 ep2, world 2, 2 GPUs", 109.92),
    "nccl-h200x2-seventh/b-fsdp2-run0-1gpu": ("FSDP2, world 2, 1 GPU", 162.35),
    "nccl-h200x2-seventh/b-fsdp2-run0-2gpu": ("FSDP2, world 2, 2 GPUs", 162.35),
    "nccl-h200x2-seventh/c-moe-dp2-ep2-run0-1gpu": ("MoE dp2 ep2, world 2, 1 GPU", 114.27),
    "nccl-h200x2-seventh/c-moe-dp2-ep2-run0-2gpu": ("MoE dp2 ep2, world 2, 2 GPUs", 114.27),
    "nccl-h200x2-seventh/d-fsdp2-run0-1gpu": ("FSDP2, world 2, 1 GPU", 137.03),
    "nccl-h200x2-seventh/d-fsdp2-run0-2gpu": ("FSDP2, world 2, 2 GPUs", 137.03),
    "nccl-h200x2-seventh/d-fsdp2-run1-1gpu": ("FSDP2, world 2, 1 GPU", 142.31),
    "nccl-h200x2-seventh/d-fsdp2-run1-2gpu": ("FSDP2, world 2, 2 GPUs", 142.31),
    "nccl-h200x2-seventh/d-moe-dp2-ep2-run0-1gpu": ("MoE dp2 ep2, world 2, 1 GPU", 115.30),
    "nccl-h200x2-seventh/d-moe-dp2-ep2-run0-2gpu": ("MoE dp2 ep2, world 2, 2 GPUs", 115.30),
    "nccl-h200x2-seventh/e-moe-dp2-ep2-run0-1gpu": ("MoE dp2 ep2, world 2, 1 GPU", 116.49),
    "nccl-h200x2-seventh/e-moe-dp2-ep2-run0-2gpu": ("MoE dp2 ep2, world 2, 2 GPUs", 116.49),
}


def emulate_12(ranks: dict, cold_ns: int) -> dict:
    """1.1 events with the 1.2 fields filled in (see the module docstring)."""
    out = {}
    for r, evs in ranks.items():
        new, prev = [], None
        for e in evs:
            if isinstance(e, T.Compute) and e.cpu_ns >= 0 and e.free_ns == -1 and e.cold_ns == 0:
                after_call = prev is not None and isinstance(prev, (T.Collective, T.P2P))
                e = dataclasses.replace(e, free_ns=(e.end_ns - e.start_ns) if e.gpu_ns == -1 else -1,
                                        cold_ns=cold_ns if after_call else 0)
            if isinstance(e, (T.Compute, T.Iteration, T.Collective, T.P2P)):
                prev = e
            new.append(e)
        out[r] = new
    return out


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
    ap.add_argument("--net", default=NET)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cpu-share", default="min", choices=("min", "median", "own"),
                    help="the graph's CPU-share estimator (prism.core.graph.two_clock_columns)")
    ap.add_argument("--sets", default="old,new,sixth,seventh",
                    help="which sets to replay (comma-separated; default all)")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per capture")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model, _ = resolve_profile(a.net, None)
    cold = None if a.emulate_cold is None else int(a.emulate_cold * 1e6)
    out: dict = {"net": a.net, "emulate_cold_ms": a.emulate_cold, "sets": {}}
    every: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for tgz in sorted(TRACES.glob("*.tgz")):
            with tarfile.open(tgz) as tf:
                tf.extractall(tmp, filter="data")
        known = {"old": TRUTHS, "new": NEW, "sixth": SIXTH, "seventh": SEVENTH}
        wanted = a.sets.split(",")
        if any(w not in known for w in wanted):
            ap.error(f"--sets {a.sets}: known sets are {', '.join(known)}")
        for label, table in ((w, known[w]) for w in wanted):
            rows = []
            for name, (what, truth) in table.items():
                ranks = runfolder.read_run(pathlib.Path(tmp) / name).ranks
                if cold is not None:
                    ranks = emulate_12(ranks, cold)
                ms = replay_batch(ExecutionGraph.from_events(ranks, cpu_share=a.cpu_share), cost_model=model).mean_iteration_time(a.warmup) / 1e6
                err = 100 * (ms - truth) / truth
                rows.append({"capture": name, "workload": what, "truth_ms": truth, "prism_ms": round(ms, 3),
                             "error_pct": round(err, 2)})
                if a.verbose:
                    print(f"  {label:6s} {name.split('/')[-1]:28s} {what:34s} {truth:8.2f} {ms:8.2f} {err:+6.1f}%")
            errs = [abs(r["error_pct"]) for r in rows]
            every += errs
            s = {"n": len(rows), "median_abs_error_pct": statistics.median(errs), "max_abs_error_pct": max(errs),
                 "within_2pct": sum(e <= 2 for e in errs),
                 "mean_signed_error_pct": statistics.mean(r["error_pct"] for r in rows)}
            out["sets"][label] = {"rows": rows, "summary": s}
            print(f"{label:6s} {s['n']:2d} captures: median |error| {s['median_abs_error_pct']:.2f}%, "
                  f"max {s['max_abs_error_pct']:.1f}%, {s['within_2pct']} within 2%, "
                  f"mean signed {s['mean_signed_error_pct']:+.2f}%")
    out["all"] = {"n": len(every), "median_abs_error_pct": statistics.median(every),
                  "within_2pct": sum(e <= 2 for e in every)}
    print(f"all    {len(every)} captures: median |error| {out['all']['median_abs_error_pct']:.2f}%, "
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
