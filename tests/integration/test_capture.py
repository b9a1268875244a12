"""End-to-end captures through ``python -m prism capture``: real rank
processes, the real coordinator, real ZeroMQ. Expected groups and collective
counts come from the layout (docs/DESIGN.md), never from the trace under test."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from prism.core import trace as T
from prism.shell import runfolder
from prism.workloads import harness
from tests.support.captures import gpt_tiny
from tests.support.truth import gloo_world, shared_gloo_world
from tests.support.full import FULL

ROOT = Path(__file__).resolve().parents[2]


def capture(tmp_path: Path, world: int, command: list[str], *extra: str, name: str = "run",
            timeout: float = 300) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / name
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "prism", "capture", "-n", str(world), "--out", str(run_dir),
         "--progress", "off", *extra, "--", *command],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
    )
    return proc, run_dir


def rank_log(run_dir: Path, rank: int) -> str:
    return runfolder.log_path(run_dir, rank).read_text()


def layout_groups(tp: int, pp: int, dp: int) -> dict[str, list[tuple[int, ...]]]:
    def rank(t, d, p):
        return t + tp * (d + dp * p)

    return {
        "tp": [tuple(rank(t, d, p) for t in range(tp)) for p in range(pp) for d in range(dp)],
        "dp": [tuple(rank(t, d, p) for d in range(dp)) for p in range(pp) for t in range(tp)],
        "pp": [tuple(rank(t, d, p) for p in range(pp)) for d in range(dp) for t in range(tp)],
    }


@pytest.mark.slow
def test_gpt_world16_groups_and_collective_counts_follow_the_layout(shared_captures):
    # test_real_captures' dp-4 capture (tests/support/captures.py): 2 layers, 2 micro-batches (gpt.py's default), 2 steps.
    tp, pp, dp, layers, micro, steps = 2, 2, 4, 2, 2, 2
    proc, run_dir = shared_captures.get(16, gpt_tiny(dp), "--slots", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = runfolder.read_run(run_dir)
    assert sorted(run.ranks) == list(range(16))
    assert T.validate_run(run) == []
    assert run.manifest.layout == (("tp", 2), ("pp", 2), ("dp", 4))

    groups = {e.gid: e.ranks for e in run.ranks[0] if isinstance(e, T.GroupCreated)}
    for evs in run.ranks.values():
        for e in evs:
            if isinstance(e, T.GroupCreated):
                groups.setdefault(e.gid, e.ranks)
    expected = layout_groups(tp, pp, dp)
    by_ranks = {ranks: gid for gid, ranks in groups.items()}
    for kind, members in expected.items():
        for ranks in members:
            assert ranks in by_ranks, f"{kind} group {ranks} missing"

    # Instances per group, counted once (on the group's first member).
    counts: Counter = Counter()
    for gid, ranks in groups.items():
        for e in run.ranks[ranks[0]]:
            if isinstance(e, T.Collective) and e.gid == gid:
                counts[(ranks, e.op)] += 1
    per_stage_layers = layers // pp
    for ranks in expected["tp"]:
        # forward: attention-out and MLP-down all_reduce; backward: the two
        # copy-to-TP all_reduces; per layer of the stage, per micro-batch.
        assert counts[(ranks, "all_reduce")] == 4 * per_stage_layers * micro * steps
    for ranks in expected["dp"]:
        last_stage = ranks[0] >= tp * dp * (pp - 1)
        # gradient all_reduce, plus the loss all_reduce on the last stage
        assert counts[(ranks, "all_reduce")] == steps * (2 if last_stage else 1)
    for ranks in expected["pp"]:
        assert counts[(ranks, "broadcast")] == steps
    for r, evs in run.ranks.items():
        p2p = [e for e in evs if isinstance(e, T.P2P)]
        # 1F1B between two stages: M activations one way, M grads the other.
        assert len(p2p) == 2 * micro * steps, r
        assert sum(isinstance(e, T.Iteration) for e in evs) == steps


@pytest.mark.slow
def test_moe_all_to_all_splits_differ_across_ranks(tmp_path):
    proc, run_dir = capture(tmp_path, 4, ["-m", "prism.workloads.gpt", "--dp", "4", "--ep", "4",
                                          "--experts", "4", "--layers", "2", "--steps", "2"], "--slots", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = runfolder.read_run(run_dir)
    assert T.validate_run(run) == []
    splits = {}
    for r, evs in run.ranks.items():
        a2a = [e for e in evs if isinstance(e, T.Collective) and e.op == "all_to_all_single" and e.in_splits]
        assert a2a, f"rank {r} recorded no all_to_all_single with split sizes"
        splits[r] = [e.in_splits for e in a2a if e.dtype != "int64"] or [e.in_splits for e in a2a]
        # The token counts themselves are small tensors: their values are kept.
        assert any(isinstance(e, T.TensorValue) and e.ref.startswith("coll:") for e in evs)
    assert len({tuple(v) for v in splits.values()}) > 1, splits


def _lines(text: str, prefix: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(prefix)]


# collectives_example.py is the variant: every rank's output against gloo's is
# tests/integration/test_frameworks.py::test_api_tour_prints_what_gloo_prints_on_every_rank,
# every op's values tests/integration/test_backend.py::test_every_op_matches_gloo.
@pytest.mark.slow
@pytest.mark.parametrize("script, ranks_that_print", [
    # both variants of test_gpt_losses_equal_gloo (the same claim on the bundled GPT); DDP's
    # reducer under Prism: test_emulate.py::test_ddp_async_buckets_pass_their_waits_and_reproduce_the_losses
    pytest.param("ddp_example.py", [0], marks=FULL),
    pytest.param("collectives_example.py", [0, 1, 2, 3], marks=FULL),
])
def test_zero_modification_same_values_as_gloo(tmp_path, script, ranks_that_print):
    path = str(ROOT / "prism" / "workloads" / script)
    # retried on gloo's own teardown abort only; the same world is test_workloads' (one run a session)
    truth = shared_gloo_world([path], 4, cwd=str(ROOT))
    proc, run_dir = capture(tmp_path, 4, [path], "--slots", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in ranks_that_print:
        prefix = "step " if script == "ddp_example.py" else f"rank {r} step "
        want = _lines(truth[r].stdout, prefix)
        got = _lines(rank_log(run_dir, r), prefix)
        assert want and len(got) == len(want)
        for w, g in zip(want, got):
            wk, wv = w.rsplit(" ", 1)
            gk, gv = g.rsplit(" ", 1)
            assert wk == gk
            assert float(gv) == pytest.approx(float(wv), rel=1e-5, abs=1e-7), (w, g)


@pytest.mark.slow
def test_gpt_losses_equal_gloo(tmp_path):
    args = ["-m", "prism.workloads.gpt", "--tp", "2", "--steps", "3", "--layers", "2"]
    truth = gloo_world(args, 2, timeout=240)
    proc, run_dir = capture(tmp_path, 2, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = harness.parse_losses(truth[0].stdout)
    got = harness.parse_losses(rank_log(run_dir, 0))
    assert len(want) == 3 and got == pytest.approx(want, rel=1e-5)
    # Rank 0's output reaches the console, prefixed with its rank.
    assert "[rank 0] step 0 loss" in proc.stderr


SCRIPT_HEAD = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank = dist.get_rank()
x = torch.ones(4)
dist.all_reduce(x)
"""


def write_script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT_HEAD + textwrap.dedent(body))
    return str(path)


def assert_trace_kept(run_dir: Path, world: int) -> None:
    run = runfolder.read_run(run_dir)
    assert sorted(run.ranks) == list(range(world))
    assert T.validate_run(run) == [], T.validate_run(run)[:3]
    for evs in run.ranks.values():
        assert isinstance(evs[-1], T.RankEnd)
        # what happened before the failure is there
        assert any(isinstance(e, T.Collective) and e.op == "all_reduce" for e in evs)


@pytest.mark.slow
def test_mismatch_is_reported_with_ranks_group_and_both_calls(tmp_path):
    script = write_script(tmp_path, """
        y = torch.ones(3)
        if rank == 1:
            dist.all_gather_into_tensor(torch.empty(6), y)
        else:
            dist.all_reduce(y, op=dist.ReduceOp.MAX)
    """)
    t0 = time.monotonic()
    proc, run_dir = capture(tmp_path, 2, [script])
    assert proc.returncode == 1
    err = proc.stderr
    assert "capture FAILED (mismatch)" in err
    assert "group world" in err and "sequence 1" in err
    assert "rank 0 called all_reduce(MAX" in err or "rank 1 called all_gather_into_tensor" in err
    assert "all_reduce" in err and "all_gather_into_tensor" in err
    assert time.monotonic() - t0 < 60
    assert_trace_kept(run_dir, 2)


@pytest.mark.slow
def test_deadlock_is_reported_rank_by_rank(tmp_path):
    script = write_script(tmp_path, """
        if rank == 0:
            dist.recv(torch.empty(2), src=1, tag=5)
        else:
            dist.all_reduce(torch.ones(2))
    """)
    proc, run_dir = capture(tmp_path, 2, [script], "--quiet-period", "2")
    assert proc.returncode == 1
    err = proc.stderr
    assert "capture FAILED (deadlock)" in err
    assert "rank 0: waits in recv from rank 1 tag 5" in err
    assert "rank 1: waits in all_reduce on group world" in err
    assert_trace_kept(run_dir, 2)


@pytest.mark.slow
def test_crashing_rank_shows_its_traceback_and_stops_the_others(tmp_path):
    script = write_script(tmp_path, """
        import time
        if rank == 2:
            raise ValueError("bad batch on rank two")
        dist.all_reduce(torch.ones(2))
        time.sleep(60)
    """)
    t0 = time.monotonic()
    proc, run_dir = capture(tmp_path, 3, [script], "--show-ranks", "none")
    assert proc.returncode == 1
    assert time.monotonic() - t0 < 50, "the other ranks were not stopped"
    err = proc.stderr
    assert "rank 2 failed" in err
    assert "ValueError: bad batch on rank two" in err
    assert "[rank 2]" in err  # the failing rank's output reaches the console
    assert "ValueError: bad batch on rank two" in rank_log(run_dir, 2)
    # no orphans: every rank process is gone
    pids = [e.pid for r in range(3) for e in runfolder.read_rank_file(runfolder.rank_path(run_dir, r)).events
            if isinstance(e, T.RankStart)]
    assert len(pids) == 3
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert_trace_kept(run_dir, 3)


def test_bad_arguments_are_refused(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "prism", "capture", "-n", "0", "--", "x.py"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "--world-size must be at least 1, got 0" in r.stderr
    r = subprocess.run([sys.executable, "-m", "prism", "capture", "-n", "2", "--", "nope.py"],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode != 0 and "script 'nope.py' does not exist" in r.stderr
