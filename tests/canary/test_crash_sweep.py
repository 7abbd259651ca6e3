"""A canary run killed right after any one of its writes leaves a cluster `gpucanary cleanup` restores.

`CanaryRun.execute()` runs against the in-memory apiserver (`kube_double.FakeKube`) with the real pool
providers, policy code, recorder and probe loop. The run is "killed" right after its N-th write (the
store is kept as it stood at that instant, see `FakeKube.crash_after_write`), for every N from 1 to
the number of writes a whole run makes (pool, namespaces, workloads, policy, upgrade, restore). Then
`cleanup()` runs without a run id on that store (the dead run's Lease cannot move in it, so cleanup's
watch of it is skipped), with the same scripted operator, and the store must equal the one before the run.

Writes are counted on the run's main thread, so N names the same write in every run; the probe loop
and the Lease renewal write from threads of their own (probe Jobs in the run's namespace, renewals of
its Lease), in between.

`World` plays what the cluster's controllers would do, as scripted state, never a state machine: a
namespace gets its default ServiceAccount, a Job or Deployment a Running pod, and the pool node the
upgrade-state label the operator would write once the target version is set (upgrade-failed, so the
run moves on at once) and upgrade-done once the prior version is back.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
from harness import eventually
from kube_double import Crashed, FakeKube

from pytest_gpucanary.canary import lease, publish
from pytest_gpucanary.canary.cleanup import cleanup
from pytest_gpucanary.config import Settings
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.fleet.kwok_pool import KwokPoolProvider
from pytest_gpucanary.shipped import FIXTURES
from pytest_gpucanary.gpu_operator import (
    CLUSTER_POLICY, GPU_COUNT_LABEL, GPU_PRESENT_LABEL, GPU_RESOURCE, NVIDIADRIVER, SKIP_LABEL, UPGRADE_STATE_LABEL,
)
from pytest_gpucanary.canary.pool import POOL_ELIGIBLE_LABEL
from pytest_gpucanary.canary.pool.existing_node import ExistingNodeProvider
from pytest_gpucanary.canary.run import CanaryRun
from pytest_gpucanary.canary.workloads import IMAGE_PULL_ROLE, PRIORITY_CLASS_MANIFEST, ROLE_LABEL
from pytest_gpucanary.progress import ProgressLine

DRIVER_FROM, DRIVER_TO = "570.172.08", "580.95.05"
OPERATOR_NS = "gpu-operator"
POLICY = {"autoUpgrade": True, "maxParallelUpgrades": 1, "maxUnavailable": "25%",
          "waitForCompletion": {"podSelector": "", "timeoutSeconds": 0},
          "podDeletion": {"force": False, "timeoutSeconds": 300, "deleteEmptyDir": False},
          "drain": {"enable": False, "force": False, "podSelector": "", "timeoutSeconds": 300, "deleteEmptyDir": False}}
IMAGE = "nvcr.io/nvidia/driver:{}-ubuntu22.04"


def gpu_node(name: str, **labels: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {GPU_PRESENT_LABEL: "true", UPGRADE_STATE_LABEL: "upgrade-done",
                                                  **labels}},
            "spec": {"taints": [{"key": "dedicated", "value": "gpu", "effect": "PreferNoSchedule"}]}}


def operand_pod(node: str, component: str, **labels: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{component}-{node}", "namespace": OPERATOR_NS, "labels": labels,
                         "ownerReferences": [{"kind": "DaemonSet", "name": component}]},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": IMAGE.format(DRIVER_FROM)}]},
            "status": {"phase": "Running"}}


def cluster(*, nvidiadriver_mode: bool) -> FakeKube:
    fake = FakeKube()
    objects = [
        {"apiVersion": CLUSTER_POLICY[0], "kind": CLUSTER_POLICY[1], "metadata": {"name": "cluster-policy"},
         "spec": {"driver": {"useNvidiaDriverCRD": nvidiadriver_mode, "version": DRIVER_FROM,
                             "upgradePolicy": POLICY}}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NS}},
        PRIORITY_CLASS_MANIFEST,
        {"apiVersion": "apps/v1", "kind": "DaemonSet",
         "metadata": {"name": "nvidia-driver-daemonset", "namespace": OPERATOR_NS,
                      "labels": {"app.kubernetes.io/component": "nvidia-driver"}},
         "spec": {"template": {"spec": {"containers": [{"name": "c", "image": IMAGE.format(DRIVER_FROM)}]}}},
         "status": {"observedGeneration": 1}},
    ]
    names = ["canary-0", "gpu-1", "gpu-2"]
    if nvidiadriver_mode:
        objects.append({"apiVersion": NVIDIADRIVER[0], "kind": NVIDIADRIVER[1], "metadata": {"name": "fleet"},
                        "spec": {"driverType": "gpu", "version": DRIVER_FROM}})
    for name in names:
        objects += [gpu_node(name, team="ml", **{POOL_ELIGIBLE_LABEL: "true"}),
                    operand_pod(name, "nvidia-driver-daemonset", **{"app.kubernetes.io/component": "nvidia-driver"}),
                    operand_pod(name, "nvidia-operator-validator", app="nvidia-operator-validator")]
    for obj in objects:
        fake.create(obj)
    fake.writes.clear()
    return fake


class World:
    """What the kubelet, the controllers and the operator would write, as scripted reactions to the run."""

    def __init__(self, fake: FakeKube, *, pool_node: str | None) -> None:
        self.fake, self.pool_node = fake, pool_node
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._follow, args=kind, daemon=True) for kind in
                        (("v1", "Namespace"), ("batch/v1", "Job"), ("apps/v1", "Deployment"), ("v1", "Pod"),
                         ("v1", "Node"), (*CLUSTER_POLICY,), (*NVIDIADRIVER,))]

    def __enter__(self) -> World:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=5)

    def _follow(self, api_version: str, kind: str) -> None:
        for event in self.fake.watch(api_version, kind, stop=self.stop):
            if event.type in ("ADDED", "MODIFIED"):
                self._react(kind, event.object, added=event.type == "ADDED")
            elif event.type == "RELISTED" and kind in (CLUSTER_POLICY[1], NVIDIADRIVER[1]):
                for obj in event.object["items"]:   # the operator reconciles what it finds when it starts
                    self._react(kind, obj, added=False)

    def _react(self, kind: str, obj: dict, *, added: bool) -> None:
        meta = obj["metadata"]
        if kind == "Node" and added and obj.get("status", {}).get("allocatable", {}).get(GPU_RESOURCE) == "0":
            count = meta["labels"][GPU_COUNT_LABEL]      # a new kwok pool node: its device plugin registers
            self.fake.patch("v1", "Node", meta["name"], {"status": {"allocatable": {GPU_RESOURCE: count}}})
        elif kind == "Namespace" and added:
            self._create({"apiVersion": "v1", "kind": "ServiceAccount",
                          "metadata": {"name": "default", "namespace": meta["name"]}})
        elif kind == "Pod" and added and meta.get("labels", {}).get(ROLE_LABEL) == IMAGE_PULL_ROLE:
            self._patch("v1", "Pod", meta["name"], meta["namespace"], {"status": {   # the kubelet pulled it
                "phase": "Succeeded", "containerStatuses": [{"name": "pull", "state": {"terminated": {"exitCode": 0}}}]}})
        elif kind in ("Job", "Deployment") and added:
            if kind == "Job":      # the Job controller: done at once, so the run moves on
                self._patch("batch/v1", "Job", meta["name"], meta["namespace"], {"status": {
                    "succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}})
            template = obj["spec"]["template"]
            labels = {**template.get("metadata", {}).get("labels", {}), "job-name": meta["name"]}
            self._create({"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": f"{meta['name']}-pod", "namespace": meta["namespace"], "labels": labels},
                          "spec": {"nodeName": template["spec"].get("nodeName") or "gpu-1"},
                          "status": {"phase": "Running",
                                     "conditions": [{"type": "PodScheduled", "status": "True"}]}})
        elif kind in (CLUSTER_POLICY[1], NVIDIADRIVER[1]):
            version = obj["spec"].get("version") or obj["spec"].get("driver", {}).get("version")
            node = self.pool_node or (obj["spec"].get("nodeSelector") and f"{meta['name']}-0")
            if node and version:
                states = ("upgrade-required", "upgrade-failed") if version == DRIVER_TO else ("upgrade-done",)
                for state in states:
                    try:
                        self.fake.patch("v1", "Node", node, {"metadata": {"labels": {UPGRADE_STATE_LABEL: state}}})
                    except Exception:   # the kwok pool's node may be gone already
                        pass

    def _patch(self, api_version: str, kind: str, name: str, namespace: str, body: dict) -> None:
        try:
            self.fake.patch(api_version, kind, name, body, namespace=namespace)
        except Exception:           # the run's namespace already gone
            pass

    def _create(self, manifest: dict) -> None:
        try:
            self.fake.create(manifest)
        except Exception:           # a run's namespace deleted before its pod: nothing to run
            pass


def settings(tmp_path: Path, run_id: str) -> Settings:
    return Settings(policy=FIXTURES / "policies" / "default.yaml", driver_version=DRIVER_TO,
                    reports_dir=tmp_path / "reports", run_id=run_id, baseline_s=0.01, probe_interval_s=3600.0,
                    upgrade_budget_s=30.0, max_start_latency_s=1.0, load_users=0)


def content(objects: dict) -> dict:
    """What a restore must put back: everything but the fields the apiserver bumps on every write, and the
    verdict a finished run leaves on purpose (its ConfigMap in the canary's own namespace)."""
    def strip(obj: dict) -> dict:
        meta = {k: v for k, v in obj["metadata"].items() if k not in ("resourceVersion", "generation")}
        return {**obj, "metadata": meta}
    return {key: strip(obj) for key, obj in objects.items() if key not in verdicts(objects)}


def verdicts(objects: dict) -> list[tuple]:
    return [key for key in objects if key[:3] == ("v1", "ConfigMap", publish.NAMESPACE)]


MODES = {
    # the fleet's default: NVIDIADriver mode, operator older than v26.7 (policy on the ClusterPolicy), kwok pool
    "nvidiadriver-kwok": (True, lambda: KwokPoolProvider(), None),
    # a real cluster: ClusterPolicy mode, a carved-out existing node, every other GPU node held back
    "clusterpolicy-existing": (False, lambda: ExistingNodeProvider(node="canary-0", restore_timeout_s=30), "canary-0"),
}


def run_once(tmp_path: Path, mode: str, run_id: str, *, crash_after: int | None) -> tuple[dict, FakeKube, list[str]]:
    """The store before the run, the store after it, and the run's progress lines."""
    nvidiadriver_mode, provider, pool_node = MODES[mode]
    fake = cluster(nvidiadriver_mode=nvidiadriver_mode)
    before = content(fake.objects())
    if crash_after is not None:
        fake.crash_after_write(crash_after)
    lines: list[str] = []
    with World(fake, pool_node=pool_node):
        run = CanaryRun(settings(tmp_path, run_id), fake, provider(), progress=ProgressLine(write=lines.append))
        try:
            run.execute()
        except Crashed:
            assert crash_after is not None
    return before, fake, lines


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_run_killed_after_any_write_is_restored_by_cleanup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             mode: str) -> None:
    monkeypatch.setattr(lease, "DURATION_S", 1)
    before, whole, lines = run_once(tmp_path, mode, "whole", crash_after=None)
    assert content(whole.objects()) == before, lines     # a run that lives restores everything itself
    assert len(verdicts(whole.objects())) == 1, lines    # and leaves its verdict
    kinds = {kind for _, kind, _, _ in whole.writes}
    assert {"Namespace", "Lease", "Job", "Node"} <= kinds and ({"ClusterPolicy", "NVIDIADriver"} & kinds), whole.writes
    crashed: list[tuple[int, tuple, dict, dict]] = []
    for n in range(1, len(whole.writes) + 1):
        before_n, fake, _ = run_once(tmp_path, mode, f"crash-{n}", crash_after=n)
        assert fake.at_crash is not None, f"write {n} never happened: {whole.writes[n - 1]}"
        crashed.append((n, fake.writes[n - 1], before_n, fake.at_crash))
    for n, write, before_n, at_crash in crashed:
        left = FakeKube.holding(at_crash)
        with World(left, pool_node=MODES[mode][2]):  # the operator rolls the pool back as cleanup restores it
            result = cleanup(left, report=lambda line: None, sleep=lambda s: None, wait_s=10)
        assert result.problems == [], f"killed after write {n} ({write}): {result.problems}"
        assert content(left.objects()) == before_n, f"killed after write {n} ({write}): not restored"


def test_clusterpolicy_mode_fails_at_rollout_naming_a_gpu_node_that_joins_mid_upgrade(tmp_path: Path) -> None:
    """A GPU node that an autoscaler adds after the holds were set would take the ClusterPolicy's target: the
    run stops waiting, fails rollout naming it ("blast radius"), and restores; the node never gets a hold of
    the run's, and the ClusterPolicy is back at the pool's driver."""
    fake = cluster(nvidiadriver_mode=False)

    class Autoscaled(World):
        def _react(self, kind: str, obj: dict, *, added: bool) -> None:
            if kind == CLUSTER_POLICY[1] and obj["spec"]["driver"]["version"] == DRIVER_TO:
                self._create(gpu_node("gpu-joined"))    # joins as the upgrade starts
            super()._react(kind, obj, added=added)

    lines: list[str] = []
    with Autoscaled(fake, pool_node="canary-0"):
        outcome = CanaryRun(settings(tmp_path, "blast"), fake, ExistingNodeProvider(node="canary-0", restore_timeout_s=30),
                            progress=ProgressLine(write=lines.append)).execute()

    rollout = outcome.verdict("rollout")
    assert rollout.outcome.value == "fail"
    assert any("blast radius: GPU node gpu-joined is not held back from the ClusterPolicy's target 580.95.05" in line
               for line in outcome.evidence.blast_radius), outcome.evidence.blast_radius
    assert "blast radius: GPU node gpu-joined" in rollout.summary
    assert fake.get(*CLUSTER_POLICY, "cluster-policy")["spec"]["driver"]["version"] == DRIVER_FROM
    assert "annotations" not in fake.get("v1", "Node", "gpu-joined")["metadata"]


def test_a_driver_pod_at_the_target_outside_the_pool_is_a_breach() -> None:
    from pytest_gpucanary.canary.blast_radius import BlastRadiusWatch

    fake = cluster(nvidiadriver_mode=False)
    fake.patch("v1", "Node", "gpu-1", {"metadata": {"labels": {SKIP_LABEL: "true"}}})
    fake.patch("v1", "Node", "gpu-2", {"metadata": {"labels": {SKIP_LABEL: "true"}}})
    watch = BlastRadiusWatch(fake, ("canary-0",), DRIVER_TO).start()
    try:
        recreated = {"spec": {"containers": [{"name": "c", "image": IMAGE.format(DRIVER_TO)}]}}
        fake.patch("v1", "Pod", "nvidia-driver-daemonset-canary-0", recreated, namespace=OPERATOR_NS)  # the pool
        fake.patch("v1", "Pod", "nvidia-driver-daemonset-gpu-2", recreated, namespace=OPERATOR_NS)     # held
        eventually(lambda: watch.breaches, timeout_s=5, every_s=0.05)
    finally:
        watch.stop()
    assert len(watch.breaches) == 1 and watch.breaches[0].startswith(
        f"blast radius: driver pod {OPERATOR_NS}/nvidia-driver-daemonset-gpu-2 on node gpu-2, outside the pool, runs "
        f"the target {DRIVER_TO}")


def test_a_driver_holder_on_a_kwok_pool_is_refused_before_any_write(tmp_path: Path) -> None:
    """A KWOK node's driver is simulated: a holder there could not keep it loaded, so its run would prove nothing."""
    fake = cluster(nvidiadriver_mode=True)
    wanted = dataclasses.replace(settings(tmp_path, "held"), holder=FIXTURES / "workloads" / "holder.yaml")
    run = CanaryRun(wanted, fake, KwokPoolProvider(), progress=ProgressLine(write=lambda line: None))
    with pytest.raises(ConfigError, match="a kwok pool's driver is simulated"):
        run.execute()
    assert fake.writes == []
