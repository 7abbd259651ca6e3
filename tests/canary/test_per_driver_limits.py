"""From v26.7 the upgrade controller counts `maxUnavailable` per NVIDIADriver, against that CR's own
nodes (controllers/upgrade_controller.go partitions the cluster's state by the node's
`nvidia.com/gpu-operator.driver.owner` label). Proven on the real controller: with a fleet node of
another NVIDIADriver cordoned (unavailable, as the library counts it), a two-node pool with
`maxUnavailable: 1` still upgrades, one node at a time. Counted cluster-wide, the cordoned fleet
node would take the only slot and the pool would never start.
"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path

import pytest

from pytest_gpucanary.fleet.kwok_pool import KwokPool
from pytest_gpucanary.fleet.manifests import gpu_node_name
from pytest_gpucanary.gpu_operator import NVIDIADRIVER, UPGRADE_STATE_LABEL
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.ladder import timeline
from pytest_gpucanary.cluster import discover
from pytest_gpucanary.canary.recorder import Recorder, StreamSpec
from harness import FLEET_DRIVER, TARGET

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OLD, NEW = FLEET_DRIVER, TARGET
ONE_AT_A_TIME = {"autoUpgrade": True, "maxParallelUpgrades": 0, "maxUnavailable": 1,
                 "waitForCompletion": {"podSelector": "", "timeoutSeconds": 0},
                 "podDeletion": {"force": False, "timeoutSeconds": 60, "deleteEmptyDir": False},
                 "drain": {"enable": False, "force": False, "podSelector": "", "timeoutSeconds": 60,
                           "deleteEmptyDir": False}}
UNAVAILABLE = ("cordon-required", "wait-for-jobs-required", "pod-deletion-required", "drain-required",
               "pod-restart-required", "validation-required", "uncordon-required")


def out_of_service(records: list, node: str) -> tuple[int, int]:
    """From the node's cordon to its uncordon in its upgrade (a fresh node goes straight to upgrade-done)."""
    spans = [s for s in timeline.state_spans(records, node) if s.state in UNAVAILABLE]
    assert spans, f"{node} never left service"
    return min(s.start_wall_ns for s in spans), max(s.end_wall_ns for s in spans)


def test_max_unavailable_counts_only_the_pools_own_nodes(gpucanary_fleet, kube: Kube, tmp_path: Path) -> None:
    if not discover(kube).per_driver_policy:
        pytest.skip("this operator release counts maxUnavailable cluster-wide (per-NVIDIADriver policies: v26.7+)")
    run_id = uuid.uuid4().hex[:6]
    pool = KwokPool(kube, name=f"limits-{run_id}", run_id=run_id, size=2)
    cordoned = gpu_node_name(0)
    streams = [StreamSpec(f"node-{n}", "v1", "Node", field_selector=f"metadata.name={n}")
               for n in (f"{pool.name}-0", f"{pool.name}-1", cordoned)]
    with contextlib.ExitStack() as undo, Recorder(kube, tmp_path / "timeline.jsonl", streams) as recorder:
        undo.callback(pool.delete)
        pool.create(driver_version=OLD)
        pool.wait_for_gpus()
        for node in pool.nodes:
            recorder.wait_for(lambda rs, n=node: True if "upgrade-done" in timeline.upgrade_states(rs, n) else None,
                              timeout_s=300, what=f"{node} settled at upgrade-done")
        kube.patch("v1", "Node", cordoned, {"spec": {"unschedulable": True}})
        undo.callback(kube.patch, "v1", "Node", cordoned, {"spec": {"unschedulable": None}})
        kube.patch(*NVIDIADRIVER, pool.name, {"spec": {"upgradePolicy": ONE_AT_A_TIME, "version": NEW}})
        for node in pool.nodes:
            recorder.wait_for(lambda rs, n=node: timeline.terminal_state(rs, n), timeout_s=900,
                              what=f"{node} reaching upgrade-done or upgrade-failed")
        records = list(recorder.records)

    assert [timeline.terminal_state(records, n) for n in pool.nodes] == ["upgrade-done", "upgrade-done"]
    assert timeline.upgrade_states(records, cordoned)[-1] == "upgrade-done"      # the fleet's node was left alone
    (a_start, a_end), (b_start, b_end) = (out_of_service(records, n) for n in pool.nodes)
    assert a_end <= b_start or b_end <= a_start, "maxUnavailable 1: the pool's two nodes were out at the same time"
    assert not [r for r in records if r.name == cordoned and r.object.get("metadata", {}).get("labels", {})
                .get(UPGRADE_STATE_LABEL) not in ("upgrade-done", None)]
