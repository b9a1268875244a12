"""Release flags in a shared-memory file: the coordinator releases a GPU
sandbox's device-path call by writing the flag the GPU waits on, with no
message to the rank and no Python thread of the rank on the way.

The rank (``cuda_ext.ReleaseFlags(shared=PATH)``) creates the file, maps it
and registers it with CUDA (``cudaHostRegister``), so the wait kernel reads
its flags and deadlines where it read pinned memory before; it tells the
coordinator the path (``protocol.ReleaseShared``) and, per call, the slot
and value it waits on (``CollectiveArrive.release_slot``). The coordinator
maps the same file (``SharedRelease.open``) and, as a result goes out, writes
that call's deadline and tail, then its flag (``release``). The rank still
gets the result message and flips the flag itself as before (the same value:
whichever comes first releases the GPU). Once the coordinator has mapped the
file it unlinks it: both mappings stay, and no file is left behind however
the rank ends.

Layout (little-endian, native alignment; ``layout``): a header of eight
int64 (magic, version, slots, the wait clock's offset from the rank's
monotonic clock, the rank's dilation), then ``slots`` int32 flags, then two
int64 per slot (deadline on the wait's clock, tail in ns). The rank writes
the header's offset once it is measured and its dilation whenever it moves
(the coordinator's release times are on the rank's dilated clock). Stores
are ordered (x86-64's TSO; the rank's own flip writes in the same order).

Torch-free (numpy and mmap): the coordinator imports it.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np

MAGIC = 0x50524953_4D52454C  # "PRISMREL"
VERSION = 1
HEADER_WORDS = 8
#: header word indexes
H_MAGIC, H_VERSION, H_SLOTS, H_OFFSET, H_DILATION = range(5)


@dataclass(frozen=True)
class Layout:
    slots: int
    flags_at: int
    deadlines_at: int
    nbytes: int


def layout(slots: int) -> Layout:
    if slots <= 0:
        raise ValueError(f"shared release flags: slots must be positive, got {slots}")
    flags_at = HEADER_WORDS * 8
    deadlines_at = flags_at + 4 * slots
    deadlines_at += -deadlines_at % 8
    nbytes = deadlines_at + 16 * slots
    nbytes += -nbytes % mmap.PAGESIZE  # whole pages (cudaHostRegister maps pages)
    return Layout(slots, flags_at, deadlines_at, nbytes)


class SharedRelease:
    """The mapped file: ``header`` (int64), ``flags`` (int32), ``deadlines``
    (int64, two per slot), numpy views of the one mapping."""

    def __init__(self, path: str, mm: mmap.mmap, lay: Layout) -> None:
        self.path = path
        self._mm = mm
        self.layout = lay
        self.header = np.frombuffer(mm, dtype=np.int64, count=HEADER_WORDS, offset=0)
        self.flags = np.frombuffer(mm, dtype=np.int32, count=lay.slots, offset=lay.flags_at)
        self.deadlines = np.frombuffer(mm, dtype=np.int64, count=2 * lay.slots, offset=lay.deadlines_at)

    @classmethod
    def create(cls, path: str, slots: int) -> SharedRelease:
        """The rank's side: a new zeroed file of ``slots`` flags at ``path`` (replaced if it exists)."""
        lay = layout(slots)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, lay.nbytes)
            mm = mmap.mmap(fd, lay.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        s = cls(path, mm, lay)
        s.header[H_SLOTS] = slots
        s.header[H_VERSION] = VERSION
        s.header[H_MAGIC] = MAGIC
        return s

    @classmethod
    def open(cls, path: str, slots: int | None = None) -> SharedRelease:
        """The coordinator's side: map a file a rank created. A file that is
        not one (wrong magic, version or size) is refused by name."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ValueError(f"shared release flags {path}: cannot open ({e.strerror})") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_WORDS * 8:
                raise ValueError(f"shared release flags {path}: {size} bytes, not a flags file")
            head = np.frombuffer(os.pread(fd, HEADER_WORDS * 8, 0), dtype=np.int64)
            if int(head[H_MAGIC]) != MAGIC or int(head[H_VERSION]) != VERSION:
                raise ValueError(f"shared release flags {path}: not a Prism flags file of version {VERSION}")
            n = int(head[H_SLOTS])
            if slots is not None and n != slots:
                raise ValueError(f"shared release flags {path}: {n} slots, the rank said {slots}")
            lay = layout(n)
            if size < lay.nbytes:
                raise ValueError(f"shared release flags {path}: {size} bytes, {n} slots need {lay.nbytes}")
            mm = mmap.mmap(fd, lay.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, mm, lay)

    def release(self, slot: int, value: int, at_rank_ns: int = 0, tail_ns: int = 0) -> None:
        """Release the wait on ``slot`` up to ``value``: it ends at ``max(at, its
        reach + tail_ns)``; ``at_rank_ns`` on the rank's dilated clock (0: at once),
        converted here with the header's dilation and clock offset. The
        deadline goes first, then the flag."""
        if not 0 <= slot < self.layout.slots:
            raise ValueError(f"shared release flags {self.path}: slot {slot} out of 0..{self.layout.slots - 1}")
        if at_rank_ns:
            mono = int(at_rank_ns) + int(self.header[H_DILATION])
            self.deadlines[2 * slot] = mono - int(self.header[H_OFFSET])
        else:
            self.deadlines[2 * slot] = 0
        self.deadlines[2 * slot + 1] = max(0, int(tail_ns))
        if int(self.flags[slot]) < value:
            self.flags[slot] = value

    def close(self) -> None:
        del self.header, self.flags, self.deadlines
        try:
            self._mm.close()
        except BufferError:  # a view still held (a tensor over it): the mapping goes with the process
            pass
