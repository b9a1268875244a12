"""prism.validation.cpunoise and the step clock's scheduler lines: what the
FSDP2 truth study (bench/cpu_noise.py) reads. Runs on CPU; the plain-run path
with gloo on two ranks: tests/integration/test_cpu_noise_runs.py."""

import json
import pathlib

import pytest

from prism.validation import cpunoise as noise
from prism.validation import stepclock as clock

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_step_clock_writes_scheduler_lines_its_parser_skips():
    line = clock.sched_line(3)
    if not pathlib.Path("/proc/thread-self/schedstat").exists():
        pytest.skip("no /proc/thread-self/schedstat (not Linux, or no schedstats)")
    word, step, cpu, run_ns, wait_ns = line.split()
    assert word == "sched" and step == "3" and int(cpu) >= 0 and int(run_ns) > 0 and int(wait_ns) >= 0
    ends, mem = clock.parse(f"0 100\n{line}mem-peak 0 5 6\n1 250\n")
    assert ends == [100, 250] and mem == {"mem-peak": [0, 5, 6]}


def test_profiled_sums_randn_and_kernels_and_tolerates_a_missing_file(tmp_path):
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::randn", "ts": 0, "dur": 47000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::randn", "ts": 50000, "dur": 3000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::normal_", "ts": 1, "dur": 46000},  # nested: not counted
        {"ph": "X", "cat": "kernel", "name": "sgemm", "ts": 60000, "dur": 5500},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 1},
    ]}
    path = tmp_path / "profile-rank-0.json"
    path.write_text(json.dumps(trace))
    assert noise.profiled(path) == {"randn_ms": 50.0, "kernel_ms": 5.5}
    assert noise.profiled(tmp_path / "missing.json") == {}


def test_cpu_pairs_come_from_the_topology():
    topo = {"affinity": [0, 1, 2, 3], "siblings": {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"},
            "core": {0: [0, 0], 1: [0, 1], 2: [0, 0], 3: [0, 1]}}
    assert noise.pick_cpus(topo) == (2, 0, 1)  # CPU 2, its sibling 0, CPU 1 on another core
    flat = {"affinity": [0, 1], "siblings": {0: "0", 1: "1"}, "core": {0: [0, 0], 1: [0, 1]}}
    assert noise.pick_cpus(flat) == (1, -1, 0)
    assert noise.expand_cpus("4-6") == [4, 5, 6]


def test_host_pressure_reads_steal_quota_throttling_and_psi_and_deltas_them(tmp_path):
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    (proc / "pressure").mkdir(parents=True)
    cg.mkdir()

    def write(steal, throttled, usec, psi):
        (proc / "stat").write_text(f"cpu  10 0 5 100 0 0 0 {steal} 0 0\ncpu0 1 2 3\n")
        (cg / "cpu.max").write_text("800000 100000\n")
        (cg / "cpu.stat").write_text(f"usage_usec 5\nnr_periods 40\nnr_throttled {throttled}\nthrottled_usec {usec}\n")
        (proc / "pressure" / "cpu").write_text(f"some avg10=1.00 avg60=0.50 avg300=0.10 total={psi}\n"
                                               "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")

    write(7, 3, 1000, 5000)
    before = noise.host_pressure(str(proc), str(cg))
    assert before == {"steal_ticks": 7, "cpu_max": "800000 100000", "nr_periods": 40, "nr_throttled": 3,
                      "throttled_usec": 1000, "psi_some_us": 5000}
    write(9, 8, 61000, 905000)
    after = noise.host_pressure(str(proc), str(cg))
    assert noise.pressure_delta(before, after) == {"cpu_max": "800000 100000", "steal_ticks": 2, "nr_periods": 0,
                                                   "nr_throttled": 5, "throttled_usec": 60000,
                                                   "psi_some_us": 900000}
    # A machine without a cgroup v2 CPU controller or PSI: those are None, not an error.
    empty = noise.host_pressure(str(tmp_path / "none"), str(tmp_path / "none"))
    assert set(empty.values()) == {None}
    assert noise.pressure_delta(empty, after)["nr_throttled"] is None
