"""Is this host quiet enough for CPU ground truth? A quick look (about 30 s)
before a CPU-truth suite spends device minutes.

    python bench/host_check.py [--spin-s 3] [--out FILE.json]

spin
    1, half the usable cores and all of them spinning at once, each process
    counting loop turns for ``--spin-s``: per level the slowest and fastest
    process's rate against one alone (a quiet host keeps every process near
    1.0 up to its core count), and over each level what took CPU time from
    the host (``prism.validation.cpunoise.host_pressure``: steal ticks, a
    cgroup CPU quota's throttling, CPU pressure stall time).
gloo
    a 1 KiB and a 1 MiB all_reduce between 2 processes, alone (twice) and
    with every core's process in a group of 2 at once
    (``prism.app.netprofile.measure``): the slowest member's time per call.

A verdict line names what looks wrong (a quota that throttled, processes that
ran at under 80% of one alone below the core count, an all_reduce whose two
measurements alone are over 25% apart). For scale: a 1 KiB all_reduce of 2
took 273 us on the H200 machine's CPUs (2026-12-02), 680-757 us on an H100
host's (2026-12-07), 0.8-2.5 ms on the 2-core VM (two runs a minute
apart). Prints a table and writes JSON (bench/README.md names the file).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _results import result_path, write_json  # noqa: E402
from prism.app.netprofile import usable_cores  # noqa: E402
from prism.validation.cpunoise import host_pressure, pressure_delta  # noqa: E402


def _spin(seconds: float) -> float:
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n / seconds


def spin_levels(cores: int, seconds: float) -> list[dict]:
    levels = sorted({1, max(1, cores // 2), cores})
    out = []
    alone = None
    ctx = mp.get_context("spawn")
    for k in levels:
        h0 = host_pressure()
        with ctx.Pool(k) as pool:
            rates = pool.map(_spin, [seconds] * k)
        host = pressure_delta(h0, host_pressure())
        alone = alone or max(rates)
        out.append({"processes": k, "min_rate": min(rates) / alone, "max_rate": max(rates) / alone, "host": host})
    return out


def gloo(cores: int) -> list[dict]:
    from prism.app.netprofile import measure

    sizes = [1024, 1 << 20]
    rows = []
    plan = [("alone", None), ("alone again", None)]
    if cores >= 4:
        plan.append((f"{cores // 2 * 2} at once", cores // 2 * 2))
    for label, concurrent in plan:
        for p in measure(sizes, [2], ["all_reduce"], concurrent=concurrent, timeout=120):
            rows.append({"how": label, "nbytes": p.nbytes, "us": p.seconds * 1e6,
                         "median_member_us": None if p.median_rank_seconds is None else p.median_rank_seconds * 1e6})
    return rows


def verdict(spin: list[dict], calls: list[dict], cores: int) -> list[str]:
    bad = []
    for s in spin:
        if (s["host"]["nr_throttled"] or 0) > 0:
            bad.append(f"the cgroup's CPU quota ({s['host']['cpu_max']}) throttled {s['host']['nr_throttled']} "
                       f"times with {s['processes']} processes spinning")
        if s["processes"] < cores and s["min_rate"] < 0.8:
            bad.append(f"with {s['processes']} of {cores} cores busy the slowest process ran at "
                       f"{s['min_rate']:.0%} of one alone")
    for nbytes in sorted({c["nbytes"] for c in calls}):
        twice = [c["us"] for c in calls if c["nbytes"] == nbytes and c["how"].startswith("alone")]
        if len(twice) == 2 and max(twice) > 1.25 * min(twice):
            bad.append(f"a {nbytes}-byte gloo all_reduce of 2 took {twice[0]:.0f} us, then {twice[1]:.0f} us "
                       "measured again alone (over 25% apart)")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spin-s", type=float, default=3.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.spin_s <= 0:
        ap.error("--spin-s must be more than 0")
    cores = usable_cores()
    spin = spin_levels(cores, a.spin_s)
    calls = gloo(cores)
    print(f"{'spinning':>9} {'slowest':>8} {'fastest':>8} {'throttled':>10} {'steal':>6} {'CPU pressure':>13}")
    for s in spin:
        h = s["host"]
        print(f"{s['processes']:>9} {s['min_rate']:>8.2f} {s['max_rate']:>8.2f} {str(h['nr_throttled']):>10} "
              f"{str(h['steal_ticks']):>6} {str(h['psi_some_us']) + ' us':>13}")
    print(f"\n{'gloo all_reduce of 2':<22} {'bytes':>8} {'slowest us':>11} {'median us':>10}")
    for c in calls:
        med = "" if c["median_member_us"] is None else f"{c['median_member_us']:.0f}"
        print(f"{c['how']:<22} {c['nbytes']:>8} {c['us']:>11.0f} {med:>10}")
    bad = verdict(spin, calls, cores)
    print("\nverdict: " + ("quiet enough" if not bad else "; ".join(bad)))
    doc = {"benchmark": "host_check", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"node": platform.node(), "cores": cores, "python": platform.python_version(),
                       "quota": spin[0]["host"]["cpu_max"]},
           "command": " ".join(["python", "bench/host_check.py", *sys.argv[1:]]),
           "spin": spin, "gloo": calls, "verdict": bad}
    write_json(a.out or result_path("host_check"), doc)


if __name__ == "__main__":
    main()
