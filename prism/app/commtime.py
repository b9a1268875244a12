"""``prism commtime RUN``: a CPU capture's communication, run for real on this host.

    python -m prism commtime RUN [--name NAME] [--net PROFILE] [--passes 2]
    python -m prism predict RUN --comm measured        # (or emulate) price calls with what it measured

Runs RUN's graph as a skeleton job (``prism.core.commtimes``): one process per
rank over gloo (``OMP_NUM_THREADS=1``), each walking its rank's program with
every compute segment a busy loop of its recorded duration (calibrated where
the run has a calibration, as predict's default) and every call the real
``torch.distributed`` call on scratch tensors of the recorded op, size and
group, async calls waited where the program waited. The program runs
``passes`` times (the first of several sets up gloo's connections and is
not kept); each collective instance's and message's time, the mean over the
passes kept, is stored
under ``RUN/commtime/NAME/`` and ``--comm measured`` (or ``--comm NAME``)
makes predict and emulate use them in place of the cost model's for that
graph. What the skeleton measures is the job's own traffic at the
moment it happens, with the other ranks computing or talking beside it: the
contention that a profile timed outside the job (one group alone, or all
groups of a size at once) leaves out or overstates.

Limits: CPU captures (gloo) with one core per rank here (more ranks than
cores would time the host's scheduling, and the command refuses); the graph
measured only (``--comm measured`` refuses a scaled-out world and
``--link-slowdown``: use ``--comm model`` there); all_to_all's splits taken
even; a gather/scatter/reduce/broadcast rooted at the group's first rank;
sends eager (``isend``), as Prism's are.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prism.app.errors import InconsistentTraceError, UsageError
from prism.core.commtimes import MeasuredComm, graph_fingerprint, mean_costs, measured_costs, rank_program
from prism.core.graph import OPS, ExecutionGraph, GraphError

__all__ = ["CommtimeConfig", "CommtimeResult", "commtime", "stored_commtimes", "comm_model", "COMM_CHOICES"]

COMMTIME_DIR = "commtime"
_MANIFEST = "manifest.json"
_TIMES = "times.npz"
#: ``--comm``'s named choices (anything else is a stored measurement's name).
COMM_CHOICES = ("model", "measured")


@dataclass(frozen=True)
class CommtimeConfig:
    run: str
    name: str | None = None
    #: the cost profile the summary compares with (as predict's --net)
    net: str | None = None
    passes: int = 2
    timeout: float = 600.0
    calibration: str = "auto"
    #: most ranks allowed (default: this machine's usable cores)
    cores: int | None = None


@dataclass
class CommtimeResult:
    path: pathlib.Path
    manifest: dict
    rows: list[dict] = field(default_factory=list)

    def format(self) -> str:
        m = self.manifest
        lines = [f"prism commtime: {m['world_size']} ranks, {m['passes_kept']} of {m['passes']} passes kept (mean), "
                 f"{m['instances_measured']}/{m['instances']} collective instances and "
                 f"{m['messages_measured']}/{m['messages']} messages measured in {m['seconds']:.1f} s",
                 f"skeleton iteration (recorded compute, real calls): {m['skeleton_iteration_ms']:.2f} ms "
                 f"(mean of steps {m['skeleton_steps']})",
                 f"{'op':<24} {'group':>5} {'calls':>6} {'measured ms':>12} {'model ms':>10} {'ratio':>7}"]
        for r in self.rows:
            ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
            lines.append(f"{r['op']:<24} {r['group_size']:>5} {r['count']:>6} {r['measured_ms']:>12.3f} "
                         f"{r['model_ms']:>10.3f} {ratio:>7}")
        lines.append(f"stored in {self.path}; use it with `prism predict {m['run']} --comm measured` "
                     f"(or --comm {m['name']}); model: {m['model']}")
        return "\n".join(lines)


def commtime_path(run: str | os.PathLike[str], name: str | None) -> pathlib.Path:
    base = pathlib.Path(run) / COMMTIME_DIR
    return base if name is None else base / name


def _graph_of(run: str, calibration: str) -> tuple[ExecutionGraph, Any, Any]:
    from prism.app.calibrate import events_for_replay
    from prism.app.predict import _complete_steps, load_run_events, load_run_manifest, traced_device_kind

    ranks = load_run_events(run)
    if not ranks:
        raise UsageError(f"{run} has no rank files: nothing to measure")
    ranks, _missing = _complete_steps(run, ranks)
    ranks, _cal, _hint = events_for_replay(run, ranks, calibration)
    try:
        graph = ExecutionGraph.from_events(ranks)
    except GraphError as e:
        raise InconsistentTraceError(f"the trace in {run} is inconsistent: {e}") from None
    return graph, load_run_manifest(run), traced_device_kind(ranks)


def stored_commtimes(run: str | os.PathLike[str]) -> list[pathlib.Path]:
    base = commtime_path(run, None)
    return sorted((d for d in base.iterdir() if (d / _MANIFEST).is_file() and (d / _TIMES).is_file()),
                  key=lambda d: (json.loads((d / _MANIFEST).read_text()).get("created_utc", ""), d.name)) \
        if base.is_dir() else []


def comm_model(run: str | os.PathLike[str], which: str, base: Any, graph: ExecutionGraph | None = None) -> Any:
    """The cost model predict/emulate use: ``base`` for "model"; for
    "measured" (the newest) or a stored measurement's name, a ``MeasuredComm``
    over ``base`` (checked against ``graph`` when given: ``UsageError`` if it
    was measured on another)."""
    if which in (None, "", "model"):
        return base
    found = stored_commtimes(run)
    if which == "measured":
        if not found:
            raise UsageError(f"--comm measured: {run} has no in-situ communication times (nothing in "
                             f"{commtime_path(run, None)}); run `prism commtime {run}` first, or use --comm model")
        d = found[-1]
    else:
        d = commtime_path(run, which)
        if d not in found:
            names = ", ".join(p.name for p in found) or "none"
            raise UsageError(f"--comm {which!r}: no such measurement in {commtime_path(run, None)} (there are: "
                             f"{names}); give model, measured or one of those names")
    try:
        manifest = json.loads((d / _MANIFEST).read_text())
        with np.load(d / _TIMES) as z:
            arrays = {"inst_ns": z["inst_ns"], "msg_ns": z["msg_ns"]}
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"cannot read the communication times in {d}: {e}; remove that folder or measure again") \
            from None
    got = MeasuredComm.of(base, arrays, manifest["fingerprint"], manifest.get("name", d.name))
    if graph is not None and graph_fingerprint(graph) != got.fingerprint:
        raise UsageError(f"--comm {which}: the communication times in {d} were measured on another graph (a "
                         "re-capture, other steps or another layout): run `prism commtime "
                         f"{run}` again, or use --comm model")
    return got


def _summary(graph: ExecutionGraph, inst: np.ndarray, msg: np.ndarray, model: Any) -> list[dict]:
    modelled_i = model.instance_costs(graph) if graph.n_instances else np.zeros(0, np.int64)
    modelled_m = model.message_costs(graph) if graph.n_messages else np.zeros(0, np.int64)
    rows: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for i in range(graph.n_instances):
        if inst[i] >= 0:
            key = (OPS[int(graph.inst_op[i])], int(graph.group_size[graph.inst_group[i]]))
            rows.setdefault(key, []).append((int(inst[i]), int(modelled_i[i])))
    for j in range(graph.n_messages):
        if msg[j] >= 0:
            rows.setdefault(("send/recv", 2), []).append((int(msg[j]), int(modelled_m[j])))
    out = []
    for (op, n), vals in sorted(rows.items()):
        meas = statistics.median(v[0] for v in vals) / 1e6
        mod = statistics.median(v[1] for v in vals) / 1e6
        out.append({"op": op, "group_size": n, "count": len(vals), "measured_ms": meas, "model_ms": mod,
                    "ratio": (meas / mod) if mod > 0 else None})
    return out


def commtime(config: CommtimeConfig) -> CommtimeResult:
    """Measure and store ``config.run``'s communication times (see the module docstring)."""
    from prism.app.netprofile import usable_cores
    from prism.app.predict import resolve_profile
    from prism.workloads.harness import WorldError, run_world

    run = config.run
    if config.passes < 1:
        raise UsageError(f"--passes must be at least 1, got {config.passes}")
    if not pathlib.Path(run).is_dir():
        raise UsageError(f"{run}: no such run directory")
    if config.name is not None and (config.name in COMM_CHOICES or "/" in config.name or config.name.startswith(".")
                                    or not config.name):
        raise UsageError(f"--name {config.name!r} is reserved or not a folder name; pick another")
    bad = {k: v for k, v, ok in (("PRISM_SKELETON_COMPUTE", os.environ.get("PRISM_SKELETON_COMPUTE", "spin"),
                                  ("spin", "yield", "sleep")),
                                 ("PRISM_SKELETON_CALLBACKS", os.environ.get("PRISM_SKELETON_CALLBACKS", "1"),
                                  ("0", "1")))
           if v not in ok}
    if bad:
        raise UsageError("unknown skeleton diagnostics: " + ", ".join(f"{k}={v!r}" for k, v in bad.items())
                         + " (PRISM_SKELETON_COMPUTE takes spin, yield or sleep; PRISM_SKELETON_CALLBACKS 0 or 1); "
                           "unset them for the default")
    graph, manifest, device_kind = _graph_of(run, config.calibration)
    if device_kind not in (None, "cpu"):
        raise UsageError(f"{run} was captured on {device_kind}: in-situ communication times need a CPU (gloo) "
                         "capture; a GPU job's calls need one GPU per rank (not built)")
    world = graph.world_size
    cores = config.cores or usable_cores()
    if world > cores:
        raise UsageError(f"{run} has {world} ranks but this machine gives {cores} cores: the skeleton runs one "
                         "process per rank and would time the host's scheduling, not the calls; run it on a "
                         f"machine with {world} cores (or pass --cores to override)")
    try:
        model, why = resolve_profile(config.net, manifest, device_kind)
    except Exception as e:  # ProfileError
        raise UsageError(str(e)) from None
    name = config.name or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    if config.name is None:  # two in one second: -2, -3, ...
        k, base_name = 1, name
        while commtime_path(run, name).exists():
            k += 1
            name = f"{base_name}-{k}"
    root = str(pathlib.Path(__file__).resolve().parents[2])
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="prism-commtime-") as tmp:
        d = pathlib.Path(tmp)
        (d / "groups.json").write_text(json.dumps([list(g.ranks) for g in graph.groups]))
        for r in range(world):
            (d / f"program-{r}.json").write_text(json.dumps(rank_program(graph, r)))
        env = {"OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
        try:
            run_world(["-m", "prism.app.commtime", "--worker", str(d), str(config.passes)], world,
                      timeout=config.timeout, env=env)
        except WorldError as e:
            raise UsageError(f"the skeleton job of {run} failed: {e}") from None
        got = [json.loads((d / f"times-{r}.json").read_text())["passes"] for r in range(world)]
    seconds = time.monotonic() - t0
    per_pass, skels = [], []
    for k in range(min(len(g) for g in got)):
        start = np.full(len(graph.kind), -1, np.int64)
        end = np.full(len(graph.kind), -1, np.int64)
        iters: list[list[int]] = []
        for r in range(world):
            nodes = np.asarray(got[r][k]["node"], np.int64)
            start[nodes] = got[r][k]["start"]
            end[nodes] = got[r][k]["end"]
            iters.append(got[r][k]["iters"])
        per_pass.append(measured_costs(graph, start, end))
        steps = min((len(x) for x in iters), default=0)
        ends = np.max(np.array([x[:steps] for x in iters], np.int64), axis=0) if steps else np.zeros(0, np.int64)
        warm = 1 if steps > 2 else 0
        skels.append(float(np.mean(np.diff(ends[warm:]))) / 1e6 if steps - warm >= 2 else float("nan"))
    inst, msg = mean_costs(per_pass)
    skel = float(np.mean(skels)) if skels else float("nan")
    out = commtime_path(run, name)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / _TIMES, inst_ns=inst, msg_ns=msg, start_ns=start, end_ns=end)  # the last kept pass's stamps
    meta = {
        "name": name, "run": str(run), "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "world_size": world, "passes": config.passes, "passes_kept": len(per_pass),
        "fingerprint": graph_fingerprint(graph),
        "instances": int(graph.n_instances), "instances_measured": int(np.sum(inst >= 0)),
        "messages": int(graph.n_messages), "messages_measured": int(np.sum(msg >= 0)),
        "seconds": seconds, "skeleton_iteration_ms": skel, "skeleton_steps": f"{warm + 1}..{steps - 1}",
        "calibration": config.calibration, "model": model.name, "model_choice": why,
        "host": os.uname().nodename, "cores": cores,
        "skeleton_compute": os.environ.get("PRISM_SKELETON_COMPUTE", "spin"),
        "skeleton_callbacks": os.environ.get("PRISM_SKELETON_CALLBACKS", "1") != "0",
        "command": f"python -m prism commtime {run} --name {name} --passes {config.passes}",
    }
    rows = _summary(graph, inst, msg, model)
    meta["summary"] = rows
    (out / _MANIFEST).write_text(json.dumps(meta, indent=1))
    return CommtimeResult(out, meta, rows)


# --- the skeleton's rank ---------------------------------------------------------------


def _worker(argv: Sequence[str]) -> None:
    """One rank of the skeleton job (under ``run_world``): ``DIR PASSES``.

    Sends go out as ``isend`` whatever the program did (Prism's sends are
    eager; a blocking gloo send waits for its receive, which could deadlock a
    program Prism ran) and are finished at their wait or the pass's end. An
    async op's completion is stamped by its future's callback (gloo's thread:
    in time while this thread blocks in another call) and by polling in the
    busy loops (in time while this thread holds the GIL), the earlier kept.
    Gloo's p2p works have no future and report completion only once waited
    on (``is_completed`` stays false until ``wait``), so each is handed to a
    waiter thread that waits on it at once and stamps its return: a receive's
    completion is when its data came, not when the program got to its wait
    (which, counted in, made every message as long as the compute between
    the ``irecv`` and its wait)."""
    import torch
    import torch.distributed as dist

    d, passes = pathlib.Path(argv[0]), int(argv[1])
    torch.set_num_threads(1)
    sys.setswitchinterval(0.00002)  # a completion callback or waiter waits for the GIL at most this long
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = json.loads((d / "groups.json").read_text())
    program = json.loads((d / f"program-{rank}.json").read_text())
    pgs: list[Any] = []
    world_used = False
    for ranks in groups:
        if ranks == list(range(world)) and not world_used:
            pgs.append(dist.group.WORLD)  # the first world-sized group; any other gets its own communicator
            world_used = True
        else:
            pg = dist.new_group(ranks)  # every rank calls it, in the same order
            pgs.append(pg if rank in ranks else None)
    cache: dict[tuple, list] = {}
    in_use: dict[tuple, int] = {}

    def scratch(key: tuple, elems: int, k: int) -> Any:
        bufs = cache.setdefault(key, [])
        while len(bufs) <= k:
            bufs.append(torch.zeros(max(1, elems)))
        return bufs[k]

    mono = time.monotonic_ns
    yield_cpu = getattr(os, "sched_yield", lambda: time.sleep(0))  # both let other threads have the GIL
    # Diagnostics (bench/insitu_variants.py): how a compute segment is spent, "spin" (the default: a busy
    # loop, the core held as the program's compute holds it), "yield" (a busy loop that yields the core at
    # every turn) or "sleep" (the core left free: comm without compute beside it); and whether async
    # collectives are stamped by their futures' callbacks (PRISM_SKELETON_CALLBACKS=0: by polling only).
    compute_mode = os.environ.get("PRISM_SKELETON_COMPUTE", "spin")
    callbacks = os.environ.get("PRISM_SKELETON_CALLBACKS", "1") != "0"
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    done_at: dict[int, int] = {}  # completion stamps from futures' callbacks
    pending: dict[int, tuple[Any, tuple]] = {}

    waited: dict[int, threading.Event] = {}  # works a waiter thread waits on: set when they returned
    failed: dict[int, BaseException] = {}
    handed = queue.SimpleQueue()
    busy = [0, 0]  # works handed over and not returned; waiter threads
    busy_lock = threading.Lock()

    def stamp(node: int, _fut: Any = None) -> None:
        done_at.setdefault(node, mono())

    def waiter() -> None:
        while True:
            node, w = handed.get()
            try:
                w.wait()
            except BaseException as e:  # noqa: BLE001 (raised in the main thread when it next polls or waits on it)
                failed[node] = e
            finally:  # whatever happened, the main thread must not wait for this work for ever
                stamp(node)
                with busy_lock:
                    busy[0] -= 1
                waited[node].set()

    def hand_over(node: int, w: Any) -> None:
        waited[node] = threading.Event()
        with busy_lock:
            busy[0] += 1
            more = busy[0] > busy[1]  # every waiter is blocked on an earlier work: one more
            if more:
                busy[1] += 1
        if more:
            threading.Thread(target=waiter, name=f"prism-skeleton-waiter-{busy[1]}", daemon=True).start()
        handed.put((node, w))

    def track(node: int, w: Any, key: tuple, kind: str) -> None:
        pending[node] = (w, key)
        if not callbacks and kind == "coll":
            return  # stamped by polling (is_completed) only
        try:
            w.get_future().then(lambda f, n=node: stamp(n))
        except (RuntimeError, AttributeError, NotImplementedError):
            hand_over(node, w)  # no future for this work (gloo's p2p): a waiter thread stamps it

    def complete(node: int) -> bool:
        ev = waited.get(node)
        return ev.is_set() if ev is not None else pending[node][0].is_completed()

    def wait_for(node: int) -> None:
        ev = waited.get(node)
        if ev is None:
            pending[node][0].wait()
            return
        ev.wait()
        if node in failed:
            raise failed.pop(node)

    def finish(node: int, now: int) -> None:
        if node in failed:
            raise failed.pop(node)
        end[node] = min(now, done_at.get(node, now))
        _, key = pending.pop(node)
        waited.pop(node, None)
        in_use[key] -= 1

    def poll() -> None:
        if not pending:
            return
        now = mono()
        for n in [n for n in pending if complete(n)]:
            finish(n, now)

    def issue(item: list) -> tuple[Any, tuple]:
        kind, node = item[0], item[1]
        if kind == "coll":
            _, _, op, gi, nbytes, _dtype, is_async = item
            ranks = groups[gi]
            pg, n, e = pgs[gi], len(ranks), max(1, nbytes // 4)
            key = (op, gi, e)
            k = in_use.get(key, 0)
            in_use[key] = k + 1
            a = bool(is_async)
            if op in ("all_reduce", "all_reduce_coalesced"):
                w = dist.all_reduce(scratch(key, e, k), group=pg, async_op=a)
            elif op == "barrier":
                w = dist.barrier(group=pg, async_op=a)
            elif op == "broadcast":
                w = dist.broadcast(scratch(key, e, k), src=ranks[0], group=pg, async_op=a)
            elif op == "reduce":
                w = dist.reduce(scratch(key, e, k), dst=ranks[0], group=pg, async_op=a)
            elif op in ("all_gather", "all_gather_into_tensor"):
                w = dist.all_gather_into_tensor(scratch(key + ("o",), e * n, k), scratch(key, e, k), group=pg,
                                                async_op=a)
            elif op in ("reduce_scatter", "reduce_scatter_tensor"):
                e2 = max(n, e - e % n)
                w = dist.reduce_scatter_tensor(scratch(key + ("o",), e2 // n, k), scratch(key + ("i",), e2, k),
                                               group=pg, async_op=a)
            elif op in ("all_to_all", "all_to_all_single"):
                e2 = max(n, e - e % n)
                w = dist.all_to_all_single(scratch(key + ("o",), e2, k), scratch(key + ("i",), e2, k), group=pg,
                                           async_op=a)
            elif op == "gather":
                lst = [scratch(key + ("g", i), e, k) for i in range(n)] if rank == ranks[0] else None
                w = dist.gather(scratch(key, e, k), gather_list=lst, dst=ranks[0], group=pg, async_op=a)
            elif op == "scatter":  # the recorded bytes are the root's whole list: a chunk each
                c = max(1, e // n)
                lst = [scratch(key + ("s", i), c, k) for i in range(n)] if rank == ranks[0] else None
                w = dist.scatter(scratch(key, c, k), scatter_list=lst, src=ranks[0], group=pg, async_op=a)
            else:
                raise ValueError(f"skeleton: op {op!r} (node {node}) is not supported")
            return w, key
        _, _, peer, gi, nbytes, tag, is_async = item
        e = max(1, nbytes // 4)
        key = (kind, peer, e)
        k = in_use.get(key, 0)
        in_use[key] = k + 1
        t = scratch(key, e, k)
        pg = pgs[gi]
        if kind == "send":
            return dist.isend(t, dst=peer, group=pg, tag=tag), key
        if is_async:
            return dist.irecv(t, src=peer, group=pg, tag=tag), key
        dist.recv(t, src=peer, group=pg, tag=tag)
        return None, key

    iters: list[int] = []
    kept: list[dict] = []
    for p in range(passes):
        dist.barrier()
        start.clear()
        end.clear()
        done_at.clear()
        iters = []
        for item in program:
            kind, node = item[0], item[1]
            if kind == "c":
                until = mono() + item[2]
                if compute_mode == "sleep":
                    while (left := until - mono()) > 0:
                        poll()
                        time.sleep(min(left, 50_000) / 1e9)
                else:
                    every = compute_mode == "yield"
                    while mono() < until:
                        poll()
                        if every or busy[0]:  # a waiter to run: this core is its (else the OS lets it wait a tick)
                            yield_cpu()
            elif kind in ("coll", "send", "recv"):
                poll()
                start[node] = mono()
                w, key = issue(item)
                if w is not None and (item[-1] or kind == "send"):
                    track(node, w, key, kind)
                else:
                    if w is not None:
                        w.wait()
                    end[node] = mono()
                    in_use[key] -= 1
                poll()
            elif kind == "wait":
                of = item[2]
                if of in pending:
                    wait_for(of)
                    finish(of, mono())
                poll()
            elif kind == "iter":
                poll()
                iters.append(mono())
        for n in list(pending):  # waited nowhere (a blocking send, eager here): finish them
            wait_for(n)
            finish(n, mono())
        if p > 0 or passes == 1:  # the first of several sets gloo's connections up: not kept
            nodes = sorted(start)
            kept.append({"node": nodes, "start": [start[n] for n in nodes], "end": [end.get(n, -1) for n in nodes],
                         "iters": iters})
    dist.barrier()
    (d / f"times-{rank}.json").write_text(json.dumps({"passes": kept}))
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
    else:
        sys.exit("run `python -m prism commtime RUN` (this module's --worker is the skeleton's rank)")
