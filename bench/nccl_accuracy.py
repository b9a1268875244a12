"""Phase-1 fidelity against real NCCL runs: ground truth on one GPU per rank vs
Prism capturing the same script on fewer GPUs and predicting it.

    PYTHONUNBUFFERED=1 python bench/nccl_accuracy.py --out-dir DIR [--runs 3] [--capture-gpus 1,2]

Per configuration (a layout of the bundled GPT or MoE, or the FSDP2 script
written the way users write it), runs interleave (truth, Prism on 1 GPU,
Prism on 2 GPUs, truth, ...):

truth
    the unmodified script, plain torch.distributed over NCCL, one process per
    GPU (``cuda:LOCAL_RANK``), run by the step clock
    (``prism/validation/stepclock.py``) with
    ``PRISM_STEPCLOCK_SYNC=1`` (each optimizer step's end is taken after
    ``torch.cuda.synchronize``). Iteration time: gap between the job's step
    ends (the last rank's), mean over the steps after ``--warmup``. Memory per
    rank: ``torch.cuda.max_memory_allocated`` after the last step, and NVML's figure for
    the process after step 2 against ``memory_reserved`` (what lives outside
    torch's caching allocator: CUDA context, cuBLAS workspaces, NCCL's own
    buffers).
prism on K GPUs
    ``prism capture`` of the same command with ``--gpus 0..K-1`` (logical
    devices: every rank still sees ``cuda:LOCAL_RANK``; one rank computes per
    GPU at a time; ranks resident), replayed with the NCCL profile fitted by
    ``prism netprofile --backend nccl`` on this machine (fitted first if there
    is none). Memory per rank: the largest ``peak_allocated`` of the rank's
    Memory events in the trace; the stepclock also runs inside the capture, so
    the same NVML/reserved figures exist for Prism's ranks (no NCCL there).

Prints, per configuration: truth mean and noise floor (CV of the run means),
per capture: Prism mean, median paired error and its 95% bootstrap CI over
runs; per rank: peak allocated truth vs Prism, and the memory outside the
allocator in both (their difference is NCCL's own). Writes
``DIR/nccl_accuracy.json``.

``--variant NAME:KEY=VAL[,KEY=VAL]`` (repeatable) also captures every run on
every GPU count with those environment settings, recorded as ``K@NAME``
beside ``K`` and compared with the same truth: e.g. ``--variant
cal:PRISM_GPU_CALIBRATE=2-7`` measures the GPU time of every step after the
warm-up instead of steps 2-3 only. ``--device cpu`` runs the same pipeline with gloo
and CPU captures (a smoke test for machines without GPUs).
"""

from __future__ import annotations

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
from unittest import mock

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from accuracy import bootstrap_median_ci, job_step_ends, mean_iteration  # noqa: E402

from prism.app.capture import capture_run  # noqa: E402
from prism.core import trace as T  # noqa: E402
from prism.shell import runfolder  # noqa: E402
from prism.shell.profiles import load_profile  # noqa: E402
from prism.core.graph import ExecutionGraph  # noqa: E402
from prism.core.replay import replay_batch  # noqa: E402
from prism.app.netprofile import fitted_profile_path, measure  # noqa: E402
from prism.core.netfit import fit_points, profile_toml  # noqa: E402
from prism.validation.truthrun import STEPCLOCK, launch_truth, read_clocks  # noqa: E402

FSDP2 = str(ROOT / "prism" / "workloads" / "frameworks" / "fsdp2.py")
#: GPT size for a GPU: an iteration of tens of ms on an H200, a few GB per rank.
GPT = ["--hidden", "1024", "--layers", "4", "--heads", "16", "--seq-len", "512", "--batch", "8",
       "--micro-batches", "2", "--vocab", "4096"]
GPT_CPU = ["--hidden", "64", "--layers", "2", "--heads", "4", "--seq-len", "32", "--batch", "2"]
#: FSDP2 for a GPU. At --dim 1024 --hidden 4096 each all-gather carried 268 MB
#: and a capture on 2 H200s took ~40 s per step (every payload goes through
#: the coordinator; bench/results/archive/nccl_accuracy-2026-11.md, section 6): 4x less
#: traffic, more samples.
FSDP2_GPU = ["--dim", "512", "--hidden", "2048", "--layers", "4", "--batch", "4096"]
FSDP2_CPU = ["--dim", "16", "--hidden", "32", "--layers", "2", "--batch", "4"]


def configs(world: int, device: str) -> dict[str, tuple[list[str], dict[str, int]]]:
    """name -> (command without --steps, layout)."""
    gpt_size = GPT if device == "cuda" else GPT_CPU
    dev = ["--device", device]

    def gpt(tp=1, pp=1, dp=1, ep=1, experts=0):
        flags = ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp)]
        if experts:
            flags += ["--ep", str(ep), "--experts", str(experts)]
        return ["-m", "prism.workloads.gpt", *flags, *gpt_size, *dev], {"tp": tp, "pp": pp, "dp": dp}

    out = {}
    if world == 2:
        out["gpt-tp2"] = gpt(tp=2)
        out["gpt-pp2"] = gpt(pp=2)
        out["moe-dp2-ep2"] = gpt(dp=2, ep=2, experts=4)
    else:
        out[f"gpt-tp2-dp{world // 2}"] = gpt(tp=2, dp=world // 2)
        out[f"gpt-tp2-pp2-dp{world // 4}"] = gpt(tp=2, pp=2, dp=world // 4)
        out[f"moe-tp2-dp{world // 2}-ep2"] = gpt(tp=2, dp=world // 2, ep=2, experts=4)
    out["fsdp2"] = ([FSDP2, *(FSDP2_GPU if device == "cuda" else FSDP2_CPU)], {"dp": world})
    return out


def with_steps(cmd: list[str], steps: int) -> list[str]:
    return [*cmd, "--steps", str(steps)]


def mem_summary(mem: dict) -> dict:
    out = {}
    if "mem-peak" in mem:
        out["max_allocated"], out["max_reserved"] = mem["mem-peak"][1:3]
    if "mem-step" in mem:
        _, nvml, reserved, allocated = mem["mem-step"][:4]
        out.update(nvml_process=nvml, reserved_at_step=reserved, allocated_at_step=allocated)
        if nvml >= 0:
            out["outside_allocator"] = nvml - reserved
    return out


def run_truth(world: int, cmd: list[str], tmp: pathlib.Path, timeout: float, device: str) -> dict:
    d = pathlib.Path(tempfile.mkdtemp(prefix="truth-", dir=tmp))
    t0 = time.monotonic()
    launch_truth(world, cmd, d, timeout)
    ends, mems = read_clocks(d, world)
    shutil.rmtree(d, ignore_errors=True)
    return {"ends": job_step_ends(ends), "wall_s": time.monotonic() - t0, "memory": [mem_summary(m) for m in mems]}


def run_prism(world: int, cmd: list[str], layout: dict, tmp: pathlib.Path, n_gpus: int, device: str,
              name: str = "run") -> dict:
    d = pathlib.Path(tempfile.mkdtemp(prefix="prism-", dir=tmp))
    run = d / "run"
    clocks = d / "clock"
    clocks.mkdir()
    os.environ["PRISM_STEPCLOCK_DIR"] = str(clocks)
    os.environ["PRISM_STEPCLOCK_SYNC"] = "1"
    plan = None
    if device == "cuda":
        from prism.shell.gpu_plan import plan_gpus

        plan = plan_gpus(world, layout, uses_cuda=True, gpus=",".join(map(str, range(n_gpus))),
                         resident=None, gang=None, slots=None)
    slots = plan.slots if plan is not None else world
    t0 = time.monotonic()
    # One node of `world` GPUs, as the truth run has: on as many GPUs as ranks
    # the logical devices are the physical ones (no remapping, no mode).
    status = capture_run(run, world, [STEPCLOCK, *cmd], slots=slots, show_ranks=(), progress="off", gpu=plan,
                         nproc_per_node=world).exit_code
    wall = time.monotonic() - t0
    if status != 0:
        raise RuntimeError(f"prism capture on {n_gpus} GPU(s) failed with status {status}; kept {run}")
    events = runfolder.read_run(run).ranks
    peaks = {r: max((e.peak_allocated for e in evs if isinstance(e, T.Memory)), default=None)
             for r, evs in events.items()}
    _, mems = read_clocks(clocks, world)
    keep = os.environ.get("NCCL_ACCURACY_KEEP")
    if keep:  # the capture's trace for later study (rank files, manifest, telemetry)
        # config, GPUs, then the temporary name (unique); the manifest has the command and its time
        dst = pathlib.Path(keep) / f"{name}-{n_gpus}gpu-{d.name}"
        shutil.copytree(run, dst, ignore=shutil.ignore_patterns("logs", "*.sock"))
    out = {"graph": ExecutionGraph.from_events(events), "wall_s": wall,
           "memory": [{**mem_summary(mems[r]), "trace_peak_allocated": peaks.get(r)} for r in range(world)],
           "resident": plan.settings if plan is not None else None}
    shutil.rmtree(d, ignore_errors=True)
    return out


def ensure_profile(net: str | None, device: str):
    if net:
        return load_profile(net), net
    backend = "nccl" if device == "cuda" else "gloo"
    path = fitted_profile_path(backend, socket.gethostname())
    if not path.is_file():
        import torch

        n = torch.cuda.device_count() if backend == "nccl" else 2
        sizes = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28)
        if backend == "gloo":
            sizes = sizes[:6]
        gs = [g for g in (2, 4, 8) if g <= n]
        print(f"no fitted {backend} profile at {path}: measuring ({gs} ranks)", flush=True)
        points = measure(sizes, gs, ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                                     "all_to_all_single", "send"), backend=backend)
        text = profile_toml(fit_points(points), points, host=socket.gethostname(), backend=backend,
                            ranks_per_node=max(n, 2), command="bench/nccl_accuracy.py (netprofile defaults)",
                            date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return load_profile(path), str(path)


def fmt_bytes(x) -> str:
    return f"{x / 2**20:.0f}" if isinstance(x, (int, float)) and x >= 0 else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--world", type=int, default=None, help="ranks (default: the GPU count)")
    ap.add_argument("--configs", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--capture-gpus", default="1,2", help="GPU counts Prism captures on (default 1,2)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--net", default=None, help="cost profile (default: the fitted NCCL profile of this host)")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--keep-runs", default=None, metavar="DIR", help="copy each Prism capture's trace into DIR")
    ap.add_argument("--budget", type=float, default=None, metavar="S",
                    help="stop starting new configurations after S seconds (results so far are kept)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VAL[,KEY=VAL]",
                    help="also capture with these environment settings, recorded as K@NAME "
                         "(e.g. cal:PRISM_GPU_CALIBRATE=2-7); repeatable")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    variants = parse_variants(a.variant)
    import torch

    t_start = time.monotonic()
    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    if a.keep_runs:
        os.environ["NCCL_ACCURACY_KEEP"] = a.keep_runs
        pathlib.Path(a.keep_runs).mkdir(parents=True, exist_ok=True)
    world = a.world or (gpus if a.device == "cuda" else 2)
    if a.device == "cuda" and world > gpus:
        sys.exit(f"--world {world} needs one GPU per rank for the NCCL ground truth; {gpus} here")
    counts = [int(x) for x in a.capture_gpus.split(",")] if a.device == "cuda" else [0]
    if any(k > gpus for k in counts if a.device == "cuda"):
        sys.exit(f"--capture-gpus {a.capture_gpus}: only {gpus} GPUs here")
    # (label, GPUs, environment): "1", "2", then "1@NAME", "2@NAME" per variant
    caps = [(str(k), k, {}) for k in counts] + [(f"{k}@{v}", k, env) for v, env in variants.items() for k in counts]
    table = configs(world, a.device)
    names = a.configs.split(",") if a.configs else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        sys.exit(f"unknown config {unknown[0]!r}; known at world {world}: {', '.join(table)}")
    model, profile_path = ensure_profile(a.net, a.device)
    out_dir = pathlib.Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out: dict = {
        "benchmark": "nccl_accuracy", "date_utc": date, "command": "python " + " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "host": socket.gethostname(), "gpus": gpus,
                    "gpu_name": torch.cuda.get_device_name(0) if gpus else None, "cpus": os.cpu_count()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None},
        "device": a.device, "world": world, "steps": a.steps, "warmup": a.warmup, "runs": a.runs,
        "capture_gpus": counts, "variants": variants, "cost_profile": {"path": profile_path, "name": model.name,
                                               "description": model.description},
        "configs": [],
    }
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="prism-nccl-accuracy-"))
    try:
        for name in names:
            if a.budget and time.monotonic() - t_start > a.budget:
                print(f"budget of {a.budget:.0f} s spent: {name} and later configurations not run", flush=True)
                out.setdefault("not_run", []).append(name)
                continue
            cmd, layout = table[name]
            cmd = with_steps(cmd, a.steps)
            row: dict = {"config": name, "command": cmd, "truth": [], "prism": {label: [] for label, _, _ in caps}}
            out["configs"].append(row)
            try:
                for i in range(a.runs):
                    t = run_truth(world, cmd, tmp, a.timeout, a.device)
                    t_mean = mean_iteration(t["ends"], a.warmup)
                    # ends_ns: CLOCK_MONOTONIC, to set beside bench/cpu_noise.py --sample's log
                    row["truth"].append({"mean_ns": t_mean, "step_ns": np.diff(t["ends"]).tolist(),
                                         "ends_ns": [int(x) for x in t["ends"]],
                                         "wall_s": t["wall_s"], "memory": t["memory"]})
                    msg = f"{name} run {i}: truth {t_mean / 1e6:.2f} ms"
                    for label, k, env in caps:
                        t_cap = time.monotonic_ns()
                        suffix = label.partition("@")[2]
                        with mock.patch.dict(os.environ, env):
                            p = run_prism(world, cmd, layout, tmp, k, a.device,
                                          name=f"{name}-run{i}" + (f"-{suffix}" if suffix else ""))
                        g = p["graph"]
                        res = replay_batch(g, cost_model=model)
                        p_mean = res.mean_iteration_time(a.warmup)
                        err = abs(p_mean - t_mean) / t_mean
                        # the same capture replayed with one clock (wall times), as before PrismTrace 1.1
                        one = replay_batch(g, g.dur, cost_model=model).mean_iteration_time(a.warmup)
                        row["prism"][label].append({"mean_ns": p_mean, "step_ns": list(map(float, res.iteration_times)),
                                                     "one_clock_mean_ns": one, "two_clock": g.cpu is not None,
                                                     "capture_wall_s": p["wall_s"], "error": err,
                                                     "capture_start_ns": t_cap,
                                                     "memory": p["memory"], "gpu_plan": p["resident"],
                                                     "clocks": clock_summary(g)})
                        msg += (f", prism {label} {p_mean / 1e6:.2f} ms ({err:+.1%} abs, one-clock {one / 1e6:.2f} ms, "
                                f"capture {p['wall_s']:.0f} s)")
                    print(msg, flush=True)
                    # each run on disk as it ends (a call's time limit may stop the next)
                    summarise(row, caps)
                    (out_dir / "nccl_accuracy.json").write_text(json.dumps(out, indent=1, default=str))
            except Exception as e:  # recorded; the next configuration runs
                row["error"] = f"{type(e).__name__}: {e}"[-3000:]
                print(f"{name}: FAILED: {row['error']}", flush=True)
            summarise(row, caps)
            (out_dir / "nccl_accuracy.json").write_text(json.dumps(out, indent=1, default=str))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_report(out)
    (out_dir / "nccl_accuracy.json").write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {out_dir / 'nccl_accuracy.json'}")
    return 0


def clock_summary(g) -> dict | None:
    """Per rank 0, summed over the steps after step 2: wall, CPU share and GPU
    time of its compute segments (ms per step), and how many segments join."""
    if g.cpu is None:
        return None
    from prism.core.graph import COMPUTE

    m = (g.kind == COMPUTE) & (g.rank == 0) & (g.step >= 3)
    steps = max(len(np.unique(g.step[m])), 1)
    return {"wall_ms": float(g.dur[m].sum()) / steps / 1e6, "cpu_ms": float(g.cpu[m].sum()) / steps / 1e6,
            "gpu_ms": float(g.gpu[m].sum()) / steps / 1e6, "segments": int(m.sum()) // steps,
            "joins": int(g.join[m].sum()) // steps}


def parse_variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """``["cal:PRISM_GPU_CALIBRATE=2-7,X=1"]`` -> ``{"cal": {...}}``; a bad
    spec exits with what was wrong."""
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        name, sep, rest = spec.partition(":")
        if not sep or not name or not name.isidentifier() or name in out:
            sys.exit(f"--variant {spec!r}: expected NAME:KEY=VAL[,KEY=VAL] with a new identifier as NAME")
        env = {}
        for item in rest.split(","):
            key, eq, val = item.partition("=")
            if not eq or not key:
                sys.exit(f"--variant {spec!r}: {item!r} is not KEY=VAL")
            env[key] = val
        out[name] = env
    return out


def summarise(row: dict, caps: list) -> None:
    truth = [r["mean_ns"] for r in row["truth"]]
    if not truth:
        return
    row["truth_mean_ms"] = statistics.mean(truth) / 1e6
    row["noise_floor_cv"] = statistics.stdev(truth) / statistics.mean(truth) if len(truth) > 1 else None
    row["summary"] = {}
    for label, _, _ in caps:
        runs = row["prism"][label]
        if not runs:
            continue
        errs = [r["error"] for r in runs]
        lo, hi = bootstrap_median_ci(errs)
        row["summary"][label] = {"prism_mean_ms": statistics.mean(r["mean_ns"] for r in runs) / 1e6,
                                  "one_clock_mean_ms": statistics.mean(r.get("one_clock_mean_ns", r["mean_ns"])
                                                                       for r in runs) / 1e6,
                                  "median_error": statistics.median(errs), "error_ci95": [lo, hi],
                                  "signed_mean_error": statistics.mean(
                                      (r["mean_ns"] - t) / t for r, t in zip(runs, truth))}


def print_report(out: dict) -> None:
    print()
    print(f"NCCL accuracy: world {out['world']}, {out['runs']} interleaved runs, {out['steps']} steps "
          f"({out['warmup']} warm-up); profile {out['cost_profile']['name']}; {out['date_utc']}; "
          f"{out['machine']['gpus']} x {out['machine']['gpu_name']}; torch {out['versions']['torch']}")
    print(f"{'config':<16} {'truth ms':>9} {'noise CV':>9} {'GPUs':>5} {'prism ms':>9} {'signed':>8} "
          f"{'median err':>10} {'95% CI':>15} {'1-clock ms':>10}")
    for row in out["configs"]:
        if "truth_mean_ms" not in row:
            print(f"{row['config']:<16} {row.get('error', 'no runs')[:100]}")
            continue
        cv = row["noise_floor_cv"]
        for k, s in row.get("summary", {}).items():
            print(f"{row['config']:<16} {row['truth_mean_ms']:>9.2f} {(f'{cv:.1%}' if cv is not None else '-'):>9} "
                  f"{k:>5} {s['prism_mean_ms']:>9.2f} {s['signed_mean_error']:>+8.1%} {s['median_error']:>10.1%} "
                  f"{s['error_ci95'][0]:>7.1%}-{s['error_ci95'][1]:<7.1%} {s['one_clock_mean_ms']:>10.2f}")
    print()
    print("peak memory per rank (MiB): truth max_allocated vs Prism trace peak; outside torch's allocator "
          "(NVML process - reserved) truth vs Prism: the difference is NCCL's own")
    for row in out["configs"]:
        if not row["truth"]:
            continue
        tm = row["truth"][-1]["memory"]
        for k, runs in row["prism"].items():
            if not runs:
                continue
            pm = runs[-1]["memory"]
            for r, (t, p) in enumerate(zip(tm, pm)):
                print(f"  {row['config']:<16} rank {r} capture {k}: peak {fmt_bytes(t.get('max_allocated'))} vs "
                      f"{fmt_bytes(p.get('trace_peak_allocated'))}; outside allocator "
                      f"{fmt_bytes(t.get('outside_allocator'))} vs {fmt_bytes(p.get('outside_allocator'))}")


if __name__ == "__main__":
    sys.exit(main())
