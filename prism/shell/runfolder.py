"""The run directory: the one place that knows every path under a run, and its file I/O.

Layout (``docs/TRACE.md``, "Run directory")::

    RUN/manifest.json              the Manifest, written once, atomically
    RUN/ranks/rank-000012.jsonl    one append-only record file per rank
    RUN/logs/rank-000012.log       the rank's stdout and stderr (the fork server)
    RUN/telemetry/gpu.jsonl        NVML samples (prism.shell.telemetry)
    RUN/telemetry/swaps.jsonl      one line per GPU swap (prism.shell.swap)
    RUN/telemetry/swaps.json       the swap report (prism.shell.swap)
    RUN/payloads/rank-000012.jsonl a recorded rank's payload records (--record, PrismTrace 1.3)
    RUN/payloads/rank-000012.bin   the bytes it received, addressed by those records
    RUN/payloads/summary.json      what --record kept (ranks, steps, bytes, why it stopped)
    RUN/calibration/NAME/          a slice calibration: durations.npz, manifest.json (prism.app.calibrate)
    RUN/predictions/, RUN/emulation/   reserved for later stages

(The coordinator's ipc socket, ``RUN/prism.sock`` while it runs, is the
transport's: ``transport.endpoints.default_endpoint`` names it.)

The records' encoding and the parsing of a rank file's bytes are the core's
(``prism.core.trace``); this module moves the bytes: ``make_run_dir``,
``write_manifest``, ``read_manifest``, the streaming ``TraceWriter``,
``read_rank_file``, ``read_run`` and ``write_run``; for recorded payloads
``PayloadWriter``, ``read_payloads`` and ``load_payload`` (digest-checked).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from prism.core.payloads import digest
from prism.core.trace import (
    TRACE_VERSION,
    TRACE_VERSION_MINOR,
    Event,
    Manifest,
    RankStart,
    RankTrace,
    Run,
    TraceFormatError,
    TraceWarning,
    decode_manifest,
    encode_event,
    encode_manifest,
    parse_rank_file,
)

__all__ = [
    "CALIBRATION_DIR",
    "EMULATION_DIR",
    "GPU_SAMPLES_NAME",
    "LOGS_DIR",
    "MANIFEST_NAME",
    "PREDICTIONS_DIR",
    "RANKS_DIR",
    "RUN_SUBDIRS",
    "SWAP_LOG_NAME",
    "SWAP_REPORT_NAME",
    "TELEMETRY_DIR",
    "TraceWriter",
    "calibration_path",
    "gpu_samples_path",
    "in_memory_run",
    "log_path",
    "log_path_pattern",
    "load_payload",
    "payload_data_name",
    "payload_index_path",
    "payload_summary_path",
    "PayloadWriter",
    "read_payloads",
    "read_payload_summary",
    "write_payload_summary",
    "make_run_dir",
    "manifest_path",
    "rank_of_path",
    "rank_path",
    "read_manifest",
    "read_rank_file",
    "read_run",
    "swap_log_path",
    "swap_report_path",
    "write_manifest",
    "write_run",
]

PathLike = str | os.PathLike[str]

#: ``RUN/manifest.json``: the Manifest, written once, atomically.
MANIFEST_NAME = "manifest.json"
#: ``RUN/ranks/rank-000012.jsonl``: one append-only record file per rank.
RANKS_DIR = "ranks"
#: ``RUN/logs/rank-000012.log``: the rank's stdout and stderr (the launcher).
LOGS_DIR = "logs"
#: Reserved for later stages (see docs/TRACE.md, "Run directory").
CALIBRATION_DIR = "calibration"
PREDICTIONS_DIR = "predictions"
EMULATION_DIR = "emulation"
#: ``RUN/telemetry/``: what the shells measure beside the trace.
TELEMETRY_DIR = "telemetry"
RUN_SUBDIRS = (RANKS_DIR, LOGS_DIR, CALIBRATION_DIR, PREDICTIONS_DIR, EMULATION_DIR, TELEMETRY_DIR)
#: ``RUN/payloads/`` (PrismTrace 1.3, ``--record``): per recorded rank, its
#: payload records (``rank-NNNNNN.jsonl``) and the received bytes they
#: address (``rank-NNNNNN.bin``), and ``summary.json``. Made only when recording.
PAYLOADS_DIR = "payloads"
PAYLOAD_SUMMARY_NAME = "summary.json"
#: ``RUN/telemetry/gpu.jsonl``: one NVML sample per GPU and interval.
GPU_SAMPLES_NAME = "gpu.jsonl"
#: ``RUN/telemetry/swaps.jsonl``: one line per GPU swap, as it happens.
SWAP_LOG_NAME = "swaps.jsonl"
#: ``RUN/telemetry/swaps.json``: the swap summary, settings and every swap.
SWAP_REPORT_NAME = "swaps.json"

_RANK_FILE = re.compile(r"rank-(\d+)\.jsonl")
# Six digits at least, wider past 999999; one spelling shared by rank files
# and logs so a rank's two files sort alike.
_RANK_FILE_NAME = "rank-{rank:06d}.jsonl"
_LOG_NAME = "rank-{rank:06d}.log"
_PAYLOAD_NAME = "rank-{rank:06d}.bin"


def manifest_path(run_dir: PathLike) -> Path:
    """``RUN/manifest.json``."""
    return Path(run_dir) / MANIFEST_NAME


def calibration_path(run_dir: PathLike, name: str | None) -> Path:
    """``RUN/calibration/NAME/`` (a stored slice calibration), or ``RUN/calibration/`` for None."""
    base = Path(run_dir) / CALIBRATION_DIR
    return base if name is None else base / name


def rank_path(run_dir: PathLike, rank: int) -> Path:
    """``RUN/ranks/rank-000012.jsonl`` (six digits at least, wider past 999999)."""
    return Path(run_dir) / RANKS_DIR / _RANK_FILE_NAME.format(rank=rank)


def log_path(run_dir: PathLike, rank: int) -> Path:
    """``RUN/logs/rank-000012.log``: where the launcher puts the rank's output."""
    return Path(run_dir) / LOGS_DIR / _LOG_NAME.format(rank=rank)


def log_path_pattern(run_dir: PathLike) -> str:
    """``log_path`` as a ``str.format`` pattern with a ``{rank}`` field, for
    the fork server (which, on the rank side, imports no shell)."""
    return str(Path(run_dir) / LOGS_DIR / _LOG_NAME)


def gpu_samples_path(run_dir: PathLike) -> Path:
    """``RUN/telemetry/gpu.jsonl``."""
    return Path(run_dir) / TELEMETRY_DIR / GPU_SAMPLES_NAME


def swap_log_path(run_dir: PathLike) -> Path:
    """``RUN/telemetry/swaps.jsonl``."""
    return Path(run_dir) / TELEMETRY_DIR / SWAP_LOG_NAME


def swap_report_path(run_dir: PathLike) -> Path:
    """``RUN/telemetry/swaps.json``."""
    return Path(run_dir) / TELEMETRY_DIR / SWAP_REPORT_NAME


def payload_index_path(run_dir: PathLike, rank: int) -> Path:
    """``RUN/payloads/rank-000012.jsonl``: a recorded rank's payload records."""
    return Path(run_dir) / PAYLOADS_DIR / _RANK_FILE_NAME.format(rank=rank)


def payload_index_template(run_dir: PathLike) -> str:
    """``payload_index_path`` for any rank: ``RUN/payloads/rank-{rank:06d}.jsonl``
    (``str.format(rank=N)`` gives rank N's; for processes that do not import the shell)."""
    return str(Path(run_dir) / PAYLOADS_DIR / _RANK_FILE_NAME)


def payload_data_name(rank: int) -> str:
    """``payloads/rank-000012.bin``, relative to the run directory, as payload records name it."""
    return f"{PAYLOADS_DIR}/{_PAYLOAD_NAME.format(rank=rank)}"


def payload_summary_path(run_dir: PathLike) -> Path:
    """``RUN/payloads/summary.json``: what ``--record`` kept."""
    return Path(run_dir) / PAYLOADS_DIR / PAYLOAD_SUMMARY_NAME


def rank_of_path(path: PathLike) -> int | None:
    """The rank a rank file's name encodes, or None if it is not a rank file."""
    name = Path(path).name
    m = _RANK_FILE.fullmatch(name)
    # Only the canonical spelling, so two names cannot claim one rank.
    if m is None or name != rank_path("", int(m.group(1))).name:
        return None
    return int(m.group(1))


def make_run_dir(run_dir: PathLike) -> Path:
    """Create ``run_dir`` and all its subdirectories (existing ones are kept)."""
    root = Path(run_dir)
    for sub in RUN_SUBDIRS:
        (root / sub).mkdir(parents=True, exist_ok=True)
    return root


def write_manifest(run_dir: PathLike, manifest: Manifest) -> Path:
    """Create the run directory's layout and write ``manifest.json`` atomically.

    The manifest goes to a temporary file that is then renamed over the final
    name, so a reader sees either no manifest or a whole one.
    """
    make_run_dir(run_dir)
    path = manifest_path(run_dir)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(encode_manifest(manifest))
    os.replace(tmp, path)
    return path


def read_manifest(run_dir: PathLike) -> Manifest:
    """The run's manifest. Raises ``TraceFormatError`` (``TraceVersionError``
    for an unknown major version) when it is missing or invalid."""
    root = Path(run_dir)
    mpath = manifest_path(root)
    try:
        raw = mpath.read_bytes()
    except FileNotFoundError:
        raise TraceFormatError(
            f"{mpath} not found: {root} is not a Prism run directory, or the capture stopped before writing it"
        ) from None
    return decode_manifest(raw, file=str(mpath))


class TraceWriter:
    """Appends one rank's records to ``RUN/ranks/rank-NNNNNN.jsonl``.

    Lines are buffered in memory and handed to the OS in one ``write`` every
    ``flush_every`` records, on ``flush()`` and on ``close()``; the file is
    unbuffered underneath, so after a crash of the process at any point the
    file holds whole lines followed by at most one torn line, which readers
    report and skip. (``flush`` does not fsync: a power loss may lose more.)
    Shells should ``flush()`` before a rank blocks, so a hang or kill loses
    nothing that happened before it.
    """

    def __init__(self, run_dir: PathLike, rank: int, *, flush_every: int = 64, path: PathLike | None = None) -> None:
        if flush_every < 1:
            raise ValueError(f"TraceWriter: flush_every must be >= 1, got {flush_every}")
        #: ``rank_path`` unless ``path`` puts the records elsewhere (payload files).
        self.path = Path(path) if path is not None else rank_path(run_dir, rank)
        self.rank = rank
        self._flush_every = flush_every
        self._lines: list[bytes] = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (closed by close())
        try:
            self._refuse_torn_tail()
        except BaseException:
            self._file.close()
            raise

    def _refuse_torn_tail(self) -> None:
        size = os.fstat(self._file.fileno()).st_size
        if size == 0:
            return
        with open(self.path, "rb") as f:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                raise TraceFormatError(
                    f"{self.path} ends with a torn line (an earlier writer crashed); appending would "
                    "bury the damage in the middle of the file. Capture into a fresh run directory."
                )

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run."""
        return self._file.closed

    def write(self, ev: Event) -> None:
        """Queue one record; it reaches the file by the next flush."""
        if self._file.closed:
            raise ValueError(f"TraceWriter for rank {self.rank} ({self.path}) is closed")
        self._lines.append(encode_event(ev) + b"\n")
        if len(self._lines) >= self._flush_every:
            self.flush()

    def write_line(self, line: bytes) -> None:
        """Queue one record already encoded by ``encode_event`` (as a rank
        ships them to the coordinator); it must be a single line."""
        if self._file.closed:
            raise ValueError(f"TraceWriter for rank {self.rank} ({self.path}) is closed")
        if b"\n" in line or not line.startswith(b'{"k":'):
            raise TraceFormatError(
                f"rank {self.rank} sent a trace record that is not one encoded line: {line[:80]!r}; "
                "this is a Prism bug, please report it"
            )
        self._lines.append(line + b"\n")
        if len(self._lines) >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        """Hand every queued line to the OS (survives a crash of this process)."""
        if not self._lines or self._file.closed:
            return
        view = memoryview(b"".join(self._lines))
        self._lines.clear()
        # An unbuffered file may write less than asked (rare on regular files).
        while view:
            n = self._file.write(view)
            view = view[n:]

    def close(self) -> None:
        """Flush and close; closing twice is harmless."""
        if self._file.closed:
            return
        try:
            self.flush()
        finally:
            self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PayloadWriter:
    """Appends a recorded rank's payloads: the records to
    ``payloads/rank-NNNNNN.jsonl`` (a ``TraceWriter`` underneath, with its
    crash guarantees) and the received bytes to ``payloads/rank-NNNNNN.bin``,
    data first, so a record never addresses bytes the file lacks."""

    def __init__(self, run_dir: PathLike, rank: int) -> None:
        root = Path(run_dir)
        (root / PAYLOADS_DIR).mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.data_path = root / payload_data_name(rank)
        self._data = open(self.data_path, "ab", buffering=0)  # noqa: SIM115 (closed by close())
        self._records = TraceWriter(root, rank, path=payload_index_path(root, rank))

    def sent(self, records: Iterable[Event]) -> None:
        for rec in records:
            self._records.write(rec)

    def received(self, pairs: Iterable[tuple[Event, memoryview]]) -> None:
        for rec, data in pairs:
            if self._data.tell() != rec.offset:
                raise ValueError(f"payload record of rank {self.rank} at offset {rec.offset} but "
                                 f"{self.data_path} holds {self._data.tell()} bytes; this is a Prism bug")
            view = memoryview(data)
            while view:
                n = self._data.write(view)
                view = view[n:]
            self._records.write(rec)

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        try:
            self._records.close()
        finally:
            self._data.close()


def write_payload_summary(run_dir: PathLike, summary: Mapping) -> Path:
    """``payloads/summary.json``, written atomically."""
    import orjson

    path = payload_summary_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")
    os.replace(tmp, path)
    return path


def read_payload_summary(run_dir: PathLike) -> dict | None:
    """``payloads/summary.json`` (None: the capture recorded nothing)."""
    import orjson

    path = payload_summary_path(run_dir)
    try:
        return orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except orjson.JSONDecodeError as e:
        raise TraceFormatError(f"{path} is not valid JSON ({e}); the capture was stopped while writing it") from None


def read_payloads(run_dir: PathLike) -> tuple[dict[int, list[Event]], list[TraceWarning]]:
    """Every recorded rank's payload records (``payloads/rank-*.jsonl``), and
    the damage found (a torn record, a record addressing bytes past the end of
    its data file): reading stops there, as for rank files."""
    root = Path(run_dir)
    pdir = root / PAYLOADS_DIR
    out: dict[int, list[Event]] = {}
    warnings: list[TraceWarning] = []
    for f in sorted(pdir.glob("rank-*.jsonl")) if pdir.is_dir() else []:
        rank = rank_of_path(f)
        if rank is None:
            continue
        events, lines, warns = parse_rank_file(f.read_bytes(), str(f), expect_end=False)
        warnings.extend(warns)
        data = root / payload_data_name(rank)
        size = data.stat().st_size if data.exists() else 0
        kept = []
        for ev, line in zip(events, lines):
            if ev.KIND != "payload":
                warnings.append(TraceWarning(str(f), line, f"a {ev.KIND} record in a payload file; ignored"))
                continue
            if ev.role == "recv" and ev.offset + ev.nbytes > size:
                warnings.append(TraceWarning(str(f), line, f"{ev.ref} addresses bytes {ev.offset}-"
                                             f"{ev.offset + ev.nbytes} of {data}, which holds {size}: the data "
                                             "file is truncated; the records from here on were not read"))
                break
            kept.append(ev)
        out[rank] = kept
    return out, warnings


def load_payload(run_dir: PathLike, record: Event) -> bytes:
    """The bytes a ``recv`` payload record addresses, checked against its digest.
    Raises ``TraceFormatError`` naming the file, the ref and what is wrong."""
    if record.role != "recv" or not record.file:
        raise ValueError(f"{record.ref}: a {record.role!r} payload record keeps only a digest, no bytes")
    path = Path(run_dir) / record.file
    try:
        with open(path, "rb") as f:
            f.seek(record.offset)
            data = f.read(record.nbytes)
    except FileNotFoundError:
        raise TraceFormatError(f"{path} not found: the payloads of {record.ref} are missing") from None
    if len(data) != record.nbytes:
        raise TraceFormatError(f"{path}: {record.ref} needs bytes {record.offset}-{record.offset + record.nbytes}, "
                               f"the file ends at {record.offset + len(data)} (truncated)")
    if digest(data) != record.digest:
        raise TraceFormatError(f"{path}: the bytes of {record.ref} (step {record.step}) at offset {record.offset} "
                               f"do not match their digest {record.digest}: the file was changed or damaged")
    return data


def read_rank_file(path: PathLike, *, ignore_unknown: bool = False,
                   minor: int = TRACE_VERSION_MINOR) -> RankTrace:
    """Read one rank file; damage is reported, never raised.

    ``prism.core.trace.parse_rank_file`` says what counts as damage (reading
    stops at the first bad line, with a warning naming the file and the
    line). The rank comes from the file name (``rank-NNNNNN.jsonl``), else
    from the first record if it is ``rank_start``. ``ignore_unknown`` (for a
    manifest with a newer minor version) skips unknown record kinds and
    fields instead of stopping.
    """
    p = Path(path)
    events, lines, warnings = parse_rank_file(p.read_bytes(), str(p), ignore_unknown=ignore_unknown, minor=minor)
    rank = rank_of_path(p)
    if rank is None:
        if events and type(events[0]) is RankStart:
            rank = events[0].rank
        else:
            raise ValueError(
                f"{p}: cannot tell which rank this file belongs to: name it rank-NNNNNN.jsonl "
                "or start it with a rank_start record"
            )
    return RankTrace(str(p), rank, events, lines, warnings)


def in_memory_run(run_dir: PathLike, manifest: Manifest, ranks: dict[int, list[Event]],
                  warnings: list[TraceWarning] | None = None,
                  lines: dict[int, list[int]] | None = None) -> Run:
    """A ``Run`` whose files are named as if it lay in ``run_dir`` (which is
    not read): the validator's messages then point where the files go."""
    root = Path(run_dir)
    return Run(
        str(root), manifest, ranks, warnings or [], lines or {},
        manifest_file=str(manifest_path(root)),
        rank_files={r: str(rank_path(root, r)) for r in sorted({*range(manifest.world_size), *ranks})},
    )


def read_run(run_dir: PathLike) -> Run:
    """Read a run directory: the manifest and every ``ranks/rank-*.jsonl``.

    Raises ``TraceFormatError`` (``TraceVersionError`` for an unknown major
    version) when the manifest is missing or invalid: without it nothing can
    be interpreted. Damage in rank files becomes warnings (``read_rank_file``).
    """
    root = Path(run_dir)
    manifest = read_manifest(root)
    newer = manifest.version_minor > TRACE_VERSION_MINOR
    warnings: list[TraceWarning] = []
    if newer:
        warnings.append(
            TraceWarning(
                str(manifest_path(root)),
                0,
                f"written by PrismTrace {manifest.version}.{manifest.version_minor}, this reader knows "
                f"{TRACE_VERSION}.{TRACE_VERSION_MINOR}: unknown fields and record kinds are ignored",
            )
        )
    ranks: dict[int, list[Event]] = {}
    lines: dict[int, list[int]] = {}
    rdir = root / RANKS_DIR
    files = sorted(rdir.iterdir()) if rdir.is_dir() else []
    for f in files:
        rank = rank_of_path(f)
        if rank is None:
            warnings.append(TraceWarning(str(f), 0, "not a rank file (expected rank-NNNNNN.jsonl); ignored"))
            continue
        rt = read_rank_file(f, ignore_unknown=newer, minor=manifest.version_minor)
        ranks[rank] = rt.events
        lines[rank] = rt.lines
        warnings.extend(rt.warnings)
    run = in_memory_run(root, manifest, dict(sorted(ranks.items())), warnings, dict(sorted(lines.items())))
    payloads, pwarnings = read_payloads(root)
    run.payloads.update(payloads)
    run.payload_files.update({r: str(payload_index_path(root, r)) for r in payloads})
    run.warnings.extend(pwarnings)
    return run


def write_run(run_dir: PathLike, manifest: Manifest, ranks: Mapping[int, Iterable[Event]]) -> Path:
    """Write a whole run at once (tests, converters): manifest and rank files."""
    root = write_manifest(run_dir, manifest).parent
    for rank, events in ranks.items():
        with TraceWriter(root, rank) as w:
            for ev in events:
                w.write(ev)
    return root
