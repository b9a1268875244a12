"""Scale-out (prism.core.scaleout) on synthetic Megatron runs: scaling the data
parallel size gives the structure of a run at that size, and ``prism predict
--scale-dp`` (against real captures: tests/integration/test_real_captures.py)."""

import numpy as np
import pytest

from prism import cli
import prism.app.predict as app_predict
from prism.core.graph import ExecutionGraph
from prism.core.scaleout import (
    Layout,
    ScaleOutError,
    compare_structure,
    plan_scale_out,
    scale_events,
    scale_graph,
    structure,
)
from prism.core.synthetic import MegatronSpec, megatron_events
from prism.core.trace import Collective, GroupCreated, Manifest, group_id

COLUMNS = ("kind", "rank", "dur", "is_async", "group", "seq", "op", "peer", "tag", "nbytes", "wait_of", "step",
           "rec_start", "rec_end", "ref")


@pytest.mark.parametrize("tp,pp,dp,ep,target", [(2, 2, 2, 1, 4), (2, 2, 2, 1, 8), (1, 2, 4, 2, 8), (2, 1, 2, 1, 6)])
def test_scaling_synthetic_equals_the_synthetic_run_at_that_size(tp, pp, dp, ep, target):
    small = megatron_events(MegatronSpec(tp=tp, pp=pp, dp=dp, ep=ep))
    lay = Layout(tp, pp, dp, ep)
    big = ExecutionGraph.from_events(scale_events(small, lay, target))
    real = ExecutionGraph.from_events(megatron_events(MegatronSpec(tp=tp, pp=pp, dp=target, ep=ep)))
    new = lay.with_dp(target)
    assert big.world_size == real.world_size == tp * pp * target
    assert compare_structure(structure(big, new), structure(real, new)) == []
    s = structure(big, new)
    # from the layout: TP groups pp*dp, DP groups pp*tp, pipeline groups dp*tp, EP dp/ep*pp*tp
    kinds = dict(s.group_kinds)
    assert kinds.get("tp", 0) == (pp * target if tp > 1 else 0)
    assert kinds["dp"] == pp * tp
    if ep > 1:
        assert kinds["dp-block2"] == target // ep * pp * tp


def test_structure_differences_are_named():
    lay = Layout(2, 2, 2)
    a = structure(ExecutionGraph.from_events(megatron_events(MegatronSpec(tp=2, pp=2, dp=2))), lay)
    b = structure(ExecutionGraph.from_events(megatron_events(MegatronSpec(tp=2, pp=2, dp=2, micro_batches=3))), lay)
    diff = compare_structure(a, b)
    assert any(line.startswith("collectives[('tp', 'all_reduce')]") for line in diff)


def test_array_path_equals_events_path():
    small = megatron_events(MegatronSpec(tp=2, pp=2, dp=4, ep=2))
    lay = Layout(2, 2, 4, 2)
    a = ExecutionGraph.from_events(scale_events(small, lay, 8))
    b = scale_graph(small, lay, 8)
    assert [g.gid for g in a.groups] == [g.gid for g in b.groups]
    assert [g.ranks for g in a.groups] == [g.ranks for g in b.groups]
    for col in COLUMNS:
        assert np.array_equal(getattr(a, col), getattr(b, col)), col


def test_new_ranks_copy_their_source_replica():
    small = megatron_events(MegatronSpec(tp=2, pp=2, dp=2))
    lay = Layout(2, 2, 2)
    big = scale_events(small, lay, 4)
    new = lay.with_dp(4)
    for r in range(new.world_size):
        t, d, p = new.coords(r)
        src = lay.rank(t, d % 2, p)
        durs = [(e.start_ns, e.end_ns) for e in big[r] if type(e).__name__ == "Compute"]
        assert durs == [(e.start_ns, e.end_ns) for e in small[src] if type(e).__name__ == "Compute"]
        # DP all_reduce bytes per rank do not change with DP
        dp_bytes = sorted(e.bytes for e in big[r] if isinstance(e, Collective) and e.async_op)
        assert dp_bytes == sorted(e.bytes for e in small[src] if isinstance(e, Collective) and e.async_op)


def _script_groups(lay: Layout, moe: bool) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Groups as prism.workloads.gpt creates them (its documented order), with their ids."""
    made = [tuple(range(lay.world_size))]
    made += [tuple(lay.rank(t, d, p) for t in range(lay.tp)) for p in range(lay.pp) for d in range(lay.dp)]
    made += [tuple(lay.rank(t, d, p) for d in range(lay.dp)) for p in range(lay.pp) for t in range(lay.tp)]
    made += [tuple(lay.rank(t, d, p) for p in range(lay.pp)) for d in range(lay.dp) for t in range(lay.tp)]
    if moe:
        made += [tuple(lay.rank(t, b * lay.ep + e, p) for e in range(lay.ep))
                 for p in range(lay.pp) for t in range(lay.tp) for b in range(lay.dp // lay.ep)]
        made += [tuple(lay.rank(t, e + lay.ep * k, p) for k in range(lay.dp // lay.ep))
                 for p in range(lay.pp) for t in range(lay.tp) for e in range(lay.ep)]
    return {group_id(i, ranks): (i, ranks) for i, ranks in enumerate(made)}


@pytest.mark.parametrize("lay,target,moe", [(Layout(2, 2, 2), 4, False), (Layout(2, 2, 2), 16, False),
                                            (Layout(2, 1, 4, 2), 8, True), (Layout(1, 2, 2), 6, False)])
def test_group_ids_are_the_ones_the_script_creates_at_the_larger_size(lay, target, moe):
    plan = plan_scale_out(lay, _script_groups(lay, moe), target)
    expected = _script_groups(lay.with_dp(target), moe)
    assert {gid: (i, ranks) for i, ranks, gid in plan.groups} == expected


def _tiny_run(lay: Layout, extra_coll=None) -> dict:
    """Every rank: its script groups, one all_reduce on its DP group, one broadcast on its pipeline group."""
    groups = _script_groups(lay, False)
    out = {}
    for r in range(lay.world_size):
        mine = sorted((i, gid, ranks) for gid, (i, ranks) in groups.items() if r in ranks)
        evs = [GroupCreated(gid, ranks, i, str(i), 0) for i, gid, ranks in mine]
        t, d, p = lay.coords(r)
        dpg = next(gid for i, gid, ranks in mine if ranks == tuple(lay.rank(t, x, p) for x in range(lay.dp)))
        ppg = next(gid for i, gid, ranks in mine if ranks == tuple(lay.rank(t, d, x) for x in range(lay.pp)))
        evs.append(Collective(dpg, 0, "all_reduce", "SUM", "float32", ((4,),), ((4,),), 16, issue_ns=1, wait_ns=1,
                              end_ns=2))
        evs.append(Collective(ppg, 0, "broadcast", "", "float32", ((1,),), ((1,),), 4, root=lay.pp - 1,
                              issue_ns=3, wait_ns=3, end_ns=4))
        if extra_coll is not None:
            evs.append(extra_coll(dpg))
        out[r] = evs
    return out


def test_roots_follow_their_replica_and_the_graph_loads():
    lay = Layout(1, 2, 2)
    big = scale_events(_tiny_run(lay), lay, 4)
    new = lay.with_dp(4)
    for r, evs in big.items():
        bc = next(e for e in evs if isinstance(e, Collective) and e.op == "broadcast")
        members = next(e.ranks for e in evs if isinstance(e, GroupCreated) and e.gid == bc.gid)
        assert new.coords(members[bc.root]) == (0, new.coords(r)[1], 1)
    ExecutionGraph.from_events(big)


def test_size_dependent_op_on_a_widening_group_is_refused():
    lay = Layout(1, 1, 2)
    run = _tiny_run(lay, lambda g: Collective(g, 1, "all_gather_into_tensor", "", "float32", ((4,),), ((8,),), 16))
    why = r"group '.*' \(creation index \d+, ranks \[0, 1\]\) spans DP .* carries all_gather_into_tensor.*\(FSDP"
    with pytest.raises(ScaleOutError, match=why):
        scale_events(run, lay, 4)
    with pytest.raises(ScaleOutError, match=why):
        scale_graph(run, lay, 4)


@pytest.mark.parametrize("lay,target,match", [
    (Layout(2, 2, 1), 4, "capture with dp >= 2"),
    (Layout(1, 1, 2, 2), 4, r"dp >= 2\*ep"),
    (Layout(1, 1, 2), 3, "must be a multiple of the captured dp 2"),
    (Layout(1, 1, 2), 0, "positive int"),
])
def test_requests_that_cannot_be_scaled_say_why(lay, target, match):
    with pytest.raises(ScaleOutError, match=match):
        plan_scale_out(lay, _script_groups(lay, lay.ep > 1), target)


def test_group_off_the_layout_axes_is_refused():
    lay = Layout(2, 1, 2)
    groups = {"world": (0, (0, 1, 2, 3)), group_id(1, (0, 3)): (1, (0, 3))}
    with pytest.raises(ScaleOutError, match="not a product of TP x DP x PP"):
        plan_scale_out(lay, groups, 4)


def _manifest(layout, world):
    return Manifest(1, "r", world, 0, ("x",), "cpu", "0", "0", "host", layout=layout)


def test_layout_from_manifest():
    assert Layout.from_manifest(_manifest((("tp", 2), ("pp", 2)), 4)) == Layout(2, 2, 1)
    with pytest.raises(ScaleOutError, match="gives tp\\*pp\\*dp = 4 ranks but the run has 8"):
        Layout.from_manifest(_manifest((("tp", 2), ("pp", 2)), 8))


def test_predict_scale_dp(monkeypatch, capsys):
    events = megatron_events(MegatronSpec(tp=2, pp=2, dp=2, iterations=3))
    monkeypatch.setattr(app_predict, "load_run_events", lambda run: events)
    assert cli.main(["predict", "RUN", "--scale-dp", "8", "--layout", "tp=2,pp=2,dp=2"]) == 0
    out = capsys.readouterr().out
    assert "to dp 8 (world 32)" in out and "world size 32" in out
    assert cli.main(["predict", "RUN", "--scale-dp", "8"]) == 2
    assert "needs the run's layout" in capsys.readouterr().err
    assert cli.main(["predict", "RUN", "--scale-dp", "3", "--layout", "tp=2,pp=2,dp=2"]) == 2
    assert "multiple of the captured dp 2" in capsys.readouterr().err
