"""Training scripts written with the frameworks users train with: FSDP2,
DTensor tensor parallelism, a 2-D mesh, ``torch.distributed.pipelining``,
``torch.distributed.checkpoint``, plus a tour of the ``torch.distributed``
calls themselves.

Ordinary ``torch.distributed`` programs that never import Prism; run them as
script paths (``torchrun ... prism/workloads/frameworks/fsdp2.py`` or
``prism capture -n 4 -- prism/workloads/frameworks/fsdp2.py``): some import a
sibling's model (``from dtensor_tp import Net``). One rank prints
``step K loss X`` per step. ``docs/COVERAGE.md`` says what each exercises and
which test checks it under Prism.
"""
