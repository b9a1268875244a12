"""The bundled workloads under real gloo: parallel layouts must reproduce one rank's losses.

Worlds are launched with ``prism.workloads.harness.run_world`` (one process per
rank, torchrun's environment, OMP_NUM_THREADS=1). Expected values come from
one-rank runs with the same global batch, or from the arithmetic of the
collectives, never from the run under test.
"""

import ast
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prism.workloads import gpt
from prism.workloads.harness import WorldError, parse_losses, parse_splits, run_world
from tests.support.full import FULL
from tests.support.truth import gloo_world, shared_gloo_world

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "prism" / "workloads"
GPT = ["-m", "prism.workloads.gpt"]
GPT_SCRIPT = [str(WORKLOADS / "gpt.py")]


def losses(argv, nproc, shared=False):
    # Plain gloo worlds: retried on gloo's own teardown abort only (tests/truth.py);
    # shared: the same world is test_capture's ground truth (one run a session).
    results = (shared_gloo_world if shared else gloo_world)(argv, nproc, cwd=str(ROOT))
    found = [(r.rank, parse_losses(r.stdout)) for r in results if parse_losses(r.stdout)]
    assert len(found) == 1, f"expected exactly one rank to print losses, got {found}"
    return found[0][1], results


def assert_close(got, want):
    assert len(got) == len(want) == 3, (got, want)
    for g, w in zip(got, want):
        assert math.isclose(g, w, rel_tol=1e-4), (got, want)


@pytest.fixture(scope="module")
def dense_one_rank():
    # Global batch per step: DP * micro_batches * batch = 1 * 2 * 2 sequences.
    got, _ = losses(GPT, 1)
    assert len(set(got)) == 3, f"losses should change from step to step, got {got}"
    return got


@pytest.fixture(scope="module")
def moe_one_rank():
    return {k: losses(GPT + ["--layers", "2", "--experts", "4", "--top-k", str(k)], 1)[0] for k in (1, 2)}


# tp2, pp2 and dp2 alone are variants of the world-8 test (tp2 x pp2 x dp2,
# also run as a script path) and of pp3 (the suite's time: run them with
# PRISM_FULL_TESTS=1).
@pytest.mark.slow
@FULL
def test_tp2_matches_one_rank_and_runs_as_a_script_path(dense_one_rank):
    got, _ = losses(GPT_SCRIPT + ["--tp", "2"], 2)
    assert_close(got, dense_one_rank)


@pytest.mark.slow
@FULL
def test_pp2_matches_one_rank(dense_one_rank):
    # 4 micro-batches of 1 sequence: the same 4 sequences per step as the baseline's 2 x 2.
    got, results = losses(GPT + ["--pp", "2", "--micro-batches", "4", "--batch", "1"], 2)
    assert_close(got, dense_one_rank)
    assert parse_losses(results[1].stdout) == got  # the last stage (rank 1) reports


@pytest.mark.slow
def test_pp3_with_uneven_stages_matches_one_rank(dense_one_rank):
    # 4 layers over 3 stages: 1, 1 and 2 layers; warm-ups of 2, 1 and 0 micro-batches.
    got, results = losses(GPT + ["--pp", "3", "--micro-batches", "4", "--batch", "1"], 3)
    assert_close(got, dense_one_rank)
    assert parse_losses(results[2].stdout) == got


@pytest.mark.slow
@FULL
def test_dp2_with_the_global_batch_split_matches_one_rank(dense_one_rank):
    got, _ = losses(GPT + ["--dp", "2", "--batch", "1"], 2)
    assert_close(got, dense_one_rank)


@pytest.mark.slow
# A variant: the numerics of each axis are checked alone (pp3 here, MoE tp2 ep2
# below); the three axes together under Prism, their groups and calls:
# test_capture.py::test_gpt_world16_groups_and_collective_counts_follow_the_layout.
@FULL
def test_world8_tp2_pp2_dp2_matches_one_rank(dense_one_rank):
    # As a script path (gpt.py's own directory first on sys.path), as tp2's test.
    got, results = losses(GPT_SCRIPT + ["--tp", "2", "--pp", "2", "--dp", "2", "--batch", "1"], 8)
    assert_close(got, dense_one_rank)
    # rank = tp + 2 * (dp + 2 * pp): the reporter is pp 1, dp 0, tp 0, i.e. rank 4.
    assert parse_losses(results[4].stdout) == got


@pytest.mark.slow
def test_moe_ep2_matches_one_rank_and_split_sizes_differ(moe_one_rank):
    got, results = losses(GPT + ["--layers", "2", "--experts", "4", "--dp", "2", "--ep", "2",
                                 "--batch", "1", "--print-splits"], 2)
    assert_close(got, moe_one_rank[1])
    rows = {r.rank: parse_splits(r.stdout) for r in results}
    # 3 steps x 2 micro-batches x 2 layers dispatches per rank.
    assert [len(rows[0]), len(rows[1])] == [12, 12]
    tokens = 1 * 32  # batch x seq_len, top-1
    for rank in (0, 1):
        for row in rows[rank]:
            assert row["rank"] == rank and sum(row["send"]) == tokens
    # What rank 0 sends to rank 1 is what rank 1 receives from rank 0, and back.
    for a, b in zip(rows[0], rows[1]):
        assert (a["step"], a["micro"], a["layer"]) == (b["step"], b["micro"], b["layer"])
        assert a["send"][1] == b["recv"][0] and b["send"][0] == a["recv"][1]
    sends = [tuple(row["send"]) for rank in (0, 1) for row in rows[rank]]
    assert len(set(sends)) > 1, "split sizes should vary across ranks and steps"
    assert any(a["send"] != b["send"] for a, b in zip(rows[0], rows[1]))


@pytest.mark.slow
def test_moe_top2_with_tp2_ep2_matches_one_rank(moe_one_rank):
    got, _ = losses(GPT + ["--layers", "2", "--experts", "4", "--top-k", "2", "--tp", "2",
                           "--dp", "2", "--ep", "2", "--batch", "1"], 4)
    assert_close(got, moe_one_rank[2])


@pytest.mark.slow
def test_world_size_mismatch_names_the_values():
    with pytest.raises(WorldError, match=r"WORLD_SIZE=2 but --tp 4 x --pp 1 x --dp 1 = 4"):
        run_world(GPT + ["--tp", "4", "--heads", "4"], 2, cwd=str(ROOT))


@pytest.mark.slow
def test_world_of_one_needs_no_launcher():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, *GPT, "--steps", "1", "--layers", "1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert len(parse_losses(r.stdout)) == 1


@pytest.mark.parametrize(("flags", "message"), [
    (["--heads", "4", "--tp", "3"], "--heads 4 must be a multiple of --tp 3"),
    (["--dp", "3", "--ep", "2", "--experts", "4"], "--dp 3 must be a multiple of --ep 2"),
    (["--dp", "2", "--ep", "2", "--experts", "3"], "--experts 3 must be a multiple of --ep 2"),
    (["--ep", "2", "--dp", "2"], "--ep 2 needs MoE layers"),
    (["--layers", "1", "--pp", "2"], "--layers 1 must be at least --pp 2"),
])
def test_bad_flags_are_refused_with_the_values(flags, message, capsys):
    with pytest.raises(SystemExit):
        gpt.parse_args(flags)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("sizes", "moe", "expected"), [
    # tp2 dp2 pp2 ep2 (world 8): TP, DP, pipeline, EP, expert-DP groups in creation order.
    (dict(tp=2, dp=2, pp=2, ep=2), True, [
        [0, 1], [2, 3], [4, 5], [6, 7],
        [0, 2], [1, 3], [4, 6], [5, 7],
        [0, 4], [1, 5], [2, 6], [3, 7],
        [0, 2], [1, 3], [4, 6], [5, 7],
        [0], [2], [1], [3], [4], [6], [5], [7],
    ]),
    # dp4 ep2 (world 4): EP groups from consecutive DP ranks, expert-DP across them.
    (dict(tp=1, dp=4, pp=1, ep=2), True, [
        [0], [1], [2], [3],
        [0, 1, 2, 3],
        [0], [1], [2], [3],
        [0, 1], [2, 3],
        [0, 2], [1, 3],
    ]),
    (dict(tp=2, dp=1, pp=3, ep=1), False, [
        [0, 1], [2, 3], [4, 5],
        [0], [1], [2], [3], [4], [5],
        [0, 2, 4], [1, 3, 5],
    ]),
])
def test_groups_are_created_in_the_documented_order(sizes, moe, expected, monkeypatch):
    world = sizes["tp"] * sizes["dp"] * sizes["pp"]
    for rank in range(world):
        created = []
        monkeypatch.setattr(gpt.dist, "new_group", lambda ranks: created.append(list(ranks)) or object())
        groups = gpt.build_groups(gpt.Layout(rank=rank, **sizes), moe)
        assert created == expected
        assert rank in groups.pipeline_ranks


def test_layout_matches_the_megatron_order():
    lay = gpt.Layout(tp=2, dp=4, pp=2, ep=2, rank=13)  # 13 = 1 + 2 * (2 + 4 * 1)
    assert (lay.tp_rank, lay.dp_rank, lay.pp_rank, lay.ep_rank) == (1, 2, 1, 0)


@pytest.mark.parametrize("name", ["gpt.py", "ddp_example.py", "collectives_example.py"])
def test_workloads_never_import_prism(name):
    tree = ast.parse((WORKLOADS / name).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "prism" for a in node.names), name
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and (node.module or "").split(".")[0] != "prism", name


@pytest.mark.slow
def test_ddp_world4_matches_one_rank_with_the_same_global_batch():
    script = [str(WORKLOADS / "ddp_example.py")]
    four, _ = losses(script, 4, shared=True)  # its default 8 samples per rank: test_capture's truth
    one, _ = losses(script + ["--batch", "32"], 1)
    assert_close(four, one)


@pytest.mark.slow
# A variant of test_frameworks.py::test_api_tour_prints_what_gloo_prints_on_every_rank
# (every collective's values on every rank, gloo against Prism).
@FULL
def test_collectives_example_world4_values():
    world = 4
    # test_capture's ground truth too (one run a session)
    results = shared_gloo_world([str(WORKLOADS / "collectives_example.py")], world, cwd=str(ROOT))
    names = ["broadcast", "ring", "all_to_all", "all_gather_into_tensor", "reduce_scatter_tensor",
             "all_gather", "all_reduce_avg", "all_reduce_max", "loss", "w"]
    values = {}
    for r in results:
        lines = r.stdout.splitlines()
        assert len(lines) == 3 * len(names), r.stdout
        for line in lines:
            tag, rank, step_word, step, name, value = line.split()
            assert (tag, int(rank), step_word) == ("rank", r.rank, "step") and name in names
            values[int(rank), int(step), name] = float(value)

    def same(step, name, ranks):
        return len({values[r, step, name] for r in ranks}) == 1

    for step in range(3):
        everyone = range(world)
        for name in ("broadcast", "all_gather", "all_reduce_max", "w"):
            assert same(step, name, everyone), (step, name)
        for half in ([0, 2], [1, 3]):
            assert same(step, "all_reduce_avg", half) and same(step, "all_gather_into_tensor", half)
        # The ring: rank r receives h of rank r-1, and h_k = x * w * (k + 1).
        per_unit = {values[r, step, "ring"] / (((r - 1) % world) + 1) for r in everyone}
        assert max(per_unit) - min(per_unit) <= 1e-5 * max(1.0, max(map(abs, per_unit)))
        for r in everyone:
            # Rank j sends (2j + r + step) % 3 + 1 elements of value 10 j + r to rank r.
            a2a = sum((10 * j + r) * ((2 * j + r + step) % 3 + 1) for j in everyone)
            assert values[r, step, "all_to_all"] == a2a
            # SUM over ranks k of (arange(8) + k + step), rank r keeps elements 2r, 2r+1.
            rs = sum(i + k + step for k in everyone for i in (2 * r, 2 * r + 1))
            assert values[r, step, "reduce_scatter_tensor"] == rs
            # all_gather of h.sum() per rank, and the ring value of rank k+1 is h_k.sum().
            hsum = sum(values[(k + 1) % world, step, "ring"] for k in everyone)
            assert math.isclose(values[r, step, "all_gather"], hsum, rel_tol=1e-5)
    assert values[0, 2, "w"] != values[0, 0, "w"], "the optimizer step should move w"


def test_parse_losses_reads_repr_floats_and_checks_the_step_order():
    text = "noise\nstep 0 loss 5.535069227218628\nstep 1 loss 1e-05\nsplits step 0 ...\n"
    assert parse_losses(text) == [5.535069227218628, 1e-05]
    with pytest.raises(ValueError, match="expected step 1, found line 'step 2 loss 3.0'"):
        parse_losses("step 0 loss 1.0\nstep 2 loss 3.0\n")


def test_parse_splits_reads_the_print_splits_lines():
    text = "step 0 loss 1.0\nsplits step 2 micro 1 layer 3 rank 5 send [21, 43] recv [0, 20]\n"
    assert parse_splits(text) == [dict(step=2, micro=1, layer=3, rank=5, send=[21, 43], recv=[0, 20])]
