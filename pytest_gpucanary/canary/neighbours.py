"""Other systems that act on the same GPU nodes while a driver changes, found before a run touches anything.

- NVIDIA NVSentinel quarantines a node whose GPU health signals go quiet (cordon and taints; a circuit breaker
  counts such nodes and must be reset by hand). A driver swap silences DCGM, so its runbooks tell operators to
  label nodes `k8saas.nvidia.com/ManagedByNVSentinel=false` during GPU driver upgrades: a run does that on its
  pool and puts the label back as it found it (pool/existing_node.py, pool/restore.py).
- NVIDIA Skyhook and the maintenance operator's NodeMaintenance (the Network Operator's driver upgrades on the
  same RDMA nodes) cordon and drain nodes of their own accord: a run says they are there.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import Forbidden, NotFound

NVSENTINEL_LABEL = "k8saas.nvidia.com/ManagedByNVSentinel"
NVSENTINEL_NAMESPACE = "nvsentinel"  # its Helm chart's
SKYHOOK = ("skyhook.nvidia.com/v1alpha1", "Skyhook")
NODE_MAINTENANCE = ("maintenance.nvidia.com/v1alpha1", "NodeMaintenance")


@dataclass(frozen=True)
class Neighbours:
    nvsentinel: bool
    skyhook: bool
    node_maintenance: bool

    def notes(self) -> list[str]:
        """One line for each system found, saying what it may do to the pool."""
        notes = []
        if self.nvsentinel:
            notes.append(
                f"NVSentinel manages GPU nodes here: the run labels its pool {NVSENTINEL_LABEL}=false for "
                "its duration (NVSentinel's runbook for driver upgrades), so the DCGM gap of the swap "
                "quarantines nothing, and puts the label back as it was"
            )
        if self.skyhook:
            notes.append(
                "Skyhook is installed: a Skyhook whose selector takes the pool may cordon and drain it "
                "during the run; pause it there (its pause annotation) while the canary runs"
            )
        if self.node_maintenance:
            notes.append(
                "the maintenance operator is installed: a NodeMaintenance on the pool (the Network "
                "Operator's driver upgrades) cordons and drains it outside the policy under test"
            )
        return notes


def nvsentinel_present(kube: Kube) -> bool:
    """NVSentinel's namespace is there, or some node already carries its opt-out label."""
    return bool(
        kube.list("v1", "Namespace", field_selector=f"metadata.name={NVSENTINEL_NAMESPACE}", limit=1)
        or kube.list("v1", "Node", label_selector=NVSENTINEL_LABEL, limit=1)
    )


def node_maintenance_served(kube: Kube) -> bool:
    """Whether NodeMaintenances can be watched here: the kind is served and the canary may list it."""
    try:
        kube.list(*NODE_MAINTENANCE, limit=1)
    except (NotFound, Forbidden):
        return False
    return True


def detect(kube: Kube) -> Neighbours:
    return Neighbours(nvsentinel_present(kube), _serves(kube, *SKYHOOK), _serves(kube, *NODE_MAINTENANCE))


def _serves(kube: Kube, api_version: str, kind: str) -> bool:
    """Whether the cluster serves the kind: a refusal to list it says it does."""
    try:
        kube.list(api_version, kind, limit=1)
    except NotFound:
        return False
    except Forbidden:
        return True
    return True
