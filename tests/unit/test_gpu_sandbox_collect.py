"""``bench/gpu_sandbox_collect.py``: emulations of several captures of one
workload (``CAPS=N``: ``cap-WL-c2``...) count as that workload against its
stored truth, and each workload and path gets one cell with its median and
interval."""

import json

from prism.testing.bench import load_bench


def _collect():
    return load_bench("gpu_sandbox_collect")


def _summary(root, cap, name, emulated_ms, predicted_ms=45.0):
    d = root / "r" / f"cap-{cap}" / "emulation" / name
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({
        "sandbox": [0], "warmup": 1, "emulated_mean_ns": emulated_ms * 1e6, "predicted_mean_ns": predicted_ms * 1e6,
        "ranks": {"0": {"iteration_ns": [50e6, emulated_ms * 1e6, emulated_ms * 1e6], "losses_equal": True,
                        "peaks_equal": True}}}))


def test_captures_of_one_workload_make_one_cell_against_its_truth(tmp_path, capsys):
    gc = _collect()
    t = gc.TRUTH_MS["gpt-tp2"]
    for cap, name, factor in (("gpt-tp2", "device", 1.01), ("gpt-tp2", "device-2", 1.03),
                              ("gpt-tp2-c2", "device", 0.99), ("gpt-tp2-c2", "device-comp", 1.05)):
        _summary(tmp_path, cap, name, t * factor)
    rows = gc.rows_of(str(tmp_path), "A")
    assert {r["workload"] for r in rows} == {"gpt-tp2"} and {r["capture"] for r in rows} == {"gpt-tp2", "gpt-tp2-c2"}
    cells = {c["path"]: c for c in gc.cells_of(rows)}
    rec, comp = cells["recorded"], cells["compensated"]
    assert rec["n"] == 3 and rec["captures"] == 2
    assert abs(rec["median_vs_truth"] - 0.01) < 1e-9 and abs(rec["mean_vs_truth"] - 0.01) < 1e-9
    lo, hi = rec["ci95"]
    assert lo < 0.01 < hi and hi - lo > 0.04  # sd 2 pp over three runs: t(2) = 4.30
    assert rec["within_2pct"] and not comp["within_2pct"] and comp["ci95"] is None
    out = tmp_path / "o.json"
    assert gc.main([str(tmp_path), "--out", str(out)]) == 0
    assert "against the stored truth" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["cells"]) == 2


def _host_time():
    return load_bench("host_time")


def test_the_round_trip_joins_the_coordinators_side_by_rank_group_and_sequence(tmp_path):
    ht = _host_time()
    rank_log = tmp_path / "calls-gpt-device-r0.jsonl"
    rows = [{"op": "all_reduce", "gid": "g1", "seq": s, "reach": 1000 * s, "t_seen": 1000 * s + 30,
             "t_rsent": 1000 * s + 50, "t_flip": 1000 * s + 900, "due": 1000 * s + 100} for s in range(8)]
    coord = [{"rank": 0, "gid": "g1", "seq": s, "c_in": 1000 * s + 300, "c_out": 1000 * s + 500} for s in range(8)]
    coord.append({"rank": 1, "gid": "g1", "seq": 0, "c_in": 5, "c_out": 6})  # another rank's: not joined
    rank_log.write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "calls-gpt-device-rcoord.jsonl").write_text("\n".join(json.dumps(c) for c in coord))
    assert ht.coord_log_of(str(rank_log)) == str(tmp_path / "calls-gpt-device-rcoord.jsonl")
    t = ht.trip_table(rows, ht.read_calls(ht.coord_log_of(str(rank_log))), skip=0.25)
    legs = {leg["leg"].strip(): leg["p50_us"] for leg in t["legs"]}
    assert t["calls"] == 6 and t["with_coordinator"] == 6
    assert legs["-> taken by the coordinator"] == 0.25 and legs["-> result sent by the coordinator"] == 0.2
    assert legs["-> flag flipped on the rank"] == 0.4 and legs["reach -> flip (the round trip)"] == 0.9
    assert legs["due -> flip (lateness)"] == 0.8


def test_a_run_says_how_long_its_last_step_was_and_its_call_log_the_gpus_view(tmp_path):
    gc = _collect()
    d = tmp_path / "r" / "cap-gpt-tp2" / "emulation" / "device"
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({
        "sandbox": [0], "warmup": 1, "emulated_mean_ns": 46e6, "predicted_mean_ns": 45e6,
        "ranks": {"0": {"iteration_ns": [90e6, 45e6, 44e6, 46e6, 49e6]}}}))
    (row,) = gc.rows_of(str(tmp_path), "A")
    assert row["last_step_excess_ms"] == 4.0  # 49 against the median of 45, 44, 46
    # a call log with each call's step: the GPU's view, T - late, per step (bench/gpu_view.py)
    calls = []
    for step in range(4):
        for k in range(2):
            t = step * 10_000_000 + k * 4_000_000
            calls.append({"op": "all_reduce", "step": step, "t0": t, "t1": t + 100_000, "t_wait": t + 50_000,
                          "t_out": t + 60_000, "reach": t + 1_000_000, "due": t + 1_200_000, "late": 500_000})
    (tmp_path / "r" / "calls-gpt-tp2-device-r0.jsonl").write_text("\n".join(json.dumps(c) for c in calls))
    (s,) = gc.splits_of(str(tmp_path), "A")
    assert s["gpu_view_ms"] == 9.0 and s["carry_dropped_ms"] == 0  # 10 ms between first reaches, 1 ms late
