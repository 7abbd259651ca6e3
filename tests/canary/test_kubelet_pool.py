"""The real kubelet node as the canary's pool, the fleet's default (the test bed's other fleets set
GPUCANARY_FLEET_KUBELET_POOL=0): the real GPU Operator upgrades it, its operands (driver with its
driver manager, validator, device plugin) restart as real pods, and the canary's GPU job and service
run there as processes. The runs here give no pool and no service: the default provider picks the node
and its hostNetwork service, as `make demo` does.

The two policies of the demo, at once on two such nodes (each with its own NVIDIADriver, so its own
policy on v26.7): the field note's on the default pool (pod deletion refuses the job's /dev/shm, the
drain fallback evicts the service) and the default one on the second node, named with
--gpucanary-pool-node (only the GPU job is deleted).

Then upgrades that cannot finish (the tests below the demo's, so after its runs): at once, a driver version
with no image and the canary's own driver holder (`--gpucanary-holder`: a pod that holds the driver without
asking for a GPU); then, at once, a driver container that hangs before it loads and a node whose kubelet
stops during the upgrade. Each must fail at rollout in minutes, naming its cause, and leave its node on the
old driver.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

from pytest_gpucanary.canary.neighbours import NVSENTINEL_LABEL, NVSENTINEL_NAMESPACE
from pytest_gpucanary.fleet import processes
from pytest_gpucanary.fleet.binaries import DEVICE_PLUGIN, NFD_MASTER, NVML_SHIM, find_bin_dir
from pytest_gpucanary.fleet.images import NVML_STATE_PATH, PAUSE_IMAGE
from pytest_gpucanary.fleet.kubelet_node import node_name
from pytest_gpucanary.fleet.layout import FleetLayout
from pytest_gpucanary.gpu_operator import daemonset_node, unplaced
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import NotFound
from pytest_gpucanary.kube.ownership import RUN_ID_LABEL
from pytest_gpucanary.shipped import FIXTURES
from harness import CLI, TARGET, eventually, fast, gpucanary, port_beside_session, second_fleet_env
from harness import node_pod, phase_is
from harness import refused_drain_options

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NODE, SECOND = node_name(0), node_name(1)
PORT_BASE = port_beside_session("kubelet-pool")
STALL_S = 60
# The GPU job must still run when the upgrade reaches pod deletion, or there is nothing for the policy
# to refuse. 150 s costs no time: its pod is deleted or evicted within seconds of the upgrade start, and
# its replacement starts only at the uncordon, past that deadline, on v26.7 ~150 s after the start.
FAST = fast(job_duration_s=150)


def _environment(env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **env, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def pool_fleet(gpucanary_fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("kubelet-pool-fleet").resolve()
    env = second_fleet_env("kubelet-pool", root, gpucanary_fleet, GPUCANARY_FLEET_GPU_NODES="1",
                           GPUCANARY_FLEET_KUBELET_NODES="2", GPUCANARY_FLEET_KUBELET_POOL="")
    up = gpucanary("fleet", "up", timeout_s=600, env=env)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        # the operator labels a node's upgrade state at its next reconcile after the driver pod is Ready
        for node in (NODE, SECOND):
            _kube(env).wait_for("v1", "Node", node, lambda n: n["metadata"]["labels"].get(
                "nvidia.com/gpu-driver-upgrade-state") == "upgrade-done", timeout_s=180)
        yield env
    finally:
        down = gpucanary("fleet", "down", timeout_s=300, env=env)
        assert down.returncode == 0, down.stderr[-2000:]


def _kube(env: dict[str, str]) -> Kube:
    return Kube.connect(Path(env["GPUCANARY_FLEET_DIR"]) / "kubeconfig")


@dataclass
class Run:
    """One `gpucanary run` of a demo policy, as a process; `node` is the pool it must get."""

    policy: str
    node: str
    reports: Path
    args: tuple[str, ...] = ()
    target: str = TARGET
    proc: subprocess.Popen | None = None
    stdout: str = ""
    stderr: str = ""

    def start(self, env: dict[str, str]) -> Run:
        self.proc = subprocess.Popen(
            [*CLI, "run", f"--gpucanary-policy={FIXTURES / 'policies' / self.policy}",
             f"--gpucanary-driver-version={self.target}", *FAST, f"--gpucanary-reports-dir={self.reports}", *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_environment(env))
        return self

    def finish(self, timeout_s: float = 900) -> Run:
        assert self.proc is not None
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.stdout, self.stderr = self.proc.communicate()
        return self

    @property
    def output(self) -> str:
        return self.stdout[-4000:] + self.stderr[-2000:]

    @property
    def receipt(self) -> dict:
        assert f"pool {self.node} (kubelet)" in self.stdout, self.output
        [run_dir] = [p for p in self.reports.iterdir() if p.is_dir()]
        return json.loads((run_dir / "receipt.json").read_text())


@pytest.fixture(scope="module")
def demo_runs(pool_fleet: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """Both demo policies at once: the field note's on the default pool (the first kubelet pool node),
    then, once that node is carved out, the default policy on the second. Yields with both done, and
    the first node's operand pods from before its run under "operands". NVSentinel's namespace is there, and
    the second node carries its label as NVSentinel's own (true): each run takes its pool out of NVSentinel's
    care and puts the label back as it was."""
    kube, root = _kube(pool_fleet), tmp_path_factory.mktemp("demo-runs")
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NVSENTINEL_NAMESPACE}})
    kube.patch("v1", "Node", SECOND, {"metadata": {"labels": {NVSENTINEL_LABEL: "true"}}})
    before = _operand_pods(kube)
    field = Run("field-note.yaml", NODE, root / "field-note").start(pool_fleet)
    try:
        kube.wait_for("v1", "Node", NODE, lambda n: RUN_ID_LABEL in n["metadata"]["labels"], timeout_s=120)
    except BaseException:
        field.finish(timeout_s=0.1)
        raise
    default = Run("default.yaml", SECOND, root / "default", (f"--gpucanary-pool-node={SECOND}",)).start(pool_fleet)
    yield {"field-note.yaml": field.finish(), "default.yaml": default.finish(), "operands": before}


def _verdict(receipt: dict, stage: str) -> dict:
    [verdict] = [v for v in receipt["verdicts"] if v["stage"] == stage]
    return verdict


def _operand_pods(kube: Kube, node: str = NODE) -> dict[str, tuple[str, str]]:
    """app -> (uid, image of the first container) of each operator pod on a kubelet node."""
    pods = kube.list("v1", "Pod", namespace="gpu-operator", field_selector=f"spec.nodeName={node}")
    return {p["metadata"]["labels"].get("app", ""): (p["metadata"]["uid"], p["spec"]["containers"][0]["image"])
            for p in pods if not p["metadata"].get("deletionTimestamp")}


def test_operands_run_on_the_kubelet_node_from_local_images(pool_fleet: dict[str, str]) -> None:
    kube = _kube(pool_fleet)
    node = kube.get("v1", "Node", NODE)
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert kube.get("nvidia.com/v1alpha1", "NVIDIADriver", NODE)["spec"]["nodeSelector"] == {
        "gpucanary.io/driver-pool": NODE}
    pods = _operand_pods(kube)
    assert {"nvidia-device-plugin-daemonset", "nvidia-operator-validator"} <= set(pods), pods
    [driver] = [image for app, (_, image) in pods.items() if app.startswith("nvidia-gpu-driver")]
    assert driver == "nvcr.io/nvidia/driver:580.82.07-ubuntu22.04"
    # NVIDIA's validator, built from the release's tree, found the operator's driver and ran its nvidia-smi
    [validator] = kube.list("v1", "Pod", namespace="gpu-operator", label_selector="app=nvidia-operator-validator",
                            field_selector=f"spec.nodeName={NODE}")
    log = subprocess.run([str(Path(pool_fleet["GPUCANARY_BIN_DIR"]) / "kubectl"),
                          f"--kubeconfig={Path(pool_fleet['GPUCANARY_FLEET_DIR']) / 'kubeconfig'}", "logs", "-n",
                          "gpu-operator", validator["metadata"]["name"], "-c", "driver-validation"],
                         capture_output=True, text=True, timeout=60).stdout
    assert 'msg="version: v26.7.0' in log, log
    assert "Driver is not pre-installed on the host and is managed by GPU Operator" in log, log
    assert "Driver Version: 580.82.07" in log, log


def nvml_state(pool_fleet: dict[str, str], node: str) -> str:
    """The NVML stand-in's state file on a kubelet pool node, as the driver stand-in wrote it."""
    layout = FleetLayout(root=Path(pool_fleet["GPUCANARY_FLEET_DIR"]), port_base=PORT_BASE)
    pid = processes.pid_of(layout, f"{node}-containerd")
    assert pid is not None, f"{node}'s containerd is not running"
    return subprocess.run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", "--", "cat", NVML_STATE_PATH],
                          capture_output=True, text=True, check=True, timeout=30).stdout


def test_the_nodes_nvml_stand_in_answers_for_the_driver_it_runs(pool_fleet: dict[str, str]) -> None:
    """The driver stand-in writes the NVML shim's state when it loads: NVIDIA's bindings (the shim's nvml-check,
    go-nvml) see the node's eight GPUs on the driver its pod runs, each with a UUID of this node's."""
    layout = FleetLayout(root=Path(pool_fleet["GPUCANARY_FLEET_DIR"]), port_base=PORT_BASE)
    states = {node: nvml_state(pool_fleet, node) for node in (NODE, SECOND)}
    shim = find_bin_dir(NVML_SHIM, progress=lambda line: None)
    seen = {}
    for node, text in states.items():
        state = layout.root / f"nvml-check-{node}.env"
        state.write_text(text)
        result = subprocess.run([str(shim / "nvml-check")], capture_output=True, text=True, timeout=60,
                                env={**os.environ, "GPUCANARY_NVML_STATE": str(state)})
        assert result.returncode == 0 and result.stderr == "", result.stderr
        seen[node] = json.loads(result.stdout)
    for node, answers in seen.items():
        assert (answers["driver_version"], answers["count"]) == ("580.82.07", 8), (node, answers)
        assert {g["name"] for g in answers["gpus"]} == {"NVIDIA H100 80GB HBM3"}
    uuids = [{g["uuid"] for g in answers["gpus"]} for answers in seen.values()]
    assert all(len(u) == 8 for u in uuids) and not uuids[0] & uuids[1], uuids


def test_gpus_come_from_the_operators_device_plugin_pod_and_go_with_it(pool_fleet: dict[str, str]) -> None:
    """NVIDIA's device plugin (v0.19.3, built from its module) found the node's GPUs through the NVML stand-in
    and gives a pod one of them by its UUID, with the GPU's device node."""
    kube = _kube(pool_fleet)
    root = Path(pool_fleet["GPUCANARY_FLEET_DIR"])
    assert processes.pid_of(FleetLayout(root=root, port_base=PORT_BASE), f"{NODE}-device-plugin") is None, \
        "the fleet should not run its own plugin"
    kubectl = [str(Path(pool_fleet["GPUCANARY_BIN_DIR"]) / "kubectl"), f"--kubeconfig={root / 'kubeconfig'}"]
    [plugin] = kube.list("v1", "Pod", namespace="gpu-operator", label_selector="app=nvidia-device-plugin-daemonset",
                         field_selector=f"spec.nodeName={NODE}")
    log = subprocess.run([*kubectl, "logs", "-n", "gpu-operator", plugin["metadata"]["name"], "-c", "nvidia-device-plugin"],
                         capture_output=True, text=True, timeout=60).stdout
    assert '"Starting NVIDIA Device Plugin" version="v0.19.3"' in log and "Detected platform: nvml" in log, log
    uuids = {line.split()[0].split("=", 1)[1] for line in nvml_state(pool_fleet, NODE).splitlines()
             if line.startswith("DEVICE=")}
    name = f"cuda-{uuid.uuid4().hex[:6]}"
    kube.create(node_pod(name, "default", "echo gpus=$NVIDIA_VISIBLE_DEVICES; ls /dev | grep nvidia", gpus=1))
    try:
        kube.wait_for("v1", "Pod", name, phase_is("Succeeded", "Failed"), namespace="default", timeout_s=60)
        logs = subprocess.run([*kubectl, "logs", name], capture_output=True, text=True).stdout.split()
        assert logs[0].startswith("gpus=") and logs[0].removeprefix("gpus=") in uuids, (logs, uuids)
        assert [line for line in logs[1:] if line.startswith("nvidia")], logs      # its device node
    finally:
        kube.delete("v1", "Pod", name, namespace="default")

    # what the driver manager does during an upgrade: the operator's DaemonSet leaves the node
    kube.patch("v1", "Node", NODE, {"metadata": {"labels": {"nvidia.com/gpu.deploy.device-plugin": "false"}}})
    kube.wait_for("v1", "Node", NODE, lambda n: n["status"]["allocatable"].get("nvidia.com/gpu") == "0", timeout_s=60)
    assert kube.get("v1", "Node", NODE)["status"]["capacity"]["nvidia.com/gpu"] == "8"
    kube.patch("v1", "Node", NODE, {"metadata": {"labels": {"nvidia.com/gpu.deploy.device-plugin": "true"}}})
    kube.wait_for("v1", "Node", NODE, lambda n: n["status"]["allocatable"].get("nvidia.com/gpu") == "8", timeout_s=90)


def test_gfd_labels_the_node_through_nfd_master_from_the_nvml_the_runtime_mounts(pool_fleet: dict[str, str]) -> None:
    """NVIDIA's GFD (v0.19.3, from the device plugin's module and image) reads the node's GPUs through the NVML that
    the runtime stand-in mounts into its container, writes them into a NodeFeature, and NFD's nfd-master (v0.18.3)
    puts them on the node: the node agent writes no GFD label on a kubelet node."""
    kube = _kube(pool_fleet)
    root = Path(pool_fleet["GPUCANARY_FLEET_DIR"])
    kubectl = [str(Path(pool_fleet["GPUCANARY_BIN_DIR"]) / "kubectl"), f"--kubeconfig={root / 'kubeconfig'}"]
    for node in (NODE, SECOND):
        [gfd] = kube.list("v1", "Pod", namespace="gpu-operator", label_selector="app=gpu-feature-discovery",
                          field_selector=f"spec.nodeName={node}")
        log = subprocess.run([*kubectl, "logs", "-n", "gpu-operator", gfd["metadata"]["name"], "-c",
                              "gpu-feature-discovery"], capture_output=True, text=True, timeout=60).stdout
        assert "Using NVML manager" in log and f"NodeFeature object nvidia-features-for-{node}" in log, log
        features = kube.get("nfd.k8s-sigs.io/v1alpha1", "NodeFeature", f"nvidia-features-for-{node}",
                            namespace="gpu-operator")["spec"]["labels"]
        assert (features["nvidia.com/cuda.driver-version.full"], features["nvidia.com/gpu.count"],
                features["nvidia.com/gpu.product"]) == ("580.82.07", "8", "NVIDIA-H100-80GB-HBM3"), features
        meta = kube.get("v1", "Node", node)["metadata"]
        labels, written = meta["labels"], meta["annotations"]["nfd.node.kubernetes.io/feature-labels"].split(",")
        assert {k: labels.get(k) for k in features} == features, labels
        assert {"nvidia.com/cuda.driver-version.full", "nvidia.com/gpu.product"} <= set(written), written
    writers = {entry.get("manager") for entry in kube.get("v1", "Node", NODE)["metadata"]["managedFields"]
               if "nvidia.com/cuda.driver-version.full" in json.dumps(entry.get("fieldsV1", {}))}
    assert writers == {"nfd-master"}, writers


def test_each_nvidia_operand_the_pool_node_runs_is_built_from_its_own_module(pool_fleet: dict[str, str]) -> None:
    """`go version -m`: the validator from the operator's release tree, the device plugin and GFD from NVIDIA's
    k8s-device-plugin module, nfd-master from NFD's; none is a stand-in of ours."""
    operator_dir = Path(json.loads((Path(pool_fleet["GPUCANARY_FLEET_DIR"]) / "fleet.json").read_text())["operator_bin_dir"])
    plugin_dir = find_bin_dir(DEVICE_PLUGIN, progress=lambda line: None)
    binaries = {operator_dir / "nvidia-validator": "github.com/NVIDIA/gpu-operator",
                plugin_dir / "nvidia-device-plugin": "github.com/NVIDIA/k8s-device-plugin\tv0.19.3",
                plugin_dir / "gpu-feature-discovery": "github.com/NVIDIA/k8s-device-plugin\tv0.19.3",
                find_bin_dir(NFD_MASTER, progress=lambda line: None) / "nfd-master":
                    "sigs.k8s.io/node-feature-discovery\tv0.18.3"}
    for binary, module in binaries.items():
        info = subprocess.run(["go", "version", "-m", str(binary)], capture_output=True, text=True, check=True).stdout
        assert module in info, (binary, info[:600])


def test_field_note_policy_drains_the_real_service_and_the_gate_fails_at_application(
        pool_fleet: dict[str, str], demo_runs: dict) -> None:
    kube = _kube(pool_fleet)
    run, before = demo_runs["field-note.yaml"], demo_runs["operands"]
    receipt, output = run.receipt, run.output
    assert run.proc.returncode == 1, output
    assert "pool fenced: gpucanary.io/run=" in run.stdout, output      # the operands tolerate it (fixtures/fleet)
    assert _verdict(receipt, "rollout")["outcome"] == "pass", output
    application = _verdict(receipt, "application")
    assert application["outcome"] == "fail", (application["summary"], receipt["state_spans"], application["evidence"])
    [evicted] = [e for e in receipt["evictions"] if e["name"].startswith("sched-api-")]
    assert evicted["by_drain"] and not evicted["allowed"], evicted
    # the load hit the real server: none failed before, and its requests failed once the drain stopped it
    load = {e["ref"].rsplit("@", 1)[1]: e["text"] for e in application["evidence"] if e.get("kind") == "LoadStats"}
    assert " 0 failed" in load["before"], load
    assert " 0 failed" not in load["drain"], load
    # the operand pods were really replaced: new uids, and the driver pod came back at the old version
    after = _operand_pods(kube)
    for app in ("nvidia-device-plugin-daemonset", "nvidia-operator-validator"):
        assert after[app][0] != before[app][0], (app, before, after)
    assert kube.get("v1", "Node", NODE)["status"]["allocatable"]["nvidia.com/gpu"] == "8"


def test_default_policy_deletes_only_the_gpu_job_on_the_kubelet_node(pool_fleet: dict[str, str], demo_runs: dict) -> None:
    run = demo_runs["default.yaml"]
    receipt, output = run.receipt, run.output
    assert _verdict(receipt, "rollout")["outcome"] == "pass", output
    application = _verdict(receipt, "application")
    assert application["outcome"] == "pass", application
    assert "0 others (GPU pods only)" in application["summary"] and "1 evicted" in application["summary"]
    device = _verdict(receipt, "device")
    texts = [e["text"] for e in device["evidence"]]
    assert any("Succeeded" in t and "driver:580.82.07" in t for t in texts), texts   # the old driver pod ended
    assert any("Running" in t and f"driver:{TARGET}" in t for t in texts), texts      # its successor at the target
    # GFD's label (NVIDIA's GFD through nfd-master) and DCGM's driver version (the node agent's) at the target
    assert device["outcome"] == "pass", device
    assert any(f"nvidia.com/cuda.driver-version.full={TARGET}" in t for t in texts), texts
    assert run.proc.returncode == 0, output
    for name in ("default.yaml", "field-note.yaml"):
        assert f"pool opted out of NVSentinel for the run: {NVSENTINEL_LABEL}=false" in demo_runs[name].stdout
    labels = {node: _kube(pool_fleet).get("v1", "Node", node)["metadata"]["labels"] for node in (NODE, SECOND)}
    assert labels[SECOND][NVSENTINEL_LABEL] == "true" and NVSENTINEL_LABEL not in labels[NODE], labels


@pytest.fixture(scope="module")
def failing_runs(pool_fleet: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """At once: a driver with no image on the first node; on the second, the canary's own driver holder
    (`--gpucanary-holder`, a pod with NVIDIA_VISIBLE_DEVICES and no GPU request), so the new driver pod's driver
    manager cannot unload the old one. The run's restore takes its workloads, the holder with them, off first.
    From `make diagnosis-matrix` only, then, with a stall time of 60 s: at once, on the first node a driver whose
    container hangs before it loads (the fleet's 574.0.2); on the second, an upgrade to a good driver during which
    the node's kubelet stops (SIGSTOP), so the node goes NotReady, and comes back once the run has had time to
    call it. At once: one the kubelet cannot make a sandbox for on the second node, the node's pause image gone,
    and on the first node the field note's policy, whose drain a budget over the service refuses. At once: on the
    first node a driver whose container cannot load its module (574.0.1, a crash loop); on the second one that
    loads and turns Ready while the validator's nvidia-smi check of it fails (574.0.3), so the operands wait
    behind a Ready driver. Then alone: a driver pod the scheduler cannot place, as its namespace's defaults ask
    more CPU of it than the node has."""
    root = tmp_path_factory.mktemp("failing-runs")
    holder = (f"--gpucanary-holder={FIXTURES / 'workloads' / 'holder.yaml'}",)
    stall = (f"--gpucanary-stall-s={STALL_S}",)
    cases = {"no-image": (NODE, "999.1.1", ()), "driver-in-use": (SECOND, TARGET, holder),
             "hangs": (NODE, "574.0.2", stall), "node-not-ready": (SECOND, TARGET, stall),
             "crash": (NODE, "574.0.1", ()), "unvalidated": (SECOND, "574.0.3", stall),
             "unschedulable": (NODE, TARGET, stall), "no-sandbox": (SECOND, TARGET, stall)}
    policy, service = refused_drain_options(root / "eviction-refused-inputs", drain_timeout_s=STALL_S)
    runs = {name: Run("default.yaml", node, root / name, (f"--gpucanary-pool-node={node}",
                      f"--junitxml={root / name / 'junit.xml'}", *args), target=target)
            for name, (node, target, args) in cases.items()}
    runs["eviction-refused"] = Run(policy.split("=", 1)[1], NODE, root / "eviction-refused", (
        f"--gpucanary-pool-node={NODE}", f"--junitxml={root / 'eviction-refused' / 'junit.xml'}", service))
    pairs = [("no-image", "driver-in-use")]
    if os.environ.get("GPUCANARY_DIAGNOSIS_MATRIX") == "1":
        pairs += [("hangs", "node-not-ready"), ("eviction-refused", "no-sandbox"), ("crash", "unvalidated"),
                  ("unschedulable",)]
    for pair in pairs:
        with unschedulable_driver_pod(pool_fleet, NODE) if "unschedulable" in pair else \
                pause_image_gone(pool_fleet, SECOND) if "no-sandbox" in pair else nullcontext():
            for name in pair:
                runs[name].start(pool_fleet)
            if "node-not-ready" in pair:
                stop_kubelet_during_the_upgrade(pool_fleet, SECOND)
            for name in pair:
                runs[name].finish()
    return runs


OPERATOR_NAMESPACE = "gpu-operator"
MORE_CPU_THAN_A_NODE_HAS = {"apiVersion": "v1", "kind": "LimitRange",
                            "metadata": {"name": "more-cpu-than-a-node-has", "namespace": OPERATOR_NAMESPACE},
                            "spec": {"limits": [{"type": "Container", "defaultRequest": {"cpu": "64"}}]}}


@contextmanager
def alongside(work: Callable[[threading.Event], None]) -> Iterator[None]:
    """`work(stop)` in a thread while the block runs; `stop` is set when the block ends, and the thread joined."""
    stop = threading.Event()
    thread = threading.Thread(target=work, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def unschedulable_driver_pod(env: dict[str, str], node: str) -> Iterator[None]:
    """While it lasts, a container created in the operator's namespace without requests asks for 64 CPUs (a
    LimitRange, as a platform's namespace defaults can), so the driver pod an upgrade brings to `node` cannot be
    placed. Lifted as soon as that pod is Unschedulable: it keeps what it was admitted with, and the restore's
    pods place again."""
    kube = _kube(env)
    kube.create(MORE_CPU_THAN_A_NODE_HAS)

    def lift_once_unschedulable(stop: threading.Event) -> None:
        eventually(lambda: any(daemonset_node(p["spec"]) == node and unplaced(p) for p in kube.list(
            "v1", "Pod", namespace=OPERATOR_NAMESPACE, field_selector="spec.nodeName=")), stop=stop, every_s=2, timeout_s=600)
        try:
            kube.delete("v1", "LimitRange", MORE_CPU_THAN_A_NODE_HAS["metadata"]["name"], namespace=OPERATOR_NAMESPACE)
        except NotFound:
            pass

    with alongside(lift_once_unschedulable):
        yield


@contextmanager
def pause_image_gone(env: dict[str, str], node: str) -> Iterator[None]:
    """Once the run's workloads run on `node`, its containerd loses the pause image (as a kubelet's image garbage
    collection can take it on an air-gapped node), so no new pod there gets a sandbox: FailedCreatePodSandBox.
    Imported again once the run has put its NVIDIADriver back (it has called the cause), so the restore goes on."""
    kube = _kube(env)
    layout = FleetLayout(root=Path(env["GPUCANARY_FLEET_DIR"]), port_base=int(env["GPUCANARY_FLEET_PORT_BASE"]))
    pid = processes.pid_of(layout, f"{node}-containerd")
    ctr = ("nsenter", f"--mount=/proc/{pid}/ns/mnt", "--", "ctr", "--address=/run/containerd/containerd.sock",
           "--namespace=k8s.io", "images")
    tar = layout.data / "nodes" / node / "images" / (PAUSE_IMAGE.rsplit("/", 1)[1].replace(":", "-") + ".tar")

    def driver_version() -> str:
        return kube.get("nvidia.com/v1alpha1", "NVIDIADriver", node)["spec"]["version"]

    def take_and_give_back(stop: threading.Event) -> None:
        if eventually(lambda: any(p["status"].get("phase") == "Running"
                                  and p["metadata"]["namespace"].startswith("gpucanary-")
                                  for p in kube.list("v1", "Pod", field_selector=f"spec.nodeName={node}")),
                      stop=stop, timeout_s=600):
            subprocess.run([*ctr, "rm", PAUSE_IMAGE], check=True, capture_output=True, timeout=60)
            eventually(lambda: driver_version() == TARGET, stop=stop, timeout_s=600)
            eventually(lambda: driver_version() != TARGET, stop=stop, timeout_s=600)
        subprocess.run([*ctr, "import", str(tar)], check=True, capture_output=True, timeout=120)

    with alongside(take_and_give_back):
        yield


def assert_named_in_minutes(summary: str, case: str, words: str) -> None:
    """What the rollout verdict says of a cause, in either mode: its words; a drain a budget refuses ended by the
    operator at the drain's own timeout, every other cause called as it turned terminal, not at the budget; the
    scheduler's and the validator's own words where they are the cause."""
    assert words in summary, summary
    if case == "eviction-refused":
        assert f"drain gave up after {STALL_S} s" in summary, summary
    else:
        assert "it will not clear by itself" in summary and "not waiting out the budget 420 s" in summary, summary
    if case == "unschedulable":
        assert "Insufficient cpu" in summary, summary
    if case == "unvalidated":
        assert "in init container driver-validation (the driver pod is Ready); its log ends: Failed to initialize " \
               "NVML: Driver/library version mismatch" in summary, summary


def stop_kubelet_during_the_upgrade(env: dict[str, str], node: str, *, stall_s: float = STALL_S) -> None:
    """Once the run's upgrade has begun on `node`, stop its kubelet until the node has been NotReady for the
    stall time and 40 s more (the run calls it at the stall time), then let it go on."""
    kube = _kube(env)
    kube.wait_for("v1", "Node", node, lambda n: RUN_ID_LABEL in n["metadata"]["labels"] and n["metadata"]["labels"].get(
        "nvidia.com/gpu-driver-upgrade-state") not in (None, "", "upgrade-done"), timeout_s=300)
    layout = FleetLayout(root=Path(env["GPUCANARY_FLEET_DIR"]), port_base=int(env["GPUCANARY_FLEET_PORT_BASE"]))
    pid = processes.pid_of(layout, f"{node}-kubelet")
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        kube.wait_for("v1", "Node", node, lambda n: not _ready(n), timeout_s=180)
        time.sleep(stall_s + 40)
    finally:
        os.kill(pid, signal.SIGCONT)


def _ready(node: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions") or [])


@pytest.mark.parametrize("case, words", [
    ("no-image", "nvcr.io/nvidia/driver:999.1.1-ubuntu22.04"),
    ("driver-in-use", f"init container k8s-driver-manager on {SECOND}: CrashLoopBackOff"),
    pytest.param("hangs", f"container nvidia-driver-ctr on {NODE}: NotStarted since", marks=pytest.mark.diagnosis_matrix),
    pytest.param("node-not-ready", f"node {SECOND} on {SECOND}: NotReady since", marks=pytest.mark.diagnosis_matrix),
    pytest.param("crash", f"container nvidia-driver-ctr on {NODE}: CrashLoopBackOff since",
                 marks=pytest.mark.diagnosis_matrix),
    pytest.param("unvalidated", f"on {SECOND}: BlockedInInit since", marks=pytest.mark.diagnosis_matrix),
    pytest.param("unschedulable", f"on {NODE}: Unschedulable since", marks=pytest.mark.diagnosis_matrix),
    pytest.param("no-sandbox", f"on {SECOND}: SandboxNotReady since", marks=pytest.mark.diagnosis_matrix),
    pytest.param("eviction-refused", "drain cannot evict it: PodDisruptionBudget gpucanary-",
                 marks=pytest.mark.diagnosis_matrix),
])
def test_a_driver_that_cannot_come_fails_at_rollout_with_its_cause_and_the_pool_keeps_its_driver(
        pool_fleet: dict[str, str], failing_runs: dict[str, Run], case: str, words: str) -> None:
    """No image for the target, a driver the driver manager cannot unload, a driver container that never
    loads or crashes loading, the node gone NotReady, operands that wait behind a Ready driver, or a driver pod
    no node takes: the run calls
    it once it has outlasted the kubelet's back-offs (for the hang, once its log has been quiet for the stall
    time; for the node, the operands and the unplaced pod, once they have waited that long), without waiting out the budget,
    names it, and puts the node back on its old driver."""
    run = failing_runs[case]
    receipt, output = run.receipt, run.output
    assert run.proc.returncode == 1, output
    rollout = _verdict(receipt, "rollout")
    assert rollout["outcome"] == "fail", rollout["summary"]
    assert_named_in_minutes(rollout["summary"], case, words)
    said = {"node-not-ready": f"] rollout: node {SECOND} on", "unvalidated": "] rollout: operator pod gpu-operator/nvidia-",
            "eviction-refused": "] rollout: pod gpucanary-"}.get(case, "] rollout: driver pod gpu-operator/")
    assert any(said in line for line in run.stdout.splitlines()), output     # the cause reached the progress
    if case == "node-not-ready":                                             # as it happened
        assert "NodeStatusUnknown: Kubelet stopped posting node status" in rollout["summary"], rollout["summary"]
    if case == "driver-in-use":                     # who holds it, and the driver manager's own words
        holder = f"hold the driver without a GPU request: gpucanary-{receipt['run']['run_id']}/gpu-monitor-"
        assert holder in rollout["summary"], rollout["summary"]
        assert "(NVIDIA_VISIBLE_DEVICES=all)" in rollout["summary"], rollout["summary"]
        assert f"warning: pods on {SECOND} {holder}" in run.stdout, output      # said before the policy
        assert "its log ends: error: failed to uninstall nvidia driver components" in rollout["summary"]
        junit = (run.reports / "junit.xml").read_text()
        assert "Could not unload NVIDIA driver kernel modules, driver is in use" in junit, junit[-3000:]
    if case == "hangs":                             # its own last words, read while it hung
        assert "running, its startup probe has not passed; its log ends: Installing Linux kernel headers..." \
            in rollout["summary"], rollout["summary"]
        assert "rollout: nvidia-driver-ctr said last: Installing Linux kernel headers..." in run.stdout, output
    if case == "crash":                             # the exit and the driver's own last words
        assert "exit code 1 (Error) after " in rollout["summary"], rollout["summary"]
        assert "its log ends: ERROR: Unable to load the kernel module 'nvidia.ko'" in rollout["summary"], \
            rollout["summary"]
    if case == "no-sandbox":                        # the kubelet's own words, from the pod's Warning event
        assert "FailedCreatePodSandBox: " in rollout["summary"] and PAUSE_IMAGE in rollout["summary"], \
            rollout["summary"]
    if case == "unschedulable":                     # GPU Operator passes over the node: the give-back replaced the pod
        assert f"could not be placed on node {NODE}" in run.stdout, output
    kube = _kube(pool_fleet)
    [driver] = [image for app, (_, image) in _operand_pods(kube, run.node).items() if app.startswith("nvidia-gpu-driver")]
    assert driver == "nvcr.io/nvidia/driver:580.82.07-ubuntu22.04"
    node = kube.get("v1", "Node", run.node)
    labels = node["metadata"]["labels"]
    assert labels.get("nvidia.com/gpu-driver-upgrade-state") == "upgrade-done" and RUN_ID_LABEL not in labels, labels
    assert not node["spec"].get("taints"), node["spec"]                 # the run's fence went with the restore
