"""``python -m prism report``: Chrome trace, Gantt plot and Chakra ET of a run.

Most tests use a synthetic Megatron run written to disk with ``write_run``
(with clock offsets and memory samples added); the report of a real world-4
capture is in tests/integration/test_real_captures.py. Expected counts come from the graph, never from the output under
test.
"""

import gzip
import importlib.util
import os
import pathlib
import shutil
import subprocess
from collections import Counter, defaultdict

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prism import cli
from prism.shell.chakra import et_nodes
from prism.core.costmodel import ZERO, CostModel, Link
from prism.shell.profiles import load_profile
from prism.core.graph import COLL, COMPUTE, ITER, OPS, RECV, SEND, WAIT, ExecutionGraph
from prism.core.replay import Costs, replay_batch
from prism.core.synthetic import MegatronSpec, megatron_events
from prism.core.timeline import PID_BASE, chrome_trace, predicted_timeline, recorded_timeline, segments
from prism.core.trace import Iteration, Manifest, Memory, RankStart
from prism.shell.runfolder import write_run
from tests.support.helpers_graph import Program

HAS_PROTOBUF = importlib.util.find_spec("google.protobuf") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_protobuf = pytest.mark.skipif(not HAS_PROTOBUF, reason="protobuf is not installed (the 'chakra' extra)")
needs_matplotlib = pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (the 'plot' extra)")

SPEC = MegatronSpec(tp=2, pp=2, dp=2, micro_batches=2, layers_per_stage=1, iterations=3)
MiB = 2**20


def offset_of(rank: int) -> int:
    return 1_000_000 * rank - 250_000


def with_start_and_memory(events):
    """The synthetic events plus a RankStart (distinct clock offsets) and a Memory sample per step end."""
    out = {}
    for r, evs in events.items():
        rs = RankStart(r, len(events), r, 100 + r, "host", "cpu", "cpu", offset_of(r), 0)
        body = []
        for e in evs:
            body.append(e)
            if isinstance(e, Iteration):
                body.append(Memory(e.end_ns, "cpu", (r + 1) * MiB * (e.step + 1), 2 * (r + 1) * MiB * (e.step + 1),
                                   3 * MiB, e.step))
        out[r] = [rs, *body]
    return out


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    """(run dir, events, graph) of the synthetic run."""
    events = with_start_and_memory(megatron_events(SPEC))
    run = tmp_path_factory.mktemp("report") / "run"
    manifest = Manifest(1, "synthetic", SPEC.world_size, 0, ("synthetic",), "cpu", "0.1.0", "none", "host")
    write_run(run, manifest, events)
    return run, events, ExecutionGraph.from_events(events)


def report(*args: str) -> int:
    return cli.main(["report", *map(str, args)])


def load(path) -> dict:
    return orjson.loads(pathlib.Path(path).read_bytes())


# ------------------------------------------------------------ trace checks
def rank(e: dict) -> int:
    return e["pid"] - PID_BASE


def ns(us: float) -> int:
    return round(us * 1000)


def nesting_problems(trace: dict) -> list[str]:
    """Slices on one (pid, tid) that overlap without nesting."""
    by_track = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_track[(e["pid"], e["tid"])].append((ns(e["ts"]), ns(e["ts"]) + ns(e["dur"]), e["name"]))
    bad = []
    for key, slices in by_track.items():
        stack = []
        for s, e, name in sorted(slices, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1][1] <= s:
                stack.pop()
            if stack and e > stack[-1][1]:
                bad.append(f"{key}: {name} [{s}, {e}] overlaps {stack[-1][2]} [{stack[-1][0]}, {stack[-1][1]}]")
            stack.append((s, e, name))
    return bad


def flow_problems(trace: dict) -> list[str]:
    """Flow ids without exactly one start and one finish."""
    ends = defaultdict(Counter)
    for e in trace["traceEvents"]:
        if e["ph"] in ("s", "f"):
            ends[e["id"]][e["ph"]] += 1
    return [f"flow {i}: {dict(c)}" for i, c in ends.items() if c != Counter({"s": 1, "f": 1})]


def test_the_checkers_catch_broken_traces():
    bad = {"traceEvents": [
        {"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": 0.0, "dur": 2.0},
        {"ph": "X", "name": "b", "pid": 0, "tid": 0, "ts": 1.0, "dur": 2.0},  # partial overlap
        {"ph": "X", "name": "c", "pid": 0, "tid": 1, "ts": 0.0, "dur": 4.0},
        {"ph": "X", "name": "d", "pid": 0, "tid": 1, "ts": 1.0, "dur": 1.0},  # nested: fine
        {"ph": "s", "id": 1, "pid": 0, "tid": 0, "ts": 0.0},
        {"ph": "s", "id": 1, "pid": 0, "tid": 0, "ts": 0.5},
        {"ph": "f", "id": 2, "pid": 0, "tid": 0, "ts": 0.5},
    ]}
    assert len(nesting_problems(bad)) == 1 and "b [1000, 3000] overlaps a" in nesting_problems(bad)[0]
    assert sorted(flow_problems(bad)) == ["flow 1: {'s': 2}", "flow 2: {'f': 1}"]


def expected_flows(g: ExecutionGraph) -> int:
    return g.n_messages + int((g.group_size[g.inst_group] - 1).sum())


def check_trace(trace: dict, g: ExecutionGraph, memory: bool) -> None:
    ev = trace["traceEvents"]
    names = {rank(e): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(g.world_size)}
    slices = [e for e in ev if e["ph"] == "X"]
    assert len(slices) == int((g.kind != ITER).sum())
    assert Counter(rank(e) for e in slices) == Counter(g.rank[g.kind != ITER].tolist())
    for e in slices:
        assert {"op", "step"} <= e["args"].keys()
        if e["cat"] != "compute":
            assert {"gid", "seq", "bytes"} <= e["args"].keys()
    assert nesting_problems(trace) == []
    assert flow_problems(trace) == []
    assert sum(e["ph"] == "s" for e in ev) == expected_flows(g)
    marks = [e for e in ev if e["ph"] == "i" and e["s"] == "t"]
    assert len(marks) == int((g.kind == ITER).sum())
    counters = [e for e in ev if e["ph"] == "C"]
    if memory:
        assert Counter(rank(e) for e in counters) == Counter(g.rank[g.kind == ITER].tolist())
    else:
        assert counters == []
    assert all(e["pid"] > 0 and e.get("tid", 1) > 0 for e in ev)  # Perfetto reserves pid 0 (swapper)
    threads = {(rank(e), e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    for e in slices:  # every slice's thread is named
        assert (rank(e), e["tid"]) in threads
    comm = (g.kind == COLL) | (g.kind == SEND) | (g.kind == RECV)
    used = set(zip(g.rank[comm].tolist(), g.group[comm].tolist()))
    assert used, "the run should communicate"
    for r, gi in used:  # a group a rank communicates on has a thread named by its gid and ranks
        gr = g.groups[gi]
        assert any(name.startswith(f"{gr.gid} [{gr.ranks[0]}, ") for (p, _), name in threads.items() if p == r)


# ------------------------------------------------------------ perfetto json
def test_perfetto_predicted_structure_and_times(syn, tmp_path):
    run, events, g = syn
    out = tmp_path / "t.json"
    assert report(run, "--perfetto", out) == 0
    trace = load(out)
    check_trace(trace, g, memory=True)
    res = replay_batch(g, cost_model=load_profile("h200_nvlink_ib400"))
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert max(ns(e["ts"]) + ns(e["dur"]) for e in slices) == res.makespan_ns
    # the slices are the replay's times, node by node (rank by rank, program order)
    got = sorted((rank(e), ns(e["ts"]), ns(e["dur"])) for e in slices)
    keep = g.kind != ITER
    want = sorted(zip(g.rank[keep].tolist(), res.start[keep].tolist(), (res.end - res.start)[keep].tolist()))
    assert got == want
    assert trace["otherData"]["source"] == "predicted" and trace["otherData"]["cost_model"] == "h200_nvlink_ib400"
    # a memory sample taken at a step's end sits on that rank's end-of-step mark
    marks = {(rank(e), e["args"]["step"]): e["ts"] for e in trace["traceEvents"] if e["ph"] == "i" and e["s"] == "t"}
    for e in (e for e in trace["traceEvents"] if e["ph"] == "C"):
        step = round(e["args"]["allocated"] / (rank(e) + 1)) - 1
        assert e["ts"] == marks[(rank(e), step)]


def test_perfetto_recorded_uses_the_clock_offsets(syn, tmp_path):
    run, events, g = syn
    out = tmp_path / "t.json"
    assert report(run, "--perfetto", out, "--recorded") == 0
    trace = load(out)
    check_trace(trace, g, memory=True)
    assert trace["otherData"]["source"] == "recorded"
    t0 = min(int(g.rec_start[g.nodes_of(r)].min()) + offset_of(r) for r in range(g.world_size))
    computes = sorted((rank(e), ns(e["ts"]), ns(e["dur"])) for e in trace["traceEvents"] if e.get("cat") == "compute")
    want = sorted((r, ev.start_ns + offset_of(r) - t0, ev.end_ns - ev.start_ns)
                  for r, evs in events.items() for ev in evs if type(ev).__name__ == "Compute")
    assert computes == want


def test_perfetto_subset_of_ranks_gzipped(syn, tmp_path):
    run, _, g = syn
    out = tmp_path / "t.json.gz"
    assert report(run, "--perfetto", out, "--ranks", "1,5-6") == 0
    trace = orjson.loads(gzip.decompress(out.read_bytes()))
    kept = {1, 5, 6}
    assert {rank(e) for e in trace["traceEvents"]} == kept
    assert nesting_problems(trace) == [] and flow_problems(trace) == []
    keep = np.isin(g.rank, list(kept))
    start = replay_batch(g, cost_model=load_profile("h200_nvlink_ib400")).start
    want = int((keep[g.msg_send] & keep[g.msg_recv]).sum())
    for i in range(g.n_instances):
        m = g.inst_nodes[g.inst_ptr[i]:g.inst_ptr[i + 1]]
        last = m[np.argmax(start[m])]
        want += int(keep[last]) * int(sum(keep[x] for x in m if x != last))
    assert trace["otherData"]["ranks_shown"] == 3
    assert sum(e["ph"] == "s" for e in trace["traceEvents"]) == want > 0


@pytest.mark.parametrize(("spec", "message"), [
    ("0-99", "ranks must lie in 0..7"), ("3-1", "must not run backwards"), ("a", "ranks and ranges like 0-7,64"),
])
def test_perfetto_bad_ranks(syn, tmp_path, capsys, spec, message):
    assert report(syn[0], "--perfetto", tmp_path / "t.json", "--ranks", spec) == 2
    assert message in capsys.readouterr().err


def test_overlapping_async_ops_get_their_own_threads(syn):
    _, _, g = syn
    # dp_buckets=2: two async gradient all_reduces of one DP group are in flight together
    trace = chrome_trace(predicted_timeline(replay_batch(g)))
    threads = [e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert any("(overlap 1)" in t for t in threads)
    assert nesting_problems(trace) == []


def test_segments_split_held_time_as_the_replay_breakdown_does(syn):
    _, _, g = syn
    res = replay_batch(g, cost_model=load_profile("h200_nvlink_ib400"))
    totals = segments(predicted_timeline(res)).totals(g.world_size)
    b = res.breakdown()
    for key in ("compute", "communication", "waiting"):
        assert np.array_equal(totals[key], b[key]), key
    assert totals["communication"].sum() > 0 and totals["waiting"].sum() > 0 and totals["async"].sum() > 0


def test_no_memory_samples_no_counters(syn):
    _, _, g = syn
    trace = chrome_trace(predicted_timeline(replay_batch(g)))
    check_trace(trace, g, memory=False)


def test_trace_processor_loads_the_file(syn, tmp_path):
    binary = os.environ.get("PRISM_TRACE_PROCESSOR") or shutil.which("trace_processor_shell") \
        or shutil.which("trace_processor")
    if binary is None:
        pytest.skip("Perfetto's trace_processor binary is not available offline (the perfetto Python package "
                    "downloads it at run time); set PRISM_TRACE_PROCESSOR=/path/to/trace_processor_shell to run this")
    run, _, g = syn
    out = tmp_path / "t.json"
    assert report(run, "--perfetto", out) == 0
    q = tmp_path / "q.sql"
    q.write_text("select (select count(*) from slice where dur >= 0 and category != 'iteration') as s, "
                 "(select count(*) from flow) as f;\n")
    r = subprocess.run([binary, "-q", str(q), str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    s, f = r.stdout.strip().splitlines()[-1].replace('"', "").split(",")
    assert int(s) == int((g.kind != ITER).sum()) and int(f) == expected_flows(g)


def check_dependencies(g: ExecutionGraph, rank: int, nodes: list[tuple[int, list[int]]]) -> None:
    """Chakra nodes (id, data_deps) of ``rank`` against the graph: ids run 0, 1, ...; a node depends
    on the last node that held the rank and on every async op waited for since then, nothing else."""
    assert [i for i, _ in nodes] == list(range(len(nodes)))
    sl = g.nodes_of(rank)
    emitted = [n for n in range(sl.start, sl.stop) if g.kind[n] in (COMPUTE, COLL, SEND, RECV)]
    assert len(emitted) == len(nodes)
    id_of = {gn: i for i, gn in enumerate(emitted)}
    held_by, waited = None, []
    it = iter(nodes)
    for n in range(sl.start, sl.stop):
        k = int(g.kind[n])
        if k == ITER:
            continue
        if k == WAIT:
            waited.append(id_of[int(g.wait_of[n])])
            continue
        nid, deps = next(it)
        want = ([held_by] if held_by is not None else []) + waited
        assert sorted(deps) == sorted(set(want)), g.describe(n)
        assert all(d < nid for d in deps)
        if k == COMPUTE or not g.is_async[n]:
            held_by, waited = nid, []


# ------------------------------------------------------------------- chakra
@needs_protobuf
def test_chakra_files_decode_to_the_graph(syn, tmp_path):
    from prism.shell.chakra import COMM_TYPE, NODE_TYPE, read_et

    run, _, g = syn
    assert report(run, "--chakra", tmp_path / "et", "--chakra-prefix", "job") == 0
    groups = orjson.loads((tmp_path / "et" / "comm_group.json").read_bytes())
    assert groups == {gr.gid: list(gr.ranks) for gr in g.groups}
    kind_type = {COMPUTE: NODE_TYPE["COMP_NODE"], COLL: NODE_TYPE["COMM_COLL_NODE"],
                 SEND: NODE_TYPE["COMM_SEND_NODE"], RECV: NODE_TYPE["COMM_RECV_NODE"]}
    for r in range(g.world_size):
        meta, nodes = read_et(tmp_path / "et" / f"job.{r}.et")
        assert meta.version == "0.0.4"
        sl = g.nodes_of(r)
        graph_nodes = [n for n in range(sl.start, sl.stop) if g.kind[n] in kind_type]
        assert len(nodes) == len(graph_nodes)
        assert [n.id for n in nodes] == list(range(len(nodes)))
        check_dependencies(g, r, [(n.id, list(n.data_deps)) for n in nodes])
        assert all(list(n.ctrl_deps) == [] for n in nodes)
        for n, node in zip(graph_nodes, nodes):
            k = int(g.kind[n])
            attrs = {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr}
            assert node.type == kind_type[k]
            assert attrs["step"] == g.step[n] and attrs["is_cpu_op"] is False
            if k == COMPUTE:
                assert abs(node.duration_micros - g.dur[n] / 1000) <= 1
            else:
                assert attrs["comm_size"] == g.nbytes[n]
                assert attrs["pg_name"] == g.groups[g.group[n]].gid
                if k == COLL:
                    assert attrs["comm_type"] == COMM_TYPE[OPS[g.op[n]]]
                else:
                    src, dst = (r, g.peer[n]) if k == SEND else (g.peer[n], r)
                    assert (attrs["comm_src"], attrs["comm_dst"], attrs["comm_tag"]) == (src, dst, g.tag[n])


@needs_protobuf
def test_chakra_wire_format_follows_et_def_proto(syn, tmp_path):
    """Field numbers as in mlcommons/chakra schema/protobuf/et_def.proto, read off the bytes generically."""
    from google.protobuf import empty_pb2
    from google.protobuf.unknown_fields import UnknownFieldSet

    from prism.shell.chakra import COMM_TYPE, chakra_classes, read_et

    c = chakra_classes()
    numbers = {f.name: f.number for f in c.Node.DESCRIPTOR.fields}
    assert numbers == {"id": 1, "name": 2, "type": 3, "ctrl_deps": 4, "data_deps": 5, "start_time_micros": 6,
                       "duration_micros": 7, "inputs": 8, "outputs": 9, "attr": 10}
    attr = {f.name: f.number for f in c.AttributeProto.DESCRIPTOR.fields}
    assert (attr["name"], attr["int32_val"], attr["int64_val"], attr["bool_val"], attr["string_val"]) == (1, 7, 9, 27, 29)
    assert {f.name: f.number for f in c.GlobalMetadata.DESCRIPTOR.fields} == {"version": 1, "attr": 2}
    nt = c.Node.DESCRIPTOR.fields_by_name["type"].enum_type.values_by_name
    assert [nt[k].number for k in ("COMP_NODE", "COMM_SEND_NODE", "COMM_RECV_NODE", "COMM_COLL_NODE")] == [4, 5, 6, 7]
    cct = c.Node.DESCRIPTOR.file.enum_types_by_name["CollectiveCommType"].values_by_name
    assert {k: cct[k].number for k in cct} == {
        "ALL_REDUCE": 0, "REDUCE": 1, "ALL_GATHER": 2, "GATHER": 3, "SCATTER": 4, "BROADCAST": 5, "ALL_TO_ALL": 6,
        "REDUCE_SCATTER": 7, "REDUCE_SCATTER_BLOCK": 8, "BARRIER": 9}
    assert [COMM_TYPE[op] for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                                     "all_to_all_single", "broadcast", "barrier")] == [0, 2, 7, 6, 5, 9]

    run, _, g = syn
    assert report(run, "--chakra", tmp_path / "et") == 0
    data = (tmp_path / "et" / "prism.0.et").read_bytes()
    _, nodes = read_et(tmp_path / "et" / "prism.0.et")
    # skip the metadata message; decode the first node with no schema at all
    size, pos = data[0], 1
    assert size < 128
    pos += size
    nsize, pos2 = data[pos], pos + 1
    raw = empty_pb2.Empty.FromString(data[pos2:pos2 + nsize])
    fields = {(f.field_number, f.wire_type): f.data for f in UnknownFieldSet(raw)}
    assert fields[(3, 0)] == 4  # type = COMP_NODE: the rank starts with a compute segment
    assert fields[(7, 0)] == nodes[0].duration_micros
    assert fields[(2, 2)] == nodes[0].name.encode()


# --------------------------------------------------------------------- plot
@needs_matplotlib
def test_plot_writes_a_png(syn, tmp_path):
    run, _, _ = syn
    out = tmp_path / "g.png"
    assert report(run, "--plot", out, "--steps", "1:2") == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


@needs_matplotlib
def test_plot_step_window_errors(syn, tmp_path, capsys):
    run, _, _ = syn
    assert report(run, "--plot", tmp_path / "g.png", "--steps", "7") == 2
    assert "step 7 has no end-of-step marks; the run's steps are 0..2" in capsys.readouterr().err
    assert report(run, "--plot", tmp_path / "g.png", "--steps", "x:") == 2
    assert "--steps takes FIRST[:LAST]" in capsys.readouterr().err


def test_report_needs_an_output(syn, capsys):
    assert report(syn[0]) == 2
    assert "nothing to write" in capsys.readouterr().err


def test_report_bad_profile(syn, tmp_path, capsys):
    assert report(syn[0], "--perfetto", tmp_path / "t.json", "--net", "nope") == 2
    assert "nope" in capsys.readouterr().err


# ----------------------------------------------------------- random graphs
#: Two nodes of two ranks, slow inter-node link: costs differ between groups.
SKEWED = CostModel("skewed", 2, Link(2e9, 3e-6), Link(0.25e9, 7e-6), base_latency=1e-6, source="test")


@st.composite
def programs(draw):
    """Deadlock-free random runs: collectives on random groups (async on random members), p2p, waits."""
    world = draw(st.integers(2, 4))
    extra = draw(st.lists(st.sets(st.integers(0, world - 1), min_size=1, max_size=world), max_size=2))
    p = Program(world, {f"g{i}": tuple(sorted(s)) for i, s in enumerate(extra)})
    outstanding: list[tuple[int, str]] = []
    for step in range(draw(st.integers(1, 2))):
        for n in range(draw(st.integers(1, 10))):
            handle = f"h{step}.{n}"
            what = draw(st.sampled_from(["compute", "coll", "p2p", "wait"]))
            if what == "compute":
                p.compute(draw(st.integers(0, world - 1)), draw(st.integers(0, 5000)))
            elif what == "coll":
                gid = draw(st.sampled_from(sorted(p.groups)))
                asy = draw(st.sets(st.sampled_from(p.groups[gid])))
                p.coll(gid, draw(st.sampled_from(["all_reduce", "all_gather_into_tensor", "broadcast"])),
                       draw(st.integers(0, 1 << 16)), async_on=asy, handle=handle)
                outstanding += [(r, handle) for r in sorted(asy)]
            elif what == "p2p":
                src, dst = draw(st.lists(st.integers(0, world - 1), min_size=2, max_size=2, unique=True))
                a_s, a_r = draw(st.booleans()), draw(st.booleans())
                p.send(src, dst, draw(st.integers(0, 1 << 16)), async_send=a_s, async_recv=a_r, handle=handle)
                outstanding += [(r, handle) for r, a in ((src, a_s), (dst, a_r)) if a]
            elif outstanding:
                p.wait(*outstanding.pop(draw(st.integers(0, len(outstanding) - 1))))
        for r, h in outstanding:
            p.wait(r, h)
        outstanding = []
        p.end_step()
    return p.events


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.sampled_from([ZERO, SKEWED]), st.booleans())
def test_random_graphs_give_well_formed_traces_and_dependencies(events, model, recorded):
    g = ExecutionGraph.from_events(events)
    if recorded:
        tl = recorded_timeline(g, [1000 * r for r in range(g.world_size)], Costs.of(g, cost_model=model))
    else:
        tl = predicted_timeline(replay_batch(g, cost_model=model))
    trace = chrome_trace(tl)
    assert nesting_problems(trace) == []
    assert flow_problems(trace) == []
    assert sum(e["ph"] == "s" for e in trace["traceEvents"]) == expected_flows(g)
    for r in range(g.world_size):
        check_dependencies(g, r, [(n.id, list(n.data_deps)) for n in et_nodes(tl, r)])
