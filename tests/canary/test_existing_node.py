"""`ExistingNodeProvider`: refuses a node it must not take before changing anything, and gives a taken
node back exactly (labels, taints, schedulability) once it runs its original driver again.

Runs over the in-memory apiserver; the GPU Operator's part (cordon, driver pod swap, upgrade-done) is
written into the store by the test, as the operator would leave it.
"""

from __future__ import annotations

import json
import threading

import pytest
from kube_double import FakeKube

from pytest_gpucanary.canary import neighbours
from pytest_gpucanary.canary.neighbours import NVSENTINEL_LABEL, NVSENTINEL_NAMESPACE
from pytest_gpucanary.canary.pool import POOL_ELIGIBLE_LABEL
from pytest_gpucanary.canary.pool.existing_node import ExistingNodeProvider
from pytest_gpucanary.canary.pool.restore import SAVED_STATE_ANNOTATION, restore_node
from pytest_gpucanary.cluster import ClusterInfo
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.gpu_operator import GPU_PRESENT_LABEL, NVIDIADRIVER, UPGRADE_STATE_LABEL
from pytest_gpucanary.kube.errors import Forbidden, NotFound
from pytest_gpucanary.kube.ownership import RUN_ID_LABEL

DRIVER_FROM, DRIVER_TO = "570.172.08", "580.82.07"
POOL_LABEL = "gpucanary.io/driver-pool"
TAINTS = [{"key": "dedicated", "value": "canary", "effect": "NoSchedule"}]
CLUSTER = ClusterInfo("cluster-policy", nvidiadriver_mode=True, per_driver_policy=True,
                      operator_namespace="gpu-operator", gpu_nodes=("canary-0", "gpu-1"))


def node(name: str, *, gpu: bool = True, **labels: str) -> dict:
    present = {GPU_PRESENT_LABEL: "true"} if gpu else {}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {**present, UPGRADE_STATE_LABEL: "upgrade-done", **labels}},
            "spec": {"taints": TAINTS}}


def pod(name: str, node_name: str, *, namespace: str = "gpu-operator", labels: dict | None = None,
        daemonset: bool = True, version: str = DRIVER_FROM) -> dict:
    owners = [{"kind": "DaemonSet", "name": "owner"}] if daemonset else [{"kind": "ReplicaSet", "name": "owner"}]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {}, "ownerReferences": owners},
            "spec": {"nodeName": node_name,
                     "containers": [{"name": "c", "image": f"nvcr.io/nvidia/driver:{version}-ubuntu22.04"}]},
            "status": {"phase": "Running"}}


def driver_pod(node_name: str, version: str = DRIVER_FROM) -> dict:
    return pod(f"nvidia-driver-{node_name}", node_name, version=version,
               labels={"app.kubernetes.io/component": "nvidia-driver", "app": "nvidia-driver-daemonset"})


def nvidiadriver(name: str, pool: str, *, eligible: bool) -> dict:
    labels = {POOL_ELIGIBLE_LABEL: "true"} if eligible else {}
    return {"apiVersion": NVIDIADRIVER[0], "kind": NVIDIADRIVER[1], "metadata": {"name": name, "labels": labels},
            "spec": {"version": DRIVER_FROM, "nodeSelector": {POOL_LABEL: pool}}}


def good_cluster() -> FakeKube:
    fake = FakeKube()
    for obj in (node("canary-0", **{POOL_LABEL: "canary", "team": "ml", POOL_ELIGIBLE_LABEL: "true"}),
                node("gpu-1", **{POOL_LABEL: "fleet"}),
                driver_pod("canary-0"), driver_pod("gpu-1"),
                pod("device-plugin-canary-0", "canary-0"),                           # DaemonSet pods belong
                pod("probe-1", "canary-0", namespace="gpucanary-r0", labels={RUN_ID_LABEL: "r0"}, daemonset=False),
                nvidiadriver("canary", "canary", eligible=True), nvidiadriver("fleet", "fleet", eligible=False)):
        fake.create(obj)
    return fake


def foreign_pod(fake: FakeKube) -> None:
    fake.create(pod("trainer-7d9", "canary-0", namespace="team-a", daemonset=False))


def not_a_gpu_node(fake: FakeKube) -> None:
    fake.patch("v1", "Node", "canary-0", {"metadata": {"labels": {GPU_PRESENT_LABEL: None}}})


def no_driver_pod(fake: FakeKube) -> None:
    fake.delete("v1", "Pod", "nvidia-driver-canary-0", namespace="gpu-operator")


def driver_selects_more_than_the_pool(fake: FakeKube) -> None:
    fake.patch("v1", "Node", "gpu-1", {"metadata": {"labels": {POOL_LABEL: "canary"}}})


def not_marked_eligible(fake: FakeKube) -> None:
    fake.patch("v1", "Node", "canary-0", {"metadata": {"labels": {POOL_ELIGIBLE_LABEL: None}}})


def driver_not_marked_eligible(fake: FakeKube) -> None:
    fake.patch(*NVIDIADRIVER, "canary", {"metadata": {"labels": {POOL_ELIGIBLE_LABEL: None}}})


def already_in_a_run(fake: FakeKube) -> None:
    fake.patch("v1", "Node", "canary-0", {"metadata": {"labels": {RUN_ID_LABEL: "other-run"}}})


@pytest.mark.parametrize(("spoil", "node_name", "message"), [
    (not_a_gpu_node, "canary-0", "node canary-0 is not a GPU node"),
    (no_driver_pod, "canary-0", "node canary-0 has no GPU Operator driver pod"),
    (foreign_pod, "canary-0", "node canary-0 runs 1 pods the canary did not put there (team-a/trainer-7d9...)"),
    (driver_selects_more_than_the_pool, "canary-0", "NVIDIADriver canary drives 2 nodes, not only the pool"),
    (not_marked_eligible, "canary-0", f"node canary-0 is not marked eligible for canary pools (no "
                                      f"{POOL_ELIGIBLE_LABEL}=true)"),
    (driver_not_marked_eligible, "canary-0", f"NVIDIADriver canary of the pool is not marked eligible for canary "
                                             f"pools (no {POOL_ELIGIBLE_LABEL}=true)"),
    (lambda fake: None, "gpu-9", "node 'gpu-9' does not exist in the cluster"),
], ids=["not-gpu", "no-driver-pod", "foreign-pods", "shared-nvidiadriver", "not-eligible", "driver-not-eligible",
        "unknown-node"])
def test_a_node_the_canary_must_not_take_is_refused_in_one_line_and_left_alone(spoil, node_name: str,
                                                                              message: str) -> None:
    fake = good_cluster()
    spoil(fake)
    before = fake.objects()
    provider = ExistingNodeProvider(node=node_name)

    with pytest.raises(ConfigError) as refused:
        provider.provision(fake, CLUSTER, run_id="r1")

    assert str(refused.value).startswith(message)
    assert "\n" not in str(refused.value) and refused.value.hint
    assert fake.objects() == before and provider.carved == []


def test_a_node_in_another_run_is_refused_as_the_environment_naming_the_cleanup_of_that_run() -> None:
    fake = good_cluster()
    already_in_a_run(fake)
    before = fake.objects()

    with pytest.raises(EnvError) as refused:
        ExistingNodeProvider(node="canary-0").provision(fake, CLUSTER, run_id="r1")

    assert str(refused.value) == ("node canary-0 is already in canary run other-run; wait for it, or run "
                                  "`gpucanary cleanup --run-id other-run` if it was killed")
    assert fake.objects() == before


def test_foreign_pods_are_accepted_when_allowed() -> None:
    fake = good_cluster()
    foreign_pod(fake)

    pool = ExistingNodeProvider(node="canary-0", allow_foreign_pods=True).provision(fake, CLUSTER, run_id="r1")

    assert (pool.nodes, pool.driver, pool.driver_from) == (("canary-0",), "canary", DRIVER_FROM)


def test_a_good_node_is_marked_and_given_back_exactly_once_its_driver_is_back() -> None:
    fake = good_cluster()
    original = fake.get("v1", "Node", "canary-0")
    provider = ExistingNodeProvider(node="canary-0", restore_timeout_s=10)

    pool = provider.provision(fake, CLUSTER, run_id="r1")

    assert (pool.nodes, pool.driver, pool.driver_from) == (("canary-0",), "canary", DRIVER_FROM)
    marked = fake.get("v1", "Node", "canary-0")["metadata"]
    assert marked["labels"] == {**original["metadata"]["labels"], RUN_ID_LABEL: "r1"}
    assert json.loads(marked["annotations"][SAVED_STATE_ANNOTATION]) == {"run_id": "r1", "driver": DRIVER_FROM}
    # Mid-rollback, as the operator leaves it: cordoned, tainted, relabelled, the driver pod at the target.
    fake.patch("v1", "Node", "canary-0", {
        "metadata": {"labels": {UPGRADE_STATE_LABEL: "pod-restart-required"}},
        "spec": {"unschedulable": True, "taints": TAINTS + [{"key": "node.kubernetes.io/unschedulable",
                                                              "effect": "NoSchedule"}]}})
    fake.patch("v1", "Pod", "nvidia-driver-canary-0", {"spec": driver_pod("canary-0", DRIVER_TO)["spec"]},
               namespace="gpu-operator")
    seen_before_rollback: dict = {}
    health_taint = {"key": "gpu-health", "value": "xid-79", "effect": "NoSchedule"}

    def operator_finishes_the_rollback() -> None:
        seen_before_rollback.update(fake.get("v1", "Node", "canary-0")["metadata"]["labels"])
        fake.patch("v1", "Pod", "nvidia-driver-canary-0", {"spec": driver_pod("canary-0")["spec"]},
                   namespace="gpu-operator")
        # the operator uncordons; a GPU health checker found the node broken and tainted it meanwhile; someone
        # took a label off: none of it is the canary's to undo
        fake.patch("v1", "Node", "canary-0", {"metadata": {"labels": {UPGRADE_STATE_LABEL: "upgrade-done",
                                                                      "team": None}},
                                              "spec": {"unschedulable": None, "taints": TAINTS + [health_taint]}})

    timer = threading.Timer(0.3, operator_finishes_the_rollback)
    timer.start()
    provider.release(fake)
    timer.join()

    assert seen_before_rollback[RUN_ID_LABEL] == "r1"       # nothing was restored before the driver was back
    restored = fake.get("v1", "Node", "canary-0")
    assert restored["metadata"]["labels"] == {k: v for k, v in original["metadata"]["labels"].items() if k != "team"}
    assert restored["spec"] == {**original["spec"], "taints": TAINTS + [health_taint]}
    assert "annotations" not in restored["metadata"]
    assert provider.carved == []
    provider.release(fake)                                   # safe to call twice
    assert fake.get("v1", "Node", "canary-0") == restored


class ChangedBeforeTheMark(FakeKube):
    """The node changes between the carve-out's read and its write, once, as the kubelet or another run changes it."""

    def __init__(self, change: dict) -> None:
        super().__init__()
        self.change: dict | None = change

    def patch(self, api_version: str, kind: str, name: str, body: dict, **kwargs) -> dict:
        if kind == "Node" and kwargs.get("resource_version") and self.change:
            change, self.change = self.change, None
            super().patch("v1", "Node", name, change)
        return super().patch(api_version, kind, name, body, **kwargs)


def test_a_node_that_changes_under_the_carve_out_is_read_and_checked_again_not_given_up() -> None:
    """The kubelet writes its node often: a 409 on the mark reads the node again and marks what it reads, keeping
    the change (a taint the node got meanwhile stays, the fence goes on top of it)."""
    gpu_taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    fake = ChangedBeforeTheMark({"metadata": {"labels": {"heartbeat": "1"}}, "spec": {"taints": TAINTS + [gpu_taint]}})
    for obj in good_cluster().objects().values():
        fake.create(obj)
    fence = {"key": "gpucanary.io/run", "operator": "Exists", "effect": "NoSchedule"}
    for name in ("nvidia-driver-canary-0", "device-plugin-canary-0"):
        fake.patch("v1", "Pod", name, {"spec": {"tolerations": [fence]}}, namespace="gpu-operator")

    pool = ExistingNodeProvider(node="canary-0").provision(fake, CLUSTER, run_id="r1")

    marked = fake.get("v1", "Node", "canary-0")
    assert fake.change is None and pool.fence.startswith("fenced:")
    assert marked["metadata"]["labels"]["heartbeat"] == "1" and marked["metadata"]["labels"][RUN_ID_LABEL] == "r1"
    assert marked["spec"]["taints"] == TAINTS + [gpu_taint, {"key": "gpucanary.io/run", "value": "r1",
                                                             "effect": "NoSchedule"}]


def test_a_node_another_run_took_between_the_read_and_the_mark_is_refused_and_keeps_that_runs_mark() -> None:
    fake = ChangedBeforeTheMark({"metadata": {"labels": {RUN_ID_LABEL: "other-run"}}})
    for obj in good_cluster().objects().values():
        fake.create(obj)
    provider = ExistingNodeProvider(node="canary-0")

    with pytest.raises(EnvError, match="node canary-0 is already in canary run other-run"):
        provider.provision(fake, CLUSTER, run_id="r1")
    marked = fake.get("v1", "Node", "canary-0")["metadata"]
    assert marked["labels"][RUN_ID_LABEL] == "other-run" and "annotations" not in marked
    assert provider.carved == []


def test_a_tenant_pod_that_lands_on_the_pool_after_the_carve_out_stops_the_run_before_the_policy() -> None:
    fake = good_cluster()
    provider = ExistingNodeProvider(node="canary-0")
    provider.provision(fake, CLUSTER, run_id="r0")
    provider.recheck(fake)                                    # only DaemonSet pods and the run's own so far
    fake.create(pod("probe-2", "canary-0", namespace="gpucanary-other", labels={RUN_ID_LABEL: "other"},
                    daemonset=False))                         # another run's pod is not this run's

    with pytest.raises(EnvError, match="pod gpucanary-other/probe-2 landed on pool node canary-0 after it was carved"):
        provider.recheck(fake)


def test_the_pool_is_fenced_when_the_operators_pods_tolerate_it_and_the_fence_goes_with_the_restore() -> None:
    fake = good_cluster()
    fence = {"key": "gpucanary.io/run", "operator": "Exists", "effect": "NoSchedule"}
    for name in ("nvidia-driver-canary-0", "device-plugin-canary-0"):
        fake.patch("v1", "Pod", name, {"spec": {"tolerations": [fence]}}, namespace="gpu-operator")
    provider = ExistingNodeProvider(node="canary-0", restore_timeout_s=10)

    pool = provider.provision(fake, CLUSTER, run_id="r1")

    assert pool.fence == "fenced: gpucanary.io/run=r1:NoSchedule"
    taint = {"key": "gpucanary.io/run", "value": "r1", "effect": "NoSchedule"}
    assert fake.get("v1", "Node", "canary-0")["spec"]["taints"] == TAINTS + [taint]
    # a health checker taints the node meanwhile: only the fence goes with the restore
    health = {"key": "gpu-health", "value": "xid-79", "effect": "NoSchedule"}
    fake.patch("v1", "Node", "canary-0", {"spec": {"taints": TAINTS + [taint, health]}})
    provider.release(fake)
    assert fake.get("v1", "Node", "canary-0")["spec"]["taints"] == TAINTS + [health]


@pytest.mark.parametrize("before", [None, "true"])
def test_where_nvsentinel_runs_the_pool_leaves_its_care_for_the_run_and_gets_its_label_back(before: str | None) -> None:
    """NVSentinel's runbook for driver upgrades: label the node ManagedByNVSentinel=false, so the DCGM gap of the
    swap quarantines nothing; the label goes back as it was (absent, or its value), by the same restore as the
    run's own marks, so `gpucanary cleanup` puts it back after a crash too."""
    fake = good_cluster()
    fake.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NVSENTINEL_NAMESPACE}})
    if before is not None:
        fake.patch("v1", "Node", "canary-0", {"metadata": {"labels": {NVSENTINEL_LABEL: before}}})
    original = fake.get("v1", "Node", "canary-0")["metadata"]["labels"]
    provider = ExistingNodeProvider(node="canary-0", restore_timeout_s=10)

    pool = provider.provision(fake, CLUSTER, run_id="r1")

    assert pool.notes == (f"opted out of NVSentinel for the run: {NVSENTINEL_LABEL}=false, put back as it was after",)
    marked = fake.get("v1", "Node", "canary-0")["metadata"]
    assert marked["labels"][NVSENTINEL_LABEL] == "false"
    assert json.loads(marked["annotations"][SAVED_STATE_ANNOTATION])["nvsentinel"] == before
    provider.release(fake)
    assert fake.get("v1", "Node", "canary-0")["metadata"]["labels"] == original
    # someone else set the label since: it is theirs now, and the restore leaves it
    ExistingNodeProvider(node="canary-0").provision(fake, CLUSTER, run_id="r2")
    fake.patch("v1", "Node", "canary-0", {"metadata": {"labels": {NVSENTINEL_LABEL: "maintenance"}}})
    assert restore_node(fake, "canary-0", "r2")
    assert fake.get("v1", "Node", "canary-0")["metadata"]["labels"][NVSENTINEL_LABEL] == "maintenance"


def test_without_nvsentinel_the_pool_keeps_its_labels_and_neighbours_are_named_only_where_served() -> None:
    fake = good_cluster()
    pool = ExistingNodeProvider(node="canary-0").provision(fake, CLUSTER, run_id="r1")
    assert pool.notes == () and NVSENTINEL_LABEL not in fake.get("v1", "Node", "canary-0")["metadata"]["labels"]
    fake.fail("list", "Skyhook", NotFound("the cluster serves no Skyhook in skyhook.nvidia.com/v1alpha1"))
    fake.fail("list", "NodeMaintenance", Forbidden("nodemaintenances is forbidden"))     # served, not ours to read
    found = neighbours.detect(fake)
    assert found == neighbours.Neighbours(nvsentinel=False, skyhook=False, node_maintenance=True)
    assert [note.split(":")[0] for note in found.notes()] == ["the maintenance operator is installed"]


def test_an_operator_pod_that_would_not_tolerate_the_fence_leaves_the_pool_unfenced_and_says_how() -> None:
    fake = good_cluster()
    pool = ExistingNodeProvider(node="canary-0").provision(fake, CLUSTER, run_id="r1")

    assert pool.fence.startswith("not fenced: operator pod gpu-operator/"), pool.fence
    assert "-canary-0 does not tolerate gpucanary.io/run (add {key: gpucanary.io/run, operator: Exists, effect: " \
           "NoSchedule} to the ClusterPolicy's daemonsets.tolerations and the NVIDIADriver's tolerations)" in pool.fence
    assert fake.get("v1", "Node", "canary-0")["spec"]["taints"] == TAINTS


def test_every_canary_workload_tolerates_its_own_runs_fence_and_no_other() -> None:
    from pytest_gpucanary.canary import workloads
    from pytest_gpucanary.config import Settings

    placement = workloads.Placement("gpucanary-r1", "r1", "canary-0")
    mine = {"key": "gpucanary.io/run", "operator": "Equal", "value": "r1", "effect": "NoSchedule"}
    for obj in workloads.rendered(Settings(), placement):
        if obj["kind"] in ("Pod", "Job", "Deployment"):
            spec = obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]
            fences = [t for t in spec.get("tolerations") or [] if t.get("key") == "gpucanary.io/run"]
            assert fences == [mine], (obj["kind"], spec.get("tolerations"))


OWNER = "nvidia.com/gpu-operator.driver.owner"


def with_default_driver(fake: FakeKube) -> FakeKube:
    """v26.7 with a default NVIDIADriver "all" that drives every GPU node no other one picks: the operator
    names each node's driver in its owner label; "fleet" is gone, so gpu-1 falls back to the default."""
    fake.delete(*NVIDIADRIVER, "fleet")
    fake.create({"apiVersion": NVIDIADRIVER[0], "kind": NVIDIADRIVER[1], "metadata": {"name": "all", "labels": {}},
                 "spec": {"version": DRIVER_FROM, "default": True}})
    fake.patch("v1", "Node", "canary-0", {"metadata": {"labels": {OWNER: "canary"}}})
    fake.patch("v1", "Node", "gpu-1", {"metadata": {"labels": {OWNER: "all"}}})
    return fake


def test_the_pool_driver_is_the_owner_the_operator_names_beside_a_default_nvidiadriver() -> None:
    """The default NVIDIADriver names no nodeSelector, so it seems to select every GPU node, the pool's too: the
    owner label says which NVIDIADriver drives the node."""
    fake = with_default_driver(good_cluster())
    pool = ExistingNodeProvider(node="canary-0").provision(fake, CLUSTER, run_id="r1")
    assert pool.driver == "canary"


def test_a_node_of_a_default_nvidiadriver_not_marked_for_handover_is_refused_in_one_line_and_left_alone() -> None:
    fake = with_default_driver(good_cluster())
    fake.patch("v1", "Node", "gpu-1", {"metadata": {"labels": {POOL_ELIGIBLE_LABEL: "true"}}})
    fake.create(node("gpu-2", **{OWNER: "all"}))
    before = fake.objects()
    with pytest.raises(ConfigError) as refused:
        ExistingNodeProvider(node="gpu-1").provision(fake, CLUSTER, run_id="r1")
    assert str(refused.value).startswith("the pool ['gpu-1'] is driven by the default NVIDIADriver all, which is not "
                                         "marked for handing nodes to a canary run (no gpucanary.io/handover-eligible"
                                         "=true)")
    assert "kubectl label nvidiadriver all gpucanary.io/handover-eligible=true" in refused.value.hint
    assert fake.objects() == before


def owner_swap(fake: FakeKube, node_name: str, owner: str, version: str = DRIVER_FROM) -> None:
    """What GPU Operator v26.7 does when a node changes owner: the owner label, then a driver pod of the new
    owner's DaemonSet (its pods select the owner label) in place of the old one."""
    fake.patch("v1", "Node", node_name, {"metadata": {"labels": {OWNER: owner}}})
    fake.delete("v1", "Pod", f"nvidia-driver-{node_name}", namespace="gpu-operator")
    new = driver_pod(node_name, version)
    new["spec"]["nodeSelector"] = {OWNER: owner}
    fake.create(new)


def test_a_node_of_the_default_nvidiadriver_is_handed_to_the_runs_own_and_back() -> None:
    """The run's own NVIDIADriver is the default one's spec at the node's driver, picking the node by the run's
    label; the pool is ready once the node's driver pod is that NVIDIADriver's. Giving it back deletes it and
    waits for the default one's driver pod, then takes the run's marks off: the node is as it was."""
    fake = with_default_driver(good_cluster())
    fake.patch(*NVIDIADRIVER, "all", {"metadata": {"labels": {"gpucanary.io/handover-eligible": "true"}},
                                      "spec": {"image": "driver", "repository": "nvcr.io/nvidia"}})
    fake.patch("v1", "Node", "gpu-1", {"metadata": {"labels": {POOL_ELIGIBLE_LABEL: "true"}}})
    before = fake.get("v1", "Node", "gpu-1")

    def operator() -> None:
        fake.wait_for(*NVIDIADRIVER, "gpucanary-r1", lambda d: True, timeout_s=60)
        owner_swap(fake, "gpu-1", "gpucanary-r1")
        fake.wait_gone(*NVIDIADRIVER, "gpucanary-r1", timeout_s=60)
        owner_swap(fake, "gpu-1", "all")

    thread = threading.Thread(target=operator)
    thread.start()
    provider = ExistingNodeProvider(node="gpu-1", restore_timeout_s=60)
    pool = provider.provision(fake, CLUSTER, run_id="r1")
    own = fake.get(*NVIDIADRIVER, "gpucanary-r1")
    assert pool.driver == "gpucanary-r1" and pool.driver_from == DRIVER_FROM
    assert own["spec"] == {"version": DRIVER_FROM, "image": "driver", "repository": "nvcr.io/nvidia",
                           "nodeSelector": {RUN_ID_LABEL: "r1"}}
    assert own["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "gpucanary", RUN_ID_LABEL: "r1"}
    assert pool.notes[0].startswith("handed over from the default NVIDIADriver all to the run's own gpucanary-r1 "
                                    f"at driver {DRIVER_FROM} in ")
    said: list[str] = []
    provider.release(fake, report=said.append)
    thread.join(timeout=60)
    assert said == ["deleted NVIDIADriver gpucanary-r1: the default NVIDIADriver all takes the pool back"]
    after = fake.get("v1", "Node", "gpu-1")
    assert after["metadata"]["labels"] == before["metadata"]["labels"]
    assert after["metadata"].get("annotations", {}) == before["metadata"].get("annotations", {})
    assert after["spec"] == before["spec"]


def test_a_pool_driven_by_two_nvidiadrivers_is_refused() -> None:
    fake = with_default_driver(good_cluster())
    fake.patch("v1", "Node", "gpu-1", {"metadata": {"labels": {POOL_ELIGIBLE_LABEL: "true"}}})
    with pytest.raises(ConfigError, match=r"the pool \['canary-0', 'gpu-1'\] is driven by different NVIDIADrivers "
                                          r"\(\['all', 'canary'\]\)"):
        ExistingNodeProvider(selector=GPU_PRESENT_LABEL, size=2).provision(fake, CLUSTER, run_id="r1")


@pytest.mark.parametrize("state", ["validation-required", "upgrade-failed"])
def test_a_node_stranded_on_the_target_is_put_back_into_upgrade_required_to_roll_back(state: str) -> None:
    """GPU Operator leaves an out-of-date driver pod alone in validation-required and upgrade-failed: the give-back
    puts the node into upgrade-required (what the operator does for an out-of-date pod), once; the operator then
    restarts the pod at the restored version."""
    from pytest_gpucanary.canary.pool.driver import wait_for_driver

    fake = FakeKube()
    fake.create(node("canary-0", **{UPGRADE_STATE_LABEL: state}))
    fake.create(driver_pod("canary-0", version=DRIVER_TO))
    states: list[str] = []

    def operator() -> None:         # the upgrade cycle, from upgrade-required to the restored driver
        fake.wait_for("v1", "Node", "canary-0",
                      lambda n: n["metadata"]["labels"][UPGRADE_STATE_LABEL] == "upgrade-required", timeout_s=10)
        states.append("upgrade-required")
        fake.delete("v1", "Pod", "nvidia-driver-canary-0", namespace="gpu-operator")
        fake.create(driver_pod("canary-0"))
        fake.patch("v1", "Node", "canary-0", {"metadata": {"labels": {UPGRADE_STATE_LABEL: "upgrade-done"}}})

    thread = threading.Thread(target=operator)
    thread.start()
    said: list[str] = []
    wait_for_driver(fake, "canary-0", DRIVER_FROM, timeout_s=10, report=said.append)
    thread.join()
    assert states == ["upgrade-required"]
    assert said == [f"node canary-0 stayed in {state} on driver {DRIVER_TO}, which GPU Operator does not restart "
                    f"there: put it back into upgrade-required to roll it back to {DRIVER_FROM}"]


def test_a_node_in_validation_on_its_own_driver_is_left_to_the_operator() -> None:
    from pytest_gpucanary.canary.pool.driver import wait_for_driver

    fake = FakeKube()
    fake.create(node("canary-0", **{UPGRADE_STATE_LABEL: "validation-required"}))
    fake.create(driver_pod("canary-0"))
    writes = len(fake.writes)
    with pytest.raises(EnvError, match="did not return to driver"):
        wait_for_driver(fake, "canary-0", DRIVER_FROM, timeout_s=0.5, report=print)
    assert len(fake.writes) == writes


def test_a_driver_pod_no_node_took_is_deleted_so_its_daemonset_makes_one_of_the_restored_driver() -> None:
    """GPU Operator passes over a node whose driver pod is unbound: the give-back deletes a pool node's driver pod
    of the target that the scheduler could not place (and only that one), so the DaemonSet makes a new one."""
    from pytest_gpucanary.canary.pool.driver import wait_for_driver

    def unplaced(name: str, node_name: str, version: str) -> dict:
        obj = driver_pod(node_name, version=version)
        obj["metadata"]["name"] = name
        obj["spec"] = {"containers": obj["spec"]["containers"], "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node_name]}]}]}}}}
        obj["status"] = {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/4 nodes are available: 1 Insufficient cpu."}]}
        return obj

    fake = FakeKube()
    fake.create(node("canary-0", **{UPGRADE_STATE_LABEL: "pod-restart-required"}))
    fake.create(node("gpu-1", **{UPGRADE_STATE_LABEL: "pod-restart-required"}))
    fake.create(unplaced("nvidia-driver-new", "canary-0", DRIVER_TO))
    fake.create(unplaced("nvidia-driver-elsewhere", "gpu-1", DRIVER_TO))     # another node's: not the pool's

    def daemonset() -> None:        # makes a pod of the restored template once the unplaced one is gone
        fake.wait_gone("v1", "Pod", "nvidia-driver-new", namespace="gpu-operator", timeout_s=10)
        fake.create(driver_pod("canary-0"))
        fake.patch("v1", "Node", "canary-0", {"metadata": {"labels": {UPGRADE_STATE_LABEL: "upgrade-done"}}})

    thread = threading.Thread(target=daemonset)
    thread.start()
    said: list[str] = []
    wait_for_driver(fake, "canary-0", DRIVER_FROM, timeout_s=10, report=said.append)
    thread.join()
    assert said == [f"driver pod gpu-operator/nvidia-driver-new of {DRIVER_TO} could not be placed on node canary-0 "
                    "(0/4 nodes are available: 1 Insufficient cpu.), and GPU Operator passes over a node whose driver "
                    f"pod has no node: deleted it, so that its DaemonSet makes one of {DRIVER_FROM}"]
    assert fake.get("v1", "Pod", "nvidia-driver-elsewhere", namespace="gpu-operator")


def test_cleanup_of_a_killed_run_hands_its_pool_back_to_the_default_nvidiadriver() -> None:
    """A run killed after the handover left its NVIDIADriver and its marks: cleanup deletes that NVIDIADriver and
    waits for the default one's driver pod before it takes the marks off, as the run's own restore does."""
    from pytest_gpucanary.canary.cleanup import cleanup

    fake = with_default_driver(good_cluster())
    fake.patch(*NVIDIADRIVER, "all", {"metadata": {"labels": {"gpucanary.io/handover-eligible": "true"}}})
    fake.patch("v1", "Node", "gpu-1", {"metadata": {"labels": {POOL_ELIGIBLE_LABEL: "true"}}})
    before = fake.get("v1", "Node", "gpu-1")
    handed = threading.Thread(target=lambda: (fake.wait_for(*NVIDIADRIVER, "gpucanary-r1", lambda d: True, timeout_s=60),
                                              owner_swap(fake, "gpu-1", "gpucanary-r1")))
    handed.start()
    ExistingNodeProvider(node="gpu-1", restore_timeout_s=60).provision(fake, CLUSTER, run_id="r1")   # then killed
    handed.join(timeout=60)
    back = threading.Thread(target=lambda: (fake.wait_gone(*NVIDIADRIVER, "gpucanary-r1", timeout_s=60),
                                            owner_swap(fake, "gpu-1", "all")))
    back.start()
    said: list[str] = []
    result = cleanup(fake, run_id="r1", force=True, wait_s=30, report=said.append)
    back.join(timeout=60)
    assert result.problems == [] and "gave node gpu-1 back" in said, said
    after = fake.get("v1", "Node", "gpu-1")
    assert after["metadata"]["labels"] == before["metadata"]["labels"]
    assert after["spec"] == before["spec"] and SAVED_STATE_ANNOTATION not in after["metadata"].get("annotations", {})
    assert [d["metadata"]["name"] for d in fake.list(*NVIDIADRIVER)] == ["all", "canary"]
