"""`gpucanary widen` on a fleet of its own (four KWOK GPU nodes of one NVIDIADriver), with the real GPU
Operator doing every upgrade: no write without a passing verdict; a sweep killed mid-wave and resumed from
the cluster passes every wave, with its service under load and judged on an SLO of the ingress' own counters,
and customer start probes through each wave; the field note's policy fails its first wave on the service it
evicts and leaves every later node held on the old driver, and `gpucanary cleanup` rolls the sweep back; start
probes too slow for their limit halt a sweep. Every command acts as widen's own ServiceAccount under deploy/'s
RBAC and admission policies.

The verdict a sweep needs is written here as a canary run records it (`publish.record`): what a canary run
records is the canary's own e2e (test_canary_gate); what is proved here is what widen does with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from kubernetes.client.exceptions import ApiException

from pytest_gpucanary.canary import publish

from pytest_gpucanary.canary.load import LoadRun
from pytest_gpucanary.canary.metrics import Prometheus
from pytest_gpucanary.cluster import operator_release
from pytest_gpucanary.fleet.layout import FleetLayout
from pytest_gpucanary.gpu_operator import NVIDIADRIVER, SKIP_LABEL, UPGRADE_STATE_LABEL, driver_version_of
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import Conflict
from pytest_gpucanary.policy.parse import load_policy
from pytest_gpucanary.receipt.verdict import Verdict, VerdictKey
from pytest_gpucanary.shipped import FIXTURES, REPO_ROOT
from harness import CLI, TARGET, eventually, gpucanary, second_fleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NODES = [f"gpu-node-{i}" for i in range(4)]
DRIVER = "fleet"
FAST = ["--soak-s=10", "--wave-budget-s=600"]
# the share of the service's requests the fleet's ingress did not answer 200, by its own counters; no requests
# at all gives no series, which fails a wave too (a service that is not under load is not watched)
API_ERRORS = ('(sum(rate(gpucanary_ingress_requests_total{service="api-2",code!="200"}[1m])) or vector(0)) '
              '/ sum(rate(gpucanary_ingress_requests_total{service="api-2"}[1m])) < 0.01')


@pytest.fixture(scope="module")
def widen_fleet(gpucanary_fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    yield from second_fleet("widen", tmp_path_factory.mktemp("widen-fleet"), gpucanary_fleet,
                            GPUCANARY_FLEET_GPU_NODES=str(len(NODES)), GPUCANARY_FLEET_KUBELET_NODES="0")


@pytest.fixture
def kube(widen_fleet: dict[str, str]) -> Kube:
    return Kube.connect(widen_fleet["KUBECONFIG_PATH"])


@pytest.fixture(scope="module")
def as_widen(widen_fleet: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The options that make a command act as widen's own ServiceAccount (gpucanary/gpucanary-widen, with a
    TokenRequest token), once deploy/'s RBAC and admission policies are in force on the widen fleet: the
    apiserver refuses it what they refuse, first of all the fleet's NVIDIADriver until it is marked for widen."""
    kube = Kube.connect(widen_fleet["KUBECONFIG_PATH"])
    for name in ("rbac.yaml", "rbac-widen.yaml", "admission.yaml"):
        for doc in yaml.safe_load_all((REPO_ROOT / "deploy" / name).read_text()):
            try:
                kube.create(doc)
            except Conflict:
                pass
    config = yaml.safe_load(Path(widen_fleet["KUBECONFIG_PATH"]).read_text())
    config["users"] = [{"name": "gpucanary-widen", "user": {
        "token": kube.request_token("gpucanary-widen", namespace="gpucanary", expiration_s=7200)}}]
    config["contexts"][0]["context"]["user"] = "gpucanary-widen"
    path = tmp_path_factory.mktemp("widen-account") / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    widen = Kube.connect(path)
    # the apiserver enforces a new policy once its informer has it
    assert eventually(lambda: version_change_refused(widen), timeout_s=30, every_s=0.5), \
        "deploy/admission.yaml not in force after 30 s"
    layout = FleetLayout(root=Path(widen_fleet["GPUCANARY_FLEET_DIR"]),
                         port_base=int(widen_fleet["GPUCANARY_FLEET_PORT_BASE"]))
    return [f"--gpucanary-kubeconfig={path}", f"--gpucanary-prometheus-url={layout.prometheus_url}"]


def version_change_refused(kube: Kube) -> bool:
    """Whether the apiserver refuses `kube` a new version on the fleet's NVIDIADriver (asked as a dry run)."""
    try:
        kube.dynamic.patch(kube.dynamic.resources.get(api_version=NVIDIADRIVER[0], kind=NVIDIADRIVER[1]), name=DRIVER,
                           body={"spec": {"version": TARGET}}, dry_run="All",
                           content_type="application/merge-patch+json")
    except ApiException as exc:
        if exc.status == 403:
            return True
        raise
    return False


def policy_file(tmp_path: Path, source: str, **changes: object) -> Path:
    """A fixture policy with some upgradePolicy fields changed (every node of a wave at once, for speed)."""
    doc = yaml.safe_load((FIXTURES / "policies" / source).read_text())
    doc["spec"]["driver"]["upgradePolicy"].update(changes)
    path = tmp_path / source
    path.write_text(yaml.safe_dump(doc))
    return path


def record_verdict(kube: Kube, policy: Path, target: str, *, passed: bool) -> None:
    key = VerdictKey.of(load_policy(policy).to_cr(), target, operator_release(kube))
    assert publish.record(kube, Verdict(key, passed, "canary-e2e", time.time_ns(), "" if passed else "application",
                                        {"rollout": "pass", "application": "pass" if passed else "fail"}))


def driver_version(kube: Kube) -> str:
    return kube.get(*NVIDIADRIVER, DRIVER)["spec"]["version"]


def nodes_now(kube: Kube) -> dict[str, tuple[str, str | None, str]]:
    """node -> (upgrade state, skip label, its driver pod's version)"""
    drivers = {p["spec"]["nodeName"]: driver_version_of(p)
               for p in kube.list("v1", "Pod", label_selector="app.kubernetes.io/component=nvidia-driver")
               if not p["metadata"].get("deletionTimestamp")}
    return {name: ((labels := kube.get("v1", "Node", name)["metadata"].get("labels") or {}).get(UPGRADE_STATE_LABEL, ""),
                   labels.get(SKIP_LABEL), drivers.get(name, "")) for name in NODES}


def sweep_record(kube: Kube) -> list[dict]:
    return [json.loads(cm["data"]["sweep"]) for cm in kube.list("v1", "ConfigMap", namespace="gpucanary")
            if cm["metadata"]["name"].startswith("gpucanary-widen-")]


def widen_args(policy: Path, target: str, reports: Path, *extra: str) -> list[str]:
    return ["widen", f"--gpucanary-policy={policy}", f"--gpucanary-driver-version={target}",
            f"--gpucanary-reports-dir={reports}", *FAST, *extra]


def test_widen_without_a_passing_verdict_or_the_administrators_mark_refuses_before_any_write(
        widen_fleet: dict[str, str], kube: Kube, as_widen: list[str], tmp_path: Path) -> None:
    policy = policy_file(tmp_path, "default.yaml")
    before = (kube.get(*NVIDIADRIVER, DRIVER)["metadata"]["resourceVersion"],
              [kube.get("v1", "Node", n)["metadata"]["resourceVersion"] for n in NODES])
    none = gpucanary(*widen_args(policy, TARGET, tmp_path), *as_widen, env=widen_fleet)
    assert none.returncode == 1, none.stderr
    assert none.stderr.strip().splitlines() == [
        f"gpucanary: hold: no canary verdict for {load_key(kube, policy, TARGET).describe()}: run the canary "
        "with exactly this policy and target"]
    record_verdict(kube, policy, TARGET, passed=False)
    failed = gpucanary(*widen_args(policy, TARGET, tmp_path), *as_widen, env=widen_fleet)
    assert failed.returncode == 1 and failed.stderr.startswith("gpucanary: hold: the canary failed: "), failed.stderr
    record_verdict(kube, policy, TARGET, passed=True)
    unreadable = gpucanary(*widen_args(policy, TARGET, tmp_path, "--slo=sum(rate(nope[1m]) < 1"),
                           *as_widen, env=widen_fleet)
    assert unreadable.returncode == 6, unreadable.stderr
    assert unreadable.stderr.startswith("gpucanary: error: SLO `sum(rate(nope[1m]) < 1` cannot be read: Prometheus at "
                                        "http://127.0.0.1:"), unreadable.stderr
    unmarked = gpucanary(*widen_args(policy, TARGET, tmp_path), *as_widen, env=widen_fleet)
    assert unmarked.returncode == 4, unmarked.stderr
    assert unmarked.stderr.strip().splitlines() == [
        f"gpucanary: error: NVIDIADriver {DRIVER} is not marked for gpucanary widen (no gpucanary.io/widen-eligible=true); "
        "an administrator marks the NVIDIADrivers a sweep may roll out: kubectl label nvidiadriver fleet "
        "gpucanary.io/widen-eligible=true"], unmarked.stderr
    after = (kube.get(*NVIDIADRIVER, DRIVER)["metadata"]["resourceVersion"],
             [kube.get("v1", "Node", n)["metadata"]["resourceVersion"] for n in NODES])
    assert after == before and not sweep_record(kube)
    assert not [ns for ns in kube.list("v1", "Namespace") if ns["metadata"]["name"].startswith("gpucanary-widen")]
    mark_for_widen(kube)
    assert not version_change_refused(Kube.connect(as_widen[0].split("=", 1)[1]))   # the mark lets widen's token


def mark_for_widen(kube: Kube) -> None:
    """What an administrator does once: the fleet's NVIDIADriver may be rolled out by `gpucanary widen`."""
    kube.patch(*NVIDIADRIVER, DRIVER, {"metadata": {"labels": {"gpucanary.io/widen-eligible": "true"}}})


def load_key(kube: Kube, policy: Path, target: str) -> VerdictKey:
    return VerdictKey.of(load_policy(policy).to_cr(), target, operator_release(kube))


def deployment(name: str, spec: dict, *, node: str = NODES[0]) -> dict:
    """One replica on one node, as a customer's would be: managed, so a drain may evict it."""
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "default"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, **spec}}}}


SERVICE_SPEC = {"containers": [{"name": "api", "image": "registry.k8s.io/pause:3.10"}]}
# PyTorch's /dev/shm: the field note's pod deletion (deleteEmptyDir false) refuses it, so its drain fallback runs
TRAINER_SPEC = {"volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
                "containers": [{"name": "train", "image": "registry.k8s.io/pause:3.10",
                                "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
                                "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}


def place(kube: Kube, node: str, service: str, trainer: str) -> None:
    """A service that uses no GPU, with its Service (the fleet's ingress routes to it), and a GPU trainer on
    `node`, both running."""
    kube.create(deployment(service, SERVICE_SPEC, node=node))
    kube.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": service, "namespace": "default"},
                 "spec": {"selector": {"app": service}, "ports": [{"port": 80}]}})
    kube.create(deployment(trainer, TRAINER_SPEC, node=node))
    kube.watch_until("v1", "Pod", lambda pods: True if {p["metadata"]["labels"]["app"] for p in pods.values()
                                                        if p.get("status", {}).get("phase") == "Running"}
                     >= {service, trainer} else None, timeout_s=120, namespace="default")


def test_a_sweep_killed_mid_wave_resumes_from_the_cluster_and_passes_in_two_waves(
        widen_fleet: dict[str, str], kube: Kube, as_widen: list[str], tmp_path: Path) -> None:
    mark_for_widen(kube)
    policy = policy_file(tmp_path, "default.yaml", maxParallelUpgrades=0, maxUnavailable="100%")
    before = driver_version(kube)
    target = TARGET
    record_verdict(kube, policy, target, passed=True)
    place(kube, NODES[2], "api-2", "trainer-2")      # the default policy deletes GPU pods only
    layout = FleetLayout(root=Path(widen_fleet["GPUCANARY_FLEET_DIR"]),
                         port_base=int(widen_fleet["GPUCANARY_FLEET_PORT_BASE"]))
    load = LoadRun(f"http://127.0.0.1:{layout.port('ingress')}/svc/default/api-2", users=2, run_time_s=1200,
                   wait_s=0.5, log_dir=tmp_path / "load").start()      # customers of the service, the whole sweep
    try:
        # two scrapes of the ingress with requests in them
        assert eventually(lambda: Prometheus(layout.prometheus_url).query(API_ERRORS.rsplit(" < ", 1)[0]),
                          timeout_s=90, every_s=2), f"no series for the service's error ratio; {load.output_path}"
        sweep_killed_and_resumed(widen_fleet, kube, as_widen, tmp_path, policy, before, target)
    finally:
        load.stop()
    samples = load.samples()
    assert len(samples) > 100 and all(s.ok for s in samples), [s for s in samples if not s.ok][:5]


def sweep_killed_and_resumed(widen_fleet: dict[str, str], kube: Kube, as_widen: list[str], tmp_path: Path,
                             policy: Path, before: str, target: str) -> None:
    args = widen_args(policy, target, tmp_path / "reports", "--waves=fixed:2", f"--slo={API_ERRORS}", *as_widen)
    proc = subprocess.Popen([*CLI, *args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **widen_fleet, "PYTHONUNBUFFERED": "1"})
    said = []
    assert proc.stderr is not None
    for line in proc.stderr:
        said.append(line)
        if line.startswith("widen: wave 1/2: released gpu-node-0, gpu-node-1"):
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert said and said[-1].startswith("widen: wave 1/2: released"), "".join(said)
    held = nodes_now(kube)
    assert driver_version(kube) == target
    assert all(held[n][1] == "true" and held[n][2] == before for n in NODES[2:]), held   # wave 2 held on the old driver
    resumed = gpucanary(*args, "--resume", env=widen_fleet)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    lines = resumed.stderr.splitlines()
    assert any(line.startswith("widen: resuming sweep widen-") and "at wave 1/2" in line for line in lines), lines
    passed = [line for line in lines if line.startswith("widen: wave") and " passed: " in line]
    assert [line.split("; ")[0] for line in passed] == [
        "widen: wave 1/2 passed: 2 nodes, 0 GPU pods and 0 other pods removed",
        "widen: wave 2/2 passed: 2 nodes, 1 GPU pod and 0 other pods removed"], passed
    assert nodes_now(kube) == {n: ("upgrade-done", None, target) for n in NODES}
    assert "gpucanary.io/saved-spec" not in (kube.get(*NVIDIADRIVER, DRIVER)["metadata"].get("annotations") or {})
    [record] = sweep_record(kube)
    assert record["status"] == "done" and [w["outcome"] for w in record["waves"]] == ["passed", "passed"]
    for wave, line in zip(record["waves"], passed):    # customer starts measured through each wave, by the resumed sweep
        started = int(wave["probes"].split(" start probe")[0])
        assert started >= 3 and line.endswith(f"; {wave['probes']}"), (wave["probes"], line)
    assert not [ns for ns in kube.list("v1", "Namespace") if ns["metadata"]["name"] == f"gpucanary-{record['run_id']}"
                and not ns["metadata"].get("deletionTimestamp")]       # the probes' namespace: gone or going
    assert [w["nodes"] for w in record["waves"]] == [NODES[:2], NODES[2:]]
    wave_2 = record["waves"][1]
    assert wave_2["started_wall_ns"] >= record["waves"][0]["ended_wall_ns"], "wave 2 released after wave 1 passed"
    assert not [ns for ns in kube.list("v1", "Namespace") if ns["metadata"]["name"] == f"gpucanary-{record['run_id']}-owner"
                and not ns["metadata"].get("deletionTimestamp")]       # its Lease's namespace: gone or going
    run_dir = tmp_path / "reports" / record["run_id"]
    junit = (run_dir / "widen-junit.xml").read_text()
    assert junit.count("<testcase ") == 2 and "<failure" not in junit
    assert json.loads((run_dir / "widen.json").read_text())["headline"] == "widen done: 2/2 waves passed, 4 nodes"
    assert "wave 2: passed" in (run_dir / "widen.html").read_text()


def test_the_field_note_policy_fails_its_first_wave_on_the_evicted_service_and_holds_the_rest(
        widen_fleet: dict[str, str], kube: Kube, as_widen: list[str], tmp_path: Path) -> None:
    mark_for_widen(kube)
    before = driver_version(kube)
    target = "580.95.06"
    policy = policy_file(tmp_path, "field-note.yaml", maxParallelUpgrades=0, maxUnavailable="100%")
    record_verdict(kube, policy, target, passed=True)
    place(kube, NODES[0], "sched-api", "trainer")
    result = gpucanary(*widen_args(policy, target, tmp_path / "reports", "--waves=fixed:1", *as_widen), env=widen_fleet)
    assert result.returncode == 1, result.stderr[-4000:]
    halted = [line for line in result.stderr.splitlines() if line.startswith("widen: halted: ")]
    assert len(halted) == 1 and halted[0].startswith("widen: halted: wave 1/4: pod that uses no GPU default/sched-api-")
    assert halted[0].endswith(f"deleted on {NODES[0]}, not an allowed eviction; 3 nodes stay on driver {before}"), halted
    now = nodes_now(kube)
    assert all(now[n] == ("upgrade-required", "true", before) for n in NODES[1:]), now
    [record] = [r for r in sweep_record(kube) if r["key"]["target"] == target]
    assert record["status"] == "halted"
    assert [w["outcome"] for w in record["waves"]] == ["failed", "pending", "pending", "pending"]
    junit = (tmp_path / "reports" / record["run_id"] / "widen-junit.xml").read_text()
    assert junit.count("<failure") == 1 and junit.count("<skipped") == 3
    again = gpucanary(*widen_args(policy, target, tmp_path / "reports", "--waves=fixed:1", *as_widen), env=widen_fleet)
    assert again.returncode == 6 and f"sweep {record['run_id']} of this change is halted" in again.stderr, again.stderr
    cleanup = gpucanary("cleanup", f"--run-id={record['run_id']}", "--force",
                        as_widen[0].replace("--gpucanary-kubeconfig=", "--kubeconfig="), env=widen_fleet)
    assert cleanup.returncode == 0, cleanup.stderr[-3000:]
    assert driver_version(kube) == before
    assert all(kube.get("v1", "Node", n)["metadata"].get("labels", {}).get(SKIP_LABEL) is None for n in NODES)
    assert f"run {record['run_id']}: nothing of it is left on the cluster" in cleanup.stderr


def test_a_wave_whose_customer_starts_are_too_slow_halts_the_sweep(
        widen_fleet: dict[str, str], kube: Kube, as_widen: list[str], tmp_path: Path) -> None:
    """The start probes judge a wave as it rolls: a limit no pod start can meet (0.5 s from the Job's creation to
    its pod running) halts the first wave on them, with the rest held."""
    mark_for_widen(kube)
    before = driver_version(kube)
    settled = {n: ("upgrade-done", None, before) for n in NODES}
    # an earlier test's roll-back may still take a node back to `before`
    assert eventually(lambda: nodes_now(kube) == settled, timeout_s=600, every_s=2), \
        f"the fleet did not settle on driver {before}: {nodes_now(kube)}"
    target = "580.95.07"
    policy = policy_file(tmp_path, "default.yaml", maxParallelUpgrades=0, maxUnavailable="100%")
    record_verdict(kube, policy, target, passed=True)
    result = gpucanary(*widen_args(policy, target, tmp_path / "reports", "--waves=fixed:1",
                                   "--gpucanary-max-start-latency-s=0.5", *as_widen), env=widen_fleet)
    assert result.returncode == 1, result.stderr[-4000:]
    [halted] = [line for line in result.stderr.splitlines() if line.startswith("widen: halted: ")]
    assert halted.startswith("widen: halted: wave 1/4: start probes' p99 start latency "), halted
    assert halted.endswith(f"over --gpucanary-max-start-latency-s 0.5 s; 3 nodes stay on driver {before}"), halted
    [record] = [r for r in sweep_record(kube) if r["key"]["target"] == target]
    assert [w["outcome"] for w in record["waves"]] == ["failed", "pending", "pending", "pending"]
    assert record["waves"][0]["probes"].startswith(("0 start probes ran", "1 start probe ran")), record["waves"][0]
    cleanup = gpucanary("cleanup", f"--run-id={record['run_id']}", "--force",
                        as_widen[0].replace("--gpucanary-kubeconfig=", "--kubeconfig="), env=widen_fleet)
    assert cleanup.returncode == 0, cleanup.stderr[-3000:]
    assert driver_version(kube) == before
    assert f"run {record['run_id']}: nothing of it is left on the cluster" in cleanup.stderr
