"""GPUs through DRA: the canary's GPU job and fleet probes claim their GPU the way a DRA pool's own pods do, and a
pod's GPUs count its claims.

On a pool whose nodes offer their GPUs as `gpu.nvidia.com` ResourceSlices (NVIDIA's DRA driver, deployed by GPU
Operator v26.7's GPUCluster), the GPU job asks for them with a ResourceClaimTemplate of the driver's DeviceClass
instead of the device plugin's `nvidia.com/gpu`, so what the policy does to claim-holding pods is what the run
sees. A pod holds GPUs when it requests `nvidia.com/gpu` or holds a claim with devices allocated by
`gpu.nvidia.com`, admin access left out: the v26.7.0 upgrade controller's pod deletion filter (`gpuPodSpecFilter`,
cmd/gpu-operator/main.go, through `PodHasNVIDIAGPUClaim`, controllers/nodelabeling_controller.go).
"""

from __future__ import annotations

import copy
import threading

from pytest_gpucanary.canary.workloads import pod_spec
from pytest_gpucanary.errors import GpucanaryError
from pytest_gpucanary.gpu_operator import GPU_RESOURCE, allocated_gpus, claim_names
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.ownership import owned_labels

DEVICE_CLASS = "gpu.nvidia.com"  # the DeviceClass NVIDIA's DRA driver installs for whole GPUs
RESOURCE_CLAIM = ("resource.k8s.io/v1", "ResourceClaim")
RESOURCE_CLAIM_TEMPLATE = ("resource.k8s.io/v1", "ResourceClaimTemplate")
CLAIM_NAME = "gpus"  # the pod's claim, and its one device request


def template_name(count: int) -> str:
    return f"gpucanary-gpus-{count}"


def claiming(obj: dict) -> tuple[dict, set[int]]:
    """A copy of the workload `obj` whose containers claim, from the run's templates, as many `gpu.nvidia.com`
    devices as they request `nvidia.com/gpu` (MIG profiles stay as they are); and the counts claimed, one template
    each."""
    obj = copy.deepcopy(obj)
    _, spec = pod_spec(obj)
    counts = set()
    for container in spec.get("containers") or []:
        resources = container.get("resources") or {}
        asked = 0
        for section in ("limits", "requests"):
            values = resources.get(section) or {}
            if GPU_RESOURCE in values:
                asked = max(asked, int(values.pop(GPU_RESOURCE)))
        if asked:
            name = f"{CLAIM_NAME}-{container['name']}"
            container.setdefault("resources", {}).setdefault("claims", []).append({"name": name})
            spec.setdefault("resourceClaims", []).append(
                {"name": name, "resourceClaimTemplateName": template_name(asked)}
            )
            counts.add(asked)
    return obj, counts


def template(count: int, namespace: str, run_id: str) -> dict:
    """The ResourceClaimTemplate of `count` whole GPUs of the driver's DeviceClass, no admin access."""
    request = {"deviceClassName": DEVICE_CLASS, "allocationMode": "ExactCount", "count": count}
    return {
        "apiVersion": RESOURCE_CLAIM_TEMPLATE[0],
        "kind": RESOURCE_CLAIM_TEMPLATE[1],
        "metadata": {"name": template_name(count), "namespace": namespace, "labels": owned_labels(run_id)},
        "spec": {"spec": {"devices": {"requests": [{"name": CLAIM_NAME, "exactly": request}]}}},
    }


class ClaimedGpus:
    """A pod's GPUs held through claims, each claim read once it is allocated (an allocation does not change). A
    claim gone before it was read (its pod deleted) counts what an earlier record of the pod saw."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._allocated: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def __call__(self, pod: dict) -> int:
        """0 at once for a pod that holds no claim: no request is made."""
        namespace = (pod.get("metadata") or {}).get("namespace", "")
        return sum(self._gpus(namespace, name) for name in claim_names(pod))

    def _gpus(self, namespace: str, name: str) -> int:
        with self._lock:
            if (namespace, name) in self._allocated:
                return self._allocated[(namespace, name)]
        try:
            claim = self.kube.get(*RESOURCE_CLAIM, name, namespace=namespace)
        except GpucanaryError:
            return 0
        if not (claim.get("status") or {}).get("allocation"):
            return 0  # not allocated yet: read again with the pod's next record
        gpus = allocated_gpus(claim)
        with self._lock:
            self._allocated[(namespace, name)] = gpus
        return gpus
