"""`policy.apply`: the policy and target version reach only the pool, and `restore` puts every object back.

Runs over the in-memory apiserver (`kube_double.FakeKube`); each test compares the stored objects
before apply and after restore.
"""

from __future__ import annotations

import json
import threading

import pytest
from kube_double import FakeKube

from pytest_gpucanary.config import Settings
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.gpu_operator import (
    CLUSTER_POLICY, DRIVER_COMPONENT_SELECTOR, GPU_PRESENT_LABEL, NVIDIADRIVER, SKIP_LABEL, UPGRADE_STATE_LABEL,
)
from pytest_gpucanary.canary import apply as upgrade
from pytest_gpucanary.canary.run import CanaryRun
from pytest_gpucanary.canary.workloads import Placement
from pytest_gpucanary.kube.errors import Conflict, Unavailable
from pytest_gpucanary.progress import ProgressLine

from cluster_shapes import (  # tests/cluster_shapes.py
    node, driver_daemonset, content, nvidiadriver_cluster, clusterpolicy_cluster, DRIVER_FROM, DRIVER_TO, OPERATOR_NS, ORIGINAL_POLICY, CANARY_POLICY,
)


def test_per_driver_policy_goes_on_the_pools_nvidiadriver_only_and_comes_off_again() -> None:
    fake = FakeKube()
    cluster, pool = nvidiadriver_cluster(fake, per_driver_policy=True)
    before = {key: content(obj) for key, obj in fake.objects().items()}

    applied = upgrade.apply(fake, cluster, pool, CANARY_POLICY, driver_to=DRIVER_TO, run_id="run-1")

    canary = fake.get(*NVIDIADRIVER, "canary-pool")
    assert canary["spec"]["version"] == DRIVER_TO and canary["spec"]["upgradePolicy"] == CANARY_POLICY
    assert applied.describe() == "NVIDIADriver canary-pool: upgradePolicy and version"   # what the receipt says
    saved = json.loads(canary["metadata"]["annotations"][upgrade.SAVED_SPEC_ANNOTATION])
    assert saved == {"run_id": "run-1", "spec": {"version": DRIVER_FROM, "upgradePolicy": None},
                     "wrote": {"version": DRIVER_TO, "upgradePolicy": CANARY_POLICY}}
    untouched = {key: obj for key, obj in fake.objects().items() if key[3] != "canary-pool"}
    assert {key: content(obj) for key, obj in untouched.items()} == {k: before[k] for k in untouched}

    upgrade.restore(fake, applied)

    assert {key: content(obj) for key, obj in fake.objects().items()} == before
    assert applied.saved == [] and applied.skipped_nodes == []


def test_a_same_version_run_relabels_the_pools_driver_pods_and_puts_the_labels_back() -> None:
    fake = FakeKube()
    cluster, pool = nvidiadriver_cluster(fake, per_driver_policy=True)
    before = {key: content(obj) for key, obj in fake.objects().items()}

    applied = upgrade.apply(fake, cluster, pool, CANARY_POLICY, driver_to=DRIVER_FROM, run_id="run-1")

    canary = fake.get(*NVIDIADRIVER, "canary-pool")
    assert canary["spec"]["version"] == DRIVER_FROM and canary["spec"]["labels"] == {upgrade.RESTART_LABEL: "run-1"}
    assert applied.describe() == "NVIDIADriver canary-pool: labels and upgradePolicy"
    upgrade.restore(fake, applied)
    assert {key: content(obj) for key, obj in fake.objects().items()} == before


def test_older_operator_takes_the_policy_from_the_cluster_policy_and_the_version_from_the_pools_driver() -> None:
    fake = FakeKube()
    cluster, pool = nvidiadriver_cluster(fake, per_driver_policy=False)
    before = {key: content(obj) for key, obj in fake.objects().items()}

    applied = upgrade.apply(fake, cluster, pool, CANARY_POLICY, driver_to=DRIVER_TO, run_id="run-1")

    policy = fake.get(*CLUSTER_POLICY, "cluster-policy")
    assert policy["spec"]["driver"]["upgradePolicy"] == CANARY_POLICY
    assert policy["spec"]["driver"]["version"] == DRIVER_FROM           # the version moves on the pool only
    canary = fake.get(*NVIDIADRIVER, "canary-pool")
    assert canary["spec"]["version"] == DRIVER_TO and "upgradePolicy" not in canary["spec"]
    assert applied.describe() == "ClusterPolicy cluster-policy: upgradePolicy; NVIDIADriver canary-pool: version"
    assert content(fake.get(*NVIDIADRIVER, "fleet")) == before[(*NVIDIADRIVER, None, "fleet")]

    upgrade.restore(fake, applied)

    assert {key: content(obj) for key, obj in fake.objects().items()} == before


def test_clusterpolicy_mode_holds_other_gpu_nodes_back_and_gives_them_their_state_back() -> None:
    fake = FakeKube()
    cluster, pool = clusterpolicy_cluster(fake)
    before = {key: content(obj) for key, obj in fake.objects().items()}

    applied = upgrade.apply(fake, cluster, pool, CANARY_POLICY, driver_to=DRIVER_TO, run_id="run-1")

    driver = fake.get(*CLUSTER_POLICY, "cluster-policy")["spec"]["driver"]
    assert driver["version"] == DRIVER_TO and driver["upgradePolicy"] == CANARY_POLICY
    labels = {name: fake.get("v1", "Node", name)["metadata"]["labels"] for name in cluster.gpu_nodes}
    assert SKIP_LABEL not in labels["canary-0"]
    assert labels["gpu-1"][SKIP_LABEL] == labels["gpu-2"][SKIP_LABEL] == "true"
    assert content(fake.get("v1", "Node", "gpu-3")) == before[("v1", "Node", None, "gpu-3")]  # not ours to touch
    # The operator marks every out-of-date node; the skip label keeps the held-back ones there.
    fake.patch("v1", "Node", "gpu-1", {"metadata": {"labels": {UPGRADE_STATE_LABEL: "upgrade-required"}}})
    fake.patch("v1", "Node", "gpu-2", {"metadata": {"labels": {UPGRADE_STATE_LABEL: "upgrade-required"}}})

    upgrade.restore(fake, applied)

    after = {key: content(obj) for key, obj in fake.objects().items()}
    assert after[("v1", "Node", None, "gpu-1")] == before[("v1", "Node", None, "gpu-1")]
    assert after[(*CLUSTER_POLICY, None, "cluster-policy")] == before[(*CLUSTER_POLICY, None, "cluster-policy")]
    # gpu-2 had no state to give back: only the skip label and the saved copy go
    gpu_2 = after[("v1", "Node", None, "gpu-2")]["metadata"]
    assert gpu_2["labels"] == {GPU_PRESENT_LABEL: "true", UPGRADE_STATE_LABEL: "upgrade-required"}
    assert "annotations" not in gpu_2


def test_held_back_nodes_are_released_only_once_the_driver_daemonset_is_back_at_their_version() -> None:
    fake = FakeKube()
    cluster, pool = clusterpolicy_cluster(fake)
    applied = upgrade.apply(fake, cluster, pool, CANARY_POLICY, driver_to=DRIVER_TO, run_id="run-1")
    ds = driver_daemonset(DRIVER_TO)
    fake.patch("apps/v1", "DaemonSet", ds["metadata"]["name"], {"spec": ds["spec"]}, namespace=OPERATOR_NS)
    fake.patch("apps/v1", "DaemonSet", ds["metadata"]["name"], {"status": {"observedGeneration": 2}},
               namespace=OPERATOR_NS)
    seen_at_rollback: dict[str, str] = {}

    def operator_rolls_the_daemonset_back() -> None:
        seen_at_rollback.update(fake.get("v1", "Node", "gpu-1")["metadata"]["labels"])
        back = driver_daemonset(DRIVER_FROM)
        fake.patch("apps/v1", "DaemonSet", back["metadata"]["name"], {"spec": back["spec"]}, namespace=OPERATOR_NS)
        fake.patch("apps/v1", "DaemonSet", back["metadata"]["name"], {"status": {"observedGeneration": 3}},
                   namespace=OPERATOR_NS)

    timer = threading.Timer(0.3, operator_rolls_the_daemonset_back)
    timer.start()
    upgrade.restore(fake, applied)
    timer.join()

    assert seen_at_rollback[SKIP_LABEL] == "true"
    assert SKIP_LABEL not in fake.get("v1", "Node", "gpu-1")["metadata"]["labels"]


def test_the_daemonset_wait_is_bounded_and_says_what_to_do() -> None:
    fake = FakeKube()
    fake.create(driver_daemonset(DRIVER_TO))

    with pytest.raises(EnvError) as stuck:
        upgrade.wait_driver_daemonsets(fake, OPERATOR_NS, DRIVER_FROM, timeout_s=0.2)

    assert str(stuck.value).startswith(f"the driver DaemonSet did not return to {DRIVER_FROM} within 0 s")
    assert "gpucanary cleanup" in str(stuck.value)


def test_a_second_run_never_adopts_the_first_ones_saved_state_and_writes_nothing() -> None:
    """A run killed after its apply leaves its saved spec; a second run refuses that object (exit 6, naming the
    first run and the cleanup that finishes it) instead of writing under the first run's annotation."""
    fake = FakeKube()
    cluster, pool = nvidiadriver_cluster(fake, per_driver_policy=True)
    upgrade.apply(fake, cluster, pool, CANARY_POLICY, driver_to=DRIVER_TO, run_id="run-1")   # then killed
    left = fake.objects()

    with pytest.raises(EnvError) as refused:
        upgrade.apply(fake, cluster, pool, {**CANARY_POLICY, "maxParallelUpgrades": 5}, driver_to="590.1",
                      run_id="run-2")

    assert "carries gpucanary.io/saved-spec of run run-1" in str(refused.value)
    assert "gpucanary cleanup --run-id run-1" in str(refused.value)
    assert fake.objects() == left


def test_clusterpolicy_mode_refuses_before_any_write_while_another_runs_state_is_on_the_cluster() -> None:
    from pytest_gpucanary.canary.run import refuse_other_runs

    fake = FakeKube()
    cluster, pool = clusterpolicy_cluster(fake)
    upgrade.apply(fake, cluster, pool, CANARY_POLICY, driver_to=DRIVER_TO, run_id="run-1")   # then killed
    fake.writes.clear()

    with pytest.raises(EnvError, match="run run-1"):
        refuse_other_runs(fake, cluster)
    assert fake.writes == []


def test_a_gpu_node_that_joined_after_preflight_is_held_back_too() -> None:
    """The hold-back list is read at apply: a node an autoscaler added, or one whose NFD label is not there yet but
    whose driver pod runs, is held like the rest."""
    fake = FakeKube()
    cluster, pool = clusterpolicy_cluster(fake)               # preflight saw canary-0 and gpu-1..3
    fake.create(node("gpu-joined", **{UPGRADE_STATE_LABEL: "upgrade-done"}))
    fake.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-unlabelled"}, "spec": {}})
    fake.create({"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": "nvidia-driver-daemonset-x", "namespace": OPERATOR_NS,
                              "labels": {DRIVER_COMPONENT_SELECTOR.split("=")[0]: DRIVER_COMPONENT_SELECTOR.split("=")[1]}},
                 "spec": {"nodeName": "gpu-unlabelled"}})

    applied = upgrade.apply(fake, cluster, pool, CANARY_POLICY, driver_to=DRIVER_TO, run_id="run-1")

    assert {"gpu-joined", "gpu-unlabelled"} <= set(applied.skipped_nodes)
    for name in ("gpu-joined", "gpu-unlabelled"):
        assert fake.get("v1", "Node", name)["metadata"]["labels"][SKIP_LABEL] == "true"


def test_a_field_changed_since_the_canary_wrote_it_is_left_alone_and_the_holds_stay() -> None:
    """An emergency fleet-wide driver change made mid-run is not reverted by the restore; the policy the canary
    wrote (and nobody changed) is put back; the held nodes stay held, as releasing them now would hand them
    a version the canary did not prove."""
    fake = FakeKube()
    cluster, pool = clusterpolicy_cluster(fake)
    applied = upgrade.apply(fake, cluster, pool, CANARY_POLICY, driver_to=DRIVER_TO, run_id="run-1")
    fake.patch(*CLUSTER_POLICY, "cluster-policy", {"spec": {"driver": {"version": "590.48.01"}}})
    lines: list[str] = []

    with pytest.raises(EnvError, match="is at driver 590.48.01, not 570.172.08 that 2 held nodes run"):
        upgrade.restore(fake, applied, report=lines.append)

    driver = fake.get(*CLUSTER_POLICY, "cluster-policy")["spec"]["driver"]
    assert driver["version"] == "590.48.01" and driver["upgradePolicy"] == ORIGINAL_POLICY
    assert lines == ["restored ClusterPolicy cluster-policy; left spec.driver.version as it is: changed since the "
                     "canary wrote it"]
    assert all(fake.get("v1", "Node", n)["metadata"]["labels"][SKIP_LABEL] == "true" for n in ("gpu-1", "gpu-2"))


def test_a_restore_acts_only_on_its_own_runs_annotation() -> None:
    """A restore for a dead run A finds run B's saved spec on the object (B started after A's cleanup read it):
    it writes nothing."""
    fake = FakeKube()
    cluster, pool = nvidiadriver_cluster(fake, per_driver_policy=True)
    upgrade.apply(fake, cluster, pool, CANARY_POLICY, driver_to=DRIVER_TO, run_id="live-run-b")
    left = fake.objects()

    assert upgrade.restore_saved_spec(fake, NVIDIADRIVER, "canary-pool", "dead-run-a") is None
    assert upgrade.release_hold(fake, "gpu-1", "dead-run-a") is False
    assert fake.objects() == left


def test_a_write_against_a_changed_object_is_refused_by_its_resource_version() -> None:
    fake = FakeKube()
    cluster, pool = nvidiadriver_cluster(fake, per_driver_policy=True)
    seen = fake.get(*NVIDIADRIVER, "canary-pool")
    fake.patch(*NVIDIADRIVER, "canary-pool", {"metadata": {"labels": {"changed": "by-someone"}}})

    with pytest.raises(Conflict):
        fake.patch(*NVIDIADRIVER, "canary-pool", {"spec": {"version": DRIVER_TO}},
                   resource_version=seen["metadata"]["resourceVersion"])
    assert fake.get(*NVIDIADRIVER, "canary-pool")["spec"]["version"] == DRIVER_FROM


def test_restore_puts_back_a_policy_that_left_fields_unset() -> None:
    """A stored policy may name no waitForCompletion or drain.podSelector (the CRD defaults neither). The
    policy under test sets both; restore must take them off again, or the production policy keeps
    waiting for the canary's app=trainer pods."""
    partial = {key: value for key, value in ORIGINAL_POLICY.items() if key != "waitForCompletion"}
    partial["drain"] = {k: v for k, v in ORIGINAL_POLICY["drain"].items() if k != "podSelector"}
    fake = FakeKube()
    cluster, pool = clusterpolicy_cluster(fake, policy=partial)
    before = content(fake.get(*CLUSTER_POLICY, "cluster-policy"))

    upgrade.restore(fake, upgrade.apply(fake, cluster, pool, CANARY_POLICY, driver_to=DRIVER_TO, run_id="run-1"))

    after = content(fake.get(*CLUSTER_POLICY, "cluster-policy"))
    assert after["spec"]["driver"]["upgradePolicy"] == partial
    assert after == before


@pytest.mark.parametrize("fault", ["delete", "watch"])
def test_an_apiserver_outage_while_the_namespace_goes_still_restores_the_policy(fault: str) -> None:
    fake = FakeKube()
    cluster, pool = nvidiadriver_cluster(fake, per_driver_policy=True)
    fake.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "gpucanary-run-1"}})
    before = content(fake.get(*NVIDIADRIVER, "canary-pool"))
    applied = upgrade.apply(fake, cluster, pool, CANARY_POLICY, driver_to=DRIVER_TO, run_id="run-1")
    outage = Unavailable("watch Namespace: cannot reach the apiserver (ProtocolError)")
    if fault == "delete":
        fake.fail("delete", "Namespace", outage)
    else:
        fake.fail_watch("Namespace", outage, before_relist=True)
    lines: list[str] = []
    run = CanaryRun(Settings(), fake, object(), progress=ProgressLine(write=lines.append))

    run._restore(applied, Placement("gpucanary-run-1", "run-1", "canary-0"))

    assert content(fake.get(*NVIDIADRIVER, "canary-pool")) == before
    assert any("restoring the policy anyway" in line and "cannot reach the apiserver" in line for line in lines)


def test_the_operator_release_comes_from_the_cluster_policy_labels_and_an_old_one_is_refused() -> None:
    from pytest_gpucanary.cluster import _drivable
    from pytest_gpucanary.errors import EnvError
    from pytest_gpucanary.gpu_operator import RELEASE_LABEL, release_of, release_series

    assert release_of({RELEASE_LABEL: "v26.7.0", "helm.sh/chart": "gpu-operator-v26.7.0"}) == "v26.7.0"
    assert release_of({}) is None
    assert release_series("v25.10.1") == (25, 10) and release_series("main-latest") is None
    assert _drivable("v26.7.0") == "v26.7.0" and _drivable(None) is None and _drivable("v1.0.0-devel") == "v1.0.0-devel"
    with pytest.raises(EnvError, match="GPU Operator v24.9.2 is older than the releases the canary knows how to drive"):
        _drivable("v24.9.2")


def test_before_v26_7_a_run_refuses_while_another_nvidiadrivers_nodes_are_mid_upgrade() -> None:
    from pytest_gpucanary.canary.run import refuse_other_runs

    fake = FakeKube()
    cluster, _ = nvidiadriver_cluster(fake, per_driver_policy=False)
    fake.patch("v1", "Node", "gpu-1", {"metadata": {"labels": {UPGRADE_STATE_LABEL: "drain-required"}}})

    with pytest.raises(EnvError, match="NVIDIADriver fleet's node gpu-1 is in drain-required"):
        refuse_other_runs(fake, cluster)
    refuse_other_runs(fake, cluster, allow_shared_policy=True)            # the user's explicit opt-in
    refuse_other_runs(fake, nvidiadriver_cluster(FakeKube(), per_driver_policy=True)[0])   # v26.7+: its own policy
