"""Benchmark the replay engines on a synthetic Megatron-style graph.

Runs, in one process and on the same graph, the plain heapq discrete-event
loop (``replay_reference``), the steppable engine run flat out
(``SteppableReplay.run``) and the numpy batch path (``replay_batch``, first
call including its cached plan, and a second call as a what-if sweep would
make it), checks that all timelines are identical, prints a table and writes
``bench/results/replay-DATE[-MACHINE].json``.

    python bench/replay.py                       # tp8 pp8 dp128: 8,192 ranks
    python bench/replay.py --dp 16               # 1,024 ranks, for small boxes

Each engine's time is end to end given the graph (its setup included); the
graph build (checks, matching, wave schedule) is shared and timed apart. The
graph is built from arrays (``megatron_graph``): building ~10 million trace
event objects would take longer than replaying them.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import platform
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from prism.shell.profiles import load_profile  # noqa: E402
from prism.core.replay import SteppableReplay, replay_batch, replay_reference  # noqa: E402
from prism.core.synthetic import MegatronSpec, megatron_graph  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import result_path  # noqa: E402


def timed(fn):
    gc.collect()
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--dp", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4, help="layers per pipeline stage")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--dp-buckets", type=int, default=4)
    ap.add_argument("--net", default="h200_nvlink_ib400")
    ap.add_argument("--out", default=str(result_path("replay")))
    args = ap.parse_args()
    spec = MegatronSpec(tp=args.tp, pp=args.pp, dp=args.dp, micro_batches=args.micro_batches,
                        layers_per_stage=args.layers, iterations=args.iterations, dp_buckets=args.dp_buckets,
                        hidden=8192, seq_len=4096)
    model = load_profile(args.net)
    g, t_build = timed(lambda: megatron_graph(spec))
    n = g.n_nodes
    per_rank_iter = np.bincount(g.rank[g.kind == 1], minlength=g.world_size) / spec.iterations
    print(f"graph: {g!r}; built in {t_build:.2f} s")
    print(f"collectives per rank per iteration: min {per_rank_iter.min():.0f}, max {per_rank_iter.max():.0f}")
    rows = []
    ref, t_ref = timed(lambda: replay_reference(g, cost_model=model))
    rows.append(("plain heapq loop (replay_reference)", t_ref))
    stp, t_stp = timed(lambda: SteppableReplay(g, cost_model=model).run())
    rows.append(("SteppableReplay.run", t_stp))
    bat, t_bat = timed(lambda: replay_batch(g, cost_model=model))
    rows.append(("replay_batch (first call, builds plan)", t_bat))
    bat2, t_bat2 = timed(lambda: replay_batch(g, cost_model=model))
    rows.append(("replay_batch (plan cached)", t_bat2))
    identical = all(np.array_equal(ref.start, x.start) and np.array_equal(ref.end, x.end) for x in (stp, bat, bat2))
    print(f"\n{'engine':<42} {'events':>12} {'seconds':>9} {'events/s':>12} {'vs plain loop':>14}")
    for name, t in rows:
        print(f"{name:<42} {n:>12,} {t:>9.3f} {n / t:>12,.0f} {t_ref / t:>13.2f}x")
    print(f"\ntimelines identical across engines: {identical}")
    print(f"predicted iteration times: {[f'{x / 1e6:.3f} ms' for x in ref.iteration_times]}")
    result = {
        "benchmark": "replay",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([pathlib.Path(sys.executable).name] + sys.argv),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__},
        "spec": {"tp": spec.tp, "pp": spec.pp, "dp": spec.dp, "world_size": spec.world_size,
                 "micro_batches": spec.micro_batches, "layers_per_stage": spec.layers_per_stage,
                 "iterations": spec.iterations, "dp_buckets": spec.dp_buckets},
        "graph": {"nodes": n, "collective_instances": g.n_instances, "messages": g.n_messages,
                  "waves": g.waves.count, "build_seconds": t_build,
                  "collectives_per_rank_per_iteration": [float(per_rank_iter.min()), float(per_rank_iter.max())]},
        "cost_model": model.name,
        "engines": [{"engine": name, "events": n, "seconds": t, "events_per_second": n / t, "vs_plain_loop": t_ref / t}
                    for name, t in rows],
        "identical_timelines": identical,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
