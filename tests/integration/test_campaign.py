"""``prism campaign`` end to end: a 12-point campaign (2 layouts x 3 DP sizes
x 2 profiles, predict) is killed midway, rerun, and resumes without redoing
the points it had finished."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CAMPAIGN = """
[campaign]
name = "resume"
warmup = 1

[capture]
command = ["-m", "prism.workloads.gpt", "--layers", "2", "--hidden", "16", "--heads", "2",
           "--seq-len", "8", "--steps", "3"]
layout = ["tp=2,pp=1,dp=2", "tp=1,pp=2,dp=2"]

[model]
scale_dp = [2, 4, 8]
net = ["h200_nvlink_ib400", "zero"]
"""


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


@pytest.mark.slow
@pytest.mark.integration
def test_campaign_killed_midway_resumes_without_redoing_points(tmp_path):
    toml = tmp_path / "sweep.toml"
    toml.write_text(CAMPAIGN)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "prism", "campaign", str(toml), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = out / "points.jsonl"
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(_rows(log)) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the campaign and the capture it runs: its own session
        proc.communicate(timeout=30)
    first = {r["key"]: r for r in _rows(log)}
    # the second layout's capture takes seconds, so the kill lands before the last points
    assert 3 <= len(first) < 12, f"{len(first)} rows before the kill"

    rerun = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    rows = _rows(log)
    keys = [r["key"] for r in rows]
    assert len(keys) == 12 and len(set(keys)) == 12  # every point once: none redone
    for r in rows:
        if r["key"] in first:
            assert r["started_utc"] == first[r["key"]]["started_utc"]
    assert rerun.stderr.count("skipped, done at") == len(first)
    table = json.loads((out / "results.json").read_text())
    assert [r["index"] for r in table] == list(range(12))
    assert all(r["status"] == "ok" and r["iteration_ms"] > 0 for r in table)
    assert {r["world_size"] for r in table} == {4, 8, 16}  # scale_dp 2, 4, 8 of a tp*pp = 2 layout
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert len(csv_lines) == 13 and csv_lines[0].startswith("index,key,step,status,layout,scale_dp,net")
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a zero-cost network is never slower than the H200 profile at the same layout and DP size
    by = {(r["dims"]["layout"], r["dims"]["scale_dp"], r["dims"]["net"]): r["iteration_ms"] for r in table}
    for (lay, dp, net), ms in by.items():
        if net == "zero":
            assert ms <= by[(lay, dp, "h200_nvlink_ib400")] + 1e-9
