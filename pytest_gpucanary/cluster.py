"""What the target cluster's GPU Operator looks like: which mode it runs, where, at which version.
Read-only: discovery never changes the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.kube import Kube, NotFound

DRIVER_COMPONENT_SELECTOR = "app.kubernetes.io/component=nvidia-driver"


@dataclass(frozen=True)
class ClusterInfo:
    cluster_policy: str                 # name of the ClusterPolicy
    nvidiadriver_mode: bool             # spec.driver.useNvidiaDriverCRD
    per_driver_policy: bool             # NVIDIADriver has spec.upgradePolicy (operator v26.7+)
    operator_namespace: str
    gpu_nodes: tuple[str, ...]          # nodes labelled nvidia.com/gpu.present=true

    @property
    def mode(self) -> str:
        return "NVIDIADriver" if self.nvidiadriver_mode else "ClusterPolicy"


def discover(kube: Kube) -> ClusterInfo:
    try:
        policies = kube.list("nvidia.com/v1", "ClusterPolicy")
    except NotFound as err:
        raise EnvError("the cluster has no ClusterPolicy API", hint="install the NVIDIA GPU Operator first") from err
    if len(policies) != 1:
        raise EnvError(f"expected one ClusterPolicy, found {len(policies)}", hint="the GPU Operator manages exactly one")
    policy = policies[0]
    driver_pods = kube.list("v1", "Pod", label_selector=DRIVER_COMPONENT_SELECTOR)
    validators = kube.list("v1", "Pod", label_selector="app=nvidia-operator-validator")
    namespaces = {p["metadata"]["namespace"] for p in driver_pods + validators}
    if len(namespaces) != 1:
        raise EnvError(f"cannot tell the GPU Operator's namespace (driver/validator pods in {sorted(namespaces)})",
                       hint="is the GPU Operator running and ready?")
    nodes = kube.list("v1", "Node", label_selector="nvidia.com/gpu.present=true")
    return ClusterInfo(
        cluster_policy=policy["metadata"]["name"],
        nvidiadriver_mode=bool(policy.get("spec", {}).get("driver", {}).get("useNvidiaDriverCRD")),
        per_driver_policy=_nvidiadriver_has_upgrade_policy(kube),
        operator_namespace=namespaces.pop(),
        gpu_nodes=tuple(sorted(n["metadata"]["name"] for n in nodes)),
    )


def _nvidiadriver_has_upgrade_policy(kube: Kube) -> bool:
    try:
        crd = kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", "nvidiadrivers.nvidia.com")
    except NotFound:
        return False
    versions = crd["spec"]["versions"]
    return any("upgradePolicy" in v.get("schema", {}).get("openAPIV3Schema", {}).get("properties", {})
               .get("spec", {}).get("properties", {}) for v in versions)


def driver_version_of(pod: dict) -> str:
    """The driver version in a driver pod's image tag: nvcr.io/nvidia/driver:580.82.07-ubuntu22.04 -> 580.82.07."""
    images = [c.get("image", "") for c in pod.get("spec", {}).get("containers", [])]
    tag = next((i.rsplit(":", 1)[1] for i in images if ":" in i.rsplit("/", 1)[-1]), "")
    return tag.split("-", 1)[0]
