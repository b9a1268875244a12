"""prism.core.collectives against real gloo: three rank processes run every
reducing op under torch.distributed's gloo backend over a local TCP port,
and the numpy implementation gives the same bytes (SUM, AVG, MAX, PRODUCT,
NaN handling of MIN/MAX, reduce_scatter, reduce, all_reduce_coalesced)."""

import json
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from prism.core.collectives import DTYPES, from_array, reduce_arrays, run_collective
from tests.unit.test_collectives import call

GLOO_SCRIPT = textwrap.dedent("""
    import os, sys, json, numpy as np, torch, torch.distributed as dist
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(1234 + rank)
    res = {}
    def raw(t):
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes().hex()
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = torch.randn(1001, generator=g, dtype=torch.float64).to(dt)
        res[f"in_{dt}"] = raw(x)
        for op in ("SUM", "AVG", "MAX", "PRODUCT"):
            y = x.clone(); dist.all_reduce(y, op=getattr(dist.ReduceOp, op)); res[f"{op}_{dt}"] = raw(y)
        nan = x.clone(); nan[rank::5] = float("nan"); res[f"nan_{dt}"] = raw(nan)
        for op in ("MIN", "MAX"):  # gloo's std::min/max keep the local value when one is NaN
            y = nan.clone(); dist.all_reduce(y, op=getattr(dist.ReduceOp, op)); res[f"nan{op}_{dt}"] = raw(y)
        m = 1000 - 1000 % world
        o = torch.empty(m // world, dtype=dt)
        dist.reduce_scatter_tensor(o, x[:m].clone()); res[f"rs_{dt}"] = raw(o)
        ys = [x[:300].clone(), x[300:].clone()]
        dist.all_reduce_coalesced(ys); res[f"coal_{dt}"] = raw(torch.cat(ys))
        o = torch.empty(250, dtype=dt)
        dist.reduce_scatter(o, [x[i * 250:(i + 1) * 250].clone() for i in range(world)]); res[f"rsl_{dt}"] = raw(o)
        y = x.clone(); dist.reduce(y, dst=1); res[f"red_{dt}"] = raw(y)
    with open(out, "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_matches_real_gloo(tmp_path):
    world = 3
    script = tmp_path / "ranks.py"
    script.write_text(GLOO_SCRIPT)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", str(script), str(r), str(world), port,
                               str(tmp_path / f"{r}.json")]) for r in range(world)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    res = [json.loads(pathlib.Path(tmp_path / f"{r}.json").read_text()) for r in range(world)]
    names = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float64": "float64"}
    for tname, dtype in names.items():
        xs = [np.frombuffer(bytes.fromhex(r[f"in_{tname}"]), DTYPES[dtype]) for r in res]
        for op in ("SUM", "AVG", "MAX", "PRODUCT"):
            got = reduce_arrays(xs, op, dtype)
            assert all(got.tobytes().hex() == r[f"{op}_{tname}"] for r in res), (op, dtype)
        nans = [np.frombuffer(bytes.fromhex(r[f"nan_{tname}"]), DTYPES[dtype]) for r in res]
        for op in ("MIN", "MAX"):
            got = reduce_arrays(nans, op, dtype)
            assert all(got.tobytes().hex() == r[f"nan{op}_{tname}"] for r in res), (op, dtype)
        m = 1000 - 1000 % world
        c = call("reduce_scatter_tensor", dtype, [(m,)], [(m // world,)], reduce_op="SUM")
        outs = run_collective([c] * world, [[x[:m]] for x in xs])
        assert [from_array(o[0]).hex() for o in outs] == [r[f"rs_{tname}"] for r in res], dtype
        c = call("reduce_scatter", dtype, [(250,)] * world, [(250,)], reduce_op="SUM")
        outs = run_collective([c] * world, [[x[i * 250:(i + 1) * 250] for i in range(world)] for x in xs])
        assert [from_array(o[0]).hex() for o in outs] == [r[f"rsl_{tname}"] for r in res], dtype
        c = call("reduce", dtype, [(1001,)], [(1001,)], reduce_op="SUM", root=1)
        outs = run_collective([c] * world, [[x] for x in xs])
        assert from_array(outs[1][0]).hex() == res[1][f"red_{tname}"], dtype
        c = call("all_reduce_coalesced", dtype, [(300,), (701,)], [(300,), (701,)], reduce_op="SUM")
        outs = run_collective([c] * world, [[x[:300], x[300:]] for x in xs])
        assert all(from_array(np.concatenate(o)).hex() == r[f"coal_{tname}"] for o, r in zip(outs, res)), dtype
