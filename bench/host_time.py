"""Where a GPU sandbox's device-path calls spend their host time: on the CPU,
or waiting off it (the GIL, a lock, the driver), stage by stage.

    python bench/host_time.py CALLS.jsonl [CALLS.jsonl ...] [--skip 0.25] [--json OUT]
    python bench/host_time.py bench/results/gpu_sandbox-2026-12-07-h100-nativepool-calllogs.json.gz:B/calls-gpt-tp2-rec-r0.jsonl

Reads the call logs ``PRISM_DEVICE_CALL_LOG`` writes (``bench/device.sh``'s
``CALLLOG=1``; a ``BUNDLE.json.gz:NAME`` names one kept in ``bench/results``).
Per log, over the calls after the first ``--skip`` fraction (the warm-up):
each stage's median wall time and median CPU time of the program's thread
(``time.thread_time_ns`` at each moment: ``c_msg`` beside ``t_msg`` ...),
the whole call's, and its voluntary and involuntary context switches
(``getrusage(RUSAGE_THREAD)`` at the record and at the return). Wall well
above CPU with voluntary switches: the thread slept (the GIL handed to
another thread, a futex in the driver); CPU as high as wall: the work
itself (or a spinning driver call) is slow. Where the log has its
``.threads.json`` beside it, each thread's CPU time over the logged calls.

The release's round trip (a collective released at its reach, the default):
from the GPU's reach to the flag's flip, by leg, where the coordinator's side
(``...-rcoord.jsonl`` beside a ``-r0`` log, or ``--coord LOG``) was written:
the watcher seeing the reach, its ``Reached`` handed to the transport, taken
by the coordinator, its result sent, the flip on the rank; and how late the
flip came past the release's due moment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import write_json  # noqa: E402
from late_carry import read_calls  # noqa: E402

#: (label, start moment, end moment); the CPU key of moment ``t_x`` is ``c_x``, of ``f_x`` ``cf_x``.
STAGES = [
    ("entry -> record (wall only)", "t0", "t_rec"),
    ("   (entry -> device path, wall)", "t0", "t_on"),
    ("   (releaser, feed)", "t_on", "t_feed"),
    ("   (message, op made)", "t_feed", "t_op"),
    ("   (stream query, charge)", "t_op", "t_rec"),
    ("record -> message", "t_rec", "t_msg"),
    ("-> sent", "t_msg", "t_sent"),
    ("-> release wait queued", "t_sent", "t_wait"),
    ("-> outputs queued", "t_wait", "t_out"),
    ("   (feed: lock taken)", "t_wait", "f_lock"),
    ("   (feed: fills ahead)", "f_lock", "f_adv0"),
    ("   (feed: copy queued)", "f_adv0", "f_copy"),
    ("   (feed: fills after)", "f_copy", "f_adv1"),
    ("-> return (and its bookkeeping)", "t_out", "t_ret"),
    ("whole call (record -> return)", "t_rec", "t_ret"),
]


def cpu_key(moment: str) -> str:
    return "c" + moment[1:] if moment.startswith("t_") else "c" + moment


def stage_table(rows: list[dict], skip: float) -> dict:
    calls = [r for r in rows if r.get("op") not in ("send",) and "t_rec" in r and "c_ret" in r]
    calls = calls[int(len(calls) * skip):]
    out: dict = {"calls": len(calls), "stages": []}
    for label, a, b in STAGES:
        have = [r for r in calls if a in r and b in r]
        if not have:
            continue
        wall = [(r[b] - r[a]) / 1e3 for r in have]
        cpu = [(r[cpu_key(b)] - r[cpu_key(a)]) / 1e3 for r in have if cpu_key(a) in r and cpu_key(b) in r]
        out["stages"].append({"stage": label, "n": len(have), "wall_us_p50": statistics.median(wall),
                              "cpu_us_p50": statistics.median(cpu) if cpu else None,
                              "wall_us_mean": statistics.fmean(wall),
                              "cpu_us_mean": statistics.fmean(cpu) if cpu else None})
    if calls:
        vol = [r["v1"] - r["v_rec"] for r in calls]
        inv = [r["i1"] - r["i_rec"] for r in calls]
        out["voluntary_switches_per_call"] = {"p50": statistics.median(vol), "mean": statistics.fmean(vol)}
        out["involuntary_switches_per_call"] = {"p50": statistics.median(inv), "mean": statistics.fmean(inv)}
        out["span_s"] = (calls[-1]["t_ret"] - calls[0]["t_rec"]) / 1e9
    return out


#: (label, start, end) of the release's round trip; ``c_in``/``c_out`` are the coordinator's.
TRIP = [
    ("reach -> watcher saw it", "reach", "t_seen"),
    ("-> Reached handed to the transport", "t_seen", "t_rsent"),
    ("-> taken by the coordinator", "t_rsent", "c_in"),
    ("-> result sent by the coordinator", "c_in", "c_out"),
    ("-> flag flipped on the rank", "c_out", "t_flip"),
    ("reach -> flip (the round trip)", "reach", "t_flip"),
    ("due -> flip (lateness)", "due", "t_flip"),
]


def coord_log_of(path: str) -> str | None:
    """The coordinator's log beside a rank's (``calls-X-r0.jsonl`` -> ``calls-X-rcoord.jsonl``;
    in a bundle, ``BUNDLE.json.gz:.../calls-X-rcoord.jsonl``, read whether or not it is there)."""
    head, sep, tail = path.rpartition("-r")
    if not sep or not tail.split(".")[0].isdigit():
        return None
    side = f"{head}-rcoord.jsonl"
    return side if ".json.gz:" in path or os.path.exists(side) else None


def trip_table(rows: list[dict], coord: list[dict] | None, skip: float, rank: int = 0) -> dict:
    """Per leg of the release's round trip, p50 and p90 (us) over the calls after ``skip``."""
    by_key = {(c["rank"], c["gid"], c["seq"]): c for c in coord or [] if c.get("rank") == rank}
    calls = [r for r in rows if r.get("op") not in ("send", "recv") and "reach" in r and "t_flip" in r]
    calls = calls[int(len(calls) * skip):]
    merged = []
    for r in calls:
        c = by_key.get((rank, r.get("gid"), r.get("seq")))
        merged.append({**r, **({"c_in": c["c_in"], "c_out": c["c_out"]} if c and c.get("c_in") else {})})
    out: dict = {"calls": len(merged), "with_coordinator": sum("c_in" in m for m in merged), "legs": []}
    for label, a, b in TRIP:
        d = sorted((m[b] - m[a]) / 1e3 for m in merged if m.get(a) and m.get(b))
        if d:
            out["legs"].append({"leg": label, "n": len(d), "p50_us": statistics.median(d),
                                "p90_us": d[int(0.9 * (len(d) - 1))]})
    return out


def read_threads(path: str) -> list[dict] | None:
    import gzip

    bundle, _, name = path.partition(".json.gz:")
    if name:
        with gzip.open(bundle + ".json.gz", "rt") as f:
            logs = json.load(f)
        doc = logs.get(name + ".threads.json")
        return json.loads(doc) if isinstance(doc, str) else doc
    side = path.removesuffix(".gz") + ".threads.json"
    if os.path.exists(side):
        with open(side) as f:
            return json.load(f)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--skip", type=float, default=0.25, help="the fraction of calls left out at the start")
    ap.add_argument("--coord", help="the coordinator's log (default: the -rcoord.jsonl beside each)")
    ap.add_argument("--json", help="write the tables here")
    a = ap.parse_args()
    doc = {}
    for path in a.logs:
        try:
            rows = read_calls(path)
        except (OSError, ValueError, KeyError) as e:
            print(f"host_time: cannot read {path}: {e}", file=sys.stderr)
            return 2
        t = stage_table(rows, a.skip)
        t["threads"] = read_threads(path)
        cpath = a.coord or coord_log_of(path)
        coord = None
        if cpath:
            try:
                coord = read_calls(cpath)
            except (OSError, ValueError, KeyError):
                coord = None
        t["round_trip"] = trip_table(rows, coord, a.skip)
        doc[path] = t
        print(f"\n{path}: {t['calls']} calls after the first {a.skip:.0%}")
        if not t["calls"]:
            print("  (no call carries the CPU marks: a log from before 2026-12-07's host-time fields)")
            continue
        print(f"  {'stage':34s} {'wall p50':>9s} {'cpu p50':>9s} {'wall mean':>10s} {'cpu mean':>9s}  (us)")
        def num(x: float | None, w: int) -> str:
            return f"{x:{w}.1f}" if x is not None else f"{'-':>{w}s}"

        for s in t["stages"]:
            print(f"  {s['stage']:34s} {num(s['wall_us_p50'], 9)} {num(s['cpu_us_p50'], 9)} "
                  f"{num(s['wall_us_mean'], 10)} {num(s['cpu_us_mean'], 9)}")
        v, i = t["voluntary_switches_per_call"], t["involuntary_switches_per_call"]
        print(f"  context switches a call: voluntary p50 {v['p50']:g} (mean {v['mean']:.1f}), "
              f"involuntary p50 {i['p50']:g} (mean {i['mean']:.1f})")
        if t["threads"]:
            span = t["span_s"]
            print(f"  threads' CPU from the first logged call to the end ({span:.2f} s of calls):")
            for th in t["threads"][:10]:
                print(f"    {th['name'][:32]:32s} {th['cpu_ns'] / 1e6:9.1f} ms ({th['cpu_ns'] / 1e9 / span:6.1%})"
                      f"  voluntary {th['vcsw']:7d}  involuntary {th['ivcsw']:6d}")
        rt = t["round_trip"]
        if rt["legs"]:
            print(f"  the release's round trip ({rt['calls']} calls, {rt['with_coordinator']} with the "
                  f"coordinator's side), us:")
            for leg in rt["legs"]:
                print(f"    {leg['leg']:38s} p50 {leg['p50_us']:9.1f}  p90 {leg['p90_us']:9.1f}")
    if a.json:
        write_json(a.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
