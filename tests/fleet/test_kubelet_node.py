"""The fleet's real kubelet node: pods are processes, GPUs come from a device plugin, and `fleet down`
leaves nothing of the node on the machine."""

from __future__ import annotations

import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from harness import eventually, gpucanary, idle, node_pod, phase_is, port_beside_session, second_fleet_env

from pytest_gpucanary.fleet import node_cgroups, processes
from pytest_gpucanary.fleet.kubelet_node import TAINT_KEY, KubeletNode, gpu_labels, node_name
from pytest_gpucanary.fleet.layout import FleetLayout
from pytest_gpucanary.kube import Kube

pytestmark = pytest.mark.e2e

NODE = node_name(0)
SECOND_FLEET_PORT_BASE = port_beside_session("kubelet-node")
MACHINE_PATHS = ("/var/lib/kubelet", "/run/containerd", "/run/netns", "/opt/containerd")
SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops")


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def node_of(gpucanary_fleet) -> KubeletNode:
    fleet = gpucanary_fleet.fleet
    binaries = fleet.binaries()
    assert binaries is not None and binaries.kubelet_node is not None, "the session fleet has no kubelet node"
    return KubeletNode(fleet.layout, 0, binaries.kubelet_node)


def host_processes_with(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_node_registers_ready_with_eight_gpus_from_the_device_plugin(kube: Kube, gpucanary_fleet) -> None:
    node = kube.get("v1", "Node", NODE)
    conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert conditions["Ready"] == "True"
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.36.3"
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    labels = node["metadata"]["labels"]
    assert {k: labels.get(k) for k in gpu_labels()} == gpu_labels()
    assert "kwok.x-k8s.io/node" not in (node["metadata"].get("annotations") or {}), "kwok would manage it"
    assert {"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"} in node["spec"]["taints"]


def test_gpu_pod_is_a_real_process_and_its_shm_is_tmpfs(kube: Kube, namespace: str, gpucanary_fleet) -> None:
    token = f"canary-{uuid.uuid4().hex[:8]}"
    script = ("echo gpus=$NVIDIA_VISIBLE_DEVICES; echo written > /dev/shm/probe; grep ' /dev/shm ' /proc/mounts; "
              f"cat /dev/shm/probe; echo cgroup=$(grep pids /proc/self/cgroup); {idle(token)}")
    kube.create(node_pod("cuda", namespace, script, gpus=1, shm=True, grace_s=1))
    pod = kube.wait_for("v1", "Pod", "cuda", phase_is("Running", "Failed"), namespace=namespace, timeout_s=60)
    assert pod["status"]["phase"] == "Running" and pod["spec"]["nodeName"] == NODE

    def logs() -> str:
        return gpucanary_fleet.fleet.kubectl("logs", "-n", namespace, "cuda")

    assert eventually(lambda: "cgroup=" in logs(), timeout_s=20, every_s=0.2), logs()
    out = logs()
    node = node_of(gpucanary_fleet)
    pids = [pid for pid in host_processes_with(token) if pid in node_cgroups.pids(node.cgroup_root)]
    assert pids, f"no process named {token} in the node's cgroups"
    lines = out.splitlines()
    uuids = [line.split()[0].removeprefix("DEVICE=") for line in (node.dir / "nvml.env").read_text().splitlines()
             if line.startswith("DEVICE=")]
    assert lines[0].removeprefix("gpus=") in uuids, (lines[0], uuids)   # one GPU, from NVIDIA's plugin
    assert lines[1].split()[1:3] == ["/dev/shm", "tmpfs"], lines[1]
    assert lines[2] == "written"
    assert f"/{node.cgroup_root}/kubepods/" in lines[3]


def test_deleted_pod_runs_its_sigterm_trap_inside_the_grace_period(kube: Kube, namespace: str,
                                                                    gpucanary_fleet) -> None:
    script = "trap 'echo TERM-trapped; exit 0' TERM; echo started; while :; do sleep 0.1; done"
    kube.create(node_pod("graceful", namespace, script, grace_s=30))
    kube.wait_for("v1", "Pod", "graceful", phase_is("Running"), namespace=namespace, timeout_s=60)
    kubectl = gpucanary_fleet.fleet.bin_dir() / "kubectl"
    follow = subprocess.Popen([str(kubectl), f"--kubeconfig={gpucanary_fleet.fleet.kubeconfig}", "logs", "-f",
                               "-n", namespace, "graceful"], stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(follow.stdout), daemon=True)
    reader.start()
    try:
        assert eventually(lambda: "started\n" in lines, timeout_s=20, every_s=0.1), lines
        deleted = time.monotonic()
        kube.delete("v1", "Pod", "graceful", namespace=namespace)
        kube.wait_gone("v1", "Pod", "graceful", namespace=namespace, timeout_s=60)
        gone_s = time.monotonic() - deleted
        reader.join(timeout=10)
    finally:
        follow.kill()
    assert "TERM-trapped\n" in lines, lines
    assert gone_s < 15, f"pod took {gone_s:.1f} s to go with a trap that exits at once (grace 30 s)"


def test_host_network_server_answers_on_loopback(kube: Kube, namespace: str, gpucanary_fleet) -> None:
    port = gpucanary_fleet.fleet.layout.kubelet_workload_ports[0]
    token = uuid.uuid4().hex[:8]
    script = f"mkdir /www && echo served-{token} > /www/index.html && exec httpd -f -p 127.0.0.1:{port} -h /www"
    pod = node_pod("web", namespace, script, host_network=True, grace_s=2)
    pod["spec"]["containers"][0]["readinessProbe"] = {"tcpSocket": {"host": "127.0.0.1", "port": port},
                                                      "periodSeconds": 1}
    kube.create(pod)
    kube.wait_for("v1", "Pod", "web", ready, namespace=namespace, timeout_s=60)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
        assert response.read().decode().strip() == f"served-{token}"
    kube.delete("v1", "Pod", "web", namespace=namespace)
    kube.wait_gone("v1", "Pod", "web", namespace=namespace, timeout_s=60)
    assert not processes.port_in_use(port)


def _machine_mounts(root: Path) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if str(root) in line or "gpucanary-node" in line]


def _sysctls() -> dict[str, str]:
    return {name: Path(f"/proc/sys/{name}").read_text() for name in SYSCTLS}


def test_fleet_down_leaves_no_process_port_mount_cgroup_or_directory_of_the_node(
        tmp_path: Path, gpucanary_fleet) -> None:
    root = (tmp_path / "fleet").resolve()
    env = second_fleet_env("kubelet-node", root, gpucanary_fleet, GPUCANARY_FLEET_GPU_NODES="1",
                           GPUCANARY_FLEET_KUBELET_NODES="1")
    layout = FleetLayout(root=root, port_base=SECOND_FLEET_PORT_BASE)
    existed = {path: Path(path).exists() for path in MACHINE_PATHS}
    sysctls = _sysctls()
    token = f"leftover-{uuid.uuid4().hex[:8]}"
    up = gpucanary("fleet", "up", env=env, timeout_s=600, unbuffered=False)
    try:
        assert up.returncode == 0, up.stderr
        kube = Kube.connect(root / "kubeconfig")
        kube.create(node_pod("busy", "default", idle(token), gpus=1, shm=True, restart="Always"))
        kube.wait_for("v1", "Pod", "busy", phase_is("Running"), namespace="default", timeout_s=60)
        assert host_processes_with(token), "the pod's process is not on the machine"
        assert _machine_mounts(root) == [], "a node mount escaped its namespace"
    finally:
        down = gpucanary("fleet", "down", env=env, timeout_s=600, unbuffered=False)
    assert down.returncode == 0, down.stderr
    assert "stopped kubelet nodes gpu-kubelet-0" in down.stderr
    assert host_processes_with(token) == [], "the pod's process outlived fleet down"
    assert processes.owned_pids(layout) == []
    assert [p for p in range(SECOND_FLEET_PORT_BASE, SECOND_FLEET_PORT_BASE + 100) if processes.port_in_use(p)] == []
    assert _machine_mounts(root) == []
    assert list(Path("/sys/fs/cgroup").glob(f"*/gpucanary-{SECOND_FLEET_PORT_BASE}-*")) == []
    assert not (root / "data").exists() and not (root / "hosts").exists()
    assert {path: Path(path).exists() for path in MACHINE_PATHS} == existed
    assert _sysctls() == sysctls
