"""The hybrid replay's oracle on a real capture: the bundled GPT (tp2 pp2 dp2,
world 8) captured on CPU; sandbox ranks {0} and {0, 5} fed their calls at the
batch replay's times reproduce its timeline exactly."""

import numpy as np
import pytest

from prism.core.graph import ExecutionGraph
from prism.core.hybrid import HybridReplay
from prism.core.replay import replay_batch
from prism.shell.profiles import load_profile
from prism.shell.runfolder import read_run
from tests.support.captures import GPT_W8_SMALL, RECORD_045
from tests.support.hybrid_driver import drive


@pytest.fixture(scope="module")
def gpt_graph(shared_captures):
    # test_emulate's capture, which also records ranks 0, 4 and 5 (stored beside
    # the trace): the oracle is checked on whatever graph a capture yields.
    proc, run = shared_captures.get(8, GPT_W8_SMALL, *RECORD_045)
    assert proc.returncode == 0, proc.stderr[-3000:]
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
