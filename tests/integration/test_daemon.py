"""The job daemon end to end: ``python -m prism coordinator --daemon`` in the
background, jobs submitted from other processes, a SIGTERM and a restart;
a tcp daemon with CURVE keys that lets in only the client with the keys."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from prism.app import daemon as app_daemon
from prism.app import trace as app_trace

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def prism(*args: str, cwd: Path, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prism", *args], capture_output=True, text=True, cwd=cwd,
                          env=ENV, timeout=timeout)


def start_daemon(state: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """A daemon in the background and its endpoint, once it listens."""
    (state / "daemon.json").unlink(missing_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    with open(state.parent / f"{state.name}.stderr", "ab") as err:
        proc = subprocess.Popen([sys.executable, "-m", "prism", "coordinator", "--daemon", "--state", str(state),
                                 *args], stdout=subprocess.DEVNULL, stderr=err, env=ENV)
    deadline = time.monotonic() + 20
    while not (state / "daemon.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"the daemon did not start: {(state.parent / f'{state.name}.stderr').read_text()}")
        time.sleep(0.05)
    return proc, orjson.loads((state / "daemon.json").read_bytes())["endpoint"]


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def wait_all_ended(state: Path, n: int, timeout: float = 60) -> list[app_daemon.Job]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = app_daemon.jobs(daemon=str(state)).jobs
        if len(jobs) == n and all(j.state not in ("queued", "running") for j in jobs):
            return list(jobs)
        time.sleep(0.2)
    pytest.fail(f"jobs did not end within {timeout} s: {jobs}")


@pytest.mark.slow
def test_daemon_runs_captures_and_a_predict_in_order_and_keeps_them_across_sigterm_and_restart(tmp_path):
    state = tmp_path / "state"
    work = tmp_path / "work"
    work.mkdir()
    procs = []
    try:
        daemon, endpoint = start_daemon(state, "--slots", "2")
        procs.append(daemon)
        assert endpoint == f"ipc://{state}/daemon.sock"
        cap = ["capture", "-n", "2", "--slots", "2", "--progress", "off"]
        script = ["--", "-m", "prism.workloads.ddp_example", "--steps", "2", "--layers", "1"]
        # Submitted by other processes: the first through the command line, two from this test.
        r = prism("submit", "--daemon", str(state), "--json", "--", *cap, "--out", "c1", *script, cwd=work)
        assert r.returncode == 0, r.stderr
        assert orjson.loads(r.stdout)["state"] == "queued"
        app_daemon.submit([*cap, "--out", "c2", *script], daemon=endpoint, cwd=work)
        app_daemon.submit(["predict", "c1", "--warmup", "0"], after=["1"], daemon=endpoint, cwd=work)
        jobs = wait_all_ended(state, 3)
        r = prism("jobs", "--daemon", endpoint, "--json", cwd=work)
        assert r.returncode == 0, r.stderr
        listed = orjson.loads(r.stdout)
        assert [(j["id"], j["kind"], j["state"], j["exit_code"]) for j in listed["jobs"]] == [
            ("1", "capture", "done", 0), ("2", "capture", "done", 0), ("3", "predict", "done", 0)], \
            [app_daemon.logs(j.id, daemon=str(state)).text for j in jobs]
        assert listed["slots"] == 2 and listed["jobs"][0]["run_dir"] == str(work / "c1")
        # In order: each capture holds both slots; the predict waits for capture 1.
        by = {j.id: j for j in jobs}
        assert by["1"].ended_at <= by["2"].started_at and by["1"].ended_at <= by["3"].started_at
        assert (work / "c1" / "manifest.json").exists() and (work / "c2" / "manifest.json").exists()
        assert "predicted iteration time" in app_daemon.logs("3", daemon=str(state)).text
        text = prism("jobs", "--daemon", str(state), cwd=work).stdout
        assert "3 jobs; slots 0/2 busy" in text and "predict c1 --warmup 0" in text

        # A job running when the daemon gets SIGTERM: the capture stops itself (143, not killed),
        # its trace stays valid, nothing of it is left, and it is interrupted.
        sleeper = app_daemon.submit(["capture", "-n", "1", "--progress", "off", "--out", "sl", "--",
                                     str(ROOT / "tests/support/scripts/sleep_worker.py")], daemon=endpoint, cwd=work)
        deadline = time.monotonic() + 20
        while "grandchild" not in (log := app_daemon.logs(sleeper.id, daemon=endpoint).text):
            assert time.monotonic() < deadline, log
            time.sleep(0.1)
        grandchild = int(log.split("grandchild ")[1].split()[0])
        assert stop(daemon) == 0
        assert not (state / "daemon.sock").exists()
        daemon, _ = start_daemon(state, "--slots", "2")
        procs.append(daemon)
        again = app_daemon.jobs(daemon=str(state)).jobs
        assert [(j.id, j.state) for j in again] == [("1", "done"), ("2", "done"), ("3", "done"), ("4", "interrupted")]
        assert again[3].exit_code == 143 and "the daemon stopped while it ran" in again[3].message
        check = app_trace.validate(app_trace.read(work / "sl"))
        assert check.ok, check.text()
        assert not Path(f"/proc/{grandchild}").exists() or Path(f"/proc/{grandchild}/stat").read_text().split()[2] == "Z"
        assert stop(daemon) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_a_request_outlasts_handshakes_cut_while_the_daemon_restarts(tmp_path):
    """Something that closes the connection mid-handshake (a daemon
    restarting on its port) cuts the client's CURVE handshake without detail;
    the request waits on through two such cuts and reaches the daemon that
    binds the port next, rather than blaming the keys."""
    import socket
    import threading

    keys = tmp_path / "keys"
    app_daemon.make_keys(keys)
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", 0))
    ls.listen()
    port = ls.getsockname()[1]
    cuts = []

    def cut_twice_then_leave() -> None:
        for _ in range(2):
            conn, _ = ls.accept()
            time.sleep(0.05)
            conn.close()
            cuts.append(time.monotonic())
        ls.close()

    t = threading.Thread(target=cut_twice_then_leave, daemon=True)
    t.start()
    answer: dict = {}

    def ask() -> None:
        try:
            answer["jobs"] = app_daemon.jobs(daemon=f"tcp://127.0.0.1:{port}", keys=keys, timeout_s=30).jobs
        except Exception as e:  # noqa: BLE001 (the assertion below shows it)
            answer["error"] = e

    client = threading.Thread(target=ask, daemon=True)
    client.start()
    t.join(timeout=20)
    assert len(cuts) == 2
    daemon, _ = start_daemon(tmp_path / "s", "--listen", f"tcp://127.0.0.1:{port}", "--keys", str(keys))
    try:
        client.join(timeout=30)
        assert answer == {"jobs": ()}, answer
    finally:
        assert stop(daemon) == 0


@pytest.mark.slow  # over 2 s on the 2-core VM
def test_a_tcp_daemon_with_keys_lets_in_only_clients_with_keys(tmp_path):
    keys, other = tmp_path / "keys", tmp_path / "other"
    r = prism("keys", str(keys), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in keys.iterdir() if p.is_file()} == {
        "server.key": "0o600", "server.key_secret": "0o600", "client.key": "0o600", "client.key_secret": "0o600"}
    app_daemon.make_keys(other)
    # Without keys, listening beyond loopback is refused in one line (both coordinators).
    for argv in (["coordinator", "--daemon", "--state", str(tmp_path / "s0"), "--listen", "tcp://0.0.0.0:0"],
                 ["coordinator", "--listen", "tcp://0.0.0.0:0", "-n", "2", "--out", str(tmp_path / "r")]):
        r = prism(*argv, cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith("prism coordinator: error: refusing to listen on tcp://0.0.0.0:0")
        assert len(r.stderr.strip().splitlines()) == 1
    daemon, endpoint = start_daemon(tmp_path / "s1", "--listen", "tcp://0.0.0.0:*", "--keys", str(keys))
    try:
        port = endpoint.rsplit(":", 1)[1]
        here = f"tcp://127.0.0.1:{port}"
        assert app_daemon.jobs(daemon=here, keys=keys).jobs == ()
        with pytest.raises(app_daemon.DaemonError, match=rf"the daemon at {here} requires CURVE keys: pass --keys"):
            app_daemon.jobs(daemon=here, timeout_s=5)
        r = prism("jobs", "--daemon", here, cwd=tmp_path)
        assert r.returncode == 1 and "requires CURVE keys" in r.stderr and "Traceback" not in r.stderr
        # The wrong server key: every handshake is cut, and after the third the keys are named.
        t0 = time.monotonic()
        with pytest.raises(app_daemon.DaemonError, match=r"the CURVE handshake with the daemon at .* failed: .*server\.key"):
            app_daemon.jobs(daemon=here, keys=other, timeout_s=10)
        assert time.monotonic() - t0 < 5
        # Another client key, the right server key: refused by name.
        shutil.copy(keys / "server.key", other / "server.key")
        with pytest.raises(app_daemon.DaemonError, match="refused your key"):
            app_daemon.jobs(daemon=here, keys=other, timeout_s=5)
    finally:
        assert stop(daemon) == 0
