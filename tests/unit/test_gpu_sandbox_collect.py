"""``bench/gpu_sandbox_collect.py``: emulations of several captures of one
workload (``CAPS=N``: ``cap-WL-c2``...) count as that workload against its
stored truth, and each workload and path gets one cell with its median and
interval."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _collect():
    spec = importlib.util.spec_from_file_location("gpu_sandbox_collect", ROOT / "bench" / "gpu_sandbox_collect.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
