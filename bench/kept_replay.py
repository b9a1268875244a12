"""Replays kept CPU captures (``accuracy.py`` / ``calibration.py
--keep-runs``) under one or more cost profiles and compares each with the
truth measured beside it. No GPU, seconds: the offline loop for the gloo
model (issue 19) that ``two_clock_check.py`` is for the GPU captures.

    python bench/kept_replay.py RESULT.json [RESULT.json ...] --kept DIR \\
        [--net PROFILE[,PROFILE...] | --blend W[,W...]] [--json OUT.json]

``RESULT.json``: a benchmark's JSON whose pairs name their kept capture
(``kept``); ``--kept``: the folder given to ``--keep-runs`` (default: a
``keep`` folder beside each JSON). ``--net``: profile files or bundled names
(default: the one the benchmark used, from its JSON); ``--blend``: profiles
between the JSON's isolated and concurrent gloo points (geometric, weight W
on the concurrent ones; and the concurrent points' median member where
measured). Per pair it prints the
truth, each profile's prediction and its error; per config and profile the
median |error| (signed median) and its 95% bootstrap CI.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _results import write_json  # noqa: E402  (bench/ is this script's folder, on sys.path)
from accuracy import bootstrap_median_ci  # noqa: E402
from prism.app.errors import PrismError  # noqa: E402
from prism.app.predict import PredictConfig, predict  # noqa: E402


def _pairs(doc: dict):
    """(config, index, pair) for every pair of an accuracy or calibration JSON, finished or in progress."""
    rows = list(doc.get("configs") or [])
    if doc.get("in_progress"):
        rows.append(doc["in_progress"])
    for row in rows:
        for i, pair in enumerate(row.get("runs") or []):
            yield row["config"], i, pair


def _profile_of(doc: dict) -> str | None:
    """The profile file the benchmark predicted with, where its JSON names one."""
    prof = doc.get("profile") or doc.get("cost_profile") or {}
    return prof.get("path") if isinstance(prof, dict) else prof


def blend_profiles(doc: dict, weights: list[float], world: int, folder: pathlib.Path) -> list[str]:
    """Profile files from an accuracy JSON's measured gloo points: per weight
    w, each point's time the geometric blend isolated^(1-w) x concurrent^w
    (0: the isolated ``measured`` profile, 1: ``concurrent``), fitted per op
    and corrected to the blended points as accuracy.py's profiles are; and,
    where the JSON has them, the concurrent points' median member's times
    (``concurrent-median``)."""
    import math

    from prism.core.netfit import Point, fit_per_op, fit_points, profile_toml

    mp = doc.get("measured_points") or {}
    iso = {(p["op"], p["n"], p["nbytes"]): p for p in mp.get("isolated") or []}
    con = {(p["op"], p["n"], p["nbytes"]): p for p in mp.get("concurrent") or []}
    if not iso or not con:
        sys.exit("kept_replay: --blend needs the benchmark JSON's measured_points (isolated and concurrent)")
    kw = dict(host="blend", backend="gloo", ranks_per_node=max(p["n"] for p in iso.values()),
              command="bench/kept_replay.py --blend", date=doc.get("date_utc") or "")
    def blend(k: tuple, p: dict, w: float) -> float:
        if k not in con or not w:
            return p["seconds"]
        return math.exp((1 - w) * math.log(p["seconds"]) + w * math.log(con[k]["seconds"]))

    sets = {f"{w:g}": [Point(p["op"], p["n"], p["nbytes"], blend(k, p, w)) for k, p in iso.items()]
            for w in weights}
    if all(p.get("median_rank_seconds") is not None for p in con.values()):
        sets["concurrent-median"] = [Point(p["op"], p["n"], p["nbytes"], p["median_rank_seconds"])
                                     for p in con.values()]
    paths = []
    for name, pts in sets.items():
        f = folder / f"blend-w{world}-{name}.toml"
        f.write_text(profile_toml(fit_points(pts), pts, per_op=fit_per_op(pts), **kw))
        paths.append(str(f))
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="accuracy or calibration JSON files whose pairs name a kept capture")
    ap.add_argument("--kept", default=None, help="the --keep-runs folder (default: keep/ beside each JSON)")
    ap.add_argument("--net", default=None, help="comma-separated profiles (default: the benchmark's own)")
    ap.add_argument("--comm", default="model", metavar="model|measured|both|NAME[,NAME...]",
                    help="communication times: the profiles' (model), the kept capture's newest in-situ ones "
                         "(measured: `prism commtime`, kept by accuracy.py --in-situ), both side by side, or a "
                         "comma-separated list of those and stored measurements' names (e.g. "
                         "model,spin,sleep: `prism commtime RUN --name sleep` with PRISM_SKELETON_COMPUTE=sleep)")
    ap.add_argument("--blend", default=None, metavar="W[,W...]",
                    help="instead of --net: profiles blended from the JSON's measured points, isolated^(1-W) x "
                         "concurrent^W per point (0 = measured, 1 = concurrent; e.g. 0,0.5,1), and the concurrent "
                         "points' median member where measured")
    ap.add_argument("--json", default=None, help="write every pair's figures here")
    a = ap.parse_args()
    if a.blend and a.net:
        sys.exit("kept_replay: give --net or --blend, not both")
    try:
        weights = [float(w) for w in a.blend.split(",")] if a.blend else []
    except ValueError:
        sys.exit(f"kept_replay: --blend {a.blend!r}: give comma-separated weights between 0 and 1")
    if any(not 0 <= w <= 1 for w in weights):
        sys.exit(f"kept_replay: --blend {a.blend!r}: every weight must lie between 0 and 1")
    import tempfile

    blend_dir = pathlib.Path(tempfile.mkdtemp(prefix="kept-replay-")) if weights else None

    rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
    out = []
    for path in a.results:
        p = pathlib.Path(path)
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            sys.exit(f"kept_replay: cannot read {p}: {e}")
        kept_root = pathlib.Path(a.kept) if a.kept else p.parent / "keep"
        world = int(((doc.get("configs") or [{}])[0]).get("world") or 0)
        nets = (blend_profiles(doc, weights, world, blend_dir) if weights
                else a.net.split(",") if a.net else [_profile_of(doc)])
        if nets == [None]:
            sys.exit(f"kept_replay: {p} names no profile; pass --net")
        warmup = int(doc.get("warmup") or 2)
        for config, i, pair in _pairs(doc):
            if not pair.get("kept"):
                continue
            run = kept_root / pair["kept"]
            if not run.is_dir():
                sys.exit(f"kept_replay: {p}: pair {i} of {config} was kept as {run}, which is not there; pass "
                         "--kept with the --keep-runs folder")
            truth = float(pair["truth_mean_ns"])
            line = {"result": str(p), "config": config, "pair": i, "kept": pair["kept"], "truth_ns": truth}
            comms = [c for part in a.comm.split(",") if part.strip()
                     for c in (("model", "measured") if part.strip() == "both" else (part.strip(),))]
            for net in nets:
                for comm in comms:
                    key = net if comm == "model" else f"{net}+in-situ" if comm == "measured" else f"{net}+{comm}"
                    try:
                        pred = predict(PredictConfig(run=run, net=net, warmup=warmup, calibration="off",
                                                     comm=comm)).mean_iteration_ns
                    except PrismError as e:
                        sys.exit(f"kept_replay: {run} under {net} (--comm {comm}): {e} (pass --net with a profile "
                                 "file; in-situ times need a capture kept by accuracy.py --in-situ, or one timed "
                                 "with `prism commtime RUN --name NAME`)")
                    line[key] = pred
                    rows.setdefault((config, key), []).append((truth, pred))
            keys = [k for k in line if k not in ("result", "config", "pair", "kept", "truth_ns")]
            out.append(line)
            print(f"{config} pair {i}: truth {truth / 1e6:.1f} ms, " + ", ".join(
                f"{pathlib.Path(n).name} {line[n] / 1e6:.1f} ({line[n] / truth - 1:+.1%})" for n in keys), flush=True)
    if not out:
        sys.exit("kept_replay: no pair names a kept capture (run the benchmark with --keep-runs DIR)")
    print()
    print(f"{'config':<20} {'profile':<44} {'pairs':>5} {'median |err|':>12} {'signed':>8} {'95% CI':>12}")
    summary = []
    for (config, net), vals in rows.items():
        errs = [abs(p - t) / t for t, p in vals]
        signed = statistics.median((p - t) / t for t, p in vals)
        lo, hi = bootstrap_median_ci(errs)
        summary.append({"config": config, "profile": net, "pairs": len(vals), "median_error": statistics.median(errs),
                        "median_signed_error": signed, "error_ci95": [lo, hi]})
        print(f"{config:<20} {pathlib.Path(net).name[:44]:<44} {len(vals):>5} {statistics.median(errs):>12.1%} "
              f"{signed:>+8.1%} {lo:>5.0%}-{hi:.0%}")
    if a.json:
        write_json(a.json, {"pairs": out, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
