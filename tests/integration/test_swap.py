"""The swap executor (prism/shell/swap.py) and swapping in a real capture on CPU
with a stand-in driver. The CUDA driver blocks only a checkpointed process's
CUDA calls and its host threads run on; on CPU there are no CUDA calls to
block, so the stand-in checks the coordinator's side instead: no rank is
checkpointed while it computes, none is granted while checkpointed, and
every rank's data survives (the losses)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prism.shell import runfolder, swap
from prism.app.capture import capture_run
from prism.shell.gpu_plan import plan_gpus
from prism.workloads.harness import parse_losses
from tests.support.full import FULL

ROOT = Path(__file__).resolve().parents[2]


class FakeDriver:
    """Tracks each pid's checkpoint state; records the calls."""

    def __init__(self, fail_on: str = ""):
        self.states: dict[int, str] = {}
        self.calls: list[tuple[str, int]] = []
        self.fail_on = fail_on

    def _call(self, name, pid):
        self.calls.append((name, pid))
        if name == self.fail_on:
            raise swap.SwapError(f"cuCheckpointProcess{name.title()}(pid {pid}) failed: CUDA_ERROR_ILLEGAL_STATE (401)")

    def state(self, pid):
        return self.states.get(pid, "running")

    def lock(self, pid):
        self._call("lock", pid)
        self.states[pid] = "locked"

    def checkpoint(self, pid):
        self._call("checkpoint", pid)
        self.states[pid] = "checkpointed"

    def restore(self, pid):
        self._call("restore", pid)
        self.states[pid] = "locked"

    def unlock(self, pid):
        self._call("unlock", pid)
        self.states[pid] = "running"


class CheckingDriver(FakeDriver):
    """Also checks, at each call, what the coordinator's scheduler says."""

    def __init__(self):
        super().__init__()
        self.coord = None
        self.violations: list[str] = []
        self.granted_while_out: list[int] = []

    def _rank(self, pid):
        return next(r for r, session in self.coord.sessions.items() if session.pid == pid)

    def lock(self, pid):
        from prism.core.scheduler import RankState

        rank = self._rank(pid)
        if self.coord.scheduler.state(rank) == RankState.RUNNING:
            self.violations.append(f"rank {rank} checkpointed while running")
        super().lock(pid)

    def attach(self, coord):
        self.coord = coord
        send = coord._send

        async def checked_send(rank, msg):
            from prism.core import protocol as P

            if isinstance(msg, P.SlotGrant) and self.state(coord.sessions[rank].pid) != "running":
                self.violations.append(f"rank {rank} granted while checkpointed")
            return await send(rank, msg)

        coord._send = checked_send


def test_executor_runs_the_driver_calls_in_order_and_summarizes():
    drv = FakeDriver()
    clock = iter(range(100)).__next__
    ex = swap.SwapExecutor(drv, memory_of=lambda pid: 2 * 10**9, clock=clock)
    out = ex.swap_out(3, 1003, step=0)
    back = ex.swap_in(3, 1003, step=1)
    assert drv.calls == [("lock", 1003), ("checkpoint", 1003), ("restore", 1003), ("unlock", 1003)]
    assert (out.direction, out.status, out.bytes, out.seconds) == ("out", "ok", 2 * 10**9, 1)
    assert (back.direction, back.status, back.bytes) == ("in", "ok", 2 * 10**9)
    # A process without CUDA state (never checkpointed) is skipped.
    assert ex.swap_in(4, 1004).status == "skipped"
    s = swap.summarize(ex.records, steps=2)
    assert (s["swaps"], s["skipped"], s["swaps_out"], s["swaps_in"]) == (2, 1, 1, 1)
    assert s["gb_per_s_out"] == 2.0 and s["swaps_per_step"] == {"1": 1, "2": 1}
    assert s["swaps_per_iteration"] == 1.0


def test_executor_failure_names_rank_pid_and_driver_error():
    ex = swap.SwapExecutor(FakeDriver(fail_on="checkpoint"))
    with pytest.raises(swap.SwapError, match=r"swapping rank 5 \(pid 4242\) out at step 2 failed: .*ILLEGAL_STATE"):
        ex.swap_out(5, 4242, step=2)


def test_driver_absent_says_what_is_needed():
    try:
        swap.CheckpointDriver()
    except swap.SwapError as e:
        assert "NVIDIA driver" in str(e) or "driver 570" in str(e)
    else:
        pytest.skip("this machine has a CUDA driver with the checkpoint API")


GPT = ["-m", "prism.workloads.gpt", "--tp", "2", "--pp", "2", "--steps", "2", "--layers", "2"]


def _plan(driver, gang="tp"):
    plan = plan_gpus(4, {"tp": 2, "pp": 2}, uses_cuda=False, gpus="0", resident=2, gang=gang, slots=1)
    plan.driver = driver
    return plan


def _checked_by(driver, monkeypatch):
    """Let ``driver`` watch the coordinator that ``capture_run`` builds."""
    from prism.shell import coordinator

    class Watched(coordinator.Coordinator):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            driver.attach(self)

    monkeypatch.setattr(coordinator, "Coordinator", Watched)


@pytest.fixture(scope="module")
def one_process_losses():
    """GPT's losses from one process computing the same function (the truth of every swap capture)."""
    ref = subprocess.run([sys.executable, *GPT[:2], "--steps", "2", "--layers", "2"], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    return parse_losses(ref.stdout)


# gang 1 is a variant: test_simulated_swaps_on_cpu_finish_without_rescues[1] swaps one rank at a time too.
@pytest.mark.slow
@pytest.mark.parametrize("gang", ["tp", pytest.param("1", marks=FULL)])
def test_capture_with_swaps_keeps_every_rank_data(tmp_path, monkeypatch, launched, gang, one_process_losses):
    monkeypatch.chdir(ROOT)
    drv = CheckingDriver()
    _checked_by(drv, monkeypatch)
    code = capture_run(tmp_path / "run", 4, GPT, slots=1, progress="off", show_ranks=(), quiet_s=15,
                       gpu=_plan(drv, gang)).exit_code
    assert code == 0
    assert drv.violations == []
    doc = json.loads(runfolder.swap_report_path(tmp_path / "run").read_text())
    assert doc["summary"]["swaps_out"] > 0 and doc["summary"]["swaps_in"] > 0
    # The same swaps were streamed as they happened (kept if a capture is killed).
    streamed = [json.loads(line) for line in
                runfolder.swap_log_path(tmp_path / "run").read_text().splitlines()]
    assert streamed == doc["records"]
    assert doc["settings"]["gang"] == gang and doc["settings"]["resident_per_gpu"] == 2
    # Every rank alternates out, in, out, ... (never swapped twice the same way).
    for rank in range(4):
        dirs = [r["direction"] for r in doc["records"] if r["rank"] == rank and r["status"] == "ok"]
        assert dirs == ["out", "in"] * (len(dirs) // 2) + ["out"] * (len(dirs) % 2), (rank, dirs)
    # The last stage's rank (2) prints the losses; one process computes the same function.
    got = parse_losses(runfolder.log_path(tmp_path / "run", 2).read_text())
    assert len(got) == 2 and got == pytest.approx(one_process_losses, rel=1e-5)


@pytest.fixture
def launched(monkeypatch):
    """The rank processes each capture launched, reaped afterwards (a capture
    that fails leaves the fork server's pipe to the garbage collector)."""
    import prism.shell.launcher

    procs = []
    original = prism.shell.launcher.launch_ranks

    def launch(*a, **kw):
        procs.append(original(*a, **kw))
        return procs[-1]

    monkeypatch.setattr(prism.shell.launcher, "launch_ranks", launch)
    yield procs
    for p in procs:
        p.close()
        p._server.stdout.close()


@pytest.mark.slow
def test_capture_survives_ranks_stopped_outright(tmp_path, monkeypatch, launched):
    # Stricter than the CUDA driver: a checkpointed process stops outright
    # (SIGSTOP), host threads included, until it is restored (SIGCONT). Data
    # reaching a stopped rank wakes it; a rank stopped while it still had
    # work (released by the stall monitor, not blocked) is restored by the
    # coordinator's rescue after a quiet spell.
    monkeypatch.chdir(ROOT)
    code = capture_run(tmp_path / "run", 4, GPT, slots=1, progress="off", show_ranks=(), quiet_s=60,
                       gpu=_plan(swap.SimulatedDriver())).exit_code
    assert code == 0
    got = parse_losses(runfolder.log_path(tmp_path / "run", 2).read_text())
    assert len(got) == 2


@pytest.mark.slow
def test_failed_checkpoint_stops_the_capture_cleanly(tmp_path, monkeypatch, launched):
    monkeypatch.chdir(ROOT)
    outcome = capture_run(tmp_path / "run", 4, GPT, slots=1, progress="off", show_ranks=(),
                          gpu=_plan(FakeDriver(fail_on="checkpoint")))
    assert outcome.exit_code == 1
    err = outcome.text()
    assert "capture FAILED (swap_failed)" in err
    assert re.search(r"swapping rank \d \(pid \d+\) out at step -?\d+ failed: .*CUDA_ERROR_ILLEGAL_STATE", err)
    # The trace stays valid: every rank has its end record.
    for r in range(4):
        assert '"k":"rank_end"' in runfolder.rank_path(tmp_path / "run", r).read_text()


@pytest.mark.gpu(reason="swaps a process's GPU memory out and back")
@pytest.mark.skipif(not swap.CheckpointDriver.available(), reason="needs a CUDA driver with the checkpoint API")
def test_checkpoint_driver_round_trip_keeps_data():
    holder = subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / "gpu_holder.py"), "0.25"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().startswith("ready")
        drv = swap.CheckpointDriver()
        ex = swap.SwapExecutor(drv)
        assert ex.swap_out(0, holder.pid).status == "ok"
        assert drv.state(holder.pid) == "checkpointed"
        assert ex.swap_in(0, holder.pid).status == "ok"
        assert drv.state(holder.pid) == "running"
        holder.stdin.write("check\n")
        holder.stdin.flush()
        assert holder.stdout.readline().startswith("ok")
    finally:
        holder.kill()
        holder.wait()
        holder.stdin.close()
        holder.stdout.close()


@pytest.mark.slow
@pytest.mark.parametrize("gang", ["1", pytest.param("tpxpp", marks=FULL)])  # gangs of TP x PP: a variant
def test_simulated_swaps_on_cpu_finish_without_rescues(tmp_path, gang):
    # World 8 on "one GPU" holding 4: gang 1 hung until the rescue (rank
    # stopped between its release and the result it had already been sent),
    # tpxpp swapped whole pipelines back and forth (200 swaps per iteration)
    # before the policy held grants back for ranks that had just received data.
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "prism", "capture", "-n", "8", "--resident", "4", "--gang", gang,
           "--simulate-swaps", "--out", str(run), "--progress", "off", "--show-ranks", "none", "--",
           "-m", "prism.workloads.gpt", "--tp", "2", "--pp", "2", "--dp", "2", "--steps", "2", "--layers", "2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(runfolder.swap_report_path(run).read_text())
    s = doc["summary"]
    assert s["swaps_out"] > 0 and s["swaps_out"] == s["swaps_in"]
    assert doc["settings"]["simulated"]["driver"] == "SIGSTOP/SIGCONT"
    assert f"gang {gang}]" in proc.stderr and "simulated on CPU" in proc.stderr
    # Every rank is stopped and continued in turn, never twice the same way.
    for rank in range(8):
        dirs = [r["direction"] for r in doc["records"] if r["rank"] == rank and r["status"] == "ok"]
        assert dirs == ["out", "in"] * (len(dirs) // 2) + ["out"] * (len(dirs) % 2), (rank, dirs)
    # No quiet spell needed a rescue (each costs 5 s; the capture takes ~4 s here).
    assert s["rescues"] == 0


@pytest.mark.slow
def test_simulate_swaps_rejects_a_cuda_command_and_a_missing_resident(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    base = [sys.executable, "-m", "prism", "capture", "-n", "2", "--out", str(tmp_path / "r"), "--simulate-swaps"]
    p = subprocess.run(base + ["--resident", "1", "--", "-m", "prism.workloads.gpt", "--dp", "2", "--device", "cuda"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode != 0 and "runs the ranks on CPU, but the command uses cuda" in p.stderr
    p = subprocess.run(base + ["--", "-m", "prism.workloads.gpt", "--dp", "2"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode != 0 and "--simulate-swaps needs --resident K" in p.stderr
