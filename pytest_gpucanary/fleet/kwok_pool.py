"""A pool of fresh simulated GPU nodes in the local fleet (the `kwok` pool provider).

In NVIDIADriver mode each pool gets an NVIDIADriver of its own, created at the version the rest of
the fleet runs. Creates only objects named after the pool and labelled with the run id.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import yaml

from pytest_gpucanary.canary.dra import RESOURCE_SLICE
from pytest_gpucanary.canary.pool import DRIVER_POOL_LABEL, POOL_ELIGIBLE_LABEL, Pool
from pytest_gpucanary.canary.preflight import Permission
from pytest_gpucanary.cluster import ClusterInfo
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.fleet.manifests import FLEET_FIXTURES, gpu_node
from pytest_gpucanary.fleet.operator import gpus_allocatable
from pytest_gpucanary.gpu_operator import DRIVER_COMPONENT_SELECTOR, GPU_RESOURCE, NVIDIADRIVER, driver_version_of
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import NotFound
from pytest_gpucanary.kube.ownership import owned_labels
from pytest_gpucanary.ladder.slices import GPU_DRIVER

FLEET_DRIVER = "fleet"  # the NVIDIADriver of the fleet's own nodes (fixtures/fleet/nvidiadriver.yaml)
NETWORKING_KEYS = ("rdma", "gds", "gdrcopy")
# on the pool's own nodes and NVIDIADriver: deploy/local-fleet-kwok-pool.yaml's admission bindings leave them out
KWOK_POOL_LABEL = "gpucanary.io/kwok-pool"
GPUS_TIMEOUT_S = 180.0  # a fresh node: driver pod, its driver manager, then validator and device plugin


@dataclass
class KwokPool:
    """Nodes plus (optionally) their own NVIDIADriver; used by the provider and by fleet tests."""

    kube: Kube
    name: str
    run_id: str
    size: int = 1
    nodes: list[str] = field(default_factory=list)
    has_driver: bool = False
    dra: bool = False  # GPUCluster mode: the nodes offer their GPUs as ResourceSlices, not nvidia.com/gpu

    def create(self, *, driver_version: str | None) -> list[str]:
        """Create the pool's NVIDIADriver at `driver_version` (unless it is None), then the nodes: a node that came
        first would belong to a default NVIDIADriver (v26.7) until its own appeared, and change owner."""
        if driver_version is not None:
            self.kube.create(self._driver(driver_version))
            self.has_driver = True
        for index in range(self.size):
            manifest = gpu_node(f"{self.name}-{index}", dra=self.dra)
            manifest["metadata"]["labels"].update(
                {**owned_labels(self.run_id), DRIVER_POOL_LABEL: self.name, KWOK_POOL_LABEL: self.name}
            )
            self.kube.create(manifest)
            self.nodes.append(manifest["metadata"]["name"])
        return list(self.nodes)

    def _driver(self, version: str) -> dict:
        driver = copy.deepcopy(yaml.safe_load((FLEET_FIXTURES / "nvidiadriver.yaml").read_text()))
        driver["metadata"] = {
            "name": self.name,
            "labels": {**owned_labels(self.run_id), KWOK_POOL_LABEL: self.name, POOL_ELIGIBLE_LABEL: "true"},
        }
        driver["spec"].update(version=version, nodeSelector={DRIVER_POOL_LABEL: self.name})
        with contextlib.suppress(NotFound):  # a fresh node of the fleet: its GPU networking too
            fleet_spec = self.kube.get(*NVIDIADRIVER, FLEET_DRIVER)["spec"]
            driver["spec"].update({key: fleet_spec[key] for key in NETWORKING_KEYS if key in fleet_spec})
        return driver

    def wait_for_gpus(self, timeout_s: float = GPUS_TIMEOUT_S) -> None:
        """Until every node shows its GPUs: the driver pod Ready, then the device plugin or, in GPUCluster mode, the DRA
        kubelet plugin (fleet/node_agent.py)."""
        if self.dra:
            wanted = set(self.nodes)
            try:
                self.kube.watch_until(
                    *RESOURCE_SLICE,
                    lambda slices: True if wanted <= {s["spec"].get("nodeName") for s in slices.values()} else None,
                    timeout_s=timeout_s,
                    field_selector=f"spec.driver={GPU_DRIVER}",
                )
            except TimeoutError:
                raise EnvError(
                    f"pool {self.name} offers no {GPU_DRIVER} ResourceSlices on every node after {timeout_s:.0f} s",
                    hint="are the GPU Operator and the fleet's node agent running? see `gpucanary fleet status`",
                ) from None
            return
        for name in self.nodes:
            try:
                self.kube.wait_for("v1", "Node", name, gpus_allocatable, timeout_s=timeout_s)
            except TimeoutError:
                raise EnvError(
                    f"pool node {name} shows no {GPU_RESOURCE} allocatable after {timeout_s:.0f} s",
                    hint="are the GPU Operator and the fleet's node agent running? see `gpucanary fleet status`",
                ) from None

    def set_driver_version(self, version: str) -> None:
        self.kube.patch(*NVIDIADRIVER, self.name, {"spec": {"version": version}})

    def delete(self) -> None:
        with contextlib.suppress(NotFound):
            self.kube.delete(*NVIDIADRIVER, self.name)
        for name in self.nodes:
            with contextlib.suppress(NotFound):
                self.kube.delete("v1", "Node", name)


def fleet_driver_version(kube: Kube) -> str:
    """What a fresh node of the fleet would get: its own NVIDIADriver's version in NVIDIADriver mode (one
    read), else the version most GPU nodes run now (one driver pod per node, read in pages)."""
    with contextlib.suppress(NotFound):
        if version := kube.get(*NVIDIADRIVER, FLEET_DRIVER)["spec"].get("version"):
            return version
    versions = Counter(driver_version_of(p) for p in kube.each("v1", "Pod", label_selector=DRIVER_COMPONENT_SELECTOR))
    if not versions:
        raise EnvError("no driver pods in the cluster", hint="is the GPU Operator ready?")
    return versions.most_common(1)[0][0]


# beyond preflight.PERMISSIONS (which creates and deletes NVIDIADrivers already): the pool's own nodes
# (deploy/local-fleet-kwok-pool.yaml)
KWOK_POOL_PERMISSIONS = tuple(
    Permission(verb, "nodes", "", "create and delete the pool's simulated nodes") for verb in ("create", "delete")
)


@dataclass
class KwokPoolProvider:
    size: int = 1
    name: str = "kwok"
    fresh_per_run: bool = True  # nodes of its own per run, so a gate's base and head can run at once
    pool: KwokPool | None = None
    driver_from: str | None = None
    permissions: tuple[Permission, ...] = KWOK_POOL_PERMISSIONS

    def check(self, kube: Kube, cluster: ClusterInfo) -> None:
        self.driver_from = fleet_driver_version(kube)

    def provision(self, kube: Kube, cluster: ClusterInfo, *, run_id: str) -> Pool:
        driver_from = self.driver_from or fleet_driver_version(kube)  # read once per run, at check
        self.pool = KwokPool(
            kube, name=f"canary-{run_id}", run_id=run_id, size=self.size, dra=cluster.gpu_cluster is not None
        )
        self.pool.create(driver_version=driver_from if cluster.nvidiadriver_mode else None)
        self.pool.wait_for_gpus()
        return Pool(tuple(self.pool.nodes), self.pool.name if self.pool.has_driver else None, driver_from)

    def release(self, kube: Kube, report: Callable[[str], None] = print) -> None:
        if self.pool is not None:
            self.pool.delete()
