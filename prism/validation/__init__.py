"""Checking Prism's predictions against measured runs.

- ``fidelity``: the kept GPU captures (``bench/results/traces/``), the truths
  measured beside them, and their replay with the current model;
- ``stepclock``: the script that runs a training command unmodified and logs
  each optimizer step's end (the ground truth's clock), and its file format;
- ``truthrun``: ground-truth runs (plain torch.distributed, no Prism) under the
  step clock;
- ``truthcut``: one profiled truth step cut into the stretches a capture
  records, beside the capture's;
- ``cpunoise``: CPU topology, single-thread draw timings and scheduler data of
  truth runs (why a CPU-bound truth moves between runs).

The benchmarks under ``bench/`` are the command lines around these. Nothing
here imports torch at import time.
"""
