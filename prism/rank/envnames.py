"""Environment variables a shell sets for a sandbox rank, importable without
torch (the rest of ``prism.rank`` imports it): the emulating coordinator
needs their names, not torch's two seconds and 150 MB."""

#: The emulation's sandbox ranks, comma-separated (``prism.rank.devicepath``).
SANDBOX_ENV = "PRISM_SANDBOX_RANKS"
#: "1": a GPU sandbox keeps calls answered by virtual ranks only on its device.
GPU_SANDBOX_ENV = "PRISM_GPU_SANDBOX"
#: Comma-separated physical GPUs shared by the run (``prism.rank.devices``).
GPUS_ENV = "PRISM_GPUS"
#: A diagnostic: the device path's call log (``prism.rank.devicepath``), a path
#: with ``{rank}``; the emulating coordinator writes its side of each call's
#: round trip beside it, as rank ``coord``.
CALL_LOG_ENV = "PRISM_DEVICE_CALL_LOG"
#: The capture's payload records for any rank (``RUN/payloads/rank-{rank:06d}.jsonl``),
#: whose recorded outputs a device-path sandbox delivers from its prefetch
#: pool (``prism.rank.devicepath.RecordedFeed``).
RECORDING_ENV = "PRISM_DEVICE_RECORDING"
#: That prefetch pool's size in bytes (``prism emulate --prefetch-pool MIB``).
POOL_ENV = "PRISM_PREFETCH_POOL_BYTES"
#: A sandbox's Python thread switch interval in microseconds
#: (``sys.setswitchinterval``; unset: Python's 5,000). A GPU sandbox's
#: reach watcher and transport thread need the GIL to report a reach and to
#: flip a release; while the main thread issues work they wait up to one
#: interval for it, and a release due sooner than that arrives late.
SWITCH_INTERVAL_ENV = "PRISM_SWITCH_INTERVAL_US"
#: The ranks one node's agent runs, as "8-15" (``prism agent``): a rank's GPU
#: among ``PRISM_GPUS`` (that node's) is chosen by its place among them.
NODE_RANKS_ENV = "PRISM_NODE_RANKS"
#: A diagnostic: a directory where each rank started by the fork server
#: writes ``rank-N.prof``, a ``cProfile`` of its main thread, as it ends
#: (``python -m pstats`` reads it).
PROFILE_RANK_ENV = "PRISM_PROFILE_RANK"
#: ``prism emulate --pruned``: a folder the sandbox ranks share; an
#: all_reduce, all_gather_into_tensor or reduce_scatter_tensor among two or
#: more of them runs among them for real (gloo), its communicator set up
#: through a file store there (``prism.rank.pruned``).
PRUNED_ENV = "PRISM_PRUNED_DIR"
#: "1": the emulation has recordings, so a pruned call sends its inputs'
#: digests for the coordinator to check (``CollectiveArrive.in_digests``).
PRUNED_DIGESTS_ENV = "PRISM_PRUNED_DIGESTS"
#: A warm fork server's socket (``python -m prism.rank.forkserver --zygote
#: PATH``): a launch forks its fork server from it instead of starting a
#: fresh interpreter that imports torch again (the test suite sets it; see
#: ``prism.rank.forkserver.zygote``).
ZYGOTE_ENV = "PRISM_FORKSERVER_ZYGOTE"
#: Environment variables a launch may set differently from the zygote's own
#: (read at run time, not when torch and Prism were imported); a launch whose
#: environment differs elsewhere gets a fresh fork server.
ZYGOTE_FREE_PREFIXES = ("PRISM_", "PYTEST_")
#: "1" (opt-in): a GPU sandbox's device-path call sends its arrival at its
#: reach with it (protocol 12; ``prism.rank.devicepath.arrive_at_reach``), not
#: at its issue with a ``Reached`` after (the default, as in protocols 5-11).
#: ``prism emulate`` sets "0" for the sandboxes where early releases are asked
#: for (``PRISM_EARLY_RELEASE=1``).
ARRIVE_AT_REACH_ENV = "PRISM_DEVICE_ARRIVE_AT_REACH"
