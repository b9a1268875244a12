"""Slice calibration without processes: planning, symmetry classes, matching a
slice's trace to the capture, applying stored durations, and the app's
refusals of bad input (prism.core.calibration, prism.app.calibrate).

Expected slices are computed from Megatron's layout by hand
(rank = tp + TP * (dp + DP * pp), docs/DESIGN.md), never from the code under test.
"""

from __future__ import annotations

import json
import numpy as np
import pytest

from prism.app.calibrate import CalibrateConfig, calibrate, calibrated_events, load_calibration
from prism.app.errors import UsageError
from prism.core.calibration import (
    CalibrationError,
    apply_calibration,
    expand_classes,
    measured_durations,
    plan_slices,
    symmetric_plan,
    symmetry_classes,
)
from prism.core.graph import COMPUTE, ExecutionGraph
from prism.core.scaleout import Layout
from tests.support.helpers_graph import Program

L222 = Layout(tp=2, pp=2, dp=2)


# ------------------------------------------------------------------ planning
@pytest.mark.parametrize("spec, want", [
    ("tp", [(0, 1), (2, 3), (4, 5), (6, 7)]),
    ("pp", [(0, 4), (1, 5), (2, 6), (3, 7)]),
    ("gang", [(0, 1, 4, 5), (2, 3, 6, 7)]),
    ("pairs", [(0, 1), (2, 3), (4, 5), (6, 7)]),
    ("auto", [(0, 1), (2, 3), (4, 5), (6, 7)]),  # the TP groups
    ("0,4;1", [(0, 4), (1,)]),
])
def test_slices_of_a_tp2_pp2_dp2_layout(spec, want):
    assert list(plan_slices(8, spec, cores=4, layout=L222)) == want


def test_auto_takes_pipelines_without_tp_and_pairs_without_a_layout():
    assert list(plan_slices(4, "auto", cores=2, layout=Layout(pp=2, dp=2))) == [(0, 2), (1, 3)]
    assert list(plan_slices(5, "auto", cores=2)) == [(0, 1), (2, 3), (4,)]
    # TP groups of 4 do not fit 2 cores: pairs
    assert list(plan_slices(8, "auto", cores=2, layout=Layout(tp=4, dp=2))) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert list(plan_slices(4, "pairs", cores=1)) == [(0,), (1,), (2,), (3,)]


@pytest.mark.parametrize("spec, layout, cores, match", [
    ("0,1;9", L222, 4, r"rank 9 in slice 1 is not in the run \(world size 8"),
    ("0,1;1,2", L222, 4, "rank 1 is in slice 0 and in slice 1"),
    ("0,x", L222, 4, "'x' in slice 0 is not a rank"),
    ("0,1;;2", L222, 4, "slice 1 is empty"),
    ("gang", L222, 2, "slice 0,1,4,5 has 4 ranks but only 2 fit"),
    ("0,1,2", L222, 2, "slice 0,1,2 has 3 ranks but only 2 fit"),
    ("tp", None, 4, "needs the run's layout"),
    ("tp", Layout(dp=8), 4, r"no TP groups \(tp = 1\)"),
    ("pp", Layout(tp=2, dp=4), 4, r"no pipeline \(pp = 1\)"),
])
def test_bad_slices_are_refused_naming_the_value(spec, layout, cores, match):
    with pytest.raises(CalibrationError, match=match):
        plan_slices(8, spec, cores=cores, layout=layout)


def test_symmetry_classes_are_positions_in_the_layout():
    assert symmetry_classes(8, L222) == ((0, 2), (1, 3), (4, 6), (5, 7))
    # EP ranks (dp % ep) are positions too: dp 0 and 2 hold the same experts
    assert symmetry_classes(4, Layout(dp=4, ep=2)) == ((0, 2), (1, 3))
    assert symmetry_classes(3, None) == ((0,), (1,), (2,))


def test_symmetric_plan_keeps_one_slice_per_class():
    slices, rep = symmetric_plan(plan_slices(8, "tp", cores=2, layout=L222), symmetry_classes(8, L222))
    assert slices == ((0, 1), (4, 5))
    assert rep == {0: 0, 2: 0, 1: 1, 3: 1, 4: 4, 6: 4, 5: 5, 7: 5}
    # pipelines cover a class per stage: two of the four are enough
    slices, rep = symmetric_plan(plan_slices(8, "pp", cores=2, layout=L222), symmetry_classes(8, L222))
    assert slices == ((0, 4), (1, 5)) and rep[6] == 4 and rep[3] == 1


# ---------------------------------------------------------------- measuring
def program(durs: dict[int, list[list[int]]], *, split: bool = False, op: str = "all_reduce",
            cpu: int = -1) -> Program:
    """Two ranks, two steps: per step, compute segments (``durs[r][step]``),
    an all-reduce on the world, a barrier-like all-reduce, the step's end.
    ``split``: rank 0 cuts its first segment of each step in two."""
    p = Program(2)
    for step in range(2):
        for r in (0, 1):
            first, second = durs[r][step]
            if split and r == 0:
                p.compute(r, first // 2)
                p.compute(r, first - first // 2)
            else:
                p.compute(r, first, cpu=cpu if r == 1 else -1, gpu=first if cpu >= 0 and r == 1 else -1)
        p.coll("world", op)
        for r in (0, 1):
            p.compute(r, durs[r][step][1])
        p.coll("world")
        p.end_step()
    return p


BARE = {0: [[100, 40], [120, 50]], 1: [[300, 60], [310, 70]]}
SLICE = {0: [[80, 30], [90, 35]], 1: [[200, 20], [210, 25]]}


def test_a_slice_measurement_replaces_the_bare_durations_one_by_one():
    bare, meas = program(BARE).events, program(SLICE).events
    m = measured_durations(0, bare[0], meas[0])
    assert m.durations.tolist() == [80, 30, 90, 35]
    assert (m.segments, m.replaced, m.kept_two_clock, m.regrouped) == (4, 4, 0, 0)


def test_a_gap_cut_differently_is_split_in_proportion_to_the_bare_durations():
    bare = program(BARE, split=True).events  # rank 0: 50 + 50 before the first call of step 0
    meas = program(SLICE).events  # one segment of 80 there
    m = measured_durations(0, bare[0], meas[0])
    assert m.durations.tolist() == [40, 40, 30, 45, 45, 35] and m.regrouped == 2


def test_two_clock_segments_keep_the_capture_timing():
    bare = program(BARE, cpu=5).events
    m = measured_durations(1, bare[1], program(SLICE).events[1])
    assert m.durations.tolist() == [300, 20, 310, 25] and m.kept_two_clock == 2


def test_segments_the_capture_ran_undisturbed_keep_their_capture_timing():
    # rank 0's thread CPU time per segment: all of it (clean), 96% (clean: over
    # CLEAN_SHARE), half (descheduled: polluted), unknown (older trace: polluted)
    import dataclasses

    from prism.core.calibration import CLEAN_SHARE
    from prism.core.trace import Compute

    assert CLEAN_SHARE == 0.95
    share = iter([1.0, 0.96, 0.5, None])
    bare = [dataclasses.replace(ev, thread_cpu_ns=-1 if (f := next(share)) is None else
                                int(f * (ev.end_ns - ev.start_ns)))
            if isinstance(ev, Compute) else ev for ev in program(BARE).events[0]]
    meas = program(SLICE).events[0]
    m = measured_durations(0, bare, meas)
    assert m.durations.tolist() == [100, 40, 90, 35]  # bare 100, 40 kept; slice 90, 35 taken
    assert (m.replaced, m.kept_clean, m.kept_two_clock) == (2, 2, 0)
    segs = [ev.end_ns - ev.start_ns for ev in bare if isinstance(ev, Compute)]
    assert (m.clean_ns, m.replaced_bare_ns, m.replaced_ns) == (140, segs[2] + segs[3], 125)
    m = measured_durations(0, bare, meas, keep_clean=False)  # --replace-clean: the rule before PrismTrace 1.4
    assert m.durations.tolist() == [80, 30, 90, 35] and (m.replaced, m.kept_clean) == (4, 0)
    assert (m.clean_ns, m.replaced_bare_ns, m.replaced_ns) == (0, sum(segs), 235)


def test_a_slice_that_took_another_path_is_refused_naming_rank_and_call():
    with pytest.raises(CalibrationError, match=r"rank 0, call 0: the slice run made broadcast on group 'world' "
                                               r"seq 0 where the capture has all_reduce on group 'world' seq 0"):
        measured_durations(0, program(BARE).events[0], program(SLICE, op="broadcast").events[0])
    short = program(SLICE).events[0][:-3]
    with pytest.raises(CalibrationError, match=r"rank 0: its slice run stopped after 4 of the capture's 6 calls"):
        measured_durations(0, program(BARE).events[0], short)


def test_a_wait_that_moves_among_the_calls_does_not_count_as_another_path():
    def run(wait_first: bool, durs: tuple[int, int]) -> Program:
        p = Program(2)
        p.coll("world", async_on=(0, 1))
        for r in (0, 1):
            p.compute(r, durs[0])
        if wait_first:
            p.wait(0)
        p.coll("world")
        if not wait_first:
            p.wait(0)
        p.wait(1)
        for r in (0, 1):
            p.compute(r, durs[1])
        p.end_step()
        return p

    m = measured_durations(0, run(True, (100, 50)).events[0], run(False, (70, 20)).events[0])
    assert m.durations.tolist() == [70, 20] and m.regrouped == 0


def test_applied_durations_keep_the_graph_and_change_its_compute():
    bare = program(BARE).events
    table = {0: np.array([1, 2, 3, 4], np.int64)}
    g0 = ExecutionGraph.from_events(bare)
    g1 = ExecutionGraph.from_events(apply_calibration(bare, table))
    assert g1.n_nodes == g0.n_nodes and (g1.kind == g0.kind).all() and (g1.op == g0.op).all()
    sl0, sl1 = g1.nodes_of(0), g1.nodes_of(1)
    assert g1.dur[sl0][g1.kind[sl0] == COMPUTE].tolist() == [1, 2, 3, 4]
    assert (g1.dur[sl1] == g0.dur[sl1]).all()
    with pytest.raises(CalibrationError, match="holds 3 compute segments but the run has 4"):
        apply_calibration(bare, {0: np.array([1, 2, 3], np.int64)})


def test_class_members_take_their_representative_gap_by_gap():
    p = Program(4, {"a": (0, 1), "b": (2, 3)})
    for r in range(4):
        p.compute(r, 10 * (r + 1))
    p.coll("a")
    p.coll("b")
    for r in range(4):
        p.compute(r, 5)
        if r == 2:
            p.compute(r, 5)  # rank 2 cuts this gap in two
    p.coll("a")
    p.coll("b")
    p.end_step()
    rep = {0: 0, 2: 0}
    out = expand_classes(p.events, {0: np.array([7, 8], np.int64)}, rep)
    assert out[0].durations.tolist() == [7, 8]
    assert out[2].durations.tolist() == [7, 4, 4] and out[2].regrouped == 1
    p.coll("b", "broadcast")
    with pytest.raises(CalibrationError, match=r"rank 2 is not symmetric to its class representative, rank 0: at "
                                               r"call 3 rank 2 has broadcast on group 'b' seq 2 and rank 0 has no more"):
        expand_classes(p.events, {0: np.array([7, 8], np.int64)}, rep)


# ----------------------------------------------------------- the app refuses
@pytest.fixture
def tiny_run(tmp_path):
    from prism.app.capture import manifest_for
    from prism.shell import runfolder

    run = tmp_path / "run"
    runfolder.make_run_dir(run)
    cmd = ["-m", "prism.workloads.gpt", "--tp", "2"]
    runfolder.write_run(run, manifest_for(run, 2, cmd, 2, "cpu"), program(BARE).events)
    return run


def test_a_run_without_a_graph_is_refused(tmp_path):
    with pytest.raises(UsageError, match=f"{tmp_path} has no graph to calibrate"):
        calibrate(CalibrateConfig(run=tmp_path))


@pytest.mark.parametrize("kw, match", [
    ({"slices": "0;7"}, r"rank 7 in slice 1 is not in the run \(world size 2"),
    ({"slices": "tp", "cores": 1}, "slice 0,1 has 2 ranks but only 1 fit"),
    ({"name": "on"}, "--name 'on': give a plain name"),
])
def test_bad_calibrate_options_are_refused_before_anything_runs(tiny_run, kw, match):
    with pytest.raises(UsageError, match=match):
        calibrate(CalibrateConfig(run=tiny_run, **{"cores": 2, **kw}))
    assert not (tiny_run / "emulation").exists() or not any((tiny_run / "emulation").iterdir())


def test_calibration_off_leaves_the_events_and_a_missing_one_is_named(tiny_run):
    events = program(BARE).events
    assert calibrated_events(tiny_run, events, "off") == (events, None)
    with pytest.raises(UsageError, match="has no calibration"):
        load_calibration(tiny_run, "on")
    with pytest.raises(UsageError, match=r"--calibration 'nope': no such calibration"):
        calibrated_events(tiny_run, events, "nope")



def test_pack_slices_merges_whole_slices_up_to_the_cores():
    from prism.core.calibration import pack_slices

    tp = ((0, 1), (2, 3), (4, 5), (6, 7))
    assert pack_slices(tp, 4) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert pack_slices(tp, 5) == ((0, 1, 2, 3), (4, 5, 6, 7))  # a slice is never split
    assert pack_slices(tp, 8) == ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert pack_slices(tp, 2) == tp
    assert pack_slices(((0, 4), (1, 5, 2)), 3) == ((0, 4), (1, 2, 5))
    with pytest.raises(CalibrationError, match="slice 1,5,2 has 3 ranks but only 2 fit"):
        pack_slices(((0, 4), (1, 5, 2)), 2)


def test_node_rounds_put_one_slice_on_each_node_at_a_time():
    from prism.core.calibration import node_rounds

    assert node_rounds(3, 0) == ((0,), (1,), (2,))  # one machine: one slice after the other
    assert node_rounds(3, 1) == ((0,), (1,), (2,))
    assert node_rounds(5, 2) == ((0, 1), (2, 3), (4,))
    assert node_rounds(2, 4) == ((0, 1),)
    assert node_rounds(0, 2) == ()
    with pytest.raises(CalibrationError, match="counts"):
        node_rounds(2, -1)


def _manifest(**kw):
    m = {"run": "r", "world_size": 8, "slices": [[0, 1], [2, 3], [4, 5], [6, 7]], "slice_mode": "tp", "symmetric": False,
         "packed": False, "cores": 16, "emulations": ["e0", "e1", "e2", "e3"], "slice_wall_s": [1.0] * 4,
         "resumed": [], "classes": {}, "uncalibrated_ranks": [], "agents": 0, "name": "c", "cost_model": "p",
         "per_rank": {"0": {"replaced": 5, "kept_two_clock": 0, "kept_clean": 0}},
         "bare_mean_ns": 2e6, "calibrated_mean_ns": 1.9e6}
    m.update(kw)
    return m


def test_a_calibration_of_lone_slices_on_a_big_machine_points_to_pack():
    from pathlib import Path

    from prism.app.calibrate import CalibrationResult

    tmp = Path("x")
    text = CalibrationResult(tmp, _manifest()).text()
    assert "each slice ran alone, 2 rank(s) on a machine of 16 cores" in text and "without --no-pack the slices run" in text
    # packed, a machine the slices half fill or more, one slice, agents' nodes, nothing CPU-timed replaced
    for quiet in (_manifest(packed=True), _manifest(cores=3), _manifest(slices=[[0, 1]], emulations=["e0"]),
                  _manifest(agents=2), _manifest(per_rank={"0": {"replaced": 0, "kept_two_clock": 5}})):
        assert "ran alone" not in CalibrationResult(tmp, quiet).text()


def test_a_cuda_captures_slices_hold_one_rank_per_gpu_given(monkeypatch):
    from pathlib import Path
    from types import SimpleNamespace

    from prism.app import calibrate as cal
    from prism.app.errors import UsageError

    monkeypatch.setattr(cal, "_usable_cores", lambda: 16)
    assert cal._on_cuda(SimpleNamespace(device_kind="cuda"), {}) is True
    assert cal._on_cuda(SimpleNamespace(device_kind="cpu"), {}) is False
    cfg = cal.CalibrateConfig(run="r")
    assert cal._default_slots(cfg, False) == (16, "cores")
    assert cal._default_slots(cfg, True) == (1, "GPUs")  # GPU 0, as emulate's default
    assert cal._default_slots(cal.CalibrateConfig(run="r", gpus="0,1"), True) == (2, "GPUs")
    assert cal._default_slots(cal.CalibrateConfig(run="r", gpus="1,1"), True) == (1, "GPUs")
    assert cal._default_slots(cal.CalibrateConfig(run="r", agents=2), True) == (16, "cores")
    with pytest.raises(UsageError, match="--gpus takes GPU indices"):
        cal._default_slots(cal.CalibrateConfig(run="r", gpus="a"), True)
    text = cal.CalibrationResult(Path("x"), _manifest(cores=2, slot_unit="GPUs", slices=[[0], [1]],
                                                      emulations=["e0", "e1"])).text()
    assert "2 GPUs per slice at most" in text and "ran alone" not in text


def test_slices_run_packed_by_default_except_through_agents():
    from prism.app.calibrate import CalibrateConfig, _packs

    assert _packs(CalibrateConfig(run="r")) is True
    assert _packs(CalibrateConfig(run="r", agents=2)) is False  # one slice per node, alone on it
    assert _packs(CalibrateConfig(run="r", agents=2, pack=True)) is True
    assert _packs(CalibrateConfig(run="r", pack=False)) is False  # --no-pack


def test_calibration_auto_uses_the_newest_when_there_is_one(tiny_run):
    import numpy as np

    from prism.app.calibrate import has_calibration
    from prism.shell import runfolder

    events = program(BARE).events
    assert not has_calibration(tiny_run)
    assert calibrated_events(tiny_run, events, "auto") == (events, None)  # none stored: the bare graph
    for name, created, scale in (("old", "2026-12-01T00:00:00Z", 2), ("new", "2026-12-07T00:00:00Z", 3)):
        d = runfolder.calibration_path(tiny_run, name)
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps({"name": name, "created_utc": created, "world_size": 2,
                                                     "slices": [[0, 1]]}))
        np.savez(d / "durations.npz", **{f"rank-{r:06d}": np.array([x * scale for st in BARE[r] for x in st])
                                         for r in (0, 1)})
    assert has_calibration(tiny_run)
    got, manifest = calibrated_events(tiny_run, events, "auto")
    assert manifest["name"] == "new" and got != events
    assert calibrated_events(tiny_run, events, "on")[1]["name"] == "new"
    assert calibrated_events(tiny_run, events, "old")[1]["name"] == "old"
    assert calibrated_events(tiny_run, events, "off") == (events, None)


def _cpu_ranks(shares):
    from prism.core.trace import Compute

    return {r: [Compute(start_ns=i * 1000, end_ns=i * 1000 + 1000, step=0, thread_cpu_ns=int(1000 * s))
                for i in range(4)] for r, s in enumerate(shares)}


def test_a_polluted_capture_is_named_with_what_to_do(tmp_path):
    from prism.app.calibrate import pollution_hint
    from prism.core.calibration import POLLUTED_SHARE, cpu_share
    from prism.core.trace import Compute

    share, worst, worst_rank, n, clean = cpu_share(_cpu_ranks([1.0, 0.3]))
    assert (share, worst, worst_rank, n, clean) == (pytest.approx(0.65), pytest.approx(0.3), 1, 8, 4)
    hint = pollution_hint(tmp_path / "run", _cpu_ranks([1.0, 0.3]))
    assert "on a CPU for 65% of their compute (rank 1: 30%" in hint and f"`prism calibrate {tmp_path / 'run'}`" in hint
    assert pollution_hint(tmp_path, _cpu_ranks([1.0, 0.95])) is None  # clean enough
    assert cpu_share(_cpu_ranks([POLLUTED_SHARE]))[0] == pytest.approx(POLLUTED_SHARE)
    # GPU segments (two clocks) and traces without the CPU clock say nothing
    gpu = {0: [Compute(start_ns=0, end_ns=1000, step=0, cpu_ns=500, gpu_ns=900, thread_cpu_ns=100)]}
    assert cpu_share(gpu) is None and pollution_hint(tmp_path, gpu) is None
    assert cpu_share({0: [Compute(start_ns=0, end_ns=1000, step=0)]}) is None


def test_calibrate_refuses_the_option_words_as_names(tiny_run):
    for word in ("auto", "off", "on"):
        with pytest.raises(UsageError, match=f"--name '{word}': give a plain name"):
            calibrate(CalibrateConfig(run=tiny_run, name=word, cores=2))


def test_predict_names_a_polluted_capture_unless_told_off(tmp_path):
    import dataclasses

    from prism.app.capture import manifest_for
    from prism.app.predict import PredictConfig, predict
    from prism.core.trace import Compute
    from prism.shell import runfolder

    run = tmp_path / "run"
    runfolder.make_run_dir(run)
    events = {r: [dataclasses.replace(ev, thread_cpu_ns=(ev.end_ns - ev.start_ns) // 3) if isinstance(ev, Compute)
                  else ev for ev in evs] for r, evs in program(BARE).events.items()}
    runfolder.write_run(run, manifest_for(run, 2, ["-m", "prism.workloads.gpt", "--tp", "2"], 2, "cpu"), events)
    p = predict(PredictConfig(run=run, net="zero", warmup=1))
    assert p.calibration is None and "looks polluted" in p.text() and "33% of their compute" in p.text()
    assert f"`prism calibrate {run}`" in p.text() and p.summary()["calibration_hint"] == p.calibration_hint
    off = predict(PredictConfig(run=run, net="zero", warmup=1, calibration="off"))
    assert off.calibration_hint is None and "polluted" not in off.text()
