"""Which steps of a run every rank completed, and the run cut to them (sans-IO).

A capture that failed or was killed leaves ranks at different points: one
rank died before its optimizer step returned while the others finished the
step. Iteration times need every rank's end of step, so ``prism predict`` and
``prism report`` work on the steps every rank completed: ``completeness``
says which those are and what the ranks did beyond them, ``cut_to_step``
keeps each rank's events up to its end of that step.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prism.core import trace as T


@dataclass(frozen=True)
class Completeness:
    #: Steps every rank completed (each rank's optimizer step returned), in order.
    common: tuple[int, ...]
    #: Rank -> the steps it completed that not every rank did.
    beyond: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: Rank -> (status, the exception line of its message) of ranks that did not end "ok".
    ended: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: Those of ``ended`` that Prism stopped because another rank failed.
    stopped: frozenset[int] = frozenset()

    @property
    def uneven(self) -> bool:
        """Some rank completed a step another did not: the run must be cut."""
        return any(self.beyond.values())

    @property
    def failed(self) -> bool:
        return bool(self.ended)

    def describe(self) -> list[str]:
        """What is missing, one line each (empty for a complete run): the
        ranks that failed on their own first, then how many Prism stopped."""
        lines = []
        causes = {r: v for r, v in self.ended.items() if r not in self.stopped}
        for rank, (status, message) in sorted(causes.items())[:4]:
            lines.append(f"rank {rank} ended {status}" + (f": {message}" if message else ""))
        if len(causes) > 4:
            lines.append(f"... and {len(causes) - 4} more ranks failed")
        stopped = sorted(set(self.ended) - set(causes))
        if stopped:
            lines.append(f"{len(stopped)} other rank(s) (e.g. rank {stopped[0]}) were stopped when the capture stopped")
        if self.uneven:
            steps = sorted({s for v in self.beyond.values() for s in v})
            short = [r for r, v in self.beyond.items() if not v]
            lines.append(f"step(s) {', '.join(map(str, steps))} left out: not completed by "
                         f"{len(short)} rank(s) (e.g. rank {short[0]})" if short else
                         f"step(s) {', '.join(map(str, steps))} left out")
        return lines


def completeness(ranks: Mapping[int, Sequence[T.Event]]) -> Completeness:
    steps: dict[int, set[int]] = {}
    ended: dict[int, tuple[str, str]] = {}
    stopped: set[int] = set()
    ends = {rank: next((e for e in reversed(events) if type(e) is T.RankEnd), None) for rank, events in ranks.items()}
    # Events built in memory (synthetic runs) carry no end records at all.
    recorded = any(end is not None for end in ends.values())
    for rank, events in ranks.items():
        steps[rank] = {e.step for e in events if type(e) is T.Iteration}
        end = ends[rank]
        if end is None:
            if recorded:
                ended[rank] = ("without an end record", "its file was cut off (killed or still being written)")
        elif end.status != "ok":
            ended[rank] = (end.status, _last_words(end.message))
            if end.status == "killed" or _STOPPED.search(end.message):
                stopped.add(rank)
    common_set = set.intersection(*steps.values()) if steps else set()
    # Only a prefix of steps is usable: step k needs step k-1's end as its start.
    common: list[int] = []
    for s in sorted(common_set):
        if common and s != common[-1] + 1:
            break
        common.append(s)
    beyond = {r: tuple(sorted(v - set(common))) for r, v in steps.items()}
    return Completeness(tuple(common), beyond, ended, frozenset(stopped))


def cut_to_step(ranks: Mapping[int, Sequence[T.Event]], last: int) -> dict[int, list[T.Event]]:
    """Each rank's events up to and including its end of step ``last``."""
    out: dict[int, list[T.Event]] = {}
    for rank, events in ranks.items():
        kept: list[T.Event] = []
        for e in events:
            kept.append(e)
            if type(e) is T.Iteration and e.step == last:
                break
        out[rank] = kept
    return out


#: Messages of ranks that Prism stopped because another rank failed.
_STOPPED = re.compile(r"from the coordinator|shut the run down|peer_failed|stopped by Prism|capture stopped")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")


def _last_words(message: str) -> str:
    """The exception line of a traceback (else its last line), shortened."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    found = [line for line in lines if _EXCEPTION_LINE.match(line)]
    return (found[-1] if found else lines[-1])[:200]
