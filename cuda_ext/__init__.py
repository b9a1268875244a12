"""Prism's CUDA extension for phase 2 (hybrid emulation): prefetch buffer
pools, stream-ordered release flags, and the kernels of communication pruning
and compensation, compiled with ``torch.utils.cpp_extension`` on demand, each
with a pure-torch fallback that defines its semantics. Not built yet; see
docs/DESIGN.md, "Phase 2: where each part goes"."""
