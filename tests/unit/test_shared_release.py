"""Release flags in shared memory (``transport.shared_release``, protocol 11):
the rank's file and the coordinator's view of it agree on the layout; a
release written by another process (the coordinator) reaches the rank's
flags and deadlines, converted onto the wait's clock; a file that is not one
is refused by name; on a CPU the rank's wait sees a flag another process
wrote."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

import cuda_ext
from prism.core import protocol as P
from transport import shared_release as S

ROOT = Path(__file__).resolve().parents[2]


def test_the_coordinators_release_lands_in_the_ranks_flags_on_the_wait_clock(tmp_path):
    path = str(tmp_path / "flags")
    rank = S.SharedRelease.create(path, 8)
    rank.header[S.H_OFFSET] = 1_000  # the rank's monotonic clock less the wait's
    rank.header[S.H_DILATION] = 250  # the rank's clock lags the monotonic one by this much
    coord = S.SharedRelease.open(path, 8)
    coord.release(3, 2, at_rank_ns=10_000, tail_ns=77)
    assert int(rank.flags[3]) == 2 and [int(x) for x in rank.deadlines[6:8]] == [10_000 + 250 - 1_000, 77]
    coord.release(3, 1, at_rank_ns=0, tail_ns=-5)  # an older value never lowers the flag; no time: at once
    assert int(rank.flags[3]) == 2 and [int(x) for x in rank.deadlines[6:8]] == [0, 0]
    assert all(int(rank.flags[i]) == 0 for i in range(8) if i != 3)
    with pytest.raises(ValueError, match="slot 8 out of 0..7"):
        coord.release(8, 1)
    with pytest.raises(ValueError, match="8 slots, the rank said 16"):
        S.SharedRelease.open(path, 16)
    coord.close()
    rank.close()


def test_a_file_that_is_not_a_flags_file_is_refused_by_name(tmp_path):
    junk = tmp_path / "junk"
    junk.write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match=f"{junk}: not a Prism flags file"):
        S.SharedRelease.open(str(junk))
    with pytest.raises(ValueError, match="cannot open"):
        S.SharedRelease.open(str(tmp_path / "missing"))
    short = tmp_path / "short"
    short.write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="8 bytes, not a flags file"):
        S.SharedRelease.open(str(short))


def test_layout_is_whole_pages_with_aligned_deadlines():
    for slots in (1, 3, 4096):
        lay = S.layout(slots)
        assert lay.deadlines_at % 8 == 0 and lay.nbytes % 4096 == 0
        assert lay.deadlines_at >= lay.flags_at + 4 * slots and lay.nbytes >= lay.deadlines_at + 16 * slots
    with pytest.raises(ValueError):
        S.layout(0)


WRITER = """
import sys, time
from transport.shared_release import SharedRelease
s = SharedRelease.open(sys.argv[1])
time.sleep(0.2)
s.release(int(sys.argv[2]), int(sys.argv[3]), tail_ns=5)
"""


def test_a_cpu_wait_on_shared_flags_ends_when_another_process_writes_the_flag(tmp_path):
    # The rank's ReleaseFlags(shared=...) on a CPU (host mode): the wait blocks
    # this thread until the coordinator, another process, writes the flag.
    flags = cuda_ext.ReleaseFlags(4, "cpu", shared=str(tmp_path / "rel"))
    assert flags.shared is not None and flags.default_mode() == "host"
    flags.publish_dilation(123)
    assert int(flags.shared.header[S.H_DILATION]) == 123
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "rel"), "2", "1"], cwd=ROOT)
    t0 = time.monotonic()
    done = threading.Event()
    th = threading.Thread(target=lambda: (flags.wait(2, 1), done.set()), daemon=True)
    th.start()
    assert done.wait(20), "the wait did not end on the other process's write"
    assert proc.wait(20) == 0
    assert time.monotonic() - t0 >= 0.15  # it waited for the write, not past it
    assert int(flags.flags[2]) == 1 and int(flags.deadlines[5]) == 5
    assert isinstance(flags.flags, torch.Tensor) and flags.flags.dtype == torch.int32


def test_the_emulator_writes_a_shared_flag_as_the_result_goes_out(tmp_path):
    # The coordinator's side: after the rank's ReleaseShared, a device-path
    # collective that named its slot is released by writing the flag (on the
    # wait's clock) before its result message goes out, which still goes.
    from prism.shell.coordinator import Received
    from tests.support.emulator_harness import offline_emulator

    coord = offline_emulator(tmp_path, endpoint="ipc:///tmp/x")
    sent = coord._sock.sent
    rank = S.SharedRelease.create(str(tmp_path / "flags"), 16)
    rank.header[S.H_OFFSET], rank.header[S.H_DILATION] = 40, 7

    async def main():
        await coord._handle(Received(b"r0", P.Hello(P.PROTOCOL_VERSION, 0, 2, 0, 1, "h", "cpu", 10**15)))
        await coord._handle(Received(b"r0", P.ReleaseShared(0, str(tmp_path / "flags"), 16)))
        await coord._handle(Received(b"r1", P.ReleaseShared(0, str(tmp_path / "nope"), 16)))  # refused: logged
        assert list(coord._shared) == [0] and coord.stats.shared_release_ranks == [0]
        assert not (tmp_path / "flags").exists()  # mapped by both sides, then unlinked: none left behind
        coord._slots[(0, "g1", 4)] = (5, 2)  # as _on_coll keeps it for a call naming slot 5, value 2
        await coord._deliver(0, P.CollectiveResult("g1", 4, tail_ns=300), 5_000, 4_000)
        coord._close_traces()

    coord._anchor_s, coord._anchor_ns = 0.0, 10**15
    trio.run(main, clock=trio.testing.MockClock())
    off = coord.clock_offsets.get(0, 0)
    assert int(rank.flags[5]) == 2 and int(rank.deadlines[11]) == 300
    assert int(rank.deadlines[10]) == 5_000 - off + 7 - 40
    assert coord.stats.shared_releases == 1 and not coord._slots
    results = [m for ident, m in sent if isinstance(m, P.CollectiveResult)]
    assert [(m.gid, m.seq, m.tail_ns) for m in results] == [("g1", 4, 300)]


def test_a_collective_arrive_carries_its_slot_and_old_messages_default_to_none():
    m = P.CollectiveArrive(rank=0, gid="g", seq=1, op="all_reduce", reduce_op="SUM", dtype="float32",
                           in_shapes=((4,),), out_shapes=((4,),), on_device=True, release_slot=3, release_value=9)
    back = P.decode(P.encode(m))
    assert (back.release_slot, back.release_value) == (3, 9)
    plain = P.decode(P.encode(P.CollectiveArrive(rank=0, gid="g", seq=1, op="all_reduce", reduce_op="SUM",
                                                 dtype="float32", in_shapes=((4,),), out_shapes=((4,),))))
    assert plain.release_slot == -1
    r = P.decode(P.encode(P.ReleaseShared(2, "/dev/shm/x", 4096)))
    assert (r.rank, r.path, r.slots) == (2, "/dev/shm/x", 4096)
