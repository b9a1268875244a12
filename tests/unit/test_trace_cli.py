"""``python -m prism trace summary|validate`` on runs written with the writer."""

from __future__ import annotations

import dataclasses

from tests.unit.test_trace import FIRST_COLL, MANIFEST, W, rank_events, write_sample_run

from prism import cli
from prism.core import trace as T
from prism.shell import runfolder
from prism.app.trace import compact_ranks


def test_summary_counts_every_rank_and_group(tmp_path, capsys):
    run_dir = write_sample_run(tmp_path / "run")
    assert cli.main(["trace", "summary", str(run_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"run {run_dir}: r1, world_size 4, PrismTrace 1.{T.TRACE_VERSION_MINOR}, cpu, command: train.py --steps 2")
    header = out[1].split()
    assert header == ["rank", "events", "compute", "collectives", "p2p", "steps", "last_step", "end"]
    rows = {int(line.split()[0]): line.split() for line in out[2 : 2 + W]}
    for r in range(W):
        evs = rank_events(r)
        # 2 steps x (all_reduce, all_to_all_single, broadcast); one p2p per step.
        assert rows[r] == [str(r), str(len(evs)), "2", "6", "2", "2", "1", "ok"]
    groups = {line.split()[0]: line for line in out[2 + W :] if line.startswith(("world", "g"))}
    tp0, dp0 = T.group_id(1, [0, 1]), T.group_id(3, [0, 2])
    assert groups[tp0].split() == [tp0, "1", "2", "0-1", "2", "all_reduce=2"]
    assert groups[dp0].split() == [dp0, "3", "2", "0,2", "4", "all_to_all_single=2", "broadcast=2"]
    assert groups["world"].split() == ["world", "0", "4", "0-3", "0", "-"]


def test_summary_lists_warnings_of_a_crashed_rank(tmp_path, capsys):
    run_dir = write_sample_run(tmp_path / "run")
    path = runfolder.rank_path(run_dir, 2)
    path.write_bytes(path.read_bytes()[:-7])
    assert cli.main(["trace", "summary", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "1 warning(s):" in out
    assert f"{path}:{len(rank_events(2))}: torn last line" in out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["2"])
    assert row.split()[-1] == "(none)"


def test_validate_valid_run_exits_0(tmp_path, capsys):
    run_dir = write_sample_run(tmp_path / "run")
    assert cli.main(["trace", "validate", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == f"0 problem(s), 0 warning(s) in {run_dir}"


def test_validate_reports_problems_and_exits_1(tmp_path, capsys):
    run_dir = write_sample_run(tmp_path / "run")
    evs = rank_events(1)
    evs[FIRST_COLL] = dataclasses.replace(evs[FIRST_COLL], op="allreduce")
    path = runfolder.rank_path(run_dir, 1)
    path.write_bytes(b"".join(T.encode_event(ev) + b"\n" for ev in evs[:-1]))
    assert cli.main(["trace", "validate", str(run_dir)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{path}:{FIRST_COLL + 1} rank 1 op: allreduce on g1-")
    assert "unknown collective op 'allreduce'" in out[0]
    assert out[1] == f"{path}:{len(evs)} warning: file ends without rank_end: the rank crashed, was killed, or is still running"
    assert out[2] == f"1 problem(s), 1 warning(s) in {run_dir}"


def test_warnings_alone_do_not_fail_validation(tmp_path, capsys):
    run_dir = write_sample_run(tmp_path / "run")
    path = runfolder.rank_path(run_dir, 0)
    path.write_bytes(path.read_bytes()[:-3])
    assert cli.main(["trace", "validate", str(run_dir)]) == 0
    assert "0 problem(s), 1 warning(s)" in capsys.readouterr().out


def test_unreadable_run_exits_2_and_says_why(tmp_path, capsys):
    for sub in ("summary", "validate"):
        assert cli.main(["trace", sub, str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"prism trace: cannot read run {tmp_path}:" in err
        assert "not a Prism run directory" in err


def test_compact_ranks():
    assert compact_ranks([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert compact_ranks([5]) == "5"
    assert compact_ranks([]) == ""


def test_summary_shows_the_two_clocks_of_gpu_ranks(tmp_path, capsys):
    plain = write_sample_run(tmp_path / "plain")
    assert cli.main(["trace", "summary", str(plain)]) == 0
    assert "GPU timing" not in capsys.readouterr().out  # CPU ranks: one clock, no section

    def gpu(ev):  # step 1 is a calibration step on rank 0
        if type(ev) is not T.Compute:
            return ev
        calibrated = ev.step == 1
        return dataclasses.replace(ev, cpu_ns=(ev.end_ns - ev.start_ns) // 2,
                                   gpu_ns=3_000_000 if calibrated else -1, join=True, cold_ns=120_000,
                                   free_ns=-1 if calibrated else ev.end_ns - ev.start_ns)

    events = {r: [gpu(ev) for ev in rank_events(r)] if r == 0 else rank_events(r) for r in range(W)}
    run_dir = runfolder.write_run(tmp_path / "gpu", MANIFEST, events)
    assert cli.main(["trace", "summary", str(run_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    i = next(k for k, line in enumerate(out) if line.startswith("GPU timing"))
    assert out[i + 1].split()[:4] == ["rank", "wall", "cpu", "free"]
    row = out[i + 2].split()
    assert row[0] == "0" and row[1] == "-" and row[3] == "-" and row[4] == "3.00" and row[6] == "1"
    assert row[7] == "120" and row[8] == "1"
    assert len(out) == i + 3  # only the GPU rank
