"""The clock sync's estimator (``prism.core.clocksync``): the offset of a
sample and the choice of the sample with the shortest round trip."""

import pytest

from prism.core.clocksync import ClockSample, best_sample

#: The coordinator's clock runs this far ahead of the rank's.
OFFSET = 5_000_000_000


def sample(sent: int, forward: int, back: int) -> ClockSample:
    """A probe sent at ``sent`` (rank's clock) that took ``forward`` ns to
    the coordinator and ``back`` ns home."""
    return ClockSample(sent, sent + forward + OFFSET, sent + forward + back)


def test_a_symmetric_round_trip_gives_the_offset_exactly():
    s = sample(1_000, 300, 300)
    assert s.rtt_ns == 600 and s.offset_ns == OFFSET


def test_an_asymmetric_one_is_off_by_half_the_difference():
    s = sample(1_000, 900, 100)  # the stamp came late in the round trip
    assert s.offset_ns - OFFSET == (900 - 100) // 2


def test_the_shortest_round_trip_wins_wherever_it_is():
    samples = [sample(0, 40_000_000, 1_000),     # the first: a handshake-like delay on the way there
               sample(100, 5_000, 30_000),
               sample(200, 2_000, 2_500),        # the shortest
               sample(300, 1_000, 9_000_000),    # a descheduled rank on the way home
               sample(400, 3_000, 3_000)]
    best = best_sample(samples)
    assert best is samples[2]
    assert best.offset_ns - OFFSET == (2_000 - 2_500) // 2
    assert samples[0].offset_ns - OFFSET > 10_000_000  # the first alone: 20 ms off
    assert best_sample(reversed(samples)) is samples[2]


def test_ties_keep_the_first_and_a_negative_offset_rounds_down():
    a, b = ClockSample(10, 3, 20), ClockSample(30, 13, 40)
    assert best_sample([a, b]) is a
    assert a.offset_ns == 3 - 15 and ClockSample(0, 0, 1).offset_ns == 0


def test_no_samples_or_a_clock_going_backwards_is_refused():
    with pytest.raises(ValueError, match="no clock samples"):
        best_sample([])
    with pytest.raises(ValueError, match="went backwards"):
        best_sample([ClockSample(100, 0, 50)])
