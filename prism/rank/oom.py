"""A rank that ran out of GPU memory, told in one paragraph.

``describe(exc, rank, step)`` is None unless ``exc`` is (or was raised from) a
``torch.OutOfMemoryError``; else the paragraph ``prism capture`` prints and the
trace keeps: the rank, the step, the request, what torch's allocator held
(allocated and reserved) against the limit, and where in the script it
happened (the innermost frame outside torch and Prism).

The limit is ``prism capture --memory-limit``'s allocator budget when one was
given (``MEMORY_LIMIT_ENV``, bytes), else the device's total memory.
"""

from __future__ import annotations

import os
import re
import traceback
from typing import Any

#: The allocator's budget in bytes under ``prism capture --memory-limit`` (set by the capture).
MEMORY_LIMIT_ENV = "PRISM_MEMORY_LIMIT_BYTES"
_REQUEST = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _oom_in(exc: BaseException | None) -> BaseException | None:
    import torch

    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, torch.OutOfMemoryError):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _script_frame(exc: BaseException) -> str:
    """``file:line in function: code`` of the innermost frame that is the script's."""
    import torch

    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(skip) and "site-packages" not in f.filename
              and not f.filename.startswith("<frozen")]
    if not frames:
        return "(no frame of the script on the stack)"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def describe(exc: BaseException, rank: int, step: int) -> str | None:
    import torch

    oom = _oom_in(exc)
    if oom is None:
        return None
    m = _REQUEST.search(str(oom))
    requested = m.group(1) if m else "an unknown amount"
    details = ""
    try:
        dev = torch._C._cuda_getDevice()
        allocated, reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        limit_env = os.environ.get(MEMORY_LIMIT_ENV)
        if limit_env:
            limit = f"the --memory-limit allocator budget of {gib(int(limit_env))}"
        else:
            limit = f"the device's {gib(torch.cuda.get_device_properties(dev).total_memory)}"
        details = f" with {gib(allocated)} allocated and {gib(reserved)} reserved by torch's allocator, against {limit}"
    except Exception as e:  # noqa: BLE001 (the device may be unusable after the failure)
        details = f" (the allocator could not be read: {e})"
    return (f"rank {rank} ran out of GPU memory in step {step}: it asked for {requested}{details}; "
            f"at {_script_frame(oom)}")


def set_limit(limit_bytes: int) -> Any:
    """Cap torch's allocator on this process's GPU at ``limit_bytes`` (a real
    ``torch.OutOfMemoryError`` past it); the fraction set, for the record."""
    import torch

    dev = torch._C._cuda_getDevice()
    total = torch.cuda.get_device_properties(dev).total_memory
    fraction = min(limit_bytes / total, 1.0)
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    return fraction
