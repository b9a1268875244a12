"""``python -m prism trace ...``: inspect a PrismTrace run (argument parsing and
printing over ``prism.app.trace``).

Exit status: 0 on success; ``validate`` exits 1 when the run breaks a rule;
both exit 2 when the directory cannot be read as a run at all (no manifest,
unknown major version).
"""

from __future__ import annotations

import argparse
import sys

from prism.app import trace as app_trace
from prism.app.errors import PrismError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_command", metavar="SUBCOMMAND", required=True)
    s = sub.add_parser("summary", help="per-rank and per-group counts of a run")
    s.add_argument("run", help="run directory")
    s.set_defaults(func=summary)
    v = sub.add_parser("validate", help="check every record of a run; exit 1 on errors")
    v.add_argument("run", help="run directory")
    v.set_defaults(func=validate)


def _read(path: str):
    """The run, or None after saying why it cannot be read."""
    try:
        return app_trace.read(path)
    except PrismError as e:
        print(f"prism trace: {e}", file=sys.stderr)
        return None


def summary(args: argparse.Namespace) -> int:
    run = _read(args.run)
    if run is None:
        return 2
    print(app_trace.summary_text(run))
    return 0


def validate(args: argparse.Namespace) -> int:
    run = _read(args.run)
    if run is None:
        return 2
    checked = app_trace.validate(run)
    print(checked.text())
    return 0 if checked.ok else 1
