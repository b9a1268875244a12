"""Ground-truth worlds for the tests: plain torch.distributed over gloo."""

from __future__ import annotations

from typing import Any

from prism.workloads.harness import WorldError, run_world

#: gloo itself sometimes aborts at teardown on a loaded 2-core box ("terminate
#: called without an active exception", exit -6, after the script's last
#: line; twice in a row once in a fresh-clone CI run). The ground truth gets
#: this many tries for that abort only; Prism never gets a second one.
TEARDOWN_ABORT_TRIES = 4


def gloo_world(argv: list[str], nproc: int, **kwargs: Any) -> Any:
    """``run_world`` retried only on gloo's teardown abort."""
    for attempt in range(TEARDOWN_ABORT_TRIES):
        try:
            return run_world(argv, nproc, **kwargs)
        except WorldError as e:
            if "exit -6" not in str(e) or attempt == TEARDOWN_ABORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


#: One run per (argv, nproc, cwd, env) and session: see :func:`shared_gloo_world`.
_SHARED: dict[tuple, Any] = {}


def shared_gloo_world(argv: list[str], nproc: int, *, cwd: str, env: dict[str, str] | None = None,
                      timeout: float = 240) -> Any:
    """:func:`gloo_world`, run once per session for the same script, flags,
    world size, directory and extra environment: tests in several modules
    compare against the same ground truth (the collectives and DDP examples
    at world 4) and a world is deterministic, so they share one run. The
    results are immutable (``RankResult`` is frozen, in a list only read)."""
    key = (tuple(argv), nproc, cwd, tuple(sorted((env or {}).items())))
    if key not in _SHARED:
        _SHARED[key] = tuple(gloo_world(argv, nproc, cwd=cwd, env=env, timeout=timeout))
    return list(_SHARED[key])
