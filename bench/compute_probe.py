"""Is compute slower inside a Prism capture than in the real job? A fixed loop, both ways.

    python bench/compute_probe.py --world 8 [--modes py,mm] [--pin] [--runs 3] [--out FILE.json]

``bench/compute_probe_work.py`` (a pure-Python loop, ``py``, or eight
256x256 matmuls, ``mm``, between small all_reduces) runs as the truth
(plain torch.distributed over gloo, one process per rank, the step clock)
and under ``prism capture``, in interleaved pairs. Per pair and side: each
loop's mean wall and main-thread CPU time (the worker's own clocks, mean over
ranks), and ``bench/comm_share.py``'s segment sums (the truth's time between
calls against the capture's compute segments). ``--pin`` puts rank r on the
r-th CPU (both sides, ``PRISM_PIN_CPUS=1``): no migration between CPUs. The wall/CPU pair tells
a slower thread (CPU time up: caches, frequency, another thread's GIL
requests) from a descheduled one (wall up, CPU not). Needs one core per rank.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _results import result_path, write_json  # noqa: E402
from comm_share import capture_segments, compare_segments, truth_split  # noqa: E402
from prism.app.capture import capture_run  # noqa: E402
from prism.app.netprofile import usable_cores  # noqa: E402
from prism.core.graph import ExecutionGraph  # noqa: E402
from prism.shell.runfolder import read_run  # noqa: E402

WORK = str(ROOT / "bench" / "compute_probe_work.py")


def loops(d: pathlib.Path, side: str, world: int) -> dict:
    vals = [(d / f"{side}-{r}.txt").read_text().split() for r in range(world)]
    return {"wall_us": statistics.mean(float(v[0]) for v in vals), "cpu_us": statistics.mean(float(v[1]) for v in vals)}


def pair(world: int, mode: str, pin: bool, tmp: pathlib.Path) -> dict:
    d = pathlib.Path(tempfile.mkdtemp(prefix="probe-", dir=tmp))
    # both sides inherit it; PRISM_PIN_CPUS: each rank on one CPU (prism/rank/forkserver.py)
    os.environ.update(PROBE_DIR=str(d), PROBE_MODE=mode, PRISM_PIN_CPUS="1" if pin else "0")
    t = truth_split(world, [WORK], tmp, 2, 120)
    run = d / "run"
    if capture_run(run, world, [WORK], slots=usable_cores(), show_ranks=(), progress="off").exit_code:
        raise RuntimeError(f"the capture failed; logs in {run / 'logs'}")
    seg = compare_segments(t["segments"], capture_segments(ExecutionGraph.from_events(read_run(run).ranks), 2))
    out = {"truth": loops(d, "truth", world), "capture": loops(d, "capture", world),
           "segments_truth_ms": sum(r["truth_ms"] for r in seg["rows"]),
           "segments_capture_ms": sum(r["capture_ms"] for r in seg["rows"]), "truth_iteration_ms": t["iteration_ms"]}
    shutil.rmtree(d, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--modes", default="py,mm")
    ap.add_argument("--pin", action="store_true", help="rank r on the r-th CPU, in the truth and the capture")
    ap.add_argument("--runs", type=int, default=2, help="interleaved truth/capture pairs per mode")
    ap.add_argument("--out", default=str(result_path("compute_probe")))
    a = ap.parse_args()
    if a.world > usable_cores():
        sys.exit(f"--world {a.world} exceeds the {usable_cores()} cores: the truth would be unfair")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="prism-probe-"))
    import torch

    res = {"benchmark": "compute_probe", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "python " + " ".join(sys.argv), "versions": {"python": platform.python_version(),
                                                                  "torch": torch.__version__},
           "cpus": usable_cores(), "world": a.world, "pin": a.pin, "modes": {}}
    print(f"{'mode':<5} {'pair':>4} {'truth wall/CPU us':>19} {'capture wall/CPU us':>21} {'CPU ratio':>9} "
          f"{'segments truth/capture ms':>27}")
    try:
        for mode in a.modes.split(","):
            runs = []
            for i in range(a.runs):
                p = pair(a.world, mode, a.pin, tmp)
                runs.append(p)
                t, c = p["truth"], p["capture"]
                print(f"{mode:<5} {i:>4} {t['wall_us']:>9.1f}/{t['cpu_us']:<9.1f} {c['wall_us']:>10.1f}/{c['cpu_us']:<10.1f}"
                      f" {c['cpu_us'] / t['cpu_us']:>9.3f} {p['segments_truth_ms']:>13.2f}/{p['segments_capture_ms']:<13.2f}",
                      flush=True)
            ratios = [r["capture"]["cpu_us"] / r["truth"]["cpu_us"] for r in runs]
            res["modes"][mode] = {"runs": runs, "cpu_ratio_median": statistics.median(ratios)}
            print(f"{mode}: capture/truth CPU time per loop, median of {len(ratios)} pairs: {statistics.median(ratios):.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
