"""Logical CUDA devices: a script written for an 8-GPU node runs unchanged
when its rank is given one physical GPU (or shares one with other ranks).

A rank with ``LOCAL_RANK`` 5 calls ``torch.cuda.set_device(5)``, builds
tensors on ``cuda:5`` and asks ``torch.cuda.device_count()``; under Prism its
process sees exactly one GPU, the physical one it was given, as in-process
device 0 (``CUDA_VISIBLE_DEVICES`` is set to it before CUDA initialises), and
every logical index ``0 .. nproc_per_node-1`` names that device.

How (Python-level interception, chosen over a preloaded ``libcudart`` shim):

- ``torch.cuda.set_device``, ``device``, ``current_device``,
  ``device_count`` and the index resolver ``_get_device_index`` (which
  ``get_device_properties``, ``mem_get_info``, ``max_memory_allocated`` and the
  other memory statistics use) are replaced in ``torch.cuda`` and
  ``torch.cuda.memory``. The script sees logical values (``device_count()`` is
  ``nproc_per_node``; ``current_device()`` is the last logical index it
  selected); callers inside torch keep getting in-process values, because
  they feed them straight to C++, except ``device_count`` called from
  ``torch.distributed`` (``DeviceMesh`` sizes hosts by it). FSDP2 builds its
  device from ``current_device()`` and checks parameters against it, so
  ``torch.distributed`` gets the in-process ``current_device``.
- Explicit device arguments (``tensor.to(5)``, ``.to("cuda:5")``,
  ``.cuda(5)``, ``torch.zeros(..., device=torch.device("cuda", 5))``) are
  rewritten to ``cuda:0`` by a ``TorchFunctionMode`` pushed on the script's
  thread. ``bench/gpu_capture.py`` measures its cost per call.

A libcudart shim would also relabel tensors (``t.device`` would print
``cuda:5``), but torch sizes per-device tables by the count and reaches
devices through the driver API, NVML and the caching allocator too, so every
path would need shimming; the Python route touches only what scripts call.

When each rank's logical index is its physical GPU and the node has as many
GPUs as ranks (``prism capture --gpus 0,1 --nproc-per-node 2`` at world 2),
nothing is patched: the rank runs as in the real job, except that its
current device starts as its own GPU rather than 0 (so Prism's calls before
the script's ``set_device`` open no context on GPU 0); ``PRISM_LOGICAL_IDENTITY=0``
remaps anyway.

Limits (documented, not hidden): ``tensor.device`` and ``tensor.get_device()``
show ``cuda:0``; the rewrite mode is thread-local, so device arguments given
in threads the script starts are not rewritten (``set_device`` and friends
work everywhere); ``torch.Generator(device="cuda:5")`` and other
non-``torch``-function constructors are not rewritten; a logical index
``>= nproc_per_node`` raises as an invalid ordinal would.

Public API: ``install(rank, world_size, nproc_per_node, gpus=None)``,
``install_if_requested(rank, world_size, nproc_per_node)`` (the fork server's hook),
``choose_gpu(rank, world_size, gpus)``, ``physical_name(device)``, ``LogicalDeviceMode``,
``rewrite_device(obj)``, ``installed()``, ``PHYSICAL_ENV``, ``GPUS_ENV``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: One physical GPU for this rank ("3" or "cuda:3"); wins over ``GPUS_ENV``.
PHYSICAL_ENV = "PRISM_PHYSICAL_DEVICE"
#: "0": always remap, even when logical and physical indices coincide.
IDENTITY_ENV = "PRISM_LOGICAL_IDENTITY"
#: ``GPUS_ENV``: comma-separated physical GPUs shared by the run (``prism capture
#: --gpus``); ranks are assigned to them in contiguous blocks.
from prism.rank.envnames import GPUS_ENV, NODE_RANKS_ENV  # noqa: E402
from prism.rank.placement import choose_gpu, choose_node_gpu, node_rank_list, parse_gpus  # noqa: E402,F401 (re-exported)

_CUDA_INDEX = re.compile(r"cuda:(\d+)")
_state: _Logical | None = None


class _Logical:
    __slots__ = ("count", "current", "physical", "mode")

    def __init__(self, count: int, current: int, physical: int) -> None:
        self.count = count
        self.current = current
        self.physical = physical
        self.mode: LogicalDeviceMode | None = None


def mode() -> LogicalDeviceMode | None:
    """The rewrite mode pushed on the script's thread, if installed."""
    return getattr(_state, "mode", None) if _state is not None else None


def bind_thread() -> bool:
    """Make the calling Prism thread's current CUDA device the rank's GPU;
    True once done (then it holds for the thread's life).

    A new thread's current device is 0. With every GPU visible (one GPU per
    rank, nothing remapped) a device guard in Prism's completion thread that
    restores device 0 opens a context there: +518-524 MiB on GPU 0 for rank 1
    on 2 H200s, which the real run does not have. Does nothing until CUDA is
    initialised (that is the script's to do), nor when the rank sees only its
    own GPU (remapped ranks: device 0 is it).
    """
    if _state is None or _state.mode is not None:
        return True
    if not torch.cuda.is_initialized():
        return False
    torch.cuda.set_device(_state.physical)
    return True


def installed() -> bool:
    """Whether logical devices are installed in this process."""
    return _state is not None


def physical_name(device: str) -> str:
    """The physical GPU behind a logical ``cuda:i`` (as NVML numbers GPUs);
    ``device`` itself when logical devices are not installed or it is not CUDA."""
    if _state is None or not device.startswith("cuda"):
        return device
    return f"cuda:{_state.physical}"


def _logical_index(device: Any) -> int | None:
    """The index the script named, or None for "the current device"."""
    if device is None:
        return None
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return device.index
    if isinstance(device, torch.cuda.device):
        return _state.current if _state is not None else None
    raise ValueError(f"cannot read a CUDA device index from {device!r}")


def _check(index: int | None, what: str) -> None:
    if index is not None and _state is not None and not (-1 <= index < _state.count):
        raise RuntimeError(
            f"{what}: CUDA device {index} does not exist on this emulated node, which has "
            f"{_state.count} (nproc_per_node); logical devices are 0..{_state.count - 1} "
            "(your script's or launch options' fault: check LOCAL_RANK use and --nproc-per-node)")


def rewrite_device(obj: Any) -> Any:
    """``obj`` with any CUDA index replaced by in-process device 0 (the rank's
    physical GPU); anything else is returned unchanged."""
    if isinstance(obj, torch.device):
        if obj.type == "cuda" and obj.index not in (None, 0):
            _check(obj.index, "device")
            return torch.device("cuda", 0)
        return obj
    if isinstance(obj, str) and obj.startswith("cuda:"):
        m = _CUDA_INDEX.fullmatch(obj)
        if m and m.group(1) != "0":
            _check(int(m.group(1)), "device")
            return "cuda:0"
    return obj


_INT_DEVICE_FIRST = {torch.Tensor.to, torch.Tensor.cuda}
_monotonic_ns = time.monotonic_ns


class LogicalDeviceMode(TorchFunctionMode):
    """Rewrites explicit CUDA device arguments (``device=`` anywhere,
    ``torch.device``/``"cuda:N"`` positional, an int first argument of
    ``Tensor.to``/``Tensor.cuda``) to in-process device 0."""

    #: Calls seen (prism.rank.gputime removes their cost from the CPU share).
    calls = 0
    #: When the last call through the mode started (a wait for the GPU inside
    #: it began no earlier: prism.rank.gputime's join segments end their CPU
    #: share there).
    call_ns = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        self.call_ns = _monotonic_ns()
        if func is torch.device:
            # torch.device(...) reaches modes too; a device object keeps its
            # logical index until it is used.
            return func(*args, **(kwargs or {}))
        if kwargs:
            dev = kwargs.get("device")
            if dev is not None:
                if isinstance(dev, int) and dev > 0:
                    _check(dev, getattr(func, "__name__", "device"))
                    kwargs = {**kwargs, "device": 0}
                else:
                    new = rewrite_device(dev)
                    if new is not dev:
                        kwargs = {**kwargs, "device": new}
        else:
            kwargs = {}
        if len(args) > 1:
            first = args[1]
            if isinstance(first, int) and not isinstance(first, bool) and first > 0 and func in _INT_DEVICE_FIRST:
                _check(first, getattr(func, "__name__", "device"))
                args = (args[0], 0, *args[2:])
            elif isinstance(first, (torch.device, str)):
                new = rewrite_device(first)
                if new is not first:
                    args = (args[0], new, *args[2:])
        elif args and isinstance(args[0], (torch.device, str)):
            new = rewrite_device(args[0])
            if new is not args[0]:
                args = (new,)
        return func(*args, **kwargs)


def _from_torch_internals() -> bool:
    """Whether the caller of the patched function is torch itself (and not
    torch.distributed, which reasons in per-host device counts)."""
    name = sys._getframe(2).f_globals.get("__name__", "")
    return name.startswith("torch.") and not name.startswith("torch.distributed")


def install(rank: int, world_size: int, nproc_per_node: int, gpus: Sequence[int] | None = None) -> int | None:
    """Give this rank process its physical GPU and logical devices
    ``0..nproc_per_node-1``; returns the physical GPU, or None (nothing done)
    when the machine has no CUDA device. Must run before CUDA initialises
    (in the fork server's child, before the script)."""
    global _state
    if _state is not None:
        return _state.physical
    if torch.cuda.is_initialized():
        raise RuntimeError("prism.rank.devices.install: CUDA is already initialised in this process; "
                           "this is a Prism bug (install runs before the script), please report it")
    # NVML's count: initialising CUDA here would fix CUDA_VISIBLE_DEVICES too early.
    if torch.cuda.device_count() == 0:
        return None
    env = os.environ
    if env.get(PHYSICAL_ENV):
        physical = parse_gpus(env[PHYSICAL_ENV])[0]
    else:
        if gpus is None:
            gpus = parse_gpus(env[GPUS_ENV]) if env.get(GPUS_ENV) else list(range(torch.cuda.device_count()))
        physical = choose_node_gpu(rank, world_size, gpus, env.get(NODE_RANKS_ENV))
    if (physical == rank % nproc_per_node and torch.cuda.device_count() == nproc_per_node
            and env.get(IDENTITY_ENV, "1") != "0"):
        # One GPU per rank with the script's own numbering (a capture on as
        # many GPUs per node as the node has ranks): every index already
        # names the right device. Nothing is patched and no mode is pushed,
        # so the rank runs exactly as in the real job, at the same CPU cost.
        env[PHYSICAL_ENV] = str(physical)
        _state = _Logical(nproc_per_node, physical, physical)
        # Prism's own CUDA calls before the script selects its device (the
        # GPU timing's set-up) would otherwise open a second context on GPU 0
        # (measured on 2 H200s: +518 MiB on rank 1). The script's own
        # set_device(LOCAL_RANK) then changes nothing.
        torch.cuda.set_device(physical)
        return physical
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible:
        entries = [v for v in visible.split(",") if v.strip()]
        if physical >= len(entries):
            raise ValueError(f"rank {rank}: physical GPU {physical} is not among CUDA_VISIBLE_DEVICES={visible}")
        env["CUDA_VISIBLE_DEVICES"] = entries[physical]
    else:
        env["CUDA_VISIBLE_DEVICES"] = str(physical)
    env[PHYSICAL_ENV] = str(physical)
    # torchrun gives no default device: it stays 0 until the script selects one.
    _state = _Logical(nproc_per_node, 0, physical)
    _patch_torch_cuda()
    _state.mode = LogicalDeviceMode()
    _state.mode.__enter__()
    _patch_autograd_engine(_state.mode)
    return physical


def install_if_requested(rank: int, world_size: int, nproc_per_node: int) -> int | None:
    """``install`` when the launch asked for GPUs (``PRISM_GPUS`` or
    ``PRISM_PHYSICAL_DEVICE`` set, as ``prism capture`` does for a CUDA
    command or ``--gpus``); CPU captures and ground-truth runs stay untouched."""
    if not (os.environ.get(GPUS_ENV) or os.environ.get(PHYSICAL_ENV)):
        return None
    return install(rank, world_size, nproc_per_node)


def _patch_torch_cuda() -> None:
    import torch.cuda.memory as cmem

    cuda = torch.cuda
    orig_index = cuda._get_device_index
    orig_set = cuda.set_device
    orig_current = cuda.current_device
    orig_count = cuda.device_count
    orig_device = cuda.device

    def _get_device_index(device: Any, optional: bool = False, allow_cpu: bool = False) -> int:
        if isinstance(device, (int, str, torch.device)):
            index = device if isinstance(device, int) else torch.device(device).index
            if isinstance(device, int) or (torch.device(device).type == "cuda"):
                _check(index, "device")
                if index is not None and index >= 0:
                    return 0
        result = orig_index(device, optional, allow_cpu)
        return 0 if result > 0 else result

    def set_device(device: Any) -> None:
        index = _logical_index(device)
        _check(index, "torch.cuda.set_device")
        if index is not None and index >= 0:
            _state.current = index
            orig_set(0)

    def current_device() -> int:
        # Every torch caller gets the in-process index, torch.distributed
        # included: FSDP2 builds its device from it and checks parameters
        # against it (only device_count is logical there, for DeviceMesh).
        if sys._getframe(1).f_globals.get("__name__", "").startswith("torch."):
            return orig_current()
        orig_current()  # initialises CUDA as the original would
        return _state.current

    def device_count() -> int:
        if _from_torch_internals():
            return orig_count()
        return _state.count if orig_count() > 0 else 0

    class device(orig_device):  # noqa: N801 (torch's name)
        __doc__ = orig_device.__doc__

        def __init__(self, dev: Any) -> None:
            self.logical = _logical_index(dev)
            _check(self.logical, "torch.cuda.device")
            super().__init__(dev)
            self.prev_logical = None

        def __enter__(self):
            self.prev_logical = _state.current
            if self.logical is not None and self.logical >= 0:
                _state.current = self.logical
            return super().__enter__()

        def __exit__(self, *exc: Any):
            _state.current = self.prev_logical
            return super().__exit__(*exc)

    cuda._get_device_index = _get_device_index
    cmem._get_device_index = _get_device_index
    logical_generators(cuda)
    _patch_copy_streams()
    _patch_accelerator_index()
    cuda.set_device = set_device
    cuda.current_device = current_device
    cuda.device_count = device_count
    cuda.device = device


class _LogicalGenerators(tuple):
    """``torch.cuda.default_generators`` indexed by a logical device: this
    process has one device, so every valid logical index names its generator
    (Megatron-core reads ``default_generators[torch.cuda.current_device()]``)."""

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int) and not isinstance(index, bool) and len(self) == 1:
            _check(index, "torch.cuda.default_generators")
            return tuple.__getitem__(self, 0)
        return tuple.__getitem__(self, index)


def logical_generators(module: Any) -> None:
    """Make ``module.default_generators`` (set by torch's C++ side when CUDA
    initialises, after this runs) a ``_LogicalGenerators``: a property on the
    module's class intercepts the assignment."""
    current = module.__dict__.get("default_generators", ())

    class _Module(type(module)):
        @property
        def default_generators(self) -> Any:
            value = self.__dict__.get("_prism_default_generators")
            if not value:  # written straight into the module's dict after all
                value = _LogicalGenerators(self.__dict__.get("default_generators", ()))
            return value

        @default_generators.setter
        def default_generators(self, value: Any) -> None:
            self.__dict__["_prism_default_generators"] = _LogicalGenerators(value)

    module.__class__ = _Module
    module.default_generators = current


def _patch_copy_streams() -> None:
    """DDP with ``device_ids=[LOCAL_RANK]`` moves its inputs on a side stream
    from ``torch.nn.parallel._functions._get_stream(cuda:LOCAL_RANK)``, a list
    sized by the in-process device count: give it the in-process device."""
    import torch.nn.parallel._functions as functions

    original = functions._get_stream

    def _get_stream(device: Any) -> Any:
        if isinstance(device, torch.device) and device.type == "cuda" and device.index:
            _check(device.index, "the DDP copy stream's device")
            device = torch.device("cuda", 0)
        return original(device)

    functions._get_stream = _get_stream


def _patch_autograd_engine(mode: LogicalDeviceMode) -> None:
    """Backward passes run in autograd's device threads with the thread-local
    state captured when the engine is called, which is inside the mode's own
    handler for ``backward``/``autograd.grad``, where torch has popped the
    mode: a custom Function's backward that allocates on
    ``torch.cuda.current_device()`` (the script's logical index; Megatron's
    MoE all_to_all does) would then name a device this process lacks
    ("invalid device ordinal", measured on one H200). So the engine is entered
    with the mode pushed again: the device threads see the logical devices
    as the script's own thread does."""
    import torch.autograd as autograd

    original = getattr(autograd, "_engine_run_backward", None)
    if original is None:  # torch before 2.3 calls the engine directly
        return

    def _engine_run_backward(*args: Any, **kwargs: Any) -> Any:
        if mode in torch.overrides._get_current_function_mode_stack():
            return original(*args, **kwargs)
        with mode:
            return original(*args, **kwargs)

    autograd._engine_run_backward = _engine_run_backward


def _patch_accelerator_index() -> None:
    """``torch.accelerator.device_index(i)`` (DDP's input copies enter it with
    its ``device_ids[0]``, the script's logical index) switches to the
    in-process device; the script's current logical device moves with it."""
    accelerator = getattr(torch, "accelerator", None)
    original = getattr(accelerator, "device_index", None)
    if original is None:  # torch before 2.8
        return

    class device_index(original):  # noqa: N801 (torch's name)
        __doc__ = original.__doc__

        def __init__(self, device: int | None, /) -> None:
            _check(device, "torch.accelerator.device_index")
            super().__init__(None if device is None else (0 if device >= 0 else device))

    accelerator.device_index = device_index
