"""Training scripts written with the frameworks users train with (FSDP2,
DTensor tensor parallelism, 2-D meshes, ``torch.distributed.pipelining``,
``torch.distributed.checkpoint``). Ordinary ``torch.distributed`` programs
that never import Prism; each rank 0 (or the last pipeline stage) prints
``step K loss X``. ``docs/COVERAGE.md`` lists what each one exercises."""
