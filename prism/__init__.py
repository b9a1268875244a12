"""Prism: emulate large-scale distributed LLM training on a few GPUs (or CPUs).

Prism runs a user's *unmodified* ``torch.distributed`` training script as a
world of N logical ranks on far fewer devices, records its global execution
graph (phase 1) and then emulates the full-scale job with a few real "sandbox"
ranks and thousands of replayed "virtual" ranks (phase 2), so that iteration
time, peak memory and failures match what the full-scale job would show.
``docs/DESIGN.md`` explains the method, the vocabulary, the compensation
policy, the validation and the phase-2 plan.

Architecture
============

The code is layered like h11 and trio: a **sans-IO core** holds the logic;
thin **shells** around it own sockets, processes, clocks, files and devices.

``prism.core`` (sans-IO: no trio, zmq or torch, no clock, no file I/O)
    ``codec``        one reflective codec between frozen dataclasses and
                     JSON-able dicts, shared by the trace and the protocol.
    ``trace``        PrismTrace (``docs/TRACE.md``): ``records`` (event
                     dataclasses, Manifest, group ids), ``codec`` (lines <->
                     events, parsing a rank file's bytes), ``validator``.
    ``protocol``     wire messages between a rank and the coordinator
                     (``docs/PROTOCOL.md``).
    ``collectives``  what every collective computes, in gloo's reduction order.
    ``hybrid``       the hybrid replay: sandbox ranks' calls fed in as they
                     happen, virtual ranks stepped from the graph (phase 2).
    ``compensation`` what virtual ranks contribute where nothing recorded it,
                     folded into one input (phase 2).
    ``steps``        the steps every rank of a failed or killed run completed.
    ``matcher``      pairs participations and sends/receives across ranks;
                     mismatches, dead peers, deadlock reports.
    ``scheduler``    the slot scheduler and the complete ``SwapPolicy``
                     protocol.
    ``residency``    the GPU residency policy: swap, wake and rescue rules.
    ``graph``        the global execution graph (numpy columns), load checks.
    ``replay``       discrete-event replay: a steppable engine paced by
                     ``now`` and a vectorised batch path with one semantics.
    ``align``        sequence alignment of segment signatures.
    ``costmodel``    alpha-beta communication cost model; parses profiles.
    ``netfit``       fits the cost model to measured times (``prism netprofile``).
    ``scaleout``     grows a capture to a larger data-parallel degree.
    ``synthetic``    synthetic Megatron-style runs for tests and benchmarks.
    ``timeline``     Chrome-trace (Perfetto) timelines of a replay.
    Time enters the core as an argument (``now``, integer nanoseconds); bytes
    enter as arguments too. A test forbids the imports and ``open()``,
    ``os.makedirs`` and pathlib writes.

``prism.shell`` (the I/O around the core)
    ``coordinator``  the trio coordinator: typed events, a dispatch table,
                     participants (real rank sessions; virtual ranks in
                     phase 2), the clock from trio.
    ``runfolder``    the one place that knows every path under a run
                     directory: trace writer and reader, manifest, telemetry
                     and log paths.
    ``profiles``     cost profile files: the bundled ones and user TOML files.
    ``launcher``     starts the fork server and the rank processes.
    ``gpu_plan``     which GPUs, how many resident ranks, which gangs.
    ``swap``         the GPU checkpoint executor.
    ``telemetry``    NVML sampling.
    ``chakra``, ``plot``  exporters (Chakra ET, Gantt plots).

``prism.rank`` (inside each logical rank process)
    The ``prism`` torch.distributed backend, the runtime (slots, completion
    thread), the trace recorder, the fork server, the bootstrap that forces
    the backend without touching the script, logical devices, GPU timing.

``prism.app`` (the library API)
    ``capture``, ``predict``, ``report``, ``netprofile``, ``trace``,
    ``emulate``, ``calibrate``: functions that take a config object and
    return a result object. They never print.

``prism.cli``
    ``python -m prism ...``: parses arguments, calls ``prism.app``, prints
    the results.

``prism.validation``
    What tests and benchmarks share to check fidelity against ground truth
    (kept captures and their truths).

``prism.testing``
    The test harness (pytest-trio): the real coordinator on an in-memory
    ROUTER, scripted fake ranks, trace assertions, injected faults, and a
    pytest plugin (``prism.testing.pytest_plugin``).

``prism.workloads``
    The bundled training scripts (they never import prism).

``transport`` (top-level package)
    ZeroMQ messaging: an async socket for trio, a blocking client for rank
    processes, an in-memory pair and router for tests, and the endpoint policy (ipc or
    loopback unless authenticated).

``cuda_ext`` (top-level package)
    The CUDA extension of phase 2: prefetch pools, stream-ordered release,
    compensation kernels, with a pure-torch fallback.

Dependency rules
================

- ``prism.core`` imports nothing of prism outside the core.
- ``prism.shell`` and ``prism.rank`` import the core (and ``transport``).
- ``prism.app`` imports the core and the shell.
- ``prism.testing`` imports the core and the shell.
- ``prism.cli`` imports ``prism.app`` only (and core types, to format
  results); nothing imports it except ``prism/__main__.py`` and the
  ``prism`` console script.

Vocabulary (defined in ``docs/DESIGN.md``; used with these meanings everywhere)
===============================================================================

logical rank
    A rank of the emulated world, ``0 .. world_size-1``.
slot
    Room for one rank to run at a time. On CPU, ``--slots K`` bounds how many
    ranks compute at once in total (default: the number of cores); on GPUs,
    how many compute at once (default: one per GPU), while ``--resident``
    says how many keep their state on each GPU.
gang
    Ranks scheduled together so their dense collectives (a TP group; a whole
    pipeline when it fits) complete without swaps.
sandbox rank
    A rank that runs the real program in phase 2.
virtual rank
    A rank that replays the graph: an object in the coordinator. *Live*
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
iteration time
    The time from the end of the job's step k-1 to the end of its step k; the
    job's step ends when the last rank's optimizer step returns.
noise floor
    The ground truth's run-to-run coefficient of variation, reported beside
    every error.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
