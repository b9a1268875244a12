"""``python -m prism`` as a command in a fresh interpreter: the entry point runs
and prints its help, and ``trace validate`` on a run written with the writer
exits 0 with nothing on stderr (in-process CLI tests: tests/unit/test_cli.py,
tests/unit/test_trace_cli.py)."""

import subprocess
import sys

from tests.unit.test_trace import write_sample_run


def test_python_dash_m_prism_runs():
    r = subprocess.run([sys.executable, "-m", "prism", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    assert "capture" in r.stdout


def test_python_dash_m_prism_trace_validate(tmp_path):
    run_dir = write_sample_run(tmp_path / "run")
    r = subprocess.run([sys.executable, "-m", "prism", "trace", "validate", str(run_dir)], capture_output=True, text=True)
    assert (r.returncode, r.stderr) == (0, "")
