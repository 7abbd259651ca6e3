"""The local fleet's own pytest plugin (entry point `gpucanary-fleet`): the `gpucanary_fleet` fixture, the
started test bed as pytest-kubernetes' cluster manager, for tests that drive the fleet itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_gpucanary.fleet.cluster_manager import FleetClusterManager
    from pytest_gpucanary.fleet.fleet import Fleet


@pytest.fixture(scope="session")
def gpucanary_fleet(gpucanary_test_bed: Fleet) -> FleetClusterManager:
    """The local GPU fleet, up (started once per session by `gpucanary_test_bed`)."""
    from pytest_gpucanary.fleet.cluster_manager import FleetClusterManager

    manager = FleetClusterManager(gpucanary_test_bed)
    manager.create()  # up already: puts the fleet's kubectl on PATH and waits until it answers
    return manager
