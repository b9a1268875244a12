"""``python -m prism predict RUN``: argument parsing and printing over
``prism.app.predict``."""

from __future__ import annotations

import argparse
import json
import sys

from prism.app.errors import PrismError
from prism.app.predict import DEFAULT_PROFILE, PredictConfig, predict
from prism.core.replay import DEFAULT_WARMUP
from prism.core.whatif import WhatIf, WhatIfError, parse_link, parse_straggler, parse_throttle


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory (a PrismTrace capture)")
    p.add_argument("--net", default=None, metavar="PROFILE",
                   help="communication cost profile: a TOML path, a bundled name, or 'zero' (default: the profile "
                        "`prism netprofile` fitted for the run's backend and host, ~/.cache/prism/profiles/"
                        f"BACKEND-HOST.toml, if there is one, else the shipped {DEFAULT_PROFILE})")
    p.add_argument("--scale-dp", type=int, default=None, metavar="N",
                   help="predict the run grown to data-parallel degree N (replicas copied; see prism.core.scaleout)")
    p.add_argument("--layout", default=None, metavar="tp=T,pp=P,dp=D[,ep=E]",
                   help="the captured run's layout for --scale-dp (default: the manifest's, from --tp/--pp/--dp flags)")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                   help=f"steps dropped before averaging iteration times (default: {DEFAULT_WARMUP})")
    p.add_argument("--calibration", default="auto", metavar="auto|on|off|NAME",
                   help="compute durations: auto (the default: the newest `prism calibrate` of the run if it has "
                        "one, else as captured), on (the newest, required), off (as captured) or a calibration's "
                        "--name; calibration wins where the capture had more ranks than free cores and ties elsewhere")
    from prism.cli.commtime import add_comm_argument

    add_comm_argument(p)
    w = p.add_argument_group("what-if knobs (prism.core.whatif)")
    w.add_argument("--straggler", action="append", default=[], metavar="RANK:PCT",
                   help="rank RANK computes PCT%% slower (repeatable), e.g. 3:20")
    w.add_argument("--throttle", default=None, metavar="RANKS:PCT",
                   help="the GPUs of RANKS (0,3 / 0-7 / all) run PCT%% below their clock: device work x 1/(1-PCT/100)")
    w.add_argument("--link-slowdown", default=None, metavar="X[:TIER]",
                   help="links X times slower (bandwidth / X, latency x X); TIER: all (default), intra or inter")
    w.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                   help="a GPU of GIB: OOM when a rank's traced peak plus --memory-overhead exceeds it (exit 3)")
    w.add_argument("--memory-overhead", type=float, default=0.6, metavar="GIB",
                   help="of --memory-limit, what the real job holds outside torch's allocator (default 0.6)")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.set_defaults(func=main)


def whatif_of(args: argparse.Namespace) -> WhatIf | None:
    """The what-if knobs of the command line (None: none given); raises WhatIfError."""
    if not (args.straggler or args.throttle or args.link_slowdown or args.memory_limit is not None):
        return None
    return WhatIf(straggler=tuple(parse_straggler(s) for s in args.straggler),
                  throttle=parse_throttle(args.throttle) if args.throttle else None,
                  link=parse_link(args.link_slowdown) if args.link_slowdown else None,
                  memory_limit_gib=args.memory_limit, memory_overhead_gib=args.memory_overhead)


def main(args: argparse.Namespace) -> int:
    try:
        whatif = whatif_of(args)
    except WhatIfError as e:
        print(f"prism predict: {e}", file=sys.stderr)
        return 2
    config = PredictConfig(run=args.run, net=args.net, scale_dp=args.scale_dp, layout=args.layout,
                           warmup=args.warmup, calibration=args.calibration, comm=args.comm, whatif=whatif)
    try:
        prediction = predict(config)
    except PrismError as e:
        print(f"prism predict: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps(prediction.summary(), indent=2) if args.json else prediction.text())
    return 3 if prediction.oom else 0
