"""The agents' sans-IO pieces: messages, placement, discovery (issue 23)."""

from __future__ import annotations

import pytest

from prism.core import agents as A


@pytest.mark.parametrize("msg", [
    A.AgentHello("n1#1", "n1", 16, (0, 1), 123, node_rank=1),
    A.Launch((4, 5, 6, 7), 8, "tcp://h:1", "/shared/run", ("-m", "x", "--tp", "2"), "/w", 8, {"A": "1"}, (4,)),
    A.Exits({3: 0, 7: -9}), A.Exits({2: 0}, {2: 123 << 20}),
    A.Prepared({"path": "kernels", "reason": "", "checked_s": 1.5}), A.Prepared({}, "loading cuda_ext failed"),
    A.Prepared({}, "no checkpoint API", stage="swaps"),
    A.Launch((0, 1), 2, "tcp://h:1", "/r", ("x",), "/w", 8, swap={"driver": "simulated", "delay_s": 0.0}),
    A.Swap(7, 3, 4242, "out", 2), A.Swapped(7, "ok", 12.5, 0.25, 1 << 30), A.Swapped(8, error="restore failed"),
    A.AgentBeat(2), A.CoordinatorBeat(), A.KillAll("why"), A.Refused("no"),
])
def test_messages_round_trip_through_json(msg):
    import orjson

    assert A.decode(orjson.loads(orjson.dumps(A.encode(msg)))) == msg


def test_swap_messages_are_checked():
    with pytest.raises(A.AgentProtocolError, match="bad Swap message: swap direction 'sideways'"):
        A.decode({**A.encode(A.Swap(1, 0, 10, "out")), "direction": "sideways"})
    assert A.swap_spec({"driver": "checkpoint"}) == ("checkpoint", 0.0)
    assert A.swap_spec({"driver": "simulated", "delay_s": 0.5}) == ("simulated", 0.5)
    for spec, match in [({}, "swap driver None: expected one of checkpoint, simulated"),
                        ({"driver": "cuda"}, "swap driver 'cuda'"),
                        ({"driver": "simulated", "delay_s": -1}, "expected seconds, 0 or more"),
                        ({"driver": "simulated", "delay_s": "1"}, "expected seconds"),
                        ({"driver": "checkpoint", "delay_s": 1}, "takes no delay_s")]:
        with pytest.raises(ValueError, match=match):
            A.swap_spec(spec)


def test_ranks_share_their_nodes_gpus_in_blocks_for_the_swap_policy():
    # node 0: ranks 0-3 on GPUs (0, 1); node 1: ranks 4-7 on one GPU (its GPU 2: another index)
    assert A.node_gpu_of([[0, 1, 2, 3], [4, 5, 6, 7]], [(0, 1), (2,)]) == {0: 0, 1: 0, 2: 1, 3: 1,
                                                                          4: 2, 5: 2, 6: 2, 7: 2}
    # one simulated GPU per node: a GPU per node
    assert A.node_gpu_of([[0, 1], [2, 3], []], [(0,), (0,), (0,)]) == {0: 0, 1: 0, 2: 1, 3: 1}
    with pytest.raises(ValueError, match="node 1 has ranks 2-3 but no GPU"):
        A.node_gpu_of([[0, 1], [2, 3]], [(0,), ()])


def test_another_version_or_a_bad_message_is_named():
    d = A.encode(A.AgentBeat(1))
    with pytest.raises(A.AgentProtocolError, match="version 99, this side speaks 3: run the same Prism"):
        A.decode({**d, "v": 99})
    with pytest.raises(A.AgentProtocolError, match="unknown agent message type 'Nope'"):
        A.decode({**d, "t": "Nope"})
    with pytest.raises(A.AgentProtocolError, match="bad Exits"):
        A.decode({"t": "Exits", "v": A.AGENT_PROTOCOL_VERSION, "codes": {"x": 1}})
    with pytest.raises(A.AgentProtocolError, match="not an agent message"):
        A.decode([1])


@pytest.mark.parametrize("world, agents, gang, want", [
    (16, 2, 2, [list(range(8)), list(range(8, 16))]),
    (8, 3, 2, [[0, 1, 2, 3], [4, 5], [6, 7]]),
    (4, 4, 1, [[0], [1], [2], [3]]),
    (6, 1, 3, [list(range(6))]),
])
def test_blocks_are_contiguous_whole_gangs(world, agents, gang, want):
    got = A.assign_blocks(world, agents, gang)
    assert got == want
    assert sorted(r for b in got for r in b) == list(range(world))


@pytest.mark.parametrize("ranks, agents, gang, want", [
    ([0, 2], 2, 2, [[0], [2]]),            # two TP groups' sandboxes, one per agent
    ([0, 2], 1, 2, [[0, 2]]),              # one agent: a rank set with a gap
    ([0, 1, 2], 2, 2, [[0, 1], [2]]),      # TP partners stay together
    ([5, 0, 4], 2, 2, [[0], [4, 5]]),      # any order in, rank order out
    ([0, 1, 3, 8, 9, 10, 11], 3, 2, [[0, 1, 3], [8, 9], [10, 11]]),
    ([1, 6, 7], 3, 1, [[1], [6], [7]]),
])
def test_a_subset_of_ranks_is_placed_in_whole_gangs(ranks, agents, gang, want):
    got = A.place_ranks(ranks, agents, gang)
    assert got == want
    assert sorted(r for b in got for r in b) == sorted(ranks)
    for block in got:  # no gang is split between agents
        assert not {r // gang for r in block} & {r // gang for b in got if b is not block for r in b}


def test_a_whole_world_is_placed_as_assign_blocks_places_it():
    for gang in (1, 2, 3, 4):
        for world in range(gang, 33, gang):
            for agents in range(1, world // gang + 1):
                assert A.place_ranks(range(world), agents, gang) == A.assign_blocks(world, agents, gang)


def test_agents_beyond_the_gangs_get_empty_blocks():
    # a calibration slice (one TP group) over more agents than it has gangs:
    # the last agents have nothing in this run, the others as with fewer agents
    assert A.place_ranks([0, 1], 2, 2) == [[0, 1], []]
    assert A.place_ranks([4, 6], 4, 2) == [[4], [6], [], []]
    assert A.place_ranks([0, 1, 2, 3], 3, 2) == [[0, 1], [2, 3], []]
    with pytest.raises(ValueError, match="no rank to place"):
        A.place_ranks([], 2)
    with pytest.raises(ValueError, match="at least 1"):
        A.place_ranks([0], 0)


def test_a_given_placement_is_checked_and_padded():
    # a calibration's round: one slice per node, in node order
    assert A.check_placement([[2, 3], [0, 1]], [0, 1, 2, 3], 3) == [[2, 3], [0, 1], []]
    assert A.check_placement([[1, 0]], [0, 1], 1) == [[0, 1]]
    with pytest.raises(ValueError, match="2 blocks for 1 agent"):
        A.check_placement([[0], [1]], [0, 1], 1)
    with pytest.raises(ValueError, match="rank 1 is placed on agents 0 and 1"):
        A.check_placement([[0, 1], [1]], [0, 1], 2)
    with pytest.raises(ValueError, match=r"ranks \[2\] are on no agent"):
        A.check_placement([[0, 1]], [0, 1, 2], 2)
    with pytest.raises(ValueError, match=r"ranks \[5\] are not among them"):
        A.check_placement([[0, 1], [5]], [0, 1], 2)


def test_impossible_placements_say_why():
    with pytest.raises(ValueError, match="2 agents for 1 gang"):
        A.assign_blocks(4, 2, 4)
    with pytest.raises(ValueError, match="does not split into gangs of 4"):
        A.assign_blocks(6, 1, 4)
    with pytest.raises(ValueError, match="at least 1"):
        A.assign_blocks(6, 0)


@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a[9-10]b,c", ["a9b", "a10b", "c"]),
])
def test_slurm_nodelists_expand(text, hosts):
    assert A.expand_nodelist(text) == hosts


def test_discovery_reads_slurm_and_torchrun():
    d = A.discover({"SLURM_NODEID": "2", "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "gpu[05-08]"})
    assert (d.node_rank, d.nnodes, d.coordinator_host, d.source) == (2, 4, "gpu05", "slurm")
    d = A.discover({"MASTER_ADDR": "head", "MASTER_PORT": "29500", "NODE_RANK": "1", "NNODES": "2"})
    assert (d.node_rank, d.nnodes, d.coordinator_host, d.port, d.source) == (1, 2, "head", 29500, "torchrun")
    d = A.discover({"MASTER_ADDR": "head", "GROUP_RANK": "3", "GROUP_WORLD_SIZE": "4"})
    assert (d.node_rank, d.nnodes) == (3, 4)


@pytest.mark.parametrize("env, match", [
    ({}, "no launcher environment found .* pass --coordinator"),
    ({"MASTER_ADDR": "h"}, "neither NODE_RANK nor GROUP_RANK"),
    ({"SLURM_NODEID": "0"}, "SLURM_JOB_NODELIST is not"),
    ({"SLURM_NODEID": "x", "SLURM_JOB_NODELIST": "a"}, "SLURM_NODEID='x' is not a whole number"),
])
def test_discovery_says_what_is_missing(env, match):
    with pytest.raises(ValueError, match=match):
        A.discover(env)


def test_agent_options_resolve_from_the_environment():
    from prism.app.agent import AgentRunConfig, resolve
    from prism.app.errors import UsageError

    env = {"SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n2"}
    assert resolve(AgentRunConfig(keys="k", port=4000), env) == ("tcp://n1:4000", 1, "n2")
    assert resolve(AgentRunConfig("tcp://x:5", node_rank=3), env) == ("tcp://x:5", 3, "n2")
    with pytest.raises(UsageError, match="expected tcp://HOST:PORT"):
        resolve(AgentRunConfig("ipc:///x"), env)


def test_capture_options_for_agents_are_checked(tmp_path):
    from prism.app.capture import CaptureConfig, plan_capture
    from prism.app.errors import UsageError

    cmd = ["-m", "prism.workloads.gpt", "--tp", "2", "--pp", "2", "--dp", "1"]
    for kw, match in [
        (dict(agents=2), "needs --listen tcp://HOST:PORT"),
        (dict(agents=2, listen="tcp://127.0.0.1:1"), "pass --keys DIR .* or --insecure"),
        (dict(agents=3, listen="tcp://127.0.0.1:1", insecure=True), "3 agents for 2 gang"),
        (dict(keys="k"), "add --agents N"),
        (dict(agents=2, listen="tcp://127.0.0.1:1", insecure=True, gpus="0"), "each node's agent offers its own"),
        (dict(agents=2, listen="tcp://127.0.0.1:1", insecure=True, resident=2), "the command runs on CPU: give the "
                                                                                "script its cuda device"),
        (dict(agents=2, listen="tcp://127.0.0.1:1", insecure=True, gang="tp"), "add it, or drop --gang"),
        (dict(agents=2, listen="tcp://127.0.0.1:1", insecure=True, resident=2, simulate_swaps=0.0,
              memory_limit_gib=4), "emulates a smaller GPU"),
        (dict(agents=2, listen="tcp://127.0.0.1:1", insecure=True, resident=1, simulate_swaps=0.0),
         "--resident 1 is less than the gang size 2"),
        # world 4 = tp2 x pp2: the pipeline (ranks 0-3) would span the two nodes
        (dict(agents=2, listen="tcp://127.0.0.1:1", insecure=True, resident=4, gang="tpxpp", simulate_swaps=0.0),
         r"--gang tpxpp with --agents 2: gang 0 \(ranks 0-3\) would span nodes \[0, 1\].*use --gang tp"),
    ]:
        with pytest.raises(UsageError, match=match):
            plan_capture(CaptureConfig(4, cmd, out=tmp_path / "run", **kw))
    # --resident through agents: the swap plan's driver goes to each agent; its GPUs come when they join
    plan = plan_capture(CaptureConfig(4, cmd, out=tmp_path / "run", agents=2, listen="tcp://127.0.0.1:1",
                                      insecure=True, resident=2, simulate_swaps=0.25))
    assert not plan.agent_gpus and plan.gpu.simulated and plan.gpu.gang == "tp"
    assert plan.gpu.agent_swap == {"driver": "simulated", "delay_s": 0.25} and plan.gpu.rank_gpu is None
    plan = plan_capture(CaptureConfig(4, [*cmd, "--device", "cuda"], out=tmp_path / "run", agents=2,
                                      listen="tcp://127.0.0.1:1", insecure=True, resident=2))
    assert plan.agent_gpus and plan.gpu.agent_swap == {"driver": "checkpoint"} and not plan.gpu.simulated
    # a CUDA command through agents: planned on the agents' GPUs once they join, not this machine's
    plan = plan_capture(CaptureConfig(4, [*cmd, "--device", "cuda"], out=tmp_path / "run", agents=2,
                                      listen="tcp://127.0.0.1:1", insecure=True))
    assert plan.agent_gpus and plan.gpu is None and plan.agent_memory_limit_bytes is None
    # --memory-limit through agents: every node's ranks get the same allocator budget
    plan = plan_capture(CaptureConfig(4, [*cmd, "--device", "cuda"], out=tmp_path / "run", agents=2,
                                      listen="tcp://127.0.0.1:1", insecure=True, memory_limit_gib=2.6))
    assert plan.agent_memory_limit_bytes == 2 * 2**30 and "torch's allocator may hold 2.00 GiB" in plan.notes[0]
    for kw, match in [(dict(memory_limit_gib=0.5), "leaves nothing for torch's allocator"),
                      (dict(memory_limit_gib=4, cpu=True), "emulates a smaller GPU for ranks that use one")]:
        cpu = kw.pop("cpu", False)
        with pytest.raises(UsageError, match=match):
            plan_capture(CaptureConfig(4, [*cmd, "--device", "cpu" if cpu else "cuda"], out=tmp_path / "run",
                                       agents=2, listen="tcp://127.0.0.1:1", insecure=True, **kw))


def test_a_cuda_capture_puts_each_nodes_ranks_on_its_own_gpus():
    from prism.app.capture import agent_gpu_env
    from prism.app.errors import UsageError
    from prism.rank.devices import choose_node_gpu

    a = A.AgentHello("n0#0", "n0", 16, (0, 1), 1, node_rank=0)
    b = A.AgentHello("n1#1", "n1", 16, (2,), 2, node_rank=1)
    env = agent_gpu_env([(a, [0, 1, 2, 3]), (b, [4, 5, 6, 7])])
    assert env == {("n0#0", "n0", 1): {"PRISM_GPUS": "0,1", "PRISM_NODE_RANKS": "0-3"},
                   ("n1#1", "n1", 2): {"PRISM_GPUS": "2", "PRISM_NODE_RANKS": "4-7"}}
    twin = A.AgentHello("n0#0", "n0", 16, (1,), 9, node_rank=0)  # the same name: still two agents
    assert len(agent_gpu_env([(a, [0, 1]), (twin, [2, 3])])) == 2
    # in the rank: its place among its node's ranks picks among its node's GPUs
    assert [choose_node_gpu(r, 8, [0, 1], "0-3") for r in range(4)] == [0, 0, 1, 1]
    assert [choose_node_gpu(r, 8, [2], "4-7") for r in range(4, 8)] == [2, 2, 2, 2]
    assert choose_node_gpu(5, 8, [0, 1], None) == 1  # one machine: the world's blocks, as before
    with pytest.raises(ValueError, match="rank 9 is not among this node's ranks PRISM_NODE_RANKS=4-7"):
        choose_node_gpu(9, 16, [0], "4-7")
    with pytest.raises(UsageError, match="agent n1#1 .host n1. offers no GPU for its ranks 4-7: start it on a node "
                                         "with GPUs, or with --gpus"):
        agent_gpu_env([(a, [0, 1, 2, 3]), (A.AgentHello("n1#1", "n1", 16, (), 2), [4, 5, 6, 7])])
    assert agent_gpu_env([(a, [0, 1]), (A.AgentHello("n2", "n2", 4, (), 3), [])]) == {
        ("n0#0", "n0", 1): {"PRISM_GPUS": "0,1", "PRISM_NODE_RANKS": "0-1"}}  # a node with no ranks needs no GPU


def test_an_agents_gpus_option(monkeypatch):
    import prism.shell.gpu_plan as G
    from prism.app.agent import node_gpus
    from prism.app.errors import UsageError

    monkeypatch.setattr(G, "visible_gpus", lambda: [])  # no NVML: nothing to check against
    assert node_gpus("0,1") == (0, 1) and node_gpus("none") == () and node_gpus("cuda:3") == (3,)
    assert node_gpus(None) == ()
    for bad, match in [("a", "is not a GPU index"), ("0,0", "distinct GPU indices"), ("", "distinct GPU")]:
        with pytest.raises(UsageError, match=match):
            node_gpus(bad)
    monkeypatch.setattr(G, "visible_gpus", lambda: [0, 1])
    assert node_gpus(None) == (0, 1) and node_gpus("1") == (1,)
    with pytest.raises(UsageError, match=r"--gpus 0,2: GPU 2 is not on this node \(NVML sees \[0, 1\]\)"):
        node_gpus("0,2")


def test_each_node_computes_on_its_own_slots():
    from prism.core import scheduler as S

    # Ranks 0-3 on node 0 (1 slot), 4-7 on node 1 (2 slots); 8 slots in all.
    sched = S.Scheduler(8, range(8), nodes={r: r // 4 for r in range(8)}, node_slots=[1, 2])
    grants = [a.rank for r in (0, 1, 2, 4, 5, 6) for a in sched.request(r)]
    assert grants == [0, 4, 5]
    assert sched.waiting == (1, 2, 6)
    assert [a.rank for a in sched.release(5)] == [6]  # node 1's slot goes to node 1's rank
    assert [a.rank for a in sched.finish(0)] == [1]
    assert sched.running == [4, 6, 1]
    with pytest.raises(ValueError, match="both nodes"):
        S.Scheduler(2, range(2), nodes={0: 0, 1: 0})
    with pytest.raises(ValueError, match="at least 1 slot"):
        S.Scheduler(2, range(2), nodes={0: 0, 1: 1}, node_slots=[1, 0])


def test_a_swap_policy_picks_among_the_ranks_a_nodes_slot_can_take():
    """With ranks on nodes, the scheduler asks the swap policy which rank to
    grant among those whose node has a free slot (as on one machine): a
    resident rank goes before one that would swap a gang out, and nothing is
    granted while the policy holds the slots back."""
    from prism.core import scheduler as S
    from prism.core.residency import GangResidency

    # Node 0: ranks 0-3 on its one GPU (gangs {0,1}, {2,3}), --resident 2; node 1: ranks 4-7 likewise.
    gangs = {r: r // 2 for r in range(8)}
    policy = GangResidency(2, gangs, {r: r // 4 for r in range(8)})
    sched = S.Scheduler(2, range(8), policy, nodes={r: r // 4 for r in range(8)}, node_slots=[1, 1])
    def acts(actions):
        return [(type(a).__name__, a.rank) for a in actions]

    assert acts(sched.request(0)) == [("Grant", 0)]  # gang {0,1} comes in
    assert sched.request(1) == []  # node 0's slot is taken
    assert acts(sched.release(0)) == [("Grant", 1)]
    assert sched.request(2) == [] and sched.request(0) == []  # line: 2, then 0
    # rank 1 blocks: rank 0 (resident, behind rank 2 in line) goes first; no swap
    assert acts(sched.release(1)) == [("Grant", 0)]
    # rank 0 blocks: rank 2's gang comes in, swapping gang {0,1} out
    got = acts(sched.release(0))
    assert got[-1] == ("Grant", 2) and ("SwapOut", 0) in got and ("SwapOut", 1) in got, got
    # a grant for node 1 is not held up by node 0
    assert acts(sched.request(4)) == [("Grant", 4)]


def test_a_cuda_swap_plan_through_agents_takes_each_nodes_gpus(tmp_path):
    """Once the agents joined: each rank's GPU is its node's (a GPU index per
    (node, GPU)), the policy and the coordinator's ``AgentSwapper`` exist
    only where a GPU holds more ranks than --resident, and a gang split over
    two GPUs of a node refuses the agents with the reason."""
    from prism.app.capture import CaptureConfig, plan_capture, setup_agent_swaps
    from prism.app.errors import UsageError
    from prism.shell.agent import AgentSwapper

    class Procs:
        def __init__(self, gpus):
            self.hellos = [A.AgentHello(f"n{i}", f"h{i}", 8, g, 10 + i, node_rank=i) for i, g in enumerate(gpus)]
            self.closed = None

        def placement(self):
            return [(h, list(range(4 * i, 4 * i + 4))) for i, h in enumerate(self.hellos)]

        def close(self, reason):
            self.closed = reason

    def plan(resident, gang=None, layout=("--tp", "2", "--pp", "1", "--dp", "4")):
        return plan_capture(CaptureConfig(8, ["-m", "prism.workloads.gpt", *layout, "--device", "cuda"],
                                          out=tmp_path / "run", agents=2, listen="tcp://127.0.0.1:1", insecure=True,
                                          resident=resident, gang=gang)).gpu

    gpu = plan(2)
    setup_agent_swaps(gpu, Procs([(0,), (3, 5)]), tmp_path)
    assert gpu.rank_gpu == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 2, 7: 2}
    assert gpu.swapping and isinstance(gpu.executor, AgentSwapper) and gpu.policy.max_resident == 2
    assert gpu.settings["ranks_per_gpu"] == 4 and gpu.settings["agents"][1] == {
        "node": "n1", "host": "h1", "ranks": "4-7", "gpus": [3, 5]}
    gpu.executor.close()
    gpu = plan(2)
    setup_agent_swaps(gpu, Procs([(0, 1), (0, 1)]), tmp_path)  # two ranks per GPU: all resident
    assert not gpu.swapping and gpu.policy is None and gpu.executor is None
    # node 0's 4 ranks over its 3 GPUs: 0, 0, 1, 2, so TP group {2, 3} would span GPUs 1 and 2
    gpu = plan(2)
    procs = Procs([(0, 1, 2), (0,)])
    with pytest.raises(UsageError, match=r"--resident 2 through agents: gang 1 \(ranks \[2, 3\]\) spans GPUs \[1, 2\]"):
        setup_agent_swaps(gpu, procs, tmp_path)
    assert procs.closed and "spans GPUs" in procs.closed
