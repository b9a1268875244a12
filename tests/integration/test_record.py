"""``prism capture --record``: recorded payloads (PrismTrace 1.3) on real captures.

The bundled GPT at world 8 (tp2 pp2 dp2) is captured twice with ranks 0, 4
and 5 recorded (the first capture is test_emulate's, tests/support/captures.py). What must hold: every tensor those ranks received (each collective
output, each receive) is stored, with a digest of every tensor they sent;
the stored bytes match their digests and, where the trace's small-tensor
store kept the same tensor (the rank's own record, made in the rank), equal
it; and each digest equals the one of the second, identical capture.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prism.core import payloads as PL
from prism.core import trace as T
from prism.shell import runfolder
from tests.support.captures import GPT_W8_SMALL, RECORD_045

ROOT = Path(__file__).resolve().parents[2]
GPT = ["-m", "prism.workloads.gpt", "--tp", "2", "--pp", "2", "--dp", "2", "--steps", "2"]
RECORDED = (0, 4, 5)


def capture(tmp: Path, name: str, world: int, command: list[str], *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp / name
    proc = subprocess.run(
        [sys.executable, "-m", "prism", "capture", "-n", str(world), "--out", str(run_dir), "--progress", "off",
         "--show-ranks", "none", *extra, "--", *command],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=tmp,
    )
    return proc, run_dir


@pytest.fixture(scope="module")
def two_captures(tmp_path_factory, shared_captures):
    tmp = tmp_path_factory.mktemp("record")
    runs = []
    # The session's capture (test_emulate's), then the same command and flags again.
    for proc, run_dir in (shared_captures.get(8, GPT_W8_SMALL, *RECORD_045),
                          capture(tmp, "b", 8, GPT_W8_SMALL, *RECORD_045)):
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "payload records" in proc.stderr, proc.stderr[-2000:]
        runs.append(runfolder.read_run(run_dir))
    return runs


@pytest.mark.slow
def test_every_received_tensor_is_recorded_with_sent_digests(two_captures):
    run = two_captures[0]
    assert T.validate_run(run) == [] and run.warnings == []
    assert sorted(run.payloads) == list(RECORDED)
    assert dict(run.manifest.notes)["record_ranks"] == "0,4-5"  # as a range
    for rank in RECORDED:
        book = PL.index(run.payloads[rank])
        expected_recv, expected_sent = set(), set()
        me = {ev.gid: ev.ranks.index(rank) for ev in run.ranks[rank] if type(ev) is T.GroupCreated}
        for ev in run.ranks[rank]:
            if type(ev) is T.Collective and ev.op != "barrier":
                n = len(ev.out_shapes)
                expected_recv |= {PL.coll_ref(ev.gid, ev.seq, "out", i, n) for i in range(n)}
                # Every member declares a broadcast's tensor; only the root sends it.
                if ev.op != "broadcast" or me[ev.gid] == ev.root:
                    k = len(ev.in_shapes)
                    expected_sent |= {PL.coll_ref(ev.gid, ev.seq, "in", i, k) for i in range(k)}
            elif type(ev) is T.P2P and ev.op == "recv":
                expected_recv.add(PL.p2p_ref(ev.peer, rank, ev.tag, ev.pseq))
            elif type(ev) is T.P2P:
                expected_sent.add(PL.p2p_ref(rank, ev.peer, ev.tag, ev.pseq))
        recv = {ref for role, ref in book if role == "recv"}
        sent = {ref for role, ref in book if role == "sent"}
        assert expected_recv and recv == expected_recv, (rank, expected_recv ^ recv)
        assert expected_sent <= sent, (rank, expected_sent - sent)
        # The shapes are the trace's.
        shapes = {PL.coll_ref(ev.gid, ev.seq, "out", i, len(ev.out_shapes)): s
                  for ev in run.ranks[rank] if type(ev) is T.Collective for i, s in enumerate(ev.out_shapes)}
        for (role, ref), p in book.items():
            if role == "recv" and ref in shapes:
                assert tuple(p.shape) == tuple(shapes[ref]), (rank, ref)


@pytest.mark.slow
def test_stored_bytes_match_digests_and_the_ranks_own_values(two_captures):
    run = two_captures[0]
    compared = 0
    for rank in RECORDED:
        values = {ev.ref: ev.data for ev in run.ranks[rank] if type(ev) is T.TensorValue}
        for p in run.payloads[rank]:
            if p.role != "recv":
                continue
            data = runfolder.load_payload(run.path, p)
            assert PL.digest(data) == p.digest
            if p.ref in values:  # the small-tensor store: what the rank itself held after the call
                assert data == values[p.ref], (rank, p.ref)
                compared += 1
    assert compared >= 4  # the loss and grad-norm scalars at least


@pytest.mark.slow
def test_digests_equal_across_two_identical_captures(two_captures):
    a, b = two_captures
    for rank in RECORDED:
        da = {(p.role, p.ref): p.digest for p in a.payloads[rank]}
        db = {(p.role, p.ref): p.digest for p in b.payloads[rank]}
        assert da == db
        assert PL.first_divergence(rank, a.payloads[rank], db) is None


@pytest.mark.slow
def test_record_steps_and_the_size_cap(tmp_path):
    # Step 1 only, all ranks, a cap the first step of recording passes: a
    # warning names where it stopped; the capture itself succeeds.
    proc, run_dir = capture(tmp_path, "cap", 8, GPT, "--record", "all", "--record-steps", "1",
                            "--record-limit", str(200_000 / 2**30))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--record stopped at rank" in proc.stderr and "Raise --record-limit" in proc.stderr, proc.stderr[-2000:]
    summary = runfolder.read_payload_summary(run_dir)
    assert summary["stopped"] and summary["bytes"] <= 200_000 and summary["steps"] == "1"
    run = runfolder.read_run(run_dir)
    assert T.validate_run(run) == [] and run.warnings == []
    assert all(p.step == 1 for records in run.payloads.values() for p in records)
    assert sum(p.nbytes for records in run.payloads.values() for p in records if p.role == "recv") == summary["bytes"]


@pytest.mark.slow
def test_damaged_payloads_are_reported(two_captures, tmp_path):
    import shutil

    src = Path(two_captures[0].path)
    run_dir = tmp_path / "damaged"
    assert not list(src.glob("*.sock"))  # the coordinator removes its ipc socket file
    shutil.copytree(src, run_dir)
    data = run_dir / runfolder.payload_data_name(5)
    blob = bytearray(data.read_bytes())
    first = next(p for p in runfolder.read_payloads(run_dir)[0][5] if p.role == "recv")
    blob[first.offset] ^= 0xFF
    data.write_bytes(bytes(blob[: len(blob) // 2]))
    with pytest.raises(T.TraceFormatError, match="do not match their digest"):
        runfolder.load_payload(run_dir, first)
    payloads, warnings = runfolder.read_payloads(run_dir)
    assert warnings and "truncated" in warnings[0].message and str(data) in warnings[0].message
    assert 0 < len([p for p in payloads[5] if p.role == "recv"]) < 40


@pytest.mark.parametrize("extra, message", [
    (("--record", "9"), "--record: ranks '9': '9' is outside the world of 8 ranks"),
    (("--record", "0", "--record-steps", "x"), "--record-steps: steps 'x'"),
    (("--record-steps", "1"), "give --record RANKS too"),
    (("--record", "0", "--record-limit", "0"), "--record-limit must be more than 0"),
])
def test_bad_record_flags_are_usage_errors(tmp_path, extra, message):
    proc, _ = capture(tmp_path, "bad", 8, GPT, *extra)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
