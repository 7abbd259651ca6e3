"""What survives what, on the real fleet: a run killed at every step boundary, and control-plane faults.

Each case starts `gpucanary run` as CI would, takes a snapshot of everything the canary may touch
before it (tests/testbed/snapshot.py), interrupts or kills it at one step boundary, and, after the run's own
unwinding (SIGINT, SIGTERM) or after `gpucanary cleanup` without a run id (SIGKILL, crash after a
write), requires the same snapshot again and no write outside the pool, its namespaces and the
policy objects in the audit log (tests/testbed/audit.py `outside`; the cleanup's requests are held to the
dead run's scope too).

A killed run's Lease is shortened to LEASE_S through fault_hooks.LEASE_DURATION_ENV, so that cleanup
without a run id, as an operator would run it, sees the owner gone after seconds, not a minute: cleanup
watches the Lease for that duration on its own clock and calls the run dead when it did not move.

`make test` runs the cases in CI_CASES; `make kill-matrix` runs all of them (GPUCANARY_KILL_MATRIX=1).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from testbed.audit import RunScope, outside, read_log
from testbed.audit_run import CANARY_USER_AGENT, CanaryResult, fence
from testbed.snapshot import differences, run_killed, snapshot
from pytest_gpucanary.gpu_operator import UPGRADE_STATE_LABEL
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.ownership import RUN_ID_LABEL
from pytest_gpucanary.shipped import FIXTURES
import fault_hooks
from harness import TARGET, gpucanary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ARGS = [f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}", f"--gpucanary-driver-version={TARGET}",
        "--gpucanary-probe-interval-s=10", "--gpucanary-job-duration-s=60", "--gpucanary-upgrade-budget-s=420",
        "--gpucanary-max-p99-s=3", "--gpucanary-baseline-s=10"]
LEASE_S = 8
SETTLE_TIMEOUT_S = 240

# Step boundaries: the progress line that starts each one, or the pool node's upgrade state.
LINES = {
    "pool-provisioned": "] pool canary-",
    "workloads-created": "] workloads placed on ",
    "load-started": "] load: ",
    "policy-applied": "applied; upgrading the pool",
    "evaluating": "] evaluating the ladder",
    "restoring": "] restoring the cluster",
}
STATES = ("upgrade-required", "cordon-required", "wait-for-jobs-required", "pod-deletion-required",
          "pod-restart-required", "validation-required", "uncordon-required")
BOUNDARIES = [*list(LINES)[:4], *STATES, *list(LINES)[4:]]
SIGNALS = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}
# in `make test` (each case is one canary run, about 2 min); SIGINT right after the policy is applied, then
# again, is test_canary_gate.py::test_interrupted_run_restores_everything_also_through_a_second_signal already
CI_CASES = {("pod-restart-required", "sigkill"), ("restoring", "sigterm")}


def cases() -> list:
    return [pytest.param(boundary, sig, id=f"{boundary}-{sig}",
                         marks=() if (boundary, sig) in CI_CASES else pytest.mark.kill_matrix)
            for boundary in BOUNDARIES for sig in SIGNALS]


def state_cue(kube: Kube, state: str, fire: Callable[[], None], stop: threading.Event) -> threading.Thread:
    """Fires once the pool node (any node carrying a run id, the run's own) enters `state`: a watch, so a
    state that lasts 0.1 s is still seen, milliseconds after the operator wrote it."""
    def follow() -> None:
        def entered(nodes: dict[str, dict]) -> bool | None:
            return True if any(n["metadata"].get("labels", {}).get(UPGRADE_STATE_LABEL) == state
                               for n in nodes.values()) or stop.is_set() else None
        try:
            kube.watch_until("v1", "Node", entered, timeout_s=900, label_selector=RUN_ID_LABEL)
        except TimeoutError:
            return
        if not stop.is_set():
            fire()
    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    return thread


def cleanup_after_lease(fleet, kube: Kube, run_id: str) -> tuple[subprocess.CompletedProcess[str], list]:
    """`gpucanary cleanup` without a run id: it watches the dead run's Lease for one (shortened) duration itself."""
    since_s = time.time()
    result = gpucanary("cleanup", f"--kubeconfig={fleet.kubeconfig}", unbuffered=False, timeout_s=300)
    until_s = time.time()
    fence(fleet)
    return result, read_log(fleet.layout.audit_log, user_agent_prefix=CANARY_USER_AGENT, since_s=since_s,
                            until_s=until_s)


def wait_restored(kube: Kube, before: dict) -> list[str]:
    """Watch namespaces until the run's are gone (deletion finishes asynchronously); then the differences."""
    try:
        kube.watch_until("v1", "Namespace", lambda nss: True if not [n for n in nss if n.startswith("gpucanary-")]
                         else None, timeout_s=SETTLE_TIMEOUT_S)
    except TimeoutError:
        pass   # reported below as a difference
    return differences(before, snapshot(kube))


def run_scope(result: CanaryResult) -> RunScope:
    created = RunScope(result.run_id, frozenset()).with_creates(result.records)
    pool = frozenset(name for resource, _, name in created.created if resource == "nodes")
    return RunScope(result.run_id, pool, created.created)


def describe(records) -> str:
    return "\n".join(f"{r.verb} {r.request_uri} -> {r.code}" for r in records[:20])


def assert_restored_and_in_scope(gpucanary_fleet, kube: Kube, before: dict, result: CanaryResult,
                                 *, killed: bool) -> None:
    fleet = gpucanary_fleet.fleet
    records = list(result.records)
    if killed:
        cleaned, cleanup_records = cleanup_after_lease(fleet, kube, result.run_id)
        assert cleaned.returncode == 0, cleaned.stdout[-2000:] + cleaned.stderr[-2000:]
        records += cleanup_records
    else:
        assert "cleanup done" in result.output, result.output[-3000:]
    diff = wait_restored(kube, before)
    assert not diff, "\n".join(diff) + "\n" + result.output[-3000:]
    wrote_outside = outside(records, run_scope(result))
    assert not wrote_outside, describe(wrote_outside)


@pytest.mark.parametrize(("boundary", "sig_name"), cases())
def test_a_run_stopped_at_a_step_boundary_leaves_the_cluster_as_it_found_it(
        gpucanary_fleet, kube: Kube, tmp_path: Path, boundary: str, sig_name: str) -> None:
    fleet, sig = gpucanary_fleet.fleet, SIGNALS[sig_name]
    before = snapshot(kube)
    stop = threading.Event()
    fired = threading.Event()
    holder: dict = {}

    if boundary in STATES:
        def fire() -> None:      # the node watch sends the signal itself, within ms of the transition
            fired.set()
            proc = holder["proc"]
            os.killpg(proc.pid, sig) if sig is signal.SIGKILL else proc.send_signal(sig)
        state_cue(kube, boundary, fire, stop)
    result = run_killed(fleet, ARGS, reports=tmp_path / "reports",
                        cue=(lambda line: LINES[boundary] in line) if boundary in LINES else (lambda _: False),
                        sig=sig, env={fault_hooks.LEASE_DURATION_ENV: str(LEASE_S)}, command=fault_hooks.argv(),
                        on_start=lambda proc: holder.__setitem__("proc", proc))
    stop.set()
    sent = f"[test] sending {sig.name}" in result.output or fired.is_set()
    assert sent, f"the run never reached {boundary}:\n{result.output[-3000:]}"
    if sig is not signal.SIGKILL:
        assert result.returncode in (1, 0, 2) and "cleanup done" in result.output, result.output[-3000:]
    assert_restored_and_in_scope(gpucanary_fleet, kube, before, result, killed=sig is signal.SIGKILL)


@pytest.mark.parametrize("crash_after", [
    pytest.param("2:NVIDIADriver", id="after-the-pool-version-patch"),    # write 1 creates the pool's NVIDIADriver
    pytest.param("1:ClusterPolicy", id="after-the-cluster-wide-policy-before-the-version",
                 marks=pytest.mark.kill_matrix),
])
def test_a_run_dying_right_after_a_write_is_restored_by_cleanup(gpucanary_fleet, kube: Kube, tmp_path: Path,
                                                                crash_after: str) -> None:
    """The e2e sample of tests/canary/test_crash_sweep.py: the process ends with os._exit(137) after the
    named write (fault_hooks.CRASH_AFTER_WRITE_ENV), its locust with it, and cleanup puts everything back."""
    before = snapshot(kube)
    result = run_killed(gpucanary_fleet.fleet, ARGS, reports=tmp_path / "reports", cue=lambda _: False,
                        sig=signal.SIGKILL, command=fault_hooks.argv(),
                        env={fault_hooks.LEASE_DURATION_ENV: str(LEASE_S), fault_hooks.CRASH_AFTER_WRITE_ENV: crash_after})
    assert result.returncode == 137, result.output[-3000:]
    assert "cleanup done" not in result.output
    assert_restored_and_in_scope(gpucanary_fleet, kube, before, result, killed=True)
