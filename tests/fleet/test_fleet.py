"""The local fleet behaves like a small GPU cluster: scheduling, eviction, PDBs, Job timing, metrics."""

from __future__ import annotations

from datetime import datetime

import pytest
from harness import eventually
from prometheus_api_client import PrometheusConnect

from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import Throttled

pytestmark = pytest.mark.e2e


def pod(name: str, namespace: str, *, gpus: int = 0, annotations: dict | None = None) -> dict:
    resources = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
            "spec": {"containers": [{"name": "main", "image": "busybox", "resources": resources}],
                     "terminationGracePeriodSeconds": 1}}


def is_running(obj: dict) -> bool:
    return obj.get("status", {}).get("phase") == "Running"


def test_gpu_pod_is_scheduled_onto_a_gpu_node_and_runs(kube: Kube, namespace: str) -> None:
    kube.create(pod("cuda", namespace, gpus=1))
    running = kube.wait_for("v1", "Pod", "cuda", is_running, namespace=namespace, timeout_s=60)
    node = kube.get("v1", "Node", running["spec"]["nodeName"])
    assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) >= 1


def test_pod_asking_more_gpus_than_any_node_stays_pending(kube: Kube, namespace: str) -> None:
    kube.create(pod("greedy", namespace, gpus=9))
    kube.wait_for("v1", "Pod", "greedy",
                  lambda p: any(c["type"] == "PodScheduled" and c["status"] == "False"
                                for c in p.get("status", {}).get("conditions", [])),
                  namespace=namespace, timeout_s=60)
    events = kube.list("v1", "Event", namespace=namespace,
                       field_selector="involvedObject.name=greedy,reason=FailedScheduling")
    assert events, "no FailedScheduling event for the 9-GPU pod"
    assert "nvidia.com/gpu" in events[0]["message"]
    assert kube.get("v1", "Pod", "greedy", namespace=namespace)["status"]["phase"] == "Pending"


def test_evicted_deployment_pod_is_replaced_and_pdb_refuses_second_eviction(kube: Kube, namespace: str) -> None:
    labels = {"app": "api"}
    kube.create({"apiVersion": "apps/v1", "kind": "Deployment",
                 "metadata": {"name": "api", "namespace": namespace},
                 "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                          "template": {"metadata": {"labels": labels},
                                       "spec": pod("x", namespace)["spec"]}}})
    first = _running_pod(kube, namespace, "app=api")
    kube.evict(first, namespace=namespace)
    replacement = _running_pod(kube, namespace, "app=api", besides=first)
    assert replacement != first

    kube.create({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                 "metadata": {"name": "api", "namespace": namespace},
                 "spec": {"minAvailable": 1, "selector": {"matchLabels": labels}}})
    kube.wait_for("policy/v1", "PodDisruptionBudget", "api",
                  lambda b: b.get("status", {}).get("currentHealthy") == 1
                  and b["status"].get("observedGeneration") == b["metadata"]["generation"],
                  namespace=namespace, timeout_s=60)
    with pytest.raises(Throttled) as refused:
        kube.evict(replacement, namespace=namespace)
    assert "disruption budget" in str(refused.value)


def _running_pod(kube: Kube, namespace: str, selector: str, *, besides: str = "") -> str:
    return kube.watch_until(
        "v1", "Pod",
        lambda pods: next((name for name, item in pods.items() if name != besides and is_running(item)
                           and not item["metadata"].get("deletionTimestamp")), None),
        namespace=namespace, label_selector=selector, timeout_s=90)


def test_job_pod_completes_after_its_configured_duration_not_before(kube: Kube, namespace: str) -> None:
    run_s = 20
    template = pod("x", namespace, annotations={"gpucanary.io/run-duration": f"{run_s}s"})
    template["spec"]["restartPolicy"] = "Never"
    kube.create({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train", "namespace": namespace},
                 "spec": {"backoffLimit": 0, "template": {"metadata": {"annotations": template["metadata"]["annotations"]},
                                                           "spec": template["spec"]}}})
    done = kube.wait_for("batch/v1", "Job", "train", lambda j: j.get("status", {}).get("succeeded") == 1,
                         namespace=namespace, timeout_s=run_s + 60)
    [job_pod] = kube.list("v1", "Pod", namespace=namespace, label_selector="job-name=train")
    state = job_pod["status"]["containerStatuses"][0]["state"]["terminated"]
    ran_s = (_ts(state["finishedAt"]) - _ts(state["startedAt"])).total_seconds()
    assert run_s - 1 <= ran_s <= run_s + 5, f"pod ran {ran_s:.0f} s (server clock, 1 s resolution), wanted {run_s} s"
    assert done["status"]["succeeded"] == 1


def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


@pytest.mark.parametrize("job", ["apiserver", "gpu-operator"])
def test_prometheus_reports_the_target_up(gpucanary_fleet, job: str) -> None:
    prometheus = PrometheusConnect(url=gpucanary_fleet.fleet.prometheus_url, disable_ssl=True, timeout=10)
    result = eventually(lambda: prometheus.custom_query(f'up{{job="{job}"}}'), timeout_s=60, every_s=2)
    assert result, f"Prometheus has no `up` sample for {job} after 60 s"
    assert result[0]["value"][1] == "1"


def test_dcgm_metrics_carry_each_gpu_node_s_driver_version(gpucanary_fleet) -> None:
    prometheus = PrometheusConnect(url=gpucanary_fleet.fleet.prometheus_url, disable_ssl=True, timeout=10)
    def versions_by_node() -> dict[str, set[str]]:
        versions: dict[str, set[str]] = {}
        for s in prometheus.custom_query('DCGM_FI_DEV_GPU_UTIL{modelName!=""}'):
            versions.setdefault(s["metric"]["Hostname"], set()).add(s["metric"].get("DCGM_FI_DRIVER_VERSION", ""))
        return versions

    def every_node() -> dict[str, set[str]]:
        versions = versions_by_node()
        return versions if len(versions) >= len(gpucanary_fleet.fleet.gpu_node_names()) else {}

    versions = eventually(every_node, timeout_s=60, every_s=2) or versions_by_node()
    assert set(versions) >= set(gpucanary_fleet.fleet.gpu_node_names()), versions
    assert all(v == {"580.82.07"} for v in versions.values()), versions


def test_paged_read_returns_what_one_list_does(kube: Kube) -> None:
    """`Kube.each` follows the apiserver's continue tokens: pages of 2 give every operator pod once."""
    listed = sorted(p["metadata"]["uid"] for p in kube.list("v1", "Pod", namespace="gpu-operator"))
    paged = [p["metadata"]["uid"] for p in kube.each("v1", "Pod", page_size=2)
             if p["metadata"]["namespace"] == "gpu-operator"]
    assert len(listed) > 2 and sorted(paged) == listed
