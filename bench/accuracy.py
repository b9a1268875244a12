"""Ground truth vs Prism: iteration-time error of ``prism capture`` + ``predict``.

For each configuration (a layout of the bundled GPT or MoE), runs alternately
(truth, prism, truth, prism, ...; docs/DESIGN.md: CPU ground truth is noisy, so
pairs are interleaved and many steps taken):

truth
    the unmodified workload with plain torch.distributed (gloo), one process
    per rank, one torch thread each, through ``prism.shell.launcher.launch_ranks``
    with ``endpoint=None``. The script is run by the step clock
    (``prism/validation/stepclock.py``),
    which registers a global optimizer step post-hook that logs
    CLOCK_MONOTONIC (one clock for the host) per rank per step. The job's
    step k ends when the last rank's optimizer step k returns; the iteration
    time is the gap between consecutive job step ends; the run's mean drops
    ``--warmup`` steps.
prism
    ``prism.app.capture.capture_run`` with ``--slots`` = the core count (durations
    measured without oversubscription), then the graph replayed with the
    gloo profile fitted by ``prism netprofile`` on this host (fitted first if
    there is none), mean over the same steps.

Per configuration it prints the truth's mean iteration time and its noise
floor (coefficient of variation of the per-run means), Prism's mean
prediction, and the median paired error |pred - truth| / truth with a 95%
bootstrap CI over runs; writes ``bench/results/accuracy-DATE[-MACHINE].json`` (machine,
versions, date, command, every run's numbers).

Fair ground truth needs one core per rank: ``--world`` may not exceed the
cores. Here (2 cores) ``--world 2``; on a 16-core machine
``--world 8`` runs the GPT in two layouts and the MoE
(``python bench/accuracy.py --world 8 --runs 3``, under 10 minutes there).
``--quick`` takes fewer runs and steps.
"""

from __future__ import annotations

import argparse
import json
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

from prism.app.capture import capture_run  # noqa: E402
from prism.shell.profiles import load_profile  # noqa: E402
from prism.core.graph import ExecutionGraph  # noqa: E402
from prism.core.replay import replay_batch  # noqa: E402
from prism.shell.runfolder import read_run  # noqa: E402
from prism.shell.launcher import launch_ranks  # noqa: E402
from prism.validation import stepclock  # noqa: E402
from prism.validation.truthrun import STEPCLOCK  # noqa: E402

from _results import result_path  # noqa: E402  (bench/ is this script's folder, on sys.path)
from prism.app.netprofile import DEFAULT_OPS, DEFAULT_SIZES, fitted_profile_path, measure, usable_cores  # noqa: E402
from prism.core.netfit import fit_points, profile_toml  # noqa: E402

#: Model size: an iteration of about 50-200 ms per rank on one core.
MODEL = ["--hidden", "128", "--layers", "2", "--heads", "4", "--seq-len", "64", "--batch", "4",
         "--micro-batches", "2"]
CONFIGS: dict[int, dict[str, list[str]]] = {
    2: {
        "gpt-tp2": ["--tp", "2"],
        "gpt-dp2": ["--dp", "2"],
        "gpt-pp2": ["--pp", "2"],
    },
    8: {
        "gpt-tp2-pp2-dp2": ["--tp", "2", "--pp", "2", "--dp", "2"],
        "gpt-tp2-dp4": ["--tp", "2", "--dp", "4"],
        "moe-tp2-dp4-ep2": ["--tp", "2", "--dp", "4", "--ep", "2", "--experts", "4"],
    },
}


def command(flags: list[str], steps: int) -> list[str]:
    return ["-m", "prism.workloads.gpt", *flags, *MODEL, "--steps", str(steps)]


def job_step_ends(per_rank: list[list[int]]) -> np.ndarray:
    """The job's step-end times: per step, the last rank's."""
    steps = min(len(r) for r in per_rank)
    return np.max(np.array([r[:steps] for r in per_rank], dtype=np.int64), axis=0)


def mean_iteration(ends: np.ndarray, warmup: int) -> float:
    """Mean time from the end of step warmup-1 to the end of the last step, per step (ns)."""
    if len(ends) <= warmup or warmup < 1:
        raise ValueError(f"need more than {warmup} steps (and warmup >= 1) to measure, got {len(ends)}")
    return float(ends[-1] - ends[warmup - 1]) / (len(ends) - warmup)


def run_truth(world: int, cmd: list[str], tmp: pathlib.Path, timeout: float) -> tuple[np.ndarray, float, np.ndarray]:
    d = pathlib.Path(tempfile.mkdtemp(prefix="truth-", dir=tmp))
    t0 = time.monotonic()
    h = launch_ranks(world, None, d, [STEPCLOCK, *cmd], env={"PRISM_STEPCLOCK_DIR": str(d), "OMP_NUM_THREADS": "1"},
                     show_ranks=())
    codes = h.wait(timeout=timeout)
    if any(c != 0 for c in codes):
        h.close()
        raise RuntimeError(f"ground-truth run failed (exit codes {codes}); logs in {d / 'logs'}")
    per_rank = []
    for r in range(world):
        per_rank.append(stepclock.parse((d / f"rank-{r}.txt").read_text())[0])
    wall = time.monotonic() - t0
    shutil.rmtree(d, ignore_errors=True)
    ends = job_step_ends(per_rank)
    return np.diff(ends), wall, ends


def run_prism(world: int, cmd: list[str], tmp: pathlib.Path, model, slots: int, warmup: int):
    d = pathlib.Path(tempfile.mkdtemp(prefix="prism-", dir=tmp)) / "run"
    t0 = time.monotonic()
    status = capture_run(d, world, cmd, slots=slots, show_ranks=(), progress="off").exit_code
    if status != 0:
        raise RuntimeError(f"prism capture failed with status {status}; logs in {d / 'logs'}")
    wall = time.monotonic() - t0
    res = replay_batch(ExecutionGraph.from_events(read_run(d).ranks), cost_model=model)
    shutil.rmtree(d.parent, ignore_errors=True)
    return res.iteration_times, res.mean_iteration_time(warmup), wall


def bootstrap_median_ci(x: list[float], reps: int = 4000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    a = np.asarray(x)
    meds = np.median(a[rng.integers(0, len(a), (reps, len(a)))], axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def ensure_profile(net: str | None) -> tuple[object, str]:
    if net:
        return load_profile(net), net
    path = fitted_profile_path("gloo", socket.gethostname())
    if not path.is_file():
        print(f"no fitted gloo profile at {path}: running prism netprofile first", flush=True)
        cores = usable_cores()
        gs = [n for n in (2, 4, 8, 16) if n <= cores] or [2]
        points = measure(DEFAULT_SIZES, gs, DEFAULT_OPS)
        text = profile_toml(fit_points(points), points, host=socket.gethostname(), backend="gloo",
                            ranks_per_node=cores, command="bench/accuracy.py (prism netprofile defaults)",
                            date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return load_profile(path), str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks per run (at most the core count); default 2")
    ap.add_argument("--configs", default=None, help="comma-separated names (default: all for --world)")
    ap.add_argument("--runs", type=int, default=4, help="truth/prism pairs per configuration (default 4)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="2 runs of 6 steps")
    ap.add_argument("--net", default=None, help="cost profile (default: the fitted gloo profile of this host)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per ground-truth run")
    ap.add_argument("--out", default=str(result_path("accuracy")))
    a = ap.parse_args()
    if a.quick:
        a.runs, a.steps = 2, 6
    cores = usable_cores()
    if a.world > cores:
        sys.exit(f"--world {a.world} exceeds the {cores} cores: the ground truth would be oversubscribed and unfair")
    if a.world not in CONFIGS:
        sys.exit(f"--world must be one of {sorted(CONFIGS)}")
    names = a.configs.split(",") if a.configs else list(CONFIGS[a.world])
    unknown = [n for n in names if n not in CONFIGS[a.world]]
    if unknown:
        sys.exit(f"unknown config {unknown[0]!r} for --world {a.world}; known: {', '.join(CONFIGS[a.world])}")
    model, profile_path = ensure_profile(a.net)
    import torch

    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out: dict = {
        "benchmark": "accuracy",
        "date_utc": date,
        "command": "python " + " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "host": socket.gethostname(), "cpus": cores,
                    "load_average_at_start": os.getloadavg()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
        "model_flags": MODEL, "steps": a.steps, "warmup": a.warmup, "runs": a.runs,
        "cost_profile": {"path": profile_path, "name": model.name, "description": model.description},
        "slots": cores, "configs": [],
    }
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="prism-accuracy-"))
    rows = []
    try:
        for name in names:
            cmd = command(CONFIGS[a.world][name], a.steps)
            truth, pred, pairs = [], [], []
            for i in range(a.runs):
                times, twall, ends = run_truth(a.world, cmd, tmp, a.timeout)
                t_mean = mean_iteration(ends, a.warmup)
                ptimes, p_mean, pwall = run_prism(a.world, cmd, tmp, model, cores, a.warmup)
                truth.append(t_mean)
                pred.append(p_mean)
                err = abs(p_mean - t_mean) / t_mean
                pairs.append({"truth_step_ns": times.tolist(), "truth_mean_ns": t_mean, "truth_wall_s": twall,
                              "prism_step_ns": ptimes.tolist(), "prism_mean_ns": p_mean, "capture_wall_s": pwall,
                              "error": err})
                print(f"{name} run {i}: truth {t_mean / 1e6:.1f} ms, prism {p_mean / 1e6:.1f} ms, "
                      f"error {err:.1%}  (truth {twall:.0f} s, capture {pwall:.0f} s)", flush=True)
            errs = [p["error"] for p in pairs]
            cv = statistics.stdev(truth) / statistics.mean(truth) if len(truth) > 1 else float("nan")
            lo, hi = bootstrap_median_ci(errs)
            row = {"config": name, "flags": CONFIGS[a.world][name], "world": a.world,
                   "truth_mean_ms": statistics.mean(truth) / 1e6, "noise_floor_cv": cv,
                   "prism_mean_ms": statistics.mean(pred) / 1e6, "median_error": statistics.median(errs),
                   "error_ci95": [lo, hi], "runs": pairs}
            out["configs"].append(row)
            rows.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"accuracy: world {a.world}, {a.runs} interleaved truth/prism pairs, {a.steps} steps ({a.warmup} warm-up), "
          f"profile {model.name}; {date}, {socket.gethostname()} ({cores} cores)")
    print(f"{'config':<18} {'truth ms':>9} {'noise CV':>9} {'prism ms':>9} {'median err':>11} {'95% CI':>16}")
    for r in rows:
        print(f"{r['config']:<18} {r['truth_mean_ms']:>9.1f} {r['noise_floor_cv']:>9.1%} {r['prism_mean_ms']:>9.1f} "
              f"{r['median_error']:>11.1%} {r['error_ci95'][0]:>7.1%}-{r['error_ci95'][1]:<7.1%}")
    pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
