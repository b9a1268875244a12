"""``prism capture --agents N`` and ``prism emulate --agents N`` served by
``prism agent`` processes: separate process trees on one machine, tcp on
loopback with CURVE (issue 23)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prism.core import trace as T
from prism.shell.agent import AgentConfig, AgentError, AgentProcesses, run_agent
from prism.shell import runfolder
from prism.workloads import harness
from tests.integration.test_emulate import forkservers
from tests.support.captures import gpt_tiny
from tests.support.full import FULL
from transport.curve import make_keys
from transport.endpoints import free_tcp_endpoint

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))


def start(cwd: Path, *args: str, out: str, keep_stdout: bool = False) -> subprocess.Popen:
    """``python -m prism ARGS`` in its own session (the test kills its whole
    tree if it must); stderr (and with ``keep_stdout`` stdout) into ``out``."""
    with open(cwd / out, "w") as err:
        return subprocess.Popen([sys.executable, "-m", "prism", *args], cwd=cwd, env=ENV, start_new_session=True,
                                stdout=err if keep_stdout else subprocess.DEVNULL, stderr=err)


def reap(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


def served(tmp_path: Path, world: int, command: list[str], agents: int, *extra: str, agent_args: tuple = ()):
    """The capture (started first) and its agents, each on loopback tcp with
    CURVE; ``agent_args``: more options for every agent."""
    make_keys(tmp_path / "keys")
    ep = free_tcp_endpoint()
    cap = start(tmp_path, "capture", "-n", str(world), "--agents", str(agents), "--listen", ep, "--keys", "keys",
                "--out", "run", "--progress", "off", "--show-ranks", "none", *extra, "--", *command, out="cap.err")
    ags = [start(tmp_path, "agent", "--coordinator", ep, "--keys", "keys", "--node-rank", str(i), *agent_args,
                 out=f"agent{i}.err") for i in range(agents)]
    return cap, ags


def capture_served(tmp_path: Path, world: int, command: list[str], agents: int, *extra: str, agent_args: tuple = (),
                   timeout: float = 120) -> str:
    """``served``, waited for: the capture and every agent must exit 0 within
    ``timeout`` (the agents 30 s after); no process is left. The capture's stderr."""
    cap, ags = served(tmp_path, world, command, agents, *extra, agent_args=agent_args)
    try:
        assert cap.wait(timeout=timeout) == 0, (tmp_path / "cap.err").read_text()
        assert [a.wait(timeout=30) for a in ags] == [0] * agents
    finally:
        reap(cap, *ags)
    return (tmp_path / "cap.err").read_text()


def timeless(events: list[T.Event]) -> list[str]:
    """A rank's trace without what a run's timing and processes change: no
    times, pids or hosts, and in no order (async calls are written as they
    complete, which is timing too)."""
    out = []
    for ev in events:
        if isinstance(ev, (T.Memory, T.Compute)):
            continue
        d = dataclasses.asdict(ev)
        out.append((type(ev).__name__, sorted((k, v) for k, v in d.items()
                                              if not k.endswith("_ns") and k not in ("pid", "hostname"))))
    return sorted(map(repr, out))


@pytest.mark.slow
def test_two_agents_capture_equals_one_machine(tmp_path, shared_captures):
    # the world 16: the bundled GPT tp2 pp2 dp4 (tiny), through two agents on loopback with CURVE
    cmd = gpt_tiny(4)
    text = capture_served(tmp_path, 16, cmd, 2, "--slots", "2")
    assert "ran ranks 0-7" in text and "ran ranks 8-15" in text, text
    proc, plain = shared_captures.get(16, cmd, "--slots", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = runfolder.read_run(tmp_path / "run"), runfolder.read_run(plain)
    assert not got.warnings
    assert sorted(got.ranks) == sorted(want.ranks) == list(range(16))
    reported = []
    for r in range(16):
        assert timeless(got.ranks[r]) == timeless(want.ranks[r]), f"rank {r}"
        assert sum(isinstance(e, T.Collective) for e in got.ranks[r]) > 0
        losses = harness.parse_losses(runfolder.log_path(tmp_path / "run", r).read_text())
        assert losses == harness.parse_losses(runfolder.log_path(plain, r).read_text()), f"rank {r}"
        reported += losses
    assert len(reported) >= 2  # the reporting rank's two steps
    assert not forkservers(tmp_path)


@pytest.mark.slow
@FULL  # sibling: test_a_calibration_runs_its_slices_through_agents_that_serve_many_runs (agents serving run after run)
def test_one_agent_serves_two_captures_in_a_row(tmp_path):
    """``prism agent --runs 2``: after the first capture it connects again to
    the same address and serves the next capture bound there, then exits."""
    make_keys(tmp_path / "keys")
    ep = free_tcp_endpoint()
    cmd = gpt_tiny(1)

    def capture(out: str) -> subprocess.Popen:
        return start(tmp_path, "capture", "-n", "4", "--agents", "1", "--listen", ep, "--keys", "keys", "--out", out,
                     "--progress", "off", "--show-ranks", "none", "--", *cmd, out=f"{out}.err")

    agent = start(tmp_path, "agent", "--coordinator", ep, "--keys", "keys", "--runs", "2", out="agent.err")
    caps = [capture("run1")]
    try:
        assert caps[0].wait(timeout=120) == 0, (tmp_path / "run1.err").read_text()
        assert agent.poll() is None, (tmp_path / "agent.err").read_text()  # waits for its second run
        caps.append(capture("run2"))
        assert caps[1].wait(timeout=120) == 0, (tmp_path / "run2.err").read_text()
        assert agent.wait(timeout=30) == 0, (tmp_path / "agent.err").read_text()
    finally:
        reap(agent, *caps)
    text = (tmp_path / "agent.err").read_text()
    assert "run 1 of 2 ended: 4 ranks, 0 failed" in text and "run 2 of 2 ended: 4 ranks, 0 failed" in text, text
    assert "8 ranks ended over 2 runs, 0 failed" in text, text
    for out in ("run1", "run2"):
        assert sorted(runfolder.read_run(tmp_path / out).ranks) == [0, 1, 2, 3]
    assert not forkservers(tmp_path)


@pytest.mark.slow
def test_a_lost_agent_ends_the_run_naming_it_and_its_ranks(tmp_path):
    cmd = [*gpt_tiny(1)[:-1], "400"]
    cap, ags = served(tmp_path, 4, cmd, 2, "--slots", "2", "--quiet-period", "30")
    try:
        # Kill node 1 once its ranks compute (their trace files have records).
        deadline = time.monotonic() + 60
        while not all(runfolder.rank_path(tmp_path / "run", r).exists() and
                      runfolder.rank_path(tmp_path / "run", r).stat().st_size > 0 for r in (2, 3)):
            assert time.monotonic() < deadline and cap.poll() is None, (tmp_path / "cap.err").read_text()
            time.sleep(0.2)
        time.sleep(0.5)
        os.kill(ags[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        code = cap.wait(timeout=30)
        took = time.monotonic() - killed
        assert ags[0].wait(timeout=30) == 1
    finally:
        reap(cap, *ags)
    text = (tmp_path / "cap.err").read_text()
    assert code == 1, text
    assert took < 15, took
    assert "capture FAILED (node_lost)" in text and "ranks 2-3) lost" in text and "#1" in text, text
    assert "Traceback" not in text
    deadline = time.monotonic() + 10
    while forkservers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not forkservers(tmp_path)
    r = subprocess.run([sys.executable, "-m", "prism", "trace", "validate", "run"], cwd=tmp_path, env=ENV,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_an_agent_with_other_keys_is_refused_clearly(tmp_path):
    make_keys(tmp_path / "keys")
    make_keys(tmp_path / "other")
    ep = free_tcp_endpoint()

    procs = AgentProcesses(ep, 1, 2, keys=tmp_path / "keys")
    try:
        with pytest.raises(AgentError, match="server.key is not its public key"):
            run_agent(AgentConfig(ep, tmp_path / "other", wait_s=10))
        stranger = tmp_path / "stranger"  # the right server key, a client key it does not know
        stranger.mkdir()
        shutil.copy(tmp_path / "keys" / "server.key", stranger)
        shutil.copy(tmp_path / "other" / "client.key_secret", stranger)
        with pytest.raises(AgentError, match=r"refused your key .*client.key_secret.*authorized/"):
            run_agent(AgentConfig(ep, stranger, wait_s=10))
        with pytest.raises(AgentError, match="requires CURVE keys"):
            run_agent(AgentConfig(ep, None, insecure=True, wait_s=10))
    finally:
        procs.close()


def test_a_rank_without_the_right_keys_is_refused_at_once(tmp_path):
    import zmq

    from prism.core.protocol import PROTOCOL_VERSION, Hello
    from transport.client import BlockingClient, CoordinatorLost
    from transport.curve import serve_curve

    make_keys(tmp_path / "keys")
    make_keys(tmp_path / "other")
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    shutil.copy(tmp_path / "keys" / "server.key", stranger)
    shutil.copy(tmp_path / "other" / "client.key_secret", stranger)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    auth = serve_curve(sock, tmp_path / "keys")
    try:
        sock.bind("tcp://127.0.0.1:*")
        ep = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        hello = Hello(PROTOCOL_VERSION, 0, 2, 0, os.getpid(), "h", "cpu", time.monotonic_ns())
        for keys, match in [(stranger, "refused your key"), (None, "requires CURVE keys: pass --keys")]:
            t0 = time.monotonic()
            with pytest.raises(CoordinatorLost, match=match):
                BlockingClient.connect(ep, hello, timeout=20, curve_keys=keys)
            assert time.monotonic() - t0 < 5
    finally:
        sock.close(linger=0)
        auth.stop()


# --- emulation through agents ---------------------------------------------------------

#: GPT tp2 x dp2 (world 4), one layer: sandboxes 0 and 2 are in two TP groups, one per agent.
GPT_W4 = ["-m", "prism.workloads.gpt", "--tp", "2", "--pp", "1", "--dp", "2", "--layers", "1", "--hidden", "32",
          "--heads", "2", "--seq-len", "16", "--steps", "3"]


def emulated(tmp_path: Path, run: Path, sandbox: str, agents: int, name: str, *, ep: str | None = None,
             wrap: dict[int, list[str]] | None = None, agent_args: tuple = (), emu_args: tuple = ()):
    """``prism emulate RUN --agents N`` (started first) and its agents, on
    loopback tcp with CURVE (or ``ep``); ``wrap[i]``: a command agent i runs
    under; ``emu_args``: more options for the emulation."""
    if not (tmp_path / "keys").exists():  # a capture served by agents in the same test made them
        make_keys(tmp_path / "keys")
    ep = ep or free_tcp_endpoint()
    emu = start(tmp_path, "emulate", str(run), "--sandbox", sandbox, "--agents", str(agents), "--listen", ep,
                "--keys", "keys", "--name", name, "--progress", "off", *emu_args, out="emu.out", keep_stdout=True)
    ags = []
    for i in range(agents):
        args = ["agent", "--coordinator", ep, "--keys", "keys", "--node-rank", str(i), *agent_args]
        if wrap and i in wrap:
            with open(tmp_path / f"agent{i}.err", "w") as err:
                ags.append(subprocess.Popen([*wrap[i], sys.executable, "-m", "prism", *args], cwd=tmp_path, env=ENV,
                                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=err))
        else:
            ags.append(start(tmp_path, *args, out=f"agent{i}.err"))
    return emu, ags


def _other_clock() -> tuple[str, list[str]] | None:
    """A tcp endpoint on this host's non-loopback address (ranks there count
    as another node's: their clock offset is estimated) and a command that
    runs a process with CLOCK_MONOTONIC 10^5 s ahead (a Linux time
    namespace), as a node booted at another time; None where either is missing."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 9))  # no packet: only the route's source address
            ip = s.getsockname()[0]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
    except OSError:
        return None
    if ip.startswith("127."):
        return None
    wrap = ["unshare", "--time", "--monotonic", "100000"]
    try:
        ok = subprocess.run([*wrap, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (f"tcp://{ip}:{port}", wrap) if ok else None


@pytest.fixture
def gpt_w4(tmp_path, shared_captures) -> Path:
    # A copy: the emulation writes RUN/emulation/.
    return shared_captures.copy(tmp_path / "gpt", 4, GPT_W4, "--record", "0,2")


@pytest.mark.slow
def test_an_emulation_through_two_agents_gives_the_captures_losses(tmp_path, gpt_w4):
    emu, ags = emulated(tmp_path, gpt_w4, "0,2", 2, "agents")
    try:
        assert emu.wait(timeout=120) == 0, (tmp_path / "emu.out").read_text()
        assert [a.wait(timeout=30) for a in ags] == [0, 0]
    finally:
        reap(emu, *ags)
    text = (tmp_path / "emu.out").read_text()
    assert "ran sandbox ranks 0\n" in text and "ran sandbox ranks 2\n" in text, text
    out = gpt_w4 / "emulation" / "agents"
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "ok" and s["sandbox"] == [0, 2]
    assert [a["ranks"] for a in s["agents"]] == [[0], [2]]
    # only the sandbox ranks ran, each through its agent
    assert sorted(p.name for p in (out / runfolder.LOGS_DIR).iterdir()) == ["rank-000000.log", "rank-000002.log"]
    r0 = s["ranks"]["0"]
    assert len(r0["losses"]) == 3 and r0["losses"] == r0["capture_losses"] and r0["losses_equal"] is True
    assert s["calls"]["compensated"] == 0 and s["calls"]["recorded"] > 0
    for r in ("0", "2"):
        info = s["ranks"][r]
        assert info["recorded"] and not info["divergence"] and len(info["iteration_ns"]) == 3
        assert info["peak_rss_bytes"] > 0  # reported by its agent with its exit
    assert not forkservers(tmp_path)


# A variant of test_an_emulation_through_two_agents_gives_the_captures_losses:
# node 1's clock is 10^5 s ahead of the coordinator's, as another machine's.
@pytest.mark.slow
@FULL
def test_a_sandbox_on_a_node_with_another_clock_is_paced_on_its_own(tmp_path, gpt_w4):
    other = _other_clock()
    if other is None:
        pytest.skip("needs a non-loopback IPv4 address and `unshare --time` (a Linux time namespace)")
    ep, wrap = other
    emu, ags = emulated(tmp_path, gpt_w4, "0,2", 2, "clock", ep=ep, wrap={1: wrap})
    try:
        # The coordinator's clock and node 1's differ by 10^5 s: a release
        # computed on the wrong one would be held for a day (a hang) or not at all.
        assert emu.wait(timeout=120) == 0, (tmp_path / "emu.out").read_text()
        assert [a.wait(timeout=30) for a in ags] == [0, 0]
    finally:
        reap(emu, *ags)
    s = json.loads((gpt_w4 / "emulation" / "clock" / "summary.json").read_text())
    assert s["status"] == "ok"
    r0, r2 = s["ranks"]["0"], s["ranks"]["2"]
    assert r0["losses"] == r0["capture_losses"] and r0["losses_equal"] is True
    # each offset estimated to within tens of ms (a message's transit on a busy 2-core machine)
    assert abs(r0["clock_offset_ns"]) < 50e6 and abs(r2["clock_offset_ns"] + 100_000 * 10**9) < 50e6, (r0, r2)
    # the results were released on each rank's clock: the pacing lag stays small
    assert s["pacing"]["lag_p50_ns"] < 5e6, s["pacing"]
    for info in (r0, r2):
        assert len(info["iteration_ns"]) == 3 and 0 < info["mean_iteration_ns"] < 1e9
    assert not forkservers(tmp_path)


# A variant of test_a_lost_agent_ends_the_run_naming_it_and_its_ranks (the
# coordinator's watcher, which the emulator inherits) through an emulation.
@pytest.mark.slow
@FULL
def test_a_lost_agent_ends_an_emulation_naming_it_and_its_ranks(tmp_path, gpt_w4):
    emu, ags = emulated(tmp_path, gpt_w4, "0,2", 2, "lost")
    try:
        # Kill node 1 as soon as it has its Launch (its sandbox is starting).
        deadline = time.monotonic() + 60
        while "ranks 2 of 4" not in (tmp_path / "agent1.err").read_text():
            assert time.monotonic() < deadline and emu.poll() is None, (tmp_path / "emu.out").read_text()
            time.sleep(0.05)
        os.kill(ags[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        code = emu.wait(timeout=30)
        took = time.monotonic() - killed
        assert ags[0].wait(timeout=30) == 1
    finally:
        reap(emu, *ags)
    text = (tmp_path / "emu.out").read_text()
    assert code == 1, text
    assert took < 15, took
    assert "emulate: FAILED (node_lost)" in text and "ranks 2) lost" in text and "#1" in text, text
    assert "Traceback" not in text
    s = json.loads((gpt_w4 / "emulation" / "lost" / "summary.json").read_text())
    assert s["status"] == "node_lost" and "ranks 2) lost" in s["message"]
    deadline = time.monotonic() + 10
    while forkservers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not forkservers(tmp_path)


def test_agents_get_only_the_ranks_placed_on_them(tmp_path):
    """The coordinator's side with a subset of the world (an emulation's
    sandbox): each agent's Launch has its ranks and the environment; the
    handle waits for those ranks only and keeps the peak RSS they report."""
    import orjson
    import zmq

    from prism.core import agents as A

    procs = AgentProcesses(free_tcp_endpoint(), 2, 8, keys=None, insecure=True)
    socks = []
    try:
        for node_rank in (1, 0):  # joining in either order; placed in node order
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(procs.endpoint)
            sock.send(orjson.dumps(A.encode(A.AgentHello(f"n{node_rank}", "h", 4, (0, 1) if node_rank else (),
                                                         100 + node_rank, node_rank=node_rank))))
            socks.append((node_rank, sock))
        procs.wait_agents(10)
        placed = procs.place(2, [6, 0, 1, 5])
        assert [(h.node, ranks) for h, ranks in placed] == [("n0", [0, 1]), ("n1", [5, 6])]
        assert procs.node_slots() == ({0: 0, 1: 0, 5: 1, 6: 1}, [4, 4])
        assert procs.node_slots(gpus=True)[1] == [1, 2]  # a CUDA run: one rank computing per GPU
        procs.launch("tcp://h:1", tmp_path, ["-m", "x"], env={"PRISM_SANDBOX_RANKS": "0,1,5,6"},
                     env_of=lambda hello, ranks: {"NODE": f"{hello.node}:{ranks}"})
        for node_rank, sock in socks:
            assert sock.poll(5000)
            while not isinstance(msg := A.decode(orjson.loads(sock.recv())), A.Launch):
                assert sock.poll(5000)
            assert msg.ranks == ((0, 1) if node_rank == 0 else (5, 6)) and msg.world_size == 8
            assert msg.env == {"PRISM_SANDBOX_RANKS": "0,1,5,6",
                               "NODE": "n0:[0, 1]" if node_rank == 0 else "n1:[5, 6]"}
            sock.send(orjson.dumps(A.encode(A.Exits({r: 0 for r in msg.ranks}, {msg.ranks[0]: 1 << 20}))))
        t0 = time.monotonic()
        codes = procs.wait(timeout=10)
        assert time.monotonic() - t0 < 5  # the ranks not placed are not waited for
        assert codes == [0, 0, None, None, None, 0, 0, None]
        assert procs.running() == [] and procs.peak_rss == {0: 1 << 20, 5: 1 << 20}
    finally:
        procs.close()
        for _, sock in socks:
            sock.close()


@pytest.mark.slow
def test_a_calibration_runs_its_slices_through_agents_that_serve_many_runs(tmp_path, gpt_w4):
    """``prism calibrate --agents 2`` over ``prism agent --runs 0``: the two
    first slices (a rank each) run side by side, one per agent, in one
    emulation (the third, a TP group, a run of its own, goes to agent 0 while
    agent 1 gets an empty launch); both agents go on to the next run and end cleanly on SIGTERM;
    ``predict --calibration on`` uses the result."""
    from prism.app.calibrate import load_calibration
    from prism.app.predict import PredictConfig, predict

    make_keys(tmp_path / "keys")
    ep = free_tcp_endpoint()
    cal = start(tmp_path, "calibrate", str(gpt_w4), "--slices", "0;1,2;3", "--cores", "2", "--name", "ag",
                "--agents", "2", "--listen", ep, "--keys", "keys", out="cal.out", keep_stdout=True)
    # node 1 offers one slot: its slice of two ranks is cramped, and said so
    ags = [start(tmp_path, "agent", "--coordinator", ep, "--keys", "keys", "--node-rank", str(i), "--runs", "0",
                 *(["--slots", "1"] if i else []), out=f"agent{i}.err") for i in range(2)]
    try:
        assert cal.wait(timeout=180) == 0, (tmp_path / "cal.out").read_text()
        # the coordinator ends as the last ranks do; each agent notes its run's end a moment later
        # (its fork server's last report): wait for both notes, so the SIGTERM finds them between runs
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                "run 2 ended" in (tmp_path / f"agent{i}.err").read_text() for i in range(2)):
            time.sleep(0.1)
        assert all(a.poll() is None for a in ags)  # waiting for the next run
        for a in ags:
            a.send_signal(signal.SIGTERM)
        codes = [a.wait(timeout=30) for a in ags]
    finally:
        reap(cal, *ags)
    texts = [(tmp_path / f"agent{i}.err").read_text() for i in range(2)]
    assert codes == [0, 0], texts
    for text in texts:
        assert "run 2 ended" in text and "stopped by SIGTERM: no rank of it was running" in text and "Traceback" not in text, text
    m = json.loads((gpt_w4 / "calibration" / "ag" / "manifest.json").read_text())
    assert m["slices"] == [[0], [1, 2], [3]] and m["agents"] == 2 and m["uncalibrated_ranks"] == []
    assert m["emulations"] == ["calibrate-ag-slices0-1", "calibrate-ag-slices0-1", "calibrate-ag-slice2"]
    n0, n1, n2 = (n["node"] for n in m["slice_nodes"])
    assert n0 != n1 and n2 == n0
    assert m["cramped_slices"] == [f"slice 1 (2 ranks) on node {n1} (1 slot)"]
    s = json.loads((gpt_w4 / "emulation" / "calibrate-ag-slices0-1" / "summary.json").read_text())
    assert s["status"] == "ok" and [a["ranks"] for a in s["agents"]] == [[0], [1, 2]], s["agents"]
    s = json.loads((gpt_w4 / "emulation" / "calibrate-ag-slice2" / "summary.json").read_text())
    assert s["status"] == "ok" and [a["ranks"] for a in s["agents"]] == [[3], []], s["agents"]
    out = (tmp_path / "cal.out").read_text()
    assert f"slice 1: ranks 1,2 on node {n1}" in out and "warning: a slice had more ranks than its node's slots" in out
    table, _ = load_calibration(gpt_w4, "on")
    assert sorted(table) == [0, 1, 2, 3]
    p = predict(PredictConfig(run=gpt_w4, warmup=1, calibration="on"))
    assert p.calibration["name"] == "ag" and p.mean_iteration_ns > 0
    assert not forkservers(tmp_path)


@pytest.mark.slow
def test_agents_started_by_real_torchrun_find_their_node_rank_and_serve_a_capture(tmp_path):
    """Two ``torchrun --nnodes 2 --node-rank R --master-addr ... -m prism
    agent`` (torch's own launcher, static rendezvous, one process per node):
    each agent takes its node rank from torchrun's GROUP_RANK and the
    coordinator's host from MASTER_ADDR (its port is ``--port``, not
    torchrun's store port), and the pair serves a capture as two agents do."""
    make_keys(tmp_path / "keys")
    ep = free_tcp_endpoint()
    port = ep.rsplit(":", 1)[1]
    master = free_tcp_endpoint().rsplit(":", 1)[1]
    cap = start(tmp_path, "capture", "-n", "4", "--agents", "2", "--listen", ep, "--keys", "keys", "--out", "run",
                "--progress", "off", "--show-ranks", "none", "--", *GPT_W4, out="cap.err")
    ags = []
    for r in range(2):
        with open(tmp_path / f"torchrun{r}.err", "w") as err:
            ags.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                 "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", master,
                 "-m", "prism", "agent", "--keys", "keys", "--port", port],
                cwd=tmp_path, env=ENV, start_new_session=True, stdout=err, stderr=err))
    try:
        assert cap.wait(timeout=120) == 0, (tmp_path / "cap.err").read_text()
        codes = [a.wait(timeout=60) for a in ags]
    finally:
        reap(cap, *ags)
    texts = [(tmp_path / f"torchrun{r}.err").read_text() for r in range(2)]
    assert codes == [0, 0], texts
    import re

    for r, text in enumerate(texts):  # MASTER_ADDR with --port; node rank r from GROUP_RANK
        assert re.search(rf"joining tcp://127\.0\.0\.1:{port} as \S+#{r}\b", text), text
    cap_text = (tmp_path / "cap.err").read_text()
    assert re.search(r"agent \S+#0 on \S+ ran ranks 0-1", cap_text), cap_text
    assert re.search(r"agent \S+#1 on \S+ ran ranks 2-3", cap_text), cap_text
    run = runfolder.read_run(tmp_path / "run")
    assert sorted(run.ranks) == [0, 1, 2, 3] and not run.warnings
    assert not forkservers(tmp_path)


def test_an_agent_between_runs_waits_on_and_serves_empty_launches(tmp_path):
    """``runs=2`` with no coordinator yet: a wait past ``wait_s`` is a note,
    not an error; each coordinator in turn (binding the same address once
    the last closed) gives it an empty launch, and it ends after the second."""
    import threading

    ep = free_tcp_endpoint()
    notes: list[str] = []
    got: list[object] = []
    agent = threading.Thread(target=lambda: got.append(run_agent(
        AgentConfig(ep, None, insecure=True, wait_s=0.3, runs=2), notes.append)), daemon=True)
    agent.start()
    deadline = time.monotonic() + 10
    while not any("still waiting for the next run" in n for n in notes):
        assert time.monotonic() < deadline and agent.is_alive(), notes
        time.sleep(0.05)
    for run in (1, 2):
        procs = AgentProcesses(ep, 1, 2, keys=None, insecure=True)
        try:
            procs.wait_agents(10)
            procs.launch("tcp://127.0.0.1:1", tmp_path, ["-m", "x"])  # nothing placed: an empty Launch
            deadline = time.monotonic() + 10
            while not any(f"run {run} of 2 ended: 0 ranks" in n for n in notes):
                assert time.monotonic() < deadline, notes
                time.sleep(0.05)
        finally:
            procs.close()
    agent.join(timeout=10)
    assert not agent.is_alive() and got and got[0].runs == 2 and got[0].ok, notes
    assert sum("has no rank for this node" in n for n in notes) == 2, notes


def _swallow_the_hello(ep: str) -> None:
    """A coordinator past its last read (its thread stopped, its socket not
    yet closed): the agent's hello arrives and goes down with the socket."""
    import zmq

    old = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        old.bind(ep)
        assert old.poll(5000)  # the hello came; nobody answers it
    finally:
        old.close(linger=0)


def _cut_the_handshake(ep: str) -> None:
    """A coordinator closing while the agent's connection is being set up:
    the connection ends mid-handshake (what a wrong server key also gives)."""
    import socket

    host, _, port = ep.removeprefix("tcp://").rpartition(":")
    with socket.create_server((host, int(port))) as srv:
        srv.settimeout(5)
        conn, _ = srv.accept()
        conn.close()


@pytest.mark.parametrize("old_coordinator", [_swallow_the_hello, _cut_the_handshake])
def test_an_agent_says_hello_again_to_the_next_coordinator_when_the_last_one_closes(tmp_path, old_coordinator):
    """The last run's coordinator (a calibration's last slice) closing as an
    agent joins it: the agent's hello is lost with that coordinator's socket,
    or its handshake is cut. ZeroMQ reconnects the agent to the next
    coordinator bound at the address, but nothing says hello there: the
    agent starts over on a new connection, and joins."""
    import threading

    ep = free_tcp_endpoint()
    notes: list[str] = []
    got: list[object] = []
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            got.append(run_agent(AgentConfig(ep, None, insecure=True, wait_s=20), notes.append))
        except BaseException as e:
            errors.append(e)

    agent = threading.Thread(target=serve, daemon=True)
    agent.start()
    old_coordinator(ep)
    procs = AgentProcesses(ep, 1, 2, keys=None, insecure=True)
    try:
        procs.wait_agents(10)
        procs.launch("tcp://127.0.0.1:1", tmp_path, ["-m", "x"])  # nothing placed: an empty Launch
        agent.join(timeout=10)
    finally:
        procs.close()
    assert not agent.is_alive() and not errors and got and got[0].ok, (errors, notes)
    assert any("saying hello again" in n for n in notes), notes


@pytest.mark.slow
def test_a_cuda_capture_through_an_agent_without_gpus_is_refused_naming_it(tmp_path):
    make_keys(tmp_path / "keys")
    ep = free_tcp_endpoint()
    cap = start(tmp_path, "capture", "-n", "2", "--agents", "1", "--listen", ep, "--keys", "keys", "--out", "run",
                "--progress", "off", "--", "-m", "prism.workloads.gpt", "--tp", "2", "--device", "cuda",
                out="cap.err")
    ag = start(tmp_path, "agent", "--coordinator", ep, "--keys", "keys", "--node-rank", "0", "--gpus", "none",
               "--wait", "20", out="agent.err")
    try:
        assert cap.wait(timeout=60) == 2
        err = (tmp_path / "cap.err").read_text()
        assert "agent" in err and "offers no GPU for its ranks 0-1: start it on a node with GPUs" in err, err
        assert "Traceback" not in err, err
        assert ag.wait(timeout=15) == 1  # refused with the same reason, at once
        assert "offers no GPU" in (tmp_path / "agent.err").read_text()
        assert not (tmp_path / "run" / "ranks").exists() or not any((tmp_path / "run" / "ranks").iterdir())
    finally:
        reap(cap, ag)


@pytest.mark.slow
@FULL  # siblings: test_agents_get_only_the_ranks_placed_on_them (each node's Launch environment) and
# tests/unit/test_agents.py::test_a_cuda_capture_puts_each_nodes_ranks_on_its_own_gpus (what it holds)
def test_a_cuda_capture_gives_each_node_its_own_gpus(tmp_path):
    """Two agents offering different GPUs serve a capture of a command that
    names cuda: each rank is launched with its node's GPUs and its node's
    ranks (on this CPU machine the ranks cannot take a GPU, so the script
    only reports what it was given)."""
    from prism.shell.gpu_plan import visible_gpus
    from tests.support.rank_harness import SCRIPTS

    seen = visible_gpus()  # an agent refuses GPUs its node does not have; without NVML any index goes
    offers = ("3", "5,6") if not seen else (str(seen[0]), ",".join(map(str, seen[:2])))
    make_keys(tmp_path / "keys")
    ep = free_tcp_endpoint()
    cap = start(tmp_path, "capture", "-n", "4", "--agents", "2", "--listen", ep, "--keys", "keys", "--out", "run",
                "--progress", "off", "--show-ranks", "none", "--memory-limit", "3", "--",
                str(SCRIPTS / "env_worker.py"), str(tmp_path), "--device", "cuda", out="cap.err")
    ags = [start(tmp_path, "agent", "--coordinator", ep, "--keys", "keys", "--node-rank", str(i), "--gpus", g,
                 out=f"agent{i}.err") for i, g in enumerate(offers)]
    try:
        assert cap.wait(timeout=120) == 0, (tmp_path / "cap.err").read_text()
        for a in ags:
            assert a.wait(timeout=30) == 0
    finally:
        reap(cap, *ags)
    envs = [json.loads((tmp_path / f"env{r}.json").read_text())["env"] for r in range(4)]
    assert [(e["PRISM_GPUS"], e["PRISM_NODE_RANKS"]) for e in envs] == [(offers[0], "0-1"), (offers[0], "0-1"),
                                                                        (offers[1], "2-3"), (offers[1], "2-3")]
    # --memory-limit through agents: each node's ranks get the same allocator budget (3 GiB less the 0.6 overhead)
    budget = int((3 - 0.6) * 2**30)
    assert [e.get("PRISM_MEMORY_LIMIT_BYTES") for e in envs] == [str(budget)] * 4
    from prism.app.predict import load_run_manifest

    manifest = load_run_manifest(tmp_path / "run")
    assert manifest.device_kind == "cuda" and dict(manifest.notes)["allocator_limit_bytes"] == str(budget)
    assert f"with GPUs {offers[1]}" in (tmp_path / "agent1.err").read_text()
    assert not forkservers(tmp_path)


@pytest.mark.gpu(reason="two agents sharing GPU 0 serve a CUDA capture and an emulation of it")
def test_two_agents_on_one_gpu_capture_and_emulate_like_one_machine(tmp_path, shared_captures):
    """Issue 23 on a GPU: two agents offering the same GPU (two "nodes" of
    one machine) serve a CUDA capture of GPT tp2 dp2; its trace equals a
    one-machine CUDA capture's but for timing, its losses are equal; an
    emulation of it through the agents (sandboxes 0 and 2, one per node)
    gives the capture's losses bit for bit."""
    cmd = [*GPT_W4, "--device", "cuda"]
    capture_served(tmp_path, 4, cmd, 2, "--record", "0,2", agent_args=("--gpus", "0"), timeout=240)
    proc, plain = shared_captures.get(4, cmd, "--gpus", "0", "--record", "0,2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from prism.app.predict import load_run_manifest

    assert load_run_manifest(tmp_path / "run").device_kind == "cuda"
    got, want = runfolder.read_run(tmp_path / "run"), runfolder.read_run(plain)
    assert not got.warnings and sorted(got.ranks) == sorted(want.ranks) == [0, 1, 2, 3]
    def peaks(run, r):  # per step, the rank's torch peak
        return {ev.step: ev.peak_allocated for ev in run.ranks[r] if isinstance(ev, T.Memory)}

    for r in range(4):
        assert timeless(got.ranks[r]) == timeless(want.ranks[r]), f"rank {r}"
        losses = harness.parse_losses(runfolder.log_path(tmp_path / "run", r).read_text())
        assert losses == harness.parse_losses(runfolder.log_path(plain, r).read_text()), f"rank {r}"
        # the program's memory readings do not depend on where its ranks ran (a 4 KiB difference
        # on rank 2 between an agents capture and its emulation was seen once, 2026-12-04)
        assert peaks(got, r) == peaks(want, r) and peaks(got, r), (r, peaks(got, r), peaks(want, r))
    emu, ags = emulated(tmp_path, tmp_path / "run", "0,2", 2, "agents-gpu", agent_args=("--gpus", "0"))
    try:
        assert emu.wait(timeout=240) == 0, (tmp_path / "emu.out").read_text()
        assert [a.wait(timeout=30) for a in ags] == [0, 0]
    finally:
        reap(emu, *ags)
    s = json.loads((tmp_path / "run" / "emulation" / "agents-gpu" / "summary.json").read_text())
    assert s["status"] == "ok" and [a["ranks"] for a in s["agents"]] == [[0], [2]]
    r0 = s["ranks"]["0"]  # the rank that prints the losses
    assert len(r0["losses"]) == 3 and r0["losses_equal"] is True, r0
    for r in ("0", "2"):
        info = s["ranks"][r]
        assert info["recorded"] and not info["divergence"] and info["peaks_equal"] is True, (r, info)
    assert s["calls"]["compensated"] == 0 and s["calls"]["recorded"] > 0
    assert not forkservers(tmp_path)


@pytest.mark.gpu(reason="device-path sandboxes on two agents' nodes (both on GPU 0)")
def test_device_path_sandboxes_through_agents_give_the_captures_losses(tmp_path, shared_captures):
    """``--device-path`` through agents: each agent checks cuda_ext's kernels
    on its node before its sandboxes start (the summary's ``cuda_ext`` names
    every node's check); the recorded sandboxes 0 and 2, one per node, give
    the capture's losses and torch peaks."""
    cmd = [*GPT_W4, "--device", "cuda"]
    proc, plain = shared_captures.get(4, cmd, "--gpus", "0", "--record", "0,2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    emu, ags = emulated(tmp_path, plain, "0,2", 2, "agents-dp", agent_args=("--gpus", "0"),
                        emu_args=("--device-path",))
    try:
        assert emu.wait(timeout=300) == 0, (tmp_path / "emu.out").read_text()
        assert [a.wait(timeout=30) for a in ags] == [0, 0]
    finally:
        reap(emu, *ags)
    s = json.loads((plain / "emulation" / "agents-dp" / "summary.json").read_text())
    assert s["status"] == "ok" and [a["ranks"] for a in s["agents"]] == [[0], [2]]
    assert s["cuda_ext"]["path"] == "kernels" and len(s["cuda_ext"]["nodes"]) == 2, s["cuda_ext"]
    assert s["ranks"]["0"]["losses_equal"] is True, s["ranks"]["0"]
    for r in ("0", "2"):
        info = s["ranks"][r]
        assert info["recorded"] and not info["divergence"] and info["peaks_equal"] is True, (r, info)
    assert s["calls"]["reached_on_gpu"] > 0, s["calls"]
    assert not forkservers(tmp_path)


@pytest.mark.gpu(reason="an OOM under --memory-limit on an agent's GPU")
def test_an_oom_under_a_memory_limit_through_agents_is_a_named_result(tmp_path):
    """``--memory-limit`` through agents: each node's ranks get the
    allocator budget, and the rank that passes it is reported as on one machine
    (the script reads only its first argument; ``--device cuda`` tells Prism
    it runs on CUDA, as a training script's flag would)."""
    from tests.support.rank_harness import SCRIPTS

    cap, ags = served(tmp_path, 2, [str(SCRIPTS / "oom_worker.py"), "0.5", "--device", "cuda"], 2, "--memory-limit", "4.6",
                      agent_args=("--gpus", "0"))
    try:
        # rank 1 asks for 1, 2, 3, 4 GiB: the 4 GiB of step 3 passes the 4.0 GiB budget (4.6 - 0.6)
        assert cap.wait(timeout=240) == 3, (tmp_path / "cap.err").read_text()
        [a.wait(timeout=30) for a in ags]
    finally:
        reap(cap, *ags)
    err = (tmp_path / "cap.err").read_text()
    assert "capture FAILED (oom)" in err and "rank 1 ran out of GPU memory in step 3" in err, err[-3000:]
    assert "against the --memory-limit allocator budget of 4.00 GiB" in err, err[-3000:]
    assert not forkservers(tmp_path)


# --- GPU swaps through agents (protocol 3) ---------------------------------------------

#: GPT tp2 x dp4 (world 8), tiny: two agents get 4 ranks (two TP groups) each.
GPT_W8_DP4 = ["-m", "prism.workloads.gpt", "--tp", "2", "--pp", "1", "--dp", "4", "--layers", "1", "--hidden", "16",
              "--heads", "2", "--seq-len", "8", "--steps", "2"]


@pytest.mark.slow
def test_two_agents_swap_their_ranks_as_one_machine_does(tmp_path, shared_captures):
    """``--resident 2 --simulate-swaps 0`` through two agents: each node's
    agent stops and continues its own ranks (one simulated GPU per node, 4
    ranks on it, 2 resident); the trace and losses equal a one-machine
    capture's with the same options, and the swaps are reported the same way."""
    swaps = ("--resident", "2", "--simulate-swaps", "0")
    text = capture_served(tmp_path, 8, GPT_W8_DP4, 2, *swaps)
    assert "ran ranks 0-3" in text and "ran ranks 4-7" in text, text
    assert "simulated on CPU, one per agent's node, 2 agents, gang tp]" in text, text
    for i in range(2):
        assert "swapping this node's ranks with the simulated driver" in (tmp_path / f"agent{i}.err").read_text()
    proc, plain = shared_captures.get(8, GPT_W8_DP4, *swaps)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = runfolder.read_run(tmp_path / "run"), runfolder.read_run(plain)
    assert not got.warnings and sorted(got.ranks) == sorted(want.ranks) == list(range(8))
    for r in range(8):
        assert timeless(got.ranks[r]) == timeless(want.ranks[r]), f"rank {r}"
        losses = harness.parse_losses(runfolder.log_path(tmp_path / "run", r).read_text())
        assert losses == harness.parse_losses(runfolder.log_path(plain, r).read_text()), f"rank {r}"
    docs = [json.loads(runfolder.swap_report_path(run).read_text()) for run in (tmp_path / "run", plain)]
    for doc in docs:
        s = doc["summary"]
        assert s["swaps_out"] > 0 and s["swaps_out"] == s["swaps_in"] and s["steps"] == 2, s
        assert doc["settings"]["simulated"]["driver"] == "SIGSTOP/SIGCONT"
        assert f"prism: {s['swaps']} swaps ({s['swaps_out']} out, {s['swaps_in']} in)" in (
            text if doc is docs[0] else proc.stderr)
    doc = docs[0]
    assert [a["ranks"] for a in doc["settings"]["agents"]] == ["0-3", "4-7"]
    pids = {r: next(e.pid for e in got.ranks[r] if isinstance(e, T.RankStart)) for r in range(8)}
    for rank in range(8):
        recs = [x for x in doc["records"] if x["rank"] == rank and x["status"] == "ok"]
        dirs = [x["direction"] for x in recs]
        assert dirs == ["out", "in"] * (len(dirs) // 2), (rank, dirs)  # every rank ends resident
        assert all(x["pid"] == pids[rank] for x in recs)
    # one machine-wide log, on the coordinator's clock (one host: offset 0), in the order of the swaps
    lines = [json.loads(x) for x in (tmp_path / "run" / "telemetry" / "swaps.jsonl").read_text().splitlines()]
    assert lines == doc["records"]
    starts = [x["t_start"] for x in lines]
    assert starts == sorted(starts) and abs(starts[0] - time.monotonic()) < 300
    assert not forkservers(tmp_path)


class _FakeAgent:
    """An agent's socket in a thread of its own: says hello, takes its
    Launch, beats (until ``silent``) and answers each Swap with ``reply(msg)``
    (None: no answer)."""

    def __init__(self, endpoint: str, node: str, node_rank: int, reply, driver_error: str = "") -> None:
        import threading

        import zmq

        self.node, self.node_rank, self.reply = node, node_rank, reply
        self.launch = None
        self.driver_error = driver_error
        self.swaps: list = []
        self.silent = threading.Event()
        self.stop = threading.Event()
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _send(self, msg) -> None:
        import orjson

        from prism.core import agents as A

        self.sock.send(orjson.dumps(A.encode(msg)))

    def _run(self) -> None:
        import orjson

        from prism.core import agents as A

        self._send(A.AgentHello(self.node, "h", 4, (), 100 + self.node_rank, node_rank=self.node_rank))
        last = 0.0
        while not self.stop.is_set():
            if self.sock.poll(20):
                msg = A.decode(orjson.loads(self.sock.recv()))
                if isinstance(msg, A.Launch):
                    self.launch = msg
                    self._send(A.Prepared({} if self.driver_error else {"driver": msg.swap.get("driver")},
                                          self.driver_error, stage="swaps"))
                elif isinstance(msg, A.Swap):
                    self.swaps.append(msg)
                    if not self.silent.is_set() and (answer := self.reply(msg)) is not None:
                        self._send(answer)
            if not self.silent.is_set() and time.monotonic() - last > 0.2:
                last = time.monotonic()
                self._send(A.AgentBeat(2))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.mark.slow  # over 2 s on the 2-core VM
def test_swaps_go_to_the_agent_that_runs_the_rank_and_failures_name_it(tmp_path):
    """The coordinator's side of protocol 3: ``AgentSwapper`` sends each swap
    to the agent running the rank and maps its answer onto the coordinator's
    clock (the rank's offset); an agent's error, or an agent lost while the
    coordinator waits, is a ``SwapError`` naming the agent, the rank and the
    direction, within the lost period (never a hang)."""
    from prism.core import agents as A
    from prism.shell.agent import AgentSwapper
    from prism.shell.swap import SwapError, SwapRecord

    procs = AgentProcesses(free_tcp_endpoint(), 2, 4, keys=None, insecure=True, lost_after_s=1.0)
    ok = lambda m: A.Swapped(m.token, "ok", 10.0, 0.5, 1 << 20)  # noqa: E731
    failing = lambda m: A.Swapped(m.token, error=f"swapping rank {m.rank} (pid {m.pid}) {m.direction} failed: boom")  # noqa: E731
    agents = [_FakeAgent(procs.endpoint, "n0", 0, failing), _FakeAgent(procs.endpoint, "n1", 1, ok)]
    try:
        procs.wait_agents(10)
        procs.place(2)
        procs.launch("tcp://h:1", tmp_path, ["-m", "x"], swap={"driver": "simulated", "delay_s": 0.0})
        deadline = time.monotonic() + 10
        while len(procs.swap_drivers) < 2:
            assert time.monotonic() < deadline, procs.swap_drivers
            time.sleep(0.02)
        assert [a.launch.swap for a in agents] == [{"driver": "simulated", "delay_s": 0.0}] * 2
        assert procs.swap_drivers == {"n0": {"driver": "simulated"}, "n1": {"driver": "simulated"}}
        swapper = AgentSwapper(procs, log=tmp_path / "swaps.jsonl")
        swapper.offset_of = lambda rank: 2_000_000_000 if rank >= 2 else 0  # node 1's clock is 2 s behind
        rec = swapper.swap_out(3, 4242, 1)
        assert rec == SwapRecord(3, 4242, "out", "ok", 12.0, 0.5, 1 << 20, 1)
        assert [(m.rank, m.pid, m.direction, m.step) for m in agents[1].swaps] == [(3, 4242, "out", 1)]
        assert agents[0].swaps == []
        with pytest.raises(SwapError, match=r"agent n0 \(host h, pid 100\) could not swap rank 1 in: swapping "
                                            r"rank 1 \(pid 7\) in failed: boom"):
            swapper.swap_in(1, 7, 1)
        agents[1].silent.set()  # node 1 dies while it swaps
        t0 = time.monotonic()
        with pytest.raises(SwapError, match=r"swapping rank 2 \(pid 9\) out at step 1 on agent n1 \(host h, pid 101, "
                                            r"ranks 2-3\) failed: the agent was lost before it answered"):
            swapper.swap_out(2, 9, 1)
        assert time.monotonic() - t0 < 5
        with pytest.raises(SwapError, match="rank 2 .* on agent n1 .* failed: the agent is lost"):
            swapper.swap_in(2, 9, 1)  # and at once afterwards
        swapper.close()
        assert [json.loads(x)["t_start"] for x in (tmp_path / "swaps.jsonl").read_text().splitlines()] == [12.0]
    finally:
        for a in agents:
            a.close()
        procs.close()


@pytest.mark.slow  # over 2 s on the 2-core VM
def test_a_swap_that_hangs_on_a_beating_node_stops_after_the_swap_timeout(tmp_path):
    """``prism capture --swap-timeout S``: a node that still beats but never
    answers a swap (its driver's call hangs) is a ``SwapError`` naming the
    node, the rank and the timeout after ``S`` seconds, not a wait of 600."""
    from prism.app.capture import CaptureConfig, plan_capture, setup_agent_swaps
    from prism.app.errors import UsageError
    from prism.shell.swap import SwapError

    cmd = ["-m", "prism.workloads.gpt", "--tp", "2", "--pp", "2", "--dp", "2"]
    with pytest.raises(UsageError, match="--swap-timeout 0: give the seconds one swap may take"):
        plan_capture(CaptureConfig(8, cmd, out=tmp_path / "run", agents=2, listen="tcp://127.0.0.1:1",
                                   insecure=True, resident=2, simulate_swaps=0.0, swap_timeout_s=0))
    plan = plan_capture(CaptureConfig(8, cmd, out=tmp_path / "run", agents=2, listen="tcp://127.0.0.1:1",
                                      insecure=True, resident=2, simulate_swaps=0.0, swap_timeout_s=1.0))
    procs = AgentProcesses(free_tcp_endpoint(), 2, 8, keys=None, insecure=True, lost_after_s=1.5)
    agents = [_FakeAgent(procs.endpoint, f"n{i}", i, lambda m: None) for i in range(2)]  # never answer
    try:
        procs.wait_agents(10)
        procs.place(2)
        setup_agent_swaps(plan.gpu, procs, tmp_path, timeout_s=1.0)
        procs.launch("tcp://h:1", tmp_path, ["-m", "x"], swap=plan.gpu.agent_swap)
        t0 = time.monotonic()
        with pytest.raises(SwapError, match=r"swapping rank 5 \(pid 5\) out at step 2 on agent n1 .* failed: no "
                                            r"answer within 1 s although the agent still beats"):
            plan.gpu.executor.swap_out(5, 5, 2)
        assert 0.9 < time.monotonic() - t0 < 5
        plan.gpu.executor.close()
    finally:
        for a in agents:
            a.close()
        procs.close()


@pytest.mark.slow  # over 2 s on the 2-core VM
def test_an_agent_whose_swap_driver_will_not_load_ends_the_run_swap_failed(tmp_path):
    """An agent that cannot load its swap driver (``Prepared`` "swaps" with an
    error) fails its ranks; the report names the node and the reason, and the
    run's status is "swap_failed", not "node_lost" (the node is alive)."""
    procs = AgentProcesses(free_tcp_endpoint(), 2, 4, keys=None, insecure=True, lost_after_s=5.0)
    ok = lambda m: None  # noqa: E731
    agents = [_FakeAgent(procs.endpoint, "n0", 0, ok),
              _FakeAgent(procs.endpoint, "n1", 1, ok, driver_error="no checkpoint API in driver 535")]
    try:
        procs.wait_agents(10)
        procs.place(2)
        procs.launch("tcp://h:1", tmp_path, ["-m", "x"], swap={"driver": "checkpoint"})
        deadline = time.monotonic() + 10
        while not procs.lost():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert "agent n1" in procs.lost() and "cannot swap them" in procs.lost() and "driver 535" in procs.lost()
        assert procs.lost_status() == "swap_failed"
        assert procs.poll()[2:] == [1, 1]
    finally:
        for a in agents:
            a.close()
        procs.close()


def test_an_agent_checks_its_swap_driver_and_swaps_in_a_worker_thread(monkeypatch):
    """The node's side of protocol 3: a driver that does not load is a
    ``Prepared`` error naming the node and what to do; a loaded one swaps in
    a worker thread whose answers (records, or the executor's error) wake
    the agent's loop; a swap of a rank not on the node, or one that exited,
    is refused with the reason."""
    import zmq

    from prism.core import agents as A
    from prism.shell import agent as G
    from prism.shell import swap

    sent: list = []
    ctx = zmq.Context.instance()

    def broken():
        raise swap.SwapError("the CUDA driver has no cuCheckpointProcessLock: GPU swapping needs driver 570 or newer")

    monkeypatch.setattr(swap, "CheckpointDriver", broken)
    assert G._prepare_swaps({"driver": "checkpoint"}, "gpu7#3", sent.append, lambda _: None, ctx) is None
    assert sent[-1].stage == "swaps" and sent[-1].error.startswith(
        "cannot swap ranks on node gpu7#3: the CUDA driver has no cuCheckpointProcessLock")
    assert "update that node's NVIDIA driver (570 or newer), or capture with --simulate-swaps" in sent[-1].error
    assert G._prepare_swaps({"driver": "nope"}, "n", sent.append, lambda _: None, ctx) is None
    assert "swap driver 'nope'" in sent[-1].error

    swaps = G._prepare_swaps({"driver": "simulated", "delay_s": 0.0}, "n", sent.append, lambda _: None, ctx)
    try:
        assert sent[-1] == A.Prepared({"driver": "simulated", "delay_s": 0.0, "checked_s": sent[-1].kernels["checked_s"]},
                                      stage="swaps")

        class Executor:
            def swap_out(self, rank, pid, step):
                return swap.SwapRecord(rank, pid, "out", "ok", 5.0, 0.25, 64, step)

            def swap_in(self, rank, pid, step):
                raise swap.SwapError(f"swapping rank {rank} (pid {pid}) in at step {step} failed: gone")

        swaps.executor = Executor()
        swaps.submit(A.Swap(1, 2, 42, "out", 0))
        swaps.submit(A.Swap(2, 2, 42, "in", 0))
        poller = zmq.Poller()
        poller.register(swaps.wake, zmq.POLLIN)
        got: list = []
        deadline = time.monotonic() + 10
        while len(got) < 2:
            assert time.monotonic() < deadline, got
            poller.poll(1000)
            got += swaps.answers()
        assert got == [A.Swapped(1, "ok", 5.0, 0.25, 64),
                       A.Swapped(2, error="swapping rank 2 (pid 42) in at step 0 failed: gone")]
        assert swaps.pending == 0
    finally:
        swaps.close()

    class Procs:
        def poll(self, rank):
            return {2: None, 3: -9}[rank]

    assert G._swap_refusal(A.Swap(1, 2, 42, "out"), [2, 3], Procs()) == ""
    assert "rank 5 does not run on this node (its ranks are 2-3)" in G._swap_refusal(A.Swap(1, 5, 1, "in"), [2, 3], Procs())
    assert G._swap_refusal(A.Swap(1, 3, 43, "in"), [2, 3], Procs()) == \
        "rank 3 (pid 43) already exited (status -9) when it was to be swapped in"


@pytest.mark.gpu(reason="the checkpoint driver swaps ranks through two agents sharing GPU 0")
def test_two_agents_checkpoint_their_ranks_on_gpus_as_one_machine_does(tmp_path, shared_captures):
    """``--resident 2`` of a CUDA capture through two agents (both offering
    GPU 0; the policy counts one GPU per node): each agent checkpoints its
    own ranks with the CUDA driver; the trace and losses equal a one-machine
    capture's with ``--gpus 0 --resident 2``, every swap is "ok" with the
    process's GPU memory, and every rank ends restored."""
    from prism.shell.swap import CheckpointDriver

    if not CheckpointDriver.available():
        pytest.skip("needs a CUDA driver with the checkpoint API (570 or newer)")
    cmd = [*GPT_W8_DP4, "--device", "cuda"]
    text = capture_served(tmp_path, 8, cmd, 2, "--resident", "2", agent_args=("--gpus", "0"), timeout=300)
    assert "on the agents' GPUs, 2 agents, gang tp]" in text, text
    assert "swapping this node's ranks with the checkpoint driver" in (tmp_path / "agent0.err").read_text()
    proc, plain = shared_captures.get(8, cmd, "--gpus", "0", "--resident", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = runfolder.read_run(tmp_path / "run"), runfolder.read_run(plain)
    assert not got.warnings and sorted(got.ranks) == sorted(want.ranks) == list(range(8))
    for r in range(8):
        assert timeless(got.ranks[r]) == timeless(want.ranks[r]), f"rank {r}"
        losses = harness.parse_losses(runfolder.log_path(tmp_path / "run", r).read_text())
        assert losses == harness.parse_losses(runfolder.log_path(plain, r).read_text()), f"rank {r}"
    doc = json.loads(runfolder.swap_report_path(tmp_path / "run").read_text())
    s = doc["summary"]
    assert s["swaps_out"] > 0 and s["swaps_out"] == s["swaps_in"], s
    ok = [x for x in doc["records"] if x["status"] == "ok"]
    assert ok and all(x["bytes"] > 0 for x in ok if x["direction"] == "out"), ok[:4]
    for rank in range(8):
        dirs = [x["direction"] for x in ok if x["rank"] == rank]
        assert dirs == ["out", "in"] * (len(dirs) // 2), (rank, dirs)
    assert not forkservers(tmp_path)
