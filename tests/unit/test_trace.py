"""PrismTrace v1: codec and validator (prism.core.trace), writer and reader
(prism.shell.runfolder); a writer killed mid-write: tests/integration/test_trace_files.py."""

from __future__ import annotations

import dataclasses
import os
import typing

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.core import trace as T
from prism.shell import runfolder
from prism.core.trace import (
    P2P,
    Collective,
    Compute,
    GroupCreated,
    Iteration,
    Manifest,
    Memory,
    RankEnd,
    RankStart,
    TensorValue,
)

# --------------------------------------------------------------------------
# Hypothesis strategies: one per dataclass, built from its fields' types
# --------------------------------------------------------------------------

_INT = st.integers(-(2**63), 2**63 - 1)


def _strategy_for_type(tp: typing.Any) -> st.SearchStrategy[typing.Any]:
    if tp is int:
        return _INT
    if tp is str:
        return st.text(max_size=20)
    if tp is bool:
        return st.booleans()
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    if tp is bytes:
        return st.binary(max_size=64)
    args = typing.get_args(tp)
    if type(None) in args:
        return st.none() | _strategy_for_type(next(a for a in args if a is not type(None)))
    if typing.get_origin(tp) is tuple and args[-1] is Ellipsis:
        return st.lists(_strategy_for_type(args[0]), max_size=4).map(tuple)
    if typing.get_origin(tp) is tuple:
        return st.tuples(*map(_strategy_for_type, args))
    raise AssertionError(f"no strategy for {tp!r}")


def records(cls: type) -> st.SearchStrategy[typing.Any]:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: _strategy_for_type(hints[f.name]) for f in dataclasses.fields(cls)})


ALL_EVENTS = st.one_of(*(records(c) for c in T.EVENT_TYPES))


@pytest.mark.parametrize("cls", T.EVENT_TYPES, ids=lambda c: c.KIND)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_event_kind_round_trips(cls, data):
    ev = data.draw(records(cls))
    line = T.encode_event(ev)
    assert b"\n" not in line
    assert orjson.loads(line)["k"] == cls.KIND
    assert T.decode_event(line) == ev
    assert T.decode_event(orjson.loads(line)) == ev


@settings(max_examples=100, deadline=None)
@given(m=records(Manifest).map(lambda m: dataclasses.replace(m, version=T.TRACE_VERSION, version_minor=T.TRACE_VERSION_MINOR)))
def test_manifest_round_trips(m):
    raw = T.encode_manifest(m)
    assert raw.endswith(b"}\n") and b'\n  "' in raw  # pretty: one field per line
    assert T.decode_manifest(raw) == m


# --------------------------------------------------------------------------
# Codec: strict decoding
# --------------------------------------------------------------------------

COLL = Collective(
    gid="world", seq=0, op="all_reduce", reduce_op="SUM", dtype="float32",
    in_shapes=((4,),), out_shapes=((4,),), bytes=16, issue_ns=10, wait_ns=10, end_ns=20,
)


def _coll_obj(**changes):
    obj = orjson.loads(T.encode_event(COLL))
    obj.update(changes)
    return obj


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ({"k": "nope", "t_ns": 1}, r"unknown record kind 'nope'"),
        ({"t_ns": 1}, r"record has no kind field 'k'"),
        ({k: v for k, v in _coll_obj().items() if k != "seq"}, r"coll record is missing field 'seq'"),
        (_coll_obj(extra=5), r"coll record has unknown field 'extra' \(value 5\)"),
        (_coll_obj(seq="3"), r"coll record: field seq must be int, got '3'"),
        (_coll_obj(seq=True), r"field seq must be int, got True"),
        (_coll_obj(async_op=1), r"field async_op must be bool, got 1"),
        (_coll_obj(in_shapes=[[4, "x"]]), r"field in_shapes\[0\]\[1\] must be int, got 'x'"),
        (_coll_obj(in_shapes=[4]), r"field in_shapes\[0\] must be list of int, got 4"),
        (_coll_obj(premul="2"), r"field premul must be finite float or null, got '2'"),
        ({"k": "value", "ref": "r", "dtype": "int8", "shape": [1], "data": "!!"}, r"field data must be base64 str, got '!!'"),
    ],
)
def test_decode_rejects_bad_records_naming_field_and_value(obj, match):
    with pytest.raises(T.TraceFormatError, match=match):
        T.decode_event(orjson.dumps(obj))


def test_decode_error_carries_field_and_value():
    with pytest.raises(T.TraceFormatError) as e:
        T.decode_event(_coll_obj(bytes=-1.5))
    assert (e.value.field, e.value.value) == ("bytes", -1.5)


@pytest.mark.parametrize(("raw", "match"), [(b"{not json", r"not JSON"), (b"[1, 2]", r"must be a JSON object, got \[1, 2\]")])
def test_decode_rejects_non_records(raw, match):
    with pytest.raises(T.TraceFormatError, match=match):
        T.decode_event(raw)


def test_decode_ignore_unknown_drops_extra_fields():
    assert T.decode_event(_coll_obj(extra=5), ignore_unknown=True) == COLL


@pytest.mark.parametrize(
    ("ev", "match"),
    [
        (dataclasses.replace(COLL, in_shapes=[(4,)]), r"field in_shapes must be tuple of list of int, got \[\(4,\)\]"),
        (dataclasses.replace(COLL, seq=False), r"field seq must be int, got False"),
        (dataclasses.replace(COLL, premul=float("nan")), r"field premul must be finite float or null, got nan"),
        (Iteration(step=1, end_ns=2**64), r"field end_ns must be int in the 64-bit range, got 18446744073709551616"),
    ],
)
def test_encode_rejects_what_the_reader_would_reject(ev, match):
    with pytest.raises(T.TraceFormatError, match=match):
        T.encode_event(ev)


def test_encode_refuses_non_events():
    with pytest.raises(TypeError, match="not a PrismTrace record"):
        T.encode_event({"k": "coll"})


# --------------------------------------------------------------------------
# Manifest versions
# --------------------------------------------------------------------------

MANIFEST = Manifest(
    version=T.TRACE_VERSION, run_id="r1", world_size=4, created_unix_ns=1_700_000_000_000_000_000,
    command=("train.py", "--steps", "2"), device_kind="cpu", prism_version="0.1.0",
    torch_version="2.13.0", hostname="box", layout=(("tp", 2), ("dp", 2)), notes=(("slots", "2"),),
)


def _manifest_obj(**changes):
    obj = orjson.loads(T.encode_manifest(MANIFEST))
    obj.update(changes)
    return obj


def test_manifest_newer_major_is_refused_naming_file_and_versions():
    match = (rf"RUN/manifest.json was written with PrismTrace 2\.{T.TRACE_VERSION_MINOR}; this reader knows only "
             rf"major version 1 \(up to 1\.{T.TRACE_VERSION_MINOR}\)\. Upgrade Prism")
    with pytest.raises(T.TraceVersionError, match=match):
        T.decode_manifest(_manifest_obj(version=2), file="RUN/manifest.json")


def test_manifest_newer_minor_ignores_unknown_fields():
    m = T.decode_manifest(_manifest_obj(version_minor=T.TRACE_VERSION_MINOR + 1, shiny=True))
    assert m == dataclasses.replace(MANIFEST, version_minor=T.TRACE_VERSION_MINOR + 1)


def test_manifest_same_minor_rejects_unknown_fields():
    with pytest.raises(T.TraceFormatError, match=r"m.json: manifest record has unknown field 'shiny'"):
        T.decode_manifest(_manifest_obj(shiny=True), file="m.json")


def test_manifest_without_version_is_refused():
    obj = _manifest_obj()
    del obj["version_minor"]
    with pytest.raises(T.TraceFormatError, match=r"version and version_minor must be ints, got 1 and None"):
        T.decode_manifest(obj)


# --------------------------------------------------------------------------
# Group ids and layout
# --------------------------------------------------------------------------


def test_group_id_is_stable_and_distinguishes_index_and_members():
    assert T.group_id(0, range(8)) == "world"
    gid = T.group_id(2, [0, 2, 4])
    assert gid.startswith("g2-") and len(gid) == len("g2-") + 8
    assert gid == T.group_id(2, (0, 2, 4))
    assert gid != T.group_id(3, [0, 2, 4])
    assert gid != T.group_id(2, [0, 2, 5])
    assert gid != T.group_id(2, [2, 0, 4])  # group-rank order matters


@pytest.mark.parametrize(("index", "ranks"), [(-1, [0]), (1, []), (1, [0, -2]), (True, [0])])
def test_group_id_rejects_bad_input(index, ranks):
    with pytest.raises(ValueError, match=r"group_id: "):
        T.group_id(index, ranks)


def test_layout_paths(tmp_path):
    assert runfolder.rank_path(tmp_path, 12) == tmp_path / "ranks" / "rank-000012.jsonl"
    assert runfolder.log_path(tmp_path, 12) == tmp_path / "logs" / "rank-000012.log"
    assert runfolder.manifest_path(tmp_path) == tmp_path / "manifest.json"
    assert runfolder.log_path_pattern(tmp_path).format(rank=12) == str(runfolder.log_path(tmp_path, 12))
    assert runfolder.gpu_samples_path(tmp_path) == tmp_path / "telemetry" / "gpu.jsonl"
    assert runfolder.swap_log_path(tmp_path) == tmp_path / "telemetry" / "swaps.jsonl"
    assert runfolder.swap_report_path(tmp_path) == tmp_path / "telemetry" / "swaps.json"
    assert runfolder.rank_of_path(runfolder.rank_path(tmp_path, 1234567)) == 1234567
    assert runfolder.rank_of_path("rank-12.jsonl") is None  # not the canonical spelling
    assert runfolder.rank_of_path("notes.txt") is None
    runfolder.write_manifest(tmp_path / "run", MANIFEST)
    for sub in ("ranks", "logs", "calibration", "predictions", "emulation", "telemetry"):
        assert (tmp_path / "run" / sub).is_dir()
    assert not (tmp_path / "run" / "manifest.json.tmp").exists()


# --------------------------------------------------------------------------
# A small valid run (world 4: TP 2 x DP 2), with the layout's groups
# --------------------------------------------------------------------------

W = 4
TP_GROUPS = [[0, 1], [2, 3]]  # rank = tp_rank + TP * dp_rank
DP_GROUPS = [[0, 2], [1, 3]]


def rank_events(rank: int, steps: int = 2) -> list[T.Event]:
    tp = next(g for g in TP_GROUPS if rank in g)
    dp = next(g for g in DP_GROUPS if rank in g)
    # Every rank creates every group in the same order (torch's rule); it
    # records those it belongs to.
    created = [(1, TP_GROUPS[0]), (2, TP_GROUPS[1]), (3, DP_GROUPS[0]), (4, DP_GROUPS[1])]
    evs: list[T.Event] = [
        RankStart(rank=rank, world_size=W, local_rank=rank, pid=100 + rank, hostname="box", device="cpu",
                  physical_device="cpu", clock_offset_ns=-5, start_ns=1000),
        GroupCreated(gid="world", ranks=tuple(range(W)), index=0, name="0", t_ns=1001),
    ]
    for index, members in created:
        if rank in members:
            evs.append(GroupCreated(T.group_id(index, members), tuple(members), index, str(index), 1002))
    tp_gid, dp_gid = T.group_id(1 + TP_GROUPS.index(tp), tp), T.group_id(3 + DP_GROUPS.index(dp), dp)
    t = 2000
    for step in range(steps):
        evs.append(Compute(t, t + 100, step))
        evs.append(Collective(tp_gid, step, "all_reduce", "SUM", "float32", ((8,),), ((8,),), 32,
                              issue_ns=t + 100, wait_ns=t + 100, end_ns=t + 150, step=step))
        evs.append(Collective(dp_gid, 2 * step, "all_to_all_single", "", "int64", ((5, 2),), ((3, 2),), 80,
                              in_splits=(2, 3), out_splits=(1, 2), issue_ns=t + 150, wait_ns=t + 160,
                              end_ns=t + 170, step=step))
        evs.append(TensorValue(f"coll:{dp_gid}:{2 * step}:out", "int64", (2,), bytes(16)))
        evs.append(Collective(dp_gid, 2 * step + 1, "broadcast", "", "float32", ((2,),), ((2,),), 8, root=0,
                              async_op=True, issue_ns=t + 170, wait_ns=t + 180, end_ns=t + 190, step=step))
        peer = dp[1 - dp.index(rank)]
        evs.append(P2P("send" if rank < peer else "recv", dp_gid, peer, 0, step, "bfloat16", (3,), 6,
                       issue_ns=t + 190, wait_ns=t + 190, end_ns=t + 195, step=step))
        evs.append(Memory(t + 199, "cpu", 10, 20, 30, step))
        evs.append(Iteration(step, t + 200))
        t += 1000
    evs.append(RankEnd(t, "ok"))
    return evs


def write_sample_run(run_dir, **manifest_changes):
    m = dataclasses.replace(MANIFEST, **manifest_changes)
    return runfolder.write_run(run_dir, m, {r: rank_events(r) for r in range(W)})


def test_sample_run_is_valid(tmp_path):
    run = runfolder.read_run(write_sample_run(tmp_path / "run"))
    assert run.warnings == []
    assert T.validate_run(run) == []


# --------------------------------------------------------------------------
# Writer and reader
# --------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(events=st.lists(ALL_EVENTS, max_size=30), flush_every=st.integers(1, 8))
def test_writer_reader_round_trip(tmp_path_factory, events, flush_every):
    run_dir = tmp_path_factory.mktemp("run")
    with runfolder.TraceWriter(run_dir, 3, flush_every=flush_every) as w:
        for ev in events:
            w.write(ev)
    rt = runfolder.read_rank_file(runfolder.rank_path(run_dir, 3))
    assert rt.rank == 3
    assert rt.events == events
    assert rt.lines == list(range(1, len(events) + 1))


def test_writer_flushes_every_n_lines_and_on_flush(tmp_path):
    evs = rank_events(0)
    w = runfolder.TraceWriter(tmp_path, 0, flush_every=3)
    path = runfolder.rank_path(tmp_path, 0)
    w.write(evs[0])
    w.write(evs[1])
    assert path.read_bytes() == b""
    w.write(evs[2])
    assert path.read_bytes().count(b"\n") == 3
    w.write(evs[3])
    w.flush()
    assert path.read_bytes().count(b"\n") == 4
    w.close()
    w.close()
    with pytest.raises(ValueError, match=r"TraceWriter for rank 0 .* is closed"):
        w.write(evs[4])


def test_writer_appends_to_a_clean_file_and_refuses_a_torn_one(tmp_path):
    evs = rank_events(1)
    with runfolder.TraceWriter(tmp_path, 1) as w:
        w.write(evs[0])
    with runfolder.TraceWriter(tmp_path, 1) as w:
        w.write(evs[1])
    assert runfolder.read_rank_file(runfolder.rank_path(tmp_path, 1)).events == evs[:2]
    with open(runfolder.rank_path(tmp_path, 1), "ab") as f:
        f.write(b'{"k":"iter"')
    with pytest.raises(T.TraceFormatError, match=r"rank-000001.jsonl ends with a torn line"):
        runfolder.TraceWriter(tmp_path, 1)


def test_truncation_at_every_byte_keeps_whole_records_and_warns(tmp_path):
    evs = rank_events(0, steps=1)
    with runfolder.TraceWriter(tmp_path, 0) as w:
        for ev in evs:
            w.write(ev)
    path = runfolder.rank_path(tmp_path, 0)
    full = path.read_bytes()
    ends = [i + 1 for i, b in enumerate(full) if b == ord("\n")]
    for cut in range(len(full)):
        path.write_bytes(full[:cut])
        rt = runfolder.read_rank_file(path)
        whole = sum(1 for e in ends if e <= cut)
        assert rt.events == evs[:whole], cut
        assert len(rt.warnings) == 1, cut
        w = rt.warnings[0]
        assert (w.file, w.line) == (str(path), whole + 1), cut
        torn = cut not in ends and cut != 0
        assert ("torn last line" in w.message) == torn, (cut, w.message)
        assert ("without rank_end" in w.message) == (not torn), (cut, w.message)


def test_corrupted_middle_line_stops_reading_there(tmp_path):
    evs = rank_events(2, steps=1)
    with runfolder.TraceWriter(tmp_path, 2) as w:
        for ev in evs:
            w.write(ev)
    path = runfolder.rank_path(tmp_path, 2)
    lines = path.read_bytes().split(b"\n")
    lines[4] = lines[4][:10] + b"\x00garbage" + lines[4][10:]
    path.write_bytes(b"\n".join(lines))
    rt = runfolder.read_rank_file(path)
    assert rt.events == evs[:4]
    assert [(w.line, w.message[:18]) for w in rt.warnings] == [(5, "corrupted record: ")]
    assert str(path) in str(rt.warnings[0])


def test_valid_json_with_bad_field_in_the_middle_is_damage(tmp_path):
    path = runfolder.rank_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    good = T.encode_event(rank_events(0)[0])
    path.write_bytes(good + b"\n" + b'{"k":"iter","step":"1","end_ns":2}\n' + good + b"\n")
    rt = runfolder.read_rank_file(path)
    assert len(rt.events) == 1
    assert rt.warnings[0].line == 2
    assert "field step must be int, got '1'" in rt.warnings[0].message


def test_empty_line_is_damage(tmp_path):
    path = runfolder.rank_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    good = T.encode_event(rank_events(0)[0])
    path.write_bytes(good + b"\n\n" + good + b"\n")
    rt = runfolder.read_rank_file(path)
    assert (len(rt.events), rt.warnings[0].line) == (1, 2)
    assert "empty line" in rt.warnings[0].message


def test_rank_from_first_record_when_the_name_is_not_canonical(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(T.encode_event(rank_events(3)[0]) + b"\n")
    assert runfolder.read_rank_file(path).rank == 3
    (tmp_path / "x.jsonl").write_bytes(b"")
    with pytest.raises(ValueError, match=r"cannot tell which rank this file belongs to"):
        runfolder.read_rank_file(tmp_path / "x.jsonl")


def test_read_run_without_manifest_says_what_is_wrong(tmp_path):
    with pytest.raises(T.TraceFormatError, match=r"manifest.json not found: .* is not a Prism run directory"):
        runfolder.read_run(tmp_path)


def test_read_run_with_newer_minor_skips_unknown_kinds_and_fields(tmp_path):
    run_dir = write_sample_run(tmp_path / "run")
    newer = _manifest_obj(version_minor=T.TRACE_VERSION_MINOR + 1)
    runfolder.manifest_path(run_dir).write_bytes(orjson.dumps(newer))
    path = runfolder.rank_path(run_dir, 0)
    lines = path.read_bytes().split(b"\n")
    lines.insert(3, b'{"k":"future","x":1}')
    lines[4] = lines[4][:-1] + b',"later":7}'
    path.write_bytes(b"\n".join(lines))
    run = runfolder.read_run(run_dir)
    assert run.ranks[0] == rank_events(0)
    assert run.lines[0][3] == 5  # line numbers still point into the file
    msgs = [w.message for w in run.warnings]
    assert any(f"written by PrismTrace 1.{T.TRACE_VERSION_MINOR + 1}" in m for m in msgs)
    assert any("skipped records of unknown kind 'future'" in m for m in msgs)
    # With the reader's own minor the same lines are damage.
    runfolder.manifest_path(run_dir).write_bytes(T.encode_manifest(MANIFEST))
    run = runfolder.read_run(run_dir)
    assert len(run.ranks[0]) == 3
    assert any("unknown record kind 'future'" in w.message for w in run.warnings)


def test_read_run_ignores_stray_files_with_a_warning(tmp_path):
    run_dir = write_sample_run(tmp_path / "run")
    (run_dir / "ranks" / "notes.txt").write_text("hi")
    run = runfolder.read_run(run_dir)
    assert sorted(run.ranks) == list(range(W))
    assert [w.message for w in run.warnings] == ["not a rank file (expected rank-NNNNNN.jsonl); ignored"]


# --------------------------------------------------------------------------
# Validator: one test per rule, on a synthetic run changed in one place
# --------------------------------------------------------------------------


def _run_with(rank: int, edit) -> T.Run:
    ranks = {r: rank_events(r) for r in range(W)}
    ranks[rank] = edit(list(ranks[rank]))
    return runfolder.in_memory_run("RUN", MANIFEST, ranks)


def _only_problem(run: T.Run) -> T.Problem:
    problems = T.validate_run(run)
    assert len(problems) == 1, problems
    return problems[0]


def _replace_at(i, **changes):
    def edit(evs):
        evs[i] = dataclasses.replace(evs[i], **changes)
        return evs

    return edit


def _index(rank, pred):
    return next(i for i, ev in enumerate(rank_events(rank)) if pred(ev))


FIRST_COLL = _index(0, lambda ev: type(ev) is Collective)
FIRST_A2A = _index(0, lambda ev: type(ev) is Collective and ev.op == "all_to_all_single")
FIRST_BCAST = _index(0, lambda ev: type(ev) is Collective and ev.op == "broadcast")
FIRST_P2P = _index(0, lambda ev: type(ev) is P2P)
FIRST_VALUE = _index(0, lambda ev: type(ev) is TensorValue)
FIRST_COMPUTE = _index(0, lambda ev: type(ev) is Compute)
FIRST_ITER = _index(0, lambda ev: type(ev) is Iteration)


def _check(run, field, match, *, rank=0, line=None):
    # A broken record may also break a later rule (a wrong gid leaves a gap in
    # the right group's seqs); the rule under test is the one on this field.
    problems = [p for p in T.validate_run(run) if (p.rank, p.field) == (rank, field)]
    assert len(problems) == 1, problems
    p = problems[0]
    assert p.file == os.path.join("RUN", "ranks", f"rank-{rank:06d}.jsonl")
    if line is not None:
        assert p.line == line
    with pytest.raises(AssertionError, match=match):
        raise AssertionError(p.message)
    return p


def test_rule_first_record_is_rank_start():
    _check(_run_with(0, lambda evs: evs[1:]), "k", r"first record must be rank_start, got group", line=1)


def test_rule_rank_start_names_the_files_rank():
    _check(_run_with(0, _replace_at(0, rank=2)), "rank", r"rank_start says rank 2 in the file of rank 0", line=1)


def test_rule_rank_start_only_first():
    _check(_run_with(0, lambda evs: evs[:2] + [evs[0]] + evs[2:]), "k", r"rank_start again", line=3)


def test_rule_nothing_after_rank_end():
    _check(_run_with(0, lambda evs: evs + [Memory(10**6, "cpu", 1, 1, 1, 9)]), "k", r"mem record after rank_end")


def test_rule_empty_rank_file():
    _check(_run_with(1, lambda evs: []), "k", r"the file has no records", rank=1)


def test_rule_every_rank_has_a_file():
    ranks = {r: rank_events(r) for r in range(W - 1)}
    p = _only_problem(runfolder.in_memory_run("RUN", MANIFEST, ranks))
    assert (p.rank, p.message) == (3, "no rank file for rank 3 (world_size 4)")
    assert p.file == os.path.join("RUN", "ranks", "rank-000003.jsonl")


def test_a_run_built_without_file_names_is_named_by_rank():
    ranks = {r: rank_events(r) for r in range(W - 1)}
    p = _only_problem(T.Run("RUN", MANIFEST, ranks))
    assert (p.file, p.rank) == ("rank 3", 3)


def test_rule_collective_times_ordered():
    _check(_run_with(0, _replace_at(FIRST_COLL, wait_ns=5)), "issue_ns",
           r"all_reduce on g1-\w+ seq 0: times must satisfy issue_ns <= wait_ns <= end_ns, got 2100, 5, 2150")


def test_rule_p2p_times_ordered():
    _check(_run_with(0, _replace_at(FIRST_P2P, end_ns=0)), "wait_ns", r"send with peer 2 .*issue_ns <= wait_ns <= end_ns")


def test_rule_compute_start_before_end():
    _check(_run_with(0, _replace_at(FIRST_COMPUTE, end_ns=1)), "end_ns", r"compute ends \(1\) before it starts \(2000\)")


def test_rule_op_is_known():
    _check(_run_with(0, _replace_at(FIRST_COLL, op="allreduce")), "op", r"unknown collective op 'allreduce'")


def test_rule_reduce_op_is_known_for_reducing_ops():
    _check(_run_with(0, _replace_at(FIRST_COLL, reduce_op="sum")), "reduce_op", r"reduce_op must be one of SUM, .*got 'sum'")


def test_rule_reduce_op_empty_for_non_reducing_ops():
    _check(_run_with(0, _replace_at(FIRST_BCAST, reduce_op="SUM")), "reduce_op", r"non-reducing op must have reduce_op \"\"")


def test_rule_bytes_not_negative():
    _check(_run_with(0, _replace_at(FIRST_COLL, bytes=-1)), "bytes", r"bytes must be >= 0, got -1")


def test_rule_bytes_match_input_shapes():
    _check(_run_with(0, _replace_at(FIRST_COLL, bytes=33)), "bytes", r"bytes 33 != 32, the size of in_shapes \[\(8,\)\] in float32")


def test_rule_dtype_known():
    _check(_run_with(0, _replace_at(FIRST_P2P, dtype="float")), "dtype", r"unknown dtype 'float'")


def test_rule_root_in_group():
    _check(_run_with(0, _replace_at(FIRST_BCAST, root=2)), "root", r"root 2 is not a group rank of g3-\w+ \(size 2\)")


def test_rule_all_to_all_single_splits_sum_to_dim0():
    _check(_run_with(0, _replace_at(FIRST_A2A, in_splits=(2, 2))), "in_splits",
           r"in_splits \[2, 2\] must be 2 sizes >= 0 summing to dim 0 of \[5, 2\]")


def test_rule_all_to_all_single_splits_one_per_member():
    _check(_run_with(0, _replace_at(FIRST_A2A, out_splits=(1, 1, 1))), "out_splits", r"out_splits \[1, 1, 1\] must be 2 sizes")


def test_rule_all_to_all_single_without_splits_divides_evenly():
    _check(_run_with(0, _replace_at(FIRST_A2A, in_splits=())), "in_splits", r"no in_splits, so dim 0 \(5\) must divide evenly among 2 ranks")


def test_rule_splits_only_on_all_to_all():
    _check(_run_with(0, _replace_at(FIRST_COLL, in_splits=(4, 4))), "in_splits", r"only all_to_all ops have splits")


def test_rule_seq_contiguous_from_zero():
    evs = rank_events(0)
    last = max(i for i, ev in enumerate(evs) if type(ev) is Collective and ev.op == "all_reduce")
    _check(_run_with(0, _replace_at(last, seq=2)), "seq", r"collectives on g1-\w+: seq 1 is missing .*next is 2")


def test_rule_seq_not_repeated():
    evs = rank_events(0)
    last = max(i for i, ev in enumerate(evs) if type(ev) is Collective and ev.op == "all_reduce")
    problems = T.validate_run(_run_with(0, _replace_at(last, seq=0)))
    assert [p.field for p in problems] == ["seq"]
    assert f"seq 0 already used on line {FIRST_COLL + 1}" in problems[0].message


def test_rule_pseq_contiguous_from_zero():
    evs = rank_events(0)
    last = max(i for i, ev in enumerate(evs) if type(ev) is P2P)
    _check(_run_with(0, _replace_at(last, pseq=5)), "pseq", r"sends with peer 2 tag 0: pseq 1 is missing")


def test_rule_gid_declared_before_use():
    _check(_run_with(0, _replace_at(FIRST_COLL, gid="g9-00000000")), "gid",
           r"group 'g9-00000000' was not declared by a group record before this line")


def test_rule_rank_is_member_of_the_group_it_uses():
    other = T.group_id(2, TP_GROUPS[1])

    def edit(evs):
        evs.insert(2, GroupCreated(other, tuple(TP_GROUPS[1]), 2, "2", 1002))
        return evs

    run = _run_with(0, lambda evs: _replace_at(FIRST_COLL + 1, gid=other)(edit(evs)))
    _check(run, "gid", r"rank 0 is not a member of g2-\w+ \(ranks \[2, 3\]\)")


def test_rule_p2p_peer_in_group():
    _check(_run_with(0, _replace_at(FIRST_P2P, peer=1)), "peer", r"peer 1 must be another member of g3-\w+ \(ranks \[0, 2\]\)")


def test_rule_group_id_matches_index_and_ranks():
    _check(_run_with(0, _replace_at(2, index=7)), "gid", r"group gid 'g1-\w+' should be 'g7-\w+' \(index 7, ranks \[0, 1\]\)")


def test_rule_world_group_holds_every_rank():
    _check(_run_with(0, _replace_at(1, ranks=(0, 1, 2))), "ranks", r"world group \(index 0\) must hold ranks 0..3")


def test_rule_same_gid_same_members_across_ranks():
    gid = T.group_id(1, TP_GROUPS[0])
    # Rank 1 claims the id of rank 0's TP group with an extra member.
    i = _index(1, lambda ev: type(ev) is GroupCreated and ev.gid == gid)
    run = _run_with(1, _replace_at(i, ranks=(0, 1, 3)))
    problems = T.validate_run(run)
    cross = [p for p in problems if "on rank 0" in p.message]
    assert len(cross) == 1
    assert cross[0].rank == 1
    assert f"group {gid} has index 1 ranks [0, 1, 3] here but index 1 ranks [0, 1] on rank 0" in cross[0].message


def test_rule_value_size_matches_dtype_and_shape():
    _check(_run_with(0, _replace_at(FIRST_VALUE, data=bytes(15))), "data",
           r"15 bytes of data, but shape \[2\] in int64 needs 16")


def test_rule_value_fits_the_small_tensor_limit():
    run = _run_with(0, lambda evs: evs)
    run = dataclasses.replace(run, manifest=dataclasses.replace(MANIFEST, small_tensor_limit=8))
    problems = T.validate_run(run)
    assert {p.field for p in problems} == {"data"}
    assert "16 bytes exceed the manifest's small_tensor_limit 8" in problems[0].message


def test_rule_value_ref_well_formed():
    _check(_run_with(0, _replace_at(FIRST_VALUE, ref="coll:world")), "ref", r"ref must be coll:GID:SEQ:ROLE or p2p:SRC:DST:TAG:PSEQ")


def test_rule_steps_never_decrease():
    _check(_run_with(0, _replace_at(FIRST_ITER + 2, step=0)), "step", r"step went back from 1 \(line \d+\) to 0")


def test_problem_lines_come_from_the_file(tmp_path):
    run_dir = write_sample_run(tmp_path / "run")
    path = runfolder.rank_path(run_dir, 0)
    evs = rank_events(0)
    evs[FIRST_COLL] = dataclasses.replace(evs[FIRST_COLL], bytes=-1)
    path.write_bytes(b"".join(T.encode_event(ev) + b"\n" for ev in evs))
    (p,) = T.validate_run(runfolder.read_run(run_dir))
    assert (p.file, p.line, p.rank, p.field) == (str(path), FIRST_COLL + 1, 0, "bytes")
    assert str(p).startswith(f"{path}:{FIRST_COLL + 1} rank 0 bytes: ")


def test_public_names_are_exported():
    # The package re-exports every public name its records, codec and
    # validator define, and nothing else.
    from prism.core.trace import codec, records, validator

    defined = {
        n
        for mod in (records, codec, validator)
        for n, v in vars(mod).items()
        if not n.startswith("_")
        and (n.isupper() or getattr(v, "__module__", None) == mod.__name__)
    }
    assert set(T.__all__) == defined | {"Event"}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"layout": [["tp", "2"]]}, r"manifest record: field layout\[0\]\[1\] must be int, got '2'"),
        ({"layout": [["tp"]]}, r"field layout\[0\] must be list \[str, int\], got \['tp'\]"),
        ({"command": "train.py"}, r"field command must be list of str, got 'train.py'"),
    ],
)
def test_manifest_fields_are_checked(changes, match):
    with pytest.raises(T.TraceFormatError, match=match):
        T.decode_manifest(_manifest_obj(**changes))


def test_encode_names_nested_fields():
    with pytest.raises(T.TraceFormatError, match=r"field layout\[1\]\[0\] must be str, got 3"):
        T.encode_manifest(dataclasses.replace(MANIFEST, layout=(("tp", 2), (3, 4))))


def test_compute_records_of_minor_1_get_the_1_2_defaults():
    line = b'{"k":"compute","start_ns":5,"end_ns":9,"step":1,"cpu_ns":3,"gpu_ns":-1,"join":false}'
    assert T.decode_event(line, minor=1) == T.Compute(5, 9, 1, 3, -1, False, -1, 0)
    with pytest.raises(T.TraceFormatError, match="missing field 'free_ns'"):
        T.decode_event(line)
    two = T.Compute(5, 9, 1, cpu_ns=3, gpu_ns=-1, free_ns=8, cold_ns=2)
    assert T.decode_event(T.encode_event(two)) == two


def test_compute_records_of_minor_0_get_the_1_1_defaults():
    line = b'{"k":"compute","start_ns":5,"end_ns":9,"step":1}'
    assert T.decode_event(line, minor=0) == T.Compute(5, 9, 1, -1, -1, False)
    with pytest.raises(T.TraceFormatError, match="missing field 'cpu_ns'"):
        T.decode_event(line)  # a 1.1 writer writes every field
    two = T.Compute(5, 9, 1, cpu_ns=3, gpu_ns=2, join=True)
    assert T.decode_event(T.encode_event(two)) == two


def test_the_summary_says_how_much_of_the_compute_ran_on_a_cpu():
    from prism.app.trace import summary_text

    def seg(start, dur, cpu):
        return T.Compute(start, start + dur, 0, thread_cpu_ns=cpu)

    ranks = {r: rank_events(r) for r in range(W)}
    # rank 0: one clean segment (100 of 100) and one half descheduled (50 of 100); rank 1: 90 of 100
    ranks[0] = [*ranks[0][:2], seg(10, 100, 100), seg(200, 100, 50), *ranks[0][2:]]
    ranks[1] = [*ranks[1][:2], seg(10, 100, 90), *ranks[1][2:]]
    text = summary_text(T.Run("RUN", MANIFEST, ranks))
    line = text.splitlines()[text.splitlines().index("") + 1:]
    want = ("compute segments on a CPU (PrismTrace 1.4): the main threads used 80.0% of their wall time (lowest: "
            "rank 0, 75.0%); 1 of 3 segments clean")
    assert any(want in ln for ln in line), text
