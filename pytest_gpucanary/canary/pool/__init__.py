"""Disposable node pools the canary upgrades: the PoolProvider protocol and the pool it yields.

A provider creates or carves out the pool's nodes and gives them back exactly as it found them.
The built-in ones are `existing_node.ExistingNodeProvider` (real clusters) and the local fleet's
KWOK pools; others plug in through the `pytest_gpucanary_make_pool` hook.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pytest_gpucanary.cluster import ClusterInfo
    from pytest_gpucanary.kube import Kube

DRIVER_POOL_LABEL = "gpucanary.io/driver-pool"
# An existing node may be carved out as a pool only when an administrator set this label to "true" on it,
# whatever a selector or a node name given to a run says.
POOL_ELIGIBLE_LABEL = "gpucanary.io/pool-eligible"
# A node of the default NVIDIADriver (v26.7) is handed to an NVIDIADriver of the run's own, copied from the
# default one, only when an administrator set this label to "true" on the default one (deploy/admission.yaml
# compares the copy with it).
HANDOVER_ELIGIBLE_LABEL = "gpucanary.io/handover-eligible"


@dataclass(frozen=True)
class Pool:
    nodes: tuple[str, ...]
    driver: str | None  # the NVIDIADriver that drives exactly these nodes (NVIDIADriver mode)
    driver_from: str  # the driver version the pool runs before the upgrade
    service: Path | None = None  # the service manifest its nodes need when the run was given none
    fence: str = ""  # how tenants are kept off it meanwhile, in words ("" when it is new)
    notes: tuple[str, ...] = ()  # what else the carve-out changed for the run, in words


class PoolProvider(Protocol):
    """A provider may also set `fresh_per_run = True` when each run gets nodes of its own (then a gate runs
    base and head at once where the operator allows it)."""

    name: str

    def check(self, kube: Kube, cluster: ClusterInfo) -> None:
        """Read-only: raise ConfigError/EnvError if the pool cannot be provisioned (run before any write)."""

    def provision(self, kube: Kube, cluster: ClusterInfo, *, run_id: str) -> Pool:
        """Create or carve out the pool; raise ConfigError/EnvError before changing anything if it cannot."""

    def release(self, kube: Kube, report: Callable[[str], None] = print) -> None:
        """Give the pool back: remove what was created, restore what was changed, saying what it had to do beyond
        that. Safe to call twice."""
