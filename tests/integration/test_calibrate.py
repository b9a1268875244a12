"""``prism calibrate`` end to end on CPU: a world-4 capture of the bundled GPT
(tp2 x dp2, small) is calibrated slice by slice (its two TP groups), the
durations are stored under RUN/calibration/NAME/ and ``predict`` and
``emulate`` use them when asked; ``--symmetric`` runs one slice for the two
classes of equivalent ranks and copies its durations to the DP replica.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from prism.app.calibrate import CalibrateConfig, calibrate, load_calibration
from prism.app.emulate import EmulateConfig, emulate
from prism.app.errors import UsageError
from prism.app.predict import PredictConfig, predict
from prism.core.graph import COMPUTE

pytestmark = pytest.mark.slow

GPT_W4 = ["-m", "prism.workloads.gpt", "--tp", "2", "--dp", "2", "--layers", "2", "--hidden", "32", "--heads", "2",
          "--seq-len", "16", "--steps", "3"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, shared_captures):
    return shared_captures.copy(tmp_path_factory.mktemp("calibrate") / "gpt", 4, GPT_W4)


def compute_durations(prediction, rank):
    g = prediction.result.graph
    sl = g.nodes_of(rank)
    return g.dur[sl][g.kind[sl] == COMPUTE]


def test_calibrate_stores_durations_that_predict_and_emulate_use(run):
    # every CPU segment of the real ranks says how much CPU its main thread used
    from prism.core.trace import Compute
    from prism.shell import runfolder

    segs = [ev for evs in runfolder.read_run(run).ranks.values() for ev in evs if isinstance(ev, Compute)]
    assert segs and all(0 <= ev.thread_cpu_ns <= ev.end_ns - ev.start_ns + 2_000_000 for ev in segs)
    # --replace-clean: every segment takes its slice's measurement (which ones a
    # capture ran undisturbed depends on the machine's load: the unit tests
    # check that rule)
    res = calibrate(CalibrateConfig(run=run, name="tp", cores=2, keep_clean=False))
    m = res.manifest
    assert m["keep_clean"] is False and all(v["kept_clean"] == 0 for v in m["per_rank"].values())
    assert m["slices"] == [[0, 1], [2, 3]] and not m["symmetric"] and m["uncalibrated_ranks"] == []
    assert m["packed"] is True  # the default; two cores hold one TP pair at a time
    assert sorted(p.name for p in res.out_dir.iterdir()) == ["durations.npz", "manifest.json"]
    assert json.loads((res.out_dir / "manifest.json").read_text())["emulations"] == m["emulations"]
    for name in m["emulations"]:
        assert (run / "emulation" / name / "summary.json").is_file()
    table, _ = load_calibration(run, "tp")
    assert sorted(table) == [0, 1, 2, 3]
    bare = predict(PredictConfig(run=run, warmup=1, calibration="off"))
    cal = predict(PredictConfig(run=run, warmup=1, calibration="on"))
    assert cal.calibration["name"] == "tp" and bare.calibration is None
    # the default (auto) takes the run's newest calibration
    assert predict(PredictConfig(run=run, warmup=1)).calibration["name"] == "tp"
    for r in range(4):
        assert compute_durations(bare, r).tolist() != compute_durations(cal, r).tolist()
        assert compute_durations(cal, r).tolist() == table[r].tolist()
        assert m["per_rank"][str(r)]["replaced"] == len(table[r])
    assert cal.result.graph.n_nodes == bare.result.graph.n_nodes
    assert "slice calibration 'tp'" in cal.text()
    assert cal.mean_iteration_ns == pytest.approx(m["calibrated_mean_ns"])
    # emulate checks the option before it launches anything
    with pytest.raises(UsageError, match="--calibration 'nope': no such calibration .* tp"):
        emulate(EmulateConfig(run=run, sandbox="0", calibration="nope", name="never"))
    assert not (run / "emulation" / "never").exists()


def test_symmetric_calibration_copies_one_slice_to_its_classes(run):
    # --replace-clean: every segment from the representative (what is copied is the point here)
    res = calibrate(CalibrateConfig(run=run, name="sym", cores=2, symmetric=True, keep_clean=False))
    m = res.manifest
    assert m["slices"] == [[0, 1]] and m["classes"] == {"0": [0, 2], "1": [1, 3]}
    assert m["per_rank"]["2"]["source_rank"] == 0 and m["per_rank"]["3"]["source_rank"] == 1
    table, _ = load_calibration(run, "sym")
    assert sorted(table) == [0, 1, 2, 3]
    # the replica's gaps take the representative's measured totals
    assert abs(int(table[2].sum()) - int(table[0].sum())) <= len(table[2])
    with pytest.raises(UsageError, match="already holds a calibration"):
        calibrate(CalibrateConfig(run=run, name="sym", cores=2))


def test_resume_keeps_the_finished_slices_and_reruns_the_failed_one(run, monkeypatch):
    import prism.app.emulate as emulate_mod
    from prism.app.calibrate import CalibrationFailed

    real = emulate_mod.emulate

    def slice1_stopped(config):  # slice 1 stopped by a signal: a folder whose summary says so
        if config.name.endswith("slice1"):
            d = run / "emulation" / config.name
            d.mkdir(parents=True)
            (d / "summary.json").write_text(json.dumps({"status": "interrupted", "sandbox": [2, 3]}))
            return emulate_mod.EmulationOutcome(d, 143, "interrupted", "stopped by SIGTERM")
        return real(config)

    monkeypatch.setattr(emulate_mod, "emulate", slice1_stopped)
    with pytest.raises(CalibrationFailed, match=r"(?s)slice 1 \(ranks 2,3\) failed .*stopped by SIGTERM.*The 1 slice\(s\) "
                                                r"measured before it are kept: `prism calibrate .* --name res --resume`"):
        calibrate(CalibrateConfig(run=run, name="res", cores=2, keep_clean=False))
    monkeypatch.setattr(emulate_mod, "emulate", real)
    emus = run / "emulation"
    done = (emus / "calibrate-res-slice0" / "summary.json").stat().st_mtime_ns
    with pytest.raises(UsageError, match="calibrate-res-slice0 exists already: an earlier calibration 'res'; --resume"):
        calibrate(CalibrateConfig(run=run, name="res", cores=2, keep_clean=False))
    with pytest.raises(UsageError, match="ran sandbox ranks 0,1, but slice 0 .ranks 0,2. now holds 0,2"):
        calibrate(CalibrateConfig(run=run, name="res", slices="0,2;1,3", cores=2, keep_clean=False, resume=True))
    with pytest.raises(UsageError, match="--resume needs the --name"):
        calibrate(CalibrateConfig(run=run, cores=2, resume=True))
    res = calibrate(CalibrateConfig(run=run, name="res", cores=2, keep_clean=False, resume=True))
    m = res.manifest
    assert m["resumed"] == ["calibrate-res-slice0"]
    assert m["emulations"] == ["calibrate-res-slice0", "calibrate-res-slice1-retry2"]
    assert (emus / "calibrate-res-slice0" / "summary.json").stat().st_mtime_ns == done  # not run again
    assert json.loads((emus / "calibrate-res-slice1" / "summary.json").read_text())["status"] == "interrupted"
    assert "kept from an earlier run" in res.text()
    table, _ = load_calibration(run, "res")
    assert sorted(table) == [0, 1, 2, 3] and all(m["per_rank"][str(r)]["replaced"] == len(table[r]) for r in table)


def test_a_slice_too_big_for_the_cores_is_refused(run):
    with pytest.raises(UsageError, match="slice 0,1,2 has 3 ranks but only 2 fit"):
        calibrate(CalibrateConfig(run=run, slices="0,1,2;3", cores=2, name="big"))
    assert np.all([not p.name.startswith("calibrate-big") for p in (run / "emulation").iterdir()])


def test_gpus_are_refused_for_a_cpu_capture_and_through_agents(run):
    with pytest.raises(UsageError, match="--gpus 0: this capture ran on CPU"):
        calibrate(CalibrateConfig(run=run, gpus="0", name="g"))
    with pytest.raises(UsageError, match="with --agents each node's agent offers its own"):
        calibrate(CalibrateConfig(run=run, gpus="0", agents=2, name="g"))
    assert np.all([not p.name.startswith("calibrate-g") for p in (run / "emulation").iterdir()])


def test_pipelines_calibrate_although_their_waits_move(tmp_path_factory, shared_captures):
    # tp2 x pp2: an irecv's wait falls before or after the next send, run by run; issues must match, waits float
    cmd = ["-m", "prism.workloads.gpt", "--tp", "2", "--pp", "2", *GPT_W4[6:]]
    pp_run = shared_captures.copy(tmp_path_factory.mktemp("calibrate-pp") / "gpt", 4, cmd)
    m = calibrate(CalibrateConfig(run=pp_run, slices="pp", name="pp", cores=2)).manifest
    assert m["slices"] == [[0, 2], [1, 3]] and m["uncalibrated_ranks"] == []
    assert predict(PredictConfig(run=pp_run, warmup=1, calibration="pp")).calibration["slices"] == [[0, 2], [1, 3]]
