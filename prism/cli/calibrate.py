"""``python -m prism calibrate RUN``: argument parsing and printing over ``prism.app.calibrate``."""

from __future__ import annotations

import argparse
import json
import sys

from prism.app.errors import PrismError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory of a `prism capture`")
    p.add_argument("--slices", default="auto", metavar="auto|tp|pp|gang|pairs|R0,R1;R2,R3",
                   help="how ranks are grouped into slices, each run for real against the bare graph: the TP "
                        "groups, the pipelines, a DP replica's TP x PP block, pairs, or explicit slices; auto "
                        "(default): the TP groups if any, else the pipelines, else pairs")
    p.add_argument("--symmetric", action="store_true",
                   help="run one slice per class of equivalent ranks (same TP rank, PP stage, EP rank) and copy "
                        "its durations to the class")
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                   help="run slices together, as many as --cores holds, so the machine is as loaded as in the "
                        "job (an idle machine computes faster than a full one); the default except with --agents. "
                        "--no-pack: one slice at a time")
    p.add_argument("--name", default=None, help="stored in RUN/calibration/NAME (default: the date and time)")
    p.add_argument("--net", default=None, metavar="PROFILE", help="cost profile, as for `prism predict`")
    p.add_argument("--cores", type=int, default=None,
                   help="most ranks a slice may hold (default: this machine's usable cores; for a capture that "
                        "ran on GPUs, the GPUs given by --gpus: one sandbox rank per GPU; more than that makes "
                        "sandboxes share a GPU and time-share it)")
    p.add_argument("--gpus", default=None, metavar="0[,1,...]",
                   help="a CUDA capture's slices run their sandbox ranks on these GPUs, one per GPU, as `prism "
                        "emulate --gpus` (default: GPU 0, so one rank per slice; not with --agents, whose nodes "
                        "offer their own)")
    p.add_argument("--layout", default=None, metavar="tp=T,pp=P,dp=D[,ep=E]",
                   help="the run's layout when the manifest has none")
    p.add_argument("--warmup", type=int, default=1, help="steps dropped before averaging (default: 1)")
    p.add_argument("--resume", action="store_true",
                   help="finish the calibration --name that an interruption or a failed slice stopped: the slices "
                        "it measured are kept, the others run (failed attempts' folders are kept too)")
    p.add_argument("--json", action="store_true", help="print the calibration's manifest as JSON")
    p.add_argument("--replace-clean", action="store_true",
                   help="replace every CPU-timed segment by its slice's measurement, also those the capture ran "
                        "undisturbed (its main thread on a CPU for 95%% of the segment or more), which are kept "
                        "by default")
    from prism.cli.agent import add_agent_options

    add_agent_options(p, "run each slice's ranks through `prism agent --runs 0` on other nodes (N slices at a "
                         "time, one per node, in one emulation; the run directory on a shared filesystem)",
                      "wait for N agents at each round of N slices and put each slice on a node of its own",
                      listen_help="where the agents join",
                      wait_help="how long each slice waits for the agents to join (default 60)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from prism.app.calibrate import CalibrateConfig, calibrate

    config = CalibrateConfig(run=args.run, slices=args.slices, symmetric=args.symmetric, pack=args.pack,
                             name=args.name,
                             net=args.net, cores=args.cores, gpus=args.gpus, layout=args.layout, warmup=args.warmup,
                             agents=args.agents, listen=args.listen, keys=args.keys, insecure=args.insecure,
                             agent_wait_s=args.agent_wait, keep_clean=not args.replace_clean,
                             resume=args.resume)
    try:
        result = calibrate(config)
    except PrismError as e:
        print(f"prism calibrate: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps(result.manifest, indent=2) if args.json else result.text())
    return 0
