"""The GPU job claiming its GPUs through DRA, and a pod's GPUs counted through its claims as the operator's pod
deletion counts them."""

from __future__ import annotations

from harness import eventually
from kube_double import FakeKube

from pytest_gpucanary.canary import claims, workloads
from pytest_gpucanary.canary.probes import ProbeLoop
from pytest_gpucanary.canary.recorder import trim


def placement() -> workloads.Placement:
    return workloads.Placement("gpucanary-r1", "r1", "pool-0")


def test_the_gpu_job_claims_as_many_gpus_as_it_requested_from_one_template_per_count() -> None:
    job = workloads.gpu_job(None, placement(), duration_s=60)
    claimed, counts = claims.claiming(job)
    assert counts == {1}
    spec = claimed["spec"]["template"]["spec"]
    [container] = spec["containers"]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert container["resources"]["claims"] == [{"name": "gpus-cuda-work"}]
    assert spec["resourceClaims"] == [{"name": "gpus-cuda-work", "resourceClaimTemplateName": "gpucanary-gpus-1"}]
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}  # a copy

    template = claims.template(1, "gpucanary-r1", "r1")
    assert template["metadata"]["name"] == "gpucanary-gpus-1" and template["metadata"]["namespace"] == "gpucanary-r1"
    assert template["metadata"]["labels"]["gpucanary.io/run-id"] == "r1"
    [request] = template["spec"]["spec"]["devices"]["requests"]
    assert request == {"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount",
                                                    "count": 1}}


def test_mig_profiles_and_pods_without_gpus_are_left_as_they_are() -> None:
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"}, "spec": {"template": {"metadata": {}, "spec": {
        "containers": [{"name": "mig", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}},
                       {"name": "cpu", "resources": {"requests": {"cpu": "1"}}}]}}}}
    claimed, counts = claims.claiming(job)
    assert counts == set() and claimed == job


def pod(claims_spec: list[dict], statuses: list[dict] | None = None, namespace: str = "team") -> dict:
    return {"metadata": {"name": "p", "namespace": namespace, "uid": "u1"},
            "spec": {"nodeName": "pool-0", "resourceClaims": claims_spec,
                     "containers": [{"name": "c", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]},
            "status": {"resourceClaimStatuses": statuses or []}}


def claim(name: str, results: list[dict] | None, namespace: str = "team") -> dict:
    status = {"allocation": {"devices": {"results": results}}} if results is not None else {}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace}, "spec": {}, "status": status}


def result(device: str, driver: str = "gpu.nvidia.com", **extra: object) -> dict:
    return {"request": "gpus", "driver": driver, "pool": "pool-0", "device": device, **extra}


def test_a_pods_claims_named_in_its_spec_or_made_from_a_template() -> None:
    held = pod([{"name": "a", "resourceClaimName": "shared"}, {"name": "b", "resourceClaimTemplateName": "t"},
                {"name": "c", "resourceClaimTemplateName": "t"}],
               [{"name": "b", "resourceClaimName": "p-b-x1"}])   # c's claim is not made yet
    assert claims.claim_names(held) == ["shared", "p-b-x1"]


def test_only_devices_of_nvidias_gpu_driver_without_admin_access_count() -> None:
    assert claims.allocated_gpus(claim("c", [result("gpu-0"), result("gpu-1"), result("nic-0", "rdma.example.com"),
                                             result("gpu-2", adminAccess=True)])) == 2
    assert claims.allocated_gpus(claim("c", None)) == 0


def test_claimed_gpus_reads_each_claim_once_allocated_and_remembers_it_after_it_is_gone() -> None:
    fake = FakeKube()
    fake.create(claim("p-gpus", None))
    counted = claims.ClaimedGpus(fake)
    holder = pod([{"name": "gpus", "resourceClaimTemplateName": "t"}], [{"name": "gpus", "resourceClaimName": "p-gpus"}])
    assert counted(holder) == 0                       # not allocated yet: asked again with the next record
    fake.patch("resource.k8s.io/v1", "ResourceClaim", "p-gpus", {"status": claim("p-gpus", [result("gpu-3")])["status"]},
               namespace="team")
    assert counted(holder) == 1
    fake.delete("resource.k8s.io/v1", "ResourceClaim", "p-gpus", namespace="team")
    assert counted(holder) == 1                       # deleted with its pod: the allocation read before counts
    assert counted(pod([{"name": "x", "resourceClaimName": "never-made"}])) == 0


def test_the_recorder_counts_a_pods_claimed_gpus_and_a_claim_holder_does_not_hold_the_driver_unasked() -> None:
    holder = pod([{"name": "gpus", "resourceClaimTemplateName": "t"}])
    kept = trim("Pod", holder, claimed_gpus=2)
    assert kept["spec"]["gpus"] == 2 and kept["spec"]["claimedGpus"] == 2 and "holdsDriver" not in kept["spec"]
    unclaimed = trim("Pod", holder)
    assert unclaimed["spec"]["gpus"] == 0 and unclaimed["spec"]["holdsDriver"] == "NVIDIA_VISIBLE_DEVICES=all"


def test_the_fleet_probe_claims_its_gpu_where_the_gpu_job_does_and_makes_its_template_once() -> None:
    fake = FakeKube()
    fake.create(claims.template(1, "gpucanary-r1", "r1"))       # the GPU job's, made before the loop
    loop = ProbeLoop(fake, placement(), manifest=None, interval_s=0.01, pool_nodes=("pool-0",), claim_gpus=True)
    loop.start()
    try:
        assert eventually(lambda: len(loop.created) >= 4, timeout_s=10)
    finally:
        loop.stop()
    assert loop.errors == []
    jobs = {j["metadata"]["labels"]["gpucanary.io/probe-scope"]: j["spec"]["template"]["spec"]
            for j in fake.list("batch/v1", "Job", namespace="gpucanary-r1")}
    assert jobs["fleet"]["resourceClaims"] == [{"name": "gpus-probe", "resourceClaimTemplateName": "gpucanary-gpus-1"}]
    assert "nvidia.com/gpu" not in jobs["fleet"]["containers"][0]["resources"].get("limits", {})
    assert "resourceClaims" not in jobs["pool"]      # a pool probe asks for no GPU
    assert [t["metadata"]["name"] for t in fake.list(*claims.RESOURCE_CLAIM_TEMPLATE, namespace="gpucanary-r1")] == [
        "gpucanary-gpus-1"]
