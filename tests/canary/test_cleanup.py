"""`gpucanary cleanup`: what a killed run left is restored or deleted by its run id; nothing else moves.

The leftovers are made by the product itself (`ExistingNodeProvider.provision`, `policy.apply`) on the
in-memory apiserver, then the run "dies" (nothing restores them) and `cleanup` runs on the store.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone

import pytest

from kube_double import FakeKube
from manual_clock import ManualClock

from pytest_gpucanary.canary import lease
from pytest_gpucanary.canary.cleanup import cleanup
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.gpu_operator import (
    CLUSTER_POLICY, GPU_PRESENT_LABEL, NVIDIADRIVER, SKIP_LABEL, UPGRADE_STATE_LABEL,
)
from pytest_gpucanary.canary import apply as upgrade
from pytest_gpucanary.canary.pool import POOL_ELIGIBLE_LABEL, Pool
from pytest_gpucanary.canary.pool.existing_node import ExistingNodeProvider
from pytest_gpucanary.canary.pool.restore import SAVED_STATE_ANNOTATION
from pytest_gpucanary.cluster import ClusterInfo
from pytest_gpucanary.kube.ownership import owned_labels

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


def driver_daemonset(version: str) -> dict:
    return {"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "nvidia-driver-daemonset", "namespace": OPERATOR_NS,
                         "labels": {"app.kubernetes.io/component": "nvidia-driver"}},
            "spec": {"template": {"spec": {"containers": [
                {"name": "nvidia-driver-ctr", "image": f"nvcr.io/nvidia/driver:{version}-ubuntu22.04"}]}}},
            "status": {"observedGeneration": 1}}


POOL_TAINTS = [{"key": "dedicated", "value": "canary", "effect": "NoSchedule"}]
UNSCHEDULABLE_TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}


def cluster_as_found() -> FakeKube:
    fake = FakeKube()
    for obj in (
        {"apiVersion": CLUSTER_POLICY[0], "kind": CLUSTER_POLICY[1], "metadata": {"name": "cluster-policy"},
         "spec": {"driver": {"version": "570.172.08", "upgradePolicy": POLICY}}},
        nvidiadriver("fleet"), nvidiadriver("pool-b"),
        namespace(OPERATOR_NS), namespace("team-a"),
        node("canary-0", taints=POOL_TAINTS, **{UPGRADE_STATE_LABEL: "upgrade-done", "team": "ml",
                                                 POOL_ELIGIBLE_LABEL: "true"}),
        node("gpu-1", **{UPGRADE_STATE_LABEL: "upgrade-done"}),
        node("gpu-2", **{UPGRADE_STATE_LABEL: "upgrade-done"}),
        node("gpu-3", **{SKIP_LABEL: "true"}),                 # held back by its owner, not by a canary
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-4", "labels": {"team": "web"}}, "spec": {}},
        driver_pod("canary-0"), driver_daemonset("570.172.08"),
    ):
        fake.create(obj)
    return fake


def leave_two_killed_runs(fake: FakeKube) -> None:
    """run-a (ClusterPolicy mode) carved out canary-0, held the other driver nodes back and was killed
    mid-upgrade; run-b (NVIDIADriver mode, kwok pool) was killed too, with a hold of its own on cpu-4 (written
    as it would be). Neither restored anything."""
    cluster = ClusterInfo("cluster-policy", nvidiadriver_mode=False, per_driver_policy=False,
                          operator_namespace=OPERATOR_NS, gpu_nodes=("canary-0", "gpu-1", "gpu-2", "gpu-3"))
    pool = ExistingNodeProvider(node="canary-0").provision(fake, cluster, run_id="run-a")
    upgrade.apply(fake, cluster, pool, CANARY_POLICY, driver_to="580.82.07", run_id="run-a")
    # The operator got as far as cordoning the pool node and marking a held-back one.
    fake.patch("v1", "Node", "canary-0", {"metadata": {"labels": {UPGRADE_STATE_LABEL: "cordon-required"}},
                                          "spec": {"unschedulable": True, "taints": [
                                              *fake.get("v1", "Node", "canary-0")["spec"].get("taints", []),
                                              UNSCHEDULABLE_TAINT]}})
    fake.patch("v1", "Node", "gpu-1", {"metadata": {"labels": {UPGRADE_STATE_LABEL: "upgrade-required"}}})

    upgrade.apply(fake, ClusterInfo("cluster-policy", nvidiadriver_mode=True, per_driver_policy=True,
                                    operator_namespace=OPERATOR_NS, gpu_nodes=("kwok-run-b-0",)),
                  Pool(("kwok-run-b-0",), "pool-b", "570.172.08"), CANARY_POLICY, driver_to="580.82.07",
                  run_id="run-b")
    fake.patch("v1", "Node", "cpu-4", {"metadata": {
        "labels": {SKIP_LABEL: "true"},
        "annotations": {upgrade.SKIP_SET_ANNOTATION: json.dumps({
            "run_id": "run-b", "state": "upgrade-done", "version": "570.172.08", "namespace": OPERATOR_NS})}}})
    for run in ("run-a", "run-b"):
        fake.create(namespace(f"gpucanary-{run}", owned_labels(run)))
        fake.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "gpu-job-x", "namespace": f"gpucanary-{run}", "labels": owned_labels(run)}, "spec": {}})
        fake.create({**node(f"kwok-{run}-0"), "metadata": {"name": f"kwok-{run}-0", "labels": owned_labels(run)}})
    fake.create(nvidiadriver("gpucanary-run-a", owned_labels("run-a")))


class Operator:
    """What the GPU Operator does once the ClusterPolicy is back at the pool's driver: the pool node rolls back,
    is uncordoned (its own taint goes) and reaches upgrade-done."""

    def __init__(self, fake: FakeKube) -> None:
        self.fake, self.stop = fake, threading.Event()
        self.thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> Operator:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)

    def _follow(self) -> None:
        for event in self.fake.watch(*CLUSTER_POLICY, stop=self.stop):
            objects = event.object["items"] if event.type == "RELISTED" else [event.object]
            if any(o["spec"]["driver"]["version"] == "570.172.08" for o in objects):
                node = self.fake.get("v1", "Node", "canary-0")
                if node["metadata"]["labels"].get(UPGRADE_STATE_LABEL) != "upgrade-done":
                    taints = [t for t in node["spec"].get("taints") or [] if t["key"] != UNSCHEDULABLE_TAINT["key"]]
                    self.fake.patch("v1", "Node", "canary-0", {
                        "metadata": {"labels": {UPGRADE_STATE_LABEL: "upgrade-done"}},
                        "spec": {"unschedulable": None, "taints": taints}})


def no_wait(seconds: float) -> None:
    """cleanup's lease duration passes at once: nothing renews a dead run's Lease in a store nobody writes."""


def content(obj: dict) -> dict:
    """The object without the server's counters, which every write moves on."""
    return {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k not in ("resourceVersion", "generation")}}


NODE, NS = ("v1", "Node", None), ("v1", "Namespace", None)
RUN_A_RESTORED = [(*CLUSTER_POLICY, None, "cluster-policy"), (*NODE, "canary-0"), (*NODE, "gpu-1"), (*NODE, "gpu-2")]
RUN_A_DELETED = [(*NODE, "kwok-run-a-0"), (*NS, "gpucanary-run-a"), ("v1", "Pod", "gpucanary-run-a", "gpu-job-x"),
                 (*NVIDIADRIVER, None, "gpucanary-run-a")]
RUN_B_RESTORED = [(*NVIDIADRIVER, None, "pool-b"), (*NODE, "cpu-4")]
RUN_B_DELETED = [(*NODE, "kwok-run-b-0"), (*NS, "gpucanary-run-b"), ("v1", "Pod", "gpucanary-run-b", "gpu-job-x")]


def test_cleanup_by_run_id_restores_and_deletes_that_run_only() -> None:
    fake = cluster_as_found()
    found = fake.objects()
    leave_two_killed_runs(fake)
    left = fake.objects()
    lines: list[str] = []

    with Operator(fake):
        result = cleanup(fake, run_id="run-a", report=lines.append, sleep=no_wait)

    after = fake.objects()
    assert result.problems == [], lines
    assert {key: content(after[key]) for key in RUN_A_RESTORED} == {key: content(found[key]) for key in RUN_A_RESTORED}
    assert not set(RUN_A_DELETED) & set(after)
    untouched = set(after) - set(RUN_A_RESTORED)        # run-b's leftovers and what no run made
    assert {key: after[key] for key in untouched} == {key: left[key] for key in untouched}  # not even written
    assert set(left) - set(after) == set(RUN_A_DELETED)
    # the CP, 2 holds, the node given back; the namespace, the KWOK node and the NVIDIADriver deleted
    assert result.restored == 7
    assert lines[-1] == "run run-a: nothing of it is left on the cluster"


def test_cleanup_without_a_run_id_handles_every_run_and_only_canary_objects() -> None:
    fake = cluster_as_found()
    found = fake.objects()
    leave_two_killed_runs(fake)

    with Operator(fake):
        result = cleanup(fake, report=lambda line: None, sleep=no_wait)

    after = fake.objects()
    assert result.problems == []
    assert set(after) == set(found)
    assert {key: content(obj) for key, obj in after.items()} == {key: content(obj) for key, obj in found.items()}
    untouched = set(found) - set(RUN_A_RESTORED) - set(RUN_B_RESTORED)
    assert {key: after[key] for key in untouched} == {key: found[key] for key in untouched}
    assert result.restored == 11    # run-a's 7, and run-b's NVIDIADriver and cpu-4 restored, namespace and node deleted
    again = cleanup(fake, report=lambda line: None, sleep=no_wait)
    assert again.restored == 0 and again.problems == [] and fake.objects() == after


def hold_lease(fake: FakeKube, run: str) -> None:
    """What a run's RunLease leaves on the cluster."""
    fake.create(namespace(lease.namespace_of(run), owned_labels(run)))
    fake.create({"apiVersion": lease.LEASE[0], "kind": lease.LEASE[1],
                 "metadata": {"name": lease.LEASE_NAME, "namespace": lease.namespace_of(run)},
                 "spec": {"holderIdentity": f"ci-runner/{run}", "leaseDurationSeconds": lease.DURATION_S,
                          "renewTime": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}})


def renewing(fake: FakeKube, run: str):
    """A cleanup's wait during which `run` renews its Lease once, as a live run does."""
    def wait(seconds: float) -> None:
        fake.patch(*lease.LEASE, lease.LEASE_NAME, {"spec": {"renewTime": "2026-12-03T00:00:00.000000Z"}},
                   namespace=lease.namespace_of(run))
    return wait


def test_cleanup_without_a_run_id_leaves_a_live_run_alone_and_says_so() -> None:
    fake = cluster_as_found()
    found = fake.objects()
    leave_two_killed_runs(fake)
    hold_lease(fake, "run-a")           # alive: its owner renews while cleanup watches
    hold_lease(fake, "run-b")           # gone: it stopped renewing
    left = fake.objects()
    lines: list[str] = []

    result = cleanup(fake, report=lines.append, sleep=renewing(fake, "run-a"))

    after = fake.objects()
    run_a = {key for key in left if key not in found and "run-b" not in str(key)} | set(RUN_A_RESTORED)
    run_a -= {(*lease.LEASE, lease.namespace_of("run-a"), lease.LEASE_NAME)}     # renewed by the run itself
    assert {key: after.get(key) for key in run_a} == {key: left[key] for key in run_a}   # not even written
    pool_b = (*NVIDIADRIVER, None, "pool-b")
    assert content(after[pool_b]) == content(found[pool_b])
    assert not set(RUN_B_DELETED) & set(after)
    assert "left live run run-a alone (held by ci-runner/run-a)" in lines
    # run-b's hold stays while the live run-a keeps the ClusterPolicy at its target: released now, cpu-4
    # would take that version; its Lease stays too, so a later cleanup finishes it
    assert after[(*NODE, "cpu-4")]["metadata"]["labels"][SKIP_LABEL] == "true"
    assert (*NS, lease.namespace_of("run-b")) in after
    assert any("ClusterPolicy cluster-policy is at driver 580.82.07, not 570.172.08" in p for p in result.problems)


def test_cleanup_of_a_named_live_run_is_refused_unless_forced() -> None:
    fake = cluster_as_found()
    leave_two_killed_runs(fake)
    hold_lease(fake, "run-a")
    left = fake.objects()

    with pytest.raises(EnvError, match="run run-a is alive"):
        cleanup(fake, run_id="run-a", report=lambda line: None, sleep=renewing(fake, "run-a"))
    assert {k: v for k, v in fake.objects().items() if k[1] != "Lease"} == \
        {k: v for k, v in left.items() if k[1] != "Lease"}

    with Operator(fake):
        forced = cleanup(fake, run_id="run-a", force=True, report=lambda line: None, sleep=renewing(fake, "run-a"))
    assert forced.problems == [] and not any("run-a" in str(key) for key in fake.objects())


def test_a_run_lease_is_created_first_renewed_and_released() -> None:
    fake = FakeKube()
    held = lease.RunLease(fake, "run-c").acquire()
    seen = lease.read(fake, "run-c")
    assert seen is not None and seen.holder == held.holder
    held.release()
    assert lease.read(fake, "run-c") is None
    assert (*NS, lease.namespace_of("run-c")) not in fake.objects()


def test_two_cleanups_at_once_take_a_dead_run_over_once() -> None:
    """Both watch the same dead Lease; only the first compare-and-swap wins, the other leaves the run alone."""
    fake = cluster_as_found()
    found = fake.objects()
    leave_two_killed_runs(fake)
    hold_lease(fake, "run-a")
    both_watched = threading.Barrier(2, timeout=10)
    lines: dict[str, list[str]] = {"one": [], "two": []}
    results: dict[str, object] = {}

    def one_cleanup(name: str) -> None:
        results[name] = cleanup(fake, run_id="run-a", report=lines[name].append,
                                sleep=lambda s: both_watched.wait())

    with Operator(fake):
        threads = [threading.Thread(target=one_cleanup, args=(name,)) for name in lines]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)

    # the loser lost the swap, or (on a slow machine) read the Lease only after the winner had released it
    restored = sorted(result.restored for result in results.values())
    assert restored[0] == 0 < restored[1], lines
    assert {key: content(fake.objects()[key]) for key in RUN_A_RESTORED} == \
        {key: content(found[key]) for key in RUN_A_RESTORED}


def _held_lease(fake: FakeKube, run_id: str, clock: ManualClock, said: list[str]) -> lease.RunLease:
    """A run's Lease acquired off the main thread (a lost Lease is reported, the test process is not interrupted),
    renewed only when the test takes a turn."""
    held: list[lease.RunLease] = []
    starter = threading.Thread(target=lambda: held.append(lease.RunLease(fake, run_id, say=said.append,
                                                                         clock=clock).acquire()))
    starter.start()
    starter.join()
    return held[0]


def test_a_run_whose_renewals_stall_is_taken_over_and_stops() -> None:
    """Cleanup judges a run dead on its own clock when the Lease did not move for a whole duration; the run,
    renewing late, loses the compare-and-swap and stops instead of writing on."""
    fake, clock, said = FakeKube(), ManualClock(), []
    run = _held_lease(fake, "run-s", clock, said)
    run.tick()                                    # renewals move the Lease while the run lives

    dead, live = lease.observe(fake, {"run-s"}, sleep=lambda s: None, report=lambda line: None)
    assert "run-s" in dead and not live           # no renewal during the observer's wait: a hung connection
    assert lease.take_over(fake, "run-s", dead["run-s"], "cleanup/test")
    assert not run.tick()                         # the run's connection comes back: it renews late

    assert run.lost == "its Lease was taken over by cleanup/test"
    assert said == ["run run-s stops: its Lease was taken over by cleanup/test; it restores only what still holds "
                    "what it wrote"]
    assert lease.read(fake, "run-s").holder == "cleanup/test"
    run.release()                                                    # a run that lost its Lease leaves it
    assert lease.read(fake, "run-s") is not None


def test_a_live_run_is_not_judged_dead() -> None:
    fake, clock = FakeKube(), ManualClock()
    run = _held_lease(fake, "run-l", clock, [])

    dead, live = lease.observe(fake, {"run-l"}, sleep=lambda s: run.tick(), report=lambda line: None)

    assert "run-l" in live and not dead
    run.release()
    assert lease.read(fake, "run-l") is None


def test_the_renewal_loop_outlives_any_exception() -> None:
    fake, clock, said = FakeKube(), ManualClock(), []
    run = _held_lease(fake, "run-r", clock, said)
    renew, failures = run._renew, []

    def flaky() -> None:
        if len(failures) < 3:
            failures.append(1)
            raise RuntimeError("a client bug, not an API error")
        renew()

    run._renew = flaky
    before = lease.read(fake, "run-r").resource_version
    for _ in range(3):
        clock.now += run.renew_every_s
        assert run.tick()                         # three failures stay within one duration
    assert lease.read(fake, "run-r").resource_version == before
    clock.now += run.renew_every_s
    assert run.tick()

    assert len(failures) == 3 and lease.read(fake, "run-r").resource_version != before and not run.lost
    assert said == []
    run.release()


def test_a_whole_duration_without_a_renewal_stops_the_run() -> None:
    fake, clock, said = FakeKube(), ManualClock(), []
    run = _held_lease(fake, "run-d", clock, said)

    def unreachable() -> None:
        raise ConnectionError("the apiserver does not answer")

    run._renew = unreachable
    for _ in range(3):
        clock.now += run.renew_every_s
        assert run.tick()
    clock.now += run.renew_every_s

    assert not run.tick()
    assert run.lost == f"the Lease was not renewed for {lease.DURATION_S} s"
    assert said == [f"run run-d stops: the Lease was not renewed for {lease.DURATION_S} s; it restores only what "
                    "still holds what it wrote"]
    run.release()
    assert lease.read(fake, "run-d") is not None                     # left for a cleanup to take over


def test_a_renewal_that_fails_while_the_run_releases_stops_nothing() -> None:
    """The run is over once it releases: a renewal still in flight that then finds the Lease gone must not
    report a lost Lease or interrupt whatever the process does next."""
    fake, clock, said = FakeKube(), ManualClock(), []
    run = _held_lease(fake, "run-x", clock, said)
    in_flight, released = threading.Event(), threading.Event()
    renew = run._renew

    def slow_renew() -> None:
        in_flight.set()
        released.wait(10)
        renew()                      # the Lease is gone by now: NotFound, then read() finds nobody

    run._renew = slow_renew
    turn = threading.Thread(target=run.tick)
    turn.start()
    assert in_flight.wait(10)
    releaser = threading.Thread(target=run.release)
    releaser.start()
    assert run._stop.wait(10)
    lease.release(fake, "run-x")     # as release() does once the renewal thread is joined
    released.set()
    turn.join(10)
    releaser.join(10)
    assert run.lost == "" and said == []


def test_one_bad_annotation_is_reported_and_the_rest_restored() -> None:
    fake = cluster_as_found()
    found = fake.objects()
    leave_two_killed_runs(fake)
    fake.patch("v1", "Node", "gpu-3", {"metadata": {"annotations": {SAVED_STATE_ANNOTATION: "garbage"}}})
    lines: list[str] = []

    with Operator(fake):
        result = cleanup(fake, report=lines.append, sleep=no_wait)

    assert result.problems == ["Node gpu-3: gpucanary.io/saved-node-state names no canary run; left as it is"], lines
    gpu_3 = fake.get("v1", "Node", "gpu-3")["metadata"]
    assert gpu_3["annotations"] == {SAVED_STATE_ANNOTATION: "garbage"} and gpu_3["labels"][SKIP_LABEL] == "true"
    restored = set(RUN_A_RESTORED) | set(RUN_B_RESTORED)
    assert {key: content(fake.objects()[key]) for key in restored} == {key: content(found[key]) for key in restored}


def test_a_forged_node_annotation_makes_cleanup_write_nothing_but_its_removal() -> None:
    """A kubelet can write its own node's annotations: one naming a dead run and carrying labels and taints must
    not make cleanup (which may patch any node) give the node those labels or strip its taints."""
    fake = cluster_as_found()
    forged = json.dumps({"run_id": "run-x", "labels": {"node-role.kubernetes.io/control-plane": ""}, "taints": [],
                         "unschedulable": False})
    fake.patch("v1", "Node", "gpu-2", {"metadata": {"annotations": {SAVED_STATE_ANNOTATION: forged}},
                                       "spec": {"taints": [{"key": "tenant", "value": "a", "effect": "NoSchedule"}]}})
    before = fake.get("v1", "Node", "gpu-2")

    cleanup(fake, report=lambda line: None, sleep=no_wait, wait_s=0.2)

    after = fake.get("v1", "Node", "gpu-2")
    assert after["metadata"]["labels"] == before["metadata"]["labels"]
    assert after["spec"] == before["spec"]


def test_cleanup_takes_a_killed_runs_fence_off_and_keeps_a_taint_set_since() -> None:
    """The operator's pods tolerate the fence, so run-a fenced canary-0; a health checker tainted it after the
    kill. Cleanup gives the node back with the checker's taint and without the fence."""
    fake = cluster_as_found()
    fake.patch("v1", "Pod", "nvidia-driver-daemonset-canary-0", {"spec": {"tolerations": [
        {"key": "gpucanary.io/run", "operator": "Exists", "effect": "NoSchedule"}]}}, namespace=OPERATOR_NS)
    leave_two_killed_runs(fake)
    fence = {"key": "gpucanary.io/run", "value": "run-a", "effect": "NoSchedule"}
    assert fake.get("v1", "Node", "canary-0")["spec"]["taints"] == [*POOL_TAINTS, fence, UNSCHEDULABLE_TAINT]
    health = {"key": "gpu-health", "value": "xid-79", "effect": "NoSchedule"}
    fake.patch("v1", "Node", "canary-0", {"spec": {"taints": [*POOL_TAINTS, fence, UNSCHEDULABLE_TAINT, health]}})

    with Operator(fake):
        result = cleanup(fake, run_id="run-a", report=lambda line: None, sleep=no_wait)

    assert result.problems == []
    canary = fake.get("v1", "Node", "canary-0")
    assert canary["spec"]["taints"] == [*POOL_TAINTS, health]
    assert "gpucanary.io/run-id" not in canary["metadata"]["labels"] and "annotations" not in canary["metadata"]


def test_the_clusterpolicy_lock_released_is_the_one_read_not_one_another_run_took_since() -> None:
    """Between a release's read of the lock and its delete, the lock changed hands (a cleanup released it and
    the next run took it): the uid precondition keeps the next run's lock."""
    fake = FakeKube()
    lease.take_cluster_lock(fake, "run-a")
    taken_by_b: dict = {}
    real_delete = fake.delete

    def delete_after_the_handover(api_version: str, kind: str, name: str, **kwargs) -> None:
        if name == lease.CLUSTER_LOCK_NAMESPACE and not taken_by_b:
            real_delete(api_version, kind, name)
            lease.take_cluster_lock(fake, "run-b")
            taken_by_b.update(fake.get("v1", "Namespace", name)["metadata"])
        real_delete(api_version, kind, name, **kwargs)

    fake.delete = delete_after_the_handover
    lease.release_cluster_lock(fake, "run-a")

    assert fake.get("v1", "Namespace", lease.CLUSTER_LOCK_NAMESPACE)["metadata"] == taken_by_b
    assert taken_by_b["labels"]["gpucanary.io/run-id"] == "run-b"


def test_a_wait_that_runs_out_leaves_the_node_held_and_says_so() -> None:
    fake = cluster_as_found()
    leave_two_killed_runs(fake)          # no operator here: canary-0 never gets back to upgrade-done

    result = cleanup(fake, run_id="run-a", report=lambda line: None, sleep=no_wait, wait_s=0.3)

    assert any(p.startswith("run run-a: node canary-0 stays the run's: node canary-0 did not return to driver "
                            "570.172.08") for p in result.problems), result.problems
    canary = fake.get("v1", "Node", "canary-0")["metadata"]
    assert canary["labels"]["gpucanary.io/run-id"] == "run-a" and SAVED_STATE_ANNOTATION in canary["annotations"]
    assert lease.read(fake, "run-a") is not None      # a later cleanup finishes it
