"""Captures that tests in several modules read: one ``prism capture`` a session.

A capture of the bundled GPT is deterministic in what the tests check (groups,
collectives, values, payload digests), so where modules capture the same
command with the same flags they share one run (the suite's time) through the
session fixture ``shared_captures`` (tests/conftest.py). A shared run folder
is read-only: a test that writes into one (``prism emulate`` writes
``RUN/emulation/``) works on :meth:`SharedCaptures.copy`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: GPT tp2 x pp2 x dp2 (world 8), small: test_emulate (recording ranks 0, 4 and 5), test_record, test_hybrid_capture.
GPT_W8_SMALL = ["-m", "prism.workloads.gpt", "--tp", "2", "--pp", "2", "--dp", "2",
                "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--steps", "3"]
#: The flags those modules capture GPT_W8_SMALL with.
RECORD_045 = ("--record", "0,4,5")


def gpt_tiny(dp: int) -> list[str]:
    """GPT tp2 x pp2 x dp ``dp``, tiny (world 4 dp): test_real_captures' scale-out pair and test_capture's world 16."""
    return ["-m", "prism.workloads.gpt", "--tp", "2", "--pp", "2", "--dp", str(dp), "--layers", "2",
            "--hidden", "16", "--heads", "2", "--seq-len", "8", "--steps", "2"]


class SharedCaptures:
    """Each (world, command, flags) captured once per session under ``base``."""

    def __init__(self, base: Path):
        self.base = base
        self.cache: dict[tuple, tuple[subprocess.CompletedProcess, Path]] = {}

    def get(self, world: int, command: list[str], *extra: str,
            timeout: float = 600) -> tuple[subprocess.CompletedProcess, Path]:
        """The capture's process (check its return code) and run folder (read it only)."""
        key = (world, tuple(command), extra)
        if key not in self.cache:
            run_dir = self.base / f"run-{len(self.cache)}"
            proc = subprocess.run(
                [sys.executable, "-m", "prism", "capture", "-n", str(world), "--out", str(run_dir),
                 "--progress", "off", "--show-ranks", "none", *extra, "--", *command],
                capture_output=True, text=True, timeout=timeout, cwd=self.base,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)),
            )
            self.cache[key] = (proc, run_dir)
        return self.cache[key]

    def copy(self, dest: Path, world: int, command: list[str], *extra: str) -> Path:
        """A private copy of the capture's run folder at ``dest``, to write into; fails if the capture did."""
        proc, run_dir = self.get(world, command, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        shutil.copytree(run_dir, dest)
        return dest


__all__ = ["GPT_W8_SMALL", "RECORD_045", "SharedCaptures", "gpt_tiny"]
