"""Build small PrismTrace event lists by hand or at random, for graph and replay tests.

``Program`` appends calls to per-rank programs in one global order, which by
construction gives a deadlock-free run (every dependency points forward in
that order); each rank keeps a local clock (compute takes its duration, every
call 1 ns) and an async op's record is written at its wait point, as a real
writer does on completion.
"""

from __future__ import annotations

from prism.core.trace import P2P, Collective, Compute, GroupCreated, Iteration


class Program:
    def __init__(self, world: int, groups: dict[str, tuple[int, ...]] | None = None) -> None:
        self.world = world
        self.groups = {"world": tuple(range(world))}
        self.groups.update(groups or {})
        self.events: dict[int, list] = {
            r: [GroupCreated(gid, ranks, i, gid, 0) for i, (gid, ranks) in enumerate(self.groups.items()) if r in ranks]
            for r in range(world)
        }
        self.clock = [0] * world
        self.step = [0] * world
        self.seq = {g: 0 for g in self.groups}
        self.pseq: dict[tuple[int, int, int], int] = {}
        self.pending: dict[tuple[int, str], tuple] = {}  # (rank, handle) -> (issue, record kwargs)

    def _tick(self, r: int, dt: int = 1) -> int:
        t = self.clock[r]
        self.clock[r] = t + dt
        return t

    def compute(self, r: int, dur: int, *, cpu: int = -1, gpu: int = -1, join: bool = False, free: int = -1,
                cold: int = 0) -> None:
        """A compute segment; ``cpu``/``gpu``/``join`` (and ``free``/``cold``,
        PrismTrace 1.2) make it a GPU rank's two-clock segment."""
        t = self._tick(r, dur)
        self.events[r].append(Compute(t, t + dur, self.step[r], cpu, gpu, join, free, cold))

    def coll(self, gid: str, op: str = "all_reduce", nbytes: int = 1024, *, async_on=(), dtype: str = "float32",
             handle: str = "") -> int:
        """One collective instance on ``gid``; members in ``async_on`` issue it async (wait with ``wait``)."""
        seq = self.seq[gid]
        self.seq[gid] += 1
        for r in self.groups[gid]:
            kw = dict(gid=gid, seq=seq, op=op, reduce_op="SUM" if "reduce" in op else "", dtype=dtype,
                      in_shapes=((nbytes // 4,),), out_shapes=((nbytes // 4,),), bytes=nbytes, step=self.step[r])
            issue = self._tick(r)
            if r in async_on:
                self.pending[(r, handle)] = (issue, Collective, kw)
            else:
                self.events[r].append(Collective(**kw, issue_ns=issue, wait_ns=issue, end_ns=issue + 1))
        return seq

    def send(self, src: int, dst: int, nbytes: int = 4096, *, tag: int = 0, async_send: bool = False,
             async_recv: bool = False, handle: str = "") -> None:
        key = (src, dst, tag)
        pseq = self.pseq.get(key, 0)
        self.pseq[key] = pseq + 1
        for r, op, peer, is_async in ((src, "send", dst, async_send), (dst, "recv", src, async_recv)):
            kw = dict(op=op, gid="world", peer=peer, tag=tag, pseq=pseq, dtype="float32", shape=(nbytes // 4,),
                      bytes=nbytes, step=self.step[r])
            issue = self._tick(r)
            if is_async:
                self.pending[(r, handle)] = (issue, P2P, kw)
            else:
                self.events[r].append(P2P(**kw, issue_ns=issue, wait_ns=issue, end_ns=issue + 1))

    def wait(self, r: int, handle: str = "") -> None:
        issue, cls, kw = self.pending.pop((r, handle))
        t = self._tick(r)
        self.events[r].append(cls(**kw, async_op=True, issue_ns=issue, wait_ns=t, end_ns=t + 1))

    def end_step(self, ranks=None) -> None:
        for r in range(self.world) if ranks is None else ranks:
            self.events[r].append(Iteration(self.step[r], self._tick(r)))
            self.step[r] += 1
