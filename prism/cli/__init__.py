"""``python -m prism``: the command line, the only importer of ``prism.cli.*``.

Each command module (``prism.cli.capture``, ``predict``, ``trace``,
``report``, ``netprofile``, ``daemon``) parses its arguments, calls the library
(``prism.app``) and prints the result. Each command is registered in
``_COMMANDS``. A command whose issue has not
landed yet is listed with the issue that brings it and refuses to run (exit
status 2) instead of pretending to work.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class _Command:
    name: str
    help: str
    # None while the command is not built; the issue that brings it.
    build: Callable[[argparse.ArgumentParser], None] | None = None
    pending_issue: int | None = None


def _build_trace(p: argparse.ArgumentParser) -> None:
    from prism.cli import trace

    trace.add_arguments(p)


def _build_capture(p: argparse.ArgumentParser) -> None:
    from prism.cli import capture

    capture.add_capture_arguments(p)


def _build_coordinator(p: argparse.ArgumentParser) -> None:
    from prism.cli import capture

    capture.add_coordinator_arguments(p)


def _build_demo(p: argparse.ArgumentParser) -> None:
    from prism.cli import capture

    capture.add_demo_arguments(p)


def _build_netprofile(p: argparse.ArgumentParser) -> None:
    from prism.cli import netprofile

    netprofile.add_arguments(p)


def _build_predict(p: argparse.ArgumentParser) -> None:
    from prism.cli import predict

    predict.add_arguments(p)


def _build_emulate(p: argparse.ArgumentParser) -> None:
    from prism.cli import emulate

    emulate.add_arguments(p)


def _build_calibrate(p: argparse.ArgumentParser) -> None:
    from prism.cli import calibrate

    calibrate.add_arguments(p)


def _build_commtime(p: argparse.ArgumentParser) -> None:
    from prism.cli import commtime

    commtime.add_arguments(p)


def _build_run(p: argparse.ArgumentParser) -> None:
    from prism.cli import emulate

    emulate.add_run_arguments(p)


def _build_submit(p: argparse.ArgumentParser) -> None:
    from prism.cli import daemon

    daemon.add_submit_arguments(p)


def _build_jobs(p: argparse.ArgumentParser) -> None:
    from prism.cli import daemon

    daemon.add_jobs_arguments(p)


def _build_cancel(p: argparse.ArgumentParser) -> None:
    from prism.cli import daemon

    daemon.add_cancel_arguments(p)


def _build_resume(p: argparse.ArgumentParser) -> None:
    from prism.cli import daemon

    daemon.add_resume_arguments(p)


def _build_keys(p: argparse.ArgumentParser) -> None:
    from prism.cli import daemon

    daemon.add_keys_arguments(p)


def _build_agent(p: argparse.ArgumentParser) -> None:
    from prism.cli import agent

    agent.add_arguments(p)


def _build_campaign(p: argparse.ArgumentParser) -> None:
    from prism.cli import campaign

    campaign.add_arguments(p)


def _build_report(p: argparse.ArgumentParser) -> None:
    from prism.cli import report

    report.add_arguments(p)


_COMMANDS: tuple[_Command, ...] = (
    _Command("demo", "capture the bundled GPT at world 16 on CPU and summarise it", build=_build_demo),
    _Command("capture", "run an unmodified torch.distributed script as N logical ranks and record its trace", build=_build_capture),
    _Command("coordinator", "run a standalone coordinator for one capture, or (--daemon) the job daemon",
             build=_build_coordinator),
    _Command("submit", "queue a job (capture, predict, emulate, calibrate, campaign) on the job daemon",
             build=_build_submit),
    _Command("jobs", "list the job daemon's jobs: status, progress, logs (--json for scripts)", build=_build_jobs),
    _Command("cancel", "cancel a queued or running job of the job daemon", build=_build_cancel),
    _Command("resume", "queue an interrupted or cancelled campaign job again (it skips finished points)",
             build=_build_resume),
    _Command("keys", "write CURVE keypairs for the job daemon (or a capture's agents) and a client",
             build=_build_keys),
    _Command("agent", "serve a capture's ranks on this node (one per node, under srun or torchrun)",
             build=_build_agent),
    _Command("trace", "inspect a PrismTrace run: summary, validate", build=_build_trace),
    _Command("predict", "predict iteration time and breakdown from a captured run", build=_build_predict),
    _Command("calibrate", "run the ranks slice by slice against the bare graph and store their measured durations",
             build=_build_calibrate),
    _Command("commtime", "run a CPU capture's calls for real on this host (a skeleton job) and store their times",
             build=_build_commtime),
    _Command("report", "write timelines (Perfetto, Gantt plot, Chakra ET) for a run", build=_build_report),
    _Command("netprofile", "measure the local backend (gloo) and fit a communication cost profile", build=_build_netprofile),
    _Command("emulate", "run chosen sandbox ranks for real against the captured run's virtual ranks",
             build=_build_emulate),
    _Command("run", "capture (recording the sandbox ranks), predict and emulate in one go; one report",
             build=_build_run),
    _Command("campaign", "run a what-if sweep from a TOML file (layouts x DP sizes x profiles x knobs); resumable",
             build=_build_campaign),
)


#: Commands whose script and its arguments follow ``--`` after a positional.
_SCRIPT_AFTER_POSITIONAL = ("emulate",)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m prism",
        description="Prism: emulate large-scale distributed LLM training on a few devices.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in _COMMANDS:
        if cmd.build is not None:
            p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
            cmd.build(p)
        else:
            where = f"issue #{cmd.pending_issue}" if cmd.pending_issue else "phase 2"
            sub.add_parser(cmd.name, help=f"[not built yet: {where}] {cmd.help}", add_help=False)
    return parser


#: Commands that launch ranks on this machine: their fork server starts before
#: the command line is even parsed (``prism.app.capture.prestart_forkserver``).
_LAUNCHING = ("capture", "emulate", "run", "calibrate")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _LAUNCHING and not {"-h", "--help"} & set(argv):
        from prism.app.capture import prestart_forkserver

        prestart_forkserver()
    parser = make_parser()
    pending = {c.name: c for c in _COMMANDS if c.build is None}
    if argv and argv[0] in pending:
        name = argv[0]
        issue = pending[name].pending_issue
        where = f"issue #{issue}" if issue else "phase 2"
        print(
            f"prism {name}: not built yet; it arrives with {where}. "
            "Run `python -m prism --help` to see what works today.",
            file=sys.stderr,
        )
        return 2
    script: list[str] | None = None
    if argv and argv[0] in _SCRIPT_AFTER_POSITIONAL and "--" in argv:
        # ``emulate RUN [options] -- SCRIPT ARGS``: argparse cannot take a
        # remainder after a positional when the script's own flags follow.
        i = argv.index("--")
        argv, script = argv[:i], argv[i + 1:]
    args = parser.parse_args(argv)
    if script is not None:
        args.script = script
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # ``prism jobs --json | head``: the reader left; say nothing more.
        # Point stdout at /dev/null so the interpreter's final flush is quiet too.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
