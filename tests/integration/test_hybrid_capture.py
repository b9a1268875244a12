"""The hybrid replay's oracle on a real capture: the bundled GPT (tp2 pp2 dp2,
world 8) captured on CPU; sandbox ranks {0} and {0, 5} fed their calls at the
batch replay's times reproduce its timeline exactly."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prism.core.graph import ExecutionGraph
from prism.core.hybrid import HybridReplay
from prism.core.replay import replay_batch
from prism.shell.profiles import load_profile
from prism.shell.runfolder import read_run
from tests.support.hybrid_driver import drive

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpt_graph(tmp_path_factory):
    run = tmp_path_factory.mktemp("hybrid") / "gpt"
    subprocess.run([sys.executable, "-m", "prism", "capture", "-n", "8", "--out", str(run), "--progress", "off",
                    "--show-ranks", "none", "--", "-m", "prism.workloads.gpt", "--tp", "2", "--pp", "2", "--dp", "2",
                    "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--steps", "3"],
                   check=True, cwd=ROOT, capture_output=True, timeout=300)
    return ExecutionGraph.from_events(read_run(run).ranks)


@pytest.mark.slow
@pytest.mark.parametrize("sandbox", [[0], [0, 5]])
def test_the_oracle_holds_on_a_captured_gpt(gpt_graph, sandbox):
    model = load_profile("h200_nvlink_ib400")
    want = replay_batch(gpt_graph, cost_model=model)
    eng = HybridReplay(gpt_graph, sandbox, cost_model=model)

    def at_batch_time(rank, node, t0):
        cn = eng.next_call_node(rank, node)
        return int(want.start[cn]) if cn < gpt_graph.rank_ptr[rank + 1] else int(want.end[cn - 1])

    released = drive(eng, at_batch_time)
    got = eng.result()
    np.testing.assert_array_equal(got.start, want.start)
    np.testing.assert_array_equal(got.end, want.end)
    assert released and {r.rank for r in released} == set(sandbox)
