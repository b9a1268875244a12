"""Run a training command unmodified and log when each optimizer step returns.

Used by ``bench/accuracy.py`` for ground-truth runs (plain torch.distributed,
no Prism): ``_stepclock.py -m MODULE ARGS...`` or ``_stepclock.py SCRIPT ARGS...``.
A global optimizer step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``)
appends ``STEP MONOTONIC_NS`` to ``$PRISM_STEPCLOCK_DIR/rank-R.txt``; the step
is counted per rank from 0. CLOCK_MONOTONIC is one clock for the whole host
on Linux, so the ranks' times compare.
"""

import os
import runpy
import sys
import time

from torch.optim.optimizer import register_optimizer_step_post_hook


def main() -> None:
    out_dir = os.environ["PRISM_STEPCLOCK_DIR"]
    rank = int(os.environ["RANK"])
    log = open(os.path.join(out_dir, f"rank-{rank}.txt"), "w", buffering=1)
    count = [0]

    def hook(optimizer, args, kwargs) -> None:
        log.write(f"{count[0]} {time.monotonic_ns()}\n")
        count[0] += 1

    register_optimizer_step_post_hook(hook)
    cmd = sys.argv[1:]
    if cmd[0] == "-m":
        sys.argv = [cmd[1], *cmd[2:]]
        runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = cmd
        runpy.run_path(cmd[0], run_name="__main__")


if __name__ == "__main__":
    main()
