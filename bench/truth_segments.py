"""The ground truth's own step, cut into the segments a capture records, beside
the capture's: which segments does the replay get wrong?

    python bench/truth_segments.py --world 2 --step 5 [--capture RUN] [--out DIR] -- CMD... (CMD runs past step 5)
    python bench/truth_segments.py --profiles DIR --step 5 [--capture RUN]     # already recorded

Runs CMD (as ``bench/nccl_accuracy.py`` runs its truths: plain
torch.distributed, one process per GPU with NCCL, or gloo on CPU) under
the step clock (``prism.validation.stepclock``) with ``PRISM_STEPCLOCK_PROFILE_STEP``: the torch
profiler records exactly step ``--step`` of every rank. Each rank's step is
cut at its communication calls (the ``c10d::*`` operators on the script's
thread), as a capture cuts it; per segment: the CPU span from the previous
call's end to this call's start, and the GPU busy time of the kernels and
copies launched in that span (their union, from the launches' correlation
ids; NCCL's kernels run inside the calls and are counted apart). With
``--capture`` the same step of a Prism capture of the same command is shown
beside it: per stretch between two communication calls, the sum of the CPU
shares and of the GPU times the replay uses (``ExecutionGraph`` two-clock
columns; a capture also cuts at the script's GPU waits, summed here).
Prints a table per rank and writes ``--json``. Runs on CPU too (gloo; no GPU
column).

The profiler adds its own cost to every operator on the CPU: the truth's CPU
spans are upper bounds (a tiny CPU GPT step on the 2-core VM: 25.4 ms of
spans against 13.2 ms of capture CPU shares, stretch by stretch 1-10x). The
GPU busy times are the kernels' own and compare directly.

The cutting itself is ``prism.validation.truthcut.cut_profile``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prism.validation.truthcut import capture_stretches, cut_profile  # noqa: E402,F401
from prism.validation.truthrun import launch_truth  # noqa: E402


def run_truth(world: int, cmd: list[str], out: pathlib.Path, step: int, timeout: float,
              extra_env: dict | None = None, tool: str = "truth_segments") -> None:
    try:
        launch_truth(world, cmd, out, timeout, {"PRISM_STEPCLOCK_PROFILE_STEP": str(step), **(extra_env or {})})
    except RuntimeError as e:
        raise SystemExit(f"{tool}: {e}") from None


def add_truth_args(ap: argparse.ArgumentParser) -> None:
    """The options this tool and ``truth_timeline.py`` share."""
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--step", type=int, default=5, help="the step to profile (default 5)")
    ap.add_argument("--profiles", default=None, help="a folder with profile-rank-R.json already recorded")
    ap.add_argument("--capture", default=None, help="a Prism capture of the same command (its run folder)")
    ap.add_argument("--out", default=None, help="where the truth run writes (default: a temporary folder)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command (as for prism capture)")


def profiles_folder(ap: argparse.ArgumentParser, a: argparse.Namespace, tool: str,
                    extra_env: dict | None = None) -> pathlib.Path:
    """``--profiles``, or the folder of a truth run of the command, profiled at ``--step``."""
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if a.profiles:
        return pathlib.Path(a.profiles)
    if not cmd:
        ap.error("give --profiles DIR or a command after --")
    folder = pathlib.Path(a.out or tempfile.mkdtemp(prefix=f"{tool.replace('_', '-')}-"))
    folder.mkdir(parents=True, exist_ok=True)
    run_truth(a.world, cmd, folder, a.step, a.timeout, extra_env, tool)
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_truth_args(ap)
    a = ap.parse_args()
    folder = profiles_folder(ap, a, "truth_segments")
    files = sorted(folder.glob("profile-rank-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    if not files:
        raise SystemExit(f"truth_segments: no profile-rank-R.json in {folder} (did the run reach step {a.step}?)")
    truth = {int(p.stem.rsplit("-", 1)[1]): cut_profile(json.loads(p.read_text())) for p in files}
    cap = capture_stretches(a.capture, a.step) if a.capture else {}
    for r, t in truth.items():
        print(f"rank {r}, step {a.step}: truth CPU span {t['cpu_ms']:.2f} ms, GPU busy {t['gpu_ms']:.2f} ms "
              f"(+ NCCL kernels {t['comm_gpu_ms']:.2f} ms); {len(t['segments'])} stretches between calls")
        c = cap.get(r, [])
        head = f"  {'#':>3} {'ended by':24} {'truth cpu':>9} {'truth gpu':>9}"
        print(head + (f" {'capt cpu':>9} {'capt gpu':>9} {'capt ended by':20}" if c else ""))
        for i, s in enumerate(t["segments"]):
            line = f"  {i:3d} {s['ended_by'][:24]:24} {s['cpu_ms']:9.3f} {s['gpu_ms']:9.3f}"
            if i < len(c):
                line += f" {c[i]['cpu_ms']:9.3f} {c[i]['gpu_ms']:9.3f} {c[i]['ended_by'][:20]:20}"
            print(line)
        if c and len(c) != len(t["segments"]):
            print(f"  (the capture has {len(c)} stretches: the calls differ, compare with care)")
        if c:
            print(f"  sums: truth cpu {sum(s['cpu_ms'] for s in t['segments']):.2f} gpu "
                  f"{sum(s['gpu_ms'] for s in t['segments']):.2f}; capture cpu {sum(x['cpu_ms'] for x in c):.2f} "
                  f"gpu {sum(x['gpu_ms'] for x in c):.2f} ms")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"step": a.step, "truth": truth, "capture": cap}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
