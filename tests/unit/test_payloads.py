"""The sans-IO side of ``--record`` (``prism.core.payloads``) and the validator's payload rules."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from prism.core import payloads as PL
from prism.core import trace as T


def test_step_sets_parse_and_print():
    s = PL.StepSet.parse("1,4-5,9-")
    assert [st for st in range(12) if st in s] == [1, 4, 5, 9, 10, 11]
    assert str(s) == "1,4-5,9-"
    for bad in ("x", "3-1", "-1", "1,,2"):
        with pytest.raises(ValueError, match="steps"):
            PL.StepSet.parse(bad)


def test_rank_lists_parse_against_the_world():
    assert PL.RecordPlan.parse_ranks("0,5", 8) == {0, 5}
    assert PL.RecordPlan.parse_ranks("2-4", 8) == {2, 3, 4}
    assert PL.RecordPlan.parse_ranks("all", 3) == {0, 1, 2}
    with pytest.raises(ValueError, match="outside the world of 8 ranks"):
        PL.RecordPlan.parse_ranks("7-8", 8)
    with pytest.raises(ValueError, match="not a rank"):
        PL.RecordPlan.parse_ranks("a", 8)


def test_digest_is_blake2b_128():
    assert PL.digest(b"abc") == hashlib.blake2b(b"abc", digest_size=16).hexdigest()


def _book(limit=1 << 20, steps=None, ranks=(0, 1)):
    return PL.PayloadBook(PL.RecordPlan(frozenset(ranks), steps, limit), {r: f"payloads/r{r}.bin" for r in ranks})


def test_book_records_received_tensors_end_to_end_with_sent_digests():
    book = _book()
    a = np.arange(6, dtype=np.float32)
    sent = book.called(0, ("coll", "g1", 0), 0, "float32", [(2, 3)], [a.tobytes()], [(2, 3)])
    assert [(p.ref, p.role, p.shape, p.nbytes, p.digest) for p in sent] == [
        ("coll:g1:0:in", "sent", (2, 3), 24, PL.digest(a.tobytes()))]
    got = book.delivered(0, ("coll", "g1", 0), [(2 * a).tobytes()], "all_reduce")
    (rec, data), = got
    assert (rec.ref, rec.role, rec.offset, rec.file, bytes(data)) == ("coll:g1:0:out", "recv", 0,
                                                                       "payloads/r0.bin", (2 * a).tobytes())
    # A list output: one record per tensor, offsets laid end to end.
    book.called(0, ("coll", "g1", 1), 0, "float32", [(3,)], [a[:3].tobytes()], [(3,), (3,)])
    two = book.delivered(0, ("coll", "g1", 1), [a[:3].tobytes(), a[3:].tobytes()], "all_gather")
    assert [(p.ref, p.offset) for p, _ in two] == [("coll:g1:1:out0", 24), ("coll:g1:1:out1", 36)]
    # A receive; a rank not recorded; a delivery never announced.
    book.called(1, ("p2p", 0, 1, 7, 0), 0, "float32", (), (), [(6,)])
    (rec, _), = book.delivered(1, ("p2p", 0, 1, 7, 0), [a.tobytes()], "recv")
    assert (rec.ref, rec.offset, rec.shape) == ("p2p:0:1:7:0", 0, (6,))
    assert book.called(2, ("coll", "g1", 0), 0, "float32", [(6,)], [a.tobytes()], [(6,)]) == []
    assert book.delivered(0, ("coll", "g9", 0), [a.tobytes()], "x") == []
    assert book.summary()["bytes"] == 24 + 24 + 24 and book.summary()["records"] == {"0": 5, "1": 1}


def test_book_keeps_only_the_chosen_steps():
    book = _book(steps=PL.StepSet.parse("1"))
    assert book.called(0, ("coll", "g", 0), 0, "int64", [(1,)], [b"\0" * 8], [(1,)]) == []
    assert book.delivered(0, ("coll", "g", 0), [b"\0" * 8], "x") == []
    assert book.called(0, ("coll", "g", 1), 1, "int64", [(1,)], [b"\0" * 8], [(1,)])
    assert book.delivered(0, ("coll", "g", 1), [b"\1" * 8], "x")
    assert book.summary()["steps_recorded"] == [1]


def test_the_cap_stops_every_rank_with_a_message_and_keeps_what_was_recorded():
    book = _book(limit=40)
    book.called(0, ("coll", "g", 0), 3, "float32", [(8,)], [b"\0" * 32], [(8,)])
    assert book.delivered(0, ("coll", "g", 0), [b"\0" * 32], "all_reduce on group g (seq 0)")
    book.called(1, ("coll", "g", 1), 3, "float32", [(4,)], [b"\0" * 16], [(4,)])
    assert book.delivered(1, ("coll", "g", 1), [b"\0" * 16], "all_reduce on group g (seq 1)") == []
    assert "rank 1, step 3, all_reduce on group g (seq 1)" in book.stopped
    assert "--record-limit 40 bytes" in book.stopped and "Raise --record-limit" in book.stopped
    assert not book.records(0) and book.called(0, ("coll", "g", 2), 3, "float32", [(1,)], [b"\0" * 4], [(1,)]) == []
    assert book.summary()["bytes"] == 32


def _rec(ref, role, digest, step=0):
    return T.Payload(ref=ref, role=role, dtype="uint8", shape=(1,), nbytes=1, digest=digest, step=step)


def test_first_divergence_names_the_first_sent_tensor_that_differs():
    recorded = [_rec("coll:g:0:in", "sent", "a" * 32), _rec("coll:g:0:out", "recv", "b" * 32),
                _rec("coll:g:1:in", "sent", "c" * 32, 1), _rec("coll:g:2:in", "sent", "d" * 32, 2)]
    same = {("sent", "coll:g:0:in"): "a" * 32, ("sent", "coll:g:1:in"): "c" * 32, ("sent", "coll:g:2:in"): "d" * 32}
    assert PL.first_divergence(3, recorded, same) is None
    # A run that stopped after step 0 does not diverge where it never went.
    assert PL.first_divergence(3, recorded, {("sent", "coll:g:0:in"): "a" * 32}) is None
    d = PL.first_divergence(3, recorded, {**same, ("sent", "coll:g:1:in"): "e" * 32})
    assert d.expected.ref == "coll:g:1:in" and d.got == "e" * 32
    assert "rank 3 diverges from the capture at step 1: it sent coll:g:1:in" in d.message()


def _run(payloads, ranks_events):
    m = T.Manifest(version=1, run_id="r", world_size=2, created_unix_ns=0, command=(), device_kind="cpu",
                   prism_version="0", torch_version="0", hostname="h")
    return T.Run("r", m, ranks_events, payloads=payloads)


def test_validator_checks_payload_records_against_the_trace():
    start = [T.RankStart(rank=r, world_size=2, local_rank=r, pid=1, hostname="h", device="cpu",
                         physical_device="cpu", clock_offset_ns=0, start_ns=0) for r in range(2)]
    group = T.GroupCreated(gid="world", ranks=(0, 1), index=0, name="", t_ns=0)
    coll = T.Collective(gid="world", seq=0, op="all_reduce", reduce_op="SUM", dtype="float32", in_shapes=((2,),),
                        out_shapes=((2,),), bytes=8, issue_ns=1, wait_ns=1, end_ns=2)
    end = T.RankEnd(t_ns=3, status="ok")
    events = {r: [start[r], group, coll, end] for r in range(2)}
    good = [T.Payload(ref="coll:world:0:in", role="sent", dtype="float32", shape=(2,), nbytes=8, digest="0" * 32,
                      step=0),
            T.Payload(ref="coll:world:0:out", role="recv", dtype="float32", shape=(2,), nbytes=8, digest="1" * 32,
                      step=0, file="payloads/rank-000000.bin", offset=0)]
    assert T.validate_run(_run({0: good}, events)) == []
    bad = [good[0],
           T.Payload(ref="coll:world:5:out", role="recv", dtype="float32", shape=(2,), nbytes=7, digest="xyz",
                     step=0, file="payloads/rank-000000.bin", offset=4)]
    fields = sorted(p.field for p in T.validate_run(_run({0: bad}, events)))
    assert fields == ["digest", "nbytes", "offset", "ref"]
