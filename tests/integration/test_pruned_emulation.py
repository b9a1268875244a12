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

from tests.support.full import FULL

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


def _capture(tmp_path: Path, script: list[str], *extra: str) -> Path:
    run = tmp_path / "run"
    p = _prism("capture", "-n", "4", *extra, "--out", str(run), "--progress", "off", "--show-ranks", "none", "--",
               *script, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    return run


def _emulate(run: Path, name: str, *extra: str) -> tuple[dict, str]:
    """The emulation's summary (its summary.json) and what it printed."""
    p = _prism("emulate", str(run), "--sandbox", "0,1", "--name", name, "--progress", "off", *extra, cwd=run.parent)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((run / "emulation" / name / "summary.json").read_text()), p.stdout


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(float(a[k]) - float(b[k])) <= 1e-5 * abs(float(a[k])) for k in a)


def test_sandbox_members_reduce_among_themselves_with_the_host_paths_result(tmp_path: Path):
    run = _capture(tmp_path, GPT, "--record", "0,1")
    got = {"host": _emulate(run, "host", "--no-recording")[0]}
    got["pruned"], text = _emulate(run, "pruned", "--no-recording", "--pruned")
    host, pr = got["host"]["calls"], got["pruned"]["calls"]
    # every TP all_reduce of the group {0, 1, 2, 3} holds both sandboxes: each is pruned, none staged
    assert host["pruned"] == 0 and host["compensated"] > 0
    assert pr["pruned"] == host["compensated"] and pr["compensated"] == 0
    assert "run by the sandbox members among themselves" in text
    assert list((run / "emulation" / "pruned" / "pruned").iterdir())  # the members' file store: a real communicator
    # k = 2 of N = 4, SUM: the members' sum times 2, where the host path sums the two inputs and the folded
    # one in gloo's ring order: the same up to rounding (a missing or wrong fold would move the loss by far more)
    losses = {n: got[n]["ranks"]["0"]["losses"] for n in got}
    assert losses["host"] and _close(losses["host"], losses["pruned"]), losses
    # with the recording: each call still run by the members for real, its inputs' digests as recorded, so
    # the recorded outputs replace theirs and the losses are the capture's bit for bit
    s, _ = _emulate(run, "rec", "--pruned")
    assert s["calls"]["pruned"] == s["calls"]["recorded"] == pr["pruned"] and s["calls"]["compensated"] == 0
    assert s["ranks"]["0"]["losses_equal"] is True


@FULL  # covered by tests/unit/test_pruned.py::test_two_members_of_an_unsorted_group_get_the_host_paths_result
def test_fsdp2_all_gathers_and_reduce_scatters_are_pruned(tmp_path: Path):
    run = _capture(tmp_path, FSDP2)
    got = {name: _emulate(run, name, "--no-recording", *extra)[0] for name, extra in (("host", ()),
                                                                                     ("pruned", ("--pruned",)))}
    host, pr = got["host"]["calls"], got["pruned"]["calls"]
    assert pr["pruned"] == host["compensated"] > 0 and pr["compensated"] == 0  # every call of the world group
    losses = {n: got[n]["ranks"]["0"]["losses"] for n in got}
    assert len(losses["host"]) == 3 and _close(losses["host"], losses["pruned"]), losses
