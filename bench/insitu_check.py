"""Does `prism commtime` measure what the real job's calls cost? Per call, truth against skeleton.

    python bench/insitu_check.py [--world 2] [--configs gpt-tp2,gpt-dp2] [--runs 2] [--steps 10] [--out FILE.json]
    python bench/insitu_check.py --world 16 --configs gpt-tp2-pp2-dp4,moe-tp2-dp8-ep2 --runs 1   # a 16-core host

Per run: the plain torch.distributed job over gloo under the step clock with
``PRISM_STEPCLOCK_CALLS=1`` (each blocking call's entry and return on the
host's monotonic clock, and its group's ranks), then a Prism capture of the
same command and ``prism commtime`` of it. A group's blocking calls pair up
across its members by their order. Per blocking collective instance after the
warm-up both sides give the same quantity, the median member's return less the
last member's entry (what the replay adds to the last arrival), and the cost
profile gives its modelled time: per config and per (op, group size), the
median and mean of each over the instances (async calls are left out: the
truth's step clock sees only their issue). Prints a table and writes JSON.
Configs: ``bench/accuracy.py``'s for the world.
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

from accuracy import CONFIGS, command  # noqa: E402  (bench/ is on sys.path)
from comm_share import paired_blocking_calls, truth_texts  # noqa: E402
from _results import result_path, write_json  # noqa: E402
from prism.app.capture import capture_run  # noqa: E402
from prism.app.commtime import CommtimeConfig, commtime  # noqa: E402
from prism.core.graph import COLL, OPS as C_OPS, ExecutionGraph  # noqa: E402
from prism.shell.runfolder import read_run  # noqa: E402
from prism.validation import stepclock  # noqa: E402


def truth_costs(world: int, cmd: list[str], tmp: pathlib.Path, warmup: int,
                timeout: float) -> tuple[dict[str, list[float]], float]:
    """Per "op/group size", the cost (ms) of each blocking collective instance
    of the real job after the warm-up; and its mean iteration (ms)."""
    texts = truth_texts(world, cmd, tmp, timeout)
    out: dict[str, list[float]] = {}
    for g, calls in paired_blocking_calls(texts):
        if calls[0][0] < warmup:
            continue
        cost = statistics.median([c[5] for c in calls]) - max(c[4] for c in calls)
        out.setdefault(f"{calls[0][1]}/{len(g)}", []).append(cost / 1e6)
    ends = np.max(np.array([stepclock.parse(t)[0] for t in texts]), axis=0)
    return out, float(np.mean(np.diff(ends[warmup - 1:]))) / 1e6


def skeleton_costs(world: int, cmd: list[str], tmp: pathlib.Path, warmup: int,
                   net: str | None) -> tuple[dict[str, list[float]], dict[str, list[float]], dict]:
    """Per "op/group size", the skeleton's and the profile's cost (ms) of each
    blocking collective instance of a fresh capture after the warm-up."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="prism-", dir=tmp)) / "run"
    status = capture_run(d, world, cmd, slots=world, show_ranks=(), progress="off").exit_code
    if status != 0:
        raise RuntimeError(f"prism capture failed with status {status}; logs in {d / 'logs'}")
    ct = commtime(CommtimeConfig(run=str(d), net=net, calibration="off", timeout=120))
    g = ExecutionGraph.from_events(read_run(d).ranks)
    with np.load(ct.path / "times.npz") as z:
        inst = z["inst_ns"]
    from prism.app.predict import load_run_manifest, resolve_profile
    model, _ = resolve_profile(net, load_run_manifest(d), "cpu")
    modelled = model.instance_costs(g)
    first = g.inst_nodes[g.inst_ptr[:-1]]
    keep = (g.step[first] >= warmup) & ~g.is_async[first] & (g.kind[first] == COLL) & (inst >= 0)
    skel: dict[str, list[float]] = {}
    mod: dict[str, list[float]] = {}
    for i in np.flatnonzero(keep):
        key = f"{C_OPS[int(g.inst_op[i])]}/{int(g.group_size[g.inst_group[i]])}"
        skel.setdefault(key, []).append(float(inst[i]) / 1e6)
        mod.setdefault(key, []).append(float(modelled[i]) / 1e6)
    info = {"skeleton_iteration_ms": ct.manifest["skeleton_iteration_ms"], "profile": model.name}
    shutil.rmtree(d.parent, ignore_errors=True)
    return skel, mod, info


def _stats(x: list[float]) -> dict:
    return {"n": len(x), "median_ms": statistics.median(x) if x else float("nan"),
            "mean_ms": statistics.mean(x) if x else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="ranks per run (at most the core count); default 2")
    ap.add_argument("--configs", default=None, help="comma-separated (default at world 2: gpt-tp2,gpt-dp2; "
                                                    "else all of accuracy.py's for the world)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--net", default=None, help="the cost profile compared (default: accuracy.py's concurrent gloo "
                                                "profile of this host, measured first where there is none)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", default=str(result_path("insitu_check")))
    a = ap.parse_args()
    if a.world not in CONFIGS:
        sys.exit(f"--world must be one of {sorted(CONFIGS)}")
    if a.world > (os.cpu_count() or 1):
        sys.exit(f"--world {a.world} needs {a.world} cores (one per rank, for the truth and the skeleton); this "
                 f"host has {os.cpu_count()}")
    names = (a.configs or ("gpt-tp2,gpt-dp2" if a.world == 2 else ",".join(CONFIGS[a.world]))).split(",")
    unknown = [n for n in names if n not in CONFIGS[a.world]]
    if unknown:
        sys.exit(f"unknown config {unknown[0]!r}; known at world {a.world}: {', '.join(CONFIGS[a.world])}")
    import torch

    out: dict = {"benchmark": "insitu_check", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "command": "python " + " ".join(sys.argv),
                 "machine": {"platform": platform.platform(), "host": socket.gethostname(), "cpus": os.cpu_count()},
                 "versions": {"python": platform.python_version(), "torch": torch.__version__},
                 "world": a.world, "steps": a.steps, "warmup": a.warmup, "configs": []}
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="prism-insitu-"))
    if a.net is None:
        # the gloo profile the CPU benchmarks predict with (predict's own default for a CPU run on a host with no
        # fitted profile is the shipped GPU one, whose times are not gloo's)
        from accuracy import ensure_profile  # noqa: E402  (bench/ is on sys.path)

        ensure_profile(None, tmp, a.world)
        a.net = str(tmp / "profile-concurrent.toml")
    out["profile"] = a.net
    try:
        for name in names:
            cmd = command(CONFIGS[a.world][name], a.steps)
            row = {"config": name, "runs": []}
            out["configs"].append(row)
            for i in range(a.runs):
                t, t_iter = truth_costs(a.world, cmd, tmp, a.warmup, a.timeout)
                s, m, info = skeleton_costs(a.world, cmd, tmp, a.warmup, a.net)
                keys = sorted(set(t) | set(s))
                run = {"truth_iteration_ms": t_iter, **info,
                       "calls": {k: {"truth": _stats(t.get(k, [])), "skeleton": _stats(s.get(k, [])),
                                     "model": _stats(m.get(k, []))} for k in keys}}
                row["runs"].append(run)
                for k in keys:
                    c = run["calls"][k]
                    print(f"{name} run {i} {k}: per blocking collective, median / mean ms (count): truth "
                          f"{c['truth']['median_ms']:.3f} / {c['truth']['mean_ms']:.3f} ({c['truth']['n']}), skeleton "
                          f"{c['skeleton']['median_ms']:.3f} / {c['skeleton']['mean_ms']:.3f} ({c['skeleton']['n']}), "
                          f"model {c['model']['median_ms']:.3f} / {c['model']['mean_ms']:.3f} [{info['profile']}]",
                          flush=True)
                print(f"{name} run {i}: truth iteration {t_iter:.2f} ms, skeleton {info['skeleton_iteration_ms']:.2f}",
                      flush=True)
                write_json(a.out, out, say=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"{'config':<18} {'call':<22} {'truth med/mean':>16} {'skeleton med/mean':>18} {'model med/mean':>16}")
    for row in out["configs"]:
        for k in sorted({k for r in row["runs"] for k in r["calls"]}):
            def cell(side, k=k, row=row):
                got = [r["calls"][k][side] for r in row["runs"] if k in r["calls"] and r["calls"][k][side]["n"]]
                if not got:
                    return "-"
                return "{:.3f}/{:.3f}".format(statistics.median(g["median_ms"] for g in got),
                                              statistics.median(g["mean_ms"] for g in got))
            print(f"{row['config']:<18} {k:<22} {cell('truth'):>16} {cell('skeleton'):>18} {cell('model'):>16}")
    write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
