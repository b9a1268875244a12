"""``python -m prism trace ...``: inspect a PrismTrace run (a thin shell over
``prism.core.trace``)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_command", metavar="SUBCOMMAND", required=True)
    s = sub.add_parser("summary", help="per-rank and per-group counts of a run")
    s.add_argument("run", help="run directory")
    s.set_defaults(func=_summary)
    v = sub.add_parser("validate", help="check every record of a run; exit 1 on errors")
    v.add_argument("run", help="run directory")
    v.set_defaults(func=_validate)


def _summary(args: argparse.Namespace) -> int:
    raise NotImplementedError


def _validate(args: argparse.Namespace) -> int:
    raise NotImplementedError
