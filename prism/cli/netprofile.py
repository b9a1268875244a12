"""``python -m prism netprofile``: measure the local gloo or NCCL backend and
fit a cost profile; argument parsing and printing over ``prism.app.netprofile``."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from prism.app.errors import PrismError
from prism.app.netprofile import (BACKENDS, DEFAULT_OPS, NetprofileConfig, NetprofileResult, plan_netprofile,
                                  run_netprofile, usable_cores)
from prism.core.netfit import issue_per_op


def _size(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in ("K", "M", "G") else t
    if not num.isdigit() or int(num) < 1:
        raise argparse.ArgumentTypeError(f"--sizes takes byte counts like 1K,64K,4M; got {text!r}")
    return int(num) * mult


def _list(parse):
    def run(text: str) -> list:
        return [parse(x) for x in text.split(",") if x.strip()]
    return run


def add_arguments(p: argparse.ArgumentParser) -> None:
    cores = usable_cores()
    p.add_argument("--backend", choices=BACKENDS, default="gloo",
                   help="gloo: CPU tensors, one process per core (default); nccl: CUDA tensors, one process per GPU "
                        "(each call's GPU time and its CPU issue cost, measured apart)")
    p.add_argument("--out", default=None, metavar="FILE.toml",
                   help="where to write the profile (default: ~/.cache/prism/profiles/BACKEND-HOST.toml, "
                        "or $PRISM_PROFILE_DIR/BACKEND-HOST.toml; `prism predict` looks there)")
    p.add_argument("--sizes", type=_list(_size), default=None,
                   help="bytes per rank, e.g. 1K,16K,1M (default gloo: 1K,16K,128K,1M,4M,16M; nccl: up to 256M)")
    p.add_argument("--group-sizes", type=_list(int), default=None,
                   help=f"group sizes to measure, each at most the core count ({cores}; nccl: the GPU count) "
                        "(default: powers of 2 up to it)")
    p.add_argument("--ops", type=_list(str), default=list(DEFAULT_OPS),
                   help=f"ops to measure (default: {','.join(DEFAULT_OPS)}; send is a ping-pong between 2 ranks)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the points and fit as JSON")
    p.add_argument("--concurrent", type=int, default=None, metavar="W",
                   help="gloo: time each group size on W ranks with all W/n groups of it at once (as a training "
                        "layout's groups run together) instead of one group alone; sizes must divide W")
    p.add_argument("--gap-us", type=float, default=0.0, metavar="US",
                   help="gloo: time each call after US microseconds of the caller's own work (a spin to a slot "
                        "the ranks agree on), as a training step's calls come after its compute, instead of back "
                        "to back (default 0: back to back)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    config = NetprofileConfig(backend=args.backend, out=args.out, sizes=args.sizes, group_sizes=args.group_sizes,
                              ops=tuple(args.ops), json_out=args.json, concurrent=args.concurrent,
                              gap_us=args.gap_us)
    try:
        plan = plan_netprofile(config)
    except PrismError as e:
        print(f"prism netprofile: {e}", file=sys.stderr)
        return e.exit_code
    print(f"prism netprofile: {plan.backend}, {plan.concurrent or max(plan.group_sizes)} processes"
          f"{' (all groups of a size at once)' if plan.concurrent else ''}"
          f"{f', each call after {plan.gap_us:g} us of work' if plan.gap_us else ''}, group sizes "
          f"{list(plan.group_sizes)}, ops {','.join(plan.ops)}, sizes {','.join(map(str, plan.sizes))} bytes",
          file=sys.stderr)
    result = run_netprofile(plan)
    print(format_result(result))
    return 0


def format_result(result: NetprofileResult) -> str:
    """The measured points against the fit, the fits, and where the profile went."""
    points, fit, per_op = result.points, result.fit, result.per_op
    one, err = result.errors_one, result.errors_per_op
    lines = [f"{'op':<24} {'ranks':>5} {'bytes':>10} {'measured us':>12} {'per-op fit':>12} {'rel err':>8}"]
    for p, t, e in zip(points, result.predicted, err):
        lines.append(f"{p.op:<24} {p.n:>5} {p.nbytes:>10} {p.seconds * 1e6:>12.1f} {t * 1e6:>12.1f} {e:>8.1%}")
    lines.append(f"one fit for all ops: base latency {fit.base_latency * 1e6:.2f} us, per-step latency "
                 f"{fit.latency * 1e6:.2f} us, bandwidth {fit.bandwidth / 1e9:.3f} GB/s; relative error median "
                 f"{np.median(one):.1%}, max {np.max(one):.1%} over {len(points)} points ({result.wall_s:.0f} s)")
    for op, f in sorted(per_op.items()):
        e = [x for p, x in zip(points, err) if p.op == op]
        lines.append(f"  {op:<24} base {f.base_latency * 1e6:8.2f} us, step {f.latency * 1e6:8.2f} us, "
                     f"{f.bandwidth / 1e9:9.3f} GB/s; error median {np.median(e):.1%}, max {np.max(e):.1%}")
    lines.append(f"per-op fits (written as [ops.*], used by predict): relative error median {np.median(err):.1%}, "
                 f"max {np.max(err):.1%}")
    for op, v in sorted(issue_per_op(points).items()):
        lines.append(f"  {op:<24} CPU issue {v * 1e6:8.2f} us per call (median over sizes)")
    lines.append(f"wrote {result.plan.out}")
    return "\n".join(lines)
