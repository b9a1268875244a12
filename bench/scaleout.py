"""Scale-out speed: events path vs array path, growing a run to large DP.

Grows a run (a capture given with ``--run``, else the synthetic tp2 x pp2 x
dp2 Megatron run of ``prism.core.synthetic``) to each target DP degree in two
ways and times both, then replays the array-path graph:

events  ``scale_events`` + ``ExecutionGraph.from_events`` (one Python object per event)
array   ``scale_graph`` (numpy tiling of the captured graph's columns)

Prints a table and writes ``bench/results/scaleout-DATE[-MACHINE].json``.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prism.shell.profiles import load_profile  # noqa: E402
from prism.core.graph import ExecutionGraph  # noqa: E402
from prism.core.replay import replay_batch  # noqa: E402
from prism.core.scaleout import Layout, scale_events, scale_graph  # noqa: E402
from prism.core.synthetic import MegatronSpec, megatron_events  # noqa: E402
from prism.shell.runfolder import read_run  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import result_path, write_json  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default=None, help="captured run directory (default: synthetic tp2 pp2 dp2)")
    ap.add_argument("--dp", default="64,512,2048", help="target DP degrees")
    ap.add_argument("--events-max-world", type=int, default=8192,
                    help="skip the events path above this world size")
    ap.add_argument("--net", default="h200_nvlink_ib400")
    ap.add_argument("--out", default=str(result_path("scaleout")))
    a = ap.parse_args()
    if a.run:
        run = read_run(a.run)
        ranks, layout = dict(run.ranks), Layout.from_manifest(run.manifest)
        source = f"{a.run} (captured: {' '.join(run.manifest.command)})"
    else:
        ranks = megatron_events(MegatronSpec(tp=2, pp=2, dp=2, iterations=4))
        layout, source = Layout(2, 2, 2), "synthetic MegatronSpec(tp=2, pp=2, dp=2, iterations=4)"
    model = load_profile(a.net)
    t = time.perf_counter()
    base = ExecutionGraph.from_events(ranks)
    base_s = time.perf_counter() - t
    rows = []
    for dp in (int(x) for x in a.dp.split(",")):
        world = layout.with_dp(dp).world_size
        t = time.perf_counter()
        g = scale_graph(ranks, layout, dp, graph=base)
        array_s = time.perf_counter() - t
        t = time.perf_counter()
        res = replay_batch(g, cost_model=model)
        replay_s = time.perf_counter() - t
        events_s = None
        if world <= a.events_max_world:
            t = time.perf_counter()
            ge = ExecutionGraph.from_events(scale_events(ranks, layout, dp))
            events_s = time.perf_counter() - t
            if not np.array_equal(ge.dur, g.dur) or [x.gid for x in ge.groups] != [x.gid for x in g.groups]:
                raise SystemExit(f"dp {dp}: the two paths disagree (a Prism bug)")
            del ge
        rows.append({"dp": dp, "world": world, "nodes": g.n_nodes, "groups": len(g.groups),
                     "array_s": array_s, "events_s": events_s, "replay_s": replay_s,
                     "events_over_array": events_s / array_s if events_s else None,
                     "predicted_iteration_ms": res.mean_iteration_time(2) / 1e6})
    print(f"scale-out from {layout} ({source}); captured graph built in {base_s:.2f} s")
    print(f"{'dp':>6} {'world':>6} {'nodes':>10} {'array s':>8} {'events s':>9} {'events/array':>13} "
          f"{'replay s':>9} {'pred ms':>9}")
    for r in rows:
        ev = f"{r['events_s']:.2f}" if r["events_s"] is not None else "skipped"
        ratio = f"{r['events_over_array']:.1f}x" if r["events_over_array"] else "-"
        print(f"{r['dp']:>6} {r['world']:>6} {r['nodes']:>10,} {r['array_s']:>8.2f} {ev:>9} {ratio:>13} "
              f"{r['replay_s']:>9.2f} {r['predicted_iteration_ms']:>9.2f}")
    out = {"benchmark": "scaleout", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "python " + " ".join(sys.argv), "source": source, "layout": str(layout), "cost_model": a.net,
           "machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "numpy": np.__version__}, "rows": rows}
    write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
