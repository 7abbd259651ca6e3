"""What NVIDIA's DRA kubelet plugin publishes on a KWOK GPU node (GPUCluster mode, `GPUCANARY_FLEET_DRA`), where the
operator's plugin pod is KWOK's and runs nothing: the node's GPUs as one ResourceSlice of driver `gpu.nvidia.com`,
shaped as the plugin publishes them (one pool named after the node, each device's `driverVersion` in semver), while
the plugin pod is Ready on a loaded driver; withdrawn when it goes, as the kubelet deletes a plugin's slices when it
unregisters, and published again on the new driver at the next pool generation. The node agent says when
(`NodeAgent.step`). The DeviceClass that claims name is the operator's (manifests/state-dra-driver)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.canary.dra import RESOURCE_SLICE
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.ladder.slices import GPU_DRIVER, semver


@dataclass
class SlicePublisher:
    kube: Kube
    shown: dict[str, str | None] = field(default_factory=dict)  # node -> driver version its slice offers
    generation: dict[str, int] = field(default_factory=dict)  # node -> the pool generation last published

    def show(self, node: str, version: str | None) -> None:
        """The node's gpu.nvidia.com ResourceSlice offering its GPUs at `version`, or none."""
        if node in self.shown and self.shown[node] == version:
            return
        selector = f"spec.nodeName={node},spec.driver={GPU_DRIVER}"
        existing = self.kube.list(*RESOURCE_SLICE, field_selector=selector)
        generations = [int(s["spec"]["pool"]["generation"]) for s in existing]
        if version and existing and all(_offers(s, version) for s in existing):  # the agent restarted
            self.generation[node] = max(generations)
        else:
            for published in existing:
                self.kube.delete(*RESOURCE_SLICE, published["metadata"]["name"])
            if version:
                generation = max([self.generation.get(node, 0), *generations]) + 1
                self.kube.create(_resource_slice(self.kube.get("v1", "Node", node), version, generation))
                self.generation[node] = generation
        self.shown[node] = version


def _resource_slice(node: dict, version: str, generation: int) -> dict:
    """The node's GPUs as NVIDIA's DRA kubelet plugin publishes them (its device attributes, fewer of them)."""
    meta = node["metadata"]
    name = meta["name"]
    count = int((meta.get("labels") or {}).get(op.GPU_COUNT_LABEL, "8"))
    devices = [
        {
            "name": f"gpu-{i}",
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": f"GPU-{name}-{i}"},
                "index": {"int": i},
                "minor": {"int": i},
                "productName": {"string": "NVIDIA H100 80GB HBM3"},
                "brand": {"string": "Nvidia"},
                "architecture": {"string": "Hopper"},
                "cudaComputeCapability": {"version": "9.0.0"},
                "driverVersion": {"version": semver(version)},
            },
            "capacity": {"memory": {"value": "80Gi"}},
        }
        for i in range(count)
    ]
    return {
        "apiVersion": RESOURCE_SLICE[0],
        "kind": RESOURCE_SLICE[1],
        "metadata": {
            "generateName": f"{name}-{GPU_DRIVER}-",
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": meta["uid"]}],
        },
        "spec": {
            "driver": GPU_DRIVER,
            "nodeName": name,
            "pool": {"name": name, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def _offers(published: dict, version: str) -> bool:
    devices = published["spec"].get("devices") or []
    return bool(devices) and all(d["attributes"]["driverVersion"]["version"] == semver(version) for d in devices)
