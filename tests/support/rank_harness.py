"""Helpers shared by the rank-side tests: run a script as a world of ranks
under the fake coordinator (or plain gloo) through the real launcher."""

from __future__ import annotations

import pathlib
from typing import Any

import orjson

from prism.shell import runfolder
from prism.shell.launcher import launch_ranks
from tests.support.fake_coordinator import FakeCoordinator

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "support" / "scripts"
FAKE_ENV = {"PRISM_CLIENT_FACTORY": "tests.support.fake_coordinator:connect", "PYTHONPATH": str(ROOT)}


def run_world(tmp: pathlib.Path, world: int, command: list[str], *, prism: bool = True, slots: int | None = None,
              timeout: float = 120, **kwargs: Any) -> tuple[list[int | None], FakeCoordinator | None]:
    """Run ``command`` at ``world`` ranks; returns (exit statuses, fake coordinator)."""
    fc = FakeCoordinator(str(tmp / "coord.sock"), world, slots=slots) if prism else None
    env = {**FAKE_ENV, **kwargs.pop("env", {})}
    procs = launch_ranks(world, fc.endpoint if fc else None, tmp, command, env=env, **kwargs)
    try:
        codes = procs.wait(timeout=timeout)
    finally:
        procs.close()
        if fc is not None:
            fc.close()
    return codes, fc


def events(fc: FakeCoordinator, rank: int) -> list[dict[str, Any]]:
    """The trace records the rank shipped, decoded as plain JSON objects."""
    return [orjson.loads(line) for line in fc.trace_lines[rank]]


def log(tmp: pathlib.Path, rank: int) -> str:
    return runfolder.log_path(tmp, rank).read_text()


__all__ = ["run_world", "events", "log", "SCRIPTS", "ROOT"]
