"""``python -m prism agent``: argument parsing and printing over ``prism.app.agent``."""

from __future__ import annotations

import argparse
import signal
import sys

from prism.app import agent as app_agent
from prism.app.errors import PrismError
from prism.core.agents import DEFAULT_AGENT_PORT, rank_span as compact_ranks


def add_agent_options(p: argparse.ArgumentParser, about: str, place_help: str, *,
                      listen_help: str = "where the agents join (e.g. tcp://0.0.0.0:29431); the ranks get another "
                                         "port on HOST",
                      wait_help: str = "how long to wait for the agents to join (default 60)",
                      agents_type=int) -> None:
    """The ``--agents/--listen/--keys/--insecure/--agent-wait`` group of a
    command served by ``prism agent`` (capture, emulate, calibrate)."""
    a = p.add_argument_group("agents", about)
    a.add_argument("--agents", type=agents_type, default=0, metavar="N", help=place_help)
    a.add_argument("--listen", default=None, metavar="tcp://HOST:PORT", help=listen_help)
    a.add_argument("--keys", default=None, metavar="DIR", help="CURVE keys made by `prism keys DIR`")
    a.add_argument("--insecure", action="store_true", help="plaintext tcp, without CURVE: a private network only")
    a.add_argument("--agent-wait", type=float, default=60.0, metavar="S", help=wait_help)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", default=None, metavar="tcp://HOST:PORT",
                   help="where the capture listens (`prism capture --agents N --listen ...`); default: node 0 of "
                        "SLURM's or torchrun's environment, at --port")
    p.add_argument("--port", type=int, default=DEFAULT_AGENT_PORT,
                   help=f"the coordinator's port when it comes from the environment (default {DEFAULT_AGENT_PORT})")
    p.add_argument("--keys", default=None, metavar="DIR",
                   help="CURVE keys made by `prism keys DIR` (server.key, client.key_secret), on a shared path")
    p.add_argument("--insecure", action="store_true",
                   help="plaintext tcp, without CURVE: a private network only")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this node's rank (agents are placed in this order); default from the environment")
    p.add_argument("--slots", type=int, default=None, help="ranks that may compute at once here (default: cores)")
    p.add_argument("--gpus", default=None, metavar="IDS",
                   help="this node's GPUs for a CUDA capture, as 0 or 0,1, or none (default: every GPU NVML sees); "
                        "the ranks placed here share them, one computing per GPU at a time")
    p.add_argument("--wait", type=float, default=120.0, metavar="S",
                   help="how long to wait for the run's launch (default 120); while more runs are to be served, "
                        "a longer wait is only a note")
    p.add_argument("--runs", type=int, default=1, metavar="N",
                   help="runs to serve one after another, reconnecting after each (default 1; 0: until stopped "
                        "by SIGTERM or SIGINT, as `prism calibrate --agents` needs)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = app_agent.AgentRunConfig(args.coordinator, args.keys, args.insecure, args.port, args.node_rank,
                                      args.slots, args.wait, args.runs, args.gpus)

    def stop(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # SIGTERM unwinds as SIGINT does: the agent kills and reaps its ranks on the way out.
    old = signal.signal(signal.SIGTERM, stop)
    try:
        outcome = app_agent.serve_agent(config, on_note=lambda t: print(f"prism agent: {t}", file=sys.stderr))
    except PrismError as e:
        print(f"prism agent: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        name = str(e) or "SIGINT"
        killed = getattr(e, "killed", [])
        what = f"killed its running ranks {compact_ranks(killed)}" if killed else "no rank of it was running"
        print(f"prism agent: stopped by {name}: {what}; none is left behind", file=sys.stderr)
        # Between runs, the way a --runs 0 agent is meant to end.
        return 0 if args.runs == 0 and not killed else 1
    finally:
        signal.signal(signal.SIGTERM, old)
    bad = {r: c for r, c in outcome.codes.items() if c != 0}
    why = f"; {outcome.stopped}" if outcome.stopped else ""
    runs = f" over {outcome.runs} runs" if outcome.runs != 1 else ""
    print(f"prism agent: {len(outcome.ranks)} ranks ended{runs}, {len(bad)} failed{why}", file=sys.stderr)
    return 0 if outcome.ok else 1
