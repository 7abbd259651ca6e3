"""The real GPU Operator upgrade controller, executing upgrade policies on fresh KWOK pools.

Scenarios that share a policy run side by side, one pool and one NVIDIADriver each, and the two
policies one after the other. Where the policy lives follows the release: from v26.7 each
NVIDIADriver carries its own `upgradePolicy` (the ClusterPolicy's is ignored in NVIDIADriver mode),
before that the ClusterPolicy's applies to every driver pod. Nothing here sets an upgrade-state
label: the controller does.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from harness import FLEET_DRIVER, TARGET, eventually

from pytest_gpucanary.canary.recorder import Record, Recorder, StreamSpec
from pytest_gpucanary.cluster import discover
from pytest_gpucanary.fleet.kwok_pool import KwokPool
from pytest_gpucanary.gpu_operator import NVIDIADRIVER
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import NotFound
from pytest_gpucanary.ladder import timeline

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OLD, NEW = FLEET_DRIVER, TARGET
POD_DELETION_TIMEOUT_S = 45
UPGRADE_TIMEOUT_S = 420          # two 2-minute requeues of the controller, plus margin
SEQUENCE = ["upgrade-required", "cordon-required", "wait-for-jobs-required", "pod-deletion-required",
            "pod-restart-required", "validation-required", "uncordon-required", "upgrade-done"]

NO_DRAIN = {"autoUpgrade": True, "maxParallelUpgrades": 0, "maxUnavailable": "100%",
            "waitForCompletion": {"podSelector": "", "timeoutSeconds": 0},
            "podDeletion": {"force": False, "timeoutSeconds": POD_DELETION_TIMEOUT_S, "deleteEmptyDir": False},
            "drain": {"enable": False, "force": False, "podSelector": "", "timeoutSeconds": 60,
                      "deleteEmptyDir": False}}
DRAIN_FALLBACK = {**NO_DRAIN, "drain": {**NO_DRAIN["drain"], "enable": True, "deleteEmptyDir": True}}


def deployment(name: str, namespace: str, node: str, *, gpus: int = 0, shm: bool = False) -> dict:
    container: dict = {"name": "main", "image": "pytorch" if gpus else "api"}
    spec: dict = {"nodeSelector": {"kubernetes.io/hostname": node}, "terminationGracePeriodSeconds": 2,
                  "containers": [container]}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    if shm:  # as PyTorch jobs mount it
        spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": spec}}}


@dataclass
class Scenario:
    key: str
    pool: KwokPool
    namespace: str
    gpu_shm: bool = False
    pdb: bool = False

    @property
    def node(self) -> str:
        return self.pool.nodes[0]


@contextlib.contextmanager
def upgrade_policy(kube: Kube, policy: dict) -> Iterator[None]:
    before = kube.get("nvidia.com/v1", "ClusterPolicy", "cluster-policy")["spec"]["driver"]["upgradePolicy"]
    kube.patch("nvidia.com/v1", "ClusterPolicy", "cluster-policy", {"spec": {"driver": {"upgradePolicy": policy}}})
    try:
        yield
    finally:
        kube.patch("nvidia.com/v1", "ClusterPolicy", "cluster-policy",
                   {"spec": {"driver": {"upgradePolicy": before}}})


def _running(records: list[Record], namespace: str, app: str) -> bool:
    latest: dict[str, dict] = {}
    for r in records:
        if r.kind == "Pod" and r.namespace == namespace and r.object.get("metadata", {}).get("labels", {}).get("app") == app:
            latest[r.object["metadata"]["uid"]] = {} if r.type == "DELETED" else r.object
    return any(p.get("status", {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
               for p in latest.values() if p)


def run_phase(kube: Kube, recorder: Recorder, run_id: str, policy: dict,
              scenarios: list[tuple[str, bool, bool]]) -> dict[str, Scenario]:
    """Create one pool per scenario at OLD, place its workloads, move every pool to NEW, wait for the end."""
    built: dict[str, Scenario] = {}
    for key, gpu_shm, pdb in scenarios:
        pool = KwokPool(kube, name=f"upg-{key}-{run_id}", run_id=run_id)
        namespace = f"upg-{key}-{run_id}"
        kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        pool.create(driver_version=OLD)
        built[key] = Scenario(key, pool, namespace, gpu_shm, pdb)
    for s in built.values():
        recorder.wait_for(lambda rs, s=s: True if "upgrade-done" in timeline.upgrade_states(rs, s.node) else None,
                          timeout_s=UPGRADE_TIMEOUT_S, what=f"{s.node} settled at upgrade-done")
        kube.wait_for("v1", "ServiceAccount", "default", lambda sa: True, namespace=s.namespace, timeout_s=30)
        kube.create(deployment("gpu-job", s.namespace, s.node, gpus=1, shm=s.gpu_shm))
        kube.create(deployment("sched-api", s.namespace, s.node))
        if s.pdb:
            kube.create({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                         "metadata": {"name": "gpu-job", "namespace": s.namespace},
                         "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "gpu-job"}}}})
    for s in built.values():
        for app in ("gpu-job", "sched-api"):
            recorder.wait_for(lambda rs, s=s, app=app: True if _running(rs, s.namespace, app) else None,
                              timeout_s=60, what=f"{s.namespace}/{app} Running")
        if s.pdb:
            kube.wait_for("policy/v1", "PodDisruptionBudget", "gpu-job",
                          lambda b: b.get("status", {}).get("currentHealthy") == 1, namespace=s.namespace,
                          timeout_s=60)
    per_driver = discover(kube).per_driver_policy
    with contextlib.nullcontext() if per_driver else upgrade_policy(kube, policy):
        for s in built.values():
            if per_driver:       # the pool's own NVIDIADriver reads it, and only its nodes follow
                kube.patch(*NVIDIADRIVER, s.pool.name, {"spec": {"upgradePolicy": policy, "version": NEW}})
            else:
                s.pool.set_driver_version(NEW)
        for s in built.values():
            recorder.wait_for(lambda rs, s=s: timeline.terminal_state(rs, s.node), timeout_s=UPGRADE_TIMEOUT_S,
                              what=f"{s.node} reaching upgrade-done or upgrade-failed")
    return built


@pytest.fixture(scope="module")
def recorder(kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorder]:
    path = Path(tmp_path_factory.mktemp("timeline")) / "timeline.jsonl"
    streams = [StreamSpec("nodes", "v1", "Node"), StreamSpec("pods", "v1", "Pod"),
               StreamSpec("node-events", "v1", "Event", namespace="default", field_selector="involvedObject.kind=Node")]
    with Recorder(kube, path, streams) as rec:
        yield rec


@pytest.fixture(scope="module")
def run_id() -> str:
    return uuid.uuid4().hex[:6]


def _cleanup(kube: Kube, scenarios: dict[str, Scenario]) -> None:
    for s in scenarios.values():
        for delete in (s.pool.delete, lambda s=s: kube.delete("v1", "Namespace", s.namespace)):
            with contextlib.suppress(NotFound):
                delete()


@pytest.fixture(scope="module")
def no_drain_phase(kube: Kube, recorder: Recorder, run_id: str) -> Iterator[dict[str, Scenario]]:
    scenarios = run_phase(kube, recorder, run_id, NO_DRAIN,
                          [("plain", False, False), ("shm", True, False), ("pdb", False, True)])
    yield scenarios
    _cleanup(kube, scenarios)


@pytest.fixture(scope="module")
def drain_phase(kube: Kube, recorder: Recorder, run_id: str, no_drain_phase) -> Iterator[dict[str, Scenario]]:
    scenarios = run_phase(kube, recorder, run_id, DRAIN_FALLBACK, [("drain", True, False)])
    yield scenarios
    _cleanup(kube, scenarios)


def gone_names(records: list[Record], scenario: Scenario) -> dict[str, timeline.PodGone]:
    return {g.name.rsplit("-", 2)[0]: g for g in timeline.pods_gone(records, scenario.node)
            if g.namespace == scenario.namespace}


def test_new_version_takes_only_the_pool_node_through_the_full_sequence(
        no_drain_phase: dict[str, Scenario], recorder: Recorder, gpucanary_fleet) -> None:
    node = no_drain_phase["plain"].node
    states = timeline.upgrade_states(recorder.records, node)
    assert states[states.index("upgrade-required"):] == SEQUENCE
    messages = [e.message for e in timeline.node_events(recorder.records, node)]
    for state in ("upgrade-required", "pod-deletion-required", "pod-restart-required", "upgrade-done"):
        assert any(m.endswith(f"Successfully updated node state label to {state}") for m in messages), messages
    events = timeline.node_events(recorder.records, node)
    assert {(e.namespace, e.source) for e in events} == {("default", "nvidia-gpu-operator")}
    for other in gpucanary_fleet.fleet.gpu_node_names():
        # never in an upgrade cycle; on a young fleet the operator may label the node upgrade-done only now
        assert [s for s in timeline.upgrade_states(recorder.records, other) if s] == ["upgrade-done"], other


def test_default_policy_evicts_the_gpu_pod_and_spares_the_non_gpu_pod(no_drain_phase: dict[str, Scenario],
                                                                       recorder: Recorder) -> None:
    gone = gone_names(recorder.records, no_drain_phase["plain"])
    assert "gpu-job" in gone and gone["gpu-job"].gpus == 1
    assert "sched-api" not in gone, gone


def test_shm_emptydir_without_drain_ends_upgrade_failed(no_drain_phase: dict[str, Scenario],
                                                       recorder: Recorder) -> None:
    scenario = no_drain_phase["shm"]
    assert timeline.terminal_state(recorder.records, scenario.node) == "upgrade-failed"
    states = timeline.upgrade_states(recorder.records, scenario.node)
    assert "drain-required" not in states and "pod-restart-required" not in states, states
    assert gone_names(recorder.records, scenario) == {}, "pod deletion refused, so nothing may be evicted"


def test_pdb_holds_gpu_pod_deletion_back_until_its_timeout(no_drain_phase: dict[str, Scenario],
                                                          recorder: Recorder) -> None:
    scenario = no_drain_phase["pdb"]
    transitions = timeline.label_transitions(recorder.records, scenario.node, timeline.UPGRADE_STATE_LABEL)
    by_state = {t.state: t.received_wall_ns for t in transitions}
    assert transitions[-1].state == "upgrade-failed"
    held_s = (by_state["upgrade-failed"] - by_state["pod-deletion-required"]) / 1e9
    assert held_s >= POD_DELETION_TIMEOUT_S - 1, f"pod deletion gave up after {held_s:.1f} s (client receive time)"
    assert "gpu-job" not in gone_names(recorder.records, scenario), "the PDB must have kept the GPU pod"


def test_shm_emptydir_with_drain_enabled_drains_the_non_gpu_pod_too(drain_phase: dict[str, Scenario],
                                                                     recorder: Recorder) -> None:
    scenario = drain_phase["drain"]
    states = timeline.upgrade_states(recorder.records, scenario.node)
    assert "drain-required" in states and states[-1] == "upgrade-done", states
    messages = [e.message for e in timeline.node_events(recorder.records, scenario.node)]
    assert any("Pod deletion failed but drain is enabled" in m for m in messages), messages
    gone = gone_names(recorder.records, scenario)
    assert {"gpu-job", "sched-api"} <= set(gone), gone
    assert gone["sched-api"].gpus == 0 and gone["sched-api"].disruption_reason == "EvictionByEvictionAPI"


def test_dcgm_driver_version_follows_the_new_driver_pod(no_drain_phase: dict[str, Scenario], gpucanary_fleet) -> None:
    """The simulated DCGM series relabel once the node's new driver pod is Ready (the node agent's GFD labels)."""
    from pytest_gpucanary.canary import metrics
    from pytest_gpucanary.ladder.metrics import judge_answer

    node = no_drain_phase["plain"].node
    def judged():
        answer = metrics.ask_driver_version(metrics.Prometheus(gpucanary_fleet.fleet.prometheus_url), nodes=(node,))
        return judge_answer(answer, nodes=(node,), target=NEW)

    assert eventually(lambda: judged().outcome.value == "pass", timeout_s=60, every_s=2), judged()


def test_operator_metric_counts_the_failed_pool_nodes(no_drain_phase: dict[str, Scenario], gpucanary_fleet) -> None:
    """gpu_operator_nodes_upgrades_failed is set in NVIDIADriver mode too, on every release: the shm and PDB pools."""
    from pytest_gpucanary.canary import metrics

    def peak() -> float:
        series = metrics.query("max_over_time(gpu_operator_nodes_upgrades_failed[15m])",
                               url=gpucanary_fleet.fleet.prometheus_url)
        return max([s.value for s in series] + [0.0])

    assert eventually(lambda: peak() >= 2, timeout_s=60, every_s=5), \
        f"gpu_operator_nodes_upgrades_failed peaked at {peak()}, 2 pool nodes failed"
