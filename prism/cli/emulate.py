"""``python -m prism emulate RUN --sandbox R`` and ``python -m prism run``:
argument parsing and printing over ``prism.app.emulate``."""

from __future__ import annotations

import argparse
import json
import sys

from prism.app.errors import PrismError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory of a `prism capture` (record the sandbox ranks with --record)")
    _common(p)
    _scale(p)
    _agents(p)
    p.epilog = ("After the options, `-- SCRIPT ARGS...` runs another command than the capture's (a changed one is "
                "checked against the captured graph call by call).")
    p.set_defaults(func=main, script=None)


def _scale(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale-dp", type=int, default=None, metavar="N",
                   help="emulate the run grown to data-parallel degree N (a multiple of the captured dp), as "
                        "`prism predict --scale-dp`: the sandbox ranks start at the scaled world size with the "
                        "command's --dp set to N; every virtual contribution is compensated")
    p.add_argument("--layout", default=None, metavar="tp=T,pp=P,dp=D[,ep=E]",
                   help="the captured run's layout for --scale-dp (default: the manifest's, from --tp/--pp/--dp flags)")


def _agents(p: argparse.ArgumentParser) -> None:
    from prism.cli.agent import add_agent_options

    add_agent_options(p, "run the sandbox ranks through `prism agent` on other nodes (the run directory on a shared "
                         "filesystem)",
                      "wait for N agents and place the sandbox ranks on them (a TP group's sandboxes on one node)",
                      listen_help="where the agents join (e.g. tcp://0.0.0.0:29431); the sandboxes get another port "
                                  "on HOST")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sandbox", default="0", metavar="RANKS",
                   help="ranks that run for real, as 0,5 or 0-3 (default: 0); the others are virtual")
    p.add_argument("--net", default=None, metavar="PROFILE",
                   help="cost profile for the virtual ranks' communication (default: as `prism predict` chooses)")
    p.add_argument("--name", default=None, help="results go to RUN/emulation/NAME (default: the date and time)")
    p.add_argument("--dormant", default="auto", choices=("auto", "simulate", "offline"),
                   help="virtual ranks in no group with a sandbox: stepped (simulate, exact) or at their batch-replay "
                        "times (offline); auto: offline from a world of 256, simulate for --scale-dp (folded copies "
                        "keep it cheap)")
    p.add_argument("--quiet", type=float, default=30.0, metavar="S",
                   help="stop with a report after S seconds without progress (default: 30)")
    p.add_argument("--warmup", type=int, default=1, help="steps dropped before averaging (default: 1)")
    p.add_argument("--no-recording", action="store_true",
                   help="ignore the capture's recorded payloads: every virtual contribution is compensated")
    p.add_argument("--pruned", action="store_true",
                   help="sandbox ranks of one group run its all_reduce, all_gather_into_tensor and "
                        "reduce_scatter_tensor among themselves for real (gloo on CPU tensors), the virtual members' "
                        "part folded in (the leftmost compensates); with a recording, the recorded outputs still "
                        "replace theirs where their inputs are the recorded ones")
    p.add_argument("--show-ranks", default="none", help="sandbox ranks whose output reaches the console: all, none "
                                                        "or a list (failing ranks always show their last lines)")
    p.add_argument("--progress", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--gpus", default=None, metavar="IDS",
                   help="GPUs the sandbox ranks run on, as 0 or 0,1 (default: GPU 0 for a capture that ran on CUDA); "
                        "each sandbox keeps its logical device")
    p.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                   help="emulate a GPU of GIB per sandbox rank, as `prism capture --memory-limit`")
    p.add_argument("--device-path", action="store_true",
                   help="GPU sandboxes (experimental): keep the data of calls answered by virtual ranks only on the "
                        "GPU, behind a stream-ordered release, instead of staging every call through host memory")
    p.add_argument("--prefetch-pool", type=int, default=256, metavar="MIB",
                   help="--device-path with a recording: each sandbox's pool of device memory (outside torch's "
                        "allocator, reported apart, counted against --memory-limit) that the recorded outputs are "
                        "staged into ahead of their calls (default: 256)")
    p.add_argument("--memory-overhead", type=float, default=None, metavar="GIB",
                   help="of --memory-limit, what the GPU holds outside torch's allocator (default: as capture)")
    p.add_argument("--calibration", default="auto", metavar="auto|on|off|NAME",
                   help="the virtual ranks' compute durations: auto (the default: the newest `prism calibrate` of "
                        "the run if it has one, else as captured), on (the newest, required), off (as captured) "
                        "or a calibration's --name")
    from prism.cli.commtime import add_comm_argument

    add_comm_argument(p)


def _gpu_kw(args: argparse.Namespace) -> dict:
    kw = {"gpus": args.gpus, "memory_limit_gib": args.memory_limit, "device_path": args.device_path,
          "calibration": args.calibration, "prefetch_pool_mib": args.prefetch_pool, "comm": args.comm,
          "pruned": getattr(args, "pruned", False)}
    if args.memory_overhead is not None:
        kw["memory_overhead_gib"] = args.memory_overhead
    return kw


def _show(text: str):
    if text in ("all", "none"):
        return text
    return tuple(int(x) for x in text.split(",") if x)


def main(args: argparse.Namespace) -> int:
    from prism.app.emulate import EmulateConfig, emulate

    cmd = list(args.script or [])
    try:
        config = EmulateConfig(run=args.run, sandbox=args.sandbox, command=cmd or None, net=args.net, name=args.name,
                               dormant=args.dormant, quiet_s=args.quiet, warmup=args.warmup,
                               show_ranks=_show(args.show_ranks), progress=args.progress,
                               use_recording=not args.no_recording, scale_dp=args.scale_dp, layout=args.layout,
                               agents=args.agents, listen=args.listen, keys=args.keys, insecure=args.insecure,
                               agent_wait_s=args.agent_wait, **_gpu_kw(args))
        outcome = emulate(config)
    except PrismError as e:
        print(f"prism emulate: {e}", file=sys.stderr)
        return e.exit_code
    except ValueError as e:
        print(f"prism emulate: {e}", file=sys.stderr)
        return 2
    print(json.dumps(outcome.summary, indent=2) if args.json else outcome.text())
    return outcome.exit_code


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", "-n", type=int, required=True, help="number of logical ranks")
    p.add_argument("--out", "-o", default=None, help="run directory (default runs/run-TIMESTAMP)")
    p.add_argument("--slots", type=int, default=None, help="ranks that may compute at once during the capture "
                                                           "(default: the number of cores)")
    _common(p)
    _scale(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS, or -- -m MODULE ARGS")
    p.set_defaults(func=run_main)


def run_main(args: argparse.Namespace) -> int:
    """``prism run``: capture (recording the sandbox ranks), predict, emulate; one report."""
    from prism.app import capture as app_capture
    from prism.app import predict as app_predict
    from prism.app.emulate import EmulateConfig, emulate

    if args.comm != "model" and (args.comm != "measured" or args.scale_dp is not None or args.gpus):
        print(f"prism run: --comm {args.comm}: a fresh capture has no stored measurement; --comm measured times its "
              "calls in situ after capturing, for a CPU capture of the world as captured (not with --scale-dp or "
              "--gpus)", file=sys.stderr)
        return 2
    if args.comm == "measured":
        from prism.app.netprofile import usable_cores

        if args.world_size > usable_cores():
            print(f"prism run: --comm measured runs one process per rank after the capture; {args.world_size} ranks "
                  f"need {args.world_size} cores and this machine gives {usable_cores()} (use --comm model)",
                  file=sys.stderr)
            return 2
    try:
        plan = app_capture.plan_capture(app_capture.CaptureConfig(
            world_size=args.world_size, command=args.command, out=args.out or app_capture.default_out("run"),
            slots=args.slots, show_ranks=(), progress=args.progress, record=args.sandbox, gpus=args.gpus,
            memory_limit_gib=args.memory_limit,
            memory_overhead_gib=(args.memory_overhead if args.memory_overhead is not None
                                 else app_capture.DEFAULT_MEMORY_OVERHEAD_GIB)))
        print(f"prism run: 1/3 capturing {plan.run_dir} at world {args.world_size}, recording sandbox ranks "
              f"{args.sandbox}", file=sys.stderr, flush=True)
        captured = app_capture.capture(plan)
        print(captured.text(), file=sys.stderr)
        if not captured.ok:
            return captured.exit_code
        if args.comm == "measured":
            from prism.app.commtime import CommtimeConfig, commtime

            print("prism run: timing the capture's calls in situ (--comm measured)", file=sys.stderr, flush=True)
            print(commtime(CommtimeConfig(run=str(plan.run_dir), net=args.net)).format(), file=sys.stderr)
        print("prism run: 2/3 predicting", file=sys.stderr, flush=True)
        prediction = app_predict.predict(app_predict.PredictConfig(
            run=plan.run_dir, net=args.net, warmup=args.warmup, scale_dp=args.scale_dp, layout=args.layout,
            calibration=args.calibration, comm=args.comm))
        grown = f" at dp {args.scale_dp}" if args.scale_dp else ""
        print(f"prism run: 3/3 emulating{grown} with sandbox ranks {args.sandbox}", file=sys.stderr, flush=True)
        outcome = emulate(EmulateConfig(run=plan.run_dir, sandbox=args.sandbox, net=args.net, name=args.name,
                                        dormant=args.dormant, quiet_s=args.quiet, warmup=args.warmup,
                                        show_ranks=_show(args.show_ranks), progress=args.progress,
                                        use_recording=not args.no_recording, scale_dp=args.scale_dp,
                                        layout=args.layout, **_gpu_kw(args)))
    except PrismError as e:
        print(f"prism run: {e}", file=sys.stderr)
        return e.exit_code
    if args.json:
        print(json.dumps({"capture": str(plan.run_dir), "prediction": prediction.summary(),
                          "emulation": outcome.summary}, indent=2))
    else:
        print(f"== prism run: {plan.run_dir} ==")
        print(f"capture: {captured.result.steps_done} steps in {captured.result.wall_s:.1f} s")
        print("-- prediction --")
        print(prediction.text())
        print("-- emulation --")
        print(outcome.text())
    return outcome.exit_code
