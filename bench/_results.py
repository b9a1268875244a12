"""Where a benchmark writes by default: ``bench/results/<benchmark>-<YYYY-MM-DD>[-<machine>].<ext>``
(today's UTC date; the machine from ``$BENCH_MACHINE``, e.g. ``vm``, ``h200cpu``, ``h200x2``). See
bench/README.md for the naming of result files."""

from __future__ import annotations

import os
import pathlib
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def result_path(benchmark: str, ext: str = "json") -> pathlib.Path:
    machine = os.environ.get("BENCH_MACHINE", "")
    name = f"{benchmark}-{time.strftime('%Y-%m-%d', time.gmtime())}" + (f"-{machine}" if machine else "")
    return RESULTS / f"{name}.{ext}"
