"""A device-path call's host time in Prism's backend, this tree against a base
revision, side by side on one machine (no GPU: the device path's CPU test mode).

    python bench/call_cost.py [--base REV] [--runs 3] [--steps 20] [--call-log] [--json OUT]
    python bench/call_cost.py --against-env PRISM_DEVICE_ARRIVE_AT_REACH=0 [...]   # this tree, a switch off/on

The GPU sandbox's remaining error is Prism's host time per call (300-500 us on
an H100's host against NCCL's 25-42; docs/DESIGN.md). Most of it is Python
bookkeeping that the device path's CPU test mode (``PRISM_GPU_SANDBOX=cpu-test``:
the same backend code on CPU tensors, no stream to wait on) runs as well, so
its cost can be cut and measured here. The bench captures the bundled GPT once
(8 ranks, tp2 pp2 dp2, small, ``--record 4``) with this tree, then emulates
sandbox rank 4 in CPU test mode ``--runs`` times with each tree, alternating
(base, this, base, this...), and reads each run's rank log: ``prism: device
path: N calls issued, X us ... (median M us ...)`` (the time from the
backend's entry to its return, per call; the base must print the median, i.e.
be 2026-12-08's ``call_cost`` commit or later). It prints per tree the median
over runs of each run's median and mean, and this tree's over the base's as
a ratio; the JSON has every run. With ``--call-log`` each run also writes
the device path's call log and the table adds each stage's median wall time
(``bench/host_time.py``'s stages; the log's own stamps cost every call a
little, the same in both trees). ``--against-env KEY=VALUE`` compares this
tree with itself under that environment (the "base" runs) instead of another
revision. Each run also gives the coordinator's CPU time (its summary's
``coordinator.cpu_s``, the whole emulation). ``--threaded-reach``: the CPU
test mode reports each reach from a thread of its own, as a GPU's reach
watcher does (``PRISM_CPU_TEST_THREADED_REACH=1``), not on the calling
thread: the GPU path's arrangement of threads and GIL. Not covered: the GPU's own calls (stream
queries, the release wait, the pool's delivery), which take their own time
on a GPU host (``bench/host_time.py`` on a GPU run's call log).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import result_path, write_json  # noqa: E402
from host_time import stage_table  # noqa: E402
from late_carry import read_calls  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
GPT = ["-m", "prism.workloads.gpt", "--tp", "2", "--pp", "2", "--dp", "2", "--layers", "2", "--hidden", "32",
       "--heads", "2", "--seq-len", "16"]
ISSUED = re.compile(r"prism: device path: (\d+) calls issued, ([\d.]+) us .*?\(median ([\d.]+) us, max ([\d.]+) us\)")


def run(cmd: list[str], tree: pathlib.Path, env: dict[str, str] | None = None, timeout: int = 600) -> str:
    e = dict(os.environ, PYTHONPATH=str(tree), **(env or {}))
    p = subprocess.run([sys.executable, *cmd], cwd=tree, env=e, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"call_cost: {' '.join(cmd[:3])} in {tree} failed ({p.returncode}):\n"
                         f"{p.stderr[-3000:]}{p.stdout[-1000:]}")
    return p.stdout


def coordinator_cpu_s(run_dir: pathlib.Path, name: str) -> float | None:
    try:
        import json

        return float(json.loads((run_dir / "emulation" / name / "summary.json").read_text())["coordinator"]["cpu_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def issued(run_dir: pathlib.Path, name: str, rank: int) -> dict:
    log = run_dir / "emulation" / name / "logs" / f"rank-{rank:06d}.log"
    m = ISSUED.search(log.read_text()) if log.is_file() else None
    if m is None:
        raise SystemExit(f"call_cost: no 'calls issued ... (median ...)' line in {log}; is the base tree older "
                         "than the bench (give --base a revision that prints the median)?")
    return {"calls": int(m.group(1)), "mean_us": float(m.group(2)), "median_us": float(m.group(3)),
            "max_us": float(m.group(4))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the revision to compare with (default HEAD: the last commit)")
    ap.add_argument("--runs", type=int, default=3, help="emulations per tree, alternating (default 3)")
    ap.add_argument("--steps", type=int, default=20, help="the workload's steps (default 20)")
    ap.add_argument("--sandbox", type=int, default=4, help="the sandbox rank (default 4)")
    ap.add_argument("--call-log", action="store_true", help="also write call logs and compare stage by stage")
    ap.add_argument("--threaded-reach", action="store_true",
                    help="report the CPU test mode's reaches from a thread of their own, as on a GPU "
                         "(PRISM_CPU_TEST_THREADED_REACH=1)")
    ap.add_argument("--against-env", default=None, metavar="KEY=VALUE",
                    help="compare this tree with itself under KEY=VALUE (the base runs), not with --base")
    ap.add_argument("--json", default=None, help="where to write the results (default bench/results/call_cost-DATE.json)")
    args = ap.parse_args()

    base_env: dict[str, str] = {}
    if args.against_env:
        key, sep, value = args.against_env.partition("=")
        if not sep or not key:
            ap.error(f"--against-env takes KEY=VALUE, got {args.against_env!r}")
        base_env = {key: value}
    work = pathlib.Path(tempfile.mkdtemp(prefix="prism-call-cost-"))
    here = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    if base_env:
        base, rev = ROOT, f"{here} with {args.against_env}"
    else:
        base = work / "base"
        rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), rev], cwd=ROOT, check=True)
    try:
        cap = work / "gpt"
        t = time.perf_counter()
        run(["-m", "prism", "capture", "-n", "8", "--record", str(args.sandbox), "--out", str(cap), "--progress",
             "off", "--show-ranks", "none", "--", *GPT, "--steps", str(args.steps)], ROOT)
        print(f"captured in {time.perf_counter() - t:.1f} s: {cap}")
        env = {"PRISM_GPU_SANDBOX": "cpu-test"}
        if args.threaded_reach:
            env["PRISM_CPU_TEST_THREADED_REACH"] = "1"
        rows = []
        for i in range(args.runs):
            for label, tree in (("base", base), ("this", ROOT)):
                name = f"{label}-{i}"
                log = work / f"calls-{name}-{{rank}}.jsonl"
                e = dict(env, **(base_env if label == "base" else {}))
                run(["-m", "prism", "emulate", str(cap), "--sandbox", str(args.sandbox), "--name", name,
                     "--progress", "off", "--prefetch-pool", "1"], tree,
                    dict(e, PRISM_DEVICE_CALL_LOG=str(log)) if args.call_log else e)
                r = {"tree": label, "run": i, **issued(cap, name, args.sandbox),
                     "coordinator_cpu_s": coordinator_cpu_s(cap, name)}
                if args.call_log:
                    st = stage_table(read_calls(str(log).format(rank=args.sandbox)), 0.25)
                    r["stages_wall_us_p50"] = {x["stage"].strip(): x["wall_us_p50"] for x in st["stages"]}
                rows.append(r)
                cc = r["coordinator_cpu_s"]
                print(f"  {name:<8} {r['calls']:>5} calls  median {r['median_us']:7.1f} us  mean {r['mean_us']:7.1f} us"
                      f"  max {r['max_us']:8.1f} us  coordinator {cc if cc is not None else float('nan'):.3f} s CPU")
    finally:
        if not base_env:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)
        shutil.rmtree(work, ignore_errors=True)

    def agg(label: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["tree"] == label)

    table = {label: {k: agg(label, k) for k in ("median_us", "mean_us")} for label in ("base", "this")}
    for label in ("base", "this"):
        cpu = [r["coordinator_cpu_s"] for r in rows if r["tree"] == label and r["coordinator_cpu_s"] is not None]
        table[label]["coordinator_cpu_s"] = statistics.median(cpu) if cpu else None
    print(f"\nper device-path call in Prism's backend (cpu-test, sandbox rank {args.sandbox}, median of {args.runs} runs):")
    print(f"  {'tree':<44}{'median us':>12}{'mean us':>12}{'coord. CPU s':>14}")
    for label, name in (("base", f"base {rev}"), ("this", f"this {here}{' + changes' if dirty else ''}")):
        cc = table[label]["coordinator_cpu_s"]
        print(f"  {name:<44}{table[label]['median_us']:>12.1f}{table[label]['mean_us']:>12.1f}"
              f"{cc if cc is not None else float('nan'):>14.3f}")
    ratio = {k: table["this"][k] / table["base"][k] for k in ("median_us", "mean_us", "coordinator_cpu_s")
             if table["this"][k] and table["base"][k]}
    print(f"  {'this / base':<44}{ratio.get('median_us', float('nan')):>12.2f}{ratio.get('mean_us', float('nan')):>12.2f}"
          f"{ratio.get('coordinator_cpu_s', float('nan')):>14.2f}")
    if args.call_log:
        stages = list(rows[0]["stages_wall_us_p50"])
        for label in ("base", "this"):
            have = {st: [r["stages_wall_us_p50"][st] for r in rows
                         if r["tree"] == label and st in r["stages_wall_us_p50"]] for st in stages}
            table[label]["stages_wall_us_p50"] = {st: statistics.median(v) for st, v in have.items() if v}
        print("\nby stage, the call log's wall p50 (median of the runs), us:")
        print(f"  {'stage':<36}{'base':>10}{'this':>10}{'this - base':>13}")
        for st in stages:
            b, t = table["base"]["stages_wall_us_p50"].get(st), table["this"]["stages_wall_us_p50"].get(st)
            if b is None or t is None:
                continue
            print(f"  {st:<36}{b:>10.1f}{t:>10.1f}{t - b:>+13.1f}")
    doc = {"benchmark": "call_cost", "date": time.strftime("%Y-%m-%d", time.gmtime()), "base": rev,
           "against_env": args.against_env, "threaded_reach": args.threaded_reach,
           "this": here + (" + uncommitted changes" if dirty else ""), "runs": args.runs, "steps": args.steps,
           "workload": " ".join(GPT), "rows": rows, "table": table, "ratio": ratio}
    write_json(args.json or result_path("call_cost"), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
