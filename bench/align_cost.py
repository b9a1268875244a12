"""What aligning one data-dependent step with its reference costs:
``difflib.SequenceMatcher`` (what ``two_clock_columns`` used before) against
``prism.core.align.matched_pairs`` (Myers), side by side on the same
synthetic signatures.

A step is ``N`` segments of a repeating per-layer pattern (an MoE block:
join, two all-to-alls, an all-reduce), with ``D`` extra joins inserted at
random places (the routing's data-dependent ``.tolist()``). Both must pair
every reference segment; the table gives the time per alignment (best of 3)
and how many pairs each found. Writes ``bench/results/align_cost-DATE[-MACHINE].json``.

``--captures`` instead aligns the real steps of the kept GPU captures
(bench/results/traces, the sets of ``prism.validation.fidelity``) both ways and
prints, per distinct alignment, the reference and step lengths, the pairs
each found and how many of difflib's pairs the longest common subsequence
shares.

    python bench/align_cost.py [--sizes 1000,4000] [--diffs 0,4,16,64]
    python bench/align_cost.py --captures
"""

from __future__ import annotations

import argparse
import difflib
import json
import pathlib
import platform
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from prism.core.align import matched_pairs  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import result_path  # noqa: E402

LAYER = [(True, 3, 1, 0), (False, 1, 2, 7), (False, 1, 2, 7), (False, 1, 0, 2)]


def steps(n: int, d: int, seed: int) -> tuple[tuple, tuple]:
    ref = tuple((LAYER * (n // len(LAYER) + 1))[:n])
    rng = random.Random(seed)
    mine = list(ref)
    for _ in range(d):
        mine.insert(rng.randrange(len(mine) + 1), (True, 3, 1, 1))
    return ref, tuple(mine)


def best_s(fn, rounds: int = 3) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def via_difflib(a, b) -> list[tuple[int, int]]:
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return [(i + k, j + k) for i, j, size in sm.get_matching_blocks() for k in range(size)]


def captures() -> None:
    import tempfile

    from prism.core import graph
    from prism.shell import runfolder
    from prism.validation import fidelity

    seen: dict[tuple, str] = {}
    calls: list[tuple] = []

    def both(a, b):
        dl, my = via_difflib(a, b), matched_pairs(a, b)
        calls.append((len(a), len(b), len(dl), len(my), len(set(dl) & set(my))))
        return my

    graph.matched_pairs = both
    print(f"{'capture':44s}{'ref':>5}{'step':>6}{'difflib':>9}{'LCS':>6}{'shared':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        fidelity.extract(tmp)
        for _, table in fidelity.SETS.values():
            for name in table:
                calls.clear()
                graph.ExecutionGraph.from_events(runfolder.read_run(pathlib.Path(tmp) / name).ranks)
                for c in calls:
                    if c[2] != c[3] or c[4] != c[2]:
                        if c not in seen:
                            seen[c] = name
                            print(f"{name:44s}{c[0]:>5}{c[1]:>6}{c[2]:>9}{c[3]:>6}{c[4]:>8}")
    print(f"{len(seen)} distinct alignments where the two differ (first capture that shows each)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,4000")
    ap.add_argument("--diffs", default="0,4,16,64")
    ap.add_argument("--captures", action="store_true", help="align the kept captures' steps both ways")
    args = ap.parse_args()
    if args.captures:
        captures()
        return
    rows = []
    print(f"Python {platform.python_version()}; time per alignment, best of 3")
    print(f"{'N':>6}{'D':>5}{'difflib s':>11}{'myers s':>10}{'ratio':>8}{'pairs dl':>10}{'pairs my':>10}")
    for n in (int(s) for s in args.sizes.split(",")):
        for d in (int(s) for s in args.diffs.split(",")):
            a, b = steps(n, d, seed=n + d)
            t_dl, p_dl = best_s(lambda: via_difflib(a, b))
            t_my, p_my = best_s(lambda: matched_pairs(a, b))
            rows.append({"n": n, "d": d, "difflib_s": t_dl, "myers_s": t_my,
                         "pairs_difflib": len(p_dl), "pairs_myers": len(p_my)})
            print(f"{n:>6}{d:>5}{t_dl:>11.4f}{t_my:>10.4f}{t_dl / max(t_my, 1e-9):>8.1f}{len(p_dl):>10}{len(p_my):>10}")
    out = result_path("align_cost")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"python": platform.python_version(), "machine": platform.machine(),
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
