"""Logical devices (prism/rank/devices.py): the rewriting on CPU, every call
a script makes on a GPU (in a fresh process, since install patches torch)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from prism.rank import devices

ROOT = Path(__file__).resolve().parents[2]


def test_choose_gpu_gives_contiguous_blocks():
    assert [devices.choose_gpu(r, 8, [0]) for r in range(8)] == [0] * 8
    assert [devices.choose_gpu(r, 8, [0, 1]) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [devices.choose_gpu(r, 6, [2, 5, 7]) for r in range(6)] == [2, 2, 5, 5, 7, 7]
    with pytest.raises(ValueError, match="no physical GPU"):
        devices.choose_gpu(0, 8, [])


def test_parse_gpus():
    assert devices.parse_gpus("0,1, 3") == [0, 1, 3]
    assert devices.parse_gpus("cuda:2") == [2]
    with pytest.raises(ValueError, match="'x' is not a GPU index"):
        devices.parse_gpus("0,x")


def test_rewrite_device_maps_every_cuda_index_to_device_0():
    assert devices.rewrite_device(torch.device("cuda", 5)) == torch.device("cuda", 0)
    assert devices.rewrite_device("cuda:7") == "cuda:0"
    assert devices.rewrite_device(torch.device("cuda")) == torch.device("cuda")
    assert devices.rewrite_device("cpu") == "cpu"
    assert devices.rewrite_device(torch.device("cpu")) == torch.device("cpu")
    assert devices.rewrite_device("cuda:x") == "cuda:x"  # not a device string: left alone


class _Record(TorchFunctionMode):
    """Below the logical mode: records what reaches torch, returns a CPU stand-in."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.device:  # torch.device(...) reaches modes too
            return func(*args, **(kwargs or {}))
        self.calls.append((getattr(func, "__name__", str(func)), args[1:], dict(kwargs or {})))
        return torch.zeros(1)


def test_mode_rewrites_explicit_device_arguments_on_cpu():
    t = torch.arange(3.0)
    rec = _Record()
    with rec, devices.LogicalDeviceMode():
        t.to(5)
        t.to("cuda:6")
        t.cuda(7)
        t.to(torch.device("cuda", 3), torch.float16)
        torch.zeros(2, device=torch.device("cuda", 4))
        torch.ones(2, device="cuda:2")
        torch.empty(2, device=1)
        t.to("cpu")
        t.add(True)  # a bool is no device index
        logical = (torch.device("cuda:5"), torch.device("cuda", 6))
    assert logical == (torch.device("cuda", 5), torch.device("cuda", 6))
    got = [(name, args, kw.get("device")) for name, args, kw in rec.calls]
    assert got == [
        ("to", (0,), None),
        ("to", ("cuda:0",), None),
        ("cuda", (0,), None),
        ("to", (torch.device("cuda", 0), torch.float16), None),
        ("zeros", (), torch.device("cuda", 0)),
        ("ones", (), "cuda:0"),
        ("empty", (), 0),
        ("to", ("cpu",), None),
        ("add", (True,), None),
    ]


_BACKWARD_PROBE = """
import json, sys, torch
from prism.rank import devices
mode = devices.LogicalDeviceMode()
if sys.argv[1] == "patched":
    devices._patch_autograd_engine(mode)
seen = []
class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2
    @staticmethod
    def backward(ctx, g):
        before = mode.calls
        out = torch.zeros_like(g) + g * 2
        seen.append(mode.calls - before)
        return out
w = torch.ones(3, requires_grad=True)
with mode:
    F.apply(w).sum().backward()
    torch.autograd.grad(F.apply(w).sum(), w)
print(json.dumps({"seen": seen, "grad": w.grad.tolist()}))
"""


@pytest.mark.slow  # over 2 s on the 2-core VM
@pytest.mark.parametrize("how", ["patched", "plain"])
def test_backward_passes_run_under_the_logical_device_mode(how):
    # Without the patch torch pops the mode before the engine captures its
    # thread-local state, so a custom Function's backward bypasses it.
    proc = subprocess.run([sys.executable, "-c", _BACKWARD_PROBE, how], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["grad"] == [2.0, 2.0, 2.0]
    assert out["seen"] == ([3, 3] if how == "patched" else [0, 0])


def test_install_without_cuda_does_nothing():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only path; this machine has a CUDA device")
    assert devices.install(5, 8, 8) is None
    assert not devices.installed()
    assert devices.physical_name("cuda:5") == "cuda:5"
    assert torch.cuda.device_count() == 0


def _probe(rank: int, world: int, nproc: int, **env: str) -> dict:
    e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), NPROC=str(nproc), **env)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH", "")) if p)
    e.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "devices_probe.py")], env=e,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [0, 5, 7])
def test_every_call_with_logical_devices(rank):
    # Remapping forced: on an 8-GPU machine rank 0 on GPU 0 would otherwise need none.
    out = _probe(rank, 8, 8, PRISM_PHYSICAL_DEVICE="0", PROBE_MESH="1", PRISM_LOGICAL_IDENTITY="0")
    assert out["physical"] == 0 and out["visible"] == "0"
    assert out["device_count"] == 8 and out["physical_name"] == "cuda:0"
    assert out["current_after_set"] == rank
    assert out["current_in_ctx"] == (rank + 1) % 8
    assert out["current_after_ctx"] == rank
    for key in ("to_int", "to_str", "cuda_int", "factory_device", "factory_str", "module_to"):
        assert out[key] == "cuda:0", key
    assert out["props_name"] == torch.cuda.get_device_properties(0).name
    assert out["mem_get_info_ok"]
    assert out["max_allocated"] >= 4 << 20
    assert out["sum"] == 12.0
    # Autograd's device thread sees the logical devices too (Megatron's MoE all_to_all backward).
    assert out["backward_alloc"] == out["backward_zeros"] == "cuda:0"
    assert out["backward_grad"] == out["grad_grad"] == [2.0, 2.0, 2.0]
    assert "device 8 does not exist on this emulated node, which has 8" in out["bad_index"]
    assert out["mesh"] == "cuda" and out["current_after_mesh"] == rank


_IDENTITY_PROBE = """
import json, os, sys, torch
torch.cuda.device_count = lambda: 2  # a node of 2 GPUs, without touching CUDA
torch.cuda.is_initialized = lambda: False
selected = []
torch.cuda.set_device = selected.append
from prism.rank import devices
set_before = torch.cuda.set_device
phys = devices.install(int(sys.argv[1]), 2, int(sys.argv[2]), gpus=[0, 1])
print(json.dumps({"physical": phys, "mode": devices.mode() is not None,
                  "patched": torch.cuda.set_device is not set_before, "selected": selected,
                  "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "physical_name": devices.physical_name("cuda:1")}))
"""


@pytest.mark.slow  # over 2 s on the 2-core VM
@pytest.mark.parametrize("rank,nproc,identity_env,remapped", [
    (1, 2, None, False),  # 2 ranks, 2 GPUs, own numbering: nothing to remap
    (0, 2, None, False),
    (1, 8, None, True),   # a node of 8 emulated on 2 GPUs: remap
    (1, 2, "0", True),    # forced
])
def test_logical_devices_are_left_alone_when_they_are_the_physical_ones(rank, nproc, identity_env, remapped):
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    e.pop("CUDA_VISIBLE_DEVICES", None)
    e.pop(devices.PHYSICAL_ENV, None)
    if identity_env is not None:
        e[devices.IDENTITY_ENV] = identity_env
    proc = subprocess.run([sys.executable, "-c", _IDENTITY_PROBE, str(rank), str(nproc)], env=e,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["physical"] == rank and out["physical_name"] == f"cuda:{rank}"
    assert out["mode"] is remapped and out["patched"] is remapped
    assert out["visible"] == (str(rank) if remapped else None)
    # Without remapping the rank starts on its own GPU (no context on GPU 0).
    assert out["selected"] == ([] if remapped else [rank])


@pytest.mark.gpu(2, reason="one rank per GPU, nothing remapped")
def test_ranks_on_their_own_gpus_hold_memory_on_no_other(tmp_path):
    # Measured before the fix on 2 H200s: rank 1 held +518 MiB on GPU 0 (a
    # second CUDA context, opened by Prism's completion thread).
    proc = subprocess.run(
        [sys.executable, "-m", "prism", "capture", "-n", "2", "--nproc-per-node", "2", "--gpus", "0,1",
         "--out", str(tmp_path / "run"), "--progress", "off", "--",
         str(ROOT / "tests" / "support" / "scripts" / "contexts_worker.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(2):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert out["device"] == r
        assert list(out["held"]) == [str(r)], f"rank {r} holds GPU memory on {out['held']} (MiB)"
