"""``python -m prism predict RUN``: argument parsing and printing over
``prism.app.predict``."""

from __future__ import annotations

import argparse
import json
import sys

from prism.app.errors import PrismError
from prism.app.predict import DEFAULT_PROFILE, PredictConfig, predict
from prism.core.replay import DEFAULT_WARMUP


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
    p.add_argument("--calibration", default="off", metavar="off|on|NAME",
                   help="compute durations: off (as captured, the default; calibration wins on a capture with more "
                        "ranks than cores, not on every clean one), on (the newest `prism calibrate` of the run) or a calibration's --name")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    config = PredictConfig(run=args.run, net=args.net, scale_dp=args.scale_dp, layout=args.layout,
                           warmup=args.warmup, calibration=args.calibration)
    try:
        prediction = predict(config)
    except PrismError as e:
        print(f"prism predict: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps(prediction.summary(), indent=2) if args.json else prediction.text())
    return 0
