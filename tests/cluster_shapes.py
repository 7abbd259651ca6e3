"""Cluster objects as the GPU Operator's chart and a run leave them (the ClusterPolicy, NVIDIADrivers, the driver
DaemonSet, GPU nodes) on the in-memory apiserver: shared by the tests of applying a policy and of widen.
Imported by its bare name (tests/ is on sys.path)."""

from __future__ import annotations

from kube_double import FakeKube

from pytest_gpucanary.canary.pool import Pool
from pytest_gpucanary.cluster import ClusterInfo
from pytest_gpucanary.gpu_operator import (
    CLUSTER_POLICY,
    DRIVER_COMPONENT_SELECTOR,
    GPU_PRESENT_LABEL,
    NVIDIADRIVER,
    SKIP_LABEL,
    UPGRADE_STATE_LABEL,
)

DRIVER_FROM, DRIVER_TO = "570.172.08", "580.82.07"
OPERATOR_NS = "gpu-operator"
# The fleet's ClusterPolicy policy (fixtures/fleet/clusterpolicy.yaml): every field written out.
ORIGINAL_POLICY = {
    "autoUpgrade": True, "maxParallelUpgrades": 1, "maxUnavailable": "25%",
    "waitForCompletion": {"podSelector": "", "timeoutSeconds": 0},
    "podDeletion": {"force": False, "timeoutSeconds": 300, "deleteEmptyDir": False},
    "drain": {"enable": False, "force": False, "podSelector": "", "timeoutSeconds": 300, "deleteEmptyDir": False},
}
# The policy under test, in the shape `UpgradePolicy.to_cr()` writes.
CANARY_POLICY = {
    "autoUpgrade": True, "maxParallelUpgrades": 2, "maxUnavailable": 1,
    "waitForCompletion": {"podSelector": "app=trainer", "timeoutSeconds": 600},
    "podDeletion": {"force": True, "timeoutSeconds": 120, "deleteEmptyDir": True},
    "drain": {"enable": True, "force": False, "podSelector": "", "timeoutSeconds": 900, "deleteEmptyDir": True},
}


def node(name: str, **labels: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {GPU_PRESENT_LABEL: "true", **labels}}, "spec": {}}


def cluster_policy(*, nvidiadriver_mode: bool, policy: dict | None = None) -> dict:
    return {"apiVersion": CLUSTER_POLICY[0], "kind": CLUSTER_POLICY[1],
            "metadata": {"name": "cluster-policy", "annotations": {"owner": "platform-team"}},
            "spec": {"driver": {"useNvidiaDriverCRD": nvidiadriver_mode, "version": DRIVER_FROM,
                                "upgradePolicy": policy or ORIGINAL_POLICY},
                     "toolkit": {"enabled": True}}}


def nvidiadriver(name: str, pool: str, **spec: object) -> dict:
    return {"apiVersion": NVIDIADRIVER[0], "kind": NVIDIADRIVER[1], "metadata": {"name": name},
            "spec": {"driverType": "gpu", "version": DRIVER_FROM,
                     "nodeSelector": {"gpucanary.io/driver-pool": pool}, **spec}}


def driver_daemonset(version: str) -> dict:
    """The operator's driver DaemonSet, its controller caught up (observedGeneration == generation)."""
    return {"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "nvidia-driver-daemonset", "namespace": OPERATOR_NS,
                         "labels": {DRIVER_COMPONENT_SELECTOR.split("=")[0]: DRIVER_COMPONENT_SELECTOR.split("=")[1]}},
            "spec": {"template": {"spec": {"containers": [
                {"name": "nvidia-driver-ctr", "image": f"nvcr.io/nvidia/driver:{version}-ubuntu22.04"}]}}},
            "status": {"observedGeneration": 1}}


def content(obj: dict) -> dict:
    """What the user and the operator read: the object without its server-kept counters."""
    meta = {k: v for k, v in obj["metadata"].items() if k not in ("resourceVersion", "generation")}
    return {**obj, "metadata": meta}


def nvidiadriver_cluster(fake: FakeKube, *, per_driver_policy: bool) -> tuple[ClusterInfo, Pool]:
    fake.create(cluster_policy(nvidiadriver_mode=True))
    fake.create(nvidiadriver("fleet", "fleet", upgradePolicy=ORIGINAL_POLICY))
    fake.create(nvidiadriver("canary-pool", "canary"))          # no policy of its own yet
    for n in (node("canary-0", **{"gpucanary.io/driver-pool": "canary"}),
              node("gpu-1", **{"gpucanary.io/driver-pool": "fleet"})):
        fake.create(n)
    cluster = ClusterInfo("cluster-policy", nvidiadriver_mode=True, per_driver_policy=per_driver_policy,
                          operator_namespace=OPERATOR_NS, gpu_nodes=("canary-0", "gpu-1"))
    return cluster, Pool(("canary-0",), "canary-pool", DRIVER_FROM)


def clusterpolicy_cluster(fake: FakeKube, *, policy: dict | None = None) -> tuple[ClusterInfo, Pool]:
    fake.create(cluster_policy(nvidiadriver_mode=False, policy=policy))
    fake.create(driver_daemonset(DRIVER_FROM))
    fake.create(node("canary-0", **{UPGRADE_STATE_LABEL: "upgrade-done"}))
    fake.create(node("gpu-1", **{UPGRADE_STATE_LABEL: "upgrade-done"}))
    fake.create(node("gpu-2"))                                   # never upgraded: no state label
    fake.create(node("gpu-3", **{SKIP_LABEL: "true"}))           # held back by someone else
    cluster = ClusterInfo("cluster-policy", nvidiadriver_mode=False, per_driver_policy=False,
                          operator_namespace=OPERATOR_NS, gpu_nodes=("canary-0", "gpu-1", "gpu-2", "gpu-3"))
    return cluster, Pool(("canary-0",), None, DRIVER_FROM)
