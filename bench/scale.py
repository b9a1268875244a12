"""Emulation at scale: the bundled GPT captured small, emulated at thousands of ranks with one sandbox.

The GPT (tp2 pp2 dp2, world 8) is captured once; then ``prism emulate RUN
--sandbox R --scale-dp N`` runs it at each world (tp2 pp2 dpN/4) with one
sandbox rank, the last stage's dp-0 tp-0 rank (it prints the losses), under
a cluster profile (default the bundled ``h200_nvlink_ib400``: the fitted
gloo profile of a 2-core VM prices a 2,048-rank all-reduce as loopback TCP
would). Per world, from the emulation's ``summary.json``: the coordinator's
setup (load, scale-out, batch replay, engine) before the sandbox starts;
the sandbox's wall time per emulated iteration (its steps after the
warm-up) beside the emulated iteration itself (real-time emulation cannot
run faster than the job it emulates) and the coordinator's CPU per
iteration; the coordinator's peak RSS; live, folded, stepped and dormant
virtual ranks; the pacing lag p99 (how late a result left against its
emulated release on the sandbox's clock; negative: ahead, the rank holds
it).

    python bench/scale.py [--worlds 512,2048,8192] [--steps 6] [--net PROFILE] [--run RUN]
    python bench/scale.py --device cuda [--host-path]     # on a GPU: captured on GPU 0, the sandbox on GPU 0

With ``--device cuda`` the GPT runs on CUDA (``--device cuda``), the capture
on GPU 0 (``prism capture --gpus 0``: the eight ranks share it) and the
sandbox on GPU 0 on the device path (``prism emulate --gpus 0
--device-path``; ``--host-path`` without it).

Prints a table and writes ``bench/results/scale-DATE[-$BENCH_MACHINE].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import result_path  # noqa: E402

TP, PP, DP = 2, 2, 2


def prism(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prism", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)), cwd=ROOT)


def capture(run: pathlib.Path, steps: int, device: str = "cpu") -> float:
    t0 = time.perf_counter()
    gpu = ["--gpus", "0"] if device == "cuda" else []
    proc = prism("capture", "-n", str(TP * PP * DP), *gpu, "--out", str(run), "--progress", "off", "--", "-m",
                 "prism.workloads.gpt", "--tp", str(TP), "--pp", str(PP), "--dp", str(DP), "--steps", str(steps),
                 "--device", device)
    if proc.returncode:
        sys.exit(f"capture failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def emulate(run: pathlib.Path, world: int, net: str, gpu: list[str] = ()) -> dict:
    dp = world // (TP * PP)
    sandbox = TP * dp  # (tp 0, dp 0, pp 1): the last stage's rank that prints the losses
    t0 = time.perf_counter()
    proc = prism("emulate", str(run), "--sandbox", str(sandbox), "--scale-dp", str(dp), "--net", net, *gpu,
                 "--name", f"scale-{world}-{time.strftime('%H%M%S')}", "--progress", "off", "--json")
    wall = time.perf_counter() - t0
    if proc.returncode:  # kept as a row: the other worlds still run (a device call is dear)
        print(f"emulation at world {world} failed:\n{proc.stderr[-3000:]}\n{proc.stdout[-2000:]}", file=sys.stderr)
        return {"world": world, "dp": dp, "sandbox": sandbox, "process_wall_s": wall, "returncode": proc.returncode,
                "error": proc.stderr[-3000:]}
    s = json.loads(proc.stdout)
    co, rk = s["coordinator"], s["ranks"][str(sandbox)]
    walls = rk["wall_iteration_ns"][s["warmup"]:]
    return {
        "world": world, "dp": dp, "sandbox": sandbox, "process_wall_s": wall,
        "setup_s": co["load_s"] + co["setup_s"], "load_s": co["load_s"], "engine_setup_s": co["setup_s"],
        "wall_per_iteration_s": sum(walls) / len(walls) / 1e9 if walls else None,
        "emulated_iteration_s": s["emulated_mean_ns"] / 1e9 if s["emulated_mean_ns"] else None,
        "predicted_iteration_s": s["predicted_mean_ns"] / 1e9 if s["predicted_mean_ns"] else None,
        "coordinator_cpu_per_iteration_s": co["cpu_s_per_iteration"],
        "coordinator_peak_rss_bytes": co["peak_rss_bytes"],
        "sandbox_peak_rss_bytes": rk["peak_rss_bytes"],
        "prism_overhead_per_step_s": (rk["prism_overhead_ns"] / max(len(rk["wall_iteration_ns"]), 1) / 1e9
                                      if rk["prism_overhead_ns"] is not None else None),
        "live": s["live"], "folded": s["folded"], "stepped": s["stepped"], "dormant": s["dormant_ranks"],
        "engine_events": co["engine_events"],
        "lag_p99_ms": s["pacing"]["lag_p99_ns"] / 1e6, "lag_p50_ms": s["pacing"]["lag_p50_ns"] / 1e6,
        "turnaround_p99_ms": s["pacing"]["turnaround_p99_ns"] / 1e6,
        "losses": rk["losses"], "status": s["status"], "cost_model": s["cost_model"],
    }


def table(rows: list[dict]) -> str:
    head = (f"{'world':>6} {'setup s':>8} {'wall/iter s':>12} {'emul/iter s':>12} {'coord CPU/iter s':>17} "
            f"{'coord peak RSS':>15} {'live':>6} {'folded':>7} {'stepped':>8} {'dormant':>8} {'lag p99 ms':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['world']:>6,} {r['setup_s']:>8.2f} {r['wall_per_iteration_s']:>12.3f} "
                     f"{r['emulated_iteration_s']:>12.3f} {r['coordinator_cpu_per_iteration_s']:>17.3f} "
                     f"{r['coordinator_peak_rss_bytes'] / 2**20:>11,.0f} MiB {r['live']:>6,} {r['folded']:>7,} "
                     f"{r['stepped']:>8,} {r['dormant']:>8,} {r['lag_p99_ms']:>+11.3f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="512,2048,8192", help="emulated worlds, multiples of 8 (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=6, help="training steps captured and emulated (default: 6)")
    ap.add_argument("--net", default="h200_nvlink_ib400", help="cost profile (default: %(default)s)")
    ap.add_argument("--run", default=None, help="an existing capture of the GPT tp2 pp2 dp2 (default: capture one)")
    ap.add_argument("--json", default=None, help="output path (default: bench/results/scale-DATE[-MACHINE].json)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: captured on GPU 0 and the sandbox on GPU 0 (default: %(default)s)")
    ap.add_argument("--host-path", action="store_true", help="--device cuda: the sandbox's calls through the host "
                    "(no --device-path)")
    args = ap.parse_args()
    gpu = [] if args.device == "cpu" else ["--gpus", "0"] + ([] if args.host_path else ["--device-path"])
    worlds = [int(w) for w in args.worlds.split(",")]
    with tempfile.TemporaryDirectory(prefix="prism-scale-") as tmp:
        run = pathlib.Path(args.run) if args.run else pathlib.Path(tmp) / "gpt"
        capture_s = None if args.run else capture(run, args.steps, args.device)
        rows = []
        for w in worlds:
            rows.append(emulate(run, w, args.net, gpu))
            print(f"world {w:,}: {'failed' if 'error' in rows[-1] else 'done'} in {rows[-1]['process_wall_s']:.1f} s",
                  file=sys.stderr, flush=True)
    ok = [r for r in rows if "error" not in r]
    print(table(ok))
    for r in rows:
        if "error" in r:
            print(f"world {r['world']:,}: failed (exit {r['returncode']}); its stderr is in the JSON")
    base = ok[0]["wall_per_iteration_s"] if ok else None
    for r in ok[1:] if ok and ok[0]["world"] == rows[0]["world"] else []:
        print(f"wall per emulated iteration at {r['world']:,}: {r['wall_per_iteration_s'] / base:.2f}x that at "
              f"{rows[0]['world']:,}")
    doc = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": platform.platform(),
           "cpus": os.cpu_count(), "python": platform.python_version(), "command": " ".join(sys.argv),
           "capture": {"layout": {"tp": TP, "pp": PP, "dp": DP}, "steps": args.steps, "wall_s": capture_s},
           "net": args.net, "device": args.device, "emulate_options": gpu, "rows": rows}
    path = pathlib.Path(args.json) if args.json else result_path("scale")
    path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")
    return 1 if len(ok) < len(rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
