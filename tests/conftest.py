"""Test-suite wiring: the ``gpu`` marker skips by itself, and every test under
tests/integration/ carries the ``integration`` marker.

``@pytest.mark.gpu`` needs one CUDA device; ``@pytest.mark.gpu(2)`` needs two;
``@pytest.mark.gpu(reason="...")`` (or ``gpu(2, reason=...)``) says why in
the skip message. Where torch sees fewer devices the test is skipped with
"needs a CUDA device" / "needs N GPUs" and that reason. Torch is asked once,
and only when a collected test carries the marker.

``shared_captures``: the captures several modules read, one a session
(tests/support/captures.py).

A warm fork server (``prism.rank.forkserver.zygote``) serves the session's
launches, this process's and its subprocesses' (``PRISM_FORKSERVER_ZYGOTE``):
each launch forks its fork server from one that imported torch once, instead
of a fresh interpreter importing it again (about 3 s of CPU a launch).
``PRISM_WARM_FORKSERVER=0`` turns it off; tests of the fresh path unset the variable.
"""

from __future__ import annotations

import contextlib
import pathlib

import pytest

from tests.support.captures import SharedCaptures
from tests.support.gpus import cuda_device_count

pytest_plugins = ["prism.testing.pytest_plugin"]

_INTEGRATION = pathlib.Path(__file__).parent / "integration"


@pytest.fixture(scope="session")
def shared_captures(tmp_path_factory: pytest.TempPathFactory) -> SharedCaptures:
    return SharedCaptures(tmp_path_factory.mktemp("shared-captures"))


_warm = contextlib.ExitStack()


def pytest_configure(config: pytest.Config) -> None:
    # Before collection: modules that build their subprocesses' environment
    # at import (``ENV = dict(os.environ, ...)``) take the variable along.
    from prism.shell import launcher

    _warm.enter_context(launcher.warm_forkserver())


def pytest_unconfigure(config: pytest.Config) -> None:
    _warm.close()


def _gpu_skip(mark: pytest.Mark) -> str | None:
    """The skip reason for a ``gpu`` mark, or None when enough GPUs are here."""
    if len(mark.args) > 1 or set(mark.kwargs) - {"reason"}:
        raise pytest.UsageError(f"@pytest.mark.gpu takes one GPU count and reason=..., got {mark}")
    need = mark.args[0] if mark.args else 1
    if not isinstance(need, int) or isinstance(need, bool) or need < 1:
        raise pytest.UsageError(f"@pytest.mark.gpu needs a GPU count >= 1, got {need!r}")
    have = cuda_device_count()
    if have >= need:
        return None
    what = "needs a CUDA device" if need == 1 else f"needs {need} GPUs"
    why = mark.kwargs.get("reason")
    return f"{what}: {why}" if why else what


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    integration = pytest.mark.integration
    for item in items:
        if _INTEGRATION in item.path.parents:
            item.add_marker(integration)
        mark = item.get_closest_marker("gpu")
        if mark is not None:
            reason = _gpu_skip(mark)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
