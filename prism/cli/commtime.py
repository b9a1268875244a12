"""``python -m prism commtime RUN``: argument parsing and printing over ``prism.app.commtime``."""

from __future__ import annotations

import argparse
import json
import sys

from prism.app.errors import PrismError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory of a CPU (gloo) `prism capture`")
    p.add_argument("--name", default=None, help="stored in RUN/commtime/NAME (default: the date and time)")
    p.add_argument("--net", default=None, metavar="PROFILE",
                   help="the cost profile the summary compares with, as for `prism predict`")
    p.add_argument("--passes", type=int, default=2,
                   help="times the program runs; every pass but the first is kept and each call's time is their mean "
                        "(default 2: the first sets up gloo's connections; more passes, less of one pass's noise)")
    p.add_argument("--calibration", default="auto", metavar="auto|on|off|NAME",
                   help="the compute durations the skeleton spins for, as for `prism predict` (default auto)")
    p.add_argument("--cores", type=int, default=None,
                   help="most ranks allowed (default: this machine's usable cores; one core per rank)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the skeleton job may take (default 600)")
    p.add_argument("--json", action="store_true", help="print the measurement's manifest as JSON")
    p.set_defaults(func=main)


def add_comm_argument(p: argparse.ArgumentParser) -> None:
    """``--comm`` of predict, emulate, run and report: the cost model's times or a stored in-situ measurement."""
    p.add_argument("--comm", default="model", metavar="model|measured|NAME",
                   help="communication times: model (the default: the cost profile's), measured (the newest "
                        "`prism commtime RUN`: the capture's own calls run for real on a CPU host) or a "
                        "measurement's --name; the captured graph only (not with --scale-dp)")


def main(args: argparse.Namespace) -> int:
    from prism.app.commtime import CommtimeConfig, commtime

    config = CommtimeConfig(run=args.run, name=args.name, net=args.net, passes=args.passes, timeout=args.timeout,
                            calibration=args.calibration, cores=args.cores)
    try:
        result = commtime(config)
    except PrismError as e:
        print(f"prism commtime: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps(result.manifest, indent=1) if args.json else result.format())
    return 0
