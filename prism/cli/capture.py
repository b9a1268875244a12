"""``python -m prism capture | coordinator | demo``: argument parsing and
printing over ``prism.app.capture``.

``capture`` exits with the capture's status: 0 when every rank finished, 1
on a mismatch, a deadlock or a failed rank (the trace so far is kept and
valid), 2 on bad arguments, 3 when a rank ran out of GPU memory.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prism.app import capture as app_capture
from prism.app import predict as app_predict
from prism.app import trace as app_trace
from prism.app.errors import PrismError
from prism.core import payloads as PL
from prism.core import trace as T


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {value}")
        return value

    return parse


def _show_ranks(text: str) -> str | tuple[int, ...]:
    if text in ("all", "none"):
        return text
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--show-ranks takes all, none or a list like 0,3,7; got {text!r}") from None


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slots", type=_positive("--slots"), default=None,
                   help="ranks that may compute at once (default: the number of cores)")
    p.add_argument("--nproc-per-node", type=_positive("--nproc-per-node"), default=8,
                   help="ranks per emulated node, for LOCAL_RANK (default 8, as torchrun on an 8-GPU node)")
    p.add_argument("--show-ranks", type=_show_ranks, default=(0,),
                   help="whose output to show on the console besides failing ranks: all, none or 0,3,7 (default 0)")
    p.add_argument("--quiet-period", type=float, default=30.0, metavar="S",
                   help="report a deadlock after S seconds without progress (default 30)")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress line on stderr (default auto)")


def add_capture_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", "-n", type=_positive("--world-size"), required=True,
                   help="number of logical ranks")
    p.add_argument("--out", "-o", default=None, help="run directory (default runs/capture-TIMESTAMP)")
    p.add_argument("--coordinator", default=None, metavar="ENDPOINT",
                   help="join a coordinator started with `prism coordinator` instead of an embedded one")
    _add_common(p)
    from prism.cli.agent import add_agent_options

    add_agent_options(p, "serve the ranks through `prism agent` on each node (a shared run directory)",
                      "wait for N agents and spread the ranks over them in contiguous blocks (whole TP groups "
                      "per node)", agents_type=_positive("--agents"))
    g = p.add_argument_group("GPUs", "ranks share physical GPUs; logical devices 0..nproc-per-node-1 map onto them")
    g.add_argument("--gpus", default=None, metavar="LIST",
                   help="physical GPUs to use, e.g. 0 or 0,1 (default: all, when the command uses cuda)")
    g.add_argument("--resident", type=_positive("--resident"), default=None, metavar="K",
                   help="ranks resident per GPU; the others are checkpointed to host memory (default: all that "
                        "fit in free GPU memory at --rank-memory each)")
    g.add_argument("--gang", choices=("1", "tp", "tpxpp"), default=None,
                   help="ranks swapped together: 1, the TP group, or TP x PP (a pipeline); default tp")
    g.add_argument("--rank-memory", type=float, default=2.0, metavar="GIB",
                   help="estimated GPU memory per rank for the default --resident (default 2)")
    g.add_argument("--simulate-swaps", type=float, default=None, nargs="?", const=0.0, metavar="SECONDS",
                   help="CPU dry run of --resident/--gang: ranks run on CPU as if they shared GPU 0 (or --gpus); "
                        "a swapped-out rank is stopped (SIGSTOP) until swapped in, optionally SECONDS per swap; "
                        "reports the swaps per iteration the GPU capture would make")
    g.add_argument("--swap-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="through --agents with --resident: how long one swap may take on its node before the "
                        "capture stops, naming the node and the rank (default 600)")
    g.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                   help="emulate a GPU of GIB GiB for every rank (e.g. 80 on a 141 GB H200): torch's allocator gets "
                        "GIB less --memory-overhead, and a request past it raises OutOfMemoryError in the rank")
    g.add_argument("--memory-overhead", type=float, default=app_capture.DEFAULT_MEMORY_OVERHEAD_GIB, metavar="GIB",
                   help="of --memory-limit, what the real job's GPU holds outside torch's allocator and Prism's "
                        "ranks do not: the CUDA context, NCCL's buffers (default "
                        f"{app_capture.DEFAULT_MEMORY_OVERHEAD_GIB}: the context; add ~0.8-1.5 for NCCL)")
    r = p.add_argument_group("recorded payloads", "keep what chosen ranks receive, for emulation (PrismTrace 1.3)")
    r.add_argument("--record", default=None, metavar="RANKS",
                   help="ranks whose received tensors (collective outputs, receives) are stored under "
                        "RUN/payloads/, with a digest of every tensor they send: 0,5 or 0-3 or all")
    r.add_argument("--record-steps", default=None, metavar="STEPS",
                   help="record only these iterations, e.g. 1-2 or 0,3- (default: all)")
    r.add_argument("--value-limit", type=int, default=T.DEFAULT_SMALL_TENSOR_LIMIT, metavar="BYTES",
                   help="tensors up to this many bytes have their values in the trace (value records; default "
                        f"{T.DEFAULT_SMALL_TENSOR_LIMIT}); 0 keeps none, for large worlds whose trace would be mostly "
                        "values")
    r.add_argument("--record-limit", type=float, default=PL.DEFAULT_RECORD_LIMIT / 2**30, metavar="GIB",
                   help="stop recording (with a warning; what was kept stays valid) before the stored tensors "
                        f"pass GIB GiB, all ranks together (default {PL.DEFAULT_RECORD_LIMIT / 2**30:g})")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- SCRIPT ARGS, or -- -m MODULE ARGS")
    p.set_defaults(func=run_capture)


def add_coordinator_arguments(p: argparse.ArgumentParser) -> None:
    from prism.cli import daemon

    p.add_argument("--listen", default=None, metavar="ENDPOINT",
                   help="ipc://PATH or tcp://127.0.0.1:PORT (required for one capture; the daemon's default is "
                        "ipc://STATE/daemon.sock)")
    p.add_argument("--world-size", "-n", type=_positive("--world-size"), default=None,
                   help="ranks of the one capture (required without --daemon)")
    p.add_argument("--out", "-o", default=None, help="run directory (default runs/capture-TIMESTAMP)")
    p.add_argument("--slots", type=_positive("--slots"), default=None,
                   help="ranks that may compute at once (the daemon: slots it owns); default the number of cores")
    p.add_argument("--quiet-period", type=float, default=30.0, metavar="S")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto")
    daemon.add_daemon_arguments(p)
    p.set_defaults(func=run_coordinator)


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", "-o", default=None, help="run directory (default runs/demo-TIMESTAMP)")
    p.add_argument("--slots", type=_positive("--slots"), default=None)
    p.add_argument("--steps", type=_positive("--steps"), default=3)
    p.set_defaults(func=run_demo)


def run_capture(args: argparse.Namespace) -> int:
    config = app_capture.CaptureConfig(
        world_size=args.world_size, command=args.command, out=args.out, slots=args.slots,
        coordinator=args.coordinator, nproc_per_node=args.nproc_per_node, show_ranks=args.show_ranks,
        quiet_s=args.quiet_period, progress=args.progress, gpus=args.gpus, resident=args.resident, gang=args.gang,
        rank_memory_gib=args.rank_memory, simulate_swaps=args.simulate_swaps, swap_timeout_s=args.swap_timeout, memory_limit_gib=args.memory_limit,
        memory_overhead_gib=args.memory_overhead, record=args.record, record_steps=args.record_steps,
        record_limit_gib=args.record_limit, small_tensor_limit=args.value_limit, agents=args.agents,
        listen=args.listen, keys=args.keys, insecure=args.insecure, agent_wait_s=args.agent_wait)
    try:
        plan = app_capture.plan_capture(config)
    except PrismError as e:
        print(f"prism capture: error: {e}", file=sys.stderr)
        return e.exit_code
    for note in plan.notes:
        print(f"prism capture: note: {note}", file=sys.stderr)
    return _captured(plan)


def _captured(plan) -> int:
    try:
        outcome = app_capture.capture(plan)
    except PrismError as e:
        print(f"prism capture: {e}", file=sys.stderr)
        return e.exit_code
    print(outcome.text(), file=sys.stderr)
    return outcome.exit_code


def run_coordinator(args: argparse.Namespace) -> int:
    if args.daemon:
        from prism.cli import daemon

        if args.world_size is not None or args.out is not None:
            print("prism coordinator: error: --world-size and --out are for one capture; the daemon takes jobs "
                  "(`prism submit -- capture -n N --out RUN -- train.py`)", file=sys.stderr)
            return 2
        return daemon.run_daemon(args)
    daemon_only = [f"--{n}" for n in ("state", "gpus", "keys") if getattr(args, n) is not None]
    if daemon_only:
        print(f"prism coordinator: error: {', '.join(daemon_only)} belong to the job daemon: add --daemon",
              file=sys.stderr)
        return 2
    if args.listen is None or args.world_size is None:
        print("prism coordinator: error: one capture's coordinator needs --listen ENDPOINT and --world-size N "
              "(or run the job daemon: --daemon)", file=sys.stderr)
        return 2
    run_dir = Path(args.out) if args.out else app_capture.default_out("capture")

    def listening(endpoint: str) -> None:
        print(f"prism coordinator: listening on {endpoint} for {args.world_size} ranks; "
              f"recording into {run_dir}", file=sys.stderr, flush=True)

    try:
        outcome = app_capture.serve_coordinator(run_dir, args.world_size, args.listen, slots=args.slots,
                                                quiet_s=args.quiet_period, progress=args.progress,
                                                on_listening=listening)
    except PrismError as e:
        print(f"prism coordinator: error: {e}", file=sys.stderr)
        return e.exit_code
    print(outcome.text(), file=sys.stderr)
    return outcome.exit_code


def run_demo(args: argparse.Namespace) -> int:
    run_dir = Path(args.out) if args.out else app_capture.default_out("demo")
    cmd = ["-m", "prism.workloads.gpt", "--tp", "2", "--pp", "2", "--dp", "4", "--steps", str(args.steps)]
    slots = args.slots or os.cpu_count() or 1
    print(f"prism demo: capturing the bundled GPT at world 16 (tp2 x pp2 x dp4) on CPU with {slots} slots "
          f"into {run_dir}", file=sys.stderr, flush=True)
    # Rank 8 (tp 0, dp 0, last stage) prints the losses.
    outcome = app_capture.capture_run(run_dir, 16, cmd, slots=slots, show_ranks=(8,), progress="auto")
    print(outcome.text(), file=sys.stderr)
    if not outcome.ok:
        return outcome.exit_code
    try:
        print(app_trace.summary_text(app_trace.read(run_dir)))
        print(f"\n$ python -m prism predict {run_dir} --warmup 1", flush=True)
        print(app_predict.predict(app_predict.PredictConfig(run=run_dir, warmup=1)).text())
    except PrismError as e:
        print(f"prism demo: {e}", file=sys.stderr)
        return e.exit_code
    return 0
