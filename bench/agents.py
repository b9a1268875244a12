"""The coordinator's message rate through agents (tcp with CURVE) vs one machine (ipc).

bench/allreduce_script.py (an ordinary script: ``--iters`` all_reduce calls)
is captured three or more ways on this machine: a plain capture (ranks on
ipc://), and ``prism capture --agents N`` served by N ``prism agent``
processes, every rank talking tcp on loopback with CURVE. Each all_reduce is
``world`` arrivals and ``world`` results through the coordinator, so
messages/s = 2 * world / p50 (rank 0's per-call median). Prints the rates and
their ratios to ipc, and writes bench/results/agents-DATE[-MACHINE].json.

    python bench/agents.py                      # world 8, agents 2 and 4
    python bench/agents.py --world 16 --iters 200

On a machine with fewer cores than ranks every side is oversubscribed; read
the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import result_path  # noqa: E402
from coordinator import SCRIPT, parse  # noqa: E402

from prism.shell import runfolder  # noqa: E402
from transport.curve import make_keys  # noqa: E402
from transport.endpoints import free_tcp_endpoint  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def capture(world: int, args: list[str], agents: int, slots: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cmd = [sys.executable, "-m", "prism", "capture", "-n", str(world), "--out", "run", "--progress", "off",
               "--show-ranks", "none"] + (["--slots", str(slots)] if slots else [])
        procs = []
        if agents:
            make_keys(tmp / "keys")
            ep = free_tcp_endpoint()
            cmd += ["--agents", str(agents), "--listen", ep, "--keys", "keys"]
        cap = subprocess.Popen([*cmd, "--", SCRIPT, *args], cwd=tmp, env=ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
        for i in range(agents):
            procs.append(subprocess.Popen([sys.executable, "-m", "prism", "agent", "--coordinator", ep, "--keys",
                                           "keys", "--node-rank", str(i)], cwd=tmp, env=ENV,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        try:
            _, err = cap.communicate(timeout=1800)
            for p in procs:
                p.wait(timeout=60)
        finally:
            for p in (cap, *procs):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if cap.returncode != 0:
            raise RuntimeError(f"prism capture (agents {agents}) failed:\n{err[-3000:]}")
        return parse(runfolder.log_path(tmp / "run", 0).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--agents", default="2,4")
    ap.add_argument("--numel", type=int, default=1024, help="float32 elements (default 1024 = 4 KiB)")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--slots", type=int, default=None)
    ap.add_argument("--out", default=str(result_path("agents")))
    a = ap.parse_args()
    script_args = ["--numel", str(a.numel), "--iters", str(a.iters)]
    rows = []
    for n in [0, *(int(x) for x in a.agents.split(","))]:
        t0 = time.monotonic()
        r = capture(a.world, script_args, n, a.slots)
        rows.append({"agents": n, "transport": "ipc" if n == 0 else "tcp+CURVE", **r,
                     "msgs_per_s": 2 * a.world / (r["p50_ms"] / 1e3), "wall_s": time.monotonic() - t0})
    base = rows[0]["msgs_per_s"]
    print(f"{'agents':>6} {'transport':>10} {'p50 ms':>8} {'p99 ms':>8} {'msgs/s':>9} {'vs ipc':>7}")
    for r in rows:
        r["ratio"] = r["msgs_per_s"] / base
        print(f"{r['agents']:>6} {r['transport']:>10} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['msgs_per_s']:>9.0f} "
              f"{r['ratio']:>7.2f}")
    report = {"bench": "agents", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "command": " ".join([sys.executable, *sys.argv]), "machine": platform.node(), "cpus": os.cpu_count(),
              "world": a.world, "bytes": a.numel * 4, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
