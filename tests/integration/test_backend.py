"""The Prism backend against the fake coordinator, in real rank processes
started by the launcher: every op gives what gloo gives for the same inputs,
slots are respected, and the trace says what happened."""

from __future__ import annotations


import orjson
import pytest
import torch

from prism.core import trace
from prism.shell import runfolder
from prism.core.trace import group_id
from tests.support.rank_harness import SCRIPTS, events, log, run_world

WORLD = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """ops_worker.py under gloo, then under Prism with one slot for 3 ranks
    (every block must release the slot or the run deadlocks)."""
    out = {}
    for mode in ("gloo", "prism"):
        tmp = tmp_path_factory.mktemp(mode)
        codes, fc = run_world(tmp, WORLD, [str(SCRIPTS / "ops_worker.py"), str(tmp)], prism=mode == "prism",
                              slots=1, timeout=240)
        assert codes == [0] * WORLD, [log(tmp, r)[-3000:] for r in range(WORLD)]
        results = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
        out[mode] = (results, fc, tmp)
    return out


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=where)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


pytestmark = pytest.mark.slow


def test_every_op_matches_gloo(runs):
    gloo, _, _ = runs["gloo"]
    prism, _, _ = runs["prism"]
    for r in range(WORLD):
        assert set(gloo[r]) <= set(prism[r])
        for name in gloo[r]:
            _assert_same(prism[r][name], gloo[r][name], f"rank {r} {name}")


def test_ops_gloo_lacks_match_their_definition(runs):
    prism, _, _ = runs["prism"]
    base = torch.arange(4, dtype=torch.float64)
    ranks_plus_one = sum(r + 1 for r in range(WORLD))
    for r in range(WORLD):
        torch.testing.assert_close(prism[r]["all_reduce_avg"], (base * ranks_plus_one / WORLD).float())
        torch.testing.assert_close(prism[r]["all_reduce_premul"], (2.5 * base * ranks_plus_one).float())
        assert prism[r]["all_reduce_bf16"].dtype == torch.bfloat16
        torch.testing.assert_close(prism[r]["all_reduce_bf16"].float(), (base * ranks_plus_one).float())


def test_slots_are_held_while_calling(runs):
    _, fc, _ = runs["prism"]
    assert fc.violations == []
    assert fc.max_holders == 1
    assert sorted(fc.goodbyes) == list(range(WORLD))
    assert all(g.status == "ok" for g in fc.goodbyes.values())


def test_trace_records(runs):
    _, fc, _ = runs["prism"]
    for r in range(WORLD):
        evs = events(fc, r)
        assert evs[0]["k"] == "rank_start" and evs[0]["rank"] == r
        assert evs[-1]["k"] == "rank_end" and evs[-1]["status"] == "ok"
        # Groups: WORLD, [0, n-1], then new_subgroups' singletons (creation
        # indices count groups this rank is not in).
        groups = [e for e in evs if e["k"] == "group"]
        assert groups[0]["gid"] == "world" and groups[0]["ranks"] == list(range(WORLD))
        sub = [g for g in groups if g["index"] == 1]
        assert bool(sub) == (r in (0, WORLD - 1))
        if sub:
            assert sub[0]["gid"] == group_id(1, [0, WORLD - 1])
        mine = [g for g in groups if g["ranks"] == [r]]
        assert len(mine) == 1 and mine[0]["index"] == 2 + r
        # Per-group sequence numbers are dense from 0.
        by_gid: dict[str, list[int]] = {}
        for e in evs:
            if e["k"] == "coll":
                by_gid.setdefault(e["gid"], []).append(e["seq"])
                assert e["issue_ns"] <= e["wait_ns"] <= e["end_ns"]
        for gid, seqs in by_gid.items():
            assert sorted(seqs) == list(range(len(seqs))), gid
        # Two optimizer steps: two iterations.
        assert [e["step"] for e in evs if e["k"] == "iter"] == [0, 1]
        # Compute segments never overlap each other.
        comp = sorted((e["start_ns"], e["end_ns"]) for e in evs if e["k"] == "compute")
        assert all(a[1] <= b[0] for a, b in zip(comp, comp[1:]))
        # Small values: the PREMUL_SUM input and output.
        premul = [e for e in evs if e["k"] == "coll" and e["reduce_op"] == "PREMUL_SUM"]
        assert premul and premul[0]["premul"] == 2.5
        ref = f"coll:world:{premul[0]['seq']}"
        assert {e["ref"] for e in evs if e["k"] == "value" and e["ref"].startswith(ref + ":")} == {ref + ":in", ref + ":out"}
        # all_to_all_single records its splits.
        a2a = [e for e in evs if e["k"] == "coll" and e["op"] == "all_to_all_single"][0]
        assert a2a["in_splits"] == [(r + j) % 3 + 1 for j in range(WORLD)]
        # Sends and receives pair up by (src, dst, tag, pseq).
        p2p = [e for e in evs if e["k"] == "p2p"]
        assert {(e["op"], e["tag"], e["pseq"]) for e in p2p} >= {("send", 7, 0), ("recv", 7, 0), ("send", 9, 0)}
        blocking_send = [e for e in p2p if e["op"] == "send" and e["tag"] == 7][0]
        assert blocking_send["async_op"] is False
        async_recv = [e for e in p2p if e["op"] == "recv" and e["tag"] == 9][0]
        assert async_recv["async_op"] is True


def test_trace_records_decode_with_the_trace_codec(runs):
    """Every record a rank shipped decodes strictly as a PrismTrace event of
    its kind, and encodes back to the same record."""
    _, fc, _ = runs["prism"]
    for r in range(WORLD):
        lines = fc.trace_lines[r]
        assert lines, f"rank {r} shipped no trace records"
        kinds = set()
        for line in lines:
            ev = trace.decode_event(line)
            assert type(ev).KIND == orjson.loads(line)["k"]
            assert trace.decode_event(trace.encode_event(ev)) == ev
            kinds.add(type(ev).KIND)
        assert {"compute", "coll", "p2p", "iter"} <= kinds, (r, kinds)


def test_async_ops_overlap(runs):
    """Three async all_reduces were all issued before the first wait."""
    _, fc, _ = runs["prism"]
    evs = events(fc, 0)
    colls = [e for e in evs if e["k"] == "coll" and e["async_op"] and e["op"] == "all_reduce"]
    first3 = colls[:3]
    assert len(first3) == 3
    last_issue = max(e["issue_ns"] for e in first3)
    # ops_worker holds the other ranks back until rank 0 issued all three.
    assert all(e["end_ns"] >= last_issue for e in first3)


def test_real_coordinator_matches_gloo(runs, tmp_path):
    """The same ops through the real coordinator (trio, ZeroMQ, matcher,
    collectives) with one slot: results equal gloo's, and the trace it wrote
    passes the PrismTrace validator."""
    from prism.app.capture import capture_run

    out = tmp_path / "out"
    out.mkdir()
    code = capture_run(tmp_path / "run", WORLD, [str(SCRIPTS / "ops_worker.py"), str(out)], slots=1, progress="off").exit_code
    assert code == 0
    gloo, _, _ = runs["gloo"]
    for r in range(WORLD):
        got = torch.load(out / f"rank{r}.pt", weights_only=False)
        for name in gloo[r]:
            _assert_same(got[name], gloo[r][name], f"rank {r} {name}")
    assert trace.validate_run(runfolder.read_run(tmp_path / "run")) == []


@pytest.mark.gpu(reason="CUDA tensors are staged through host memory")
def test_cuda_tensors(tmp_path):
    codes, fc = run_world(tmp_path, 2, [str(SCRIPTS / "cuda_worker.py"), str(tmp_path)], slots=1)
    assert codes == [0, 0], [log(tmp_path, r) for r in range(2)]
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert torch.equal(res["all_reduce"], torch.full((1024,), 6.0))
        assert all(torch.equal(o, torch.arange(3.0) + j) for j, o in enumerate(res["all_gather"]))
        assert torch.equal(res["future"], torch.full((2,), 2.0))
        assert torch.equal(res["p2p"], torch.full((4,), float((r - 1) % 2)))
        mem = [e for e in events(fc, r) if e["k"] == "mem"]
        assert len(mem) == 1 and mem[0]["device"].startswith("cuda:") and mem[0]["peak_allocated"] > 0


def test_finished_calls_do_not_keep_tensors_alive(tmp_path):
    codes, _ = run_world(tmp_path, 2, [str(SCRIPTS / "release_worker.py"), str(tmp_path)], slots=1)
    assert codes == [0, 0], [log(tmp_path, r) for r in range(2)]
    for r in range(2):
        lines = (tmp_path / f"rank{r}.txt").read_text().split("\n")[:-1]
        assert len(lines) == 10, lines
        assert [ln for ln in lines if not ln.endswith(" freed")] == [], f"rank {r}"

