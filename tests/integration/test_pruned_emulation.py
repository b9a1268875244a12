"""``prism emulate --pruned``: two sandbox ranks of one tensor-parallel group
run its all_reduces among themselves for real (gloo), the virtual members'
part folded in; their losses equal the host path's (the coordinator
computing the same compensated sums), on real processes and sockets."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPT = ["-m", "prism.workloads.gpt", "--tp", "4", "--layers", "2", "--hidden", "32", "--heads", "4",
       "--seq-len", "16", "--steps", "3"]

pytestmark = pytest.mark.slow


def _prism(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.run([sys.executable, "-m", "prism", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)


def test_sandbox_members_reduce_among_themselves_with_the_host_paths_result(tmp_path: Path):
    run = tmp_path / "run"
    p = _prism("capture", "-n", "4", "--out", str(run), "--progress", "off", "--show-ranks", "none", "--", *GPT,
               cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    got = {}
    for name, extra in (("host", []), ("pruned", ["--pruned"])):
        p = _prism("emulate", str(run), "--sandbox", "0,1", "--no-recording", "--name", name, "--progress", "off",
                   "--json", *extra, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        got[name] = json.loads(p.stdout)
    host, pr = got["host"]["calls"], got["pruned"]["calls"]
    # every TP all_reduce of the group {0, 1, 2, 3} holds both sandboxes: each is pruned, none staged
    assert host["pruned"] == 0 and host["compensated"] > 0
    assert pr["pruned"] == host["compensated"] and pr["compensated"] == 0
    assert list((run / "emulation" / "pruned" / "pruned").iterdir())  # the members' file store: a real communicator
    # k = 2 of N = 4, SUM: the members' sum times 2 is the host path's float64 fold rounded once, bit for bit
    losses = {n: got[n]["ranks"]["0"]["losses"] for n in got}
    assert losses["host"] and losses["pruned"] == losses["host"]
    assert "among themselves" in _prism("emulate", str(run), "--sandbox", "0,1", "--no-recording", "--pruned",
                                        "--name", "text", "--progress", "off", cwd=tmp_path).stdout
