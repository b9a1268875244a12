"""The hybrid engine on a large world: one sandbox rank among thousands of virtual ranks.

A synthetic Megatron layout (default tp8 pp8 dp128: 8,192 ranks) with one
sandbox rank whose calls are fed at the batch replay's own times (so the
result must equal the batch replay, which is checked), driven two ways:

- flat out: the engine as fast as it goes, working ahead as in the paced
  loop (events per second, setup time);
- paced: on the real clock, the emulated job's time 0 at the start, each
  sandbox call fed when its time comes, the engine working ahead
  (``work_ahead``) a slice of events at a time between looks at the clock,
  and each release handed over once both known and due; the lag of each
  release (when it was handed over, against when the emulated job returns
  the call) and of the last event of each slice (negative: processed ahead
  of its time).

Also: live and dormant virtual ranks (live: a member of a group that holds
the sandbox rank), the engine's own memory per virtual rank with the copies
of the graph's columns counted apart.

    python bench/hybrid.py [--dp 128] [--paced-dp 16] [--json OUT]

Prints a table and writes ``bench/results/hybrid-DATE[-$BENCH_MACHINE].json``.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import pathlib
import platform
import sys
import time
from array import array

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from prism.core.hybrid import HybridReplay  # noqa: E402
from prism.core.replay import replay_batch  # noqa: E402
from prism.core.synthetic import MegatronSpec, megatron_graph  # noqa: E402
from prism.shell.profiles import load_profile  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import result_path  # noqa: E402

SANDBOX = 0
#: Events the paced loop processes between two looks at the clock (about 50 us
#: here): how late a due release or sandbox call can be noticed.
SLICE = 32
#: The engine's arrays that are copies of the graph's columns (counted apart).
GRAPH_COPIES = ("_kind", "_rank", "_async", "_ref", "_wait_of", "_dur", "_cpu", "_gpu", "_join", "_free", "_icost",
                "_mcost", "_msg_send", "_msg_recv", "_size", "_inst_ptr", "_inst_nodes", "_ptr")


def arrival_fn(eng, batch):
    def at(rank, node, t0):
        cn = eng.next_call_node(rank, node)
        return int(batch.start[cn]) if cn < eng.graph.rank_ptr[rank + 1] else int(batch.end[cn - 1])
    return at


def feed_due(eng, graph, at, now: int | None, pending: dict) -> None:
    """Feed every sandbox call whose time has come (``now`` None: the next one)."""
    for r, (nd, t0) in list(eng.computing.items()):
        if r not in pending:
            pending[r] = at(r, nd, t0)
    for r, t in sorted(pending.items(), key=lambda x: x[1]):
        if now is not None and t > now:
            continue
        nd, _ = eng.computing[r]
        del pending[r]
        cn = eng.next_call_node(r, nd)
        if cn == graph.rank_ptr[r + 1]:
            eng.finish(r, t)
        else:
            assert eng.arrive(r, eng.call_of(cn), t) is None


def memory(eng) -> dict:
    own = copies = 0
    for name, value in vars(eng).items():
        size = value.itemsize * len(value) if isinstance(value, array) else sys.getsizeof(value)
        if isinstance(value, list):  # the event heap: its entries too
            size += sum(sys.getsizeof(x) for x in value)
        if name in GRAPH_COPIES:
            copies += size
        elif name not in ("graph", "costs"):
            own += size
    return {"engine_bytes": own, "graph_copy_bytes": copies}


def flat_out(graph, batch, model, dormant: str = "simulate") -> dict:
    t0 = time.perf_counter()
    eng = HybridReplay(graph, [SANDBOX], cost_model=model, dormant=dormant)
    setup = time.perf_counter() - t0
    mem = memory(eng)
    at = arrival_fn(eng, batch)
    pending: dict = {}
    t1 = time.perf_counter()
    while True:
        if eng.work_ahead(SLICE) is None:  # only a sandbox call moves it on
            feed_due(eng, graph, at, None, pending)
            if eng.done:
                break
        eng.take_released()
    run = time.perf_counter() - t1
    res = eng.result()
    exact = bool(np.array_equal(res.start, batch.start) and np.array_equal(res.end, batch.end))
    return {"setup_s": setup, "run_s": run, "events": eng.events, "events_per_s": eng.events / run, "exact": exact,
            **mem}


def paced(graph, batch, model, limit_s: float, dormant: str = "simulate") -> dict:
    eng = HybridReplay(graph, [SANDBOX], cost_model=model, dormant=dormant)
    at = arrival_fn(eng, batch)
    pending: dict = {}
    held: list[int] = []  # times of releases known but not yet due
    lags: list[int] = []
    rel_lags: list[int] = []
    # As a real-time shell does (prism.core.replay): the collector never walks
    # the graph, the engine or what earlier rows left.
    gc.collect()
    gc.freeze()
    clock = time.monotonic_ns
    start = clock()
    while (now := clock() - start) < limit_s * 1e9:
        feed_due(eng, graph, at, now, pending)
        for r in eng.take_released():
            heapq.heappush(held, r.t_ns)
        while held and held[0] <= (now := clock() - start):
            rel_lags.append(now - heapq.heappop(held))
        if eng.done:
            if not pending and not held:
                break
            continue
        t = eng.work_ahead(SLICE)
        lags.append(clock() - start - t)
    gc.unfreeze()
    finished = eng.done and not pending and not held
    q = lambda v, p: float(np.percentile(v, p)) / 1e6 if v else None  # noqa: E731
    return {"finished": finished, "emulated_ms": int(batch.end.max()) / 1e6, "events": eng.events,
            "event_lag_ms_p50": q(lags, 50), "event_lag_ms_p99": q(lags, 99),
            "release_lag_ms_p50": q(rel_lags, 50), "release_lag_ms_p99": q(rel_lags, 99),
            "release_lag_ms_max": q(rel_lags, 100), "releases": len(rel_lags)}


def live_count(graph, rank: int) -> int:
    members = set()
    for g in graph.groups:
        if rank in g.ranks:
            members.update(g.ranks)
    return len(members - {rank})


def run(dp: int, paced_dps: list[int], limit_s: float) -> dict:
    model = load_profile("h200_nvlink_ib400")
    out = {}
    cases = [("flat", dp, "simulate"), ("flat-offline", dp, "offline")]
    cases += [(f"paced-dp{x}-{m}", x, m) for x in paced_dps for m in ("simulate", "offline")]
    for name, d, mode in cases:
        spec = MegatronSpec(tp=8, pp=8, dp=d, iterations=2)
        t0 = time.perf_counter()
        graph = megatron_graph(spec)
        batch = replay_batch(graph, cost_model=model)
        build = time.perf_counter() - t0
        live = live_count(graph, SANDBOX)
        row = {"world": graph.world_size, "nodes": graph.n_nodes, "graph_and_batch_s": build, "live": live,
               "dormant": graph.world_size - 1 - live}
        row["dormant_mode"] = mode
        row.update(flat_out(graph, batch, model, mode) if name.startswith("flat")
                   else paced(graph, batch, model, limit_s, mode))
        if name.startswith("flat"):
            row["engine_bytes_per_virtual_rank"] = row["engine_bytes"] / (graph.world_size - 1)
        out[name] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=128, help="flat-out world: tp8 pp8 dpN (default 128: 8,192 ranks)")
    ap.add_argument("--paced-dp", default="1,16,128", help="paced worlds: tp8 pp8 dpN, a list (default 1,16,128: 64, "
                    "1,024 and 8,192 ranks; the simulate mode at 8,192 runs until --limit-s)")
    ap.add_argument("--limit-s", type=float, default=30.0, help="stop the paced run after this long")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = run(args.dp, [int(x) for x in args.paced_dp.split(",")], args.limit_s)
    for f in (rows["flat"], rows["flat-offline"]):
        print_flat(f)
    print_paced(rows)
    doc = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": platform.platform(),
           "python": platform.python_version(), "command": " ".join(sys.argv), **rows}
    path = pathlib.Path(args.json) if args.json else result_path("hybrid")
    path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")
    return 0


def print_flat(f: dict) -> None:
    print(f"flat out ({f['dormant_mode']}): world {f['world']:,} ({f['nodes']:,} nodes), live {f['live']}, dormant {f['dormant']:,}; "
          f"setup {f['setup_s']:.1f} s, {f['events']:,} events in {f['run_s']:.1f} s = {f['events_per_s']:,.0f}/s; "
          f"equal to the batch replay: {f['exact']}")
    print(f"  engine memory {f['engine_bytes'] / 2**20:,.1f} MiB = {f['engine_bytes_per_virtual_rank']:,.0f} B per "
          f"virtual rank; copies of the graph's columns {f['graph_copy_bytes'] / 2**20:,.1f} MiB (apart)")


def print_paced(rows: dict) -> None:
    for name, p in rows.items():
        if name.startswith("paced"):
            print(f"paced ({p['dormant_mode']}): world {p['world']:,}, emulated {p['emulated_ms']:.1f} ms, finished: {p['finished']}; event "
                  f"lag p50 {p['event_lag_ms_p50']:.3f} ms, p99 {p['event_lag_ms_p99']:.3f} ms; release lag p50 "
                  f"{p['release_lag_ms_p50']:.3f} ms, p99 {p['release_lag_ms_p99']:.3f} ms, max {p['release_lag_ms_max']:.3f} ms "
                  f"over {p['releases']} releases")


if __name__ == "__main__":
    raise SystemExit(main())
