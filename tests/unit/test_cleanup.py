"""`gpucanary cleanup`: what a killed run left is restored or deleted by its run id; nothing else moves.

The leftovers are made by the product itself (`ExistingNodeProvider.provision`, `policy.apply`) on the
in-memory apiserver, then the run "dies" (nothing restores them) and `cleanup` runs on the store.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from kube_double import FakeKube

from pytest_gpucanary import lease
from pytest_gpucanary.cleanup import cleanup
from pytest_gpucanary.gpu_operator import (
    CLUSTER_POLICY, GPU_PRESENT_LABEL, NVIDIADRIVER, SKIP_LABEL, UPGRADE_STATE_LABEL,
)
from pytest_gpucanary.kube import owned_labels
from pytest_gpucanary.policy import apply as upgrade
from pytest_gpucanary.pool import Pool
from pytest_gpucanary.pool.existing_node import ExistingNodeProvider
from pytest_gpucanary.preflight import ClusterInfo

OPERATOR_NS = "gpu-operator"
POLICY = {"autoUpgrade": True, "maxParallelUpgrades": 1, "maxUnavailable": "25%",
          "waitForCompletion": {"podSelector": "", "timeoutSeconds": 0},
          "podDeletion": {"force": False, "timeoutSeconds": 300, "deleteEmptyDir": False},
          "drain": {"enable": False, "force": False, "podSelector": "", "timeoutSeconds": 300, "deleteEmptyDir": False}}
CANARY_POLICY = {**POLICY, "podDeletion": {"force": True, "timeoutSeconds": 60, "deleteEmptyDir": True}}


def node(name: str, *, taints: list | None = None, **labels: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {GPU_PRESENT_LABEL: "true", **labels}},
            "spec": {"providerID": f"aws:///{name}", **({"taints": taints} if taints else {})}}


def namespace(name: str, labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, **({"labels": labels} if labels else {})}}


def nvidiadriver(name: str, labels: dict | None = None) -> dict:
    return {"apiVersion": NVIDIADRIVER[0], "kind": NVIDIADRIVER[1],
            "metadata": {"name": name, **({"labels": labels} if labels else {})},
            "spec": {"driverType": "gpu", "version": "570.172.08", "nodeSelector": {"gpucanary.io/driver-pool": name}}}


def driver_pod(node_name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"nvidia-driver-daemonset-{node_name}", "namespace": OPERATOR_NS,
                         "labels": {"app.kubernetes.io/component": "nvidia-driver"},
                         "ownerReferences": [{"kind": "DaemonSet", "name": "nvidia-driver-daemonset"}]},
            "spec": {"nodeName": node_name, "containers": [{"name": "nvidia-driver-ctr",
                                                           "image": "nvcr.io/nvidia/driver:570.172.08-ubuntu22.04"}]},
            "status": {"phase": "Running"}}


def cluster_as_found() -> FakeKube:
    fake = FakeKube()
    for obj in (
        {"apiVersion": CLUSTER_POLICY[0], "kind": CLUSTER_POLICY[1], "metadata": {"name": "cluster-policy"},
         "spec": {"driver": {"version": "570.172.08", "upgradePolicy": POLICY}}},
        nvidiadriver("fleet"), nvidiadriver("pool-b"),
        namespace(OPERATOR_NS), namespace("team-a"),
        node("canary-0", taints=[{"key": "dedicated", "value": "canary", "effect": "NoSchedule"}],
             **{UPGRADE_STATE_LABEL: "upgrade-done", "team": "ml"}),
        node("gpu-1", **{UPGRADE_STATE_LABEL: "upgrade-done"}),
        node("gpu-2", **{UPGRADE_STATE_LABEL: "upgrade-done"}),
        node("gpu-3", **{SKIP_LABEL: "true"}),                 # held back by its owner, not by a canary
        driver_pod("canary-0"),
    ):
        fake.create(obj)
    return fake


def leave_two_killed_runs(fake: FakeKube) -> None:
    """run-b (NVIDIADriver mode, kwok pool) started first and still holds gpu-2; run-a (ClusterPolicy
    mode) carved out canary-0, held gpu-1 back and was killed mid-upgrade. Neither restored anything."""
    upgrade.apply(fake, ClusterInfo("cluster-policy", nvidiadriver_mode=True, per_driver_policy=True,
                                    operator_namespace=OPERATOR_NS, gpu_nodes=("kwok-run-b-0",)),
                  Pool(("kwok-run-b-0",), "pool-b", "570.172.08"), CANARY_POLICY, driver_to="580.82.07",
                  run_id="run-b")
    fake.patch("v1", "Node", "gpu-2", {"metadata": {
        "labels": {SKIP_LABEL: "true"},
        "annotations": {upgrade.SKIP_SET_ANNOTATION: json.dumps({"run_id": "run-b", "state": "upgrade-done"})}}})
    for run in ("run-a", "run-b"):
        fake.create(namespace(f"gpucanary-{run}", owned_labels(run)))
        fake.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "gpu-job-x", "namespace": f"gpucanary-{run}", "labels": owned_labels(run)}, "spec": {}})
        fake.create({**node(f"kwok-{run}-0"), "metadata": {"name": f"kwok-{run}-0", "labels": owned_labels(run)}})
    fake.create(nvidiadriver("gpucanary-run-a", owned_labels("run-a")))

    cluster = ClusterInfo("cluster-policy", nvidiadriver_mode=False, per_driver_policy=False,
                          operator_namespace=OPERATOR_NS, gpu_nodes=("canary-0", "gpu-1", "gpu-2", "gpu-3"))
    pool = ExistingNodeProvider(node="canary-0").provision(fake, cluster, run_id="run-a")
    upgrade.apply(fake, cluster, pool, CANARY_POLICY, driver_to="580.82.07", run_id="run-a")
    # The operator got as far as cordoning the pool node and marking the held-back one.
    fake.patch("v1", "Node", "canary-0", {"metadata": {"labels": {UPGRADE_STATE_LABEL: "cordon-required"}},
                                          "spec": {"unschedulable": True, "taints": [
                                              {"key": "dedicated", "value": "canary", "effect": "NoSchedule"},
                                              {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]}})
    fake.patch("v1", "Node", "gpu-1", {"metadata": {"labels": {UPGRADE_STATE_LABEL: "upgrade-required"}}})


def content(obj: dict) -> dict:
    """The object without the server's counters, which every write moves on."""
    return {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k not in ("resourceVersion", "generation")}}


NODE, NS = ("v1", "Node", None), ("v1", "Namespace", None)
RUN_A_RESTORED = [(*CLUSTER_POLICY, None, "cluster-policy"), (*NODE, "canary-0"), (*NODE, "gpu-1")]
RUN_A_DELETED = [(*NODE, "kwok-run-a-0"), (*NS, "gpucanary-run-a"), ("v1", "Pod", "gpucanary-run-a", "gpu-job-x"),
                 (*NVIDIADRIVER, None, "gpucanary-run-a")]
RUN_B_RESTORED = [(*NVIDIADRIVER, None, "pool-b"), (*NODE, "gpu-2")]
RUN_B_DELETED = [(*NODE, "kwok-run-b-0"), (*NS, "gpucanary-run-b"), ("v1", "Pod", "gpucanary-run-b", "gpu-job-x")]


def test_cleanup_by_run_id_restores_and_deletes_that_run_only() -> None:
    fake = cluster_as_found()
    found = fake.objects()
    leave_two_killed_runs(fake)
    left = fake.objects()
    lines: list[str] = []

    count = cleanup(fake, run_id="run-a", report=lines.append)

    after = fake.objects()
    assert {key: content(after[key]) for key in RUN_A_RESTORED} == {key: content(found[key]) for key in RUN_A_RESTORED}
    assert not set(RUN_A_DELETED) & set(after)
    untouched = set(after) - set(RUN_A_RESTORED)        # run-b's leftovers and what no run made
    assert {key: after[key] for key in untouched} == {key: left[key] for key in untouched}  # not even written
    assert set(left) - set(after) == set(RUN_A_DELETED)
    assert count == len(lines) == 6       # 3 restored, and the namespace, KWOK node and NVIDIADriver deleted


def test_cleanup_without_a_run_id_handles_every_run_and_only_canary_objects() -> None:
    fake = cluster_as_found()
    found = fake.objects()
    leave_two_killed_runs(fake)

    count = cleanup(fake, report=lambda line: None)

    after = fake.objects()
    assert set(after) == set(found)
    assert {key: content(obj) for key, obj in after.items()} == {key: content(obj) for key, obj in found.items()}
    untouched = set(found) - set(RUN_A_RESTORED) - set(RUN_B_RESTORED)
    assert {key: after[key] for key in untouched} == {key: found[key] for key in untouched}
    assert count == 10      # run-a's 6, and run-b's NVIDIADriver and gpu-2 restored, namespace and node deleted
    assert cleanup(fake, report=lambda line: None) == 0 and fake.objects() == after


def hold_lease(fake: FakeKube, run: str, *, renewed_s_ago: float) -> None:
    """What a run's RunLease leaves on the cluster, renewed `renewed_s_ago` seconds ago."""
    at = datetime.now(timezone.utc) - timedelta(seconds=renewed_s_ago)
    fake.create(namespace(lease.namespace_of(run), owned_labels(run)))
    fake.create({"apiVersion": lease.LEASE[0], "kind": lease.LEASE[1],
                 "metadata": {"name": lease.LEASE_NAME, "namespace": lease.namespace_of(run)},
                 "spec": {"holderIdentity": f"ci-runner/{run}", "leaseDurationSeconds": lease.DURATION_S,
                          "renewTime": at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}})


def test_cleanup_without_a_run_id_leaves_a_live_run_alone_and_says_so() -> None:
    fake = cluster_as_found()
    found = fake.objects()
    leave_two_killed_runs(fake)
    hold_lease(fake, "run-a", renewed_s_ago=5)                          # alive: its owner renews
    hold_lease(fake, "run-b", renewed_s_ago=lease.DURATION_S + 30)      # gone: it stopped renewing
    left = fake.objects()
    lines: list[str] = []

    cleanup(fake, report=lines.append)

    after = fake.objects()
    run_a = {key for key in left if key not in found and "run-b" not in str(key)} | set(RUN_A_RESTORED)
    assert {key: after.get(key) for key in run_a} == {key: left[key] for key in run_a}   # not even written
    assert {key: content(after[key]) for key in RUN_B_RESTORED} == {key: content(found[key]) for key in RUN_B_RESTORED}
    assert not (set(RUN_B_DELETED) | {(*NS, lease.namespace_of("run-b"))}) & set(after)
    assert lines[0].startswith("left live run run-a alone (held by ci-runner/run-a, renewed ")


def test_a_run_lease_is_created_first_renewed_and_released() -> None:
    fake = FakeKube()
    held = lease.RunLease(fake, "run-c").acquire()
    seen = lease.read(fake, "run-c")
    assert seen is not None and seen.live(datetime.now(timezone.utc)) and seen.holder == held.holder
    held.release()
    assert lease.read(fake, "run-c") is None
    assert (*NS, lease.namespace_of("run-c")) not in fake.objects()
