"""How many CUDA devices torch sees, asked once (tests/conftest.py's ``gpu``
marker and the few tests that need the count itself)."""

from __future__ import annotations

import functools


@functools.cache
def cuda_device_count() -> int:
    """0 where torch has no CUDA or sees no device."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


__all__ = ["cuda_device_count"]
