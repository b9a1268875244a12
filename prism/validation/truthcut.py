"""Cutting one profiled step into the stretches a capture records.

A truth step profiled by the step clock (``prism.validation.stepclock`` with
``PRISM_STEPCLOCK_PROFILE_STEP``) is a torch-profiler Chrome trace per rank.
``cut_profile`` cuts it at the rank's communication calls (the ``c10d::*``
operators on the script's thread): per segment the CPU span and the GPU busy
time of what that span launched. ``timeline`` cuts a GPU-only profile
(``PRISM_STEPCLOCK_PROFILE_CPU=0``) at its NCCL kernels: per segment when the
stream was free, how far ahead the CPU launched, the GPU's busy time and span.
``capture_stretches`` gives the same step of a Prism capture, per stretch
between communication calls, with the two-clock columns the replay uses.
Used by ``bench/truth_segments.py`` and ``bench/truth_timeline.py``; needs no
GPU.
"""

from __future__ import annotations

import pathlib

#: GPU activity launched by the CPU (categories of the torch profiler's Chrome trace)
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def union(intervals: list[tuple[float, float]]) -> float:
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
        segments.append({"ended_by": name, "cpu_ms": (b - a) / 1e3, "gpu_ms": union(ivs) / 1e3,
                         "launches": len(corr)})
    all_gpu = [iv for v in gpu_by_corr.values() for iv in v]
    return {"segments": segments, "cpu_ms": (end - start) / 1e3, "gpu_ms": union(all_gpu) / 1e3,
            "comm_gpu_ms": union(comm_gpu) / 1e3}


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


LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}


def timeline(trace: dict) -> dict:
    """One rank's profiled step -> segments between communication kernels (ms)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = sorted((e for e in ev if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    if not gpu:
        raise ValueError("the profile holds no GPU activity: was the step profiled with CUDA?")
    launch = {}
    for e in ev:
        if e.get("cat") in LAUNCH_CATS:
            c = e.get("args", {}).get("correlation")
            if c is not None:
                launch[c] = e["ts"]
    t0 = min(min(e["ts"] for e in gpu), min(launch.values(), default=gpu[0]["ts"]))
    segs: list[dict] = []
    cur: list[dict] = []
    free = gpu[0]["ts"]
    comm_prev = None
    cpu_from = [None]

    def close(next_comm: dict | None) -> None:
        ivs = [(e["ts"], e["ts"] + e["dur"]) for e in cur]
        if ivs:
            first_launch = min(launch.get(e.get("args", {}).get("correlation"), e["ts"]) for e in cur)
            last_end = max(b for _, b in ivs)
            start = max(free, first_launch)
            nl = (launch.get(next_comm.get("args", {}).get("correlation")) if next_comm else None)
            cpu = ((nl - (cpu_from[0] if cpu_from[0] is not None else first_launch)) / 1e3
                   if nl is not None else None)
            segs.append({
                "cpu_ms": cpu,
                "after": comm_prev["name"][:32] if comm_prev else "step start",
                "free_ms": (free - t0) / 1e3,
                "ahead_ms": (free - first_launch) / 1e3,
                "busy_ms": union(ivs) / 1e3,
                "span_ms": (last_end - start) / 1e3,
                "end_ms": (last_end - t0) / 1e3,
                "kernels": len(cur),
                "next_comm_ahead_ms": ((next_comm["ts"] - launch[next_comm["args"]["correlation"]]) / 1e3
                                       if next_comm and next_comm.get("args", {}).get("correlation") in launch
                                       else None),
            })

    for e in gpu:
        if "nccl" in e["name"].lower():
            close(e)
            cur = []
            free = e["ts"] + e["dur"]
            comm_prev = e
            cpu_from[0] = launch.get(e.get("args", {}).get("correlation"))
        else:
            cur.append(e)
    close(None)
    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in gpu if "nccl" not in e["name"].lower()])
    end = max(e["ts"] + e["dur"] for e in gpu)
    return {"segments": segs, "busy_ms": busy / 1e3, "span_ms": (end - t0) / 1e3}
