"""``python -m prism coordinator --daemon | submit | jobs | cancel | keys``:
argument parsing and printing over ``prism.app.daemon``.

Status is plain text for people and JSON (``--json``) for scripts: a job's
record as ``STATE/jobs/ID/job.json`` holds it, plus its progress line.
"""

from __future__ import annotations

import argparse
import sys
import time

import orjson

from prism.app import daemon as app_daemon
from prism.app.errors import PrismError
from prism.core import jobs as J


def _add_client(p: argparse.ArgumentParser) -> None:
    p.add_argument("--daemon", default=None, metavar="ENDPOINT|STATE",
                   help="the daemon's endpoint (ipc://..., tcp://HOST:PORT) or its state directory "
                        "(default: $PRISM_DAEMON, else ~/.cache/prism/daemon)")
    p.add_argument("--keys", default=None, metavar="DIR",
                   help="CURVE keys made by `prism keys DIR` (server.key, client.key_secret), for a daemon that uses them")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="give up when the daemon has not answered within S seconds (default 10)")


def add_daemon_arguments(p: argparse.ArgumentParser) -> None:
    """The daemon's options of ``prism coordinator`` (``--daemon``)."""
    g = p.add_argument_group("job daemon", "`prism coordinator --daemon`: a long-lived service that runs jobs "
                                           "(`prism submit`, `prism jobs`, `prism cancel`)")
    g.add_argument("--daemon", action="store_true", help="run the job daemon instead of a one-capture coordinator")
    g.add_argument("--state", default=None, metavar="DIR",
                   help="the daemon's job records and logs (default $PRISM_STATE or ~/.cache/prism/daemon); it "
                        "listens on ipc://DIR/daemon.sock unless --listen says otherwise")
    g.add_argument("--gpus", default=None, metavar="LIST", help="the GPUs the daemon owns, e.g. 0,1 (default none)")
    g.add_argument("--keys", default=None, metavar="DIR",
                   help="turn CURVE on with the keys `prism keys DIR` made: only clients whose public key is in "
                        "DIR/authorized/ get in; needed to listen beyond loopback")
    g.add_argument("--grace", type=float, default=20.0, metavar="S",
                   help="seconds a job has to stop after SIGTERM before it is killed (default 20)")


def run_daemon(args: argparse.Namespace) -> int:
    def listening(endpoint: str) -> None:
        print(f"prism coordinator: daemon listening on {endpoint}; {config.slots or 'all'} slots; "
              f"state in {args.state or 'the default state directory'}", file=sys.stderr, flush=True)

    def note(text: str) -> None:
        print(f"prism coordinator: {text}", file=sys.stderr, flush=True)

    config = app_daemon.DaemonConfig(state=args.state, listen=args.listen, slots=args.slots, gpus=args.gpus,
                                     keys=args.keys, grace_s=args.grace)
    try:
        app_daemon.serve(config, on_listening=listening, on_note=note)
    except PrismError as e:
        print(f"prism coordinator: error: {e}", file=sys.stderr)
        return e.exit_code
    print("prism coordinator: daemon stopped", file=sys.stderr)
    return 0


# --- submit ------------------------------------------------------------------------


def add_submit_arguments(p: argparse.ArgumentParser) -> None:
    _add_client(p)
    p.add_argument("--name", default="", help="a name to show beside the job's id")
    p.add_argument("--after", default="", metavar="IDS",
                   help="start only once these jobs (e.g. 3 or 3,4) are done; cancelled if one of them fails")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set for the job on top of the daemon's environment (repeatable); the submitter's "
                        "PRISM_* variables are sent too")
    p.add_argument("--json", action="store_true", help="print the job's record as JSON")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help=f"-- COMMAND ARGS: COMMAND one of {', '.join(J.JOB_KINDS)}, with the arguments "
                        "it takes on the command line")
    p.set_defaults(func=run_submit)


def run_submit(args: argparse.Namespace) -> int:
    after = tuple(x.strip() for x in args.after.split(",") if x.strip())
    try:
        job = app_daemon.submit(args.command, daemon=args.daemon, keys=args.keys, name=args.name, after=after,
                                env=(*app_daemon.prism_env(), *args.env), timeout_s=args.timeout)
    except PrismError as e:
        print(f"prism submit: error: {e}", file=sys.stderr)
        return e.exit_code
    if args.json:
        print(orjson.dumps(J.job_to_dict(job)).decode())
    else:
        print(f"job {job.id} queued: {' '.join(job.command)}"
              + (f" (needs {job.slots} slot{'s' if job.slots != 1 else ''}"
                 + (f", GPUs {','.join(map(str, job.gpus))}" if job.gpus else "") + ")"))
    return 0


# --- jobs ---------------------------------------------------------------------------


def add_jobs_arguments(p: argparse.ArgumentParser) -> None:
    _add_client(p)
    p.add_argument("id", nargs="?", default="", help="one job (default: all)")
    p.add_argument("--json", action="store_true", help="JSON for scripts: {slots, slots_busy, gpus, jobs: [...]}")
    p.add_argument("--logs", action="store_true", help="print the job's log (needs ID)")
    p.add_argument("--wait", action="store_true",
                   help="wait until the job (default: every job) has ended, then list it; exit 0 only if all are done")
    p.set_defaults(func=run_jobs)


def _when(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


def _took(job: J.Job) -> str:
    if not job.started_at:
        return "-"
    end = job.ended_at or time.time()
    return f"{end - job.started_at:.1f} s"


def jobs_text(listing: J.JobList) -> str:
    """The table ``prism jobs`` prints: one line per job, then its progress or message."""
    lines = [f"{len(listing.jobs)} job{'s' if len(listing.jobs) != 1 else ''}; slots {listing.slots_busy}/"
             f"{listing.slots} busy" + (f"; GPUs {','.join(map(str, listing.gpus))}" if listing.gpus else "")]
    if listing.jobs:
        lines.append(f"{'id':>4}  {'state':<11} {'submitted':<9} {'took':>8}  {'exit':>4}  command")
    for j in listing.jobs:
        cmd = " ".join(j.command)
        cmd = cmd if len(cmd) <= 70 else cmd[:67] + "..."
        code = "-" if j.exit_code is None else str(j.exit_code)
        name = f"[{j.name}] " if j.name else ""
        lines.append(f"{j.id:>4}  {j.state:<11} {_when(j.submitted_at):<9} {_took(j):>8}  {code:>4}  {name}{cmd}")
        if j.run_dir:
            lines.append(f"{'':>6}run: {j.run_dir}")
        if j.state == "running" and j.progress:
            lines.append(f"{'':>6}progress: {j.progress}")
        elif j.message:
            lines.append(f"{'':>6}{j.message}")
    return "\n".join(lines)


def run_jobs(args: argparse.Namespace) -> int:
    try:
        if args.logs:
            if not args.id:
                print("prism jobs: error: --logs needs a job id: `prism jobs ID --logs`", file=sys.stderr)
                return 2
            text = app_daemon.logs(args.id, daemon=args.daemon, keys=args.keys, timeout_s=args.timeout)
            if text.truncated:
                print(f"[the first part of {text.path} is left out]", file=sys.stderr)
            sys.stdout.write(text.text)
            return 0
        if args.wait:
            listing = app_daemon.wait(args.id, daemon=args.daemon, keys=args.keys, timeout_s=args.timeout)
        else:
            listing = app_daemon.jobs(args.id, daemon=args.daemon, keys=args.keys, timeout_s=args.timeout)
    except PrismError as e:
        print(f"prism jobs: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("prism jobs: stopped waiting (the jobs go on)", file=sys.stderr)
        return 130
    if args.json:
        print(orjson.dumps({"slots": listing.slots, "slots_busy": listing.slots_busy, "gpus": list(listing.gpus),
                            "jobs": [J.job_to_dict(j) for j in listing.jobs]}).decode())
    else:
        print(jobs_text(listing))
    if args.wait:
        return 0 if all(j.state == "done" for j in listing.jobs) else 1
    return 0


# --- cancel, keys ---------------------------------------------------------------------


def add_cancel_arguments(p: argparse.ArgumentParser) -> None:
    _add_client(p)
    p.add_argument("id", help="the job to cancel")
    p.set_defaults(func=run_cancel)


def run_cancel(args: argparse.Namespace) -> int:
    try:
        job = app_daemon.cancel(args.id, daemon=args.daemon, keys=args.keys, timeout_s=args.timeout)
    except PrismError as e:
        print(f"prism cancel: error: {e}", file=sys.stderr)
        return e.exit_code
    if job.state == "running":
        print(f"job {job.id}: stopping (SIGTERM); `prism jobs {job.id}` shows when it has")
    else:
        print(f"job {job.id}: {job.state}")
    return 0


def add_resume_arguments(p: argparse.ArgumentParser) -> None:
    _add_client(p)
    p.add_argument("id", help="the interrupted or cancelled campaign job to queue again")
    p.set_defaults(func=run_resume)


def run_resume(args: argparse.Namespace) -> int:
    try:
        job = app_daemon.resume(args.id, daemon=args.daemon, keys=args.keys, timeout_s=args.timeout)
    except PrismError as e:
        print(f"prism resume: error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"job {job.id}: queued again ({job.message}); it skips what it finished")
    return 0


def add_keys_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="directory to write the keys into (made, mode 0700)")
    p.set_defaults(func=run_keys)


def run_keys(args: argparse.Namespace) -> int:
    try:
        k = app_daemon.make_keys(args.dir)
    except PrismError as e:
        print(f"prism keys: error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"wrote CURVE keys into {k.dir}:\n"
          f"  daemon:  {k.server_secret.name} (secret), {k.authorized.name}/ (client public keys it lets in)\n"
          f"  client:  {k.server_public.name} and {k.client_secret.name} (copy these two to a client machine)\n"
          f"start:  python -m prism coordinator --daemon --listen tcp://0.0.0.0:PORT --keys {k.dir}\n"
          f"submit: python -m prism submit --daemon tcp://HOST:PORT --keys {k.dir} -- capture ...")
    return 0
