"""Does a CPU-bound truth move with the CPU it runs on? (FSDP2's data draw)

FSDP2's step draws its data with ``torch.randn`` on the CPU, one thread, so
its truth follows the speed of the core it lands on. This bench measures, on
the machine it runs on:

1. the CPU topology (SMT siblings, packages) and the host's steal time;
2. the same draw (``torch.randn`` of 2 x 8192 x 512 with a generator, as
   ``fsdp2.py --batch 4096 --dim 512`` at world 2) timed in one process
   alone, in two at once unpinned, pinned to two SMT siblings of one core,
   and pinned to two different cores;
3. ``--truth K`` runs of a command as a plain job (``prism.validation.truthrun``,
   ``PRISM_STEPCLOCK_SCHED=1``): per run and rank the mean
   step, the main thread's CPU time and run-queue wait per step, and the CPUs
   it ran on (are the slow runs the ones whose ranks share a core?).

Prints a table and writes JSON:

    python bench/cpu_noise.py --json OUT.json [--truth 4 --world 2 -- CMD...]

``--sample LOG`` instead runs the draw once every ``--interval`` seconds
until killed, appending ``MONOTONIC_NS DRAW_NS`` lines to LOG: a probe of the
CPU's single-thread speed beside other runs (``bench/nccl_accuracy.py``
records its truths' step ends and its captures' start on the same clock).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prism.validation.cpunoise import (  # noqa: E402
    draws,
    pick_cpus,
    sample,
    steal_ticks,
    topology,
    truth_runs,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", type=int, default=8192, help="rows per draw (world x --batch)")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--truth", type=int, default=0, help="plain runs of CMD (after --)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--profile-step", type=int, default=-1,
                    help="profile this step of each plain run (operators and kernels): its aten::randn time")
    ap.add_argument("--no-draws", action="store_true", help="skip the draw placements")
    ap.add_argument("--sample", default=None, metavar="LOG", help="probe the CPU's speed until killed")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.sample:
        sample(args.sample, args.interval, args.rows, args.dim)
        return
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    topo = topology()
    a, sib, other = pick_cpus(topo)
    print(f"CPU: {topo['model']}; {len(topo['affinity'])} allowed; CPU {a}'s siblings {topo['siblings'].get(a)}; "
          f"pairs: siblings ({a},{sib}), distinct cores ({a},{other})", flush=True)
    cases = {"alone": [str(a)], "two unpinned": [None, None]}
    if sib >= 0:
        cases["two on SMT siblings"] = [str(a), str(sib)]
    if other >= 0:
        cases["two on distinct cores"] = [str(a), str(other)]
    res = {}
    print(f"{'draw (2 x randn ' + str(args.rows) + ' x ' + str(args.dim) + ')':<34} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for name, placement in ({} if args.no_draws else cases).items():
        s0 = steal_ticks()
        times = draws(placement, args.reps, args.rows, args.dim)
        flat = [t / 1e6 for ts in times for t in ts[3:]]
        res[name] = {"placement": placement, "ns": times, "steal_ticks": steal_ticks() - s0,
                     "median_ms": statistics.median(flat), "min_ms": min(flat), "max_ms": max(flat)}
        print(f"{name:<34} {res[name]['median_ms']:>10.1f} {res[name]['min_ms']:>8.1f} {res[name]['max_ms']:>8.1f}",
              flush=True)
    out = {"benchmark": "cpu_noise", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "topology": topo, "draws": res, "truth_cmd": cmd,
           "truth": truth_runs(args.truth, args.world, cmd, args.timeout, args.profile_step) if args.truth and cmd else []}
    pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
