"""pytest wiring only: options, markers and fixtures. Heavy modules are imported lazily."""

from __future__ import annotations

import sys
from typing import Iterator

import pytest

pytest_plugins = ["pytest_gpucanary.sweep_fixtures"]


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_gpucanary import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpucanary", "GPU driver upgrade canary")
    group.addoption("--gpucanary-fleet-keep", action="store_true", default=None,
                    help="Leave the local fleet running after the session (env GPUCANARY_FLEET_KEEP)")
    parser.addini("gpucanary_fleet_keep", "Leave the local fleet running after the session", type="bool",
                  default=None)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpucanary(stage): ladder stage this test gives evidence for")
    config.addinivalue_line("markers", "e2e: runs against the local GPU fleet")


def _keep_fleet(config: pytest.Config) -> bool:
    import os

    for value in (config.getoption("gpucanary_fleet_keep"), config.getini("gpucanary_fleet_keep")):
        if value is not None:
            return bool(value)
    return os.environ.get("GPUCANARY_FLEET_KEEP", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def gpucanary_fleet(request: pytest.FixtureRequest) -> Iterator[object]:
    """A ready local GPU fleet, started once per run (left running if it was up before)."""
    from pytest_gpucanary.errors import GpucanaryError
    from pytest_gpucanary.fleet import Fleet
    from pytest_gpucanary.fleet.cluster_manager import FleetClusterManager

    reporter = request.config.pluginmanager.get_plugin("terminalreporter")

    def progress(line: str) -> None:
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line, file=sys.stderr)

    manager = FleetClusterManager(Fleet.from_env(), progress=progress)
    try:
        manager.create()
    except GpucanaryError as err:
        pytest.fail(f"local fleet could not start: {err}", pytrace=False)
    yield manager
    if not _keep_fleet(request.config):
        manager.delete()
