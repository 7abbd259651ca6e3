"""Extension hooks of pytest-gpucanary."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy
import pytest

if TYPE_CHECKING:
    from pytest_gpucanary.canary.pool import PoolProvider
    from pytest_gpucanary.config import Settings

hookspec = pluggy.HookspecMarker("pytest")


@hookspec(firstresult=True)
def pytest_gpucanary_make_pool(config: pytest.Config, settings: Settings) -> PoolProvider | None:
    """Return a PoolProvider for the run, or None to let the next implementation decide (the last one, the
    plugin's own, gives the test bed's pool or carves out existing nodes: `target.pool_provider`)."""
