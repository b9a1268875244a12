"""How each late-release carry rule would have changed a device-path emulation,
from its call log (``PRISM_DEVICE_CALL_LOG``): no GPU, seconds.

    python bench/late_carry.py CALLS.jsonl[.gz] SUMMARY.json [CALLS SUMMARY ...] [--json OUT]
    python bench/late_carry.py CALLS.jsonl --emulated-ms 49.6 --predicted-ms 44.0
    python bench/late_carry.py bench/results/gpu_sandbox-2026-12-06-h100-calllogs.json.gz:4/calls-gpt-tp2-rec-late-r0.jsonl \
        --emulated-ms 49.638 --predicted-ms 43.979

A GPU sandbox's release reaches the GPU late (``late`` in each call's record)
and the reach watcher carries part of that lateness into the rank's dilated
clock (``prism.rank.devicepath.LATE_CARRY_ENV``). Given the call log of a run
and the carry rule it ran with (``--ran``, default ``min``: the runs before
2026-12-06), this recomputes what ``min``, ``excess`` and ``all`` would carry
per emulated step (steps from ``--warmup`` on, ``--steps`` in all) and the
emulated mean each would have given: the run's mean less the difference.
Arithmetic on the log, not a run: the dilated clock is linear in what is
carried, but a real run under another rule is the check. Not modelled: what
the host charge's busy rule took of a call's excess (``spend_excess``; 0-0.3
ms a step on the 2026-12-06 H100 runs), which ``excess`` then does not carry.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from prism.core.latecarry import NCCL_ISSUE_NS, RULES, carried as carried_by  # noqa: E402 (sans-IO: no torch)


def read_calls(path: str) -> list[dict]:
    """A call log (``.jsonl``, ``.jsonl.gz``), or ``BUNDLE.json.gz:NAME``: one
    of the logs kept together in ``bench/results`` (``*-calllogs.json.gz``)."""
    bundle, _, name = path.partition(".json.gz:")
    if name:
        with gzip.open(bundle + ".json.gz", "rt") as f:
            logs = json.load(f)
        if name not in logs:
            raise ValueError(f"no log {name!r} in the bundle; it has {', '.join(sorted(logs))}")
        return logs[name]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def steps_of(rows: list[dict], calls_per_step: int | None = None) -> list[int | None]:
    """Each call's step: the log's ``step`` (collectives, since 2026-12-08),
    else the collectives counted ``calls_per_step`` at a time; a send or
    receive takes the step of the collective before it (None before any)."""
    out: list[int | None] = []
    step, n = None, 0
    for r in rows:
        if r.get("op") not in ("send", "recv"):
            if "step" in r:
                step = r["step"]
            elif calls_per_step:
                step = n // calls_per_step
            n += 1
        out.append(step)
    return out


def carried(rows: list[dict], skip: int, calls_per_step: int | None = None) -> dict[str, int]:
    """ns each rule carries over the calls after the first ``skip``: call k's
    lateness at call k+1's reach (the watcher's pairing for calls in one stream);
    the ``step`` rule knows the steps from the log or ``calls_per_step``."""
    out = dict.fromkeys(RULES, 0)
    steps = steps_of(rows, calls_per_step)
    for i, (a, b) in enumerate(zip(rows, rows[1:])):
        if i < skip or "reach" not in b or "t0" not in b:
            continue
        late = a.get("late") or 0
        excess = max(0, a.get("t1", a["t0"]) - a["t0"] - NCCL_ISSUE_NS)
        new_step = steps[i] is not None and steps[i + 1] is not None and steps[i + 1] > steps[i]
        for rule in RULES:
            out[rule] += carried_by(rule, late, b["reach"] - b["t0"], excess, new_step)
    return out


def analyse(rows: list[dict], emulated_ms: float, predicted_ms: float, ran: str, steps: int, warmup: int,
            calls_per_step: int | None = None) -> dict:
    skip = len(rows) * warmup // steps
    c = carried(rows, skip, calls_per_step)
    per = steps - warmup
    res = {"calls": len(rows), "ran": ran, "emulated_ms": emulated_ms, "predicted_ms": predicted_ms,
           "carried_ms_per_step": {k: v / per / 1e6 for k, v in c.items()}}
    res["emulated_ms_by_rule"] = {k: emulated_ms - (c[k] - c[ran]) / per / 1e6 for k in RULES}
    res["error_by_rule"] = {k: v / predicted_ms - 1 for k, v in res["emulated_ms_by_rule"].items()}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="CALLS SUMMARY pairs (a run's call log and its summary.json), or one "
                                             "CALLS with --emulated-ms and --predicted-ms")
    ap.add_argument("--emulated-ms", type=float)
    ap.add_argument("--predicted-ms", type=float)
    ap.add_argument("--ran", default="min", choices=RULES, help="the rule the run carried with")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--calls-per-step", type=int, default=None,
                    help="collectives a step, for the step rule on a log without 'step' (before 2026-12-08)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.emulated_ms is not None or a.predicted_ms is not None:
        if len(a.files) != 1 or a.emulated_ms is None or a.predicted_ms is None:
            ap.error("--emulated-ms and --predicted-ms go together, with one call log")
        pairs = [(a.files[0], a.emulated_ms, a.predicted_ms)]
    else:
        if len(a.files) % 2:
            ap.error("give the files as CALLS SUMMARY pairs")
        pairs = []
        for calls, summ in zip(a.files[::2], a.files[1::2]):
            try:
                s = json.loads(pathlib.Path(summ).read_text())
                pairs.append((calls, s["emulated_mean_ns"] / 1e6, s["predicted_mean_ns"] / 1e6))
            except (OSError, ValueError, KeyError) as e:
                sys.exit(f"late_carry: {summ} is not an emulation's summary.json ({e})")
    out = []
    print(f"{'call log':<44} {'ran':>5} " + " ".join(f"{r:>8}" for r in RULES) + "   (error vs the capture's prediction)")
    for calls, em, pr in pairs:
        try:
            rows = read_calls(calls)
        except (OSError, ValueError) as e:
            sys.exit(f"late_carry: cannot read the call log {calls} ({e})")
        r = analyse(rows, em, pr, a.ran, a.steps, a.warmup, a.calls_per_step)
        r["calls_file"] = calls
        out.append(r)
        print(f"{pathlib.Path(calls).name[:44]:<44} {a.ran:>5} "
              + " ".join(f"{r['error_by_rule'][k]:>+8.1%}" for k in RULES))
    if a.json:
        from _results import write_json  # beside this script (run as one)

        write_json(a.json, {"benchmark": "late_carry", "runs": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
