"""The capture's GPU plan (prism/shell/gpu_plan.py) and GPU telemetry (prism/shell/telemetry.py)
on a machine without GPUs: fakes stand in for NVML."""

import json
import sys
import time
import types

import pytest

from prism.shell import runfolder, telemetry
from prism.shell.gpu_plan import GpuPlanError, plan_gpus


def test_cpu_capture_has_no_plan():
    assert plan_gpus(8, {"tp": 2}, uses_cuda=False, gpus=None, resident=None, gang=None, slots=None) is None


def test_explicit_plan_places_ranks_in_blocks_and_swaps_when_not_all_fit():
    plan = plan_gpus(8, {"tp": 2, "pp": 2, "dp": 2}, uses_cuda=True, gpus="0,1", resident=2, gang=None, slots=None)
    assert plan.gpus == [0, 1] and plan.slots == 2 and plan.gang == "tp"
    assert plan.gpu_of() == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}
    assert plan.swapping and plan.env() == {"PRISM_GPUS": "0,1"}
    assert plan.settings["gang_size"] == 2 and plan.settings["layout"] == {"tp": 2, "dp": 2, "pp": 2}
    all_fit = plan_gpus(8, {}, uses_cuda=True, gpus="0", resident=8, gang="1", slots=None)
    assert not all_fit.swapping


def test_setup_builds_policy_and_executor_before_any_coordinator(tmp_path):
    from prism.core.residency import GangResidency
    from prism.shell.swap import SimulatedDriver

    plan = plan_gpus(8, {"tp": 2}, uses_cuda=True, gpus="0,1", resident=2, gang=None, slots=None)
    plan.driver = SimulatedDriver()
    plan.setup(tmp_path / "run")
    assert isinstance(plan.policy, GangResidency) and plan.policy.gpu_of == plan.gpu_of()
    assert plan.executor.driver is plan.driver
    plan.executor.close()
    assert (tmp_path / "run" / "telemetry" / "swaps.jsonl").exists()
    all_fit = plan_gpus(8, {}, uses_cuda=True, gpus="0", resident=8, gang="1", slots=None)
    all_fit.setup(tmp_path / "other")
    assert all_fit.policy is None and all_fit.executor is None


def test_tpxpp_with_expert_parallelism_gets_a_note():
    # Dense: one DP all-reduce per step crosses pipelines, tpxpp swapped least
    # on the H200 (19 swaps per iteration vs 32 with TP gangs): no note.
    lay = {"tp": 2, "pp": 2, "dp": 2}
    assert plan_gpus(8, lay, uses_cuda=True, gpus="0", resident=4, gang="tpxpp", slots=None).notes == []
    moe = plan_gpus(8, {**lay, "ep": 2}, uses_cuda=True, gpus="0", resident=4, gang="tpxpp", slots=None)
    assert len(moe.notes) == 1 and "every all-to-all between pipelines" in moe.notes[0]
    assert "--simulate-swaps" in moe.notes[0]
    assert plan_gpus(8, {**lay, "ep": 2}, uses_cuda=True, gpus="0", resident=4, gang="tp", slots=None).notes == []
    # Everything resident: nothing swaps, no note.
    assert plan_gpus(8, {**lay, "ep": 2}, uses_cuda=True, gpus="0", resident=8, gang="tpxpp", slots=None).notes == []


@pytest.mark.parametrize("kw, match", [
    (dict(resident=1, gang="tp"), "less than the gang size 2"),
    (dict(resident=4, gang="tpxpp", layout={"tp": 2, "pp": 3}), "multiply to the world size"),
    (dict(resident=0, gang="1"), "at least 1"),
])
def test_bad_gpu_options_say_what_to_change(kw, match):
    layout = kw.pop("layout", {"tp": 2, "pp": 2})
    with pytest.raises(GpuPlanError, match=match):
        plan_gpus(8, layout, uses_cuda=True, gpus="0", slots=None, **kw)


class _Mem:
    def __init__(self, used, total, free):
        self.used, self.total, self.free = used, total, free


def _fake_pynvml(free=100 * 2**30):
    nv = types.SimpleNamespace()
    nv.NVMLError = type("NVMLError", (Exception,), {})
    nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM, nv.NVML_TEMPERATURE_GPU = 1, 2, 0
    nv.nvmlInit = lambda: None
    nv.nvmlDeviceGetCount = lambda: 1
    nv.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    nv.nvmlDeviceGetMemoryInfo = lambda h: _Mem(5 * 2**30, 140 * 2**30, free)
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=42, memory=7)
    nv.nvmlDeviceGetPowerUsage = lambda h: 250_000
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x4 | 0x40
    nv.nvmlDeviceGetClockInfo = lambda h, kind: {1: 1980, 2: 3201}[kind]
    nv.nvmlDeviceGetTemperature = lambda h, kind: 61

    def procs(h):
        raise nv.NVMLError("not supported")

    nv.nvmlDeviceGetComputeRunningProcesses = procs
    return nv


def test_default_resident_comes_from_free_memory(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(free=int(9.5 * 2**30)))
    plan = plan_gpus(16, {"tp": 2}, uses_cuda=True, gpus=None, resident=None, gang=None, slots=None,
                     rank_memory_gib=2.0)
    assert plan.gpus == [0] and plan.resident == 4 and plan.swapping
    assert "9.5 GiB free / 2.0 GiB per rank" in plan.why


def test_sampler_writes_one_line_per_gpu_and_sample(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    s = telemetry.GpuSampler(tmp_path, interval_s=0.01)
    assert s.start()
    time.sleep(0.1)
    s.stop()
    rows = [json.loads(line) for line in runfolder.gpu_samples_path(tmp_path).read_text().splitlines()]
    assert len(rows) == s.samples >= 2
    r = rows[0]
    assert (r["gpu"], r["mem_used"], r["util_gpu"], r["sm_clock_mhz"], r["mem_clock_mhz"], r["temp_c"],
            r["power_w"]) == (0, 5 * 2**30, 42, 1980, 3201, 61, 250.0)
    assert r["throttle"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert telemetry.process_memory(123) == 0  # the fake NVML cannot list processes


def test_sampler_skips_cleanly_without_nvml(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    s = telemetry.GpuSampler(tmp_path)
    assert not s.start() and "pynvml" in s.skipped
    s.stop()
    assert not runfolder.gpu_samples_path(tmp_path).exists()
