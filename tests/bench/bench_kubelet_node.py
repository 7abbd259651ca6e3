"""Pod start latency and memory of the fleet's real kubelet node, on a running fleet.

Creates busybox pods on gpu-kubelet-0, one at a time and then in one burst, and times create ->
Running by the client's monotonic clock (the create call returns, then a watch sees phase
Running); the pods' own startedAt (apiserver clock, 1 s resolution) is reported beside it. Then
sums the resident memory of the node's kubelet, containerd, device plugin and shims.
Run: GPUCANARY_FLEET_DIR=... GPUCANARY_FLEET_PORT_BASE=... python tests/bench/bench_kubelet_node.py [n]
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
import uuid
from datetime import datetime

from pytest_gpucanary.fleet import Fleet, processes
from pytest_gpucanary.fleet.kubelet_node import TAINT_KEY, node_name
from pytest_gpucanary.fleet.kubelet_nodes import KubeletNodes, namespace_members
from pytest_gpucanary.kube import Kube
import figures  # tests/bench/figures.py: this run's output, kept for the docs

NODE = node_name(0)


def pod(name: str, namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace,
                                                              "labels": {"bench": "kubelet-node"}},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": NODE}, "dnsPolicy": "Default",
                     "tolerations": [{"key": TAINT_KEY, "operator": "Exists"}], "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "main", "image": "localhost/gpucanary/busybox:1",
                                     "imagePullPolicy": "Never", "command": ["sleep", "3600"]}]}}


def quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(samples: list[float]) -> str:
    return (f"n={len(samples)} p50={quantile(samples, 0.5):.2f} s p99={quantile(samples, 0.99):.2f} s "
            f"min={min(samples):.2f} max={max(samples):.2f} mean={statistics.mean(samples):.2f}")


def start_latencies(kube: Kube, namespace: str, names: list[str]) -> list[float]:
    """Create the pods back to back; seconds from each create's return to its Running seen."""
    created: dict[str, float] = {}
    running: dict[str, float] = {}
    done = threading.Event()

    def watch() -> None:
        for event in kube.watch("v1", "Pod", stop=done, namespace=namespace, label_selector="bench=kubelet-node"):
            for obj in event.object["items"] if event.type == "RELISTED" else [event.object]:
                name = obj["metadata"]["name"]
                if obj.get("status", {}).get("phase") == "Running" and name not in running:
                    running[name] = time.monotonic()
            if all(n in running for n in names):
                done.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(0.5)  # the watch has listed
    for name in names:
        kube.create(pod(name, namespace))
        created[name] = time.monotonic()
    watcher.join(timeout=300)
    return [running[n] - created[n] for n in names]


def _time(value: str | datetime) -> datetime:
    return value if isinstance(value, datetime) else datetime.fromisoformat(value.replace("Z", "+00:00"))


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main(n: int) -> None:
    fleet = Fleet.from_env()
    kube = Kube.connect(fleet.kubeconfig)
    namespace = f"bench-{uuid.uuid4().hex[:6]}"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    kube.wait_for("v1", "ServiceAccount", "default", lambda sa: True, namespace=namespace, timeout_s=30)
    try:
        one_at_a_time = []
        for i in range(n):
            one_at_a_time += start_latencies(kube, namespace, [f"seq-{i}"])
            kube.delete("v1", "Pod", f"seq-{i}", namespace=namespace)
            kube.wait_gone("v1", "Pod", f"seq-{i}", namespace=namespace)
        burst = start_latencies(kube, namespace, [f"burst-{i}" for i in range(n)])
        started_s = []
        for obj in kube.list("v1", "Pod", namespace=namespace, label_selector="bench=kubelet-node"):
            state = obj["status"]["containerStatuses"][0]["state"]["running"]
            started_s.append((_time(state["startedAt"]) - _time(obj["metadata"]["creationTimestamp"])).total_seconds())
        nodes = KubeletNodes.running(fleet.layout)
        names = ("containerd", "kubelet", "device-plugin")
        rss = {part: rss_mib(processes.pid_of(fleet.layout, f"{NODE}-{part}") or 0) for part in names}
        namespace_id = (nodes.nodes()[0].namespace_file.read_text().strip()) if nodes else ""
        shims = [pid for pid in namespace_members(namespace_id)
                 if open(f"/proc/{pid}/comm").read().strip().startswith("containerd-shim")]
        rss["shims"] = sum(rss_mib(pid) for pid in shims)
    finally:
        kube.delete("v1", "Namespace", namespace)
    state = json.loads((fleet.layout.data / "nodes" / "nodes.json").read_text())
    print(f"node start (containerd start -> Ready with 8 GPUs, last fleet up): {state.get('start_s')}")
    print(f"create -> Running, one at a time (client monotonic): {summary(one_at_a_time)}")
    print(f"create -> Running, burst of {n} (client monotonic): {summary(burst)}")
    print(f"creationTimestamp -> startedAt, burst (apiserver clock, 1 s resolution): {summary(started_s)}")
    print(f"RSS MiB with {n} running pods: " + ", ".join(f"{k} {v:.1f}" for k, v in rss.items())
          + f" ({len(shims)} shims); kubelet+containerd {rss['kubelet'] + rss['containerd']:.1f}")


if __name__ == "__main__":
    with figures.recorded(__file__):
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
