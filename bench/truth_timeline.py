"""The ground truth's GPU timeline of one step, cut at its communication
kernels: was the GPU waiting for the CPU, or the CPU ahead of the GPU?

    python bench/truth_timeline.py --world 2 --step 5 [--capture RUN] [--out DIR] -- CMD...
    python bench/truth_timeline.py --profiles DIR --step 5 [--capture RUN]

Runs CMD (as ``bench/truth_segments.py`` does: plain torch.distributed, one
process per GPU with NCCL) with ``PRISM_STEPCLOCK_PROFILE_STEP`` and
``PRISM_STEPCLOCK_PROFILE_CPU=0``: the torch profiler records only the GPU's
activity and the CUDA calls of step ``--step`` (no operator records, so the
CPU runs near its real speed; with operators GPT tp2's profiled step took
118 ms against 44). Each rank's step is cut at its NCCL kernels. Per segment
(the compute between two communication kernels):

- ``free``: when the stream was free for it (the previous NCCL kernel's end,
  ms from the step's first activity);
- ``ahead``: how long before ``free`` the CPU had launched the segment's
  first kernel (negative: the GPU waited for the CPU that long);
- ``busy``: the union of the segment's kernels (NCCL's excluded);
- ``span``: from ``free`` (or the first kernel's launch, if later) to the
  segment's last kernel's end; ``span - busy`` is time the GPU waited for
  the CPU inside the segment;
- ``cpu``: the CPU's time for the segment, from the launch of the
  communication kernel before it to the launch of the one after it (the
  call's own issue cost included), comparable with the capture's CPU share
  plus the profile's ``issue_us``.

With ``--capture`` the capture's same step is printed beside it, per stretch
between communication calls: the CPU share, GPU time and, where the capture
recorded it, the wall time (which, from a drained GPU, is the finish time
the two-clock replay's ``max(cpu, gpu)`` leaves out). Prints a table per
rank; ``--json`` writes it. Needs CUDA (NCCL kernels). The cutting itself
is ``prism.validation.truthcut.timeline``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from truth_segments import add_truth_args, profiles_folder  # noqa: E402

from prism.validation.truthcut import capture_stretches, timeline  # noqa: E402

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_truth_args(ap)
    a = ap.parse_args()
    d = profiles_folder(ap, a, "truth_timeline", {"PRISM_STEPCLOCK_PROFILE_CPU": "0"})
    cap = capture_stretches(a.capture, a.step) if a.capture else {}
    out: dict = {"step": a.step, "ranks": {}}
    for p in sorted(d.glob("profile-rank-*.json")):
        r = int(p.stem.rsplit("-", 1)[1])
        try:
            tl = timeline(json.loads(p.read_text()))
        except (ValueError, json.JSONDecodeError) as e:
            raise SystemExit(f"truth_timeline: {p}: {e}") from None
        out["ranks"][r] = tl
        rows = cap.get(r, [])
        print(f"rank {r}, step {a.step}: GPU busy {tl['busy_ms']:.2f} ms (NCCL excluded) over {tl['span_ms']:.2f} ms")
        print(f"  {'#':>3} {'free':>8} {'ahead':>7} {'busy':>7} {'span':>7} {'wait':>6} {'cpu':>7} {'nk':>4} {'next ahead':>10}"
              + ("   capt cpu capt gpu capt wall" if rows else ""))
        for i, s in enumerate(tl["segments"]):
            nxt = s["next_comm_ahead_ms"]
            line = (f"  {i:3d} {s['free_ms']:8.3f} {s['ahead_ms']:7.3f} {s['busy_ms']:7.3f} {s['span_ms']:7.3f} "
                    f"{s['span_ms'] - s['busy_ms']:6.3f} {s['cpu_ms'] if s['cpu_ms'] is not None else float('nan'):7.3f} {s['kernels']:4d} {nxt if nxt is not None else float('nan'):10.3f}")
            if i < len(rows):
                c = rows[i]
                line += f"   {c['cpu_ms']:8.3f} {c['gpu_ms']:8.3f} {c['wall_ms']:9.3f}"
            print(line)
        if rows and len(rows) != len(tl["segments"]):
            print(f"  (the capture has {len(rows)} stretches, the truth {len(tl['segments'])}: compare with care)")
        out["ranks"][r]["capture"] = rows
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
