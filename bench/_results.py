"""Shared by the benchmarks: where a benchmark writes by default, and the per-call timer.

Where a benchmark writes by default: ``bench/results/<benchmark>-<YYYY-MM-DD>[-<machine>].<ext>``
(today's UTC date; the machine from ``$BENCH_MACHINE``, e.g. ``vm``, ``h200cpu``, ``h200x2``). See
bench/README.md for the naming of result files."""

from __future__ import annotations

import json
import os
import pathlib
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def result_path(benchmark: str, ext: str = "json") -> pathlib.Path:
    machine = os.environ.get("BENCH_MACHINE", "")
    name = f"{benchmark}-{time.strftime('%Y-%m-%d', time.gmtime())}" + (f"-{machine}" if machine else "")
    return RESULTS / f"{name}.{ext}"


def write_json(path: str | os.PathLike[str], doc: object, say: bool = True) -> None:
    """Write a benchmark's results (indented JSON, its folder made; replaced
    whole, so a reader never sees half a file) and, with ``say``, where."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)
    if say:
        print(f"wrote {path}")


def per_call_us(fn, n: int) -> float:
    """Microseconds per call of ``fn``: the best of 3 rounds of ``n`` calls
    (the round least disturbed by other processes)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n / 1000)
    return best
