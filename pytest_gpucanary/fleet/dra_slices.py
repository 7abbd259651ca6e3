"""What NVIDIA's DRA kubelet plugin publishes on a KWOK GPU node (GPUCluster mode, `GPUCANARY_FLEET_DRA`), where the
operator's plugin pod is KWOK's and runs nothing: the node's GPUs as one ResourceSlice of driver `gpu.nvidia.com`,
shaped as the plugin v0.5.0 publishes them over the fleet's NVML state (one pool named after the node, each device's
`driverVersion` in semver), while the plugin pod is Ready on a loaded driver. When it goes for the swap the slice
goes at once, where the kubelet deletes a plugin's slices 30 s after it unregisters (`defaultWipingDelay`; the
fleet's swap keeps the plugin away longer), and on the new driver it is published again onto the empty pool, at
generation 1 as the plugin's ResourceSlice controller starts a pool. The node agent says when (`NodeAgent.step`).
The DeviceClass that claims name is the operator's (manifests/state-dra-driver)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.canary.dra import RESOURCE_SLICE
from pytest_gpucanary.fleet import images
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.ladder.slices import GPU_DRIVER, semver


@dataclass
class SlicePublisher:
    kube: Kube
    shown: dict[str, str | None] = field(default_factory=dict)  # node -> driver version its slice offers

    def show(self, node: str, version: str | None) -> None:
        """The node's gpu.nvidia.com ResourceSlice offering its GPUs at `version`, or none. Published onto an empty
        pool it is at generation 1, as the plugin's ResourceSlice controller starts a pool; one the agent finds at
        `version` (it restarted) stays as it is."""
        if node in self.shown and self.shown[node] == version:
            return
        selector = f"spec.nodeName={node},spec.driver={GPU_DRIVER}"
        existing = self.kube.list(*RESOURCE_SLICE, field_selector=selector)
        if not (version and existing and all(_offers(s, version) for s in existing)):
            for published in existing:
                self.kube.delete(*RESOURCE_SLICE, published["metadata"]["name"])
            if version:
                self.kube.create(_resource_slice(self.kube.get("v1", "Node", node), version))
        self.shown[node] = version


def _resource_slice(node: dict, version: str) -> dict:
    """The node's GPUs as NVIDIA's DRA kubelet plugin v0.5.0 publishes them over the fleet's NVML state (its device
    attributes, capacity, slice name and owner, as the plugin built them over the NVML stand-in; no sysfs here, so no
    pcieRoot or numaNode)."""
    meta = node["metadata"]
    name = meta["name"]
    count = int((meta.get("labels") or {}).get(op.GPU_COUNT_LABEL, "8"))
    cuda = images.cuda_driver_version(version)
    devices = [
        {
            "name": f"gpu-{i}",
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": images.gpu_uuid(name, i)},
                "productName": {"string": images.GPU_PRODUCT},
                "brand": {"string": "Nvidia"},
                "architecture": {"string": "Hopper"},
                "cudaComputeCapability": {"version": "9.0.0"},
                "driverVersion": {"version": semver(version)},
                "cudaDriverVersion": {"version": f"{cuda // 1000}.{cuda % 1000 // 10}.0"},
                "resource.kubernetes.io/pciBusID": {"string": f"0000:{images.GPU_BUSES[i % 8].lower()}:00.0"},
            },
            "capacity": {"memory": {"value": f"{images.GPU_MEMORY_MIB}Mi"}},
        }
        for i in range(count)
    ]
    return {
        "apiVersion": RESOURCE_SLICE[0],
        "kind": RESOURCE_SLICE[1],
        "metadata": {
            # the ResourceSlice controller's: the slice's index in its pool, the driver, the node
            "generateName": f"00000-{GPU_DRIVER}-{name}-",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": name, "uid": meta["uid"], "controller": True}
            ],
        },
        "spec": {
            "driver": GPU_DRIVER,
            "nodeName": name,
            "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def _offers(published: dict, version: str) -> bool:
    devices = published["spec"].get("devices") or []
    return bool(devices) and all(d["attributes"]["driverVersion"]["version"] == semver(version) for d in devices)
