"""The rank side of Prism: everything that runs inside a logical rank's process.

``backend``    ``PrismProcessGroup``, the torch.distributed backend "prism"
               (every call goes through the coordinator; wire contract in its
               docstring).
``runtime``    per-process state: coordinator client, slot, completion thread,
               optimizer-step hooks (iteration ends, memory samples).
``recorder``   ``RankRecorder``: PrismTrace events shipped as ``TraceRecords``.
``bootstrap``  connects, forces the backend, runs the user's script.
``forkserver`` imports torch once and forks one child per rank.

This package imports torch; ``prism.core`` never imports it.
"""
