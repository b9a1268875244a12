"""The script's memory readings and Prism's per-step peaks are kept apart
(prism.rank.memstats), shown on a fake allocator: the same bookkeeping runs on
a GPU in tests/integration/test_memory_readings.py."""

import pytest

from prism.rank import memstats


class FakeAllocator:
    """torch's counters for one device: current and peak allocated bytes."""

    def __init__(self):
        self.current = self.peak = 0

    def alloc(self, n):
        self.current += n
        self.peak = max(self.peak, self.current)

    def free(self, n):
        self.current -= n

    def stats(self, device):
        pools = {"all": {"current": self.current, "peak": self.peak, "allocated": 0, "freed": 0}}
        return {"allocated_bytes": pools, "reserved_bytes": {"all": {"current": 0, "peak": 0}}, "num_ooms": 0}

    def reset(self, device):
        self.peak = self.current


@pytest.fixture
def fake(monkeypatch):
    a = FakeAllocator()
    monkeypatch.setattr(memstats, "_real_stats", a.stats)
    monkeypatch.setattr(memstats, "_real_reset", a.reset)
    monkeypatch.setattr(memstats, "_script_book", {})
    monkeypatch.setattr(memstats, "_prism_book", {})
    return a


def script_peak():
    return memstats._script_stats(0)["allocated_bytes"]["all"]["peak"]


def test_prisms_step_resets_do_not_lower_the_scripts_peak(fake):
    fake.alloc(100)
    fake.free(100)           # step 0 peaks at 100
    assert memstats.step_sample(0) == (0, 0, 100)
    fake.alloc(40)           # step 1 peaks at 40
    assert script_peak() == 100  # without Prism: the peak since the start
    assert memstats.step_sample(0)[2] == 40
    assert script_peak() == 100


def test_the_scripts_reset_starts_its_window_and_prism_still_sees_the_step_peak(fake):
    fake.alloc(100)
    fake.free(60)            # current 40, peak 100
    memstats._script_reset(0)
    assert script_peak() == 40   # as torch would say after a reset
    fake.alloc(10)
    assert script_peak() == 50
    assert memstats.step_sample(0)[2] == 100  # Prism's step saw the 100 before the script's reset
    assert script_peak() == 50


def test_other_fields_pass_through(fake):
    fake.alloc(7)
    s = memstats._script_stats(0)
    assert s["allocated_bytes"]["all"]["current"] == 7 and s["num_ooms"] == 0


def test_mem_get_info_on_a_shared_gpu_answers_as_if_alone(monkeypatch):
    import torch
    import torch.cuda.memory as cmem

    # the real call sees the other ranks' memory too: 10 of 100 free
    monkeypatch.setattr(cmem, "mem_get_info", lambda device=None: (10, 100))
    monkeypatch.setattr(torch.cuda, "mem_get_info", cmem.mem_get_info)
    monkeypatch.setattr(memstats, "_process_bytes", lambda pid: 30)
    memstats._install_mem_get_info(torch)
    assert torch.cuda.mem_get_info() == (70, 100) and cmem.mem_get_info(0) == (70, 100)
    monkeypatch.setattr(memstats, "_process_bytes", lambda pid: 0)  # NVML cannot tell: the real answer
    assert torch.cuda.mem_get_info() == (10, 100)
