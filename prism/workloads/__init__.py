"""Bundled workloads: ordinary ``torch.distributed`` training scripts.

None of them imports Prism; Prism runs them unmodified (replacing the process
group backend), and so does torchrun, which gives the ground truth. Each runs
as ``python -m prism.workloads.NAME`` or as a script path under a launcher.

``gpt``
    A small GPT decoder with Megatron-style tensor, pipeline (1F1B), data and
    expert parallelism (``--tp --pp --dp --ep --experts``), written with plain
    ``torch.distributed`` calls. Rank layout
    ``rank = tp_rank + TP * (dp_rank + DP * pp_rank)``, EP groups from
    consecutive DP ranks. Its docstring gives the group creation order, the
    flags and the model. Any layout computes the same losses as one rank with
    the same global batch, up to float rounding.
``ddp_example``
    Plain ``DistributedDataParallel`` on a small MLP, as users write it.
``collectives_example``
    Hand-written subgroups, uneven ``all_to_all_single``, broadcast, a p2p
    ring, ``reduce_scatter_tensor``, ``all_gather_into_tensor``,
    ``all_gather`` and AVG/MAX ``all_reduce``, with backward and an optimizer
    step.

Printed lines (stdout; :mod:`prism.workloads.harness` parses them):

- ``step K loss X`` (gpt, ddp_example): one line per step K = 0, 1, ...,
  from one rank; X is ``repr`` of a Python float, the global-batch mean loss.
- ``splits step K micro M layer L rank R send [..] recv [..]`` (gpt with
  ``--print-splits``): MoE dispatch split sizes, every rank.
- ``rank R step K NAME X`` (collectives_example): every rank, one line per
  collective result.

:mod:`prism.workloads.harness` runs a world of these scripts without a
launcher (``run_world``) and parses their output.
"""
