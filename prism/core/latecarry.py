"""How much of a late release a GPU sandbox's dilated clock takes out (sans-IO).

A device-path collective's release reaches the GPU ``late`` ns after it was
due; the stream's next call, issued by the host ``gap`` ns before the GPU
reached it, shows how much of that delayed the stream. Had the release been on
time the reach would have been ``max(reach - late, issue - excess)``, where
``excess`` is the host's time in Prism's calls before that issue beyond what
NCCL's host side takes (the real job's host would not have spent it). The
rules (``PRISM_DEVICE_LATE_CARRY``; ``prism.rank.devicepath._Watcher``):

    excess  min(late, gap + excess)   (the default)
    min     min(late, gap)            (the rule before 2026-12-06)
    all     late
    step    late where the next call is in a later step of the program,
            else as ``excess`` (an experiment, 2026-12-08): a training loop
            waits for its GPU at a step's end (``loss.item()``), so the host
            comes to the next step's first call late by the GPU's delay, and
            the small ``gap`` there says nothing of a lateness absorbed

``bench/late_carry.py`` applies them to a call log.
"""

from __future__ import annotations

#: What NCCL's host side takes to issue a collective (25-42 us per call by op,
#: measured on two H200s, ``bench/results/archive/nccl_accuracy-2026-11.md``):
#: the part of Prism's own issue time the real job would spend too.
NCCL_ISSUE_NS = 30_000

RULES = ("excess", "min", "all", "step")


def carried(rule: str, late: int, gap: int, excess: int, new_step: bool = False) -> int:
    """The ns of ``late`` that ``rule`` takes out (``gap``: the next reach
    less its host issue; ``excess``: Prism's time beyond NCCL's before it;
    ``new_step``: the next call is in a later step than the late ones)."""
    if rule == "all" or (rule == "step" and new_step):
        return late
    gap = max(0, gap)
    return min(late, gap + excess if rule in ("excess", "step") else gap)
