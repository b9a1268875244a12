"""Collective round trip through Prism's coordinator vs a bare gloo all_reduce.

The same ordinary script (bench/allreduce_script.py) runs in one go under real
gloo (one process per rank) and under ``prism capture`` (every all_reduce
travels rank -> coordinator -> rank over ZeroMQ), at each world size, side by
side in one run. Prints a table (p50/p99 per call as rank 0 sees it) and
writes bench/results/coordinator-DATE[-MACHINE].json.

    python bench/coordinator.py                 # worlds 16 and 64, 4 KiB
    python bench/coordinator.py --worlds 4 --iters 20

On a machine with fewer cores than ranks both sides are oversubscribed; the
ratio is what to read, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prism.shell import runfolder  # noqa: E402
from prism.workloads import harness  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import result_path  # noqa: E402

SCRIPT = str(ROOT / "bench" / "allreduce_script.py")


def parse(text: str) -> dict:
    m = re.search(r"^RESULT (\{.*\})$", text, re.M)
    if not m:
        raise RuntimeError(f"no RESULT line in:\n{text[-2000:]}")
    return json.loads(m.group(1))


def run_gloo(world: int, args: list[str]) -> dict:
    res = harness.run_world([SCRIPT, *args], world, timeout=900)
    return parse(res[0].stdout)


def run_prism(world: int, args: list[str], slots: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "prism", "capture", "-n", str(world), "--out", str(run_dir),
               "--progress", "off", "--show-ranks", "none"]
        if slots:
            cmd += ["--slots", str(slots)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        p = subprocess.run([*cmd, "--", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"prism capture failed:\n{p.stderr[-3000:]}")
        return parse(runfolder.log_path(run_dir, 0).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="16,64")
    ap.add_argument("--numel", type=int, default=1024, help="float32 elements (default 1024 = 4 KiB)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--slots", type=int, default=None, help="prism --slots (default: the number of cores)")
    ap.add_argument("--out", default=str(result_path("coordinator")))
    a = ap.parse_args()
    script_args = ["--numel", str(a.numel), "--iters", str(a.iters)]
    rows = []
    for world in [int(w) for w in a.worlds.split(",")]:
        t0 = time.monotonic()
        gloo = run_gloo(world, script_args)
        t1 = time.monotonic()
        prism = run_prism(world, script_args, a.slots)
        t2 = time.monotonic()
        rows.append({"world": world, "bytes": a.numel * 4, "gloo": gloo, "prism": prism,
                     "ratio_p50": prism["p50_ms"] / gloo["p50_ms"], "ratio_p99": prism["p99_ms"] / gloo["p99_ms"],
                     "gloo_wall_s": t1 - t0, "prism_wall_s": t2 - t1})
    print(f"{'world':>5} {'bytes':>7} {'gloo p50':>10} {'gloo p99':>10} {'prism p50':>10} {'prism p99':>10} "
          f"{'p50 x':>6} {'p99 x':>6}")
    for r in rows:
        print(f"{r['world']:>5} {r['bytes']:>7} {r['gloo']['p50_ms']:>8.3f}ms {r['gloo']['p99_ms']:>8.3f}ms "
              f"{r['prism']['p50_ms']:>8.3f}ms {r['prism']['p99_ms']:>8.3f}ms {r['ratio_p50']:>6.2f} "
              f"{r['ratio_p99']:>6.2f}")
    import torch  # noqa: PLC0415 (version only)

    report = {
        "bench": "coordinator", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([sys.executable, *sys.argv]), "machine": platform.node(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "rows": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
