"""A campaign's files: the append-only log of finished points, its tables, its plot.

``ResultLog`` is ``OUT/points.jsonl``: one JSON row per finished point,
appended and fsynced before the next point starts, so a campaign killed at
any moment keeps every point it finished and loses at most the one it was
running. A torn last line (the kill came mid-write) is ignored on reading
and cut off before the next append. ``write_tables`` writes the rows as
``results.csv`` and ``results.json``; ``write_plot`` draws ``plot.png`` with
matplotlib's object API (no pyplot state, no GUI backend).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ResultLog", "write_tables", "write_plot", "CSV_COLUMNS"]

#: The CSV's columns around the dimensions (which come after ``status``).
CSV_COLUMNS = ("index", "key", "step", "status")
CSV_TAIL = ("world_size", "iteration_ms", "peak_memory_gib", "peak_memory_rank", "memory_status",
            "memory_over_gib", "message", "started_utc", "wall_s")


class ResultLog:
    """``points.jsonl`` of one campaign's output folder."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def read(self) -> dict[str, dict]:
        """Key -> the last row written for it (torn or foreign lines skipped)."""
        rows: dict[str, dict] = {}
        if not self.path.is_file():
            return rows
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("key"), str):
                rows[row["key"]] = row
        return rows

    def _cut_torn_tail(self) -> None:
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def append(self, row: Mapping[str, Any]) -> None:
        """Write one row and make it durable before returning."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._cut_torn_tail()
        line = json.dumps(row, sort_keys=False, default=str) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return v


def write_tables(rows: Sequence[Mapping[str, Any]], dims: Sequence[str], out_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``results.csv`` (one line per point: its dimensions and results) and
    ``results.json`` (the rows as logged); returns their paths."""
    out = Path(out_dir)
    csv_path, json_path = out / "results.csv", out / "results.json"
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow([*CSV_COLUMNS, *dims, *CSV_TAIL])
        for r in rows:
            d = r.get("dims", {})
            w.writerow([_cell(r.get(c)) for c in CSV_COLUMNS] + [_cell(d.get(k)) for k in dims]
                       + [_cell(r.get(c)) for c in CSV_TAIL])
    json_path.write_text(json.dumps(list(rows), indent=1, default=str) + "\n", encoding="utf-8")
    return csv_path, json_path


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def write_plot(rows: Sequence[Mapping[str, Any]], x: str, y: str, series: Sequence[str], title: str,
               path: str | os.PathLike[str]) -> Path:
    """One line per ``series`` combination of ``y`` against the dimension
    ``x``; points that ran out of memory are red crosses, failed points are
    left out. Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure

    usable = [r for r in rows if r.get("status") in ("ok", "oom") and _num(r.get(y))]
    xs_all = [r["dims"].get(x) for r in usable]
    numeric = all(_num(v) for v in xs_all)
    cats = sorted(set(map(str, xs_all)), key=str) if not numeric else []
    fig = Figure(figsize=(8, 5), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in usable:
        name = ", ".join(f"{s}={r['dims'].get(s)}" for s in series) or y
        groups.setdefault(name, []).append(r)
    oom_label = "out of memory"
    for name, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["dims"].get(x) if numeric else cats.index(str(r["dims"].get(x))))
        xv = [r["dims"].get(x) if numeric else cats.index(str(r["dims"].get(x))) for r in rs]
        ax.plot(xv, [r[y] for r in rs], marker="o", label=name)
        bad = [(a, r[y]) for a, r in zip(xv, rs) if r.get("status") == "oom"]
        if bad:
            ax.scatter([a for a, _ in bad], [b for _, b in bad], marker="x", s=90, color="#C44E52", zorder=3,
                       label=oom_label)
            oom_label = None
    if numeric and xs_all and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 8:
        ax.set_xscale("log", base=2)
    if cats:
        ax.set_xticks(range(len(cats)), cats, rotation=20)
    ax.set_xlabel(x)
    ax.set_ylabel({"iteration_ms": "iteration time (ms)", "peak_memory_gib": "peak memory (GiB)"}.get(y, y))
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if groups:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no point has a result to plot", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)
