"""The network cost model (prism.core.costmodel): alpha-beta formulas per op
within and between nodes, the vectorised costs, and profile files (the
bundled ones, loading by path, validation naming file, key and value)."""

import pathlib
import tomllib

import numpy as np
import pytest

from prism.core.costmodel import ZERO, CostModel, Link, ProfileError, parse_profile
from prism.core.synthetic import MegatronSpec, megatron_graph
from prism.shell.profiles import PROFILE_DIR, load_profile

# 1 GB/s = 1 byte/ns inside a node, 0.5 byte/ns between nodes; 1 us / 10 us per step
M = CostModel("t", 4, Link(1e9, 1e-6), Link(0.5e9, 10e-6), base_latency=2e-6)
INTRA = [0, 1, 2, 3]
SPAN = [0, 1, 4, 5]  # two nodes


@pytest.mark.parametrize("op,ranks,nbytes,expected_ns", [
    # ring all_reduce: base + 2(n-1) alpha + 2(n-1)/n S / beta
    ("all_reduce", INTRA, 4000, 2000 + 6 * 1000 + 6000),
    ("all_reduce", SPAN, 4000, 2000 + 6 * 10_000 + 12_000),
    # all_gather: S is the own shard; (n-1) S cross the link
    ("all_gather_into_tensor", INTRA, 1000, 2000 + 3 * 1000 + 3000),
    # reduce_scatter: S is the full input; (n-1)/n S
    ("reduce_scatter_tensor", INTRA, 4000, 2000 + 3 * 1000 + 3000),
    ("all_to_all_single", SPAN, 4000, 2000 + 3 * 10_000 + 6000),
    # broadcast as a pipelined chain: (n-1) alpha + S / beta
    ("broadcast", INTRA, 4000, 2000 + 3 * 1000 + 4000),
    ("barrier", INTRA, 4, 2000 + 6 * 1000),
    ("all_reduce", [3], 4000, 0),  # a group of one does not communicate
])
def test_formulas(op, ranks, nbytes, expected_ns):
    assert M.collective_ns(op, nbytes, ranks) == expected_ns


def test_auto_takes_the_faster_of_ring_and_tree_per_call():
    ring = CostModel("r", 4, M.intra, M.inter, base_latency=2e-6)
    tree = CostModel("t", 4, M.intra, M.inter, base_latency=2e-6, algorithms=(("all_reduce", "tree"),))
    auto = CostModel("a", 4, M.intra, M.inter, base_latency=2e-6, algorithms=(("all_reduce", "auto"),))
    world = list(range(1024))
    for nbytes in (0, 1000, 10**6, 10**8, 10**10):
        for ranks in (world, world[:8], world[:2], world[:4]):
            want = min(ring.collective_ns("all_reduce", nbytes, ranks), tree.collective_ns("all_reduce", nbytes, ranks))
            assert auto.collective_ns("all_reduce", nbytes, ranks) == want
    # latency-bound in a large group: the tree; bandwidth-bound: the ring
    assert auto.collective_ns("all_reduce", 1000, world) == tree.collective_ns("all_reduce", 1000, world)
    assert auto.collective_ns("all_reduce", 10**10, world[:8]) == ring.collective_ns("all_reduce", 10**10, world[:8])
    # other ops keep their algorithm
    assert auto.collective_ns("broadcast", 1000, world) == ring.collective_ns("broadcast", 1000, world)
    m = parse_profile(profile_text(extra='[algorithms]\nall_reduce = "auto"\n'), "inline")
    assert m.algorithm("all_reduce") == "auto"


def test_auto_with_per_op_parameters_and_measured_points():
    from prism.core.costmodel import OpParams

    per_op = (("all_reduce", OpParams(base_latency=5e-6, latency=2e-6, bandwidth=2e9)),)
    kw = dict(base_latency=2e-6, per_op=per_op)
    ring, tree, auto = (CostModel(a, 4, M.intra, M.inter, algorithms=(("all_reduce", a),), **kw)
                        for a in ("ring", "tree", "auto"))
    for nbytes in (0, 1000, 10**6, 10**9):
        for ranks in (list(range(4)), list(range(64))):  # inside a node (per-op parameters) and across nodes
            want = min(ring.collective_ns("all_reduce", nbytes, ranks), tree.collective_ns("all_reduce", nbytes, ranks))
            assert auto.collective_ns("all_reduce", nbytes, ranks) == want
    # measured points scale auto's own model by measured / modelled at their sizes
    measured = (("all_reduce", 4, (1000, 10**6), (1e-4, 1e-3)),)
    m_auto = CostModel("a", 4, M.intra, M.inter, algorithms=(("all_reduce", "auto"),), measured=measured, **kw)
    assert m_auto.collective_ns("all_reduce", 1000, list(range(4))) == 100_000
    assert m_auto.collective_ns("all_reduce", 10**6, list(range(4))) == 1_000_000


def test_tree_all_reduce_and_p2p():
    tree = CostModel("t", 4, M.intra, M.inter, base_latency=2e-6, algorithms=(("all_reduce", "tree"),))
    # 2 ceil(log2 8) steps over the network, 2 S over the link
    assert tree.collective_ns("all_reduce", 1000, list(range(8))) == 2000 + 6 * 10_000 + 4000
    assert M.p2p_ns(1000, 0, 3) == 2000 + 1000 + 1000
    assert M.p2p_ns(1000, 3, 4) == 2000 + 10_000 + 2000


def test_vectorised_costs_match_scalar_form():
    g = megatron_graph(MegatronSpec(tp=2, pp=2, dp=4, ep=2, micro_batches=2, iterations=1))
    m = CostModel("t", 4, M.intra, M.inter, base_latency=2e-6)
    inst = m.instance_costs(g)
    from prism.core.graph import OPS
    for i in range(0, g.n_instances, 7):
        ranks = g.groups[g.inst_group[i]].ranks
        assert inst[i] == m.collective_ns(OPS[g.inst_op[i]], int(g.inst_bytes[i]), ranks)
    msg = m.message_costs(g)
    for j in range(0, g.n_messages, 5):
        assert msg[j] == m.p2p_ns(int(g.msg_bytes[j]), int(g.rank[g.msg_send[j]]), int(g.rank[g.msg_recv[j]]))
    assert not ZERO.instance_costs(g).any() and not ZERO.message_costs(g).any()
    assert ZERO.collective_ns("all_reduce", 1 << 30, list(range(64))) == 0


def test_bundled_profile_loads_and_cites_its_figures():
    m = load_profile("h200_nvlink_ib400")
    assert m.name == "h200_nvlink_ib400" and m.ranks_per_node == 8
    assert m.intra.bandwidth == 450e9 and m.inter.bandwidth == 50e9
    text = (PROFILE_DIR / "h200_nvlink_ib400.toml").read_text()
    assert "not measured here" in m.description
    # every figure has its source written above it
    lines = text.splitlines()
    def is_number(v: str) -> bool:
        try:
            float(v)
        except ValueError:
            return False
        return True

    checked = 0
    for i, line in enumerate(lines):
        if "=" in line and not line.startswith("#") and is_number(line.split("=")[1].strip()):
            checked += 1
            block = []
            j = i - 1
            while j >= 0 and lines[j].startswith("#"):
                block.append(lines[j])
                j -= 1
            comment = " ".join(block)
            assert "not measured here" in comment.lower() or "datasheet" in comment.lower(), line
    assert checked == 6
    assert tomllib.loads(text)["name"] == "h200_nvlink_ib400"


def test_load_by_path_and_zero(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('name = "mine"\nranks_per_node = 4\n[intra]\nbandwidth_GBps = 1\nlatency_us = 1\n'
                 '[inter]\nbandwidth_GBps = 0.5\nlatency_us = 10\n')
    m = load_profile(p)
    assert m.source == str(p) and m.collective_ns("all_reduce", 4000, INTRA) == M.collective_ns("all_reduce", 4000, INTRA) - 2000
    assert load_profile("zero") is ZERO


GOOD = {"name": '"x"', "ranks_per_node": "8", "base_latency_us": "1"}


def profile_text(top=None, intra=None, inter=None, extra="") -> str:
    t = dict(GOOD, **(top or {}))
    li = {"bandwidth_GBps": "100", "latency_us": "1", **(intra or {})}
    le = {"bandwidth_GBps": "10", "latency_us": "5", **(inter or {})}
    body = "".join(f"{k} = {v}\n" for k, v in t.items() if v is not None)
    body += "[intra]\n" + "".join(f"{k} = {v}\n" for k, v in li.items() if v is not None)
    body += "[inter]\n" + "".join(f"{k} = {v}\n" for k, v in le.items() if v is not None)
    return body + extra


@pytest.mark.parametrize("text,match", [
    (profile_text(intra={"bandwidth_GBps": "-5"}), r"bad\.toml: key 'intra\.bandwidth_GBps' has value -5; expected a positive"),
    (profile_text(inter={"latency_us": '"fast"'}), r"bad\.toml: key 'inter\.latency_us' has value 'fast'; expected a number"),
    (profile_text(top={"ranks_per_node": "0"}), r"bad\.toml: key 'ranks_per_node' has value 0; expected a positive int"),
    (profile_text(top={"ranks_per_node": "8.5"}), r"key 'ranks_per_node' has value 8\.5; expected an integer"),
    (profile_text(top={"name": None}), r"bad\.toml: missing key 'name'"),
    (profile_text(intra={"latency_us": None}), r"bad\.toml: missing key 'intra\.latency_us'"),
    (profile_text(top={"bandwidth": "1"}), r"bad\.toml: unknown key 'bandwidth'"),
    (profile_text(intra={"speed": "1"}), r"bad\.toml: unknown key 'intra\.speed'"),
    (profile_text(top={"base_latency_us": "true"}), r"key 'base_latency_us' has value True; expected a number"),
    (profile_text(extra='[algorithms]\nall_reduce = "butterfly"\n'),
     r"bad\.toml: key 'algorithms\.all_reduce' has value 'butterfly'; expected one of \('ring', 'tree', 'auto'\)"),
    (profile_text(extra='[algorithms]\nsend = "ring"\n'), r"key 'algorithms\.send': no algorithm choice"),
    ("name = \n", r"bad\.toml: not valid TOML"),
])
def test_validation_names_file_key_and_value(tmp_path, text, match):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ProfileError, match=match):
        load_profile(p)


def test_good_text_parses():
    m = parse_profile(profile_text(extra='[algorithms]\nbroadcast = "tree"\n'), "inline")
    assert m.algorithm("broadcast") == "tree" and m.algorithm("all_reduce") == "ring"
    assert m.base_latency == pytest.approx(1e-6) and m.inter.latency == pytest.approx(5e-6)


def test_unknown_profile_lists_bundled():
    with pytest.raises(ProfileError, match=r"cost profile 'nope' not found: .*bundled profile name \(h200_nvlink_ib400"):
        load_profile("nope")


def test_profiles_directory_ships_with_the_package():
    assert pathlib.Path(PROFILE_DIR).is_dir()
    assert np.all([p.suffix == ".toml" for p in PROFILE_DIR.iterdir() if p.is_file()])
