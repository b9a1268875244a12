"""``prism emulate``: sandbox ranks run for real against the captured run's virtual ranks (CPU).

The bundled GPT (tp2 pp2 dp2, world 8) is captured once with ranks 0, 4 and
5 recorded (rank 4 prints the losses; the capture test_record and
test_hybrid_capture read too, tests/support/captures.py). What must hold: only the sandbox
ranks are launched, with their full-world environment; with the recording
each sandbox's losses equal the capture's, printed digit for digit; without
it the run completes with compensated values and says how far its losses
moved; a changed model width stops the emulation within seconds naming
rank, op, group and sequence; a crashing sandbox ends it with its
traceback; no rank process is left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prism.shell import runfolder
from tests.support.captures import GPT_W8_SMALL, RECORD_045
from tests.support.full import FULL

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GPT = GPT_W8_SMALL
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
SCRIPTS = ROOT / "tests" / "support" / "scripts"


def prism(*args: str, cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prism", *args], capture_output=True, text=True, timeout=timeout,
                          env=env or ENV, cwd=cwd)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, shared_captures) -> Path:
    # A copy of the session's capture: the emulations write into RUN/emulation/.
    return shared_captures.copy(tmp_path_factory.mktemp("emulate") / "gpt", 8, GPT, *RECORD_045)


def summary(out: str) -> dict:
    return json.loads(out)


def forkservers(cwd: Path) -> set[int]:
    """Fork servers running in ``cwd`` (an emulation's launch directory): the
    ones of other emulations on the machine (other tests, other users) are not
    this test's to count."""
    out = subprocess.run(["pgrep", "-f", "prism.rank.forkserver"], capture_output=True, text=True).stdout
    mine = set()
    for pid in (int(p) for p in out.split()):
        try:
            if Path(os.readlink(f"/proc/{pid}/cwd")) == Path(cwd).resolve():
                mine.add(pid)
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return mine


def test_recorded_sandboxes_reproduce_the_capture(gpt_run):
    before = forkservers(gpt_run.parent)
    proc = prism("emulate", str(gpt_run), "--sandbox", "0,4,5", "--name", "rec", "--progress", "off", "--json",
                 cwd=gpt_run.parent)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    s = summary(proc.stdout)
    assert s["status"] == "ok" and s["sandbox"] == [0, 4, 5]
    out = gpt_run / "emulation" / "rec"
    # only the sandbox ranks ran: their logs and traces, nobody else's
    assert sorted(p.name for p in (out / runfolder.LOGS_DIR).iterdir()) == [
        "rank-000000.log", "rank-000004.log", "rank-000005.log"]
    r4 = s["ranks"]["4"]
    assert r4["losses"] and len(r4["losses"]) == 3
    assert r4["losses"] == r4["capture_losses"] and r4["losses_equal"] is True
    assert s["calls"]["compensated"] == 0 and s["calls"]["recorded"] > 0
    assert all(not s["ranks"][r]["divergence"] for r in ("0", "4", "5"))
    # group reduction: the sandboxes created their groups only
    assert 0 < s["groups"]["instantiated"] <= s["groups"]["with_sandbox"] < s["groups"]["in_graph"]
    assert s["emulated_mean_ns"] > 0 and s["predicted_mean_ns"] > 0
    for r in ("0", "4", "5"):
        assert len(s["ranks"][r]["iteration_ns"]) == 3
    timeline = json.loads((out / "timeline.json").read_text())
    names = {e["args"]["name"] for e in timeline["traceEvents"] if e.get("name") == "process_name"}
    assert {"rank 0", "rank 1", "rank 4", "rank 7"} <= names
    assert forkservers(gpt_run.parent) <= before


def test_without_recording_compensates_and_says_how_far_losses_moved(gpt_run):
    proc = prism("emulate", str(gpt_run), "--sandbox", "4", "--no-recording", "--name", "comp", "--progress", "off",
                 cwd=gpt_run.parent)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    s = json.loads((gpt_run / "emulation" / "comp" / "summary.json").read_text())
    assert s["calls"]["compensated"] > 0 and s["calls"]["recorded"] == 0
    r4 = s["ranks"]["4"]
    assert len(r4["losses"]) == 3 and r4["max_loss_rel_diff"] is not None
    assert "losses" in proc.stdout and "compensated" in proc.stdout


def test_the_device_path_delivers_the_recording_from_the_prefetch_pool(gpt_run):
    # PRISM_GPU_SANDBOX=cpu-test runs the GPU sandbox's path (on_device calls,
    # outputs formed by the rank behind the release) on CPU tensors. With the
    # recording, the rank delivers the capture's recorded outputs itself from
    # its prefetch pool (protocol 7's recorded calls): its losses are the
    # capture's, digit for digit, with no payload through the coordinator.
    calls = gpt_run.parent / "devrec-calls-{rank}.jsonl"
    env = dict(ENV, PRISM_GPU_SANDBOX="cpu-test", PRISM_DEVICE_CALL_LOG=str(calls), PRISM_EARLY_RELEASE="1")
    dev = prism("emulate", str(gpt_run), "--sandbox", "4", "--name", "devrec", "--progress", "off", "--json",
                "--prefetch-pool", "1", cwd=gpt_run.parent, env=env)
    assert dev.returncode == 0, dev.stderr[-3000:]
    d = summary(dev.stdout)
    c = d["calls"]
    assert c["on_device"] > 0 and c["compensated"] == 0 and c["recorded"] >= c["on_device"]
    # the pipeline's sends and receives with virtual stages too (protocol 6)
    assert c["sends_on_device"] > 0
    # every device-path call's arrival came as a reach (protocol 5's Reached), sends' too (protocol 8),
    # none left waiting
    assert c["reached_on_gpu"] == c["on_device"] + c["sends_on_device"]
    # early releases need each arrival at its issue: none came with its reach (protocol 12's way)
    assert c["arrived_with_reach"] == 0
    assert d["pacing"]["reach_lag_p50_ns"] is not None
    # a collective whose other members had all arrived went out before its reach, at the time the
    # engine gave it once the reach came (early releases; how many depends on the message order)
    assert c["early_release_off"] == 0 and 0 <= c["released_before_reach"] <= c["on_device"]
    r4 = d["ranks"]["4"]
    assert r4["losses"] and r4["losses_equal"] is True, (r4["losses"], r4["capture_losses"])
    log = (gpt_run / "emulation" / "devrec" / runfolder.LOGS_DIR / "rank-000004.log").read_text()
    assert "prism: prefetch pool: 1 MiB" in log and "recorded outputs delivered" in log, log[-2000:]
    # the diagnostic call log (PRISM_DEVICE_CALL_LOG): one line per device-path call, host and "GPU" moments
    recs = [json.loads(line) for line in (gpt_run.parent / "devrec-calls-4.jsonl").read_text().splitlines()]
    colls = [r for r in recs if r["op"] not in ("recv", "send")]
    assert colls and all(r["t0"] <= r["t_sent"] <= r["t1"] and r["reach"] for r in colls), colls[:3]
    # on CPU nothing waits for the release, so the rank may end before any comes (a loaded machine)
    assert all(isinstance(r["due"], int) and r["due"] > 0 for r in colls if "due" in r), colls[:3]
    # the result's arrival: the flag flipped as it came, the completion thread after (the log's writer
    # waits a bounded moment for the last stamps: on a loaded machine the rank may end before one comes)
    flipped = [r for r in colls if "t_flip" in r]
    assert flipped and all(r["t0"] <= r["t_flip"] for r in flipped), colls[:3]
    assert any("t_res" in r for r in flipped) and all(r["t_flip"] <= r["t_res"] for r in flipped if "t_res" in r)
    assert all(r["busy0"] is None and r["recorded"] for r in colls)  # CPU tensors: no stream to ask
    # a recorded delivery's own steps, in order, inside the outputs' queueing
    fed = [r for r in colls if "f_copy" in r]
    assert fed and all(r["t_wait"] <= r["f_lock"] <= r["f_adv0"] <= r["f_copy"] <= r["f_adv1"] <= r["t_out"]
                       and r["f_staged"] >= 0 for r in fed), fed[:3]
    assert any(r["op"] == "send" and r["reach"] for r in recs)  # a device-path send's reach (protocol 8)
    # the thread's CPU time at each moment and its context switches (where a call's host time went)
    assert all(r["c_rec"] <= r["c_msg"] <= r["c_sent"] <= r["c_out"] <= r["c_ret"] and r["t1"] <= r["t_ret"] and r["v1"] >= r["v_rec"]
               and r["i1"] >= r["i_rec"] for r in colls), colls[:3]
    assert all(r["cf_lock"] <= r["cf_copy"] <= r["c_out"] for r in fed), fed[:3]
    assert all(r["t0"] <= r["t_on"] <= r["t_feed"] <= r["t_op"] <= r["t_rec"] for r in colls), colls[:3]
    threads = json.loads((gpt_run.parent / "devrec-calls-4.jsonl.threads.json").read_text())
    assert any(t["name"] == "MainThread" and t["cpu_ns"] > 0 for t in threads), threads
    assert any(t["name"].startswith("prism-io") for t in threads), threads
    # the coordinator's side of each release's round trip, as rank "coord" beside the ranks' logs
    coord = [json.loads(line) for line in (gpt_run.parent / "devrec-calls-coord.jsonl").read_text().splitlines()]
    keys = {(r["gid"], r["seq"]) for r in colls}
    assert coord and {(c["gid"], c["seq"]) for c in coord if c["rank"] == 4} <= keys, (coord[:3], colls[:3])
    assert all(c["c_in"] is None or c["c_in"] <= c["c_out"] for c in coord), coord[:3]
    # without early releases and with PRISM_DEVICE_ARRIVE_AT_REACH=1 each call's arrival leaves at its
    # reach, with it (protocol 12: one message, from the reach watcher; in CPU test mode the "stream"
    # reaches a call as it is issued), and the run is the same
    env12 = {k: v for k, v in env.items() if k not in ("PRISM_EARLY_RELEASE", "PRISM_DEVICE_CALL_LOG")}
    env12["PRISM_DEVICE_ARRIVE_AT_REACH"] = "1"
    at_reach = prism("emulate", str(gpt_run), "--sandbox", "4", "--name", "devrec12", "--progress", "off", "--json",
                     "--prefetch-pool", "1", cwd=gpt_run.parent, env=env12)
    assert at_reach.returncode == 0, at_reach.stderr[-3000:]
    d12 = summary(at_reach.stdout)
    c12 = d12["calls"]
    assert c12["on_device"] == c["on_device"] and len(colls) > 0, c12
    # every device-path call's: the collectives', the receives' (on_device) and the sends'
    assert c12["arrived_with_reach"] == c12["on_device"] + c12["sends_on_device"] == len(recs), c12
    assert c12["reached_on_gpu"] == c12["on_device"] + c12["sends_on_device"] and c12["released_before_reach"] == 0
    assert d12["ranks"]["4"]["losses_equal"] is True


# A variant of test_the_device_path_delivers_the_recording_from_the_prefetch_pool
# (the in-place compensation rules: tests/unit/test_devicepath.py).
@FULL
def test_the_device_path_protocol_compensates_as_the_coordinator_does(gpt_run):
    # PRISM_GPU_SANDBOX=cpu-test runs the GPU sandbox's path (on_device calls,
    # outputs formed in place by the rank) on CPU tensors: the losses equal the
    # host path's compensated ones, digit for digit.
    env = dict(ENV, PRISM_GPU_SANDBOX="cpu-test")
    dev = prism("emulate", str(gpt_run), "--sandbox", "4", "--no-recording", "--name", "dev", "--progress", "off",
                "--json", cwd=gpt_run.parent, env=env)
    assert dev.returncode == 0, dev.stderr[-3000:]
    d = summary(dev.stdout)
    host = json.loads((gpt_run / "emulation" / "comp" / "summary.json").read_text())
    assert d["calls"]["on_device"] > 0 and host["calls"]["on_device"] == 0
    # the pipeline's sends and receives with virtual stages too (protocol 6)
    assert d["calls"]["sends_on_device"] > 0 and host["calls"]["sends_on_device"] == 0
    # every device-path call's arrival came as a reach (protocol 5's Reached), sends' too (protocol 8)
    assert d["calls"]["reached_on_gpu"] == d["calls"]["on_device"] + d["calls"]["sends_on_device"]
    assert d["pacing"]["reach_lag_p50_ns"] is not None and host["pacing"]["reach_lag_p50_ns"] is None
    assert d["ranks"]["4"]["losses"] == host["ranks"]["4"]["losses"]


def test_a_changed_width_stops_within_seconds_naming_rank_op_group_and_sequence(gpt_run):
    changed = [*GPT]
    changed[changed.index("--hidden") + 1] = "48"
    t0 = time.monotonic()
    before = forkservers(gpt_run.parent)
    proc = prism("emulate", str(gpt_run), "--sandbox", "0", "--name", "wide", "--progress", "off", "--", *changed,
                 cwd=gpt_run.parent, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert took < 30, took
    text = proc.stdout + proc.stderr
    assert "mismatch" in text and "sandbox rank 0 called" in text, text[-3000:]
    assert "on group" in text and "at sequence" in text and "bytes" in text
    assert forkservers(gpt_run.parent) <= before


@pytest.fixture(scope="module")
def chained(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, list[str]]:
    """``prism run`` of a world-4 script no rank fails in, rank 1 the sandbox: its process, its
    run folder (also the crash test's capture) and the emulations in it when it ended."""
    tmp = tmp_path_factory.mktemp("run")
    run = tmp / "r"
    proc = prism("run", "-n", "4", "--sandbox", "1", "--out", str(run), "--progress", "off", "--",
                 str(SCRIPTS / "fail_at_step.py"), "99", "0", "4", cwd=tmp)
    emulations = sorted(p.name for p in (run / "emulation").iterdir()) if (run / "emulation").is_dir() else []
    return proc, run, emulations


def test_a_crashing_sandbox_ends_it_with_its_traceback(chained, tmp_path):
    # On the chained run's capture, without its recording (compensated values, as on a plain capture).
    cap, run, _ = chained
    assert cap.returncode == 0, cap.stderr[-2000:]
    before = forkservers(tmp_path)
    proc = prism("emulate", str(run), "--sandbox", "1", "--no-recording", "--name", "crash", "--progress", "off",
                 "--", str(SCRIPTS / "fail_at_step.py"), "1", "2", "4", cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "sandbox rank 1 failed" in text and "RuntimeError: rank 1 fails at step 2" in text, text[-3000:]
    assert forkservers(tmp_path) <= before


def test_bad_options_are_named(gpt_run, tmp_path):
    proc = prism("emulate", str(tmp_path), "--sandbox", "0", cwd=tmp_path)
    assert proc.returncode == 2 and "not a captured run" in proc.stderr
    proc = prism("emulate", str(gpt_run), "--sandbox", "9", cwd=tmp_path)
    assert proc.returncode == 2 and "--sandbox" in proc.stderr and "9" in proc.stderr


def test_run_chains_capture_predict_and_emulate_into_one_report(chained):
    proc, run, emulations = chained
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "-- prediction --" in out and "predicted iteration time" in out
    assert "-- emulation --" in out and "sandbox rank 1" in out and "losses equal to the capture's" in out
    assert (run / "payloads").is_dir()  # the sandbox was recorded
    assert len(emulations) == 1


def test_ddp_async_buckets_pass_their_waits_and_reproduce_the_losses(tmp_path):
    # DDP's reducer all-reduces buckets asynchronously and waits in C++: the
    # emulation passes the graph's wait nodes from the sandbox's next calls.
    run = tmp_path / "ddp"
    proc = prism("capture", "-n", "4", "--record", "0", "--out", str(run), "--progress", "off", "--show-ranks",
                 "none", "--", "-m", "prism.workloads.ddp_example", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = prism("emulate", str(run), "--sandbox", "0", "--name", "d", "--progress", "off", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    s = summary(proc.stdout)
    r0 = s["ranks"]["0"]
    assert r0["losses"] and r0["losses_equal"] is True
    assert s["calls"]["compensated"] == 0 and s["calls"]["implicit_waits"] > 0


# A variant of test_the_device_path_protocol_compensates_as_the_coordinator_does
# (uneven splits are covered by tests/unit/test_devicepath.py).
@FULL
def test_the_device_path_forms_moe_token_exchanges_as_the_coordinator_does(tmp_path):
    # MoE with expert parallelism: the token all_to_alls have uneven splits,
    # formed in place by the device path (PRISM_GPU_SANDBOX=cpu-test) with the
    # coordinator's compensation rule: the losses equal the host path's.
    run = tmp_path / "moe"
    cap = prism("capture", "-n", "2", "--out", str(run), "--progress", "off", "--", "-m", "prism.workloads.gpt",
                "--tp", "1", "--pp", "1", "--dp", "2", "--ep", "2", "--experts", "4", "--layers", "2", "--hidden",
                "32", "--heads", "2", "--seq-len", "16", "--steps", "3", cwd=tmp_path)
    assert cap.returncode == 0, cap.stderr[-3000:]
    got = {}
    for name, mode in (("host", "0"), ("dev", "cpu-test")):
        p = prism("emulate", str(run), "--sandbox", "0", "--no-recording", "--name", name, "--progress", "off",
                  "--json", cwd=tmp_path, env=dict(ENV, PRISM_GPU_SANDBOX=mode))
        assert p.returncode == 0, p.stderr[-3000:]
        got[name] = summary(p.stdout)
    dev, host = got["dev"], got["host"]
    assert dev["calls"]["on_device"] == dev["calls"]["compensated"] > 0 and host["calls"]["on_device"] == 0
    assert dev["ranks"]["0"]["losses"] == host["ranks"]["0"]["losses"] and len(host["ranks"]["0"]["losses"]) == 3


def test_a_device_path_batch_with_its_receive_first_reports_every_sends_reach(tmp_path):
    # batch_isend_irecv([irecv, isend]) on the device path (cpu-test): each
    # send's arrival is its stream's reach (protocol 8), none left waiting.
    # On a GPU the irecv waits on the side stream (NCCL's own, where a batch
    # runs as one), so the send's reach does not queue behind the receive.
    run = tmp_path / "r"
    cap = prism("capture", "-n", "2", "--out", str(run), "--progress", "off", "--",
                str(SCRIPTS / "batch_p2p.py"), "3", cwd=tmp_path, timeout=120)
    assert cap.returncode == 0, cap.stderr[-3000:]
    calls = tmp_path / "calls-{rank}.jsonl"
    env = dict(ENV, PRISM_GPU_SANDBOX="cpu-test", PRISM_DEVICE_CALL_LOG=str(calls))
    dev = prism("emulate", str(run), "--sandbox", "0", "--name", "batch", "--progress", "off", "--json",
                cwd=tmp_path, env=env, timeout=120)
    assert dev.returncode == 0, dev.stderr[-3000:]
    d = summary(dev.stdout)
    c = d["calls"]
    assert c["sends_on_device"] == 3 and c["reached_on_gpu"] == c["on_device"] + c["sends_on_device"], c
    assert len(d["ranks"]["0"]["losses"]) == 3  # compensated (no recording): the run completes
    recs = [json.loads(line) for line in (tmp_path / "calls-0.jsonl").read_text().splitlines()]
    assert sum(r["op"] == "send" and r["reach"] > 0 for r in recs) == 3, recs
