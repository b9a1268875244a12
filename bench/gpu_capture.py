"""GPU capture measurements in one run (made for one device call on an H200).

    PYTHONUNBUFFERED=1 python bench/gpu_capture.py --out-dir DIR [--quick]

Sections (each guarded by a timeout; a failure is recorded and the next runs):

1. ``env``       torch, GPU, driver.
2. ``mode``      cost of the logical-device TorchFunctionMode per torch call.
3. ``swap_raw``  checkpoint/restore of a process holding 1 and 8 GiB: seconds,
                 GB/s out and in, GPU memory freed, data checked after restore.
4. ``world2``    the bundled GPT at world 2 with ``--device cuda:0`` (both
                 ranks on the one GPU) vs a CPU capture with the same seeds:
                 losses, and ``prism trace summary`` of the GPU run.
5. ``gpt8``      GPT tp2 pp2 dp2 (world 8) on one GPU: all resident, then
                 ``--resident 4`` with gangs 1, tp, tpxpp; and on CPU. Losses
                 vs the all-resident capture and the CPU one; wall time, swaps
                 per iteration, seconds swapping, GB/s.
6. ``moe8``      MoE (tp2 pp2 dp2 ep2, 4 experts) the same way (gang tp).
7. ``scale``     all-resident GPT captures at world 8, 16, 32: host (RSS, PSS)
                 and device (GPU memory) cost per rank.

Writes ``DIR/gpu_capture.json`` (updated after every section) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from prism.shell import runfolder  # noqa: E402

LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)
RESULTS: dict = {}
RUNS_DIR = [Path("/tmp/prism-gpu-bench")]
#: ``prism capture --gpus`` for every GPU capture (None: every GPU NVML sees).
GPUS: list[str | None] = [None]


def save(out_dir: Path) -> None:
    (out_dir / "gpu_capture.json").write_text(json.dumps(RESULTS, indent=1, default=str) + "\n")


def section(name: str, out_dir: Path):
    def deco(fn):
        def run(*a, **kw):
            t0 = time.time()
            print(f"=== {name}", flush=True)
            try:
                RESULTS[name] = fn(*a, **kw)
            except Exception as e:  # recorded, the next section runs
                import traceback

                RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
                print(RESULTS[name]["traceback"], flush=True)
            RESULTS.setdefault("section_seconds", {})[name] = round(time.time() - t0, 1)
            save(out_dir)
        return run
    return deco


def env_info() -> dict:
    import torch

    out = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "torch": torch.__version__,
           "python": sys.version.split()[0], "cuda_available": torch.cuda.is_available()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        out["nvidia_smi"] = str(e)
    out["cpus"] = os.cpu_count()
    return out


def mode_cost() -> dict:
    import torch

    from prism.rank.devices import LogicalDeviceMode

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(16, device=dev)

    def loop(n=20000):
        t = time.perf_counter()
        for _ in range(n):
            x.add(1)
            x.to(dev)
        if dev == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / (2 * n) * 1e6

    loop(2000)
    plain = min(loop() for _ in range(3))
    with LogicalDeviceMode():
        loop(2000)
        mode = min(loop() for _ in range(3))
    return {"device": dev, "us_per_call_plain": round(plain, 3), "us_per_call_mode": round(mode, 3),
            "us_added": round(mode - plain, 3)}


def swap_raw(sizes=(1.0, 8.0)) -> dict:
    from prism.shell import swap, telemetry

    drv = swap.CheckpointDriver()
    out = {}
    for gib in sizes:
        holder = subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / "gpu_holder.py"), str(gib)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().startswith("ready")
            ex = swap.SwapExecutor(drv, memory_of=telemetry.process_memory)
            o = ex.swap_out(0, holder.pid)
            mem_out = telemetry.process_memory(holder.pid)
            i = ex.swap_in(0, holder.pid)
            holder.stdin.write("check\n")
            holder.stdin.flush()
            check = holder.stdout.readline().strip()
            out[f"{gib:g}GiB"] = {"process_gpu_bytes": o.bytes, "out_s": round(o.seconds, 4),
                                  "in_s": round(i.seconds, 4), "gb_s_out": round(o.bytes / o.seconds / 1e9, 3),
                                  "gb_s_in": round(o.bytes / i.seconds / 1e9, 3),
                                  "gpu_bytes_while_out": mem_out, "data_after_restore": check}
        finally:
            holder.kill()
            holder.wait()
            holder.stdin.close()
            holder.stdout.close()
    return out


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class HostSampler:
    """Peak RSS and PSS summed over a process's descendants."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        self.pid, self.every = pid, every
        self.peak_rss = self.peak_pss = self.peak_n = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        # /proc directly (psutil is not on every machine): the rank processes
        # are the fork server's children, so their command line is its.
        while not self._stop.wait(self.every):
            rss = pss = n = 0
            for pid in _descendants(self.pid):
                try:
                    if b"forkserver" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                        continue
                    roll = Path(f"/proc/{pid}/smaps_rollup").read_text()
                except OSError:
                    continue
                fields = dict(line.split(":", 1) for line in roll.splitlines()[1:] if ":" in line)
                rss += int(fields.get("Rss", "0 kB").split()[0]) * 1024
                pss += int(fields.get("Pss", "0 kB").split()[0]) * 1024
                n += 1
            self.peak_rss, self.peak_pss, self.peak_n = max(self.peak_rss, rss), max(self.peak_pss, pss), max(self.peak_n, n)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def capture(out_dir: Path, name: str, world: int, workload: list[str], opts: list[str], timeout: float = 240,
            sample_host: bool = False) -> dict:
    run = RUNS_DIR[0] / name
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "prism", "capture", "-n", str(world), "--out", str(run), "--progress", "off",
           "--quiet-period", "30", "--show-ranks", "none", *opts,
           *(["--gpus", GPUS[0]] if GPUS[0] and "--device" in workload and "cpu" not in workload else []), "--", "-m", "prism.workloads.gpt", *workload]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    host = HostSampler(proc.pid) if sample_host else None
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
        text += f"\n[bench: killed after {timeout} s]"
    wall = time.time() - t0
    if host:
        host.stop()
    res = {"rc": proc.returncode, "wall_s": round(wall, 2), "cmd": " ".join(cmd[1:]), "tail": text[-1500:]}
    losses = []
    logs = run / runfolder.LOGS_DIR
    for log in sorted(logs.glob("rank-*.log")) if logs.exists() else []:
        found = LOSS.findall(log.read_text(errors="replace"))
        if found:
            losses = [float(v) for _, v in found]
            break
    res["losses"] = losses
    swaps = runfolder.swap_report_path(run)
    if swaps.exists():
        res["swaps"] = json.loads(swaps.read_text())["summary"]
    gpu = runfolder.gpu_samples_path(run)
    if gpu.exists():
        rows = [json.loads(line) for line in gpu.read_text().splitlines() if line.strip()]
        if rows:
            used = [r["mem_used"] for r in rows if r.get("mem_used") is not None]
            res["gpu_mem_baseline"] = used[0]
            res["gpu_mem_peak"] = max(used)
            res["gpu_samples"] = len(rows)
            res["gpu_peak_util"] = max((r.get("util_gpu") or 0) for r in rows)
            res["gpu_max_temp_c"] = max((r.get("temp_c") or 0) for r in rows)
            res["gpu_max_power_w"] = max((r.get("power_w") or 0) for r in rows)
            res["gpu_throttle_seen"] = sorted({t for r in rows for t in r.get("throttle", [])})
    if host:
        res["host_peak_rss"], res["host_peak_pss"], res["host_ranks_seen"] = host.peak_rss, host.peak_pss, host.peak_n
    print(f"  {name}: rc {res['rc']} wall {res['wall_s']} s losses {losses} "
          f"swaps {res.get('swaps', {}).get('swaps')}", flush=True)
    return res


def rel_diff(a: list[float], b: list[float]) -> float | None:
    if not a or len(a) != len(b):
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="fewer configurations (smoke test)")
    ap.add_argument("--only", default="", help="comma-separated sections")
    ap.add_argument("--table", metavar="JSON", help="only print the table of an earlier run's JSON")
    ap.add_argument("--runs-dir", default="/tmp/prism-gpu-bench", help="where the captures go")
    ap.add_argument("--gpus", default=None, help="--gpus for the GPU captures (default: all GPUs)")
    ap.add_argument("--gangs", default=None, help="gangs for gpt8 (default tp,1,tpxpp)")
    ap.add_argument("--scale-worlds", default=None, help="worlds for the scale section (default 8,16,32)")
    ap.add_argument("--scale-slots", type=int, default=8)
    ap.add_argument("--scale-steps", type=int, default=2)
    ap.add_argument("--scale-timeout", type=float, default=150)
    ap.add_argument("--swap-timeout", type=float, default=150)
    ap.add_argument("--resident", type=int, default=4, help="--resident for the swapped world-8 captures")
    ap.add_argument("--skip-all-resident", action="store_true",
                    help="moe8: compare the swapped capture with the CPU capture only")
    ap.add_argument("--cpu-worlds", default="256,1024", help="worlds for the cpu_scale section")
    ap.add_argument("--cpu-slots", type=int, default=16)
    ap.add_argument("--cpu-timeout", type=float, default=300)
    a = ap.parse_args()
    RUNS_DIR[0] = Path(a.runs_dir)
    GPUS[0] = a.gpus
    if a.table:
        RESULTS.update(json.loads(Path(a.table).read_text()))
        print_table()
        return 0
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, a.only.split(",")))

    def want(name):
        return not only or name in only

    RESULTS["command"] = " ".join(sys.argv)
    section("env", out_dir)(env_info)()
    if want("swap_raw"):
        section("swap_raw", out_dir)(swap_raw)((0.5,) if a.quick else (1.0, 4.0))

    steps = "2"

    def world2():
        wl = ["--dp", "2", "--steps", steps]
        gpu = capture(out_dir, "w2-cuda0", 2, wl + ["--device", "cuda:0"], [])
        cpu = capture(out_dir, "w2-cpu", 2, wl + ["--device", "cpu"], [])
        summ = subprocess.run([sys.executable, "-m", "prism", "trace", "summary", str(RUNS_DIR[0] / "w2-cuda0")],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        return {"gpu": gpu, "cpu": cpu, "max_rel_loss_diff": rel_diff(gpu["losses"], cpu["losses"]),
                "trace_summary": summ.stdout[-6000:] + summ.stderr[-1000:]}

    if want("world2"):
        section("world2", out_dir)(world2)()

    def world8(kind: str, extra: list[str], gangs: list[str], all_resident: bool = True):
        wl = ["--tp", "2", "--pp", "2", "--dp", "2", "--steps", steps, *extra]
        out = {}
        if all_resident:
            out["all_resident"] = capture(out_dir, f"{kind}-all", 8, wl + ["--device", "cuda"], [])
        RESULTS[kind] = out

        def check():
            ref, cpu = out.get("all_resident", {}).get("losses", []), out.get("cpu", {}).get("losses", [])
            out["loss_check"] = {k: {"vs_all_resident": rel_diff(v["losses"], ref), "vs_cpu": rel_diff(v["losses"], cpu)}
                                 for k, v in out.items() if isinstance(v, dict) and "losses" in v}
            save(out_dir)

        for i, g in enumerate(gangs):
            out[f"resident{a.resident}_gang_{g}"] = capture(out_dir, f"{kind}-r{a.resident}-{g}", 8, wl + ["--device", "cuda"],
                                                 ["--resident", str(a.resident), "--gang", g], timeout=a.swap_timeout)
            if i == 0:
                out["cpu"] = capture(out_dir, f"{kind}-cpu", 8, wl + ["--device", "cpu"], ["--slots", "8"])
            check()
        return out

    if want("gpt8"):
        gangs = a.gangs.split(",") if a.gangs else (["tp"] if a.quick else ["tp", "1", "tpxpp"])
        section("gpt8", out_dir)(world8)("gpt8", [], gangs)
    if want("moe8"):
        section("moe8", out_dir)(world8)("moe8", ["--ep", "2", "--experts", "4"], ["tp"], not a.skip_all_resident)

    if want("mode"):
        section("mode", out_dir)(mode_cost)()

    def scale():
        out = {}
        worlds = [int(w) for w in a.scale_worlds.split(",")] if a.scale_worlds else ([8] if a.quick else [8, 16, 32])
        for world in worlds:
            dp = world // 4
            r = capture(out_dir, f"scale-{world}", world,
                        ["--tp", "2", "--pp", "2", "--dp", str(dp), "--steps", str(a.scale_steps), "--device", "cuda"],
                        ["--slots", str(a.scale_slots)], sample_host=True, timeout=a.scale_timeout)
            if "gpu_mem_peak" in r:
                r["device_bytes_per_rank"] = (r["gpu_mem_peak"] - r["gpu_mem_baseline"]) // world
            if r.get("host_peak_rss"):
                r["host_rss_per_rank"] = r["host_peak_rss"] // world
                r["host_pss_per_rank"] = r["host_peak_pss"] // world
            r["wall_per_rank_s"] = round(r["wall_s"] / world, 3)
            out[str(world)] = r
        return out

    if want("scale"):
        section("scale", out_dir)(scale)()

    def cpu_scale():
        """The bundled GPT on CPU at large worlds (issue 6: goal 1,024 ranks on 16 cores)."""
        out = {}
        for world in [int(w) for w in a.cpu_worlds.split(",")]:
            dp = world // 4
            r = capture(out_dir, f"cpu-{world}", world,
                        ["--tp", "2", "--pp", "2", "--dp", str(dp), "--steps", "2", "--layers", "2", "--hidden", "32",
                         "--seq-len", "16", "--device", "cpu"],
                        ["--slots", str(a.cpu_slots)], sample_host=True, timeout=a.cpu_timeout)
            if r.get("host_peak_rss"):
                r["host_rss_per_rank"] = r["host_peak_rss"] // world
                r["host_pss_per_rank"] = r["host_peak_pss"] // world
            out[str(world)] = r
            save(out_dir)
            if r["rc"] != 0:
                break
        return out

    if want("cpu_scale"):
        section("cpu_scale", out_dir)(cpu_scale)()
    save(out_dir)
    print_table()
    return 0


def print_table() -> None:
    """One row per capture, then the raw swap and mode figures."""
    print(f"{'capture':<28} {'rc':>3} {'wall s':>8} {'swaps':>6} {'/iter':>6} {'swap s':>7} "
          f"{'GB/s out':>8} {'GB/s in':>8} {'loss vs ref':>11} {'loss vs cpu':>11}")
    for sec in ("world2", "gpt8", "moe8", "scale", "cpu_scale"):
        block = RESULTS.get(sec)
        if not isinstance(block, dict):
            continue
        checks = block.get("loss_check", {})
        for name, r in block.items():
            if not isinstance(r, dict) or "rc" not in r:
                continue
            sw = r.get("swaps") or {}
            chk = checks.get(name, {})
            if sec == "world2" and name == "gpu":
                chk = {"vs_cpu": block.get("max_rel_loss_diff")}

            def f(x, fmt):
                return format(x, fmt) if isinstance(x, (int, float)) else "-"

            print(f"{sec + '/' + name:<28} {r['rc']:>3} {r['wall_s']:>8.1f} {f(sw.get('swaps'), 'd'):>6} "
                  f"{f(sw.get('swaps_per_iteration'), '.1f'):>6} {f(sw.get('seconds_total'), '.1f'):>7} "
                  f"{f(sw.get('gb_per_s_out'), '.2f'):>8} {f(sw.get('gb_per_s_in'), '.2f'):>8} "
                  f"{f(chk.get('vs_all_resident'), '.1e'):>11} {f(chk.get('vs_cpu'), '.1e'):>11}")
    for size, r in (RESULTS.get("swap_raw") or {}).items():
        if isinstance(r, dict) and "out_s" in r:
            print(f"raw swap {size}: {r['process_gpu_bytes'] / 1e9:.2f} GB out {r['out_s']} s ({r['gb_s_out']} GB/s), "
                  f"in {r['in_s']} s ({r['gb_s_in']} GB/s), data {r['data_after_restore'].split()[0]}")
    m = RESULTS.get("mode")
    if isinstance(m, dict) and "us_added" in m:
        print(f"logical-device mode on {m['device']}: +{m['us_added']} us per torch call "
              f"({m['us_per_call_plain']} -> {m['us_per_call_mode']})")


if __name__ == "__main__":
    sys.exit(main())
