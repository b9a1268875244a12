"""Prism: emulate large-scale distributed LLM training on a few GPUs (or CPUs).

Prism runs a user's *unmodified* ``torch.distributed`` training script as a
world of N logical ranks on far fewer devices, records its global execution
graph (phase 1) and then emulates the full-scale job with a few real "sandbox"
ranks and thousands of replayed "virtual" ranks (phase 2), so that iteration
time, peak memory and failures match what the full-scale job would show.

Architecture
============

The code is layered like h11 and trio: a **sans-IO core** that does no I/O,
reads no clock and imports neither trio, zmq nor torch, wrapped by thin
**shells** that own sockets, processes, clocks and devices.

``prism.core`` (sans-IO; ``tests/test_core_is_sans_io.py`` keeps it so)
    ``trace``        PrismTrace v1: event dataclasses, codec, streaming
                     writer, reader, validator (``docs/TRACE.md``).
    ``protocol``     wire messages between a rank and the coordinator, the
                     frame codec, the version handshake (``docs/PROTOCOL.md``).
    ``collectives``  what every collective computes, in gloo's reduction order.
    ``matcher``      pairs collective instances and sends/receives across
                     ranks; mismatches, dead peers, deadlock reports.
    ``scheduler``    the slot scheduler state machine with a pluggable swap
                     policy.
    ``graph``        the global execution graph (numpy arrays), load checks.
    ``replay``       discrete-event replay: a steppable engine paced by
                     ``now`` and a vectorised batch path with one semantics.
    ``costmodel``    alpha-beta communication cost model, TOML profiles.
    ``timeline``     Chrome-trace (Perfetto) timelines of a replay.
    Time enters the core as an argument (``now``, integer nanoseconds).

Shells
    ``prism.shell.coordinator``  the trio coordinator: one event loop owns the
                           matcher, the scheduler and the trace writers.
    ``prism.rank``         inside each logical rank: the ``prism``
                           torch.distributed backend, the runtime (slots,
                           completion thread), the fork server, the bootstrap
                           that forces the backend without touching the script.
    ``prism.shell.launcher``     starts the fork server and the ranks.
    ``prism.cli`` and ``*_cli``  ``python -m prism ...``; commands not built
                           yet say which issue brings them.
    ``prism.workloads``    the bundled training scripts (they never import prism).

``transport`` (top-level package)
    ZeroMQ messaging: an async socket for trio, a blocking client for rank
    processes, an in-memory pair for tests, and the endpoint policy (ipc or
    loopback unless authenticated).

``cuda_ext`` (top-level package)
    The CUDA extension (pruning, compensation, prefetch buffer pools): phase 2.

Vocabulary (from ``DESIGN.md``; used with these meanings everywhere)
====================================================================

logical rank
    A rank of the emulated world, ``0 .. world_size-1``.
slot
    Room for one rank to run at a time. On CPU, ``--slots K`` bounds how many
    ranks compute at once in total (default: the number of cores); on GPUs,
    how many ranks may be resident on each GPU at once.
gang
    Ranks scheduled together so their dense collectives (a TP group; a whole
    pipeline when it fits) complete without swaps.
sandbox rank
    A rank that runs the real program in phase 2.
virtual rank
    A rank that replays the graph: a coroutine in the coordinator. *Live*
    virtual ranks share a group with a sandbox rank and are paced in real
    time; all others are *dormant* and resolved offline from the graph.
group
    A communicator: an ordered set of logical ranks, identified across ranks by
    a stable id derived from its members and its creation order.
collective instance
    One collective call on one group, identified by ``(group id, per-group
    sequence number)``; each member's call is one *participation*.
slice
    A subset of ranks that runs for real, without swapping, during timing
    calibration while all other ranks are replayed.
scheduling unit
    What a rank does between two communication calls (a compute segment).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
