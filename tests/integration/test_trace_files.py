"""PrismTrace files written by a real process: a TraceWriter killed with
SIGKILL mid-write leaves whole lines and at most one torn last line, which
the reader reports as a warning (prism.core.trace)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from prism.shell import runfolder
from prism.core.trace import Compute


_KILLED_WRITER = """
import sys
from prism.core.trace import Compute
from prism.shell.runfolder import TraceWriter
with TraceWriter(sys.argv[1], 0, flush_every=int(sys.argv[2])) as w:
    i = 0
    while True:
        w.write(Compute(start_ns=i, end_ns=i + 1, step=0))
        i += 1
"""


@pytest.mark.parametrize("flush_every", [1, 7])
def test_killed_writer_leaves_whole_lines_and_at_most_one_torn(tmp_path, flush_every):
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path), str(flush_every)], cwd=os.getcwd())
    path = runfolder.rank_path(tmp_path, 0)
    try:
        deadline = time.monotonic() + 20
        while (not path.exists() or path.stat().st_size < 200_000) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    rt = runfolder.read_rank_file(path)
    assert len(rt.events) > 1000
    assert rt.events == [Compute(i, i + 1, 0) for i in range(len(rt.events))]
    # killed mid-line (nearly always) or, rarely, between two whole lines
    assert len(rt.warnings) <= 1
    assert all(w.line == len(rt.events) + 1 for w in rt.warnings)
