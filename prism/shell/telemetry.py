"""GPU telemetry during a capture: pynvml samples per physical GPU.

``GpuSampler`` runs one thread in the coordinator's process that samples
every ``interval_s`` (default 0.5 s) each GPU's memory in use, utilisation,
SM and memory clocks, temperature, power and throttle reasons, and appends
one JSON line per GPU and sample to ``RUN/telemetry/gpu.jsonl``. Without
pynvml or a GPU it does nothing (``GpuSampler.start`` returns False and says
why in ``skipped``). ``process_memory(pid)`` is a process's GPU memory, for
the swap executor's GB/s figures.

Public API: ``GpuSampler(run_dir, gpus=None, interval_s=0.5)`` with
``start()``, ``stop()``, ``samples``, ``skipped``; ``process_memory(pid)``;
``THROTTLE_REASONS``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence

from prism.shell import runfolder

#: nvmlClocksEventReason* bits (formerly ClocksThrottleReason*), by name.
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


def nvml():
    """The initialised ``pynvml`` module, or None without pynvml or a driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded ...
        return None
    return pynvml


def process_memory(pid: int) -> int:
    """GPU memory used by ``pid`` over all GPUs (bytes; 0 if unknown)."""
    nv = nvml()
    if nv is None:
        return 0
    total = 0
    for i in range(nv.nvmlDeviceGetCount()):
        handle = nv.nvmlDeviceGetHandleByIndex(i)
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
        except nv.NVMLError:
            continue
        total += sum(p.usedGpuMemory or 0 for p in procs if p.pid == pid)
    return total


def _reasons(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


class GpuSampler:
    """Samples ``gpus`` (default: all) every ``interval_s`` into
    ``RUN/telemetry/gpu.jsonl`` from a daemon thread."""

    def __init__(self, run_dir: str | os.PathLike[str], gpus: Sequence[int] | None = None,
                 interval_s: float = 0.5) -> None:
        self.path = runfolder.gpu_samples_path(run_dir)
        self.gpus = list(gpus) if gpus is not None else None
        self.interval_s = interval_s
        self.samples = 0
        self.skipped = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        nv = nvml()
        if nv is None:
            self.skipped = "no GPU telemetry: pynvml or an NVIDIA driver is missing"
            return False
        count = nv.nvmlDeviceGetCount()
        if count == 0:
            self.skipped = "no GPU telemetry: NVML sees no GPU"
            return False
        gpus = self.gpus if self.gpus is not None else list(range(count))
        handles = [(g, nv.nvmlDeviceGetHandleByIndex(g)) for g in gpus if g < count]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, args=(nv, handles), name="prism-gpu-telemetry", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _sample(self, nv, gpu: int, h) -> dict:
        def get(fn, *args):
            try:
                return fn(h, *args)
            except nv.NVMLError:
                return None

        mem = get(nv.nvmlDeviceGetMemoryInfo)
        util = get(nv.nvmlDeviceGetUtilizationRates)
        power = get(nv.nvmlDeviceGetPowerUsage)
        reasons = get(nv.nvmlDeviceGetCurrentClocksEventReasons) if hasattr(nv, "nvmlDeviceGetCurrentClocksEventReasons") \
            else get(nv.nvmlDeviceGetCurrentClocksThrottleReasons)
        return {
            "t_unix": round(time.time(), 3), "gpu": gpu,
            "mem_used": mem.used if mem else None, "mem_total": mem.total if mem else None,
            "util_gpu": util.gpu if util else None, "util_mem": util.memory if util else None,
            "sm_clock_mhz": get(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
            "mem_clock_mhz": get(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM),
            "temp_c": get(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU),
            "power_w": power / 1000 if power is not None else None,
            "throttle_mask": reasons, "throttle": _reasons(reasons) if reasons else [],
        }

    def _run(self, nv, handles) -> None:
        with open(self.path, "a") as f:
            while True:
                for gpu, h in handles:
                    f.write(json.dumps(self._sample(nv, gpu, h)) + "\n")
                    self.samples += 1
                f.flush()
                if self._stop.wait(self.interval_s):
                    return
