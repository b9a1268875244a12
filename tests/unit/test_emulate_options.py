"""``prism emulate``'s GPU options, checked before anything is launched."""

import pytest

from prism.app import emulate as E
from prism.app.errors import UsageError


def test_a_cpu_capture_needs_no_gpu_env():
    assert E._gpu_env(E.EmulateConfig(run="r"), "cpu", [0, 3]) == {"PRISM_SANDBOX_RANKS": "0,3"}


def test_sandboxes_take_one_gpu_each_while_they_fit(monkeypatch):
    # a slice of world 8 on --gpus 0,1: before, its ranks took GPUs as blocks of
    # the whole world (ranks 0-3 on GPU 0), so sandboxes 2 and 3 shared GPU 0
    import prism.shell.gpu_plan as G
    from prism.rank.devices import choose_node_gpu

    monkeypatch.setattr(G, "visible_gpus", lambda: [0, 1])
    env = E._gpu_env(E.EmulateConfig(run="r", gpus="0,1"), "cuda", [3, 2])
    assert env["PRISM_NODE_RANKS"] == "2,3"
    assert [choose_node_gpu(r, 8, [0, 1], env["PRISM_NODE_RANKS"]) for r in (2, 3)] == [0, 1]
    env = E._gpu_env(E.EmulateConfig(run="r", gpus="0,1"), "cuda", [0, 5, 6, 7])
    assert [choose_node_gpu(r, 8, [0, 1], env["PRISM_NODE_RANKS"]) for r in (0, 5, 6, 7)] == [0, 0, 1, 1]


def test_a_memory_limit_on_cpu_is_refused():
    with pytest.raises(UsageError, match="--memory-limit emulates a smaller GPU"):
        E._gpu_env(E.EmulateConfig(run="r", memory_limit_gib=4), "cpu", [0])


def test_gpus_must_be_visible_and_well_formed(monkeypatch):
    import prism.shell.gpu_plan as G

    monkeypatch.setattr(G, "visible_gpus", lambda: [0])
    with pytest.raises(UsageError, match="GPU 3 is not visible here"):
        E._gpu_env(E.EmulateConfig(run="r", gpus="3"), "cuda", [0])
    with pytest.raises(UsageError, match="--gpus takes GPU indices"):
        E._gpu_env(E.EmulateConfig(run="r", gpus="a"), "cuda", [0])
    env = E._gpu_env(E.EmulateConfig(run="r", memory_limit_gib=2.6), "cuda", [0, 1])  # cuda capture: GPU 0
    assert env["PRISM_GPUS"] == "0" and env["PRISM_SANDBOX_RANKS"] == "0,1" and "PRISM_GPU_SANDBOX" not in env and int(env["PRISM_MEMORY_LIMIT_BYTES"]) == 2 * 2**30
    on = E._gpu_env(E.EmulateConfig(run="r", device_path=True), "cuda", [0])
    assert on["PRISM_GPU_SANDBOX"] == "1" and on["CUDA_MODULE_LOADING"] == "EAGER"  # the device path, opt-in
    with pytest.raises(UsageError, match="leaves nothing"):
        E._gpu_env(E.EmulateConfig(run="r", memory_limit_gib=0.5), "cuda", [0])


@pytest.mark.parametrize("kw, match", [
    ({"keys": "k"}, "--listen, --keys and --insecure are for an emulation served by agents: add --agents N"),
    ({"agents": 2, "gpus": "0"}, "each node's agent offers its own"),
    ({"agents": 2, "device_path": True}, "--device-path runs GPU sandboxes on the device path, but this capture ran on CPU"),
    ({"agents": 2, "memory_limit_gib": 4}, "--memory-limit emulates a smaller GPU, but this capture ran on CPU"),
    ({"agents": 2}, "needs --listen tcp://HOST:PORT"),
    ({"agents": 2, "listen": "tcp://127.0.0.1:1"}, "pass --keys DIR .* or --insecure"),
])
def test_agent_options_are_checked_before_any_agent_is_awaited(tmp_path, kw, match):
    from tests.unit.test_scale_emulation import MegatronSpec, _run

    run = _run(tmp_path, MegatronSpec(tp=2, pp=2, dp=2, iterations=1))
    with pytest.raises(UsageError, match=match):
        E.emulate(E.EmulateConfig(run=run, **kw))


def test_a_cuda_capture_through_agents_takes_the_nodes_gpus(tmp_path):
    import dataclasses
    import threading

    import orjson
    import zmq

    from prism.app.predict import load_run_manifest
    from prism.core import agents as A
    from prism.shell import runfolder
    from tests.unit.test_scale_emulation import MegatronSpec, _run
    from transport.endpoints import free_tcp_endpoint

    # the sandboxes' environment names no GPU of this machine: each node's Launch brings its own
    env = E._gpu_env(E.EmulateConfig(run="r", agents=2, memory_limit_gib=2.6), "cuda", [0, 1])
    assert env["PRISM_SANDBOX_RANKS"] == "0,1" and "PRISM_GPUS" not in env
    assert int(env["PRISM_MEMORY_LIMIT_BYTES"]) == 2 * 2**30

    run = _run(tmp_path, MegatronSpec(tp=2, pp=2, dp=2, iterations=1))
    runfolder.write_manifest(run, dataclasses.replace(load_run_manifest(run), device_kind="cuda"))
    ep, said = free_tcp_endpoint(), []

    def gpu_less_agent():  # joins, offers no GPU, and hears why it is refused
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(ep)
        sock.send(orjson.dumps(A.encode(A.AgentHello("n0#0", "h0", 4, (), 1, node_rank=0))))
        while sock.poll(10_000):
            msg = A.decode(orjson.loads(sock.recv()))
            if isinstance(msg, A.Refused):
                said.append(msg.reason)
                break
        sock.close()

    t = threading.Thread(target=gpu_less_agent)
    t.start()
    with pytest.raises(UsageError, match="agent n0#0 .host h0. offers no GPU for its ranks 0"):
        E.emulate(E.EmulateConfig(run=run, agents=1, listen=ep, insecure=True, agent_wait_s=10))
    t.join(timeout=15)
    assert said and "offers no GPU" in said[0]


def test_the_device_path_checks_cuda_ext_before_any_sandbox_starts(tmp_path, monkeypatch):
    # in a process of its own, with the sandboxes' environment: here (no GPU) the fallback, said once
    notes = []
    info = E.prepare_kernels({"PRISM_CUDA_EXT": "off"}, notes.append)
    assert info["path"] == "fallback" and info["reason"] == "PRISM_CUDA_EXT=off"
    assert len(notes) == 1 and "not in use (PRISM_CUDA_EXT=off)" in notes[0]
    (tmp_path / "cuda_ext.py").write_text("raise ImportError('no such build')\n")  # a broken install
    with pytest.raises(UsageError, match="loading cuda_ext failed .exit code 1.: .*no such build"):
        monkeypatch.chdir(tmp_path)
        E.prepare_kernels({}, notes.append)


def test_a_kernel_check_beats_while_it_runs_and_names_a_broken_build(tmp_path, monkeypatch):
    from prism.shell.kernels import KernelCheckError, check_kernels

    ticks = []
    info = check_kernels({"PRISM_CUDA_EXT": "off"}, tick=lambda: ticks.append(1), tick_s=0.01)
    assert info["path"] == "fallback" and info["checked_s"] > 0 and ticks  # a python start outlasts 10 ms
    (tmp_path / "cuda_ext.py").write_text("import time; time.sleep(30)\n")  # a build that never ends
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KernelCheckError, match="took over 0.3 s; build them first"):
        check_kernels({}, timeout_s=0.3, tick_s=0.05)


def test_an_agent_checks_the_kernels_on_its_node_before_its_device_path_sandboxes(tmp_path, monkeypatch):
    """Through agents each node builds or loads cuda_ext itself (a Prepared
    to the coordinator, beating meanwhile); a node whose check fails starts
    none of its ranks and the run's report names it."""
    import threading

    from prism.shell import agent as AG
    from transport.endpoints import free_tcp_endpoint

    sent = []
    assert AG._prepare_kernels({"PRISM_CUDA_EXT": "off"}, sent.append, 2, lambda _: None)
    prepared = [m for m in sent if isinstance(m, AG.A.Prepared)]
    assert len(prepared) == 1 and prepared[0].kernels["reason"] == "PRISM_CUDA_EXT=off" and not prepared[0].error

    (tmp_path / "cuda_ext.py").write_text("raise ImportError('no such build')\n")  # this node's install is broken
    monkeypatch.chdir(tmp_path)
    ep = free_tcp_endpoint()
    procs = AG.AgentProcesses(ep, 1, 4, keys=None, insecure=True)
    out = {}
    t = threading.Thread(target=lambda: out.update(o=AG.run_agent(AG.AgentConfig(ep, insecure=True, node="n7",
                                                                                  wait_s=20))))
    t.start()
    try:
        procs.wait_agents(20)
        procs.place(1, [2])
        procs.launch("tcp://127.0.0.1:1", tmp_path / "emu", ["-c", "raise SystemExit(3)"],
                     env={"PRISM_GPU_SANDBOX": "1"})
        assert procs.wait(timeout=20)[2] == 1
        assert "agent n7" in procs.lost() and "ranks 2" in procs.lost()
        assert "could not start its device-path sandboxes: loading cuda_ext failed" in procs.lost()
        assert "no such build" in procs.lost() and not procs.kernels
    finally:
        procs.close()
        t.join(timeout=20)
    assert out["o"].codes == {2: 1} and "could not be checked" in out["o"].stopped


def test_early_releases_tell_the_sandboxes_to_send_each_arrival_at_its_issue(monkeypatch):
    # protocol 12 sends a device-path call's arrival at its reach; an early release needs it at the
    # issue, and ranks on agents do not inherit the emulating process's environment
    monkeypatch.delenv("PRISM_EARLY_RELEASE", raising=False)
    env = E._gpu_limits(E.EmulateConfig(run="r", device_path=True), {}, 0.0)
    assert env["PRISM_GPU_SANDBOX"] == "1" and "PRISM_DEVICE_ARRIVE_AT_REACH" not in env
    monkeypatch.setenv("PRISM_EARLY_RELEASE", "1")
    env = E._gpu_limits(E.EmulateConfig(run="r", device_path=True), {}, 0.0)
    assert env["PRISM_DEVICE_ARRIVE_AT_REACH"] == "0"
