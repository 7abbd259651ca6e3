"""The fleet's DRA stand-in on KWOK nodes: the node agent publishes a node's GPUs as a gpu.nvidia.com
ResourceSlice while its device plugin is registered on a loaded driver, withdraws it for the swap and publishes it
again on the new driver at a higher pool generation, as NVIDIA's DRA kubelet plugin and the kubelet do."""

from __future__ import annotations

from kube_double import FakeKube

from pytest_gpucanary.canary.dra import RESOURCE_SLICE
from pytest_gpucanary.fleet.dra_slices import SlicePublisher
from pytest_gpucanary.fleet.node_agent import NodeAgent

NODE = "gpu-node-0"


def slices(fake: FakeKube) -> list[dict]:
    return fake.list(*RESOURCE_SLICE, field_selector=f"spec.nodeName={NODE},spec.driver=gpu.nvidia.com")


def test_a_slice_per_loaded_driver_at_a_higher_generation_each_time() -> None:
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
    assert [d["attributes"]["driverVersion"] for d in first["spec"]["devices"]] == [{"version": "580.82.7"}] * 8
    assert first["metadata"]["ownerReferences"][0]["kind"] == "Node"   # gone with a KWOK pool node
    assert gone == []
    assert second["spec"]["pool"]["generation"] == 2 and second["metadata"]["name"] != first["metadata"]["name"]
    assert {d["attributes"]["driverVersion"]["version"] for d in second["spec"]["devices"]} == {"580.95.5"}


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
    assert after["spec"]["pool"]["generation"] == before["spec"]["pool"]["generation"] + 1


def _running(name: str, labels: dict, image: str = "busybox") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "gpu-operator", "labels": labels,
                         "annotations": {"gpucanary.io/simulated-ready": "true"}},
            "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": image}]},
            "status": {"phase": "Running", "containerStatuses": [{"name": "main", "ready": True, "image": image}]}}


def test_the_device_plugin_registered_on_a_loaded_driver_publishes_the_slice_only_with_dra() -> None:
    for dra in (True, False):
        fake = FakeKube()
        fake.create({"apiVersion": "v1", "kind": "Node",
                     "metadata": {"name": NODE, "labels": {"nvidia.com/gpu.count": "8"},
                                  "annotations": {"kwok.x-k8s.io/node": "fake"}}})
        driver = fake.create(_running("nvidia-driver", {"app.kubernetes.io/component": "nvidia-driver"},
                                      "nvcr.io/nvidia/driver:580.82.07-ubuntu22.04"))
        plugin = fake.create(_running("nvidia-device-plugin", {"app": "nvidia-device-plugin-daemonset"}))
        agent = NodeAgent(fake, slices=SlicePublisher(fake) if dra else None)
        agent.pods = {p["metadata"]["uid"]: p for p in (driver, plugin)}

        agent.step(NODE)

        assert fake.get("v1", "Node", NODE)["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        versions = {d["attributes"]["driverVersion"]["version"] for s in slices(fake) for d in s["spec"]["devices"]}
        assert versions == ({"580.82.7"} if dra else set()), (dra, versions)
