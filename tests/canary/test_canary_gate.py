"""The shipped gate, end to end on the local fleet with the real GPU Operator.

Each run goes through `gpucanary run` in a subprocess, as CI would call it. The two policies of
the field note: GPU pod deletion allowed to remove the job's /dev/shm emptyDir (gate passes), and
pod deletion refusing it with a drain fallback that evicts the non-GPU service (gate fails at
application). Runs are sequential: this operator version reads one policy for the whole cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any, Iterator

import canary_process
import pytest
from harness import (
    CLI,
    FAST,
    KEEP_FLEET,
    TARGET,
    assert_nothing_left,
    eventually,
    eventually_nothing_left,
    gpucanary,
    live,
    port_beside_session,
    receipt_of,
    unbuffered,
)

from pytest_gpucanary.canary.load import sigint_default
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.policy.parse import load_policy
from pytest_gpucanary.shipped import FIXTURES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def assert_replay_reproduces(reports: Path, *, returncode: int) -> None:
    """`gpucanary evaluate` judges the recorded run again, offline, and gets exactly the run's verdicts."""
    [run_dir] = [p for p in reports.iterdir() if p.is_dir()]
    before = json.loads((run_dir / "receipt.json").read_text())
    blanked = {**before, "verdicts": [], "first_failed": None, "evictions": []}   # only its thresholds are read
    (run_dir / "receipt.json").write_text(json.dumps(blanked))
    replayed = gpucanary("evaluate", str(run_dir), env=KEEP_FLEET, reports=reports)
    assert replayed.returncode == returncode, replayed.stderr[-2000:]
    again = json.loads((run_dir / "receipt.json").read_text())
    assert again["verdicts"] == before["verdicts"] and again["first_failed"] == before["first_failed"]
    assert again["evictions"] == before["evictions"] and again["thresholds"] == before["thresholds"]
    if returncode == 0:  # the recorded load, cut by phase again, judged with a p99 no service meets: fails
        stricter = gpucanary("evaluate", str(run_dir), "--gpucanary-max-p99-s=0.000001", env=KEEP_FLEET,
                             reports=reports)
        assert stricter.returncode == 1, stricter.stderr[-2000:]
        assert json.loads((run_dir / "receipt.json").read_text())["first_failed"] == "application"
        p99 = f"--gpucanary-max-p99-s={before['thresholds']['max_p99_s']}"
        assert gpucanary("evaluate", str(run_dir), p99, env=KEEP_FLEET, reports=reports).returncode == 0


def run_until_applied(*args: str, reports: Path, **popen: Any) -> tuple[subprocess.Popen[str], list[str]]:
    """A run of the default policy with `args`, followed until it has applied the policy (`canary_process`)."""
    return canary_process.run_until_applied([f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                                             f"--gpucanary-driver-version={TARGET}", *FAST, *args,
                                             f"--gpucanary-reports-dir={reports}"], env=unbuffered(), **popen)


def killed_once_applied(*args: str, reports: Path) -> list[str]:
    """`run_until_applied`, then SIGKILL (no chance to clean up); the lines it printed."""
    proc, seen = run_until_applied(*args, reports=reports, start_new_session=True)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return seen


def test_gate_passes_when_gpu_pod_deletion_may_remove_the_shm_emptydir(
        gpucanary_fleet, kube: Kube, tmp_path: Path, policy_before: dict) -> None:
    """Given as Helm values: real Helm renders them with the release's chart, and the run applies exactly
    the upgradePolicy of the ClusterPolicy it renders, the same as default.yaml's (the CR form)."""
    result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'helm-values.yaml'}",
                       f"--gpucanary-driver-version={TARGET}", *FAST, f"--junitxml={tmp_path / 'junit.xml'}",
                       env=KEEP_FLEET, reports=tmp_path / "reports")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    receipt = receipt_of(tmp_path / "reports")
    assert receipt["gate_passed"] is True
    outcomes = {v["stage"]: v["outcome"] for v in receipt["verdicts"]}
    assert outcomes == {"rollout": "pass", "device": "pass", "network": "skipped", "scheduler": "pass",
                        "application": "pass"}, receipt["verdicts"]
    network = next(v for v in receipt["verdicts"] if v["stage"] == "network")
    assert network["summary"].startswith("network: no GPU networking configured on the 1-node pool")
    assert receipt["run"]["upgrade_policy"] == load_policy(FIXTURES / "policies" / "default.yaml").to_cr()
    assert receipt["run"]["policy_rendering"], "the receipt shows what Helm rendered"
    junit = (tmp_path / "junit.xml").read_text()
    assert f'name="gpucanary_driver_to" value="{TARGET}"' in junit and 'name="gpucanary_stage:' in junit
    assert_device_evidence_is_from_after_the_new_driver(tmp_path / "reports", receipt)
    assert_baseline_held_and_settle_ended_on_its_events(tmp_path / "reports", receipt, result.stdout + result.stderr)
    assert_nothing_left(kube, policy_before)
    assert_replay_reproduces(tmp_path / "reports", returncode=0)
    assert "verdict recorded in ConfigMap gpucanary/gpucanary-verdict-" in result.stdout
    proceed = verdict("default.yaml")      # the CR the run's Helm values render: the same policy
    assert proceed.returncode == 0, proceed.stderr
    assert json.loads(proceed.stdout)["run_id"] == receipt["run"]["run_id"]
    assert proceed.stderr.startswith(f"gpucanary: proceed: run {receipt['run']['run_id']} passed at ")
    other = verdict("default.yaml", target="580.95.06")
    assert other.returncode == 1 and json.loads(other.stdout) is None, other.stderr
    assert other.stderr.startswith("gpucanary: hold: no canary verdict for policy sha256:"), other.stderr


def verdict(policy: str, *, target: str = TARGET) -> subprocess.CompletedProcess[str]:
    return gpucanary("verdict", f"--gpucanary-policy={FIXTURES / 'policies' / policy}",
                     f"--gpucanary-driver-version={target}", env=KEEP_FLEET, reports=Path("."), timeout_s=120)


def assert_baseline_held_and_settle_ended_on_its_events(reports: Path, receipt: dict, output: str) -> None:
    """The before phase spans the whole baseline window (10 s in FAST), and the settle step's wait for the
    probes in flight ended because they had run or ended, not at its bound."""
    [run_dir] = [p for p in reports.iterdir() if p.is_dir()]
    assert json.loads((run_dir / "steps.json").read_text())["seconds"]["baseline"] >= 10
    before = next(w for w in receipt["phase_windows"] if w["phase"] == "before")
    assert (before["end_wall_ns"] - before["start_wall_ns"]) / 1e9 >= 10, before
    assert "every probe in flight running or ended not seen within" not in output


def first_ready_ns(reports: Path) -> dict[str, tuple[str, int]]:
    """Straight from the recorded timeline: each operator pod's (app, first time seen Running and all ready)."""
    [run_dir] = [p for p in reports.iterdir() if p.is_dir()]
    ready: dict[str, tuple[str, int]] = {}
    for line in (run_dir / "timeline.jsonl").read_text().splitlines():
        record = json.loads(line)
        pod = record["object"]
        if record["kind"] != "Pod" or "metadata" not in pod:     # a relist's marker has no object
            continue
        statuses = pod.get("status", {}).get("containerStatuses") or []
        if (pod["metadata"].get("namespace") == "gpu-operator"
                and pod["status"].get("phase") == "Running" and statuses and all(s["ready"] for s in statuses)):
            labels = pod["metadata"].get("labels", {})
            app = "driver" if labels.get("app.kubernetes.io/component") == "nvidia-driver" else labels.get("app", "")
            images = " ".join(s.get("image", "") for s in statuses)
            ready.setdefault(pod["metadata"]["name"], (f"{app}@{TARGET}" if TARGET in images else app,
                                                       record["received_wall_ns"]))
    return ready


def assert_device_evidence_is_from_after_the_new_driver(reports: Path, receipt: dict) -> None:
    """The device stage passed, and the validator and device plugin it cites came up after the new driver
    pod (the fleet's driver manager removed the old ones); the GPUs left allocatable and came back."""
    device = next(v for v in receipt["verdicts"] if v["stage"] == "device")
    assert device["summary"].startswith(f"device: 1/1 pool nodes: driver {TARGET} Ready, then validator and device "
                                        "plugin Ready; GPUs gone at most "), device["summary"]
    ready = first_ready_ns(reports).values()
    [driver_ns] = [at for app, at in ready if app == f"driver@{TARGET}"]
    for app in ("nvidia-operator-validator", "nvidia-device-plugin-daemonset"):
        assert any(a == app and at > driver_ns for a, at in ready), f"no {app} pod Ready after the new driver"
    [capacity] = receipt["capacity"]
    assert capacity["before"] == 8 and capacity["lowest"] == 0 and capacity["after"] == 8, capacity
    assert 0 < capacity["left_s"] < capacity["back_s"] and capacity["gone_s"] > 0, capacity


def test_gate_fails_at_application_naming_the_drained_non_gpu_pod(
        gpucanary_fleet, kube: Kube, tmp_path: Path, policy_before: dict) -> None:
    result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'field-note.yaml'}",
                       f"--gpucanary-driver-version={TARGET}", *FAST, env=KEEP_FLEET, reports=tmp_path / "reports")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    receipt = receipt_of(tmp_path / "reports")
    assert receipt["gate_passed"] is False and receipt["first_failed"] == "application"
    application = next(v for v in receipt["verdicts"] if v["stage"] == "application")
    assert application["summary"].startswith("application: non-GPU pod gpucanary-")
    assert "/sched-api-" in application["summary"] and "evicted by drain" in application["summary"]
    assert "(allowed: GPU pods only)" in application["summary"]
    assert "application: non-GPU pod gpucanary-" in result.stdout      # the failing test's first line
    load = {e["ref"].rsplit("@", 1)[1]: e["text"] for e in application["evidence"] if e["kind"] == "LoadStats"}
    failed = {phase: int(text.split(" requests, ")[1].split(" failed")[0]) for phase, text in load.items()}
    assert failed["drain"] > 0, load        # customers saw the drain: requests failed while the pod was gone
    assert failed["before"] == 0, load
    assert_nothing_left(kube, policy_before)
    assert_replay_reproduces(tmp_path / "reports", returncode=1)
    held = verdict("field-note.yaml")
    assert held.returncode == 1 and json.loads(held.stdout)["passed"] is False, held.stderr
    assert held.stderr.startswith("gpucanary: hold: the canary failed: run ") and "failed at application" in held.stderr
    [run_dir] = [p for p in (tmp_path / "reports").iterdir() if p.is_dir()]
    assert [line for line in (run_dir / "verdict.prom").read_text().splitlines()
            if line.startswith("gpucanary_verdict_passed{")][0].endswith(
        f'target="{TARGET}",release="{receipt["run"]["operator_release"]}"}} 0')


def test_operator_default_policy_with_the_shm_job_fails_at_rollout_saying_why(
        gpucanary_fleet, kube: Kube, tmp_path: Path, policy_before: dict) -> None:
    result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'operator-default.yaml'}",
                       f"--gpucanary-driver-version={TARGET}", *FAST, env=KEEP_FLEET, reports=tmp_path / "reports")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    receipt = receipt_of(tmp_path / "reports")
    assert receipt["first_failed"] == "rollout"
    rollout = next(v for v in receipt["verdicts"] if v["stage"] == "rollout")
    assert "reached upgrade-failed" in rollout["summary"]
    assert "podDeletion refused GPU pod gpucanary-" in rollout["summary"]
    assert "/gpu-train-" in rollout["summary"] and "emptyDir dshm (podDeletion.deleteEmptyDir=false)" in rollout["summary"]
    [run_dir] = [p for p in (tmp_path / "reports").iterdir() if p.is_dir()]
    waited_s = json.loads((run_dir / "steps.json").read_text())["seconds"]["upgrade"]
    assert waited_s < 420, f"the run stops at the terminal state, not at the end of its 420 s budget: {waited_s} s"
    assert_nothing_left(kube, policy_before)


def test_prometheus_stopped_mid_run_makes_metric_checks_inconclusive_and_fails_the_gate(
        gpucanary_fleet, kube: Kube, tmp_path: Path, policy_before: dict) -> None:
    fleet = gpucanary_fleet.fleet
    config = tmp_path / "prometheus.yml"
    config.write_text((fleet.layout.root / "prometheus.yml").read_text())
    port = port_beside_session("prometheus")     # beside the session fleet's ports, not on a fixed number
    prometheus = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
    try:
        from pytest_gpucanary.canary import metrics

        # the run's preflight wants every series the checks read
        ready = eventually(lambda: not metrics.missing_series(f"http://127.0.0.1:{port}"), timeout_s=120, every_s=2)
        assert ready, metrics.missing_series(f"http://127.0.0.1:{port}")
        proc = subprocess.Popen([*CLI, "run",
                                 f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                                 f"--gpucanary-driver-version={TARGET}", *FAST,
                                 f"--gpucanary-prometheus-url=http://127.0.0.1:{port}",
                                 f"--gpucanary-reports-dir={tmp_path / 'reports'}"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=unbuffered())
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "applied; upgrading the pool" in line:
                prometheus.terminate()  # Prometheus goes away in the middle of the upgrade
        proc.wait(timeout=60)
    finally:
        prometheus.kill()
    output = "".join(seen)
    assert proc.returncode == 1, output[-3000:]
    receipt = receipt_of(tmp_path / "reports")
    assert receipt["gate_passed"] is False
    outcomes = {v["stage"]: v["outcome"] for v in receipt["verdicts"]}
    assert outcomes["rollout"] == "inconclusive" and outcomes["device"] == "inconclusive", receipt["verdicts"]
    assert receipt["first_failed"] == "rollout"
    assert_nothing_left(kube, policy_before)


def test_malformed_policy_is_refused_in_one_line_and_changes_nothing(
        gpucanary_fleet, kube: Kube, tmp_path: Path, policy_before: dict) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("apiVersion: nvidia.com/v1\nkind: ClusterPolicy\nspec:\n  driver: [unclosed\n")
    result = gpucanary("run", f"--gpucanary-policy={broken}", f"--gpucanary-driver-version={TARGET}",
                       env=KEEP_FLEET, reports=tmp_path / "reports", timeout_s=120)
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert str(broken) in result.stdout + result.stderr
    assert_nothing_left(kube, policy_before)


def test_unknown_pool_node_is_refused_in_one_line(gpucanary_fleet, kube: Kube, tmp_path: Path,
                                                   policy_before: dict) -> None:
    result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                       f"--gpucanary-driver-version={TARGET}", "--gpucanary-pool-provider=existing",
                       "--gpucanary-pool-node=no-such-node", env=KEEP_FLEET, reports=tmp_path / "reports",
                       timeout_s=120)
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    assert "node 'no-such-node' does not exist" in result.stdout + result.stderr
    assert_nothing_left(kube, policy_before)


def test_unreachable_cluster_is_an_environment_error(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'https://127.0.0.1:9'}\n"
                          "users:\n- name: u\n  user: {token: x}\ncontexts:\n- name: c\n  context: {cluster: c, user: u}\n"
                          "current-context: c\n")
    result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                       f"--gpucanary-driver-version={TARGET}", f"--gpucanary-kubeconfig={kubeconfig}",
                       env=KEEP_FLEET, reports=tmp_path / "reports", timeout_s=120)
    assert result.returncode == 6, result.stdout[-2000:] + result.stderr[-2000:]
    assert "cannot reach the apiserver" in result.stdout


def test_interrupted_run_restores_everything_also_through_a_second_signal(
        gpucanary_fleet, kube: Kube, tmp_path: Path, policy_before: dict) -> None:
    """Ctrl-C, then Ctrl-C again; SIGTERM takes the same handler (tests/canary/test_run_waits.py), and one during
    the restore is test_faults.py's restoring-sigterm case."""
    sig = signal.SIGINT
    proc, seen = run_until_applied(reports=tmp_path / "reports",
                                   preexec_fn=sigint_default)     # as from a terminal, whatever this process inherited
    assert proc.stdout is not None
    proc.send_signal(sig)
    # the second signal goes once the run took the first: sent blind, on a loaded machine both could land before
    # the run's next bytecode, and the kernel keeps one pending signal of a kind, not two
    for line in proc.stdout:
        seen.append(line)
        if f"signal {int(sig)}: stopping the run" in line:
            break
    assert proc.poll() is None, "the run ended as it took the first signal; the second one would prove nothing"
    proc.send_signal(sig)    # a second Ctrl-C, or the CI runner's SIGTERM after it, waits for the restore
    rest, _ = proc.communicate(timeout=180)
    output = "".join(seen) + rest
    assert proc.returncode == 2, output[-3000:]
    assert f"signal {int(sig)} deferred: restoring the cluster first" in output, output[-3000:]
    assert "cleanup done" in output
    assert_nothing_left(kube, policy_before)


def test_cleanup_removes_what_a_killed_run_left(gpucanary_fleet, kube: Kube, tmp_path: Path,
                                                policy_before: dict) -> None:
    run_id = f"killed-{uuid.uuid4().hex[:6]}"
    killed_once_applied(f"--gpucanary-run-id={run_id}", reports=tmp_path / "reports")
    left = [n for n in live(kube.list("v1", "Namespace")) if n.startswith("gpucanary-")]
    assert left
    # a second run given the killed run's pool never adopts what that run left there: refused before its first
    # write (exit 6), naming the cleanup that finishes the killed run
    [pool_node] = [n["metadata"]["name"] for n in kube.list("v1", "Node", label_selector=f"gpucanary.io/run-id={run_id}")]
    second = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                       f"--gpucanary-driver-version={TARGET}", *FAST, "--gpucanary-run-id=second-after-kill",
                       "--gpucanary-pool-provider=existing", f"--gpucanary-pool-node={pool_node}",
                       env=KEEP_FLEET, reports=tmp_path / "second", timeout_s=300)
    assert second.returncode == 6, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"gpucanary cleanup --run-id {run_id}" in second.stdout + second.stderr
    assert [n for n in live(kube.list("v1", "Namespace")) if n.startswith("gpucanary-")] == left
    # its Lease was renewed moments ago: cleanup watches it for a whole duration on its own clock before it calls
    # the run dead (nothing renews it now), takes it over, and restores in the run's own order with its waits
    result = gpucanary("cleanup", "--run-id", run_id, env=KEEP_FLEET, reports=tmp_path)   # as the CI templates call it
    assert result.returncode == 0, result.stderr
    assert f"watching the Lease of {run_id} for 60 s" in result.stderr, result.stderr
    assert f"run {run_id}: nothing of it is left on the cluster" in result.stderr, result.stderr
    eventually_nothing_left(kube, policy_before)


def test_existing_node_pool_is_carved_out_and_restored_exactly(gpucanary_fleet, kube: Kube, tmp_path: Path,
                                                               policy_before: dict) -> None:
    """A standing canary node with an NVIDIADriver of its own, as GPU clouds keep one, used in place; on v26.7 beside
    the fleet's default NVIDIADriver, which drives every other GPU node, and which nothing the run does hands
    a node to or from."""
    from pytest_gpucanary.fleet.kwok_pool import KwokPool, fleet_driver_version

    standing = KwokPool(kube, name=f"standing-{uuid.uuid4().hex[:6]}", run_id="standing")
    [node] = standing.create(driver_version=fleet_driver_version(kube))
    not_ours = {"metadata": {"labels": {"app.kubernetes.io/managed-by": None, "gpucanary.io/run-id": None}}}
    kube.patch("v1", "Node", node, not_ours)  # a node the cluster's owners made, not the canary
    kube.patch("nvidia.com/v1alpha1", "NVIDIADriver", standing.name, not_ours)
    try:
        kube.wait_for("v1", "Node", node, lambda n: n["metadata"]["labels"].get(
            "nvidia.com/gpu-driver-upgrade-state") == "upgrade-done", timeout_s=180)
        standing.wait_for_gpus()      # upgrade-done comes with the pod in sync; GFD's driver labels come after
        kube.patch("v1", "Node", node, {"spec": {"taints": [{"key": "dedicated", "value": "canary",
                                                             "effect": "PreferNoSchedule"}]}})
        before, owners = kube.get("v1", "Node", node), driver_owners(kube)
        if gpucanary_fleet.fleet.layout.default_driver:
            assert kube.get("nvidia.com/v1alpha1", "NVIDIADriver", "fleet")["spec"]["default"] is True
            assert owners[node] == standing.name and set(owners.values()) >= {"fleet", standing.name}, owners
        result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                           f"--gpucanary-driver-version={TARGET}", *FAST, "--gpucanary-pool-provider=existing",
                           f"--gpucanary-pool-node={node}", env=KEEP_FLEET, reports=tmp_path / "reports")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
        # the fleet's operator tolerates the fence (fixtures/fleet), so the carved node was tainted for the run
        assert "pool fenced: gpucanary.io/run=" in result.stdout, result.stdout[-3000:]
        # the canary takes off only its own label, annotation and taint; GFD's driver labels follow the driver pod back
        # (the fleet's node agent writes them), a moment after the run gave the node back
        with contextlib.suppress(TimeoutError):
            kube.wait_for("v1", "Node", node, lambda n: n["metadata"]["labels"] == before["metadata"]["labels"],
                          timeout_s=180)
        after = kube.get("v1", "Node", node)
        assert after["metadata"]["labels"] == before["metadata"]["labels"]
        assert after["spec"].get("taints") == before["spec"].get("taints")
        assert bool(after["spec"].get("unschedulable")) is False
        assert "gpucanary.io/saved-node-state" not in after["metadata"].get("annotations", {})
        driver = kube.get("nvidia.com/v1alpha1", "NVIDIADriver", standing.name)
        assert driver["spec"]["version"] == fleet_driver_version(kube)
        assert driver_owners(kube) == owners
        assert_nothing_left(kube, policy_before)
    finally:
        standing.delete()


def driver_owners(kube: Kube) -> dict[str, str]:
    """GPU node -> the NVIDIADriver the operator says drives it (v26.7's owner label; empty before)."""
    return {n["metadata"]["name"]: n["metadata"]["labels"]["nvidia.com/gpu-operator.driver.owner"]
            for n in kube.list("v1", "Node", label_selector="nvidia.com/gpu-operator.driver.owner")}


@pytest.fixture
def default_driven_node(gpucanary_fleet, kube: Kube) -> Iterator[str]:
    """A fresh GPU node that no NVIDIADriver of its own picks, so the default one drives it, marked for pools as an
    administrator would; deleted after."""
    from pytest_gpucanary.fleet.kwok_pool import KwokPool

    if not gpucanary_fleet.fleet.layout.default_driver:
        pytest.skip("the fleet runs no default NVIDIADriver (operator before v26.7)")
    loose = KwokPool(kube, name=f"loose-{uuid.uuid4().hex[:6]}", run_id="loose")
    [node] = loose.create(driver_version=None)
    kube.patch("v1", "Node", node, {"metadata": {"labels": {   # a node the cluster's owners made, marked for pools
        "app.kubernetes.io/managed-by": None, "gpucanary.io/run-id": None, "gpucanary.io/kwok-pool": None,
        "gpucanary.io/pool-eligible": "true"}}})
    try:
        kube.wait_for("v1", "Node", node, lambda n: n["metadata"]["labels"].get("nvidia.com/gpu-driver-upgrade-state")
                      == "upgrade-done" and n["metadata"]["labels"].get("nvidia.com/gpu-operator.driver.owner") == "fleet",
                      timeout_s=180)
        loose.wait_for_gpus()
        yield node
    finally:
        loose.delete()


def assert_handed_back(kube: Kube, node: str, before: dict, owners: dict[str, str]) -> None:
    """The node's labels and taints as before, the default NVIDIADriver's driver pod on it, no run's NVIDIADriver."""
    with contextlib.suppress(TimeoutError):   # GFD-style driver labels follow the driver pod back a moment later
        kube.wait_for("v1", "Node", node, lambda n: n["metadata"]["labels"] == before["metadata"]["labels"],
                      timeout_s=180)
    after = kube.get("v1", "Node", node)
    assert after["metadata"]["labels"] == before["metadata"]["labels"]
    assert after["spec"].get("taints") == before["spec"].get("taints")
    assert not [d["metadata"]["name"] for d in kube.list("nvidia.com/v1alpha1", "NVIDIADriver")
                if d["metadata"]["name"].startswith("gpucanary-")]
    assert driver_owners(kube) == owners
    drivers = [p for p in kube.list("v1", "Pod", label_selector="app.kubernetes.io/component=nvidia-driver",
                                    field_selector=f"spec.nodeName={node}") if not p["metadata"].get("deletionTimestamp")]
    assert [p["spec"]["nodeSelector"].get("nvidia.com/gpu-operator.driver.owner") for p in drivers] == ["fleet"]


def test_a_node_of_the_default_nvidiadriver_is_handed_to_the_runs_own_and_back(
        default_driven_node: str, kube: Kube, tmp_path: Path, policy_before: dict, canary_service_account) -> None:
    """A node no NVIDIADriver of its own picks belongs to the default one, whose version is every such node's: the
    run, under the canary's own token and deploy/'s admission policies, hands the node to an NVIDIADriver of its own
    (the default one's copy), waits for that handover's driver pod before the policy, judges only its own upgrade,
    then hands the node back; the operator's owner label and the node's labels end as they began."""
    from pytest_gpucanary.fleet.kwok_pool import fleet_driver_version

    node = default_driven_node
    before, owners = kube.get("v1", "Node", node), driver_owners(kube)
    result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                       f"--gpucanary-driver-version={TARGET}", *FAST, "--gpucanary-pool-provider=existing",
                       f"--gpucanary-pool-node={node}", f"--gpucanary-kubeconfig={canary_service_account()}",
                       env=KEEP_FLEET, reports=tmp_path / "reports")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    receipt = receipt_of(tmp_path / "reports")
    run_id = receipt["run"]["run_id"]
    handed = [line for line in receipt["run"]["pool_setup"] if line.startswith("handed over")]
    assert handed and handed[0].startswith(f"handed over from the default NVIDIADriver fleet to the run's own "
                                           f"gpucanary-{run_id} at driver {fleet_driver_version(kube)} in "), receipt
    assert f"deleted NVIDIADriver gpucanary-{run_id}: the default NVIDIADriver fleet takes the pool back" in result.stdout
    # the upgrade judged is the policy's alone: from the pool's driver to the target, under the run's NVIDIADriver
    assert receipt["run"]["driver_from"] == fleet_driver_version(kube) and receipt["run"]["driver_to"] == TARGET
    assert f"gpucanary-{run_id}" in receipt["run"]["policy_applied_to"], receipt["run"]["policy_applied_to"]
    assert_handed_back(kube, node, before, owners)
    assert_nothing_left(kube, policy_before)


@pytest.mark.kill_matrix     # 6 min of CI's longest file; the run's own handback is in make test (above)
def test_cleanup_hands_a_killed_runs_pool_back_to_the_default_nvidiadriver(
        default_driven_node: str, kube: Kube, tmp_path: Path, policy_before: dict) -> None:
    """Killed mid-upgrade, after the handover: `gpucanary cleanup` deletes the run's NVIDIADriver and waits for the
    default one's driver pod on the node before it takes the run's marks off."""
    node, run_id = default_driven_node, f"killed-{uuid.uuid4().hex[:6]}"
    before, owners = kube.get("v1", "Node", node), driver_owners(kube)
    seen = killed_once_applied(f"--gpucanary-run-id={run_id}", "--gpucanary-pool-provider=existing",
                               f"--gpucanary-pool-node={node}", reports=tmp_path / "reports")
    assert any("pool handed over from the default NVIDIADriver fleet" in line for line in seen), seen[-20:]
    assert driver_owners(kube)[node] == f"gpucanary-{run_id}"
    result = gpucanary("cleanup", "--run-id", run_id, env=KEEP_FLEET, reports=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"deleted NVIDIADriver gpucanary-{run_id}: the default NVIDIADriver fleet takes the pool back" in result.stderr
    assert f"run {run_id}: nothing of it is left on the cluster" in result.stderr, result.stderr
    assert_handed_back(kube, node, before, owners)
    eventually_nothing_left(kube, policy_before)


def test_non_gpu_node_is_refused_as_pool(gpucanary_fleet, kube: Kube, tmp_path: Path, policy_before: dict) -> None:
    result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                       f"--gpucanary-driver-version={TARGET}", "--gpucanary-pool-provider=existing",
                       "--gpucanary-pool-node=cpu-node-0", env=KEEP_FLEET, reports=tmp_path / "reports",
                       timeout_s=120)
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    assert "node cpu-node-0 is not a GPU node" in result.stdout + result.stderr
    assert_nothing_left(kube, policy_before)


def test_existing_node_running_foreign_pods_is_refused(gpucanary_fleet, kube: Kube, namespace: str, tmp_path: Path,
                                                       policy_before: dict) -> None:
    kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "tenant", "namespace": namespace},
                 "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "c", "image": "app"}]}})
    result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                       f"--gpucanary-driver-version={TARGET}", "--gpucanary-pool-provider=existing",
                       "--gpucanary-pool-node=gpu-node-1", env=KEEP_FLEET, reports=tmp_path / "reports",
                       timeout_s=120)
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"node gpu-node-1 runs 1 pods the canary did not put there ({namespace}/tenant...)" in result.stdout
    assert "gpucanary.io/saved-node-state" not in kube.get("v1", "Node", "gpu-node-1")["metadata"].get("annotations", {})
    assert_nothing_left(kube, policy_before)
