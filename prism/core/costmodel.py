"""Communication cost models (sans-IO: the shell reads profile files, see ``prism.shell.profiles``).

An alpha-beta model per collective algorithm: a call costs a fixed base
latency, a per-step latency (alpha) times the algorithm's number of steps,
and the bytes each rank moves divided by the per-direction bandwidth (beta)
of the bottleneck link. With ``n`` members and ``S`` the bytes one rank
contributes (the largest contribution when members differ):

=========================  ======================  =============================
op                         steps (alpha)           bytes over the link (beta)
=========================  ======================  =============================
all_reduce  ring           2(n-1)                  2(n-1)/n * S
all_reduce  tree           2 ceil(log2 n)          2 * S
all_reduce  auto           the faster of the two, per call (NCCL's tuner's way)
all_gather (ring)          n-1                     (n-1) * S   (S = own shard)
reduce_scatter (ring)      n-1                     (n-1)/n * S (S = full input)
all_to_all (pairwise)      n-1                     (n-1)/n * S
broadcast/reduce ring      n-1 (pipelined chain)   S
broadcast/reduce tree      ceil(log2 n)            S
gather                     n-1                     (n-1) * S
scatter                    n-1                     (n-1)/n * S
barrier                    as all_reduce of 0 bytes
send/recv (p2p)            1                       S
=========================  ======================  =============================

These are the textbook forms NCCL's own tuning model uses (``nsteps`` in
``src/graph/tuning.cc``). Topology: ranks ``[k*ranks_per_node, (k+1)*ranks_per_node)``
share node ``k``; a group whose members sit on one node uses the intra-node
link, a group spanning nodes uses the inter-node link for every step (the
slowest link bounds a ring). Contention between concurrent collectives is
not modelled.

A profile may give an op its own parameters (``[ops.all_reduce]``:
``base_latency_us``, ``latency_us``, ``bandwidth_GBps``), which replace the
base latency and the intra-node link for that op's groups inside one node;
``prism netprofile`` fits them per op, because one set for every op fits
real backends badly (gloo's and NCCL's algorithms differ per op).

Issue cost (``issue_us``, top level or per op): the CPU time one call costs
the thread that makes it, apart from the transfer. With NCCL a call only
enqueues work (the times above are then the collective's time on the GPU),
so the issuing thread pays this and goes on; the replay adds it to a GPU
rank's CPU clock at every call (``issue_costs``). ``prism netprofile
--backend nccl`` measures both. 0 where not given (gloo: a call's time is
all on the calling thread, in the times above).

Measured points (``[[measured]]`` tables: ``op``, ``ranks``, ``bytes``,
``us``, as ``prism netprofile`` writes them) correct the alpha-beta form
where it is wrong: for a group inside one node, the time is the model's times
the ratio measured / modelled at the measured sizes of that op (or its
``PARAM_FAMILY``), interpolated linearly in log(bytes) between them and held
constant beyond, taken at the measured group size nearest in log2 (so an
op's time per size and per group size is what was measured there, and the
alpha-beta form only interpolates and extrapolates).

Profiles are TOML files (see ``prism/profiles/``), parsed from their text
with ``tomllib`` by ``parse_profile``; ``prism.shell.profiles.load_profile``
finds and reads them. ``ZERO`` costs nothing (for tests).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from prism.core.graph import OP_CODE, OPS

if TYPE_CHECKING:
    from prism.core.graph import ExecutionGraph

#: ``auto``: per call the faster of ring and tree under this model, as NCCL's
#: tuner picks an algorithm per call by its own alpha-beta model
#: (``src/graph/tuning.cc``): tree for latency-bound calls in large groups,
#: ring for bandwidth-bound ones.
ALGORITHMS = {
    "all_reduce": ("ring", "tree", "auto"),
    "all_reduce_coalesced": ("ring", "tree", "auto"),
    "barrier": ("ring", "tree", "auto"),
    "broadcast": ("ring", "tree", "auto"),
    "reduce": ("ring", "tree", "auto"),
}
_DEFAULT_ALGORITHM = "ring"


class ProfileError(ValueError):
    """A cost profile is invalid (the profile file's fault)."""


@dataclass(frozen=True, slots=True)
class Link:
    """One direction of a link as one GPU sees it."""

    #: bytes per second, per direction, per GPU
    bandwidth: float
    #: seconds per algorithm step
    latency: float


@dataclass(frozen=True, slots=True)
class OpParams:
    """Fitted parameters of one op family on the intra-node link (``[ops.NAME]``)."""

    #: seconds added once per call
    base_latency: float
    #: seconds per algorithm step
    latency: float
    #: bytes per second
    bandwidth: float
    #: CPU seconds one call costs its caller (None: the model's ``issue``)
    issue: float | None = None


#: Ops that take the parameters of a measured op of the same shape of traffic.
PARAM_FAMILY = {"all_reduce_coalesced": "all_reduce", "barrier": "all_reduce", "all_gather": "all_gather_into_tensor",
                "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single", "recv": "send"}


@dataclass(frozen=True, slots=True)
class CostModel:
    """An alpha-beta communication cost model with a two-level topology."""

    name: str
    ranks_per_node: int
    intra: Link
    inter: Link
    #: seconds added once per call (launch and protocol overhead)
    base_latency: float = 0.0
    #: op -> algorithm for ops that have a choice (see ALGORITHMS); others "ring"
    algorithms: tuple[tuple[str, str], ...] = ()
    #: where the model came from: a file path, or a short phrase
    source: str = ""
    #: free text shown with predictions (e.g. "datasheet figures, not measured here")
    description: str = ""
    #: op -> parameters replacing (base_latency, intra link) for that op's
    #: groups within one node (``prism netprofile`` fits them per op); ops of
    #: ``PARAM_FAMILY`` use their family's
    per_op: tuple[tuple[str, OpParams], ...] = ()
    #: CPU seconds one communication call costs the calling thread (GPU
    #: ranks; see the module docstring), for ops without their own
    issue: float = 0.0
    #: measured points: (op, group size, bytes per rank ascending, seconds each), see the module docstring
    measured: tuple[tuple[str, int, tuple[int, ...], tuple[float, ...]], ...] = ()
    _zero: bool = field(default=False, repr=False)

    @classmethod
    def zero(cls) -> CostModel:
        """A model in which every communication takes no time."""
        free = Link(math.inf, 0.0)
        return cls("zero", 1, free, free, source="built in", description="communication costs nothing", _zero=True)

    def algorithm(self, op: str) -> str:
        return dict(self.algorithms).get(op, _DEFAULT_ALGORITHM)

    # -- scalar form (documentation, tests, one-off questions)
    def collective_ns(self, op: str, nbytes: int, ranks: tuple[int, ...] | list[int]) -> int:
        """Modelled duration (ns) of ``op`` moving ``nbytes`` per rank among ``ranks``."""
        if op not in OP_CODE:
            raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
        spans = len({r // self.ranks_per_node for r in ranks}) > 1
        return int(self._cost(np.array([OP_CODE[op]]), np.array([nbytes], np.int64),
                              np.array([len(ranks)]), np.array([spans]))[0])

    def p2p_ns(self, nbytes: int, src: int, dst: int) -> int:
        """Modelled duration (ns) of a point-to-point transfer of ``nbytes``."""
        spans = src // self.ranks_per_node != dst // self.ranks_per_node
        return int(self._cost(np.array([OP_CODE["send"]]), np.array([nbytes], np.int64), np.array([2]),
                              np.array([spans]))[0])

    # -- vectorised form used by replay
    def instance_costs(self, graph: ExecutionGraph) -> np.ndarray:
        """Modelled duration (int64 ns) of every collective instance of ``graph``."""
        size = graph.group_size
        span = np.array([len({r // self.ranks_per_node for r in g.ranks}) > 1 for g in graph.groups], bool)
        gi = graph.inst_group
        return self._cost(graph.inst_op.astype(np.int64), graph.inst_bytes, size[gi], span[gi] if len(gi) else span[:0])

    def message_costs(self, graph: ExecutionGraph) -> np.ndarray:
        """Modelled duration (int64 ns) of every point-to-point message of ``graph``."""
        src = graph.rank[graph.msg_send].astype(np.int64)
        dst = graph.rank[graph.msg_recv].astype(np.int64)
        spans = (src // self.ranks_per_node) != (dst // self.ranks_per_node)
        ops = np.full(len(src), OP_CODE["send"], np.int64)
        return self._cost(ops, graph.msg_bytes, np.full(len(src), 2), spans)

    def issue_ns(self, op: str) -> int:
        """CPU time (ns) one call of ``op`` costs the thread that makes it."""
        if self._zero:
            return 0
        params = dict(self.per_op)
        p = params.get(op) or params.get(PARAM_FAMILY.get(op, ""))
        issue = p.issue if p is not None and p.issue is not None else self.issue
        return int(round(issue * 1e9))

    def issue_costs(self, graph: ExecutionGraph) -> np.ndarray:
        """Per node of ``graph`` (int64 ns): the CPU cost of issuing it, for
        communication nodes (collectives, sends, receives); 0 elsewhere."""
        out = np.zeros(graph.n_nodes, np.int64)
        if self._zero or not (self.issue or any(p.issue for _, p in self.per_op)):
            return out
        for code in np.unique(graph.op[graph.op >= 0]).tolist():
            out[graph.op == code] = self.issue_ns(OPS[code])
        return out

    def _cost(self, op: np.ndarray, nbytes: np.ndarray, n: np.ndarray, spans: np.ndarray) -> np.ndarray:
        if self._zero or len(op) == 0:
            return np.zeros(len(op), np.int64)
        t = self._alpha_beta(op, nbytes, n, spans)
        if self.measured:
            t = t * self._measured_ratio(op, nbytes, n, spans)
        t = np.where(n <= 1, 0.0, t)  # a group of one does no communication
        return np.rint(t * 1e9).astype(np.int64)

    def _measured_ratio(self, op: np.ndarray, nbytes: np.ndarray, n: np.ndarray, spans: np.ndarray) -> np.ndarray:
        """Per call: measured / modelled time at its op, size and group size
        (1 where nothing was measured; see the module docstring)."""
        ratio = np.ones(len(op))
        table: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
        for name, ranks, sizes, secs in self.measured:
            x = np.asarray(sizes, np.int64)
            modelled = self._alpha_beta(np.full(len(x), OP_CODE[name]), x, np.full(len(x), ranks),
                                        np.zeros(len(x), bool))
            r = np.asarray(secs, np.float64) / np.maximum(modelled, 1e-12)
            table.setdefault(name, {})[ranks] = (np.log(np.maximum(x, 1)), np.log(np.maximum(r, 1e-12)))
        for code in np.unique(op).tolist():
            name = OPS[code]
            by_n = table.get(name) or table.get(PARAM_FAMILY.get(name, ""))
            if not by_n:
                continue
            m = np.flatnonzero((op == code) & ~spans)
            if not len(m):
                continue
            known = np.asarray(sorted(by_n), np.float64)
            for k in np.unique(n[m]).tolist():
                near = int(known[np.argmin(np.abs(np.log2(known) - math.log2(max(k, 1))))])
                lx, lr = by_n[near]
                sel = m[n[m] == k]
                ratio[sel] = np.exp(np.interp(np.log(np.maximum(nbytes[sel], 1)), lx, lr))
        return ratio

    def _alpha_beta(self, op: np.ndarray, nbytes: np.ndarray, n: np.ndarray, spans: np.ndarray) -> np.ndarray:
        """The alpha-beta time (float seconds) of each call, per-op parameters
        applied; ops on ``auto`` take the faster of ring and tree per call."""
        tree = np.zeros(len(op), bool)
        auto = np.zeros(len(op), bool)
        for code in np.unique(op).tolist():
            algo = self.algorithm(OPS[code])
            if algo == "tree":
                tree |= op == code
            elif algo == "auto":
                auto |= op == code
        t = self._alpha_beta_as(op, nbytes, n, spans, tree)
        if auto.any():
            t = np.where(auto, np.minimum(t, self._alpha_beta_as(op, nbytes, n, spans, tree | auto)), t)
        return t

    def _alpha_beta_as(self, op: np.ndarray, nbytes: np.ndarray, n: np.ndarray, spans: np.ndarray,
                       tree: np.ndarray) -> np.ndarray:
        """``_alpha_beta`` with the calls ``tree`` run as trees, the others as rings."""
        n = n.astype(np.float64)
        S = nbytes.astype(np.float64)
        bw = np.where(spans, self.inter.bandwidth, self.intra.bandwidth)
        lat = np.where(spans, self.inter.latency, self.intra.latency)
        log2n = np.ceil(np.log2(np.maximum(n, 1)))
        steps = np.zeros(len(op))
        moved = np.zeros(len(op))
        for name in set(OPS[c] for c in np.unique(op).tolist()):
            m = op == OP_CODE[name]
            nm, Sm, tm = n[m], S[m], tree[m]
            if name in ("all_reduce", "all_reduce_coalesced", "barrier"):
                Sm = Sm if name != "barrier" else np.zeros_like(Sm)
                steps[m] = np.where(tm, 2 * log2n[m], 2 * (nm - 1))
                moved[m] = np.where(tm, 2 * Sm, 2 * (nm - 1) / nm * Sm)
            elif name in ("all_gather", "all_gather_into_tensor", "gather"):
                steps[m], moved[m] = nm - 1, (nm - 1) * Sm
            elif name in ("reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "scatter"):
                steps[m], moved[m] = nm - 1, (nm - 1) / nm * Sm
            elif name in ("broadcast", "reduce"):
                steps[m] = np.where(tm, log2n[m], nm - 1)
                moved[m] = Sm
            else:  # send / recv
                steps[m], moved[m] = 1, Sm
        t = self.base_latency + steps * lat + moved / bw
        if self.per_op:
            params = dict(self.per_op)
            for code in np.unique(op).tolist():
                name = OPS[code]
                p = params.get(name) or params.get(PARAM_FAMILY.get(name, ""))
                if p is None:
                    continue
                m = (op == code) & ~spans
                t[m] = p.base_latency + steps[m] * p.latency + moved[m] / p.bandwidth
        return t


ZERO = CostModel.zero()

_TOP_KEYS = {"name", "description", "ranks_per_node", "base_latency_us", "issue_us", "intra", "inter", "algorithms",
             "ops", "measured"}
_MEASURED_KEYS = {"op", "ranks", "bytes", "us"}
_OP_KEYS = {"base_latency_us", "latency_us", "bandwidth_GBps", "issue_us"}
_LINK_KEYS = {"bandwidth_GBps", "latency_us"}


def parse_profile(text: str, source: str) -> CostModel:
    """Parse a TOML cost profile; errors name ``source``, the key and the value."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{source}: not valid TOML: {e}") from None
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ProfileError(f"{source}: unknown key {unknown[0]!r} (allowed: {sorted(_TOP_KEYS)})")

    def need(table: dict, key: str, where: str, kind: type | tuple) -> Any:
        if key not in table:
            raise ProfileError(f"{source}: missing key '{where}{key}'")
        v = table[key]
        if not isinstance(v, kind) or isinstance(v, bool):
            raise ProfileError(f"{source}: key '{where}{key}' has value {v!r}; expected {_kind_name(kind)}")
        return v

    def positive(v: float, key: str, allow_zero: bool = False) -> float:
        if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
            raise ProfileError(f"{source}: key {key!r} has value {v!r}; expected a "
                               f"{'non-negative' if allow_zero else 'positive'} finite number")
        return float(v)

    def link(key: str) -> Link:
        t = need(data, key, "", dict)
        extra = sorted(set(t) - _LINK_KEYS)
        if extra:
            raise ProfileError(f"{source}: unknown key '{key}.{extra[0]}' (allowed: {sorted(_LINK_KEYS)})")
        bw = positive(need(t, "bandwidth_GBps", f"{key}.", (int, float)), f"{key}.bandwidth_GBps")
        lat = positive(need(t, "latency_us", f"{key}.", (int, float)), f"{key}.latency_us", allow_zero=True)
        return Link(bw * 1e9, lat * 1e-6)

    name = need(data, "name", "", str)
    rpn = need(data, "ranks_per_node", "", int)
    if rpn < 1:
        raise ProfileError(f"{source}: key 'ranks_per_node' has value {rpn!r}; expected a positive int")
    base_raw = data.get("base_latency_us", 0.0)
    if not isinstance(base_raw, (int, float)) or isinstance(base_raw, bool):
        _bad(source, "base_latency_us", base_raw, "a number")
    base = positive(base_raw, "base_latency_us", allow_zero=True)

    def issue_of(table: dict, where: str) -> float | None:
        if "issue_us" not in table:
            return None
        v = table["issue_us"]
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            _bad(source, where + "issue_us", v, "a number")
        return positive(v, where + "issue_us", allow_zero=True) * 1e-6

    issue = issue_of(data, "") or 0.0
    algos = data.get("algorithms", {})
    if not isinstance(algos, dict):
        _bad(source, "algorithms", algos, "a table")
    for op, algo in algos.items():
        if op not in ALGORITHMS:
            raise ProfileError(f"{source}: key 'algorithms.{op}': no algorithm choice for this op "
                               f"(choices exist for {sorted(ALGORITHMS)})")
        if algo not in ALGORITHMS[op]:
            raise ProfileError(f"{source}: key 'algorithms.{op}' has value {algo!r}; expected one of {ALGORITHMS[op]}")
    desc = data.get("description", "")
    if not isinstance(desc, str):
        _bad(source, "description", desc, "a string")
    ops = data.get("ops", {})
    if not isinstance(ops, dict):
        _bad(source, "ops", ops, "a table of [ops.NAME] tables")
    per_op = []
    for op, t in sorted(ops.items()):
        if op not in OP_CODE:
            raise ProfileError(f"{source}: key 'ops.{op}': unknown op (known: {', '.join(OPS)})")
        if not isinstance(t, dict):
            _bad(source, f"ops.{op}", t, "a table")
        extra = sorted(set(t) - _OP_KEYS)
        if extra:
            raise ProfileError(f"{source}: unknown key 'ops.{op}.{extra[0]}' (allowed: {sorted(_OP_KEYS)})")
        where = f"ops.{op}."
        per_op.append((op, OpParams(
            positive(need(t, "base_latency_us", where, (int, float)), where + "base_latency_us", allow_zero=True) * 1e-6,
            positive(need(t, "latency_us", where, (int, float)), where + "latency_us", allow_zero=True) * 1e-6,
            positive(need(t, "bandwidth_GBps", where, (int, float)), where + "bandwidth_GBps") * 1e9,
            issue_of(t, where))))
    measured = []
    rows = data.get("measured", [])
    if not isinstance(rows, list):
        _bad(source, "measured", rows, "an array of [[measured]] tables")
    for i, t in enumerate(rows):
        where = f"measured[{i}]."
        if not isinstance(t, dict):
            _bad(source, f"measured[{i}]", t, "a table")
        extra = sorted(set(t) - _MEASURED_KEYS)
        if extra:
            raise ProfileError(f"{source}: unknown key '{where}{extra[0]}' (allowed: {sorted(_MEASURED_KEYS)})")
        op = need(t, "op", where, str)
        if op not in OP_CODE:
            raise ProfileError(f"{source}: key '{where}op' has value {op!r}: unknown op (known: {', '.join(OPS)})")
        ranks = need(t, "ranks", where, int)
        sizes, us = need(t, "bytes", where, list), need(t, "us", where, list)
        if ranks < 2 or not sizes or len(sizes) != len(us):
            raise ProfileError(f"{source}: {where[:-1]} needs ranks >= 2 and as many 'us' as 'bytes' "
                               f"(got ranks {ranks}, {len(sizes)} sizes, {len(us)} times)")
        if any(not isinstance(b, int) or isinstance(b, bool) or b < 0 for b in sizes) or sizes != sorted(set(sizes)):
            _bad(source, where + "bytes", sizes, "ascending distinct non-negative integers")
        secs = tuple(positive(v, where + "us") * 1e-6 if isinstance(v, (int, float)) and not isinstance(v, bool)
                     else _bad(source, where + "us", v, "positive numbers") for v in us)
        measured.append((op, ranks, tuple(sizes), secs))
    return CostModel(name, rpn, link("intra"), link("inter"), base * 1e-6, tuple(sorted(algos.items())),
                     source=source, description=desc, per_op=tuple(per_op), issue=issue, measured=tuple(measured))


def _bad(source: str, key: str, value: Any, expected: str) -> None:
    raise ProfileError(f"{source}: key {key!r} has value {value!r}; expected {expected}")


def _kind_name(kind: type | tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", dict: "a table"}
    if isinstance(kind, tuple):
        return "a number" if set(kind) == {int, float} else " or ".join(names[k] for k in kind)
    return names[kind]
