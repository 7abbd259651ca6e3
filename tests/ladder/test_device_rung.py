"""The device rung on the fleet, with the real GPU Operator: a validator that never comes back after the
driver swap, and a node with no validator pod at all. Both runs go at once, each on its own pool (the
fleet's default operator v26.7 reads each pool's policy from its own NVIDIADriver).

The fault is put on the pool node by the test once the operator has started its upgrade (the node's
upgrade-state label has left upgrade-done): the node agent's `gpucanary.io/simulated-validator:
never-ready` keeps new validator pods unready; `nvidia.com/gpu.deploy.operator-validator=false` is
how a cluster switches the validator off on a node, so the operator's DaemonSet leaves it.
"""

from __future__ import annotations

import json
import subprocess
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import FAST, KEEP_FLEET, TARGET, assert_nothing_left, gpucanary

from pytest_gpucanary.fleet.node_agent import VALIDATOR_ANNOTATION
from pytest_gpucanary.gpu_operator import UPGRADE_DONE, UPGRADE_FAILED, UPGRADE_STATE_LABEL
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.shipped import FIXTURES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

VALIDATION_START = "nvidia.com/gpu-driver-upgrade-validation-start-time"
BUDGET_S = 240      # v26.7 reaches validation-required about 150 s after the policy (its 2-minute requeue)
FAULTS = {"validator-never-ready": {"metadata": {"annotations": {VALIDATOR_ANNOTATION: "never-ready"}}},
          "no-validator": {"metadata": {"labels": {"nvidia.com/gpu.deploy.operator-validator": "false"}}}}


def _inject_once_upgrading(kube: Kube, node: str, patch: dict, stop: threading.Event) -> None:
    """Watch the pool node (it may not exist yet) until the operator has started its upgrade, then patch it."""
    def upgrading(objects: dict[str, dict]) -> bool | None:
        state = objects.get(node, {}).get("metadata", {}).get("labels", {}).get(UPGRADE_STATE_LABEL, "")
        return True if state not in ("", UPGRADE_DONE, UPGRADE_FAILED) or stop.is_set() else None

    kube.watch_until("v1", "Node", upgrading, timeout_s=900, field_selector=f"metadata.name={node}")
    if not stop.is_set():
        kube.patch("v1", "Node", node, patch)


def _run(kube: Kube, fault: str, reports: Path) -> tuple[subprocess.CompletedProcess[str], dict, Path]:
    run_id = f"dev-{uuid.uuid4().hex[:6]}"
    stop = threading.Event()
    injector = threading.Thread(target=_inject_once_upgrading, args=(kube, f"canary-{run_id}-0", FAULTS[fault], stop),
                                daemon=True)
    injector.start()
    try:
        result = gpucanary(
            "run", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
            f"--gpucanary-driver-version={TARGET}", *FAST, f"--gpucanary-upgrade-budget-s={BUDGET_S}",
            "--gpucanary-load-users=4", f"--gpucanary-run-id={run_id}", f"--gpucanary-reports-dir={reports}",
            env=KEEP_FLEET)
    finally:
        stop.set()
    receipt = reports / run_id / "receipt.json"
    return result, json.loads(receipt.read_text()) if receipt.exists() else {}, reports / run_id


def upgrade_wait_s(run_dir: Path) -> float:
    """How long the run waited for the pool's upgrade (its steps.json): the budget bounds it, not the machine."""
    return json.loads((run_dir / "steps.json").read_text())["seconds"]["upgrade"]


def validation_timer_started(run_dir: Path) -> bool:
    """Whether the operator ever annotated the pool node with its validation start time (its 600 s timer)."""
    for line in (run_dir / "timeline.jsonl").read_text().splitlines():
        record = json.loads(line)
        annotations = record["object"].get("metadata", {}).get("annotations") or {}    # relist markers have none
        if record["kind"] == "Node" and VALIDATION_START in annotations:
            return True
    return False


@pytest.fixture(scope="module")
def faulted_runs(gpucanary_fleet, kube: Kube, tmp_path_factory) -> dict[str, tuple]:
    with ThreadPoolExecutor(max_workers=len(FAULTS)) as pool:
        futures = {fault: pool.submit(_run, kube, fault, tmp_path_factory.mktemp(fault)) for fault in FAULTS}
        return {fault: future.result() for fault, future in futures.items()}


def test_a_validator_that_never_comes_back_fails_at_rollout_naming_validation_required_and_the_pod(
        faulted_runs, kube: Kube, policy_before: dict) -> None:
    result, receipt, run_dir = faulted_runs["validator-never-ready"]
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    assert validation_timer_started(run_dir), "the operator starts its validation timeout for an unready validator"
    first = next(v for v in receipt["verdicts"] if v["stage"] == receipt["first_failed"])
    assert receipt["first_failed"] == "rollout", receipt["verdicts"]
    assert "in validation-required" in first["summary"] and "validator pod gpu-operator/nvidia-operator-validator-" \
        in first["summary"] and "0/1 containers ready" in first["summary"], first["summary"]
    device = next(v for v in receipt["verdicts"] if v["stage"] == "device")
    assert device["outcome"] == "fail" and "held in validation-required" in device["summary"]
    assert first["summary"][:120] in result.stdout      # the failing test's first line
    assert upgrade_wait_s(run_dir) <= BUDGET_S + 60, "the run stops waiting at its budget"
    assert_nothing_left(kube, policy_before)


def test_a_node_without_a_validator_fails_within_the_budget_saying_the_operator_would_wait_forever(
        faulted_runs, kube: Kube, policy_before: dict) -> None:
    result, receipt, run_dir = faulted_runs["no-validator"]
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    assert not validation_timer_started(run_dir), "with no validator pod the operator never starts its timeout"
    assert receipt["first_failed"] == "rollout", receipt["verdicts"]
    first = next(v for v in receipt["verdicts"] if v["stage"] == "rollout")
    assert "in validation-required" in first["summary"] and "no app=nvidia-operator-validator pod on canary-" \
        in first["summary"] and "without ever starting its validation timeout" in first["summary"], first["summary"]
    assert upgrade_wait_s(run_dir) <= BUDGET_S + 60, "the run stops waiting at its budget"
    assert_nothing_left(kube, policy_before)
