"""Run a world of real ``torch.distributed`` processes without a launcher, and parse
what the bundled workloads print.

For tests and ground-truth runs: :func:`run_world` starts one Python process per
rank with the environment torchrun would give it (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``OMP_NUM_THREADS=1`` unless the caller sets it), waits for all of them, and
returns each rank's exit status and output. If one rank fails, the others are
stopped after a short grace period instead of being left to hang in a
collective. Unlike torchrun it adds no agent process and no restarts.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["RankResult", "WorldError", "parse_losses", "parse_splits", "run_world"]

_LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)
_SPLITS = re.compile(
    r"^splits step (\d+) micro (\d+) layer (\d+) rank (\d+) send \[([\d, ]*)\] recv \[([\d, ]*)\]$",
    re.MULTILINE,
)


@dataclass(frozen=True, slots=True)
class RankResult:
    """One rank's exit status and output."""

    rank: int
    returncode: int
    stdout: str
    stderr: str


class WorldError(RuntimeError):
    """A rank failed or the world ran past its timeout; the message has each rank's stderr tail."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(
    argv: Sequence[str],
    nproc: int,
    *,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    check: bool = True,
) -> list[RankResult]:
    """Run ``python *argv`` as ranks ``0 .. nproc-1`` of one world on this host.

    ``argv`` is what follows the interpreter, e.g. ``["-m", "prism.workloads.gpt",
    "--tp", "2"]`` or a script path and its flags. ``env`` entries are added to
    (and override) this process's environment. With ``check`` (default) a
    non-zero exit or a timeout raises :class:`WorldError`; without it a timeout
    still raises, but failed ranks are returned.
    """
    if nproc < 1:
        raise ValueError(f"run_world: nproc must be at least 1, got {nproc}")
    port = _free_port()
    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", "1")
    base.update(env or {})
    base.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with tempfile.TemporaryDirectory(prefix="prism-world-") as tmp:
        procs, files = [], []
        for rank in range(nproc):
            out = open(os.path.join(tmp, f"{rank}.out"), "w+")
            err = open(os.path.join(tmp, f"{rank}.err"), "w+")
            files.append((out, err))
            procs.append(subprocess.Popen(
                [sys.executable, *argv], stdout=out, stderr=err, cwd=cwd,
                env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            ))
        deadline = time.monotonic() + timeout
        failed_at = None
        timed_out = False
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now
                # Peers of a failed rank block in collectives forever: give them
                # a moment to report their own error, then stop them.
                if failed_at is not None and now - failed_at > 5.0:
                    break
                if now > deadline:
                    timed_out = True
                    break
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = []
        for rank, (p, (out, err)) in enumerate(zip(procs, files)):
            out.seek(0)
            err.seek(0)
            results.append(RankResult(rank, p.returncode, out.read(), err.read()))
            out.close()
            err.close()
    if timed_out or (check and any(r.returncode != 0 for r in results)):
        what = f"timed out after {timeout} s" if timed_out else "failed"
        tails = "\n".join(
            f"--- rank {r.rank} exit {r.returncode} stderr tail:\n{r.stderr[-1500:]}"
            for r in results if r.returncode != 0
        )
        raise WorldError(f"world of {nproc} running {' '.join(argv)} {what}\n{tails}")
    return results


def parse_losses(stdout: str) -> list[float]:
    """The per-step losses from ``step K loss X`` lines, checking K runs 0, 1, 2, ..."""
    losses = []
    for m in _LOSS.finditer(stdout):
        step, value = int(m.group(1)), float(m.group(2))
        if step != len(losses):
            raise ValueError(f"parse_losses: expected step {len(losses)}, found line {m.group(0)!r}")
        losses.append(value)
    return losses


def parse_splits(stdout: str) -> list[dict]:
    """The ``splits ...`` lines printed under ``gpt.py --print-splits``, as dicts with keys
    step, micro, layer, rank (ints) and send, recv (lists of token counts)."""
    rows = []
    for m in _SPLITS.finditer(stdout):
        step, micro, layer, rank = (int(g) for g in m.group(1, 2, 3, 4))
        send, recv = ([int(v) for v in g.split(",") if v.strip()] for g in m.group(5, 6))
        rows.append(dict(step=step, micro=micro, layer=layer, rank=rank, send=send, recv=recv))
    return rows
