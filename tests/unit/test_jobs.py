"""The job daemon's sans-IO logic (``prism.core.jobs``): what a job needs,
which queued jobs start, state moves, restart recovery, the wire messages;
and the shell's records on disk (``prism.shell.daemon``: atomic job.json,
recovery from a state directory)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import orjson
import pytest

from prism.core import jobs as J
from prism.shell import daemon as D

CAP = J.Capacity(4, (0, 1))


def job(seq: int, state: str = "queued", slots: int = 1, gpus: tuple[int, ...] = (), after=()) -> J.Job:
    return J.Job(id=str(seq), seq=seq, kind="capture", argv=("-n", str(slots)), cwd="/tmp", state=state,
                 slots=slots, gpus=gpus, after=tuple(after))


@pytest.mark.parametrize("kind,argv,need", [
    ("capture", ["-n", "8", "--slots", "2", "--", "t.py", "--slots", "9"], J.Need(2)),   # the script's own flags are not ours
    ("capture", ["--world-size=3", "--", "t.py"], J.Need(3)),
    ("capture", ["-n2", "--", "t.py"], J.Need(2)),
    ("capture", ["-n", "64", "--", "t.py"], J.Need(4)),          # no --slots: every core the daemon owns
    ("capture", ["-n", "2", "--gpus", "1,0", "--", "t.py"], J.Need(2, (0, 1))),
    ("emulate", ["run", "--sandbox", "0-1,5"], J.Need(3)),
    ("emulate", ["run", "--sandbox", "0", "--", "t.py"], J.Need(1)),
    ("calibrate", ["run", "--symmetric"], J.Need(4)),
    ("campaign", ["plan.toml"], J.Need(4)),
    ("predict", ["run", "--warmup", "1"], J.Need(1)),
    ("predict", ["run", "--slots", "2"], J.Need(2)),
])
def test_need_is_read_from_the_argv(kind, argv, need):
    assert J.need_of(kind, argv, CAP) == need


@pytest.mark.parametrize("kind,argv,words", [
    ("train", [], "unknown job command 'train'"),
    ("capture", ["-n", "2", "--slots", "8"], "owns 4 slots"),
    ("capture", ["-n", "2", "--gpus", "3"], "does not own GPU 3"),
    ("capture", ["-n", "x"], "-n 'x': expected an integer"),
    ("capture", ["--slots", "0"], "must be at least 1"),
    ("emulate", ["r", "--gpus", "a"], "GPU indices"),
])
def test_needs_the_daemon_cannot_meet_are_refused(kind, argv, words):
    with pytest.raises(J.JobError, match=words):
        J.need_of(kind, argv, CAP)


def test_run_dir_is_the_capture_out_or_the_run_argument():
    assert J.run_dir_of("capture", ["-n", "2", "--out", "runs/a", "--", "t.py", "--out", "x"], "/w") == "/w/runs/a"
    assert J.run_dir_of("capture", ["-o", "/abs/b"], "/w") == "/abs/b"
    assert J.run_dir_of("capture", ["-n", "2", "--", "t.py"], "/w") == ""
    assert J.run_dir_of("predict", ["--warmup", "1", "runs/a"], "/w") == "/w/runs/a"
    assert J.run_dir_of("emulate", ["runs/a", "--sandbox", "0", "--", "t.py"], "/w") == "/w/runs/a"


def test_jobs_start_in_order_while_they_fit():
    jobs = [job(1, slots=2), job(2, slots=2), job(3, slots=1)]
    assert [j.id for j in J.startable(jobs, CAP)] == ["1", "2"]
    # The first that does not fit stops the walk: job 3 (1 slot) does not overtake job 2 (3 slots).
    jobs = [job(1, "running", slots=2), job(2, slots=3), job(3, slots=1)]
    assert J.startable(jobs, CAP) == []
    jobs = [job(1, "done", slots=4), job(2, slots=3), job(3, slots=1)]
    assert [j.id for j in J.startable(jobs, CAP)] == ["2", "3"]


def test_a_gpu_is_held_by_one_job_at_a_time():
    jobs = [job(1, "running", gpus=(0,)), job(2, gpus=(0,)), job(3, gpus=(1,))]
    assert J.startable(jobs, CAP) == []
    jobs = [job(1, "running", gpus=(0,)), job(2, gpus=(1,))]
    assert [j.id for j in J.startable(jobs, CAP)] == ["2"]


def test_a_job_waits_for_its_dependencies_without_blocking_others():
    jobs = [job(1, "running", slots=2), job(2, after=["1"]), job(3)]
    assert [j.id for j in J.startable(jobs, CAP)] == ["3"]
    jobs[0] = J.transition(jobs[0], "done")
    assert [j.id for j in J.startable(jobs, CAP)] == ["2", "3"]
    jobs[0] = job(1, "failed")
    assert [(j.id, why) for j, why in J.blocked_by_failure(jobs)] == [("2", "job 1, which it waits for, ended failed")]
    assert J.blocked_by_failure([job(2, after=["9"])])[0][1] == "it waits for job 9, which the daemon does not know"


def test_state_moves():
    j = job(1)
    r = J.transition(j, "running", pid=7)
    assert (r.state, r.pid) == ("running", 7)
    assert J.transition(r, "done", exit_code=0).state == "done"
    assert J.transition(j, "cancelled").state == "cancelled"
    with pytest.raises(J.JobError, match="job 1 is queued; it cannot become done"):
        J.transition(j, "done")
    with pytest.raises(J.JobError, match="job 1 is done; it cannot become running"):
        J.transition(J.transition(r, "done"), "running")
    with pytest.raises(J.JobError, match="unknown job state 'lost'"):
        J.transition(j, "lost")


def test_recovery_interrupts_running_jobs_and_keeps_the_rest():
    jobs = [job(3, "running"), job(1, "done"), job(2, "queued"), job(4, "failed")]
    out = J.recover(jobs, now=100.0)
    assert [(j.id, j.state) for j in out] == [("1", "done"), ("2", "queued"), ("3", "interrupted"), ("4", "failed")]
    assert out[2].ended_at == 100.0 and "restart found it running" in out[2].message


def test_messages_round_trip_through_json():
    j = J.transition(job(1, gpus=(1,), after=["0"]), "running", pid=5, started_at=1.5)
    for msg in (J.Submit("capture", ("-n", "2"), "/w", "a", ("1",)), J.Submit("predict", ("r",), "/w", env=("A=1",)), J.Jobs(), J.Jobs("3"), J.Cancel("3"),
                J.Logs("3", 10), J.Resume("3"), J.Submitted(j), J.JobList((j, job(2)), 4, 1, (0,)),
                J.LogText("3", "x\n", "/s/log", True), J.Refused("no")):
        assert J.decode_message(orjson.loads(orjson.dumps(J.encode_message(msg)))) == msg


@pytest.mark.parametrize("data,words", [
    ([], "expected a JSON object"),
    ({"t": "Nope"}, "unknown daemon message type 'Nope'"),
    ({"t": "Cancel"}, "Cancel: field 'job_id' is missing"),
    ({"t": "Cancel", "job_id": 3}, "Cancel: field job_id = 3"),
    ({"t": "Submitted", "job": {"id": "1"}}, "Submitted.job: field 'seq' is missing"),
])
def test_bad_messages_are_named(data, words):
    with pytest.raises(J.JobError, match=words):
        J.decode_message(data)


def test_a_bad_state_in_a_record_is_refused():
    d = J.job_to_dict(job(1))
    d["state"] = "lost"
    with pytest.raises(J.JobError, match="state 'lost' is not one of"):
        J.job_from_dict(d, "x/job.json")


# --- the shell's records on disk ------------------------------------------------------


def test_records_are_written_whole_and_read_back(tmp_path):
    j = job(1)
    D.write_job(tmp_path, j)
    D.write_job(tmp_path, J.transition(j, "running", pid=3))
    assert [p.name for p in (tmp_path / "jobs" / "1").iterdir()] == ["job.json"]   # no temporary file left
    assert oct((tmp_path / "jobs" / "1" / "job.json").stat().st_mode & 0o777) == "0o600"
    (tmp_path / "jobs" / "2").mkdir()
    (tmp_path / "jobs" / "2" / "job.json").write_text("{not json")
    jobs, problems = D.read_jobs(tmp_path)
    assert [(x.id, x.state, x.pid) for x in jobs] == [("1", "running", 3)]
    assert len(problems) == 1 and "jobs/2/job.json" in problems[0] and "skipped" in problems[0]


def test_a_restarted_daemon_marks_running_jobs_interrupted_and_kills_their_leftovers(tmp_path):
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        D.write_job(tmp_path, J.transition(job(1), "running", pid=left.pid, pid_start=D.process_start(left.pid)))
        D.write_job(tmp_path, job(2))
        # A record whose pid now names another process is not killed.
        D.write_job(tmp_path, J.transition(job(3), "running", pid=os.getpid(), pid_start=1))
        D.write_job(tmp_path, J.transition(J.transition(job(4), "running"), "done", exit_code=0))
        notes: list[str] = []
        daemon = D.Daemon(D.ServiceConfig(tmp_path, "inproc://x", J.Capacity(2)), on_note=notes.append)
        daemon._recover()
        assert left.wait(timeout=10) == -9
        assert {i: j.state for i, j in daemon.jobs.items()} == {"1": "interrupted", "2": "queued",
                                                               "3": "interrupted", "4": "done"}
        assert daemon._seq == 4
        on_disk, _ = D.read_jobs(tmp_path)
        assert [j.state for j in on_disk] == ["interrupted", "queued", "interrupted", "done"]
        assert notes == [f"job 1: killed its process group {left.pid}, left by a daemon that died"]
    finally:
        left.kill()
        left.wait()


def test_the_daemon_queues_lists_cancels_and_refuses(tmp_path):
    daemon = D.Daemon(D.ServiceConfig(tmp_path, "inproc://x", J.Capacity(2)))
    sub = daemon.handle(J.Submit("capture", ("-n", "2", "--out", "r", "--", "t.py"), "/w", "a"))
    assert (sub.job.id, sub.job.state, sub.job.slots, sub.job.run_dir) == ("1", "queued", 2, "/w/r")
    assert D.read_jobs(tmp_path)[0] == [sub.job]            # on disk before it is reported
    listing = daemon.handle(J.Jobs())
    assert [j.id for j in listing.jobs] == ["1"] and (listing.slots, listing.slots_busy) == (2, 0)
    assert daemon.handle(J.Cancel("1")).jobs[0].state == "cancelled"
    for msg, words in [(J.Submit("capture", ("-n", "2", "--slots", "3"), "/w"), "owns 2 slots"),
                       (J.Submit("capture", ("-n", "2",), "rel"), "must be an absolute path"),
                       (J.Submit("predict", ("r",), "/w", after=("7",)), "no job '7'"),
                       (J.Jobs("9"), "no job '9' .*recent jobs: 1"),
                       (J.Cancel("1"), "job 1 is cancelled already")]:
        with pytest.raises(J.JobError, match=words):
            daemon.handle(msg)


def test_only_an_interrupted_or_cancelled_campaign_resumes_and_it_queues_last():
    camp = J.Job(id="2", seq=2, kind="campaign", argv=("plan.toml",), cwd="/w", state="interrupted", slots=1,
                 started_at=5.0, ended_at=9.0, exit_code=-15, pid=44, pid_start=7, message="the daemon stopped")
    back = J.resume(camp, seq=9)
    assert (back.id, back.state, back.seq, back.exit_code, back.pid, back.started_at) == ("2", "queued", 9, None, 0, 0)
    assert back.message == "resumed after it was interrupted"
    cancelled = dataclasses.replace(camp, state="cancelled")
    assert J.resume(cancelled, 10).message == "resumed after it was cancelled"
    with pytest.raises(J.JobError, match="job 1 is a capture, which does not resume"):
        J.resume(job(1, "interrupted"), 10)
    with pytest.raises(J.JobError, match="job 2 is done; only an interrupted or cancelled job can be resumed"):
        J.resume(dataclasses.replace(camp, state="done"), 10)


def test_the_daemon_resumes_a_campaign_behind_the_queue(tmp_path):
    daemon = D.Daemon(D.ServiceConfig(tmp_path, "inproc://x", J.Capacity(2)))
    camp = daemon.handle(J.Submit("campaign", ("plan.toml",), "/w")).job
    daemon.handle(J.Cancel(camp.id))
    later = daemon.handle(J.Submit("predict", ("r",), "/w")).job
    back = daemon.handle(J.Resume(camp.id)).jobs[0]
    assert back.state == "queued" and back.seq > later.seq      # behind the queue, its id kept
    assert [j.id for j in daemon.handle(J.Jobs()).jobs] == [later.id, camp.id]
    assert back in D.read_jobs(tmp_path)[0]                   # on disk


def test_wait_polls_until_every_job_has_ended(monkeypatch):
    from prism.app import daemon as app_daemon

    states = iter([("running", "queued"), ("done", "running"), ("done", "failed")])
    seen = []

    def fake_jobs(job_id="", **kw):
        a, b = next(states)
        return J.JobList((job(1, a), job(2, b)), 2, 0, ())

    monkeypatch.setattr(app_daemon, "jobs", fake_jobs)
    listing = app_daemon.wait(poll_s=0, on_poll=seen.append)
    assert [j.state for j in listing.jobs] == ["done", "failed"] and len(seen) == 3
    monkeypatch.setattr(app_daemon, "jobs", lambda job_id="", **kw: J.JobList((job(4, "running"),), 2, 1, ()))
    with pytest.raises(app_daemon.DaemonError, match=r"still active after 0 s: job 4 \(running\)"):
        app_daemon.wait(poll_s=0, limit_s=0)


def test_a_job_runs_with_its_own_environment_on_top_of_the_daemons(tmp_path):
    from prism.app import daemon as app_daemon

    daemon = D.Daemon(D.ServiceConfig(tmp_path, "inproc://x", J.Capacity(2)))
    sub = daemon.handle(J.Submit("predict", ("r",), "/w", env=("PRISM_DEVICE_REACH=issue", "X=a=b")))
    assert sub.job.env == ("PRISM_DEVICE_REACH=issue", "X=a=b")
    assert D.read_jobs(tmp_path)[0] == [sub.job]                       # kept in job.json
    env = J.job_env({"PATH": "/bin", "X": "old"}, sub.job)
    assert env == {"PATH": "/bin", "X": "a=b", "PRISM_DEVICE_REACH": "issue"}
    with pytest.raises(J.JobError, match="'1X=2' is not NAME=VALUE"):
        daemon.handle(J.Submit("predict", ("r",), "/w", env=("1X=2",)))
    assert app_daemon.prism_env({"PRISM_A": "1", "PRISM_DAEMON": "/s", "HOME": "/h"}) == ("PRISM_A=1",)
    old = J.job_to_dict(sub.job)
    del old["env"]                                                   # a record from before env existed
    assert J.job_from_dict(old).env == ()
