"""Emulation at scale, in-process: folding the scaled-out DP replicas
(``ScalePlan.fold`` with ``HybridReplay(fold=...)``) gives the unfolded
engine's timeline exactly while stepping a few ranks; a sandbox's groups are
matched to the scaled graph's by members and creation order
(``prism.core.groupmatch``); ``prism emulate --scale-dp`` checks its options
before anything is launched (``prism.app.emulate``)."""

import dataclasses

import numpy as np
import pytest

from prism.app import emulate as E
from prism.app.errors import UsageError
from prism.core.costmodel import CostModel, Link
from prism.core.groupmatch import GroupMatcher, creation_index
from prism.core.hybrid import HybridReplay
from prism.core.scaleout import Layout, scale_out
from prism.core.synthetic import MegatronSpec, megatron_events
from prism.core.trace import Collective, GroupCreated, Manifest, group_id
from prism.shell import runfolder
from tests.support.hybrid_driver import drive

MODEL = CostModel("test", 4, Link(100e9, 2e-6), Link(25e9, 5e-6), base_latency=3e-6, source="test")


def _slower(eng, graph, factor):
    dur = graph.dur

    def arrival(rank, node, t0):
        cn = eng.next_call_node(rank, node)
        return t0 + int(round(factor * int(dur[node:cn].sum())))
    return arrival


@pytest.mark.parametrize("dormant", ["simulate", "offline"])
@pytest.mark.parametrize("spec,target,sandbox", [
    (MegatronSpec(tp=2, pp=2, dp=2, iterations=3), 8, [0]),
    (MegatronSpec(tp=2, pp=2, dp=2, iterations=3), 8, [0, 13]),
    (MegatronSpec(tp=1, pp=2, dp=4, ep=2, iterations=2), 16, [1]),
], ids=["tp2pp2dp2-to-8", "two-sandboxes", "ep2-to-16"])
def test_folded_replicas_give_the_unfolded_timeline(spec, target, sandbox, dormant):
    graph, plan = scale_out(megatron_events(spec), Layout(spec.tp, spec.pp, spec.dp, spec.ep), target)
    fold = plan.fold(sandbox)
    assert fold and not set(fold) & set(sandbox) and not set(fold.values()) & set(fold)
    results = []
    for f in (None, fold):
        eng = HybridReplay(graph, sandbox, cost_model=MODEL, dormant=dormant, fold=f)
        drive(eng, _slower(eng, graph, 1.3), 1 << 30)  # a slower sandbox: the world waits for it
        results.append((eng.result(), len(eng.stepped)))
    (plain, n_plain), (folded, n_folded) = results
    nodes = np.arange(graph.n_nodes)
    if dormant == "offline":
        # A dormant rank's collective with a live one: unfolded, the live rank's arrival rewrites
        # its end (its later nodes keep their batch times); folded, no live rank arrives there.
        # The live and sandbox ranks, which the emulation reports, are equal either way.
        dormant_rank = np.zeros(graph.world_size, bool)
        dormant_rank[sorted(eng.dormant)] = True
        nodes = nodes[~dormant_rank[graph.rank]]
    np.testing.assert_array_equal(folded.start[nodes], plain.start[nodes])
    np.testing.assert_array_equal(folded.end[nodes], plain.end[nodes])
    np.testing.assert_array_equal(folded.iteration_times, plain.iteration_times)
    assert n_folded < n_plain


def test_stepped_ranks_do_not_grow_with_the_dp_degree():
    spec = MegatronSpec(tp=2, pp=2, dp=2, iterations=1)
    stepped = []
    for target in (8, 64):
        graph, plan = scale_out(megatron_events(spec), Layout(2, 2, 2), target)
        eng = HybridReplay(graph, [0], cost_model=MODEL, dormant="simulate", fold=plan.fold([0]))
        stepped.append(len(eng.stepped))
    # the sandbox's replica (4 ranks) and one representative replica per captured one left (2 x 4)
    assert stepped == [12, 12]


def test_a_fold_that_is_not_a_copy_is_refused():
    graph, plan = scale_out(megatron_events(MegatronSpec()), Layout(2, 2, 2), 4)
    with pytest.raises(ValueError, match="distinct virtual ranks"):
        HybridReplay(graph, [0], fold={4: 0})
    with pytest.raises(ValueError, match="live rank 2 cannot follow dormant rank 3"):
        HybridReplay(graph, [0], dormant="offline", fold={2: 3})  # 2 is in the sandbox's DP group, 3 in none


# --------------------------------------------------------------- group matching
def _gpt_groups(tp, pp, dp, order=("tp", "dp", "pipeline")):
    """The groups ``prism.workloads.gpt`` creates, families in ``order`` (its own: tp, dp, pipeline)."""
    rank = lambda t, d, p: t + tp * (d + dp * p)  # noqa: E731
    fam = {
        "tp": [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pipeline": [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
    return [ranks for f in order for ranks in fam[f]]


def _scaled_plan(order):
    """The plan of a tp2 pp2 dp2 run (groups made in ``order``) grown to dp 8."""
    lay = Layout(2, 2, 2)
    groups = {"world": (0, tuple(range(8)))}
    for i, ranks in enumerate(_gpt_groups(2, 2, 2, order), start=1):
        groups[group_id(i, ranks)] = (i, tuple(ranks))
    from prism.core.scaleout import plan_scale_out

    return plan_scale_out(lay, groups, 8)


@pytest.mark.parametrize("order", [("tp", "dp", "pipeline"), ("pipeline", "tp", "dp")])
def test_a_sandboxs_groups_match_the_scaled_graphs_by_members(order):
    plan = _scaled_plan(("tp", "dp", "pipeline"))
    m = GroupMatcher((gid, ranks) for _, ranks, gid in plan.groups)
    # the script at dp 8, its groups in `order`: ids from its own creation counter
    script = _gpt_groups(2, 2, 8, order)
    by_members = {ranks: gid for _, ranks, gid in plan.groups}
    for rank in (0, 13):
        for i, ranks in enumerate(script, start=1):
            if rank not in ranks:
                continue
            mine = group_id(i, ranks)
            got = m.create(rank, mine, ranks)
            assert got == by_members[tuple(ranks)]
            assert m.to_graph(rank, mine) == got and m.to_rank(rank, got) == mine
    assert (m.renamed(0) == 0) == (order == ("tp", "dp", "pipeline"))


def test_groups_of_the_same_members_match_in_creation_order():
    graph = [("world", (0, 1)), (group_id(1, (0, 1)), (0, 1)), (group_id(5, (0, 1)), (0, 1))]
    m = GroupMatcher(graph)
    assert m.create(0, "world", (0, 1)) == "world"
    assert m.create(0, group_id(2, (0, 1)), (0, 1)) == group_id(1, (0, 1))
    assert m.create(0, group_id(3, (0, 1)), (0, 1)) == group_id(5, (0, 1))
    assert m.create(0, group_id(4, (0, 1)), (0, 1)) is None  # one more than the graph has
    assert m.create(1, "x", (1, 2)) is None
    assert m.to_graph(1, "x") == "x"
    assert creation_index(group_id(12, (3,))) == 12 and creation_index("world") == 0
    with pytest.raises(ValueError, match="neither 'world' nor"):
        creation_index("dp0")


# --------------------------------------------------------------- the options
def test_the_command_gets_the_scaled_dp():
    assert E.scaled_command(["-m", "w", "--tp", "2", "--dp", "2"], 64) == (["-m", "w", "--tp", "2", "--dp", "64"], True)
    assert E.scaled_command(["t.py", "--dp=2"], 8) == (["t.py", "--dp=8"], True)
    assert E.scaled_command(["t.py", "--dpx", "2"], 8) == (["t.py", "--dpx", "2"], False)
    assert E.dp_flag(["t.py", "--dp", "4"]) == 4 and E.dp_flag(["t.py", "--dp=8"]) == 8 and E.dp_flag(["t.py"]) is None


def _run(tmp_path, spec, *, fsdp=False):
    """A synthetic run folder (``megatron_events``) with a manifest naming its layout."""
    ranks = megatron_events(spec)
    lay = Layout(spec.tp, spec.pp, spec.dp)
    if fsdp:  # after each rank's last collective on its DP group, a sharded gather there, as FSDP issues
        for r, evs in ranks.items():
            t, _, p = lay.coords(r)
            dp_ranks = tuple(lay.rank(t, d, p) for d in range(lay.dp))
            gid = next(e.gid for e in evs if type(e) is GroupCreated and tuple(e.ranks) == dp_ranks)
            at = max(i for i, e in enumerate(evs) if type(e) is Collective and e.gid == gid)
            last = evs[at]
            evs.insert(at + 1, dataclasses.replace(last, seq=last.seq + 1, op="all_gather_into_tensor", reduce_op="",
                                                   in_shapes=((4,),), out_shapes=((8,),), bytes=16))
    manifest = Manifest(1, "r", spec.world_size, 0, ("-m", "w", "--tp", str(spec.tp), "--pp", str(spec.pp), "--dp",
                                                     str(spec.dp)), "cpu", "0", "0", "h",
                        layout=(("tp", spec.tp), ("pp", spec.pp), ("dp", spec.dp)))
    runfolder.write_run(tmp_path / "run", manifest, ranks)
    return tmp_path / "run"


@pytest.mark.parametrize("kw,match", [
    ({"scale_dp": 3}, "to --scale-dp 3: target dp 3 must be a multiple of the captured dp 2"),
    ({"scale_dp": 4, "sandbox": "16"}, r"--sandbox: .*'16' is outside the world of 16 ranks .*\(the capture's world "
                                       r"of 8 scaled to dp 4: world 16\)"),
    ({"layout": "tp=2,pp=2,dp=2"}, "give --scale-dp N too"),
    ({"scale_dp": 4, "layout": "tp=2,pp=1,dp=2"}, "has 4 ranks, the capture"),
    ({"scale_dp": 0}, "positive data-parallel degree"),
    ({"scale_dp": 4, "command": ["-m", "w", "--dp", "2"]}, "has --dp 2, but --scale-dp is 4"),
])
def test_bad_scale_options_are_named(tmp_path, kw, match):
    run = _run(tmp_path, MegatronSpec(tp=2, pp=2, dp=2, iterations=1))
    with pytest.raises(UsageError, match=match):
        E.emulate(E.EmulateConfig(run=run, **kw))


def test_a_group_that_cannot_widen_is_refused_with_why(tmp_path):
    run = _run(tmp_path, MegatronSpec(tp=2, pp=2, dp=2, iterations=1), fsdp=True)
    with pytest.raises(UsageError, match=r"cannot scale .* to --scale-dp 4: group '[^']+' \(creation index \d+, "
                                         r"ranks \[\d, \d\]\) spans DP .* carries all_gather_into_tensor.*\(FSDP or a "
                                         r"ZeRO optimizer"):
        E.emulate(E.EmulateConfig(run=run, scale_dp=4))
