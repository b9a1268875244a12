"""``prism emulate --pruned``: two sandbox ranks of one tensor-parallel group
run its all_reduces among themselves for real (gloo), the virtual members'
part folded in; their losses are the host path's (the coordinator computing
the same compensated values) up to rounding, on real processes and sockets:
the bundled GPT's TP all_reduces and an FSDP2 script's all_gathers and
reduce_scatters."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FSDP2 = [str(Path(__file__).resolve().parents[2] / "prism/workloads/frameworks/fsdp2.py"), "--dim", "32", "--hidden",
         "64", "--layers", "2", "--batch", "16", "--steps", "3"]

ROOT = Path(__file__).resolve().parents[2]
GPT = ["-m", "prism.workloads.gpt", "--tp", "4", "--layers", "2", "--hidden", "32", "--heads", "4",
       "--seq-len", "16", "--steps", "3"]

pytestmark = pytest.mark.slow


def _prism(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.run([sys.executable, "-m", "prism", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)


def _both(tmp_path: Path, script: list[str]) -> tuple[Path, dict]:
    run = tmp_path / "run"
    p = _prism("capture", "-n", "4", "--out", str(run), "--progress", "off", "--show-ranks", "none", "--", *script,
               cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    got = {}
    for name, extra in (("host", []), ("pruned", ["--pruned"])):
        p = _prism("emulate", str(run), "--sandbox", "0,1", "--no-recording", "--name", name, "--progress", "off",
                   "--json", *extra, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        got[name] = json.loads(p.stdout)
    return run, got


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(float(a[k]) - float(b[k])) <= 1e-5 * abs(float(a[k])) for k in a)


def test_sandbox_members_reduce_among_themselves_with_the_host_paths_result(tmp_path: Path):
    run, got = _both(tmp_path, GPT)
    host, pr = got["host"]["calls"], got["pruned"]["calls"]
    # every TP all_reduce of the group {0, 1, 2, 3} holds both sandboxes: each is pruned, none staged
    assert host["pruned"] == 0 and host["compensated"] > 0
    assert pr["pruned"] == host["compensated"] and pr["compensated"] == 0
    assert list((run / "emulation" / "pruned" / "pruned").iterdir())  # the members' file store: a real communicator
    # k = 2 of N = 4, SUM: the members' sum times 2, where the host path sums the two inputs and the folded
    # one in gloo's ring order: the same up to rounding (a missing or wrong fold would move the loss by far more)
    losses = {n: got[n]["ranks"]["0"]["losses"] for n in got}
    assert losses["host"] and _close(losses["host"], losses["pruned"]), losses
    assert "among themselves" in _prism("emulate", str(run), "--sandbox", "0,1", "--no-recording", "--pruned",
                                        "--name", "text", "--progress", "off", cwd=tmp_path).stdout


def test_with_a_recording_the_members_traffic_is_real_and_their_losses_the_captures(tmp_path: Path):
    run = tmp_path / "run"
    p = _prism("capture", "-n", "4", "--record", "0,1", "--out", str(run), "--progress", "off", "--show-ranks",
               "none", "--", *GPT, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    p = _prism("emulate", str(run), "--sandbox", "0,1", "--pruned", "--name", "rec", "--progress", "off", "--json",
               cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)
    # each call run by the members for real, its inputs' digests as recorded, so the recorded outputs replace theirs
    assert s["calls"]["pruned"] == s["calls"]["recorded"] > 0 and s["calls"]["compensated"] == 0
    assert s["ranks"]["0"]["losses_equal"] is True  # bit for bit


def test_fsdp2_all_gathers_and_reduce_scatters_are_pruned(tmp_path: Path):
    _, got = _both(tmp_path, FSDP2)
    host, pr = got["host"]["calls"], got["pruned"]["calls"]
    assert pr["pruned"] == host["compensated"] > 0 and pr["compensated"] == 0  # every call of the world group
    losses = {n: got[n]["ranks"]["0"]["losses"] for n in got}
    assert len(losses["host"]) == 3 and _close(losses["host"], losses["pruned"]), losses
