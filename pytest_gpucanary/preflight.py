"""Read-only checks before any write: what the target cluster's GPU Operator looks like (which mode it
runs, where, whether NVIDIADrivers carry their own upgrade policy). Never changes the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.kube import Kube, NotFound


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
        policies = kube.list(*op.CLUSTER_POLICY)
    except NotFound as err:
        raise EnvError("the cluster has no ClusterPolicy API", hint="install the NVIDIA GPU Operator first") from err
    if len(policies) != 1:
        raise EnvError(f"expected one ClusterPolicy, found {len(policies)}", hint="the GPU Operator manages exactly one")
    policy = policies[0]
    driver_pods = kube.list("v1", "Pod", label_selector=op.DRIVER_COMPONENT_SELECTOR)
    validators = kube.list("v1", "Pod", label_selector=op.VALIDATOR_SELECTOR)
    namespaces = {p["metadata"]["namespace"] for p in driver_pods + validators}
    if len(namespaces) != 1:
        raise EnvError(f"cannot tell the GPU Operator's namespace (driver/validator pods in {sorted(namespaces)})",
                       hint="is the GPU Operator running and ready?")
    nodes = kube.list("v1", "Node", label_selector=op.GPU_PRESENT_SELECTOR)
    return ClusterInfo(
        cluster_policy=policy["metadata"]["name"],
        nvidiadriver_mode=bool(policy.get("spec", {}).get("driver", {}).get("useNvidiaDriverCRD")),
        per_driver_policy=_nvidiadriver_has_upgrade_policy(kube),
        operator_namespace=namespaces.pop(),
        gpu_nodes=tuple(sorted(n["metadata"]["name"] for n in nodes)),
    )


def _nvidiadriver_has_upgrade_policy(kube: Kube) -> bool:
    try:
        crd = kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", op.NVIDIADRIVER_CRD)
    except NotFound:
        return False
    versions = crd["spec"]["versions"]
    return any("upgradePolicy" in v.get("schema", {}).get("openAPIV3Schema", {}).get("properties", {})
               .get("spec", {}).get("properties", {}) for v in versions)

