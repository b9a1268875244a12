"""Where a CPU prediction's error lies: communication or compute, per step.

    python bench/comm_share.py --world 8 --configs gpt-tp2-dp4 [--runs 2] [--steps 10] [--out FILE.json]

For each configuration of ``bench/accuracy.py`` (same model, same gloo
ground truth, one process per core): the truth runs under the step clock
with ``PRISM_STEPCLOCK_CALLS=1``, so every communication call's own duration
is logged (no profiler); a Prism capture of the same command is replayed
under the profiles ``bench/accuracy.py`` compares. Per rank and step both
sides are split into *communication* (the truth: the time its calls held the
caller; the replay: its collective, point-to-point and wait nodes) and
*the rest* (iteration time less communication: compute and Python). Printed
per configuration: the mean over ranks and steps of each, truth beside each
profile's replay, so an iteration-time error shows whether the cost model
(communication) or the captured durations (the rest) carry it. Each run
also captures with ``PRISM_FRONT_END_IN_COMM=1`` (torch's Python dispatch
counted inside each call instead of in the compute around it:
``prism/rank/bootstrap.py::_front_end``), replayed under two profiles
(rows ``+fe``).

Ground truth needs one core per rank, as in ``bench/accuracy.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from accuracy import CONFIGS, command, ensure_profile, job_step_ends  # noqa: E402  (bench/ is on sys.path)
from _results import result_path  # noqa: E402
from prism.app.capture import capture_run  # noqa: E402
from prism.app.netprofile import usable_cores  # noqa: E402
from prism.core.graph import COLL, RECV, SEND, WAIT, ExecutionGraph  # noqa: E402
from prism.core.replay import replay_batch  # noqa: E402
from prism.shell.launcher import launch_ranks  # noqa: E402
from prism.rank.bootstrap import FRONT_END_ENV  # noqa: E402
from prism.shell.runfolder import read_run  # noqa: E402
from prism.validation import stepclock  # noqa: E402
from prism.validation.truthrun import STEPCLOCK  # noqa: E402


def truth_split(world: int, cmd: list[str], tmp: pathlib.Path, warmup: int, timeout: float) -> dict:
    """Per rank: mean iteration, communication and rest per step (ms), over steps after ``warmup``."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="truth-", dir=tmp))
    h = launch_ranks(world, None, d, [STEPCLOCK, *cmd], show_ranks=(),
                     env={"PRISM_STEPCLOCK_DIR": str(d), "OMP_NUM_THREADS": "1", "PRISM_STEPCLOCK_CALLS": "1"})
    try:
        codes = h.wait(timeout=timeout)
    finally:
        h.close()
    if any(c != 0 for c in codes):
        raise RuntimeError(f"ground-truth run failed (exit codes {codes}); logs in {d / 'logs'}")
    texts = [(d / f"rank-{r}.txt").read_text() for r in range(world)]
    shutil.rmtree(d, ignore_errors=True)
    ends = job_step_ends([stepclock.parse(t)[0] for t in texts])
    iters = np.diff(ends)[warmup - 1:] / 1e6  # step k's time: end(k) - end(k-1), k >= warmup
    comm = []
    for t in texts:
        per_step: dict[int, int] = {}
        for step, _op, _n, _b, t0, t1, is_async in stepclock.parse_calls(t):
            if not is_async:
                per_step[step] = per_step.get(step, 0) + (t1 - t0)
        comm.append([per_step.get(k, 0) / 1e6 for k in range(warmup, len(ends))])
    c = float(np.mean(comm))
    return {"iteration_ms": float(iters.mean()), "comm_ms": c, "rest_ms": float(iters.mean()) - c}


def prism_split(world: int, cmd: list[str], tmp: pathlib.Path, models: dict, warmup: int,
                front_end: bool = False) -> dict:
    d = pathlib.Path(tempfile.mkdtemp(prefix="prism-", dir=tmp)) / "run"
    old = os.environ.get(FRONT_END_ENV)
    os.environ[FRONT_END_ENV] = "1" if front_end else "0"  # the ranks inherit it
    try:
        status = capture_run(d, world, cmd, slots=usable_cores(), show_ranks=(), progress="off").exit_code
    finally:
        if old is None:
            os.environ.pop(FRONT_END_ENV, None)
        else:
            os.environ[FRONT_END_ENV] = old
    if status != 0:
        raise RuntimeError(f"prism capture failed with status {status}; logs in {d / 'logs'}")
    graph = ExecutionGraph.from_events(read_run(d).ranks)
    shutil.rmtree(d.parent, ignore_errors=True)
    comm_kind = np.isin(graph.kind, (COLL, SEND, RECV, WAIT))
    out = {}
    for name, model in models.items():
        res = replay_batch(graph, cost_model=model)
        span = (res.end - res.start).astype(np.float64)
        steps = graph.step
        last = int(steps.max())
        sel = comm_kind & (steps >= warmup) & (steps <= last)
        comm = float(span[sel].sum()) / world / (last - warmup + 1) / 1e6
        it = res.mean_iteration_time(warmup) / 1e6
        out[name] = {"iteration_ms": it, "comm_ms": comm, "rest_ms": it - comm}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--configs", default=None)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", default=str(result_path("comm_share")))
    a = ap.parse_args()
    if a.world > usable_cores():
        sys.exit(f"--world {a.world} exceeds the {usable_cores()} cores: the ground truth would be unfair")
    if a.world not in CONFIGS:
        sys.exit(f"--world must be one of {sorted(CONFIGS)}")
    names = a.configs.split(",") if a.configs else list(CONFIGS[a.world])
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="prism-comm-share-"))
    models, _, _ = ensure_profile(None, tmp, a.world)
    import torch

    res = {"benchmark": "comm_share", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "python " + " ".join(sys.argv), "versions": {"python": platform.python_version(),
                                                                  "torch": torch.__version__},
           "cpus": usable_cores(), "configs": []}
    try:
        for name in names:
            cmd = command(CONFIGS[a.world][name], a.steps)
            runs = []
            for i in range(a.runs):
                t = truth_split(a.world, cmd, tmp, a.warmup, a.timeout)
                p = prism_split(a.world, cmd, tmp, models, a.warmup)
                # the same with torch's front end counted inside each call (PRISM_FRONT_END_IN_COMM=1)
                f = prism_split(a.world, cmd, tmp, {k: models[k] for k in ("concurrent", "one-fit")}, a.warmup,
                                front_end=True)
                p.update({f"{k}+fe": v for k, v in f.items()})
                runs.append({"truth": t, "prism": p})
                print(f"{name} run {i}: truth {t['iteration_ms']:.1f} ms = comm {t['comm_ms']:.1f} + rest "
                      f"{t['rest_ms']:.1f}; " + "; ".join(f"{k} {v['iteration_ms']:.1f} = {v['comm_ms']:.1f} + "
                                                          f"{v['rest_ms']:.1f}" for k, v in p.items()), flush=True)
            res["configs"].append({"config": name, "runs": runs})
            pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(a.out).write_text(json.dumps(res, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{'config':<18} {'side':<12} {'iteration ms':>13} {'comm ms':>9} {'rest ms':>9}")
    for c in res["configs"]:
        def mean(side, key, prof=None):
            return statistics.mean(r["truth"][key] if prof is None else r["prism"][prof][key] for r in c["runs"])
        print(f"{c['config']:<18} {'truth':<12} {mean('t', 'iteration_ms'):>13.1f} {mean('t', 'comm_ms'):>9.1f} "
              f"{mean('t', 'rest_ms'):>9.1f}")
        for prof in c["runs"][0]["prism"]:
            print(f"{'':<18} {prof:<12} {mean('p', 'iteration_ms', prof):>13.1f} {mean('p', 'comm_ms', prof):>9.1f} "
                  f"{mean('p', 'rest_ms', prof):>9.1f}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
