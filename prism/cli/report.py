"""``python -m prism report RUN``: argument parsing and printing over
``prism.app.report`` (Perfetto, Gantt plot, Chakra ET timelines of a run)."""

from __future__ import annotations

import argparse
import sys

from prism.app.errors import PrismError
from prism.app.predict import DEFAULT_PROFILE
from prism.app.report import ReportConfig, report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory (a PrismTrace capture)")
    p.add_argument("--perfetto", metavar="FILE.json",
                   help="write a Chrome trace JSON, gzipped if FILE ends in .gz (open it in ui.perfetto.dev)")
    p.add_argument("--plot", metavar="FILE.png", help="write a per-rank Gantt chart and breakdown (needs matplotlib)")
    p.add_argument("--chakra", metavar="DIR", help="write Chakra execution traces DIR/PREFIX.RANK.et (needs protobuf)")
    p.add_argument("--chakra-prefix", default="prism", metavar="PREFIX", help="file name prefix of the Chakra traces")
    p.add_argument("--net", default=None, metavar="PROFILE",
                   help=f"communication cost profile for the replay: a TOML path, a bundled name, or 'zero' "
                        f"(default: {DEFAULT_PROFILE}; with --comm measured, the profile predict picks for the "
                        "run, pricing what was not measured); with --recorded it only splits held time into "
                        "transfer and waiting")
    p.add_argument("--recorded", action="store_true",
                   help="use the recorded timestamps instead of the replay's predicted times")
    p.add_argument("--calibration", default="auto", metavar="auto|on|off|NAME",
                   help="the replay's compute durations, as predict's: auto (the default: the run's newest "
                        "`prism calibrate` if it has one), on, off (as captured) or a calibration's --name")
    from prism.cli.commtime import add_comm_argument

    add_comm_argument(p)
    p.add_argument("--ranks", metavar="LIST",
                   help="Perfetto trace: only these ranks, e.g. 0-7,64 (default: all; a viewer struggles with "
                        "thousands)")
    p.add_argument("--steps", metavar="FIRST[:LAST]",
                   help="plot only these steps (inclusive), e.g. 2: to skip warm-up (default: the whole run)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    config = ReportConfig(run=args.run, perfetto=args.perfetto, plot=args.plot, chakra=args.chakra,
                          chakra_prefix=args.chakra_prefix, net=args.net, recorded=args.recorded, ranks=args.ranks,
                          steps=args.steps, calibration=args.calibration, comm=args.comm)
    try:
        done = report(config)
    except PrismError as e:
        print(f"prism report: {e}", file=sys.stderr)
        return e.exit_code
    tl = done.timeline
    print(f"prism report: {tl.source} timeline of {args.run} ({tl.graph.world_size} ranks, "
          f"cost model {tl.costs.model.name}); wrote:")
    for w in done.wrote:
        print(f"  {w}")
    return 0
