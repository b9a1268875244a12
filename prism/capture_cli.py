"""``python -m prism capture | coordinator | demo``: the capture shell.

``capture`` makes a run directory, starts an embedded coordinator (or joins
one given with ``--coordinator``), launches one process per logical rank
through the fork server, and exits with the capture's status: 0 when every
rank finished, 1 on a mismatch, a deadlock or a failed rank (the trace so far
is kept and valid), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import socket
import sys
import time
from pathlib import Path

from prism import __version__
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
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- SCRIPT ARGS, or -- -m MODULE ARGS")
    p.set_defaults(func=run_capture)


def add_coordinator_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", required=True, metavar="ENDPOINT",
                   help="ipc://PATH or tcp://127.0.0.1:PORT")
    p.add_argument("--world-size", "-n", type=_positive("--world-size"), required=True)
    p.add_argument("--out", "-o", default=None, help="run directory (default runs/capture-TIMESTAMP)")
    p.add_argument("--slots", type=_positive("--slots"), default=None)
    p.add_argument("--quiet-period", type=float, default=30.0, metavar="S")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto")
    p.set_defaults(func=run_coordinator)


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", "-o", default=None, help="run directory (default runs/demo-TIMESTAMP)")
    p.add_argument("--slots", type=_positive("--slots"), default=None)
    p.add_argument("--steps", type=_positive("--steps"), default=3)
    p.set_defaults(func=run_demo)


def _default_out(prefix: str) -> Path:
    return Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"


def _command(args: argparse.Namespace, parser_error) -> list[str]:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser_error("give the script to run after --, e.g. `prism capture -n 4 -- train.py --lr 1e-3`")
    if cmd[0] == "-m" and len(cmd) < 2:
        parser_error("-m needs a module name, e.g. `-- -m mypkg.train`")
    if cmd[0] != "-m" and not Path(cmd[0]).is_file():
        parser_error(f"script {cmd[0]!r} does not exist (use -m MODULE for a module)")
    return cmd


def _layout(cmd: list[str]) -> tuple[tuple[str, int], ...]:
    """Parallel degrees given as flags (--tp 2 --pp 2 ...), recorded in the manifest."""
    out = []
    for i, word in enumerate(cmd[:-1]):
        m = re.fullmatch(r"--(tp|pp|dp|ep|cp|sp)", word)
        if m and cmd[i + 1].isdigit():
            out.append((m.group(1), int(cmd[i + 1])))
    return tuple(out)


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _manifest(run_dir: Path, world_size: int, cmd: list[str], slots: int, device_kind: str) -> T.Manifest:
    return T.Manifest(
        version=T.TRACE_VERSION, run_id=run_dir.name, world_size=world_size,
        created_unix_ns=time.time_ns(), command=tuple(cmd), device_kind=device_kind,
        prism_version=__version__, torch_version=_torch_version(), hostname=socket.gethostname(),
        layout=_layout(cmd), notes=(("slots", str(slots)),),
    )


def _device_kind(cmd: list[str]) -> str:
    return "cuda" if any(w == "cuda" or w.startswith("cuda:") for w in cmd) else "cpu"


def run_capture(args: argparse.Namespace, parser_error=None) -> int:
    parser_error = parser_error or (lambda msg: (_ for _ in ()).throw(SystemExit(f"prism capture: error: {msg}")))
    cmd = _command(args, parser_error)
    run_dir = Path(args.out) if args.out else _default_out("capture")
    if (run_dir / T.RANKS_DIR).exists() and any((run_dir / T.RANKS_DIR).iterdir()):
        parser_error(f"run directory {run_dir} already holds a capture; choose another --out")
    from prism.gpu_plan import GpuPlanError, plan_gpus

    simulate = getattr(args, "simulate_swaps", None)
    if simulate is not None:
        if _device_kind(cmd) == "cuda":
            parser_error("--simulate-swaps runs the ranks on CPU, but the command uses cuda; give the script "
                         "--device cpu (the swaps are decided the same way)")
        if args.resident is None:
            parser_error("--simulate-swaps needs --resident K (how many ranks the GPU would hold)")
        if simulate < 0:
            parser_error(f"--simulate-swaps {simulate}: seconds per swap must be 0 or more")
    try:
        gpu = plan_gpus(args.world_size, dict(_layout(cmd)), uses_cuda=_device_kind(cmd) == "cuda",
                        gpus=args.gpus or ("0" if simulate is not None else None), resident=args.resident,
                        gang=args.gang, slots=args.slots, rank_memory_gib=args.rank_memory)
    except (GpuPlanError, ValueError) as e:
        parser_error(str(e))
    if simulate is not None and gpu is not None:
        from prism.swap import SimulatedDriver

        gpu.driver = SimulatedDriver(simulate)
        gpu.simulated = True
        gpu.settings["simulated"] = {"driver": "SIGSTOP/SIGCONT", "seconds_per_swap": simulate}
    for note in gpu.notes if gpu is not None else ():
        print(f"prism capture: note: {note}", file=sys.stderr)
    if gpu is None and simulate is None and not any(w == "cpu" or w.startswith("cpu:") for w in cmd):
        from prism.gpu_plan import _visible_gpus

        seen = _visible_gpus()
        if seen:
            print(f"prism capture: note: the command names no device and this machine has {len(seen)} GPU(s): "
                  "a script that takes CUDA when it is there would run rank r on GPU LOCAL_RANK with no logical "
                  "devices; to capture on GPUs pass --gpus (e.g. --gpus 0), to stay on CPU give the script its "
                  "CPU flag", file=sys.stderr)
    slots = gpu.slots if gpu is not None else (args.slots or os.cpu_count() or 1)
    return capture(run_dir, args.world_size, cmd, slots=slots, coordinator=args.coordinator,
                   nproc_per_node=args.nproc_per_node, show_ranks=args.show_ranks,
                   quiet_s=args.quiet_period, progress=args.progress, gpu=gpu)


def capture(run_dir: Path, world_size: int, cmd: list[str], *, slots: int, coordinator: str | None = None,
            nproc_per_node: int = 8, show_ranks=(0,), quiet_s: float = 30.0, progress: str = "auto",
            gpu=None) -> int:
    """Capture ``cmd`` as ``world_size`` ranks into ``run_dir``; the exit status.
    ``gpu`` is a ``prism.gpu_plan.GpuPlan`` (None: CPU)."""
    if show_ranks == "none":
        show_ranks = ()
    import trio

    from prism.coordinator import Coordinator, Progress
    from prism.launcher import launch_ranks
    from transport.endpoints import default_endpoint

    T.make_run_dir(run_dir)
    # A GPU plan means the ranks drive GPUs, whether or not the command says
    # so (scripts that take CUDA when it is there); simulated swaps run on CPU.
    kind = "cuda" if gpu is not None and not getattr(gpu, "simulated", False) else _device_kind(cmd)
    T.write_manifest(run_dir, _manifest(run_dir, world_size, cmd, slots, kind))

    env = gpu.env() if gpu is not None else {}
    if coordinator is not None:
        procs = launch_ranks(world_size, coordinator, run_dir, cmd, nproc_per_node=nproc_per_node,
                             show_ranks=show_ranks, env=env)
        codes = procs.wait()
        bad = {r: c for r, c in enumerate(codes) if c != 0}
        if bad:
            print(f"prism capture: ranks failed: {bad}; see {run_dir / T.LOGS_DIR}", file=sys.stderr)
            return 1
        print(f"prism capture: all {world_size} ranks finished; the coordinator at {coordinator} recorded "
              f"the trace into its own --out; rank logs are in {run_dir / T.LOGS_DIR}", file=sys.stderr)
        return 0

    coord = Coordinator(run_dir, world_size, slots=slots, endpoint=default_endpoint(run_dir),
                        quiet_s=quiet_s, progress=Progress(world_size, mode=progress))
    if gpu is not None:
        from prism.swap import SwapError

        try:
            gpu.setup(coord)
        except SwapError as e:
            print(f"prism capture: cannot swap ranks on the GPU: {e}", file=sys.stderr)
            return 2
    from prism.telemetry import GpuSampler

    sampler = GpuSampler(run_dir, gpu.gpus if gpu is not None and not gpu.simulated else None)
    sampler.start()

    async def main():
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(_run_and_keep, coord)
            try:
                coord.processes = await trio.to_thread.run_sync(
                    lambda: launch_ranks(world_size, endpoint, run_dir, cmd, nproc_per_node=nproc_per_node,
                                         show_ranks=show_ranks, env=env))
            except BaseException:
                nursery.cancel_scope.cancel()
                raise
        return coord.result

    try:
        result = trio.run(main)
        if coord.processes is not None and result.status == "ok":
            # Every rank said goodbye; let them finish tearing down (ZeroMQ
            # flushing, interpreter exit) rather than killing them mid-exit.
            coord.processes.wait(timeout=30)
    finally:
        sampler.stop()
        if coord.processes is not None:
            coord.processes.close()
    if gpu is not None:
        from prism import swap

        if gpu.executor:
            gpu.executor.close()
        summary = swap.write_report(run_dir, gpu.executor.records if gpu.executor else [], result.steps_done,
                                    gpu.settings, rescues=coord.rescues)
        where = "simulated on CPU" if gpu.simulated else f"on GPUs {gpu.gpus}"
        print(swap.format_summary(summary) + f" [resident {gpu.resident}/GPU {where}, gang {gpu.gang}]",
              file=sys.stderr)
    return _report(result, run_dir)


async def _run_and_keep(coord, *, task_status):
    coord.result = await coord.run(task_status=task_status)


def _report(result, run_dir: Path) -> int:
    if result.status == "ok":
        print(f"prism: captured {result.steps_done} steps of {run_dir} in {result.wall_s:.1f} s; "
              f"`python -m prism trace summary {run_dir}` shows it", file=sys.stderr)
    else:
        print(f"prism: capture FAILED ({result.status}) after {result.wall_s:.1f} s:\n{result.message}\n"
              f"The trace so far is kept in {run_dir}; rank logs in {run_dir / T.LOGS_DIR}.", file=sys.stderr)
    return result.exit_code


def run_coordinator(args: argparse.Namespace) -> int:
    import trio

    from prism.coordinator import Coordinator, Progress

    run_dir = Path(args.out) if args.out else _default_out("capture")
    T.make_run_dir(run_dir)
    slots = args.slots or os.cpu_count() or 1
    T.write_manifest(run_dir, _manifest(run_dir, args.world_size, [], slots, "cpu"))
    coord = Coordinator(run_dir, args.world_size, slots=slots, endpoint=args.listen,
                        quiet_s=args.quiet_period, progress=Progress(args.world_size, mode=args.progress))

    async def main():
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(_run_and_keep, coord)
            print(f"prism coordinator: listening on {endpoint} for {args.world_size} ranks; "
                  f"recording into {run_dir}", file=sys.stderr, flush=True)
        return coord.result

    return _report(trio.run(main), run_dir)


def run_demo(args: argparse.Namespace) -> int:
    from prism import trace_cli

    run_dir = Path(args.out) if args.out else _default_out("demo")
    cmd = ["-m", "prism.workloads.gpt", "--tp", "2", "--pp", "2", "--dp", "4", "--steps", str(args.steps)]
    slots = args.slots or os.cpu_count() or 1
    print(f"prism demo: capturing the bundled GPT at world 16 (tp2 x pp2 x dp4) on CPU with {slots} slots "
          f"into {run_dir}", file=sys.stderr, flush=True)
    # Rank 8 (tp 0, dp 0, last stage) prints the losses.
    code = capture(run_dir, 16, cmd, slots=slots, show_ranks=(8,))
    if code == 0:
        code = trace_cli._summary(argparse.Namespace(run=str(run_dir)))
    if code == 0:
        from prism import predict_cli

        print(f"\n$ python -m prism predict {run_dir} --warmup 1", flush=True)
        p = argparse.ArgumentParser()
        predict_cli.add_arguments(p)
        code = predict_cli.main(p.parse_args([str(run_dir), "--warmup", "1"]))
    return code
