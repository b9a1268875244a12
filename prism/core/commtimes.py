"""In-situ communication times: a capture's own calls, timed for real.

The cost model prices every collective and message from a profile fitted to
points timed outside the job (``prism netprofile``): one group at a time, or
every group of a size at once. On a CPU host neither is the job's own
traffic, where a collective's time depends on what the other ranks do at
that moment (their compute, their other groups' calls). ``prism commtime``
runs the captured graph itself on the host as a *skeleton job*: one real
process per rank, every compute segment a busy loop of its recorded
duration, every call the real ``torch.distributed`` call on scratch tensors
of the recorded op, size and group. This module holds what needs no I/O:

- ``rank_program``: one rank's program, in the order it ran, as the
  skeleton's worker walks it (plain lists, JSON-ready);
- ``measured_costs``: from every node's issue and completion on the skeleton
  (one monotonic clock: every process on one host), each collective
  instance's cost (the median member's completion less its last member's
  issue, what the replay adds to the last arrival) and each message's (the
  receive's completion less the later of the send's and its own issue);
- ``graph_fingerprint``: what ties those arrays to the graph they index;
- ``MeasuredComm``: a cost model whose ``instance_costs`` and
  ``message_costs`` are the measured arrays (issue costs and everything else
  stay the wrapped model's), refusing any other graph.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from prism.core.graph import COLL, COMPUTE, ITER, OPS, RECV, SEND, WAIT, ExecutionGraph

__all__ = ["CommTimesError", "rank_program", "measured_costs", "mean_costs", "graph_fingerprint", "MeasuredComm"]


class CommTimesError(ValueError):
    """Measured communication times that do not fit the graph (names what differs)."""


def graph_fingerprint(graph: ExecutionGraph) -> str:
    """A digest of the graph's communication structure: world, groups, every
    collective instance's group, op and bytes, every message's ends and bytes."""
    h = hashlib.sha256()
    h.update(str(graph.world_size).encode())
    for g in graph.groups:
        h.update(f"|{g.gid}:{','.join(map(str, g.ranks))}".encode())
    for a in (graph.inst_group, graph.inst_op, graph.inst_bytes,
              graph.rank[graph.msg_send], graph.rank[graph.msg_recv], graph.msg_bytes):
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        h.update(b"/")
    return h.hexdigest()[:32]


def _dtype_of(graph: ExecutionGraph, node: int) -> str:
    s = int(graph.sig[node])
    if s >= 0 and s < len(graph.sig_table):
        return str(graph.sig_table[s][1] or "float32")
    return "float32"


def rank_program(graph: ExecutionGraph, rank: int) -> list[list[Any]]:
    """Rank ``rank``'s nodes in program order, each a list the worker runs:

    - ``["c", node, dur_ns]``: compute (a busy loop of ``dur_ns``);
    - ``["coll", node, op, group, nbytes, dtype, async]``: a collective on
      ``graph.groups[group]``, ``nbytes`` its instance's largest member
      contribution (the same on every member);
    - ``["send" | "recv", node, peer, group, nbytes, tag, async]``;
    - ``["wait", node, of]``: wait for the async op of node ``of``;
    - ``["iter", node, step]``: the step ends.
    """
    out: list[list[Any]] = []
    lo, hi = int(graph.rank_ptr[rank]), int(graph.rank_ptr[rank + 1])
    for n in range(lo, hi):
        k = int(graph.kind[n])
        if k == COMPUTE:
            out.append(["c", n, int(graph.dur[n])])
        elif k == COLL:
            # every member moves the instance's largest contribution: gloo needs equal sizes (an
            # all_to_all's uneven splits, taken even here)
            out.append(["coll", n, OPS[int(graph.op[n])], int(graph.group[n]), int(graph.inst_bytes[graph.ref[n]]),
                        _dtype_of(graph, n), bool(graph.is_async[n])])
        elif k in (SEND, RECV):
            out.append(["send" if k == SEND else "recv", n, int(graph.peer[n]), int(graph.group[n]),
                        int(graph.nbytes[n]), int(graph.tag[n]), bool(graph.is_async[n])])
        elif k == WAIT:
            out.append(["wait", n, int(graph.wait_of[n])])
        elif k == ITER:
            out.append(["iter", n, int(graph.step[n])])
    return out


def measured_costs(graph: ExecutionGraph, start_ns: np.ndarray, end_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per collective instance and per message, the measured cost (int64 ns).

    ``start_ns`` / ``end_ns``: per node of ``graph``, when the skeleton
    issued it and when it completed (an async op's completion, not its
    wait's), -1 where not measured. An instance costs the median member's
    completion less its last member's issue (the replay completes it at the
    last arrival plus its cost); a message the receive's completion less the
    later of the send's and the receive's issue (a receive posted late finds
    its data there). Unmeasured or negative entries are -1 (the model's then).
    """
    n = len(graph.kind)
    if len(start_ns) != n or len(end_ns) != n:
        raise CommTimesError(f"measured times cover {len(start_ns)} nodes but the graph has {n}")
    start = np.asarray(start_ns, np.int64)
    end = np.asarray(end_ns, np.int64)
    inst = np.full(graph.n_instances, -1, np.int64)
    for i in range(graph.n_instances):
        m = graph.inst_nodes[graph.inst_ptr[i]:graph.inst_ptr[i + 1]]
        s, e = start[m], end[m]
        if np.any(s < 0) or np.any(e < 0):
            continue
        inst[i] = max(0, int(np.median(e)) - int(s.max()))
    msg = np.full(graph.n_messages, -1, np.int64)
    if graph.n_messages:
        s = np.maximum(start[graph.msg_send], start[graph.msg_recv])
        e = end[graph.msg_recv]
        ok = (start[graph.msg_send] >= 0) & (start[graph.msg_recv] >= 0) & (e >= 0)
        msg[ok] = np.maximum(e[ok] - s[ok], 0)
    return inst, msg


def mean_costs(per_pass: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Per instance and per message, the mean of ``measured_costs`` over
    several passes of the skeleton, over the passes that measured it (-1 where
    none did)."""
    if not per_pass:
        raise CommTimesError("no pass of the skeleton was kept")

    def mean(arrays: list[np.ndarray]) -> np.ndarray:
        a = np.stack(arrays).astype(np.float64)
        ok = a >= 0
        n = ok.sum(axis=0)
        total = np.where(ok, a, 0.0).sum(axis=0)
        return np.where(n > 0, np.rint(total / np.maximum(n, 1)), -1).astype(np.int64)

    return mean([p[0] for p in per_pass]), mean([p[1] for p in per_pass])


@dataclass(frozen=True, eq=False)
class MeasuredComm:
    """A cost model whose collective and message times are measured ones.

    ``base`` prices what was not measured (entries -1) and keeps its issue
    costs; ``fingerprint`` is ``graph_fingerprint`` of the graph measured:
    another graph (scaled out, other steps) is refused, since the arrays index
    that graph's instances and messages."""

    base: Any  # CostModel
    inst_ns: np.ndarray
    msg_ns: np.ndarray
    fingerprint: str
    label: str = "measured"

    @property
    def name(self) -> str:
        return f"{self.label} (in-situ; else {self.base.name})"

    @property
    def source(self) -> str:
        return self.base.source

    @property
    def description(self) -> str:
        return (f"communication times measured in situ ({self.label}); calls not measured priced by "
                f"{self.base.name}")

    def __getattr__(self, attr: str) -> Any:  # issue_ns, ranks_per_node, per_op, ...
        if attr.startswith("__") or attr == "base":
            raise AttributeError(attr)
        return getattr(self.base, attr)

    def _check(self, graph: ExecutionGraph) -> None:
        got = graph_fingerprint(graph)
        if got != self.fingerprint:
            raise CommTimesError(
                f"the measured communication times {self.label!r} belong to another graph (fingerprint "
                f"{self.fingerprint}, this graph {got}: other steps, another layout or a scaled-out world); "
                "measure this one with `prism commtime RUN`, or use the cost model (--comm model)")

    def instance_costs(self, graph: ExecutionGraph) -> np.ndarray:
        self._check(graph)
        model = self.base.instance_costs(graph)
        return np.where(self.inst_ns >= 0, self.inst_ns, model).astype(np.int64)

    def message_costs(self, graph: ExecutionGraph) -> np.ndarray:
        self._check(graph)
        model = self.base.message_costs(graph)
        return np.where(self.msg_ns >= 0, self.msg_ns, model).astype(np.int64)

    def issue_costs(self, graph: ExecutionGraph) -> np.ndarray:
        return self.base.issue_costs(graph)

    @classmethod
    def of(cls, base: Any, arrays: Mapping[str, Sequence[int]], fingerprint: str, label: str) -> MeasuredComm:
        return cls(base, np.asarray(arrays["inst_ns"], np.int64), np.asarray(arrays["msg_ns"], np.int64),
                   fingerprint, label)
