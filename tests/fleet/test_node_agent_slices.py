"""The fleet's DRA stand-in on KWOK nodes (GPUCluster mode): the node agent publishes a node's GPUs as a gpu.nvidia.com
ResourceSlice while the operator's DRA kubelet plugin pod is Ready on a loaded driver, withdraws it for the swap and
publishes it again on the new driver onto the empty pool, as NVIDIA's DRA kubelet plugin and the kubelet do;
its driver manager drains the plugin after the other operands, as k8s-driver-manager does."""

from __future__ import annotations

from kube_double import FakeKube

from pytest_gpucanary.canary.dra import RESOURCE_SLICE
from pytest_gpucanary.fleet.dra_slices import SlicePublisher
from pytest_gpucanary.fleet.images import gpu_uuid
from pytest_gpucanary.fleet.node_agent import NodeAgent

NODE = "gpu-node-0"


def slices(fake: FakeKube) -> list[dict]:
    return fake.list(*RESOURCE_SLICE, field_selector=f"spec.nodeName={NODE},spec.driver=gpu.nvidia.com")


def test_a_slice_per_loaded_driver_shaped_as_nvidias_plugin_publishes_it() -> None:
    """As dra-driver-nvidia-gpu v0.5.0's kubelet plugin publishes a node's GPUs over the fleet's NVML state: its device
    attributes and memory, its slice name and owner, and generation 1 on an empty pool, again after the swap (the
    kubelet deleted the old slice with the plugin's registration)."""
    fake = FakeKube()
    fake.create({"apiVersion": "v1", "kind": "Node",
                 "metadata": {"name": NODE, "labels": {"nvidia.com/gpu.count": "8"}}})
    agent = NodeAgent(fake, slices=SlicePublisher(fake))

    agent.slices.show(NODE, "580.82.07")
    [first] = slices(fake)
    agent.slices.show(NODE, None)                      # the operands left for the swap
    gone = slices(fake)
    agent.slices.show(NODE, "580.95.05")
    [second] = slices(fake)

    assert first["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert first["metadata"]["name"].startswith(f"00000-gpu.nvidia.com-{NODE}-")
    assert first["metadata"]["ownerReferences"][0] | {"uid": ""} == {"apiVersion": "v1", "kind": "Node", "name": NODE,
                                                                      "uid": "", "controller": True}
    # gpu-0 of gpu-kubelet-0 as the real plugin built it over the NVML stand-in (UUIDs derive from the node's name)
    device = first["spec"]["devices"][0]
    assert device["name"] == "gpu-0" and device["capacity"] == {"memory": {"value": "81559Mi"}}
    assert device["attributes"] | {"uuid": None} == {
        "type": {"string": "gpu"}, "uuid": None, "productName": {"string": "NVIDIA H100 80GB HBM3"},
        "brand": {"string": "Nvidia"}, "architecture": {"string": "Hopper"},
        "cudaComputeCapability": {"version": "9.0.0"}, "driverVersion": {"version": "580.82.7"},
        "cudaDriverVersion": {"version": "13.0.0"}, "resource.kubernetes.io/pciBusID": {"string": "0000:18:00.0"}}
    assert gone == []
    assert second["spec"]["pool"]["generation"] == 1 and second["metadata"]["name"] != first["metadata"]["name"]
    assert {d["attributes"]["driverVersion"]["version"] for d in second["spec"]["devices"]} == {"580.95.5"}


def test_the_uuids_are_the_ones_the_nvml_stand_in_gives_the_real_plugin() -> None:
    assert gpu_uuid("gpu-kubelet-0", 0) == "GPU-e59633e0-afc9-cbf7-58ff-aec249cf6b71"   # the plugin's, over the shim


def test_a_restarted_agent_keeps_the_slice_it_finds_at_the_loaded_version() -> None:
    fake = FakeKube()
    fake.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {}}})
    NodeAgent(fake, slices=SlicePublisher(fake)).slices.show(NODE, "580.82.07")
    [before] = slices(fake)
    writes = len(fake.writes)

    again = NodeAgent(fake, slices=SlicePublisher(fake))
    again.slices.show(NODE, "580.82.07")
    again.slices.show(NODE, "580.95.05")

    [after] = slices(fake)
    assert len(fake.writes) == writes + 2                           # nothing for the first, delete + create next
    assert after["metadata"]["name"] != before["metadata"]["name"]


def _running(name: str, labels: dict, image: str = "busybox") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "gpu-operator", "labels": labels,
                         "annotations": {"gpucanary.io/simulated-ready": "true"}},
            "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": image}]},
            "status": {"phase": "Running", "containerStatuses": [{"name": "main", "ready": True, "image": image}]}}


def _gpu_node(fake: FakeKube, labels: dict | None = None) -> None:
    fake.create({"apiVersion": "v1", "kind": "Node",
                 "metadata": {"name": NODE, "labels": {"nvidia.com/gpu.count": "8", **(labels or {})},
                              "annotations": {"kwok.x-k8s.io/node": "fake"}}})


DRIVER_LABELS = {"app.kubernetes.io/component": "nvidia-driver"}
DRIVER_IMAGE = "nvcr.io/nvidia/driver:580.82.07-ubuntu22.04"
DRA_PLUGIN_LABELS = {"app": "nvidia-dra-driver-kubelet-plugin"}
DEVICE_PLUGIN_LABELS = {"app": "nvidia-device-plugin-daemonset"}


def test_in_gpucluster_mode_the_dra_kubelet_plugin_offers_the_slice_and_there_is_no_extended_resource() -> None:
    """GPUCluster mode: the DRA kubelet plugin Ready on a loaded driver publishes the node's slice, and the node never
    shows nvidia.com/gpu; with the device plugin (ClusterPolicy's operands) it is the other way round."""
    for dra, plugin_labels, wanted_slice, wanted_gpus in (
        (True, DRA_PLUGIN_LABELS, {"580.82.7"}, None),
        (True, DEVICE_PLUGIN_LABELS, set(), None),
        (False, DEVICE_PLUGIN_LABELS, set(), "8"),
    ):
        fake = FakeKube()
        _gpu_node(fake)
        driver = fake.create(_running("nvidia-driver", DRIVER_LABELS, DRIVER_IMAGE))
        plugin = fake.create(_running("plugin", plugin_labels))
        agent = NodeAgent(fake, slices=SlicePublisher(fake) if dra else None)
        agent.pods = {p["metadata"]["uid"]: p for p in (driver, plugin)}

        agent.step(NODE)

        gpus = fake.get("v1", "Node", NODE).get("status", {}).get("allocatable", {}).get("nvidia.com/gpu")
        versions = {d["attributes"]["driverVersion"]["version"] for s in slices(fake) for d in s["spec"]["devices"]}
        assert (versions, gpus) == (wanted_slice, wanted_gpus), (dra, plugin_labels)


def test_the_driver_manager_drains_the_dra_kubelet_plugin_last_and_restores_it_with_the_others() -> None:
    """As k8s-driver-manager v0.12.0 does (evictKubeletPlugin): the operands first (here the DRA validator, a claim
    holder), then the kubelet plugin that unprepares their claims; the new driver loads only once both are gone."""
    fake = FakeKube()
    deploy = "nvidia.com/gpu.deploy."
    _gpu_node(fake, {"nvidia.com/cuda.driver-version.full": "580.82.07", f"{deploy}dra-validator": "true",
                     f"{deploy}dra-driver": "true", f"{deploy}driver": "true"})
    driver = fake.create({**_running("nvidia-driver-new", DRIVER_LABELS, DRIVER_IMAGE),
                          "metadata": {"name": "nvidia-driver-new", "namespace": "gpu-operator",
                                       "labels": DRIVER_LABELS},
                          "status": {"phase": "Pending"}})
    validator = fake.create(_running("dra-validator", {"app": "nvidia-operator-validator"}))
    plugin = fake.create(_running("dra-plugin", DRA_PLUGIN_LABELS))
    agent = NodeAgent(fake, slices=SlicePublisher(fake))
    agent.pods = {p["metadata"]["uid"]: p for p in (driver, validator, plugin)}

    def deploy_labels() -> dict[str, str]:
        labels = fake.get("v1", "Node", NODE)["metadata"]["labels"]
        return {k.removeprefix(deploy): v for k, v in labels.items() if k.startswith(deploy)}

    def driver_allowed() -> bool:
        return "gpucanary.io/simulated-ready" in (fake.get("v1", "Pod", "nvidia-driver-new", namespace="gpu-operator")
                                                  ["metadata"].get("annotations") or {})

    agent.step(NODE)
    first = deploy_labels()
    del agent.pods[validator["metadata"]["uid"]]      # the DaemonSet controller took the validator off
    agent.step(NODE)
    second = deploy_labels()
    del agent.pods[plugin["metadata"]["uid"]]
    allowed_before = driver_allowed()
    agent.step(NODE)

    assert first == {"dra-validator": "paused-for-driver-upgrade", "dra-driver": "true", "driver": "true"}
    assert second == {"dra-validator": "paused-for-driver-upgrade", "dra-driver": "paused-for-driver-upgrade",
                      "driver": "true"}
    assert not allowed_before
    assert deploy_labels() == {"dra-validator": "true", "dra-driver": "true", "driver": "true"}
    assert driver_allowed()
