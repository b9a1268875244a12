"""``python -m prism campaign FILE``: argument parsing and progress lines over
``prism.app.campaign``."""

from __future__ import annotations

import argparse
import sys

from prism.app.campaign import CampaignConfig, CampaignEvent, run_campaign
from prism.app.errors import PrismError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the campaign, a TOML file (see prism/core/campaign.py and bench/campaigns/)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output folder: points.jsonl, results.csv/json, plot.png, captures/ "
                        "(default: runs/campaigns/NAME); rerun with the same one to resume")
    p.add_argument("--dry-run", action="store_true", help="check the file and list its points; run nothing")
    p.add_argument("--retry-failed", action="store_true", help="run again the points logged as failed")
    p.set_defaults(func=main)


def _result(row: dict) -> str:
    ms = row.get("iteration_ms")
    t = f"{ms:,.1f} ms" if isinstance(ms, (int, float)) else "n/a"
    mem = row.get("peak_memory_gib")
    m = f", peak {mem:.2f} GiB on rank {row.get('peak_memory_rank')}" if isinstance(mem, (int, float)) else ""
    if row["status"] == "ok":
        return f"{t}{m}"
    if row["status"] == "oom":
        return f"OOM ({t}): {row.get('message', '')}"
    return f"FAILED: {row.get('message', '')}"


def _progress(ev: CampaignEvent) -> None:
    head = f"[{ev.n}/{ev.total}]"
    label = ev.point.label if ev.point is not None else ""
    if ev.kind == "capture":
        print(f"{head} capturing {ev.message}", file=sys.stderr, flush=True)
    elif ev.kind == "captured":
        print(f"{head} capture: {ev.message}", file=sys.stderr, flush=True)
    elif ev.kind == "done":
        print(f"{head} {label} {ev.row['step']}: {_result(ev.row)} ({ev.row['wall_s']:.1f} s)", file=sys.stderr,
              flush=True)
    elif ev.kind == "skipped" and ev.row is not None:
        print(f"{head} {label}: skipped, done at {ev.row.get('finished_utc', '?')} ({_result(ev.row)})",
              file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    listed: list[CampaignEvent] = []
    config = CampaignConfig(file=args.file, out=args.out, dry_run=args.dry_run, retry_failed=args.retry_failed,
                            on_event=listed.append if args.dry_run else _progress)
    try:
        res = run_campaign(config)
    except KeyboardInterrupt:
        print("prism campaign: interrupted; the finished points are kept, run the same command again to resume",
              file=sys.stderr)
        return 130
    except PrismError as e:
        print(f"prism campaign: {e}", file=sys.stderr)
        return e.exit_code
    c = res.campaign
    if args.dry_run:
        done = sum(1 for ev in listed if ev.kind == "skipped")
        print(f"campaign {c.name}: {len(c.points)} points, {c.distinct_captures()} distinct capture(s); "
              f"dimensions: {', '.join(c.dimensions.values()) or 'none'}; {done} done in {res.out_dir}")
        for ev in listed:
            print(f"  {ev.point.index:>4}  {ev.point.key}  {ev.point.get('campaign.step')}  {ev.point.label}"
                  + ("  (done)" if ev.kind == "skipped" else ""))
        return 0
    print(f"campaign {c.name}: {len(res.rows)} points ({res.ran} run, {res.skipped} skipped as done), "
          f"{len(res.oom)} out of memory, {len(res.failed)} failed")
    print(f"  table: {res.csv_path} and {res.json_path}")
    print(f"  plot:  {res.plot_path}" if res.plot_path else f"  {res.plot_error}")
    for r in res.failed[:5]:
        print(f"  failed: point {r['index']} ({' '.join(f'{k}={v}' for k, v in r['dims'].items())}): "
              f"{r.get('message', '')}")
    return res.exit_code
