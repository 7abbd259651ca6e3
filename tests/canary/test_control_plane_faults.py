"""Control-plane faults in the middle of an upgrade: the run keeps its evidence, or says what it lacks.

The fault starts when the pool node enters pod-deletion-required (seen by a watch): the
kube-apiserver restarted, the GPU Operator restarted, or etcd paused for 10 s (SIGSTOP, SIGCONT).
Prometheus stopped mid-run is test_canary_gate.py::test_prometheus_stopped_mid_run_....

For each:
- the recorder lost no transition of the pool node: the upgrade-state values the operator's own
  patches of that node set (the audit log holds the body of Node patches, manifests.audit_policy),
  up to the last record of the timeline, appear in reports/<run>/timeline.jsonl in the same order;
- the verdicts are those the same run gets without the fault (the default policy passes: rollout,
  device, scheduler and application pass, network skipped), or a stage is inconclusive with its
  reason; never a failure invented by the fault, never a pass on missing data;
- the cluster is as before (tests/testbed/snapshot.py) and no write went outside the run's scope.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from testbed.snapshot import run_killed, snapshot
from pytest_gpucanary.gpu_operator import UPGRADE_STATE_LABEL
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.ladder import RunEvidence, timeline

from test_faults import ARGS, run_scope, state_cue, wait_restored
from testbed.audit import outside

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WITHOUT_FAULT = {"rollout": "pass", "device": "pass", "network": "skipped", "scheduler": "pass", "application": "pass"}
ETCD_PAUSE_S = 10


def restart_apiserver(fleet) -> None:
    fleet.restart_component("kube-apiserver")


def restart_operator(fleet) -> None:
    fleet.restart_component("gpu-operator")


def pause_etcd(fleet) -> None:
    fleet.pause_component("etcd")
    try:
        time.sleep(ETCD_PAUSE_S)
    finally:
        fleet.resume_component("etcd")


FAULTS = {"apiserver-restarted": restart_apiserver, "operator-restarted": restart_operator,
          "etcd-paused-10s": pause_etcd}


def dedup(states: list[str]) -> list[str]:
    return [s for i, s in enumerate(states) if i == 0 or states[i - 1] != s]


def is_subsequence(short: list[str], long: list[str]) -> bool:
    it = iter(long)
    return all(any(s == x for x in it) for s in short)


def operator_set_states(records, node: str, *, until_s: float) -> list[str]:
    """The upgrade-state values set by the patches of `node` that are not the canary's, in order of receipt."""
    states = []
    for r in records:
        body = r.request_object if isinstance(r.request_object, dict) else {}
        value = (body.get("metadata") or {}).get("labels", {}).get(UPGRADE_STATE_LABEL)
        if r.resource == "nodes" and r.name == node and r.verb == "patch" and 200 <= r.code < 300 \
                and value and r.received_s <= until_s:
            states.append(value)
    return states


CI_FAULTS = {"apiserver-restarted"}     # in `make test`; the others with `make kill-matrix`


@pytest.mark.parametrize("fault", [pytest.param(name, marks=() if name in CI_FAULTS else pytest.mark.kill_matrix)
                                   for name in sorted(FAULTS)])
def test_a_control_plane_fault_mid_upgrade_loses_no_transition_and_invents_no_verdict(
        gpucanary_fleet, kube: Kube, tmp_path: Path, fault: str) -> None:
    fleet = gpucanary_fleet.fleet
    before = snapshot(kube)
    stop, done = threading.Event(), threading.Event()

    def inject() -> None:
        FAULTS[fault](fleet)
        done.set()
    state_cue(kube, "pod-deletion-required", lambda: threading.Thread(target=inject, daemon=True).start(), stop)
    result = run_killed(fleet, ARGS, reports=tmp_path / "reports", cue=lambda _: False, sig=signal.SIGKILL)
    stop.set()
    assert done.is_set(), f"the fault {fault} never ran:\n{result.output[-3000:]}"
    receipt = result.receipt
    assert receipt is not None, result.output[-3000:]
    outcomes = {v["stage"]: v["outcome"] for v in receipt["verdicts"]}
    for verdict in receipt["verdicts"]:
        stage, outcome = verdict["stage"], verdict["outcome"]
        assert outcome == WITHOUT_FAULT[stage] or (outcome == "inconclusive" and verdict["summary"]), verdict
    assert receipt["gate_passed"] == (outcomes == WITHOUT_FAULT)
    assert result.returncode == (0 if receipt["gate_passed"] else 1), result.output[-3000:]

    # the recorder's transitions against the operator's own patches of the pool node
    fleet_records = _all_records(fleet, result)
    evidence = RunEvidence.read(tmp_path / "reports" / result.run_id)
    [node] = evidence.pool_nodes
    recorded = dedup(timeline.upgrade_states(evidence.records, node))
    last_s = max(r.received_wall_ns for r in evidence.records) / 1e9
    patched = dedup(operator_set_states(fleet_records, node, until_s=last_s))
    assert patched and "upgrade-done" in patched, patched
    assert is_subsequence(patched, recorded), f"operator set {patched}; recorder saw {recorded}"

    diff = wait_restored(kube, before)
    assert not diff, "\n".join(diff)
    assert not outside(result.records, run_scope(result))


def _all_records(fleet, result):
    from testbed.audit import read_log
    return read_log(fleet.layout.audit_log, since_s=result.since_s, until_s=result.until_s)
