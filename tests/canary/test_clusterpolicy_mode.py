"""ClusterPolicy mode (one driver DaemonSet for every GPU node, as most v24/v25 clusters run): the
canary confines the upgrade to its pool with the operator's skip label and leaves every other node
exactly as it was, its driver pod never restarted. The fleet here has two KWOK GPU nodes and one real
kubelet node that is a canary pool, driven by the same DaemonSet: the gate runs on a KWOK pool, and a
driver that cannot come fails at rollout on the kubelet pool, named, with every node back on its driver
(`make test` runs the no-image case; `make diagnosis-matrix` every cause the rollout watcher names)."""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import nullcontext
from pathlib import Path
from typing import Iterator

import pytest

from pytest_gpucanary.fleet.layout import DEFAULT_OPERATOR_RELEASE, KUBELET_POOL_RELEASES
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.shipped import FIXTURES
from harness import CLI, TARGET, gpucanary, second_fleet
from test_kubelet_pool import (  # this folder is on sys.path (rootdir import mode)
    STALL_S, assert_named_in_minutes, stop_kubelet_during_the_upgrade, unschedulable_driver_pod,
)
from harness import refused_drain_options

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KWOK_NODES, KUBELET_NODE = ("gpu-node-0", "gpu-node-1"), "gpu-kubelet-0"
RELEASE = os.environ.get("GPUCANARY_OPERATOR_RELEASE") or DEFAULT_OPERATOR_RELEASE
KUBELET_POOL = RELEASE in KUBELET_POOL_RELEASES     # before v26.3 the driver cannot take the host's network


@pytest.fixture(scope="module")
def clusterpolicy_fleet(gpucanary_fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    yield from second_fleet("clusterpolicy", tmp_path_factory.mktemp("cp-fleet"), gpucanary_fleet,
                            GPUCANARY_FLEET_GPU_NODES="2", GPUCANARY_FLEET_DRIVER_MODE="clusterpolicy",
                            GPUCANARY_FLEET_KUBELET_NODES="1",
                            GPUCANARY_FLEET_KUBELET_POOL="1" if KUBELET_POOL else "0")


def driver_pods(kube: Kube) -> dict[str, str]:
    return {p["spec"]["nodeName"]: p["metadata"]["name"]
            for p in kube.list("v1", "Pod", label_selector="app=nvidia-driver-daemonset")}


def test_clusterpolicy_mode_gate_upgrades_only_the_pool_and_restores_the_rest(clusterpolicy_fleet: dict[str, str],
                                                                             tmp_path: Path) -> None:
    kube = Kube.connect(clusterpolicy_fleet["KUBECONFIG_PATH"])
    policy = kube.get("nvidia.com/v1", "ClusterPolicy", "cluster-policy")
    assert policy["spec"]["driver"]["useNvidiaDriverCRD"] is False
    before = driver_pods(kube)
    assert set(before) == {*KWOK_NODES, *([KUBELET_NODE] if KUBELET_POOL else [])}

    result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                       "--gpucanary-pool-provider=kwok",
                       f"--gpucanary-driver-version={TARGET}", "--gpucanary-probe-interval-s=10",
                       "--gpucanary-upgrade-budget-s=420", "--gpucanary-max-p99-s=3",
                       "--gpucanary-baseline-s=10", "--gpucanary-job-duration-s=180",
                       f"--gpucanary-reports-dir={tmp_path / 'reports'}", env=clusterpolicy_fleet)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "operator in ClusterPolicy mode" in result.stdout

    policy = kube.get("nvidia.com/v1", "ClusterPolicy", "cluster-policy")
    assert policy["spec"]["driver"]["version"] == "580.82.07"
    assert "gpucanary.io/saved-spec" not in policy["metadata"].get("annotations", {})
    for name in (*KWOK_NODES, *([KUBELET_NODE] if KUBELET_POOL else [])):
        node = kube.get("v1", "Node", name)
        labels, annotations = node["metadata"]["labels"], node["metadata"].get("annotations", {})
        assert labels.get("nvidia.com/gpu-driver-upgrade-state") == "upgrade-done", (name, labels)
        assert "nvidia.com/gpu-driver-upgrade.skip" not in labels
        assert "gpucanary.io/skip-label-set-by" not in annotations
        assert not node["spec"].get("unschedulable")
    assert {n: p for n, p in driver_pods(kube).items() if n in before} == before, "a held-back driver pod restarted"


# case -> (target driver, what the rollout verdict says); each but "no-image" runs from `make diagnosis-matrix`
CAUSES = {
    "no-image": ("999.1.1", "nvcr.io/nvidia/driver:999.1.1-ubuntu22.04"),
    "crash": ("574.0.1", f"container nvidia-driver-ctr on {KUBELET_NODE}: CrashLoopBackOff since"),
    "driver-in-use": (TARGET, f"init container k8s-driver-manager on {KUBELET_NODE}: CrashLoopBackOff since"),
    "hangs": ("574.0.2", f"container nvidia-driver-ctr on {KUBELET_NODE}: NotStarted since"),
    "unvalidated": ("574.0.3", f"on {KUBELET_NODE}: BlockedInInit since"),
    "node-not-ready": (TARGET, f"node {KUBELET_NODE} on {KUBELET_NODE}: NotReady since"),
    "eviction-refused": (TARGET, "drain cannot evict it: PodDisruptionBudget gpucanary-"),
    "unschedulable": (TARGET, f"on {KUBELET_NODE}: Unschedulable since"),
}


def _case_args(case: str, root: Path) -> tuple[str, ...]:
    """The run's options beyond the common ones: the stall time, the holder, or a refused drain (the field
    note's policy, whose pod deletion must fall back to the drain, with a 60 s drain timeout, and a service
    whose budget allows no disruption)."""
    if case == "driver-in-use":
        return (f"--gpucanary-holder={FIXTURES / 'workloads' / 'holder.yaml'}",)
    if case != "eviction-refused":
        return (f"--gpucanary-stall-s={STALL_S}",) if case in ("hangs", "unvalidated", "node-not-ready",
                                                                "unschedulable") else ()
    return refused_drain_options(root, drain_timeout_s=STALL_S)


@pytest.mark.parametrize("case", [pytest.param(case, marks=() if case == "no-image" else pytest.mark.diagnosis_matrix)
                                  for case in CAUSES if KUBELET_POOL or case == "no-image"])
def test_a_driver_that_cannot_come_fails_at_rollout_on_the_kubelet_pool_and_every_node_keeps_its_driver(
        clusterpolicy_fleet: dict[str, str], tmp_path: Path, case: str) -> None:
    """The ClusterPolicy's own driver DaemonSet on the real kubelet node (the fleet's default pool), at a target
    that cannot come: no image, a driver that crashes loading, one a pod holds without a GPU request, one that
    hangs before it loads, one that loads while the validator's check of it fails, the node gone NotReady, a
    drain that a budget refuses, or a driver pod the scheduler cannot place. Each is named in minutes, the ClusterPolicy goes back, the pool node runs its
    old driver again, and the held-back nodes' driver pods never restarted. On a release whose ClusterPolicy has
    no driver.hostNetwork, `fleet up` refuses such a pool in one line, starting nothing."""
    if not KUBELET_POOL:
        root = tmp_path / "refused"
        up = gpucanary("fleet", "up", env={**clusterpolicy_fleet, "GPUCANARY_FLEET_DIR": str(root),
                                           "GPUCANARY_FLEET_KUBELET_POOL": "1"})
        assert up.returncode == 4, up.stdout[-2000:] + up.stderr[-2000:]
        assert f"hostNetwork setting, which GPU Operator {RELEASE} does not have" in up.stderr, up.stderr
        assert not (root / "run").exists() or not any((root / "run").iterdir())
        return
    kube = Kube.connect(clusterpolicy_fleet["KUBECONFIG_PATH"])
    before = driver_pods(kube)
    target, words = CAUSES[case]
    command = [*CLI, "run",
               f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}", f"--gpucanary-driver-version={target}",
               "--gpucanary-probe-interval-s=10", "--gpucanary-upgrade-budget-s=420", "--gpucanary-baseline-s=10",
               "--gpucanary-job-duration-s=150", f"--gpucanary-reports-dir={tmp_path / 'reports'}",
               *_case_args(case, tmp_path / "inputs")]
    with unschedulable_driver_pod(clusterpolicy_fleet, KUBELET_NODE) if case == "unschedulable" else nullcontext():
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **clusterpolicy_fleet, "PYTHONUNBUFFERED": "1"})
        try:
            if case == "node-not-ready":
                stop_kubelet_during_the_upgrade(clusterpolicy_fleet, KUBELET_NODE, stall_s=STALL_S)
            stdout, stderr = proc.communicate(timeout=900)
        finally:
            proc.kill()
    output = stdout[-4000:] + stderr[-2000:]
    assert proc.returncode == 1, output
    assert f"pool {KUBELET_NODE} (kubelet)" in stdout and "operator in ClusterPolicy mode" in stdout
    [run_dir] = [p for p in (tmp_path / "reports").iterdir() if p.is_dir()]
    [rollout] = [v for v in json.loads((run_dir / "receipt.json").read_text())["verdicts"] if v["stage"] == "rollout"]
    assert rollout["outcome"] == "fail", rollout["summary"]
    assert_named_in_minutes(rollout["summary"], case, words)
    if case == "no-image":
        assert f"container nvidia-driver-ctr on {KUBELET_NODE}: " in rollout["summary"], rollout["summary"]
    if case == "unschedulable":         # GPU Operator passes over the node: the give-back replaced the pod
        assert f"could not be placed on node {KUBELET_NODE}" in stdout, output

    assert kube.get("nvidia.com/v1", "ClusterPolicy", "cluster-policy")["spec"]["driver"]["version"] == "580.82.07"
    [pod] = kube.list("v1", "Pod", label_selector="app=nvidia-driver-daemonset",
                      field_selector=f"spec.nodeName={KUBELET_NODE}")
    assert pod["spec"]["containers"][0]["image"] == "nvcr.io/nvidia/driver:580.82.07-ubuntu22.04", pod["spec"]
    assert pod["status"]["phase"] == "Running", pod["status"]
    node = kube.get("v1", "Node", KUBELET_NODE)
    assert node["metadata"]["labels"].get("nvidia.com/gpu-driver-upgrade-state") == "upgrade-done"
    # the run's fence went with the restore (the node controller's unreachable taint goes on its own time)
    assert not [t for t in node["spec"].get("taints") or [] if not t["key"].startswith("node.kubernetes.io/")] \
        and not node["spec"].get("unschedulable"), node["spec"]
    assert {n: p for n, p in driver_pods(kube).items() if n in KWOK_NODES} == \
        {n: p for n, p in before.items() if n in KWOK_NODES}, "a held-back driver pod restarted"


def test_a_gpu_node_that_joins_mid_run_fails_rollout_and_the_target_leaves_it_again(
        clusterpolicy_fleet: dict[str, str], tmp_path: Path) -> None:
    """An autoscaler adds a GPU node while the canary's target is the ClusterPolicy's: the new node is not held
    back, and its driver pod comes up at the target. The run stops waiting, fails at rollout naming the node
    ("blast radius"), and restores at once; afterwards no node outside the pool runs the target."""
    import threading
    import uuid

    from pytest_gpucanary.fleet.kwok_pool import KwokPool

    kube = Kube.connect(clusterpolicy_fleet["KUBECONFIG_PATH"])
    joined = KwokPool(kube, name=f"joined-{uuid.uuid4().hex[:6]}", run_id="autoscaler")
    proc = subprocess.Popen([*CLI, "run",
                             f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                             f"--gpucanary-driver-version={TARGET}", "--gpucanary-pool-provider=kwok",
                             "--gpucanary-probe-interval-s=10", "--gpucanary-upgrade-budget-s=420", "--gpucanary-baseline-s=10",
                             "--gpucanary-job-duration-s=180", f"--gpucanary-reports-dir={tmp_path / 'reports'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **clusterpolicy_fleet, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    output: list[str] = []
    try:
        for line in proc.stdout:
            output.append(line)
            if "applied; upgrading the pool" in line:
                [name] = joined.create(driver_version=None)
                # a node the cluster's owners made, not the canary
                kube.patch("v1", "Node", name, {"metadata": {"labels": {"app.kubernetes.io/managed-by": None,
                                                                        "gpucanary.io/run-id": None}}})
                break
        rest = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
        rest.start()
        assert proc.wait(timeout=900) == 1, "".join(output)[-4000:]
        rest.join(timeout=10)
        text = "".join(output)
        assert f"blast radius: GPU node {joined.nodes[0]} is not held back from the ClusterPolicy's target {TARGET}" \
            in text, text[-4000:]
        assert kube.get("nvidia.com/v1", "ClusterPolicy", "cluster-policy")["spec"]["driver"]["version"] == "580.82.07"

        def target_outside_the_pool(pods: dict[str, dict]) -> bool | None:
            at_target = [p["spec"].get("nodeName") for p in pods.values()
                         if any(f":{TARGET}" in c.get("image", "") for c in p["spec"]["containers"])]
            return True if not at_target else None

        kube.watch_until("v1", "Pod", target_outside_the_pool, timeout_s=600,   # the operator rolls it back
                         label_selector="app=nvidia-driver-daemonset")
    finally:
        if proc.poll() is None:
            proc.kill()
        joined.delete()
