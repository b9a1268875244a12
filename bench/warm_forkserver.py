"""A warm fork server (``prism.shell.launcher.warm_forkserver``) against a
fresh one per launch, side by side.

    python bench/warm_forkserver.py [--rounds 3] [--points 4] [--out FILE.json]

launch
    one two-rank launch of a script that prints and exits, from this
    process (``launch_ranks`` to the ranks' exit): with a fresh fork server
    (it imports torch) and with one forked from a zygote that has.
campaign
    ``python -m prism campaign`` of ``--points`` tiny CPU captures of the
    bundled GPT (tp2, world 2, one per batch size), wall time of the whole
    command, ``PRISM_WARM_FORKSERVER=0`` against the default (a zygote for
    the campaign). The captures' losses are compared between the two: a
    warm fork server must not change what a rank computes.

The modes alternate within each round (the machine's noise hits both); the
table gives each mode's median and the ratio fresh / warm. Prints a table
and writes JSON (bench/README.md names the file).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _results import result_path, write_json  # noqa: E402

CAMPAIGN = """[campaign]
name = "warm"
description = "tiny CPU captures, one per batch size"
step = "predict"
warmup = 1

[capture]
command = ["-m", "prism.workloads.gpt", "--layers", "2", "--hidden", "64", "--heads", "4",
           "--seq-len", "32", "--steps", "3"]
layout = "tp=2,pp=1,dp=1"

[capture.flags]
batch = {batches}

[model]
net = "h200_nvlink_ib400"
"""


def launch_once(folder: pathlib.Path, script: pathlib.Path, warm_path: str | None) -> float:
    from prism.rank.envnames import ZYGOTE_ENV
    from prism.shell.launcher import launch_ranks

    if warm_path is None:
        os.environ.pop(ZYGOTE_ENV, None)
    else:
        os.environ[ZYGOTE_ENV] = warm_path
    t0 = time.perf_counter()
    procs = launch_ranks(2, None, folder, [str(script)], show_ranks=())
    try:
        codes = procs.wait(timeout=120)
    finally:
        procs.close()
    took = time.perf_counter() - t0
    if codes != [0, 0]:
        raise SystemExit(f"the launch in {folder} failed: {codes}")
    return took


def losses(out: pathlib.Path) -> dict[str, list[str]]:
    """Each capture's rank-0 loss lines, by capture folder."""
    found = {}
    for log in sorted(out.glob("captures/*/logs/rank-000000.log")):
        found[log.parent.parent.name] = [ln for ln in log.read_text().splitlines() if "loss" in ln]
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--points", type=int, default=4, help="captures in the campaign (batch sizes 2, 4, ...)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.rounds < 1 or args.points < 1:
        ap.error("--rounds and --points must be at least 1")
    from prism.rank.envnames import ZYGOTE_ENV
    from prism.shell.launcher import warm_forkserver

    os.environ.pop(ZYGOTE_ENV, None)
    os.environ.pop("PRISM_WARM_FORKSERVER", None)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-warm-"))
    script = work / "hello.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'])\n")
    toml = work / "c.toml"
    toml.write_text(CAMPAIGN.format(batches=[2 * (i + 1) for i in range(args.points)]))
    rows: dict[str, dict[str, list[float]]] = {"launch": {"fresh": [], "warm": []},
                                                "campaign": {"fresh": [], "warm": []}}
    same_losses = True
    with warm_forkserver() as path:
        assert path is not None
        deadline = time.monotonic() + 120
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        for r in range(args.rounds):
            for mode in ("fresh", "warm"):
                rows["launch"][mode].append(launch_once(work / f"launch-{r}-{mode}", script,
                                                        path if mode == "warm" else None))
        os.environ.pop(ZYGOTE_ENV, None)  # the campaign commands start their own (or none)
    for r in range(args.rounds):
        got = {}
        for mode in ("fresh", "warm"):
            out = work / f"campaign-{r}-{mode}"
            env = dict(os.environ, PRISM_WARM_FORKSERVER="0" if mode == "fresh" else "1",
                       PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "prism", "campaign", str(toml), "--out", str(out)],
                                  env=env, capture_output=True, text=True)
            took = time.perf_counter() - t0
            if proc.returncode != 0:
                raise SystemExit(f"the campaign ({mode}) failed:\n{proc.stdout}\n{proc.stderr}")
            rows["campaign"][mode].append(took)
            got[mode] = losses(out)
        same_losses &= got["fresh"] == got["warm"] and len(got["warm"]) == args.points
    print(f"{'what':<34} {'fresh s':>9} {'warm s':>9} {'fresh/warm':>11}")
    table = {}
    for what, label in (("launch", "2-rank launch, to the ranks' exit"),
                        ("campaign", f"campaign of {args.points} CPU captures")):
        f, w = statistics.median(rows[what]["fresh"]), statistics.median(rows[what]["warm"])
        table[what] = {"fresh_s": f, "warm_s": w, "ratio": f / w}
        print(f"{label:<34} {f:>9.2f} {w:>9.2f} {f / w:>10.2f}x")
    print(f"captures' losses equal between the modes: {same_losses}")
    doc = {"benchmark": "warm_forkserver", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
           "command": " ".join(["python", "bench/warm_forkserver.py", *sys.argv[1:]]),
           "rounds": args.rounds, "points": args.points, "runs_s": rows, "median": table,
           "losses_equal": same_losses}
    write_json(args.out or result_path("warm_forkserver"), doc)
    if not same_losses:
        raise SystemExit("the captures' losses differ between a fresh and a warm fork server")


if __name__ == "__main__":
    main()
