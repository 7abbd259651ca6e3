"""Which nodes offer GPUs through DRA, and the line a run on such a cluster says it does not prove."""

from __future__ import annotations

from kube_double import FakeKube

from pytest_gpucanary.canary import dra
from pytest_gpucanary.kube.errors import Forbidden


def resource_slice(name: str, node: str, driver: str = "gpu.nvidia.com") -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1,
                                                                   "resourceSliceCount": 1}, "devices": []}}


def test_the_nodes_of_nvidias_gpu_slices_only_once_each() -> None:
    fake = FakeKube()
    for obj in (resource_slice("a-gpu-0", "gpu-a"), resource_slice("a-gpu-1", "gpu-a"), resource_slice("b-gpu", "gpu-b"),
                resource_slice("c-nic", "gpu-c", driver="rdma.example.com")):
        fake.create(obj)
    assert dra.gpu_nodes(fake) == ("gpu-a", "gpu-b")


def test_no_dra_where_the_kind_is_not_served_or_not_granted() -> None:
    class Refusing(FakeKube):
        def list(self, *args, **kwargs):
            raise Forbidden("list resourceslices: 403")

    assert dra.gpu_nodes(FakeKube()) == () and dra.gpu_nodes(Refusing()) == ()


def test_the_line_names_the_nodes_and_before_v26_7_that_pod_deletion_cannot_see_claims() -> None:
    nodes = tuple(f"gpu-{i}" for i in range(7))
    old = dra.note(nodes, "v26.3.3")
    assert old.startswith("7 node(s) offer GPUs through DRA (gpu.nvidia.com ResourceSlices: gpu-0, gpu-1, gpu-2, gpu-3, "
                          "gpu-4 and 2 more): the canary's GPU job claims its GPU through DRA only where the pool's nodes "
                          "offer GPUs this way")
    assert "on GPU Operator v26.3.3 pod deletion never deletes a claim-holding pod" in old
    assert "pod deletion" not in dra.note(nodes, "v26.7.0") and "pod deletion" not in dra.note(nodes, None)
