"""Does `prism commtime` measure what the real job's calls cost? Per call, truth against skeleton.

    python bench/insitu_check.py [--configs gpt-tp2,gpt-dp2] [--runs 2] [--steps 10] [--out FILE.json]

World 2 (every collective of the bundled GPT's world-2 layouts is on the one
group of both ranks, so the truth's calls pair up by their order on each
rank). Per run: the plain torch.distributed job over gloo under the step clock
with ``PRISM_STEPCLOCK_CALLS=1`` (each blocking call's entry and return on the
host's monotonic clock), then a Prism capture of the same command and
``prism commtime`` of it. Per blocking collective instance after the warm-up
both sides give the same quantity, the median member's return less the last
member's entry (what the replay adds to the last arrival), and the cost
profile gives its modelled time: per config, the median and mean of each over
the instances (async calls are left out: the truth's step clock sees only
their issue). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
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
from comm_share import truth_texts  # noqa: E402
from _results import result_path, write_json  # noqa: E402
from prism.app.capture import capture_run  # noqa: E402
from prism.app.commtime import CommtimeConfig, commtime  # noqa: E402
from prism.core.graph import COLL, ExecutionGraph  # noqa: E402
from prism.shell.runfolder import read_run  # noqa: E402
from prism.validation import stepclock  # noqa: E402


def truth_costs(cmd: list[str], tmp: pathlib.Path, warmup: int, timeout: float) -> tuple[list[float], float]:
    texts = truth_texts(2, cmd, tmp, timeout)
    calls = [[c for c in stepclock.parse_calls(t) if not c[6] and c[2] == 2] for t in texts]
    if len(calls[0]) != len(calls[1]) or any(a[1] != b[1] for a, b in zip(*calls)):
        raise RuntimeError("the two ranks' blocking calls do not pair up by order (not a world-2 collective job?)")
    costs = [(statistics.median([a[5], b[5]]) - max(a[4], b[4])) / 1e6
             for a, b in zip(*calls) if a[0] >= warmup]
    ends = np.max(np.array([stepclock.parse(t)[0] for t in texts]), axis=0)
    return costs, float(np.mean(np.diff(ends[warmup - 1:]))) / 1e6


def skeleton_costs(cmd: list[str], tmp: pathlib.Path, warmup: int, net: str | None) -> tuple[list[float], list[float], dict]:
    d = pathlib.Path(tempfile.mkdtemp(prefix="prism-", dir=tmp)) / "run"
    status = capture_run(d, 2, cmd, slots=2, show_ranks=(), progress="off").exit_code
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
    out = ([float(x) / 1e6 for x in inst[keep]], [float(x) / 1e6 for x in modelled[keep]],
           {"skeleton_iteration_ms": ct.manifest["skeleton_iteration_ms"], "profile": model.name})
    shutil.rmtree(d.parent, ignore_errors=True)
    return out


def _stats(x: list[float]) -> dict:
    return {"n": len(x), "median_ms": statistics.median(x) if x else float("nan"),
            "mean_ms": statistics.mean(x) if x else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="gpt-tp2,gpt-dp2")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--net", default=None, help="the cost profile compared (default: predict's for a CPU run here)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", default=str(result_path("insitu_check")))
    a = ap.parse_args()
    names = a.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS[2]]
    if unknown:
        sys.exit(f"unknown config {unknown[0]!r}; known at world 2: {', '.join(CONFIGS[2])}")
    import torch

    out: dict = {"benchmark": "insitu_check", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "command": "python " + " ".join(sys.argv),
                 "machine": {"platform": platform.platform(), "host": socket.gethostname()},
                 "versions": {"python": platform.python_version(), "torch": torch.__version__},
                 "steps": a.steps, "warmup": a.warmup, "configs": []}
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="prism-insitu-"))
    try:
        for name in names:
            cmd = command(CONFIGS[2][name], a.steps)
            row = {"config": name, "runs": []}
            for i in range(a.runs):
                t, t_iter = truth_costs(cmd, tmp, a.warmup, a.timeout)
                s, m, info = skeleton_costs(cmd, tmp, a.warmup, a.net)
                run = {"truth": _stats(t), "skeleton": _stats(s), "model": _stats(m), "truth_iteration_ms": t_iter,
                       **info}
                row["runs"].append(run)
                print(f"{name} run {i}: per blocking collective, median / mean ms: truth {run['truth']['median_ms']:.3f}"
                      f" / {run['truth']['mean_ms']:.3f} ({len(t)}), skeleton {run['skeleton']['median_ms']:.3f} / "
                      f"{run['skeleton']['mean_ms']:.3f} ({len(s)}), model {run['model']['median_ms']:.3f} / "
                      f"{run['model']['mean_ms']:.3f} [{info['profile']}]", flush=True)
            out["configs"].append(row)
            write_json(a.out, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"{'config':<10} {'truth med/mean':>16} {'skeleton med/mean':>18} {'model med/mean':>16}")
    for row in out["configs"]:
        def cell(k):
            return "{:.3f}/{:.3f}".format(statistics.median(r[k]["median_ms"] for r in row["runs"]),
                                          statistics.median(r[k]["mean_ms"] for r in row["runs"]))
        print(f"{row['config']:<10} {cell('truth'):>16} {cell('skeleton'):>18} {cell('model'):>16}")
    write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
