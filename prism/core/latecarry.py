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

``bench/late_carry.py`` applies them to a call log.
"""

from __future__ import annotations

#: What NCCL's host side takes to issue a collective (25-42 us per call by op,
#: measured on two H200s, ``bench/results/archive/nccl_accuracy-2026-11.md``):
#: the part of Prism's own issue time the real job would spend too.
NCCL_ISSUE_NS = 30_000

RULES = ("excess", "min", "all")


def carried(rule: str, late: int, gap: int, excess: int) -> int:
    """The ns of ``late`` that ``rule`` takes out (``gap``: the next reach
    less its host issue; ``excess``: Prism's time beyond NCCL's before it)."""
    if rule == "all":
        return late
    gap = max(0, gap)
    return min(late, gap + excess if rule == "excess" else gap)
