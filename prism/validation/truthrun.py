"""Ground-truth runs: a command as a plain torch.distributed job (no Prism),
one process per rank, under the step clock.

``launch_truth`` runs ``prism/validation/stepclock.py CMD...`` on ``world``
ranks through the launcher (``endpoint=None``: no coordinator), each rank
writing ``rank-R.txt`` (and, when asked, ``profile-rank-R.json``) into one
folder; ``read_clocks`` parses those files. ``bench/nccl_accuracy.py``,
``bench/truth_segments.py``, ``bench/truth_timeline.py`` and
``prism.validation.cpunoise`` take their truths this way.
"""

from __future__ import annotations

import pathlib

from prism.validation import stepclock

#: the step clock, run as a script in every rank
STEPCLOCK = str(pathlib.Path(stepclock.__file__).resolve())


def launch_truth(world: int, cmd: list[str], d: pathlib.Path, timeout: float, env: dict | None = None) -> None:
    """Run ``cmd`` under the step clock as a plain job of ``world`` ranks
    writing into ``d``; raises with the ranks' log tails if one fails."""
    from prism.shell.launcher import launch_ranks

    env = {"PRISM_STEPCLOCK_DIR": str(d), "PRISM_STEPCLOCK_SYNC": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    h = launch_ranks(world, None, d, [STEPCLOCK, *cmd], env=env, show_ranks=())
    try:
        codes = h.wait(timeout=timeout)
    finally:
        h.close()  # kills what still runs (a timeout) and closes the fork server's pipe
    if any(c != 0 for c in codes):
        logs = "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted((d / "logs").glob("*.log")))
        raise RuntimeError(f"ground-truth run failed (exit codes {codes}):\n{logs}")


def read_clocks(d: pathlib.Path, world: int) -> tuple[list[list[int]], list[dict]]:
    """Per rank of a run folder: (step end times in ns, memory lines)."""
    ends, mems = [], []
    for r in range(world):
        e, m = stepclock.parse((d / f"rank-{r}.txt").read_text())
        ends.append(e)
        mems.append(m)
    return ends, mems
