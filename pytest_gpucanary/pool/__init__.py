"""Disposable node pools the canary upgrades: the PoolProvider protocol and the built-in providers.

A provider creates or carves out the pool's nodes and gives them back exactly as it found them.
Others plug in through the `pytest_gpucanary_make_pool` hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pytest_gpucanary.cluster import ClusterInfo
    from pytest_gpucanary.config import Settings
    from pytest_gpucanary.kube import Kube

DRIVER_POOL_LABEL = "gpucanary.io/driver-pool"


@dataclass(frozen=True)
class Pool:
    nodes: tuple[str, ...]
    driver: str | None          # the NVIDIADriver that drives exactly these nodes (NVIDIADriver mode)
    driver_from: str            # the driver version the pool runs before the upgrade


class PoolProvider(Protocol):
    name: str

    def provision(self, kube: Kube, cluster: ClusterInfo, *, run_id: str) -> Pool:
        """Create or carve out the pool; raise ConfigError/EnvError before changing anything if it cannot."""

    def release(self, kube: Kube) -> None:
        """Give the pool back: remove what was created, restore what was changed. Safe to call twice."""


def provider_for(settings: Settings, *, local_fleet: bool) -> PoolProvider:
    name = settings.pool_provider or ("kwok" if local_fleet else "existing")
    if name == "kwok":
        from pytest_gpucanary.pool.kwok import KwokPoolProvider

        return KwokPoolProvider(size=settings.pool_size)
    from pytest_gpucanary.pool.existing_node import ExistingNodeProvider

    return ExistingNodeProvider(node=settings.pool_node, selector=settings.pool_selector, size=settings.pool_size,
                                allow_foreign_pods=settings.allow_foreign_pods,
                                restore_timeout_s=settings.upgrade_budget_s)
