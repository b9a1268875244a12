"""Prism's CUDA extension: communication pruning, compensation and prefetch
buffer pools for phase 2 (hybrid emulation). Nothing is built here yet; the
hybrid-emulation issue brings the kernels, compiled with
``torch.utils.cpp_extension`` on demand."""
