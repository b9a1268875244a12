"""``prism predict`` in-process on a synthetic Megatron run: the iteration time
breakdown, --json, and the errors for a bad profile, an inconsistent trace
and a folder that is no run."""

import json

import pytest

from prism import cli
import prism.app.predict as app_predict
from prism.core.synthetic import MegatronSpec, megatron_events


@pytest.fixture
def synthetic_run(monkeypatch):
    events = megatron_events(MegatronSpec(tp=2, pp=2, dp=2, iterations=4))
    monkeypatch.setattr(app_predict, "load_run_events", lambda run: events)
    return events


def test_predict_prints_iteration_time_breakdown_and_profile(synthetic_run, capsys):
    assert cli.main(["predict", "RUN"]) == 0
    out = capsys.readouterr().out
    assert "predicted iteration time:" in out and "2 warm-up step(s) dropped" in out
    assert "cost profile: h200_nvlink_ib400" in out and "not measured here" in out
    assert "compute" in out and "waiting" in out and "critical path:" in out


def test_predict_json(synthetic_run, capsys):
    assert cli.main(["predict", "RUN", "--net", "zero", "--json", "--warmup", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cost_model"]["name"] == "zero" and data["steps"] == 4 and data["warmup"] == 1
    assert data["mean_iteration_time_ns"] == sum(data["iteration_times_ns"][1:]) / 3
    assert data["breakdown_ns"]["communication"]["max"] == 0


def test_predict_bad_profile(synthetic_run, capsys):
    assert cli.main(["predict", "RUN", "--net", "nope"]) == 2
    assert "cost profile 'nope' not found" in capsys.readouterr().err


def test_predict_inconsistent_trace(monkeypatch, capsys):
    events = megatron_events(MegatronSpec(tp=2, pp=1, dp=1, iterations=1))
    events[1] = events[1][: len(events[1]) // 2]
    monkeypatch.setattr(app_predict, "load_run_events", lambda run: events)
    assert cli.main(["predict", "RUN"]) == 1
    err = capsys.readouterr().err
    assert "the trace in RUN is inconsistent" in err and "have no record of it" in err


def test_predict_on_a_folder_that_is_no_run_says_which(tmp_path, capsys):
    assert cli.main(["predict", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prism predict: cannot read run {tmp_path / 'nothing'}") and "Traceback" not in err


def test_predict_on_a_run_without_rank_files_says_so(monkeypatch, capsys):
    monkeypatch.setattr(app_predict, "load_run_events", lambda run: {})
    assert cli.main(["predict", "RUN", "--net", "zero"]) == 1
    err = capsys.readouterr().err
    assert "nothing to predict in RUN: it has no rank files" in err and "Traceback" not in err


def _mean(capsys, *argv):
    assert cli.main(["predict", "RUN", "--net", "zero", "--json", "--warmup", "1", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_predict_whatif_flags_change_the_prediction(synthetic_run, capsys):
    base = _mean(capsys)["mean_iteration_time_ns"]
    strag = _mean(capsys, "--straggler", "3:50")
    assert strag["mean_iteration_time_ns"] > base * 1.2 and strag["whatif"] == ["straggler: rank 3 computes 50% slower"]
    assert _mean(capsys, "--throttle", "all:50")["mean_iteration_time_ns"] == pytest.approx(2 * base, rel=0.02)
    h200 = ["--net", "h200_nvlink_ib400"]
    slow = _mean(capsys, *h200, "--link-slowdown", "4")["breakdown_ns"]["communication"]["max"]
    assert slow == pytest.approx(4 * _mean(capsys, *h200)["breakdown_ns"]["communication"]["max"], rel=0.01)


def test_predict_memory_limit_exits_3_naming_the_rank(monkeypatch, capsys):
    from prism.core.trace import Memory

    events = megatron_events(MegatronSpec(tp=2, pp=1, dp=1, iterations=3))
    events[1] = [*events[1], Memory(0, "cuda:1", 1, 1, 7 * 2**30)]
    monkeypatch.setattr(app_predict, "load_run_events", lambda run: events)
    assert cli.main(["predict", "RUN", "--memory-limit", "7.5", "--warmup", "1"]) == 3
    out = capsys.readouterr().out
    assert "OUT OF MEMORY under 7.5 GiB: rank 1 needs 7.600 GiB" in out and "0.100 GiB over" in out
    assert cli.main(["predict", "RUN", "--memory-limit", "8", "--warmup", "1"]) == 0
    assert "fits in 8 GiB" in capsys.readouterr().out


def test_predict_bad_whatif_flags(synthetic_run, capsys):
    assert cli.main(["predict", "RUN", "--straggler", "three:10"]) == 2
    assert "--straggler: 'three:10' is not RANK:PCT" in capsys.readouterr().err
    assert cli.main(["predict", "RUN", "--straggler", "99:10"]) == 2
    assert "rank 99 is not in the replayed world" in capsys.readouterr().err
