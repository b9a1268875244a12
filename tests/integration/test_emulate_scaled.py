"""``prism emulate --scale-dp``: the bundled GPT captured at world 8 (tp2 pp2
dp2, the session's shared capture) emulated at world 32 (dp 8) with two
sandbox ranks launched at that world size: rank 16 (the last stage's dp-0
tp-0 rank, which prints the losses) and rank 0 (its pipeline peer, so the
two exchange activations for real). What must hold: it completes, the
sandboxes' groups are the scaled graph's, the replicas without a sandbox
are folded, and rank 16's losses are reported beside those of the captured
rank it copies (rank 4).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.captures import GPT_W8_SMALL, RECORD_045
from tests.support.full import FULL

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, shared_captures) -> Path:
    return shared_captures.copy(tmp_path_factory.mktemp("scaled") / "gpt", 8, GPT_W8_SMALL, *RECORD_045)


def test_a_scaled_emulation_runs_the_sandbox_at_the_full_world(gpt_run):
    proc = subprocess.run([sys.executable, "-m", "prism", "emulate", str(gpt_run), "--sandbox", "0,16",
                           "--scale-dp", "8", "--name", "dp8", "--progress", "off", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=gpt_run.parent,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    s = json.loads(proc.stdout)
    assert s["status"] == "ok" and s["world_size"] == 32
    assert s["scaled"]["to_dp"] == 8 and s["scaled"]["captured_world"] == 8 and s["scaled"]["command_dp_flag"]
    assert "--dp" in s["command"] and s["command"][s["command"].index("--dp") + 1] == "8"
    assert s["recording"].startswith("not used")
    # WORLD and each sandbox's TP, DP and pipeline groups (one pipeline group holds both): 6, all the graph's
    assert s["groups"]["instantiated"] == 6 and s["groups"]["with_sandbox"] >= 6
    assert s["folded"] > 0 and s["stepped"] < s["world_size"] - s["folded"] + 1
    r16 = s["ranks"]["16"]
    assert r16["capture_rank"] == 4
    assert sorted(map(int, r16["losses"])) == [0, 1, 2]
    assert all(math.isfinite(float(v)) for v in r16["losses"].values())
    assert r16["max_loss_rel_diff"] is not None  # reported beside the captured rank's (another global batch)
    assert r16["peaks_equal"] in (None, True)  # a CPU capture samples no torch peaks; on a GPU they are equal
    assert s["emulated_mean_ns"] and s["predicted_mean_ns"]
    assert s["pacing"]["lag_p99_ns"] is not None and s["coordinator"]["peak_rss_bytes"] > 0


# A variant of test_a_scaled_emulation_runs_the_sandbox_at_the_full_world on real
# processes; the matching itself: tests/unit/test_scale_emulation.py.
@FULL
def test_groups_created_out_of_nested_order_are_matched_by_members(tmp_path):
    # TP groups for the last replica first: the scaled plan numbers them otherwise than the
    # script at dp 4 does, so the sandbox's ids differ from the graph's for the same members.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    script = str(ROOT / "tests" / "support" / "scripts" / "reverse_groups.py")
    cap = subprocess.run([sys.executable, "-m", "prism", "capture", "-n", "4", "--out", str(tmp_path / "rev"),
                          "--progress", "off", "--show-ranks", "none", "--", script, "--tp", "2", "--dp", "2"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert cap.returncode == 0, cap.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-m", "prism", "emulate", str(tmp_path / "rev"), "--sandbox", "2",
                           "--scale-dp", "4", "--progress", "off", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    s = json.loads(proc.stdout)
    assert s["status"] == "ok" and s["world_size"] == 8
    assert s["groups_renamed"] == 1 and s["groups"]["instantiated"] == 3  # WORLD, its TP and DP groups
    assert sorted(map(int, s["ranks"]["2"]["losses"])) == [0, 1, 2]
