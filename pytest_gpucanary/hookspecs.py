"""Extension hooks of pytest-gpucanary."""

from __future__ import annotations

import pluggy
import pytest

hookspec = pluggy.HookspecMarker("pytest")


@hookspec(firstresult=True)
def pytest_gpucanary_make_pool(config: pytest.Config, settings: object) -> object | None:
    """Return a PoolProvider for the run, or None to let the next implementation decide."""
