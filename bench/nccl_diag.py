"""Where Prism's prediction of a GPU run goes wrong: the same config as
``bench/nccl_accuracy.py`` run as ground truth in variants (plain; with the
logical-device TorchFunctionMode pushed; with CUDA_LAUNCH_BLOCKING=1, i.e.
no CPU/GPU overlap), then one Prism capture kept, with the per-step sums of
its compute segments and communication windows per rank, and its prediction.

    python bench/nccl_diag.py --config gpt-tp2 --net PROFILE.toml --out-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import nccl_accuracy as NA  # noqa: E402
from accuracy import mean_iteration  # noqa: E402

from prism.core import trace as T  # noqa: E402
from prism.shell import runfolder  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="gpt-tp2")
    ap.add_argument("--net", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--gpus", type=int, default=2)
    a = ap.parse_args()
    out = pathlib.Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cmd, layout = NA.configs(2, "cuda")[a.config]
    cmd = NA.with_steps(cmd, a.steps)
    tmp = pathlib.Path(tempfile.mkdtemp())
    res = {}
    for variant, env in (("plain", {}), ("mode", {"PRISM_STEPCLOCK_MODE": "1"}),
                         ("launch_blocking", {"CUDA_LAUNCH_BLOCKING": "1"}), ("plain2", {})):
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            t = NA.run_truth(2, cmd, tmp, 240, "cuda")
            res[variant] = mean_iteration(t["ends"], 3) / 1e6
        except Exception as e:
            res[variant] = f"{type(e).__name__}: {e}"[-800:]
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        print(f"truth {variant}: {res[variant]}", flush=True)
    run = out / f"{a.config}-run"
    shutil.rmtree(run, ignore_errors=True)
    r = subprocess.run([sys.executable, "-m", "prism", "capture", "-n", "2", "--gpus",
                        ",".join(map(str, range(a.gpus))), "--out", str(run), "--progress", "off",
                        "--show-ranks", "none", "--", *cmd], cwd=ROOT, capture_output=True, text=True)
    print(r.stderr[-1500:])
    ranks = runfolder.read_run(run).ranks
    per = {}
    for rank, evs in ranks.items():
        comp = {}
        comm = {}
        for e in evs:
            if isinstance(e, T.Compute):
                comp[e.step] = comp.get(e.step, 0) + (e.end_ns - e.start_ns)
            elif isinstance(e, (T.Collective, T.P2P)):
                comm[e.step] = comm.get(e.step, 0) + (e.end_ns - e.issue_ns)
        per[rank] = {"compute_ms_per_step": {s: v / 1e6 for s, v in sorted(comp.items())},
                     "comm_window_ms_per_step": {s: v / 1e6 for s, v in sorted(comm.items())}}
        print(f"rank {rank}: compute ms/step {[round(v / 1e6, 2) for _, v in sorted(comp.items())]}; "
              f"comm windows ms/step {[round(v / 1e6, 2) for _, v in sorted(comm.items())]}")
    res["capture"] = per
    p = subprocess.run([sys.executable, "-m", "prism", "predict", str(run), "--net", a.net], cwd=ROOT,
                       capture_output=True, text=True)
    print(p.stdout[-2500:], p.stderr[-1000:])
    res["predict"] = p.stdout[-4000:]
    (out / f"diag-{a.config}.json").write_text(json.dumps(res, indent=1, default=str))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
