"""End-to-end tests run on the real local fleet; each test works in a namespace of its own."""

from __future__ import annotations

import os
import uuid
from typing import Iterator

import pytest

from pytest_gpucanary.kube import Kube


@pytest.fixture(scope="session")
def kube(gpucanary_fleet) -> Kube:
    return Kube.connect(gpucanary_fleet.fleet.kubeconfig)


@pytest.fixture
def namespace(kube: Kube) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    kube.create({"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "gpucanary-tests"}}})
    kube.wait_for("v1", "ServiceAccount", "default", lambda sa: True, namespace=name, timeout_s=30)
    yield name
    kube.delete("v1", "Namespace", name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The full kill matrix (hours of canary runs) runs only from `make kill-matrix`: deselected, never skipped."""
    if os.environ.get("GPUCANARY_KILL_MATRIX") == "1":
        return
    kept = [item for item in items if item.get_closest_marker("kill_matrix") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
