"""PrismTrace v1: the records of a captured run (sans-IO).

Specified in ``docs/TRACE.md``. ``records`` holds the event types, the
manifest and the group identity; ``codec`` turns records into JSON lines and
back and parses a rank file's bytes; ``validator`` checks a run's records.
This package re-exports all three, so ``from prism.core import trace as T``
gives ``T.Compute``, ``T.decode_event`` and ``T.validate_run``. Reading and
writing run directories is the shell's: ``prism.shell.runfolder``.
"""

from prism.core.trace.codec import (
    TraceFormatError,
    TraceVersionError,
    UnknownKindError,
    decode_event,
    decode_manifest,
    encode_event,
    encode_manifest,
    parse_rank_file,
)
from prism.core.trace.records import (
    COLLECTIVE_OPS,
    DEFAULT_SMALL_TENSOR_LIMIT,
    DTYPE_ITEMSIZE,
    EVENT_TYPES,
    P2P,
    P2P_OPS,
    REDUCE_OPS,
    REDUCING_OPS,
    ROOTED_OPS,
    TRACE_VERSION,
    TRACE_VERSION_MINOR,
    Collective,
    Compute,
    Event,
    GroupCreated,
    Iteration,
    Manifest,
    Memory,
    Payload,
    RankEnd,
    RankStart,
    RankTrace,
    Run,
    TensorValue,
    TraceWarning,
    group_id,
)
from prism.core.trace.validator import Problem, validate_run

__all__ = [
    "COLLECTIVE_OPS",
    "DEFAULT_SMALL_TENSOR_LIMIT",
    "DTYPE_ITEMSIZE",
    "EVENT_TYPES",
    "P2P",
    "P2P_OPS",
    "REDUCE_OPS",
    "REDUCING_OPS",
    "ROOTED_OPS",
    "TRACE_VERSION",
    "TRACE_VERSION_MINOR",
    "Collective",
    "Compute",
    "Event",
    "GroupCreated",
    "Iteration",
    "Manifest",
    "Memory",
    "Payload",
    "Problem",
    "RankEnd",
    "RankStart",
    "RankTrace",
    "Run",
    "TensorValue",
    "TraceFormatError",
    "TraceVersionError",
    "TraceWarning",
    "UnknownKindError",
    "decode_event",
    "decode_manifest",
    "encode_event",
    "encode_manifest",
    "group_id",
    "parse_rank_file",
    "validate_run",
]
