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
    measured without oversubscription), rank 0 recorded, then the graph
    replayed with gloo profiles fitted by ``prism netprofile`` on this host
    (fitted first if there is none), mean over the same steps. Four profiles,
    side by side on the same capture. From points timed one group at a time
    (``prism netprofile``'s default): one alpha-beta set for every op
    (``one-fit``, the profile of the first accuracy report), one per op
    (``per-op``), and per op corrected to the measured points per size and
    group size (``measured``). From points timed with every group of a size
    busy at once on ``--world`` ranks (``prism netprofile --concurrent
    WORLD``), per op and corrected to them: ``concurrent``; the same points
    with each call the median member's time instead of the slowest's:
    ``concurrent-median``.
emulated
    ``prism emulate`` of that capture with rank 0 as the sandbox (its
    recorded payloads, the ``--emulate-profile`` profile, default
    ``concurrent``, for the virtual ranks): the
    emulated job's mean iteration time over the same steps, and the sandbox
    rank's own.

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

import dataclasses
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
from prism.core.trace import Compute  # noqa: E402
from prism.core.replay import replay_batch  # noqa: E402
from prism.shell.runfolder import read_run  # noqa: E402
from prism.shell.launcher import launch_ranks  # noqa: E402
from prism.validation import stepclock  # noqa: E402
from prism.validation.keep import keep_capture  # noqa: E402
from prism.validation.truthrun import STEPCLOCK  # noqa: E402

from _results import result_path, write_json  # noqa: E402  (bench/ is this script's folder, on sys.path)
from prism.app.netprofile import DEFAULT_OPS, DEFAULT_SIZES, fitted_profile_path, measure, usable_cores  # noqa: E402
from prism.core.costmodel import parse_profile  # noqa: E402
from prism.core.netfit import Point, fit_per_op, fit_points, profile_toml  # noqa: E402
from prism.core.payloads import RecordPlan  # noqa: E402
from prism.app.emulate import EmulateConfig, emulate  # noqa: E402
from prism.app.commtime import CommtimeConfig, comm_model, commtime  # noqa: E402

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
    16: {
        "gpt-tp2-pp2-dp4": ["--tp", "2", "--pp", "2", "--dp", "4"],
        "gpt-tp4-dp4": ["--tp", "4", "--dp", "4"],
        "moe-tp2-dp8-ep2": ["--tp", "2", "--dp", "8", "--ep", "2", "--experts", "4"],
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


#: The concurrent points with each call's time the median member's (a
#: typical group's) instead of the slowest's (the worst of world // n groups);
#: ``prism netprofile`` measures both. A probe: on a 16-core host (2026-12-07,
#: ``bench/results/accuracy-2026-12-07-h100cpu.md``) it was no nearer the truth
#: than ``concurrent``.
CONCURRENT_MEDIAN = "concurrent-median"


#: A prediction beside the profiles': the emulation's profile over compute
#: segments cut to the CPU time their main thread used (``Compute.thread_cpu_ns``),
#: as if no rank had been descheduled or waited for the GIL in the capture.
CPU_CLOCK = "cpu-clock"


def cpu_clock_graph(ranks: dict) -> ExecutionGraph:
    """The capture's graph with each CPU compute segment cut to the time its
    main thread was on a CPU (``Compute.thread_cpu_ns``; PrismTrace 1.4)."""
    return ExecutionGraph.from_events({r: [
        dataclasses.replace(ev, end_ns=ev.start_ns + min(ev.thread_cpu_ns, ev.end_ns - ev.start_ns))
        if isinstance(ev, Compute) and ev.thread_cpu_ns >= 0 else ev for ev in evs]
        for r, evs in ranks.items()})


#: The prediction with each collective and message timed in situ (``prism commtime``; ``--in-situ``).
IN_SITU = "in-situ"
#: The same over compute segments cut to their main thread's CPU time (as ``cpu-clock``).
IN_SITU_CPU = "cpu-clock+in-situ"


def run_prism(world: int, cmd: list[str], tmp: pathlib.Path, models: dict, slots: int, warmup: int,
              emulate_with: str | None, keep: tuple[str, str] | None = None, in_situ: str | None = None):
    """Capture (rank 0 recorded), predict under each of ``models``, emulate with
    sandbox 0 under the profile file ``emulate_with`` (None: no emulation);
    ``keep``: (folder, name) keeps the capture's graph there
    (``prism.validation.keep``); ``in_situ``: the name of the model in
    ``models`` that ``prism commtime`` runs the capture's calls for real over
    (its unmeasured calls priced by it): adds the ``in-situ`` prediction,
    and the emulation's virtual ranks take those times (``--comm measured``).
    Returns the predictions, the capture's wall time and CPU share, the
    emulation's figures and the kept folder's name."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="prism-", dir=tmp)) / "run"
    t0 = time.monotonic()
    status = capture_run(d, world, cmd, slots=slots, show_ranks=(), progress="off",
                         record=RecordPlan(frozenset({0}), None, 4 << 30)).exit_code
    if status != 0:
        raise RuntimeError(f"prism capture failed with status {status}; logs in {d / 'logs'}")
    wall = time.monotonic() - t0
    ranks = read_run(d).ranks
    segs = [ev for evs in ranks.values() for ev in evs if isinstance(ev, Compute) and ev.thread_cpu_ns >= 0]
    seg_wall = sum(ev.end_ns - ev.start_ns for ev in segs)
    # how much of the capture's compute its main threads spent on a CPU (PrismTrace 1.4): under 1, the capture's
    # timing is polluted (ranks descheduled, or waiting for the GIL)
    wall = (wall, sum(min(ev.thread_cpu_ns, ev.end_ns - ev.start_ns) for ev in segs) / seg_wall if seg_wall else None)
    graph = ExecutionGraph.from_events(ranks)
    cpu_graph = None
    preds = {}
    insitu = None
    if in_situ is not None:
        t1 = time.monotonic()
        try:
            ct = commtime(CommtimeConfig(run=str(d), net=emulate_with, calibration="off", timeout=120, passes=3))
        except Exception as e:  # noqa: BLE001  (one pair's column lost, not the whole call's measurements)
            print(f"in-situ timing failed, this pair has no in-situ column: {e}", flush=True)
            insitu = {"error": str(e)}
        else:
            insitu = {"wall_s": time.monotonic() - t1, "skeleton_iteration_ms": ct.manifest["skeleton_iteration_ms"],
                      "summary": ct.rows}
            models = {**models, IN_SITU: comm_model(d, "measured", models[in_situ])}
            models[IN_SITU_CPU] = models[IN_SITU]  # the same times over the segments' main-thread CPU time
    kept = keep_capture(d, *keep) if keep is not None else None  # with its in-situ times (RUN/commtime)
    for name, model in models.items():
        g = graph
        if name in (CPU_CLOCK, IN_SITU_CPU):  # each CPU segment cut to its main thread's CPU time (PrismTrace 1.4)
            if cpu_graph is None:
                cpu_graph = cpu_clock_graph(ranks)
            g = cpu_graph
        res = replay_batch(g, cost_model=model)
        preds[name] = (res.iteration_times, res.mean_iteration_time(warmup))
    emu = None
    if emulate_with is not None:
        t1 = time.monotonic()
        out = emulate(EmulateConfig(run=d, sandbox="0", net=emulate_with, name="acc", warmup=warmup,
                                   calibration="off",
                                   comm="measured" if insitu is not None and "error" not in insitu else "model"))
        if not out.ok:
            raise RuntimeError(f"prism emulate failed ({out.status}): {out.message}")
        s = out.summary
        emu = {"job_step_ns": s["emulated_iteration_ns"], "job_mean_ns": s["emulated_mean_ns"],
               "sandbox_step_ns": s["ranks"]["0"]["iteration_ns"], "sandbox_mean_ns": s["ranks"]["0"]["mean_iteration_ns"],
               "sandbox_wall_step_ns": s["ranks"]["0"]["wall_iteration_ns"],
               "prism_overhead_ns": s["ranks"]["0"]["prism_overhead_ns"], "wall_s": time.monotonic() - t1,
               "turnaround_p50_ns": s["pacing"]["turnaround_p50_ns"], "in_situ": insitu}
    shutil.rmtree(d.parent, ignore_errors=True)
    return preds, wall, emu, kept


def bootstrap_median_ci(x: list[float], reps: int = 4000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    a = np.asarray(x)
    meds = np.median(a[rng.integers(0, len(a), (reps, len(a)))], axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def _points(path: pathlib.Path, remeasure: bool, what: str, **kw) -> list:
    """Measured points cached at ``path`` (measured first if absent or ``remeasure``)."""
    if remeasure or not path.is_file():
        print(f"measuring gloo on this host ({what}) into {path}", flush=True)
        points = measure(DEFAULT_SIZES, kw.pop("group_sizes"), DEFAULT_OPS, **kw)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([dataclasses_asdict(p) for p in points]))
        return points
    return [Point(**p) for p in json.loads(path.read_text())]


def ensure_profile(net: str | None, tmp: pathlib.Path, world: int, remeasure: bool = False) -> tuple[dict, str, dict]:
    """The cost models to compare: name -> CostModel, the path of the
    default one, and the measured points by kind (isolated, concurrent)."""
    if net:
        return {"given": load_profile(net)}, net, {}
    path = fitted_profile_path("gloo", socket.gethostname())
    cores = usable_cores()
    gs = [n for n in (2, 4, 8, 16) if n <= cores] or [2]
    points = _points(path.with_suffix(".points.json"), remeasure, "prism netprofile defaults, one group at a time",
                     group_sizes=gs)
    cgs = [n for n in gs if world % n == 0 and n <= world]
    conc = _points(path.with_suffix(f".concurrent{world}.points.json"), remeasure,
                   f"prism netprofile --concurrent {world}", group_sizes=cgs, concurrent=world) if world > 2 else points
    command = "bench/accuracy.py (prism netprofile defaults)"
    fit, per_op = fit_points(points), fit_per_op(points)
    kw = dict(host=socket.gethostname(), backend="gloo", ranks_per_node=cores, command=command,
              date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    texts = {"concurrent": fitted_toml(conc, f"{command} --concurrent {world}", concurrent=world),
             "measured": profile_toml(fit, points, per_op=per_op, **kw),
             "per-op": profile_toml(fit, points, per_op=per_op, measured=False, **kw),
             "one-fit": profile_toml(fit, points, measured=False, **kw)}
    if world > 2 and conc and all(p.median_rank_seconds is not None for p in conc):
        # the same concurrent points, each the median member's time: a typical group's, not the worst one's
        med = [dataclasses.replace(p, seconds=p.median_rank_seconds) for p in conc]
        texts[CONCURRENT_MEDIAN] = fitted_toml(med, f"{command} --concurrent {world}, median member",
                                               concurrent=world)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(texts["measured"])
    models = {name: parsed_model(text, tmp / f"profile-{name}.toml") for name, text in texts.items()}
    return models, str(path), {"isolated": [dataclasses_asdict(p) for p in points],
                               "concurrent": [dataclasses_asdict(p) for p in conc]}


def fitted_toml(points: list, command: str, concurrent: int | None = None) -> str:
    """This host's gloo profile fitted to ``points`` (per op, the points kept), as ``prism netprofile`` writes it."""
    return profile_toml(fit_points(points), points, per_op=fit_per_op(points), host=socket.gethostname(),
                        backend="gloo", ranks_per_node=usable_cores(), command=command,
                        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), concurrent=concurrent)


def parsed_model(text: str, path: pathlib.Path):
    """``text`` written to ``path`` (named in the model's errors) and parsed."""
    path.write_text(text)
    return parse_profile(text, str(path))


def dataclasses_asdict(p) -> dict:
    return {f: getattr(p, f) for f in Point.__slots__}


def _stats(truth: list[float], vals: list[float]) -> dict:
    errs = [abs(v - t) / t for v, t in zip(vals, truth)]
    signed = [(v - t) / t for v, t in zip(vals, truth)]
    lo, hi = bootstrap_median_ci(errs)
    return {"mean_ms": statistics.mean(vals) / 1e6, "median_error": statistics.median(errs),
            "median_signed_error": statistics.median(signed), "error_ci95": [lo, hi]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks per run (at most the core count); default 2")
    ap.add_argument("--configs", default=None, help="comma-separated names (default: all for --world)")
    ap.add_argument("--runs", type=int, default=4, help="truth/prism pairs per configuration (default 4)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="2 runs of 6 steps")
    ap.add_argument("--net", default=None, help="cost profile (default: the fitted gloo profile of this host)")
    ap.add_argument("--remeasure", action="store_true", help="measure gloo again even if this host has points")
    ap.add_argument("--no-emulate", action="store_true", help="capture and predict only")
    ap.add_argument("--emulate-profile", default="concurrent",
                    help="which profile the emulation's virtual ranks use (concurrent, concurrent-median, measured, "
                         "per-op, one-fit)")
    ap.add_argument("--in-situ", action="store_true",
                    help="after each capture, `prism commtime` runs its calls for real (a skeleton job): an "
                         "`in-situ` prediction column, and the emulation's virtual ranks take those times")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per ground-truth run")
    ap.add_argument("--pin", action="store_true", help="rank r on one CPU, in the truth, the capture and the "
                    "emulation alike (PRISM_PIN_CPUS=1: prism/rank/forkserver.py)")
    ap.add_argument("--keep-runs", default=None, metavar="DIR",
                    help="keep each capture's graph (traces and manifest, no payloads) in DIR/CONFIG-K; each pair's "
                         "JSON names its folder (`kept`), beside the truth's step times")
    ap.add_argument("--out", default=str(result_path("accuracy")))
    a = ap.parse_args()
    if a.pin:
        from prism.rank.forkserver import PIN_ENV

        os.environ[PIN_ENV] = "1"  # the fork servers inherit it
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
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="prism-accuracy-"))
    models, profile_path, points = ensure_profile(a.net, tmp, a.world, a.remeasure)
    reported = a.emulate_profile if a.emulate_profile in models else next(iter(models))
    models[CPU_CLOCK] = models[reported]  # the same profile over the segments' main-thread CPU time
    emulate_with = None if a.no_emulate else (a.net or str(tmp / f"profile-{reported}.toml"))
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
        "cost_profile": {"path": profile_path, "reported": reported,
                         "variants": {k: {"name": m.name, "description": m.description} for k, m in models.items()}},
        "measured_points": points,
        "slots": cores, "pinned": a.pin, "configs": [],
    }
    rows = []
    cols_of = [*models, *([IN_SITU, IN_SITU_CPU] if a.in_situ else [])]
    out["in_situ"] = a.in_situ
    try:
        for name in names:
            cmd = command(CONFIGS[a.world][name], a.steps)
            truth, pred, emu_job, emu_sb, pairs = [], {k: [] for k in cols_of}, [], [], []
            for i in range(a.runs):
                times, twall, ends = run_truth(a.world, cmd, tmp, a.timeout)
                t_mean = mean_iteration(ends, a.warmup)
                keep = (a.keep_runs, f"{name}-{i}") if a.keep_runs else None
                preds, (pwall, cpu_share), emu, kept = run_prism(a.world, cmd, tmp, models, cores, a.warmup,
                                                                 emulate_with, keep,
                                                                 reported if a.in_situ else None)
                truth.append(t_mean)
                for k in pred:
                    pred[k].append(preds[k][1] if k in preds else float("nan"))
                if emu is not None:
                    emu_job.append(emu["job_mean_ns"])
                    emu_sb.append(emu["sandbox_mean_ns"])
                pairs.append({"truth_step_ns": times.tolist(), "truth_mean_ns": t_mean, "truth_wall_s": twall,
                              "prism": {k: {"step_ns": st.tolist(), "mean_ns": m} for k, (st, m) in preds.items()},
                              "capture_wall_s": pwall, "capture_cpu_share": cpu_share, "emulation": emu,
                              "kept": kept})
                line = f"{name} run {i}: truth {t_mean / 1e6:.1f} ms, " + ", ".join(
                    f"{k} {m / 1e6:.1f}" for k, (_, m) in preds.items())
                if emu is not None:
                    line += f", emulated job {emu['job_mean_ns'] / 1e6:.1f} (sandbox {emu['sandbox_mean_ns'] / 1e6:.1f})"
                share = f", its compute {cpu_share:.0%} on a CPU" if cpu_share is not None else ""
                print(line + f"  (truth {twall:.0f} s, capture {pwall:.0f} s{share})", flush=True)
            cv = statistics.stdev(truth) / statistics.mean(truth) if len(truth) > 1 else float("nan")
            row = {"config": name, "flags": CONFIGS[a.world][name], "world": a.world,
                   "truth_mean_ms": statistics.mean(truth) / 1e6, "noise_floor_cv": cv,
                   "predicted": {k: _stats(truth, v) for k, v in pred.items()},
                   "emulated_job": _stats(truth, emu_job) if emu_job else None,
                   "emulated_sandbox": _stats(truth, emu_sb) if emu_sb else None, "runs": pairs}
            out["configs"].append(row)
            rows.append(row)
            # written after every configuration: a run stopped at its time limit keeps what it measured
            pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(a.out).write_text(json.dumps(out, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"accuracy: world {a.world}, {a.runs} interleaved truth/prism pairs, {a.steps} steps ({a.warmup} warm-up); "
          f"{date}, {socket.gethostname()} ({cores} cores); median paired error (signed median), 95% CI")
    cols = [*cols_of, *(["emulated job", "emulated sandbox"] if emulate_with else [])]
    print(f"{'config':<18} {'truth ms':>9} {'noise CV':>9} " + " ".join(f"{c:>26}" for c in cols))
    for r in rows:
        cells = [r["predicted"][k] for k in cols_of] + ([r["emulated_job"], r["emulated_sandbox"]] if emulate_with else [])
        print(f"{r['config']:<18} {r['truth_mean_ms']:>9.1f} {r['noise_floor_cv']:>9.1%} " + " ".join(
            f"{c['mean_ms']:>7.1f} {c['median_error']:>6.1%} ({c['median_signed_error']:+.1%}) "
            f"{c['error_ci95'][0]:.0%}-{c['error_ci95'][1]:.0%}".rjust(26) for c in cells))
    write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
