"""The ground truth's own step, cut into the segments a capture records, beside
the capture's: which segments does the replay get wrong?

    python bench/truth_segments.py --world 2 --step 5 [--capture RUN] [--out DIR] -- CMD... (CMD runs past step 5)
    python bench/truth_segments.py --profiles DIR --step 5 [--capture RUN]     # already recorded

Runs CMD (as ``bench/nccl_accuracy.py`` runs its truths: plain
torch.distributed, one process per GPU with NCCL, or gloo on CPU) under
``bench/_stepclock.py`` with ``PRISM_STEPCLOCK_PROFILE_STEP``: the torch
profiler records exactly step ``--step`` of every rank. Each rank's step is
cut at its communication calls (the ``c10d::*`` operators on the script's
thread), as a capture cuts it; per segment: the CPU span from the previous
call's end to this call's start, and the GPU busy time of the kernels and
copies launched in that span (their union, from the launches' correlation
ids; NCCL's kernels run inside the calls and are counted apart). With
``--capture`` the same step of a Prism capture of the same command is shown
beside it: per stretch between two communication calls, the sum of the CPU
shares and of the GPU times the replay uses (``ExecutionGraph`` two-clock
columns; a capture also cuts at the script's GPU waits, summed here).
Prints a table per rank and writes ``--json``. Runs on CPU too (gloo; no GPU
column).

The profiler adds its own cost to every operator on the CPU: the truth's CPU
spans are upper bounds (a tiny CPU GPT step on the 2-core VM: 25.4 ms of
spans against 13.2 ms of capture CPU shares, stretch by stretch 1-10x). The
GPU busy times are the kernels' own and compare directly.

Written 2026-11-30 for issue 7 (bench/results/nccl-2026-11-29.md, section 7:
pipeline and FSDP2 predicted 2-5% low, MoE 2-3% high); checked on CPU only.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: GPU activity launched by the CPU (categories of the torch profiler's Chrome trace)
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def cut_profile(trace: dict) -> dict:
    """One rank's profiled step -> {"segments": [...], "comm_gpu_ms", "cpu_ms", "gpu_ms"} (times in ms).

    Each segment: ``ended_by`` (the call's operator, or "step end"), ``cpu_ms``
    (span on the script's thread), ``gpu_ms`` (busy time of what the span
    launched), ``launches``.
    """
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    ops = [e for e in ev if e.get("cat") == "cpu_op"]
    if not ops:
        raise ValueError("the profile holds no CPU operators: was the step profiled?")
    comm_all = [e for e in ops if e["name"].startswith("c10d::")]
    counts: dict = {}
    for e in comm_all or ops:
        counts[e["tid"]] = counts.get(e["tid"], 0) + 1
    main = max(counts, key=counts.get)
    comm: list[dict] = []
    for e in sorted((e for e in comm_all if e["tid"] == main), key=lambda e: e["ts"]):
        if comm and e["ts"] < comm[-1]["ts"] + comm[-1]["dur"]:
            continue  # nested inside the previous call
        comm.append(e)
    mine = [e for e in ev if e.get("tid") == main and e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation")]
    start = min(e["ts"] for e in mine)
    end = max(e["ts"] + e["dur"] for e in mine)
    launches = sorted((e for e in ev if e.get("cat") == "cuda_runtime" and e.get("tid") == main),
                      key=lambda e: e["ts"])
    gpu_by_corr: dict = {}
    comm_gpu = []
    for e in ev:
        if e.get("cat") in GPU_CATS:
            iv = (e["ts"], e["ts"] + e["dur"])
            if "nccl" in e["name"].lower():
                comm_gpu.append(iv)
            else:
                gpu_by_corr.setdefault(e.get("args", {}).get("correlation"), []).append(iv)
    bounds = [(start, c["ts"], c["name"]) for c in comm[:1]]
    bounds += [(a["ts"] + a["dur"], b["ts"], b["name"]) for a, b in zip(comm, comm[1:])]
    bounds.append((comm[-1]["ts"] + comm[-1]["dur"] if comm else start, end, "step end"))
    segments = []
    for a, b, name in bounds:
        corr = [e.get("args", {}).get("correlation") for e in launches if a <= e["ts"] < b]
        ivs = [iv for c in corr for iv in gpu_by_corr.get(c, [])]
        segments.append({"ended_by": name, "cpu_ms": (b - a) / 1e3, "gpu_ms": _union(ivs) / 1e3,
                         "launches": len(corr)})
    all_gpu = [iv for v in gpu_by_corr.values() for iv in v]
    return {"segments": segments, "cpu_ms": (end - start) / 1e3, "gpu_ms": _union(all_gpu) / 1e3,
            "comm_gpu_ms": _union(comm_gpu) / 1e3}


def capture_stretches(run: str | pathlib.Path, step: int) -> dict[int, list[dict]]:
    """Per rank, the capture's step ``step`` cut at its communication calls:
    the summed CPU shares, GPU times and wall times of its segments (ms),
    and the call."""
    from prism.shell import runfolder
    from prism.core.graph import COLL, COMPUTE, OPS, RECV, SEND, ExecutionGraph

    g = ExecutionGraph.from_events(runfolder.read_run(run).ranks)
    out: dict[int, list[dict]] = {}
    for r in range(g.world_size):
        sl = g.nodes_of(r)
        cur = {"cpu_ms": 0.0, "gpu_ms": 0.0, "wall_ms": 0.0, "segments": 0}
        rows = []
        for nd in range(sl.start, sl.stop):
            if g.step[nd] != step:
                continue
            k = int(g.kind[nd])
            if k == COMPUTE:
                cpu = g.cpu[nd] if g.cpu is not None and g.cpu[nd] >= 0 else g.dur[nd]
                gpu = g.gpu[nd] if g.gpu is not None and g.cpu[nd] >= 0 else 0
                cur["cpu_ms"] += cpu / 1e6
                cur["gpu_ms"] += gpu / 1e6
                cur["wall_ms"] += g.dur[nd] / 1e6
                cur["segments"] += 1
            elif k in (COLL, SEND, RECV):
                rows.append({**cur, "ended_by": OPS[int(g.op[nd])] if g.op[nd] >= 0 else "?"})
                cur = {"cpu_ms": 0.0, "gpu_ms": 0.0, "wall_ms": 0.0, "segments": 0}
        rows.append({**cur, "ended_by": "step end"})
        out[r] = rows
    return out


def run_truth(world: int, cmd: list[str], out: pathlib.Path, step: int, timeout: float,
              extra_env: dict | None = None, tool: str = "truth_segments") -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from nccl_accuracy import launch_truth

    try:
        launch_truth(world, cmd, out, timeout, {"PRISM_STEPCLOCK_PROFILE_STEP": str(step), **(extra_env or {})})
    except RuntimeError as e:
        raise SystemExit(f"{tool}: {e}") from None


def add_truth_args(ap: argparse.ArgumentParser) -> None:
    """The options this tool and ``truth_timeline.py`` share."""
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--step", type=int, default=5, help="the step to profile (default 5)")
    ap.add_argument("--profiles", default=None, help="a folder with profile-rank-R.json already recorded")
    ap.add_argument("--capture", default=None, help="a Prism capture of the same command (its run folder)")
    ap.add_argument("--out", default=None, help="where the truth run writes (default: a temporary folder)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command (as for prism capture)")


def profiles_folder(ap: argparse.ArgumentParser, a: argparse.Namespace, tool: str,
                    extra_env: dict | None = None) -> pathlib.Path:
    """``--profiles``, or the folder of a truth run of the command, profiled at ``--step``."""
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if a.profiles:
        return pathlib.Path(a.profiles)
    if not cmd:
        ap.error("give --profiles DIR or a command after --")
    folder = pathlib.Path(a.out or tempfile.mkdtemp(prefix=f"{tool.replace('_', '-')}-"))
    folder.mkdir(parents=True, exist_ok=True)
    run_truth(a.world, cmd, folder, a.step, a.timeout, extra_env, tool)
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_truth_args(ap)
    a = ap.parse_args()
    folder = profiles_folder(ap, a, "truth_segments")
    files = sorted(folder.glob("profile-rank-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    if not files:
        raise SystemExit(f"truth_segments: no profile-rank-R.json in {folder} (did the run reach step {a.step}?)")
    truth = {int(p.stem.rsplit("-", 1)[1]): cut_profile(json.loads(p.read_text())) for p in files}
    cap = capture_stretches(a.capture, a.step) if a.capture else {}
    for r, t in truth.items():
        print(f"rank {r}, step {a.step}: truth CPU span {t['cpu_ms']:.2f} ms, GPU busy {t['gpu_ms']:.2f} ms "
              f"(+ NCCL kernels {t['comm_gpu_ms']:.2f} ms); {len(t['segments'])} stretches between calls")
        c = cap.get(r, [])
        head = f"  {'#':>3} {'ended by':24} {'truth cpu':>9} {'truth gpu':>9}"
        print(head + (f" {'capt cpu':>9} {'capt gpu':>9} {'capt ended by':20}" if c else ""))
        for i, s in enumerate(t["segments"]):
            line = f"  {i:3d} {s['ended_by'][:24]:24} {s['cpu_ms']:9.3f} {s['gpu_ms']:9.3f}"
            if i < len(c):
                line += f" {c[i]['cpu_ms']:9.3f} {c[i]['gpu_ms']:9.3f} {c[i]['ended_by'][:20]:20}"
            print(line)
        if c and len(c) != len(t["segments"]):
            print(f"  (the capture has {len(c)} stretches: the calls differ, compare with care)")
        if c:
            print(f"  sums: truth cpu {sum(s['cpu_ms'] for s in t['segments']):.2f} gpu "
                  f"{sum(s['gpu_ms'] for s in t['segments']):.2f}; capture cpu {sum(x['cpu_ms'] for x in c):.2f} "
                  f"gpu {sum(x['gpu_ms'] for x in c):.2f} ms")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"step": a.step, "truth": truth, "capture": cap}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
