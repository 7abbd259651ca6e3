"""A pool of fresh simulated GPU nodes in the local fleet, each pool with an NVIDIADriver of its own.

Creates only objects named after the pool and labelled with the run id; `delete()` removes them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import yaml

from pytest_gpucanary.fleet.manifests import FLEET_FIXTURES, node
from pytest_gpucanary.kube import Kube, owned_labels

DRIVER_POOL_LABEL = "gpucanary.io/driver-pool"


@dataclass
class KwokPool:
    kube: Kube
    name: str
    run_id: str
    size: int = 1
    nodes: list[str] = field(default_factory=list)

    def create(self, *, driver_version: str) -> list[str]:
        """Create the nodes and the pool's NVIDIADriver at `driver_version`."""
        for index in range(self.size):
            manifest = node("gpu-node.yaml", f"{self.name}-{index}")
            manifest["metadata"]["labels"].update({**owned_labels(self.run_id), DRIVER_POOL_LABEL: self.name})
            self.kube.create(manifest)
            self.nodes.append(manifest["metadata"]["name"])
        self.kube.create(self._driver(driver_version))
        return list(self.nodes)

    def _driver(self, version: str) -> dict:
        driver = copy.deepcopy(yaml.safe_load((FLEET_FIXTURES / "nvidiadriver.yaml").read_text()))
        driver["metadata"] = {"name": self.name, "labels": owned_labels(self.run_id)}
        driver["spec"].update(version=version, nodeSelector={DRIVER_POOL_LABEL: self.name})
        return driver

    def set_driver_version(self, version: str) -> None:
        self.kube.patch("nvidia.com/v1alpha1", "NVIDIADriver", self.name, {"spec": {"version": version}})

    def delete(self) -> None:
        self.kube.delete("nvidia.com/v1alpha1", "NVIDIADriver", self.name)
        for name in self.nodes:
            self.kube.delete("v1", "Node", name)
