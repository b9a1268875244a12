"""Check (build or load) cuda_ext's kernels in a short-lived process.

A device-path sandbox (``prism emulate --device-path``) uses cuda_ext's
kernels. A first build takes about a minute (nvcc); inside a sandbox it
would stall the rank's first call, trip ``--quiet`` and, killed mid-build,
leave torch's build lock behind for the next run (found on an H200 with
``bench/scale.py --device cuda``, 2026-12-04). So whoever starts sandboxes
checks the kernels first, on the node that runs them: ``prism emulate`` on
its own machine, each ``prism agent`` on its node. Once built the check
costs a torch import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

__all__ = ["KERNEL_BUILD_TIMEOUT_S", "KernelCheckError", "check_kernels", "describe"]

#: How long ``check_kernels`` waits for cuda_ext's build (s).
KERNEL_BUILD_TIMEOUT_S = 900.0

_CODE = "import json, cuda_ext; print(json.dumps(cuda_ext.info().__dict__))"


class KernelCheckError(Exception):
    """The check did not finish or its process failed (the message says what to do)."""


def check_kernels(env: dict[str, str], timeout_s: float = KERNEL_BUILD_TIMEOUT_S,
                  tick: Callable[[], None] | None = None, tick_s: float = 0.5) -> dict:
    """``cuda_ext.info()`` as a dict (``path``: "kernels" or "fallback",
    ``reason``, ``build_s``, ``build_dir``) from a process of its own with
    ``env`` over this one's (the sandboxes' ``PRISM_CUDA_EXT_DIR``, if set,
    names the build). ``tick`` is called every ``tick_s`` while it runs (an
    agent beats). Raises ``KernelCheckError``."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _CODE], env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while True:
        try:
            out, err = proc.communicate(timeout=tick_s)
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() - t0 > timeout_s:
                proc.kill()
                proc.communicate()
                raise KernelCheckError(
                    f"building cuda_ext's kernels took over {timeout_s:g} s; build them first with "
                    "`python -c 'import cuda_ext; print(cuda_ext.info())'` (PRISM_CUDA_EXT_VERBOSE=1 shows the "
                    "compiler), or emulate without --device-path") from None
            if tick is not None:
                tick()
    try:
        info = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (err or out).strip().splitlines()[-3:]
        raise KernelCheckError(f"loading cuda_ext failed (exit code {proc.returncode}): "
                               f"{' | '.join(tail) or 'no output'}") from None
    info["checked_s"] = round(time.monotonic() - t0, 3)
    return info


def describe(info: dict) -> str | None:
    """A line for the user about a check's outcome worth saying (a build, or
    no kernels in use); None when the kernels were simply loaded."""
    if info.get("build_s") and info["build_s"] > 5:
        return (f"built cuda_ext's kernels in {info['build_s']:.0f} s into {info.get('build_dir')} (once per torch "
                "version; later runs load them)")
    if info.get("path") != "kernels":
        return (f"cuda_ext's kernels are not in use ({info.get('reason')}): the device path runs on its pure-torch "
                f"fallback where it can (checked in {info.get('checked_s', 0):.1f} s)")
    return None
