"""The semantics of cuda_ext's kernels, in plain torch (the fallback).

Every function here runs on any device torch has (CPU in CI, CUDA where the
extension could not be built) and is what the kernels must equal bit for bit
(``tests/unit/test_cuda_ext.py`` checks this against an independent numpy
oracle on CPU; ``tests/gpu/test_cuda_ext_gpu.py`` checks kernels against it).

Compensation (docs/DESIGN.md, "Compensation policy"): a collective among k
sandbox ranks and N - k virtual ones is computed over k + 1 inputs, the k
real ones and one *folded* contribution standing for every virtual member
(``prism.core.compensation.fold``). On a sandbox's GPU that is one fused step,
``out = own (op) folded``:

===========  =========================================
op           out
===========  =========================================
SUM          own + folded
AVG          (own + folded) / n        (n: the whole group's size)
PREMUL_SUM   factor * own + folded     (the folded term already premultiplied)
MIN / MAX    min / max of the two (NaN wins)
===========  =========================================

computed in float32 whatever the dtype (float32, float16, bfloat16), each
operation rounded as IEEE float32 does (no fused multiply-add), and the result
rounded once to the dtype (round to nearest even). Integer dtypes are not the
kernels' business: they run here.

Layouts (all_gather, all_to_all, gather/scatter): the output is the virtual
members' data with the sandbox's own chunk in its place: ``place``, three
device copies that write each byte once (as fast as a fused kernel: the
bandwidth is the copies').
"""

from __future__ import annotations

import torch

__all__ = ["OPS", "combine", "place"]

#: Reduce ops the combine step takes, with the codes the kernels use.
OPS = {"SUM": 0, "AVG": 1, "PREMUL_SUM": 2, "MIN": 3, "MAX": 4}


def _check(op: str, own: torch.Tensor, folded: torch.Tensor, out: torch.Tensor | None) -> None:
    if op not in OPS:
        raise ValueError(f"combine: unknown reduce op {op!r}; known: {', '.join(OPS)}")
    if own.shape != folded.shape or own.dtype != folded.dtype or own.device != folded.device:
        raise ValueError(f"combine: own {tuple(own.shape)} {own.dtype} on {own.device} and folded "
                         f"{tuple(folded.shape)} {folded.dtype} on {folded.device} must agree")
    if out is not None and (out.shape != own.shape or out.dtype != own.dtype or out.device != own.device):
        raise ValueError(f"combine: out {tuple(out.shape)} {out.dtype} does not match own {tuple(own.shape)} {own.dtype}")


def combine(op: str, own: torch.Tensor, folded: torch.Tensor, *, n: int = 1, factor: float = 1.0,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = own (op) folded`` (the module table); returns ``out`` (new if None)."""
    _check(op, own, folded, out)
    if not own.dtype.is_floating_point:
        r = _combine_exact(op, own, folded, n, factor)
    else:
        a, b = own.float(), folded.float()
        if op == "SUM":
            r = a + b
        elif op == "AVG":
            # a tensor divisor: torch divides a CUDA tensor by a Python scalar
            # through its reciprocal, which rounds differently
            r = (a + b) / torch.full((), float(n), dtype=torch.float32, device=a.device)
        elif op == "PREMUL_SUM":
            r = a * torch.full((), float(factor), dtype=torch.float32, device=a.device)
            r = r + b
        elif op == "MIN":
            r = torch.where(torch.isnan(a), a, torch.where(torch.isnan(b), b, torch.where(b < a, b, a)))
        else:
            r = torch.where(torch.isnan(a), a, torch.where(torch.isnan(b), b, torch.where(b > a, b, a)))
    r = r.to(own.dtype)
    if out is None:
        return r
    out.copy_(r)
    return out


def _combine_exact(op: str, own: torch.Tensor, folded: torch.Tensor, n: int, factor: float) -> torch.Tensor:
    if op == "SUM":
        return own + folded
    if op == "AVG":
        return torch.div(own + folded, n, rounding_mode="floor")
    if op == "PREMUL_SUM":
        return (own * factor).to(own.dtype) + folded
    return torch.minimum(own, folded) if op == "MIN" else torch.maximum(own, folded)


def place(out: torch.Tensor, background: torch.Tensor, own: torch.Tensor, offset: int) -> torch.Tensor:
    """``out`` (flat) = ``background`` with ``own`` written at element ``offset``:
    an all_gather's output with the sandbox's shard in its slot, an
    all_to_all's with its chunk to itself. Each byte of ``out`` is written once."""
    o, bg, me = out.view(-1), background.reshape(-1), own.reshape(-1)
    end = offset + me.numel()
    if bg.numel() != o.numel() or offset < 0 or end > o.numel():
        raise ValueError(f"place: {me.numel()} elements at {offset} do not fit an output of {o.numel()} "
                         f"(background {bg.numel()})")
    if offset:
        o[:offset].copy_(bg[:offset])
    o[offset:end].copy_(me)
    if end < o.numel():
        o[end:].copy_(bg[end:])
    return out
