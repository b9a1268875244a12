"""Which steps every rank completed, and the run cut to them (prism.core.steps)."""

from prism.core import trace as T
from prism.core.steps import completeness, cut_to_step


def _rank(steps: int, status: str = "ok", message: str = "", tail: int = 1) -> list:
    events = []
    for s in range(steps):
        events += [T.Compute(s, 10 * s, 10 * s + 5), T.Iteration(s, 10 * s + 9)]
    events += [T.Compute(steps, 10 * steps, 10 * steps + 5)] * tail
    return events + [T.RankEnd(10 * steps + 9, status, message)]


def test_a_complete_run_is_complete():
    done = completeness({0: _rank(3), 1: _rank(3)})
    assert done.common == (0, 1, 2) and not done.uneven and not done.failed and done.describe() == []


def test_a_failed_rank_names_itself_and_the_ranks_prism_stopped_are_counted():
    boom = "Traceback (most recent call last):\n  File \"x.py\", line 3\nRuntimeError: boom at step 2\n"
    stop = "prism.rank.runtime.PrismRankError: rank 0: the coordinator at ipc://x shut the run down: capture stopped"
    done = completeness({0: _rank(3, "error", stop), 1: _rank(3, "error", stop), 2: _rank(2, "error", boom)})
    assert done.common == (0, 1) and done.uneven and done.failed
    assert done.beyond == {0: (2,), 1: (2,), 2: ()}
    lines = done.describe()
    assert lines[0] == "rank 2 ended error: RuntimeError: boom at step 2"
    assert lines[1] == "2 other rank(s) (e.g. rank 0) were stopped when the capture stopped"
    assert lines[2] == "step(s) 2 left out: not completed by 1 rank(s) (e.g. rank 2)"


def test_a_cut_file_counts_as_not_ended():
    events = _rank(2)[:-1]  # no rank_end: killed mid-write
    done = completeness({0: _rank(2), 1: events})
    assert done.ended[1][0] == "without an end record" and done.common == (0, 1)
    # events built in memory have no end records at all: nothing is judged failed
    assert not completeness({0: _rank(2)[:-1], 1: _rank(2)[:-1]}).failed


def test_only_a_prefix_of_steps_counts():
    gap = [e for e in _rank(3) if not (type(e) is T.Iteration and e.step == 1)]
    assert completeness({0: _rank(3), 1: gap}).common == (0,)


def test_cut_keeps_each_rank_up_to_its_end_of_the_step():
    ranks = {0: _rank(3), 1: _rank(2)}
    cut = cut_to_step(ranks, 1)
    for events in cut.values():
        assert type(events[-1]) is T.Iteration and events[-1].step == 1
        assert [e.step for e in events if type(e) is T.Iteration] == [0, 1]
