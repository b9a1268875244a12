"""pytest fixtures for ``prism.testing`` (enable with
``pytest_plugins = ["prism.testing.pytest_plugin"]`` in a conftest.py).

``prism_world(world_size, **kw)``: an ``emulated_world`` whose run folder is
a fresh directory under the test's ``tmp_path``:

    async def test_step(prism_world, autojump_clock):
        async with prism_world(4) as world:
            result = await world.run(my_step)

The tests are trio tests: pytest-trio's ``trio_mode = true`` (in the
``[tool.pytest.ini_options]`` of pyproject.toml) or ``@pytest.mark.trio``;
take ``autojump_clock`` so quiet periods and delays pass in no real time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest

from prism.testing.world import EmulatedWorld, emulated_world


@pytest.fixture
def prism_world(tmp_path: Path) -> Callable[..., AbstractAsyncContextManager[EmulatedWorld]]:
    """A factory of emulated worlds, each in its own run folder under ``tmp_path``."""
    count = itertools.count()

    def make(world_size: int, **kw: Any) -> AbstractAsyncContextManager[EmulatedWorld]:
        return emulated_world(world_size, tmp_path / f"prism-world-{next(count)}", **kw)

    return make
