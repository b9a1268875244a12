"""A failed capture is still useful: ``prism predict`` predicts the steps every
rank completed and says what is missing; where no step is complete, one line
says why (exit 1), never a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "support" / "scripts" / "fail_at_step.py")


def _prism(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prism", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240)


@pytest.fixture(scope="module")
def failed_after(tmp_path_factory):
    """Rank 3 raises in step 2 after its all_reduce: ranks 0-2 complete step 2, rank 3 does not."""
    base = tmp_path_factory.mktemp("failed")
    cap = _prism("capture", "-n", "4", "--out", str(base / "run"), "--progress", "off", "--show-ranks", "none",
                 "--quiet-period", "10", "--", SCRIPT, "3", "2", "4", "after", cwd=base)
    assert cap.returncode == 1, cap.stderr[-2000:]
    return base / "run"


@pytest.mark.slow
def test_predict_on_a_failed_capture_predicts_the_complete_steps(failed_after):
    r = _prism("predict", str(failed_after), "--warmup", "0", cwd=failed_after.parent)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == ("incomplete run: the capture did not finish: predicted from the 2 step(s) every rank "
                        "completed (0..1)")
    assert "incomplete run: rank 3 ended error: RuntimeError: rank 3 fails at step 2" in lines
    assert "incomplete run: step(s) 2 left out: not completed by 1 rank(s) (e.g. rank 3)" in lines
    assert any(line.startswith("predicted iteration time: ") and "n/a" not in line for line in lines)
    js = _prism("predict", str(failed_after), "--json", cwd=failed_after.parent)
    assert js.returncode == 0 and '"incomplete_run"' in js.stdout


@pytest.mark.slow
def test_predict_with_no_complete_step_says_why_in_one_line(tmp_path):
    cap = _prism("capture", "-n", "2", "--out", str(tmp_path / "run"), "--progress", "off", "--show-ranks", "none",
                 "--quiet-period", "10", "--", SCRIPT, "1", "0", cwd=tmp_path)
    assert cap.returncode == 1
    r = _prism("predict", str(tmp_path / "run"), cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"prism predict: nothing to predict in {tmp_path / 'run'}: no step was completed "
                               "by every rank (rank 1 ended error: RuntimeError: rank 1 fails at step 0")
