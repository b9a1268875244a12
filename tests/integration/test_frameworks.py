"""The frameworks users train with, carried by the Prism backend unmodified.

Each script in ``prism/workloads/frameworks/`` runs twice at world 4: for real
under gloo (``harness.run_world``, the ground truth) and under
``python -m prism capture``; the per-step losses (and the final parameter
checksums) must agree to a relative 1e-5. Where gloo cannot run what the
script does (``PREMUL_SUM``), the ground truth is the same script with the
mathematically equal gloo-supported setting, as the test says. The traces are
checked for the collectives each framework is known to issue, so a test
cannot pass by the work silently not reaching the backend.

Both sides run on CPU even where CUDA is present (``CUDA_VISIBLE_DEVICES``
empty): the scripts would pick NCCL and one GPU per rank otherwise, and a
world of 4 on a one-GPU machine cannot run NCCL.

Every run costs ~10-60 s on the shared 2-core box: those tests are
``slow``, and each run is made once per session and shared by the tests that
need it: FSDP2's nested AVG path is checked on ``dcp_save.py``'s training
(``fsdp2.py``'s model, wrapped the same way), mixed precision on the HSDP run.
The variants that cover little beyond a sibling (each named where it is
declared) run only with ``PRISM_FULL_TESTS=1`` (``tests/support/full.py``).
"""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from prism.core import trace as T
from prism.shell import runfolder
from prism.workloads.harness import parse_losses
from tests.support.full import FULL
from tests.support.truth import gloo_world

ROOT = Path(__file__).resolve().parents[2]
FW = ROOT / "prism" / "workloads" / "frameworks"
WORLD = 4
REL = 1e-5
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
#: torch >= 2.13 exposes a PREMUL_SUM ReduceOp's factor to Python (2.11 does not).
PREMUL_FACTOR_VISIBLE = hasattr(__import__("torch").distributed.ReduceOp, "factor")
#: The scripts' closing lines: ``param checksum X``, ``checkpoint files N`` ...
SUMMARY = re.compile(r"^(param checksum|reloaded checksum|checkpoint files|shard sizes) (.*)$", re.MULTILINE)


def _script(name: str) -> str:
    return name if os.path.isabs(name) else str(FW / name)


def _outputs(texts: dict[int, str]) -> dict[str, object]:
    """What the reporting rank printed: its losses and final summary lines."""
    found = {r: parse_losses(t) for r, t in texts.items()}
    reporters = [r for r, losses in found.items() if losses]
    assert len(reporters) == 1, f"expected exactly one rank to print losses, got {found}"
    extra = dict(SUMMARY.findall(texts[reporters[0]]))
    return {"rank": reporters[0], "losses": found[reporters[0]], **extra}


class Runs:
    """Each (backend, script, args) world run once per session."""

    def __init__(self, base: Path):
        self.base = base
        self.cache: dict[tuple, object] = {}

    def gloo(self, script: str, *args: str) -> dict[int, str]:
        key = ("gloo", script, args)
        if key not in self.cache:
            argv = [_script(script), *args]
            # retried on gloo's own teardown abort only (tests/truth.py)
            results = gloo_world(argv, WORLD, cwd=str(ROOT), timeout=300, env=CPU_ONLY)
            self.cache[key] = {r.rank: r.stdout for r in results}
        return self.cache[key]

    def prism(self, script: str, *args: str, expect_ok: bool = True) -> tuple[int, Path, dict[int, str], str]:
        key = ("prism", script, args)
        if key not in self.cache:
            run_dir = self.base / f"{Path(script).stem}-{len(self.cache)}"
            # This checkout's prism, also in the rank processes the capture starts.
            path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
            env = {**os.environ, **CPU_ONLY, "PYTHONPATH": path}
            proc = subprocess.run(
                [sys.executable, "-m", "prism", "capture", "-n", str(WORLD), "--out", str(run_dir),
                 "--progress", "off", "--show-ranks", "none", "--quiet-period", "120", "--",
                 _script(script), *args],
                cwd=str(self.base), env=env, capture_output=True, text=True, timeout=420,
            )
            logs = {r: runfolder.log_path(run_dir, r).read_text() for r in range(WORLD) if runfolder.log_path(run_dir, r).exists()}
            self.cache[key] = (proc.returncode, run_dir, logs, proc.stderr)
        code, run_dir, logs, stderr = self.cache[key]
        if expect_ok:
            assert code == 0, f"prism capture of {script} {args} exited {code}:\n{stderr[-3000:]}"
        return code, run_dir, logs, stderr


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("frameworks"))


def assert_same_outputs(prism_logs: dict[int, str], gloo_out: dict[int, str]) -> dict:
    got, want = _outputs(prism_logs), _outputs(gloo_out)
    assert got.keys() == want.keys(), (got, want)
    assert got["rank"] == want["rank"]
    assert len(got["losses"]) == len(want["losses"]) >= 3, (got, want)
    assert len(set(want["losses"])) > 1, f"losses should change from step to step: {want}"
    for key in got:
        if key == "losses":
            for g, w in zip(got["losses"], want["losses"]):
                assert math.isclose(g, w, rel_tol=REL), (got["losses"], want["losses"])
        elif "checksum" in key:
            assert math.isclose(float(got[key]), float(want[key]), rel_tol=REL), (key, got[key], want[key])
        else:
            assert got[key] == want[key], (key, got[key], want[key])
    return got


def collectives(run_dir: Path) -> list[T.Collective]:
    run = runfolder.read_run(run_dir)
    assert T.validate_run(run) == []
    return [ev for evs in run.ranks.values() for ev in evs if isinstance(ev, T.Collective)]


def ops(run_dir: Path) -> Counter:
    return Counter((c.op, c.reduce_op, c.dtype) for c in collectives(run_dir))


# --- FSDP2 -------------------------------------------------------------------------------


def dcp_save(runs: Runs, *how: str) -> tuple[Path, dict[int, str], dict[int, str], Path, Path]:
    """``dcp_save.py``'s run under Prism and under gloo, checkpoints in the session's folder
    (one run a session: the DCP test and the FSDP2 nested test share it)."""
    tag = "-".join(a.strip("-") for a in how) or "save"
    prism_dir, gloo_dir = runs.base / f"prism-ckpt-{tag}", runs.base / f"gloo-ckpt-{tag}"
    _, run_dir, logs, _ = runs.prism("dcp_save.py", "--checkpoint-dir", str(prism_dir), *how)
    gloo = runs.gloo("dcp_save.py", "--checkpoint-dir", str(gloo_dir), *how)
    return run_dir, logs, gloo, prism_dir, gloo_dir


#: HSDP without resharding, in mixed precision: the HSDP test and the mixed-precision test share this run.
HSDP_MIXED = ("--mixed", "--replicate", "2", "--no-reshard")


# dcp_save.py trains fsdp2.py's model wrapped as fsdp2.py wraps it (fully_shard
# on every block, then the root, defaults: AVG reduce-scatters, reshard after
# forward) before it checkpoints: the nested test shares the DCP test's run;
# fsdp2.py alone is its variant.
@pytest.mark.slow
@pytest.mark.parametrize("script", ["dcp_save.py", pytest.param("fsdp2.py", marks=FULL)])
def test_fsdp2_nested_avg_matches_gloo(runs, script):
    if script == "dcp_save.py":
        run_dir, logs, gloo, _, _ = dcp_save(runs)
    else:
        _, run_dir, logs, _ = runs.prism("fsdp2.py")
        gloo = runs.gloo("fsdp2.py")
    assert_same_outputs(logs, gloo)
    seen = ops(run_dir)
    # 2 blocks + the root: 3 all-gathers forward (reshard after forward: again in
    # backward, except the root's) and 3 AVG reduce-scatters per step, per rank.
    assert seen[("reduce_scatter_tensor", "AVG", "float32")] == 3 * 3 * WORLD
    assert seen[("all_gather_into_tensor", "", "float32")] >= 3 * 3 * WORLD


# On the HSDP run (its own test checks the groups); --mixed alone is the variant.
@pytest.mark.slow
@pytest.mark.parametrize("args", [HSDP_MIXED, pytest.param(("--mixed",), marks=FULL)], ids=["hsdp", "alone"])
def test_fsdp2_mixed_precision_matches_gloo(runs, args):
    _, run_dir, logs, _ = runs.prism("fsdp2.py", *args)
    assert_same_outputs(logs, runs.gloo("fsdp2.py", *args))
    seen = ops(run_dir)
    # MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)
    assert seen[("all_gather_into_tensor", "", "bfloat16")] >= 3 * 3 * WORLD
    assert seen[("reduce_scatter_tensor", "AVG", "float32")] == 3 * 3 * WORLD


# PREMUL_SUM under FSDP2: a variant of the nested test (the backend's
# PREMUL_SUM values and trace: tests/integration/test_backend.py).
@pytest.mark.slow
@FULL
def test_fsdp2_premul_sum_matches_the_gloo_sum_equivalent(runs):
    # set_gradient_divide_factor(2) at world 4 reduce-scatters under
    # PREMUL_SUM(1/2), which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with
    # Gloo"); with set_force_sum_reduction_for_comms FSDP2 computes the same
    # gradients as SUM followed by a division by 2, which gloo runs.
    if not PREMUL_FACTOR_VISIBLE:
        # torch 2.11: the factor lives in a C++ supplement a Python backend
        # cannot read; the capture must stop with a message that says so.
        code, _, logs, stderr = runs.prism("fsdp2.py", "--divide-factor", "2", expect_ok=False)
        text = stderr + "".join(logs.values())
        assert code != 0
        assert "does not support ReduceOp.PREMUL_SUM on torch" in text, text[-3000:]
        assert "set_force_sum_reduction_for_comms" in text
        return
    _, run_dir, logs, _ = runs.prism("fsdp2.py", "--divide-factor", "2")
    assert_same_outputs(logs, runs.gloo("fsdp2.py", "--divide-factor", "2", "--sum"))
    premul = [c for c in collectives(run_dir) if c.op == "reduce_scatter_tensor"]
    assert len(premul) == 3 * 3 * WORLD
    assert {(c.reduce_op, c.premul) for c in premul} == {("PREMUL_SUM", 0.5)}


# In mixed precision (the mixed-precision test shares the run); in float32 the variant.
@pytest.mark.slow
@pytest.mark.parametrize("args", [HSDP_MIXED, pytest.param(("--replicate", "2", "--no-reshard"), marks=FULL)],
                         ids=["mixed", "float32"])
def test_fsdp2_hybrid_sharding_without_reshard_matches_gloo(runs, args):
    _, run_dir, logs, _ = runs.prism("fsdp2.py", *args)
    assert_same_outputs(logs, runs.gloo("fsdp2.py", *args))
    run = runfolder.read_run(run_dir)
    sizes = {ev.gid: ev.ranks for evs in run.ranks.values() for ev in evs if isinstance(ev, T.GroupCreated)}
    seen = Counter((c.op, c.reduce_op, sizes[c.gid]) for c in collectives(run_dir))
    # mesh (replicate=2, shard=2): reduce-scatter inside (0,1) and (2,3), then
    # all-reduce the shards across (0,2) and (1,3); 3 FSDP modules x 3 steps per rank.
    assert seen[("reduce_scatter_tensor", "AVG", (0, 1))] == seen[("reduce_scatter_tensor", "AVG", (2, 3))] == 9 * 2
    assert seen[("all_reduce", "AVG", (0, 2))] == seen[("all_reduce", "AVG", (1, 3))] == 9 * 2


# --- DTensor tensor parallelism, 2-D ---------------------------------------------------


# A variant of the 2-D test below, which runs the same model and sequence-parallel
# plan (dtensor_tp.tp_plan) on mesh["tp"] and checks the same collectives there.
@pytest.mark.slow
@FULL
def test_dtensor_tp_with_sequence_parallel_matches_gloo(runs):
    _, run_dir, logs, _ = runs.prism("dtensor_tp.py")
    assert_same_outputs(logs, runs.gloo("dtensor_tp.py"))
    seen = Counter(op for op, _, _ in ops(run_dir).elements())
    # Sequence parallelism: all-gathers into each column-parallel layer and
    # reduce-scatters out of each row-parallel one (through _c10d_functional).
    assert seen["all_gather_into_tensor"] > 0 and seen["reduce_scatter_tensor"] > 0


@pytest.mark.slow
def test_fsdp2_over_tp_on_a_2d_mesh_matches_gloo(runs):
    _, run_dir, logs, _ = runs.prism("fsdp2_tp.py", "--tp", "2")
    assert_same_outputs(logs, runs.gloo("fsdp2_tp.py", "--tp", "2"))
    run = runfolder.read_run(run_dir)
    groups = {ev.ranks for evs in run.ranks.values() for ev in evs if isinstance(ev, T.GroupCreated)}
    # mesh (dp=2, tp=2) over ranks 0..3: tp groups of consecutive ranks, dp groups strided.
    assert {(0, 1), (2, 3), (0, 2), (1, 3)} <= groups
    members = {ev.gid: ev.ranks for evs in run.ranks.values() for ev in evs if isinstance(ev, T.GroupCreated)}
    seen = Counter((members[c.gid], c.op) for c in collectives(run_dir))
    for tp in ((0, 1), (2, 3)):
        # Sequence parallelism (dtensor_tp.py's plan, through _c10d_functional):
        # all-gathers into each column-parallel layer, reduce-scatters out of each row-parallel one.
        assert seen[(tp, "all_gather_into_tensor")] > 0 and seen[(tp, "reduce_scatter_tensor")] > 0, seen
    for dp in ((0, 2), (1, 3)):
        # FSDP2 over mesh["dp"]: 3 modules' reduce-scatters per step, on each of the group's 2 ranks.
        assert seen[(dp, "reduce_scatter_tensor")] == 3 * 3 * 2, seen


# --- pipelining ------------------------------------------------------------------------


# Both schedules are variants (PRISM_FULL_TESTS=1) of the pipelines the default suite
# captures through Prism's point-to-point path: the bundled GPT's stages in
# test_calibrate.py::test_pipelines_calibrate_although_their_waits_move and
# test_emulate.py's tp2 pp2 dp2 capture.
@pytest.mark.slow
@pytest.mark.parametrize("schedule", [pytest.param("1f1b", marks=FULL), pytest.param("gpipe", marks=FULL)])
def test_pipeline_schedules_match_gloo(runs, schedule):
    _, run_dir, logs, _ = runs.prism("pipeline_1f1b.py", "--schedule", schedule)
    assert_same_outputs(logs, runs.gloo("pipeline_1f1b.py", "--schedule", schedule))
    run = runfolder.read_run(run_dir)
    p2p = [ev for evs in run.ranks.values() for ev in evs if isinstance(ev, T.P2P)]
    # Shape inference at the first step: recv_object_list sends a size (int64) then pickled bytes (uint8).
    assert {ev.dtype for ev in p2p if ev.step == 0} >= {"int64", "uint8", "float32"}
    # Per step 4 micro-batches cross each of the 3 stage boundaries forward and backward.
    # torch 2.11 makes 6 more float32 sends at the first step (its shape
    # inference, seen on the H200 machine); 2.13 does not.
    sends = Counter(ev.step for ev in p2p if ev.op == "send" and ev.dtype == "float32")
    assert sends[0] in (4 * 3 * 2, 4 * 3 * 2 + 6) and sends[1] == sends[2] == 4 * 3 * 2, sends


# --- checkpoint, object collectives, the API tour -----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("how", [[], pytest.param(["--async-save"], marks=FULL)], ids=["save", "async_save"])
def test_dcp_save_and_load_match_gloo(runs, how):
    run_dir, logs, gloo, prism_dir, gloo_dir = dcp_save(runs, *how)
    got = assert_same_outputs(logs, gloo)
    assert got["checkpoint files"] == str(WORLD)
    assert sorted(p.name for p in prism_dir.iterdir()) == sorted(p.name for p in gloo_dir.iterdir())
    names = {op for op, _, _ in ops(run_dir)}
    # dcp.save plans with gather_object / scatter_object_list / broadcast_object_list /
    # all_gather_object: gathers of pickled bytes plus the size exchanges.
    assert {"gather", "scatter", "broadcast", "all_gather"} <= names


@pytest.mark.slow
def test_api_tour_prints_what_gloo_prints_on_every_rank(runs):
    _, run_dir, logs, _ = runs.prism("api_tour.py")
    gloo = runs.gloo("api_tour.py")
    assert T.validate_run(runfolder.read_run(run_dir)) == []
    for rank in range(WORLD):
        want = [line for line in gloo[rank].splitlines() if line.startswith(f"rank {rank} ")]
        got = [line for line in logs[rank].splitlines() if line.startswith(f"rank {rank} ")]
        assert got == want
        assert want[-1] == f"rank {rank} done" and len(want) >= 28


NCCL_STYLE = '''
import torch, torch.distributed as dist
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
try:
    dist.monitored_barrier()
except ValueError as e:
    print(f"rank {rank} refused: {e}", flush=True)
# Device-level coalescing (gloo has none): a ring exchange and an all_reduce as one batch.
got, total = torch.empty(2), torch.full((2,), float(rank))
with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
    dist.isend(torch.full((2,), 10.0 * rank), (rank + 1) % world)
    dist.irecv(got, (rank - 1) % world)
    dist.all_reduce(total)
cm.wait()
print(f"rank {rank} coalesced {got.tolist()} {total.tolist()}", flush=True)
dist.barrier()  # every rank has printed before rank 1's refusal stops the run
if rank == 0:
    dist.send(torch.ones(2), dst=1)
elif rank == 1:
    dist.recv(torch.empty(2))  # from any source
dist.barrier()
'''


@pytest.mark.slow
def test_nccl_style_calls_and_an_unsupported_one(runs):
    script = runs.base / "nccl_style.py"
    script.write_text(NCCL_STYLE)
    code, _, logs, stderr = runs.prism(str(script), expect_ok=False)
    # Under NCCL (what the script asked for) torch refuses monitored_barrier: so does Prism.
    assert "rank 0 refused: monitored_barrier is only implemented for GLOO backend." in logs[0]
    for rank in range(WORLD):
        want = [10.0 * ((rank - 1) % WORLD)] * 2, [float(sum(range(WORLD)))] * 2
        assert f"rank {rank} coalesced {want[0]} {want[1]}" in logs[rank]
    # recv without a source: refused by name, the capture stops instead of hanging.
    assert code == 1
    assert "rank 1 failed" in stderr
    assert "Prism does not support recv from any source (dist.recv/irecv without src) yet" in stderr


@pytest.mark.parametrize("name", sorted(p.name for p in FW.glob("*.py") if p.name != "__init__.py"))
def test_framework_scripts_never_import_prism(name):
    tree = ast.parse((FW / name).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "prism" for a in node.names), name
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and (node.module or "").split(".")[0] != "prism", name
