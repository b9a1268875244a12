"""The launcher and bootstrap: torchrun's environment, any backend the script
asks for becomes Prism, SCRIPT and -m MODULE, failures, console output, kill."""

from __future__ import annotations

import json
import os
import tempfile
import time

import pytest

from prism.shell.launcher import launch_ranks
from tests.support.rank_harness import FAKE_ENV, SCRIPTS, log, run_world

pytestmark = pytest.mark.slow


def test_torchrun_environment_and_forced_backend(tmp_path):
    world = 4
    codes, fc = run_world(tmp_path, world, [str(SCRIPTS / "env_worker.py"), str(tmp_path)], nproc_per_node=3,
                          env={"TORCHELASTIC_RUN_ID": "ignored"})
    assert codes == [0] * world, [log(tmp_path, r) for r in range(world)]
    recs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(world)]
    ports = {rec["env"]["MASTER_PORT"] for rec in recs}
    assert len(ports) == 1 and ports.pop().isdigit()
    for r, rec in enumerate(recs):
        env = rec["env"]
        assert env["RANK"] == str(r) and env["WORLD_SIZE"] == str(world)
        assert env["LOCAL_RANK"] == str(r % 3)
        assert env["LOCAL_WORLD_SIZE"] == ("3" if r < 3 else "1")
        assert env["GROUP_RANK"] == env["NODE_RANK"] == str(r // 3)
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["TORCHELASTIC_RUN_ID"] == tmp_path.name
        assert env["OMP_NUM_THREADS"] == "1" and rec["threads"] == 1
        assert env["PRISM_COORDINATOR"] == fc.endpoint
        # "nccl", None, "cpu:gloo,cuda:nccl" and "gloo" all became Prism.
        assert rec["backend"] == "prism"
        assert rec["sum"] == world
        assert rec["argv"] == [str(SCRIPTS / "env_worker.py"), str(tmp_path)]
    assert recs[0]["child_patched"] == "True"
    assert all(g.status == "ok" for g in fc.goodbyes.values())


def test_user_thread_count_is_kept(tmp_path):
    codes, _ = run_world(tmp_path, 1, [str(SCRIPTS / "env_worker.py"), str(tmp_path)],
                         env={"OMP_NUM_THREADS": "2"})
    assert codes == [0]
    rec = json.loads((tmp_path / "env0.json").read_text())
    assert rec["env"]["OMP_NUM_THREADS"] == "2" and rec["threads"] == 2


def test_pinned_ranks_each_get_one_cpu(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    codes, _ = run_world(tmp_path, 2, [str(SCRIPTS / "env_worker.py"), str(tmp_path)], env={"PRISM_PIN_CPUS": "1"})
    assert codes == [0, 0]
    got = [json.loads((tmp_path / f"env{r}.json").read_text())["cpus"] for r in range(2)]
    assert got == [[cpus[0]], [cpus[1 % len(cpus)]]]


def test_module_and_device_mesh(tmp_path):
    codes, fc = run_world(tmp_path, 4, ["-m", "mesh_module", str(tmp_path)], cwd=SCRIPTS)
    assert codes == [0] * 4, [log(tmp_path, r) for r in range(4)]
    for r in range(4):
        rec = json.loads((tmp_path / f"mesh{r}.json").read_text())
        assert rec["backend"] == "prism" and rec["name"] == "__main__"
        assert rec["argv0"].endswith("mesh_module.py")
        # rank = dp * 2 + tp: dp groups {tp, tp + 2}, tp groups {2dp, 2dp + 1}
        assert rec["sums"] == {"dp": float(2 * (r % 2) + 2), "tp": float(4 * (r // 2) + 1)}
    # WORLD, then dp groups {0,2} {1,3} and tp groups {0,1} {2,3} in creation order.
    assert {(g.index, g.ranks) for g in fc.group_msgs} == {
        (0, (0, 1, 2, 3)), (1, (0, 2)), (2, (1, 3)), (3, (0, 1)), (4, (2, 3))}


def test_failures_logs_and_console(tmp_path, capfd):
    codes, fc = run_world(tmp_path, 3, [str(SCRIPTS / "crash_worker.py")])
    assert codes == [0, 1, 3]
    assert "ValueError: boom from rank 1" in log(tmp_path, 1)
    assert "Traceback" in log(tmp_path, 1)
    assert fc.goodbyes[0].status == "ok"
    assert fc.goodbyes[1].status == "error" and "ValueError: boom from rank 1" in fc.goodbyes[1].message
    assert fc.goodbyes[2].status == "error" and "status 3" in fc.goodbyes[2].message
    err = capfd.readouterr().err
    # Rank 0 is shown live; failing ranks show their log's tail; all prefixed.
    assert "[rank 0] line 2 from rank 0" in err
    assert "[rank 1] ValueError: boom from rank 1" in err
    assert "[rank 2] line 0 from rank 2" in err
    for r in range(3):
        assert f"line 1 from rank {r}\n" in log(tmp_path, r)


def test_show_all_ranks(tmp_path, capfd):
    codes, _ = run_world(tmp_path, 2, [str(SCRIPTS / "env_worker.py"), str(tmp_path)], show_ranks="all")
    assert codes == [0, 0]
    err = capfd.readouterr().err
    assert "[rank 0] rank 0 done" in err and "[rank 1] rank 1 done" in err


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie awaiting its parent counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def test_kill_all_leaves_no_orphans(tmp_path):
    from tests.support.fake_coordinator import FakeCoordinator

    fc = FakeCoordinator(str(tmp_path / "coord.sock"), 2)
    procs = launch_ranks(2, fc.endpoint, tmp_path, [str(SCRIPTS / "sleep_worker.py")], env=FAKE_ENV)
    try:
        assert procs.wait_started(timeout=60)
        deadline = time.monotonic() + 60
        grandchildren: list[int] = []
        while len(grandchildren) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            grandchildren = [int(line.split()[1]) for r in range(2) for line in log(tmp_path, r).splitlines()
                             if line.startswith("grandchild ")]
        assert len(grandchildren) == 2
        assert procs.poll() == [None, None]
        procs.kill_all()
        assert procs.wait(timeout=30) == [-9, -9]
        time.sleep(0.2)
        assert not any(_alive(p) for p in [*procs.pids, *grandchildren])
    finally:
        procs.close()
        fc.close()


def test_coordinator_error_fails_the_call(tmp_path):
    codes, fc = run_world(tmp_path, 2, [str(SCRIPTS / "mismatch_worker.py")])
    assert codes == [1, 1]
    for r in range(2):
        text = log(tmp_path, r)
        assert "PrismRankError" in text and "ranks called different collectives" in text
        assert fc.goodbyes[r].status == "error"


def test_unsupported_call_is_named(tmp_path):
    codes, fc = run_world(tmp_path, 1, [str(SCRIPTS / "unsupported_worker.py")])
    assert codes == [1]
    assert "Prism does not support recv from any source" in log(tmp_path, 0)


def test_ranks_inherit_the_launching_environment(tmp_path, monkeypatch):
    # An empty CUDA_VISIBLE_DEVICES hides the GPUs, as under torchrun; losing
    # it handed a one-GPU machine's GPU to every rank.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("PRISM_TEST_MARKER", "kept")
    script = tmp_path / "env.py"
    script.write_text("import os\nprint(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), os.environ.get('PRISM_TEST_MARKER'))\n")
    procs = launch_ranks(2, None, tmp_path, [str(script)], show_ranks=())
    try:
        assert procs.wait() == [0, 0]
    finally:
        procs.close()
    for r in range(2):
        assert "'' kept" in log(tmp_path, r)


def test_a_launcher_gone_at_once_takes_its_ranks_along(tmp_path, monkeypatch):
    # The launcher (an agent killed as its Launch came) dies before the fork
    # server has forked: EOF waits on its stdin and the kill comes as soon
    # as the children exist. A child slow to make its process group (here a
    # fork hook that sleeps; on a loaded node, torch's own) must not escape it.
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("import os, time\nos.register_at_fork(after_in_child=lambda: time.sleep(0.5))\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p))
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    procs = launch_ranks(1, None, tmp_path, [str(script)], show_ranks=())
    try:
        procs._server.stdin.close()
        assert procs.wait(timeout=20) == [-9]
    finally:
        procs.close()


def test_a_rank_profile_is_written_where_prism_profile_rank_says(tmp_path):
    # A diagnostic (PRISM_PROFILE_RANK): each rank's main thread under
    # cProfile, written as it leaves through the fork server's os._exit.
    import pstats

    prof = tmp_path / "prof"
    codes, _ = run_world(tmp_path, 2, [str(SCRIPTS / "env_worker.py"), str(tmp_path)],
                         env={"PRISM_PROFILE_RANK": str(prof)})
    assert codes == [0, 0]
    for r in range(2):
        stats = pstats.Stats(str(prof / f"rank-{r}.prof"))
        assert any(fn[2] == "child_main" for fn in stats.stats), sorted(stats.stats)[:5]


def test_a_prestarted_fork_server_serves_the_next_launch_of_the_same_environment(tmp_path, monkeypatch):
    # ``python -m prism capture`` starts its fork server before parsing its
    # arguments; the launch takes it only where the environment and working
    # directory are still those it was started with: a server started before
    # a change would give the ranks a stale environment.
    from prism.rank.envnames import ZYGOTE_ENV
    from prism.shell import launcher

    monkeypatch.delenv(ZYGOTE_ENV, raising=False)  # the session's warm fork server would serve it
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "env.py"
    script.write_text("import os\nprint('marker', os.environ.get('PRISM_TEST_MARKER'))\n")
    launcher.prestart_forkserver()
    early = launcher._early[0]
    procs = launch_ranks(2, None, tmp_path / "a", [str(script)], show_ranks=())
    try:
        assert procs.wait() == [0, 0]
    finally:
        procs.close()
    assert procs._server is early and launcher._early is None
    assert "marker None" in log(tmp_path / "a", 0)

    launcher.prestart_forkserver()
    stale = launcher._early[0]
    monkeypatch.setenv("PRISM_TEST_MARKER", "changed")
    procs = launch_ranks(2, None, tmp_path / "b", [str(script)], show_ranks=())
    try:
        assert procs.wait() == [0, 0]
    finally:
        procs.close()
    assert procs._server is not stale and stale.poll() is not None  # killed, not left behind
    assert "marker changed" in log(tmp_path / "b", 1)

    launcher.prestart_forkserver()
    unused = launcher._early[0]
    launcher.discard_prestarted()
    assert unused.poll() is not None and launcher._early is None


def _served_by_zygote(n: int, folder, script, codes: list[int], **kw) -> None:
    """Launch ``script`` as ``n`` ranks into ``folder``: they exit with ``codes``
    and their fork server came from the warm zygote."""
    from prism.shell import launcher

    procs = launch_ranks(n, None, folder, [str(script)], **kw)
    try:
        assert procs.wait(timeout=60) == codes
    finally:
        procs.close()
    assert isinstance(procs._server, launcher._ZygoteServer)


def test_a_zygote_forks_each_launchs_fork_server_and_refuses_a_changed_environment(tmp_path, monkeypatch, capfd):
    # The warm fork server the test session runs (and a daemon could): a
    # launch's fork server forked from it gets the launch's pipes, stderr,
    # working directory and PRISM_* variables; any other change of the
    # environment (read when torch was imported) gets a fresh fork server.
    from prism.rank.envnames import ZYGOTE_ENV
    from prism.shell import launcher

    folder = tempfile.mkdtemp(prefix="pz-")
    path, zlog = os.path.join(folder, "sock"), tmp_path / "zygote.log"
    monkeypatch.setenv("PRISM_FORKSERVER_ZYGOTE_LOG", str(zlog))
    zygote = launcher.start_zygote(path)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        monkeypatch.setenv(ZYGOTE_ENV, path)
        monkeypatch.setenv("PRISM_TEST_MARKER", "served")
        script = tmp_path / "env.py"
        script.write_text("import os, sys\nprint('marker', os.environ.get('PRISM_TEST_MARKER'), os.environ.get('TEST_OTHER'),"
                          " os.getcwd())\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
        _served_by_zygote(2, tmp_path / "a", script, [0, 3], show_ranks=(0,), cwd=tmp_path)
        assert f"marker served None {tmp_path}" in log(tmp_path / "a", 1)
        err = capfd.readouterr().err
        assert f"[rank 0] marker served None {tmp_path}" in err  # the launcher's stderr
        assert "[rank 1] exited with status 3" in err

        # Killed ranks, and a launcher gone at once: as with a fresh fork server.
        sleeper = tmp_path / "sleep.py"
        sleeper.write_text("import time\ntime.sleep(60)\n")
        procs = launch_ranks(2, None, tmp_path / "b", [str(sleeper)], show_ranks=())
        try:
            assert procs.wait_started(timeout=30)
            procs.kill_all()
            assert procs.wait(timeout=30) == [-9, -9]
        finally:
            procs.close()
        procs = launch_ranks(1, None, tmp_path / "c", [str(sleeper)], show_ranks=())
        try:
            procs._server.stdin.close()
            assert procs.wait(timeout=20) == [-9]
        finally:
            procs.close()
        assert not _alive(procs._server.pid)

        monkeypatch.setenv("TEST_OTHER", "changed")
        procs = launch_ranks(2, None, tmp_path / "d", [str(script)], show_ranks=(), cwd=tmp_path)
        try:
            assert procs.wait(timeout=60) == [0, 3]
        finally:
            procs.close()
        assert not isinstance(procs._server, launcher._ZygoteServer)
        assert "marker served changed" in log(tmp_path / "d", 0)
        with monkeypatch.context() as m:  # a launcher of another interpreter (a venv's, a system's)
            m.setattr(launcher.sys, "executable", "/opt/other/python3")
            assert launcher._from_zygote(launcher._server_env(), str(tmp_path)) is None
        refusals = zlog.read_text().splitlines()[3:]
        assert refusals[0] == "refused: the environment differs in TEST_OTHER"
        assert refusals[1].startswith("refused: another interpreter (/opt/other/python3, this one ")
        assert zlog.read_text().splitlines()[:3] == ["served"] * 3
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # garbage: refused, the zygote serves on
            s.connect(path)
            s.sendall(b"not json\n")
            assert s.recv(100) == b""
        assert zlog.read_text().splitlines()[5].startswith("bad request: ")
        monkeypatch.delenv("TEST_OTHER")
        _served_by_zygote(1, tmp_path / "f", script, [0], show_ranks=())
    finally:
        zygote.stdin.close()
        assert zygote.wait(timeout=30) == 0
    assert not os.path.exists(path)  # and a launch now starts a fresh fork server
    os.rmdir(folder)
    procs = launch_ranks(1, None, tmp_path / "e", [str(script)], show_ranks=())
    try:
        assert procs.wait(timeout=60) == [0]
    finally:
        procs.close()
    assert not isinstance(procs._server, launcher._ZygoteServer)


def test_warm_forkserver_serves_its_block_and_its_children_and_then_goes(tmp_path, monkeypatch):
    # What a daemon, a campaign and a multi-run agent wrap their work in.
    import subprocess
    import sys

    from prism.rank.envnames import ZYGOTE_ENV
    from prism.shell import launcher

    monkeypatch.delenv(ZYGOTE_ENV, raising=False)
    monkeypatch.setenv("PRISM_WARM_FORKSERVER", "0")
    with launcher.warm_forkserver() as path:
        assert path is None and ZYGOTE_ENV not in os.environ
    monkeypatch.delenv("PRISM_WARM_FORKSERVER")

    def no_tmp(*_a, **_k):
        raise PermissionError("no writable temporary folder")

    with monkeypatch.context() as m:  # no room for its socket: launches start their own, nothing fails
        m.setattr(launcher.tempfile, "mkdtemp", no_tmp)
        with launcher.warm_forkserver() as path:
            assert path is None and ZYGOTE_ENV not in os.environ
    script = tmp_path / "ok.py"
    script.write_text("print('ok')\n")
    with launcher.warm_forkserver() as path:
        assert path is not None and os.environ[ZYGOTE_ENV] == path
        with launcher.warm_forkserver() as inner:  # nested: the outer one serves
            assert inner is None
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        _served_by_zygote(1, tmp_path / "a", script, [0], show_ranks=())
        seen = subprocess.run([sys.executable, "-c", f"import os; print(os.environ['{ZYGOTE_ENV}'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        assert seen == path
        zygotes = subprocess.run(["pgrep", "-f", f"forkserver --zygote {path}"], capture_output=True, text=True).stdout.split()
        assert len(zygotes) == 1
    assert ZYGOTE_ENV not in os.environ and not os.path.exists(os.path.dirname(path))
    assert not _alive(int(zygotes[0]))
