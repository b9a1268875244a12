"""The two-clock model against real runs: the sixth session's 12 GPU
captures (world 2 on 2 H200s, PrismTrace 1.2, kept in
bench/results/traces/) replayed with the current graph, cost model and
replay, against the truths measured beside them (bench/results/
nccl-2026-11-29.md, section 8). A change to the model that loses fidelity on
these real captures fails here; `python bench/two_clock_check.py -v` prints
every capture. Needs no GPU (a few seconds)."""

import importlib.util
import pathlib
import statistics
import tarfile

import pytest

from prism.core import trace as T
from prism.core.graph import ExecutionGraph
from prism.core.replay import replay_batch
from prism.predict_cli import resolve_profile

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARCHIVE = ROOT / "bench" / "results" / "traces" / "nccl-h200x2-sixth-captures-2026-11-30.tgz"
_spec = importlib.util.spec_from_file_location("two_clock_check", ROOT / "bench" / "two_clock_check.py")


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    check = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(check)
    tmp = tmp_path_factory.mktemp("sixth")
    with tarfile.open(ARCHIVE) as tf:
        tf.extractall(tmp, filter="data")
    model, _ = resolve_profile(check.NET, None)
    out = {}
    for name, (what, truth) in check.SIXTH.items():
        g = ExecutionGraph.from_events(T.read_run(tmp / name).ranks)
        ms = replay_batch(g, cost_model=model).mean_iteration_time(3) / 1e6
        out[name] = (what, 100 * (ms - truth) / truth)
    return out


def test_gpt_tensor_and_pipeline_parallel_captures_predict_within_2_percent(errors):
    gpt = {n: e for n, (what, e) in errors.items() if what.startswith("GPT")}
    assert len(gpt) == 6
    assert all(abs(e) < 2.0 for e in gpt.values()), gpt


def test_the_median_error_over_the_captures_stays_under_2_percent(errors):
    med = statistics.median(abs(e) for _, e in errors.values())
    assert med < 2.0, {n: round(e, 2) for n, (_, e) in errors.items()}


def test_moe_captures_stay_within_5_percent(errors):
    moe = {n: e for n, (what, e) in errors.items() if what.startswith("MoE")}
    assert len(moe) == 4 and all(abs(e) < 5.0 for e in moe.values()), moe
