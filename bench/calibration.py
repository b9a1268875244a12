"""Slice calibration against CPU ground truth: bare, calibrated and symmetric-calibrated predictions.

For each configuration of the bundled GPT, runs alternately (truth, prism,
truth, prism, ...; docs/DESIGN.md, Validation):

truth
    the unmodified workload over gloo, one process per rank, one torch thread
    each, under the step clock (``bench/accuracy.py``'s ``run_truth``).
prism
    ``prism capture`` (``--capture-slots`` ranks computing at once, on
    ``--capture-cores`` cores: fewer cores than slots makes ranks share cores,
    the context-switched capture whose compute timing calibration is meant to
    clean), then three predictions of that one capture under one gloo profile
    (``--profile``, fitted as in ``bench/accuracy.py``):

    - *bare*: the capture's graph as it is (``prism predict``);
    - *calibrated*: after ``prism calibrate`` (default slices: the TP groups),
      every rank's durations measured in its slice (``--calibration on``);
    - *symmetric*: after ``prism calibrate --symmetric``: one slice per class
      of equivalent ranks (same TP rank and PP stage), copied to the class.

Per configuration it prints the truth's mean iteration time and noise floor,
each prediction's mean, median paired error |pred - truth| / truth (signed
median) and 95% bootstrap CI, the symmetric calibration's error beside the
full one's (what symmetry costs) and the calibrations' wall time; writes
``bench/results/calibration-DATE[-MACHINE].json`` (machine, versions, date,
command, every run's numbers).

Fair ground truth needs one core per rank: ``--world`` may not exceed the
cores unless ``--oversubscribe`` (the 2-core VM: then the truth itself shares
cores and the figures only show that the pipeline runs). On the H200
machine's 16 cores:

    python bench/calibration.py --world 8 --runs 3
    python bench/calibration.py --world 16 --runs 3
    python bench/calibration.py --world 16 --runs 3 --capture-cores 4 --capture-slots 16   # a polluted capture
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _results import result_path, write_json  # noqa: E402  (bench/ is this script's folder, on sys.path)
from accuracy import _stats, command, ensure_profile, mean_iteration, run_truth  # noqa: E402
from prism.app.calibrate import CalibrateConfig, calibrate  # noqa: E402
from prism.app.capture import capture_run  # noqa: E402
from prism.app.netprofile import usable_cores  # noqa: E402
from prism.app.predict import PredictConfig, predict  # noqa: E402
from prism.validation.affinity import on_cpus  # noqa: E402
from prism.validation.keep import keep_capture  # noqa: E402

CONFIGS: dict[int, dict[str, list[str]]] = {
    2: {"gpt-tp2": ["--tp", "2"]},
    4: {"gpt-tp2-dp2": ["--tp", "2", "--dp", "2"], "gpt-tp2-pp2": ["--tp", "2", "--pp", "2"]},
    8: {"gpt-tp2-pp2-dp2": ["--tp", "2", "--pp", "2", "--dp", "2"], "gpt-tp2-dp4": ["--tp", "2", "--dp", "4"]},
    16: {"gpt-tp2-pp2-dp4": ["--tp", "2", "--pp", "2", "--dp", "4"], "gpt-tp4-dp4": ["--tp", "4", "--dp", "4"]},
}
#: The calibrated variants ``--variants`` chooses from: (symmetric, packed, keep_clean).
#: ``replace-clean``: every CPU segment replaced, also those the capture ran
#: undisturbed (``prism calibrate --replace-clean``, the rule before PrismTrace 1.4).
#: ``packed-replace``: packed slices, every CPU segment replaced.
CALIBRATIONS = {"calibrated": (False, False, True), "symmetric": (True, False, True), "packed": (False, True, True),
                "replace-clean": (False, False, False), "packed-replace": (False, True, False)}
VARIANTS = ("bare", "calibrated", "symmetric")  # bare and --variants (set in main)


def run_prism(world: int, cmd: list[str], tmp: pathlib.Path, profile: str, slots: int, cores: list[int],
              slice_cores: int, slices: str, warmup: int, keep: tuple[str, str] | None = None) -> dict:
    d = pathlib.Path(tempfile.mkdtemp(prefix="prism-", dir=tmp)) / "run"
    t0 = time.monotonic()
    with on_cpus(cores):  # the capture's ranks inherit it; every thread gets its own CPUs back after
        status = capture_run(d, world, cmd, slots=slots, show_ranks=(), progress="off").exit_code
    if status != 0:
        raise RuntimeError(f"prism capture failed with status {status}; logs in {d / 'logs'}")
    out: dict = {"capture_wall_s": time.monotonic() - t0}
    if keep is not None:  # the capture's graph, before the calibrations add theirs
        out["kept"] = keep_capture(d, *keep)
    bare = predict(PredictConfig(run=d, net=profile, warmup=warmup, calibration="off"))
    out["bare"] = {"step_ns": bare.result.iteration_times.tolist(), "mean_ns": bare.mean_iteration_ns}
    for name in VARIANTS[1:]:
        sym, pack, keep = CALIBRATIONS[name]
        t1 = time.monotonic()
        cal = calibrate(CalibrateConfig(run=d, slices=slices, symmetric=sym, pack=pack, name=name, net=profile,
                                        cores=slice_cores, warmup=warmup, keep_clean=keep))
        wall = time.monotonic() - t1
        p = predict(PredictConfig(run=d, net=profile, warmup=warmup, calibration=name))
        out[name] = {"step_ns": p.result.iteration_times.tolist(), "mean_ns": p.mean_iteration_ns,
                     "slices": cal.manifest["slices"], "classes": cal.manifest["classes"], "wall_s": wall,
                     "compute_ns": {r: (v["bare_compute_ns"], v["calibrated_compute_ns"])
                                    for r, v in cal.manifest["per_rank"].items()},
                     "segments_replaced_kept_clean": [sum(v["replaced"] for v in cal.manifest["per_rank"].values()),
                                                      sum(v["kept_clean"] for v in cal.manifest["per_rank"].values())],
                     # ns over all ranks: kept-clean segments as captured; replaced ones as captured, as measured
                     "ns_clean_replacedbare_replaced": [sum(v.get(k, 0) for v in cal.manifest["per_rank"].values())
                                                        for k in ("clean_ns", "replaced_bare_ns", "replaced_ns")]}
    shutil.rmtree(d.parent, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=8, help="ranks per run (at most the core count); default 8")
    ap.add_argument("--configs", default=None, help="comma-separated names (default: all for --world)")
    ap.add_argument("--runs", type=int, default=3, help="truth/prism pairs per configuration (default 3)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", default="measured",
                    help="gloo profile of bench/accuracy.py for every prediction: measured (prism netprofile's "
                         "default), per-op, one-fit or concurrent; or --net")
    ap.add_argument("--net", default=None, help="a cost profile file instead (as prism predict --net)")
    ap.add_argument("--slices", default="auto", help="prism calibrate --slices (default auto: the TP groups)")
    ap.add_argument("--capture-cores", type=int, default=None,
                    help="cores the capture's ranks may use (default: all); fewer than --capture-slots shares them")
    ap.add_argument("--capture-slots", type=int, default=None, help="prism capture --slots (default: the capture's "
                                                                     "cores)")
    ap.add_argument("--slice-cores", type=int, default=None,
                    help="prism calibrate --cores: most ranks a slice holds (default: the cores, at most --world)")
    ap.add_argument("--oversubscribe", action="store_true",
                    help="allow --world above the cores (the truth then shares cores: a smoke run, not a measurement)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per ground-truth run")
    ap.add_argument("--keep-runs", default=None, metavar="DIR",
                    help="keep each capture's graph (traces and manifest, no payloads) in DIR/CONFIG-K; each pair's "
                         "JSON names its folder (`kept`)")
    ap.add_argument("--out", default=str(result_path("calibration")))
    ap.add_argument("--variants", default="calibrated,packed,symmetric",
                    help="calibrations beside bare: calibrated (calibrate --no-pack: one slice at a time), "
                         "symmetric (--symmetric --no-pack), packed (calibrate's default: slices run together up to "
                         "the slice cores), replace-clean (--no-pack --replace-clean), packed-replace (--replace-clean);"
                         " default calibrated,packed,symmetric")
    a = ap.parse_args()
    global VARIANTS
    chosen = [v for v in a.variants.split(",") if v]
    bad = [v for v in chosen if v not in CALIBRATIONS]
    if bad or not chosen:
        sys.exit(f"--variants: {','.join(bad) or 'none given'}; choose from {', '.join(CALIBRATIONS)}")
    VARIANTS = ("bare", *chosen)
    ncores = usable_cores()
    if a.world > ncores and not a.oversubscribe:
        sys.exit(f"--world {a.world} exceeds the {ncores} cores: the ground truth would be oversubscribed and unfair "
                 "(--oversubscribe runs it anyway, as a smoke run)")
    if a.world not in CONFIGS:
        sys.exit(f"--world must be one of {sorted(CONFIGS)}")
    names = a.configs.split(",") if a.configs else list(CONFIGS[a.world])
    unknown = [n for n in names if n not in CONFIGS[a.world]]
    if unknown:
        sys.exit(f"unknown config {unknown[0]!r} for --world {a.world}; known: {', '.join(CONFIGS[a.world])}")
    all_cores = sorted(os.sched_getaffinity(0))
    cap_cores = all_cores[:a.capture_cores] if a.capture_cores else all_cores
    slots = a.capture_slots or len(cap_cores)
    slice_cores = a.slice_cores or min(ncores, a.world)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="prism-calibration-"))
    if a.net:
        profile, profile_name = a.net, a.net
    else:
        models, _, _ = ensure_profile(None, tmp, a.world)
        if a.profile not in models:
            sys.exit(f"--profile {a.profile!r}: choose one of {', '.join(models)}")
        profile, profile_name = str(tmp / f"profile-{a.profile}.toml"), a.profile
    import torch

    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out: dict = {
        "benchmark": "calibration", "date_utc": date, "command": "python " + " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "host": socket.gethostname(), "cpus": ncores,
                    "load_average_at_start": os.getloadavg()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
        "steps": a.steps, "warmup": a.warmup, "runs": a.runs, "profile": profile_name,
        "capture": {"cores": len(cap_cores), "slots": slots}, "slices": a.slices,
        "slice_cores": slice_cores,
        "oversubscribed_truth": a.world > ncores, "configs": [],
    }
    rows = []
    try:
        for name in names:
            cmd = command(CONFIGS[a.world][name], a.steps)
            truth, vals, pairs = [], {v: [] for v in VARIANTS}, []
            for i in range(a.runs):
                _, twall, ends = run_truth(a.world, cmd, tmp, a.timeout)
                t_mean = mean_iteration(ends, a.warmup)
                keep = (a.keep_runs, f"{name}-{i}") if a.keep_runs else None
                res = run_prism(a.world, cmd, tmp, profile, slots, cap_cores, slice_cores, a.slices, a.warmup, keep)
                truth.append(t_mean)
                for v in VARIANTS:
                    vals[v].append(res[v]["mean_ns"])
                pairs.append({"truth_mean_ns": t_mean, "truth_step_ns": np.diff(ends).tolist(), "truth_wall_s": twall,
                              **res})
                # every finished pair on disk at once: a run cut by its time bound keeps what it measured
                out["in_progress"] = {"config": name, "flags": CONFIGS[a.world][name], "runs": pairs}
                write_json(a.out, out, say=False)
                print(f"{name} run {i}: truth {t_mean / 1e6:.1f} ms, " + ", ".join(
                    f"{v} {res[v]['mean_ns'] / 1e6:.1f}" for v in VARIANTS)
                      + "  (" + "; ".join(f"{v} {res[v]['wall_s']:.0f} s, {len(res[v]['slices'])} slices"
                                          for v in VARIANTS[1:]) + ")", flush=True)
            cv = statistics.stdev(truth) / statistics.mean(truth) if len(truth) > 1 else float("nan")
            row = {"config": name, "flags": CONFIGS[a.world][name], "world": a.world,
                   "truth_mean_ms": statistics.mean(truth) / 1e6, "noise_floor_cv": cv,
                   "predicted": {v: _stats(truth, vals[v]) for v in VARIANTS},
                   "runs": pairs}
            for v in VARIANTS[1:]:
                key = "calibration_wall_s" if v == "calibrated" else f"{v}_wall_s"
                row[key] = statistics.mean(p[v]["wall_s"] for p in pairs)
            if "symmetric" in VARIANTS and "calibrated" in VARIANTS:
                row["symmetry_cost"] = (row["predicted"]["symmetric"]["median_error"]
                                        - row["predicted"]["calibrated"]["median_error"])
            out["configs"].append(row)
            out.pop("in_progress", None)
            rows.append(row)
            write_json(a.out, out, say=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"calibration: world {a.world}, {a.runs} interleaved truth/prism pairs, {a.steps} steps ({a.warmup} warm-up); "
          f"{date}, {socket.gethostname()} ({ncores} cores); capture on {len(cap_cores)} cores, {slots} slots; "
          f"profile {profile_name}; median paired error (signed median), 95% CI"
          + ("; TRUTH OVERSUBSCRIBED (a smoke run)" if a.world > ncores else ""))
    print(f"{'config':<18} {'truth ms':>9} {'noise CV':>9} " + " ".join(f"{c:>26}" for c in VARIANTS)
          + f" {'symmetry costs':>15} " + " ".join(f"{v[:9] + ' s':>11}" for v in VARIANTS[1:]))
    for r in rows:
        cells = [r["predicted"][v] for v in VARIANTS]
        print(f"{r['config']:<18} {r['truth_mean_ms']:>9.1f} {r['noise_floor_cv']:>9.1%} " + " ".join(
            f"{c['mean_ms']:>7.1f} {c['median_error']:>6.1%} ({c['median_signed_error']:+.1%}) "
            f"{c['error_ci95'][0]:.0%}-{c['error_ci95'][1]:.0%}".rjust(26) for c in cells)
              + (f" {r['symmetry_cost']:>+15.1%} " if "symmetry_cost" in r else f" {'-':>15} ")
              + " ".join(f"{r['calibration_wall_s' if v == 'calibrated' else v + '_wall_s']:>11.0f}"
                         for v in VARIANTS[1:]))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
