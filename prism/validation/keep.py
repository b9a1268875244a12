"""Keep a benchmark's capture for later study: its graph (rank traces and
manifest) without what is large or only useful live (recorded payloads, logs,
emulations, calibrations, sockets). With the truth's step times stored beside
it in the benchmark's JSON, a kept capture can be replayed offline under
another cost model, as ``bench/two_clock_check.py`` does for the GPU captures.
"""

from __future__ import annotations

import pathlib
import shutil

from prism.shell import runfolder

_LEFT_OUT = (runfolder.PAYLOADS_DIR, runfolder.LOGS_DIR, runfolder.EMULATION_DIR, runfolder.CALIBRATION_DIR,
             runfolder.PREDICTIONS_DIR, "*.sock", "*.bin")


def keep_capture(run: pathlib.Path, root: str | pathlib.Path, name: str) -> str:
    """Copy the capture ``run`` to ``root/name`` (a fresh folder: ``name-2``,
    ... if taken) without payloads, logs, emulations and calibrations; returns
    the folder's name under ``root``."""
    root = pathlib.Path(root)
    root.mkdir(parents=True, exist_ok=True)
    dst, k = root / name, 1
    while dst.exists():
        k += 1
        dst = root / f"{name}-{k}"
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns(*_LEFT_OUT))
    return dst.name
