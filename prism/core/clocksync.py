"""The clock offset of a rank on another host, NTP style (sans-IO).

After its ``Welcome`` a rank whose coordinator is not on its host sends a
few ``ClockProbe`` messages, one at a time, each stamped with its monotonic
clock (``sent_ns``); the coordinator answers each at once with a
``ClockEcho`` stamped with its own clock (``coord_ns``), and the rank notes
when the echo came back (``recv_ns``). Taking the coordinator's stamp to lie
halfway through the round trip, ``coordinator_ns = rank_ns + offset`` with
``offset = coord_ns - (sent_ns + recv_ns) // 2``, wrong by at most half the
round trip (all of it spent on one leg). So the sample with the shortest
round trip is kept (``best_sample``): delays in queues, a busy coordinator
loop or a descheduled thread only lengthen round trips, and the shortest
one had the least of them. The rank then sends the offset it settled on
(``ClockOffset``), so that the coordinator uses the same one.

The shells do the sending and the reading of clocks (``prism.rank.runtime``,
``prism.shell.coordinator``); this module only does the arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ClockSample", "best_sample"]


@dataclass(frozen=True, slots=True)
class ClockSample:
    """One probe's round trip: the rank's clock when it sent the probe and
    when the echo came back, the coordinator's when it answered."""

    sent_ns: int
    coord_ns: int
    recv_ns: int

    @property
    def rtt_ns(self) -> int:
        """The round trip, on the rank's clock (it bounds the offset's error: half of it)."""
        return self.recv_ns - self.sent_ns

    @property
    def offset_ns(self) -> int:
        """``coordinator_ns - rank_ns``, taking the coordinator's stamp to be mid-trip."""
        return self.coord_ns - (self.sent_ns + self.recv_ns) // 2


def best_sample(samples: Iterable[ClockSample]) -> ClockSample:
    """The sample with the shortest round trip (the first of equals)."""
    best: ClockSample | None = None
    for s in samples:
        if s.rtt_ns < 0:
            raise ValueError(f"a clock sample came back before it was sent ({s}): the rank's clock went backwards")
        if best is None or s.rtt_ns < best.rtt_ns:
            best = s
    if best is None:
        raise ValueError("no clock samples: send at least one probe")
    return best
