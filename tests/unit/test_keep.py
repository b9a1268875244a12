"""prism.validation.keep: a kept capture holds its graph, not its payloads or logs."""

from prism.validation.keep import keep_capture


def test_a_kept_capture_holds_the_graph_and_leaves_the_bulk(tmp_path):
    run = tmp_path / "run"
    for f in ("manifest.json", "ranks/rank-000000.jsonl", "payloads/rank-000000.bin", "logs/rank-000000.log",
              "emulation/e/summary.json", "calibration/c/manifest.json", "telemetry/gpu.jsonl"):
        (run / f).parent.mkdir(parents=True, exist_ok=True)
        (run / f).write_text("x")
    assert keep_capture(run, tmp_path / "keep", "gpt-0") == "gpt-0"
    assert keep_capture(run, tmp_path / "keep", "gpt-0") == "gpt-0-2"  # never over an earlier one
    kept = sorted(str(p.relative_to(tmp_path / "keep" / "gpt-0")) for p in (tmp_path / "keep" / "gpt-0").rglob("*")
                  if p.is_file())
    assert kept == ["manifest.json", "ranks/rank-000000.jsonl", "telemetry/gpu.jsonl"]
