"""What runs inside a real GPU node's driver pod and kubelet, and KWOK does not: the driver manager,
GPU Feature Discovery's driver labels, and the device plugin's GPU count.

- **Driver manager.** k8s-driver-manager, the driver pod's init container, runs on every driver pod
  start. When a driver is loaded it pauses the node's `nvidia.com/gpu.deploy.*` labels, waits until
  the operand pods (validator, toolkit, device plugin, ...) are gone, swaps the driver and restores
  the labels; with no driver loaded (a fresh node) it only restores them. The agent does the same
  label writes, so the real DaemonSet controller removes and recreates the operand pods. The driver
  pod becomes Ready only after that (kwok's Stage pod-ready-when-allowed waits for the agent's
  `gpucanary.io/simulated-ready` annotation).
- **Loaded driver.** A Ready driver pod stands for a loaded driver: the agent writes its image's
  version into GFD's driver labels (the DCGM metrics read it there) and only then lets the node's
  validator and device plugin pods become Ready, as their init containers wait for the driver. A
  node annotated `gpucanary.io/simulated-validator: never-ready` keeps its validator pods unready.
- **Device plugin.** `nvidia.com/gpu` allocatable is the node's GPU count while a device plugin pod
  is Ready on it and 0 otherwise, as the kubelet shows it when the plugin unregisters and registers.
- **RDMA devices.** A node whose driver pod runs `nvidia-peermem-ctr` (GPUDirect RDMA) shows the RDMA
  shared device plugin's `rdma/rdma_shared_device_a` in its allocatable.

This stands in for the node, never for the upgrade controller: it writes no upgrade-state label and
deletes no pod. Only nodes that run the operator's pods are touched (never a real kubelet node).
"""

from __future__ import annotations

import argparse
import http.server
import threading
from dataclasses import dataclass, field

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.errors import GpucanaryError
from pytest_gpucanary.kube import Kube, WatchEvent

DRIVER_VERSION_LABELS = (op.DRIVER_VERSION_LABEL, "nvidia.com/cuda.driver-version.major",
                         "nvidia.com/cuda.driver-version.minor", "nvidia.com/cuda.driver-version.revision")
ALLOWED_ANNOTATION = "gpucanary.io/simulated-ready"
VALIDATOR_ANNOTATION = "gpucanary.io/simulated-validator"      # "never-ready": validators on the node stay unready
# The Network Operator's RDMA shared device plugin (k8s-rdma-shared-dev-plugin), on a node whose driver
# pod runs nvidia-peermem: its devices do not depend on the GPU driver, so they stay through a swap.
RDMA_RESOURCE, RDMA_DEVICES = "rdma/rdma_shared_device_a", "63"
USER_AGENT = "gpucanary-fleet-node-agent"   # not gpucanary/<version>: the audit log tells the canary apart by it


def driver_labels(version: str) -> dict[str, str]:
    parts = (version.split(".") + ["", "", ""])[:3]
    return dict(zip(DRIVER_VERSION_LABELS, [version, *parts]))


def paused(value: str) -> str:
    """maybeSetPaused: true -> paused-for-driver-upgrade, X -> X_paused-for-driver-upgrade, false stays."""
    if value in ("", "false") or op.PAUSED in value:
        return value
    return op.PAUSED if value == "true" else f"{value}_{op.PAUSED}"


def restored(value: str) -> str:
    """maybeSetTrue: the inverse of `paused`."""
    if value == op.PAUSED:
        return "true"
    return value.replace(f"_{op.PAUSED}", "").replace(op.PAUSED, "").strip("_") if op.PAUSED in value else value


def _ready(pod: dict) -> bool:
    status = pod.get("status", {})
    statuses = status.get("containerStatuses") or []
    return status.get("phase") == "Running" and bool(statuses) and all(s.get("ready") for s in statuses)


def _gone(pod: dict) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def _labels(pod: dict) -> dict[str, str]:
    return pod["metadata"].get("labels") or {}


def _container_names(pod: dict) -> list[str]:
    return [c.get("name", "") for c in pod.get("status", {}).get("containerStatuses") or []]


def _allowed(pod: dict) -> bool:
    return ALLOWED_ANNOTATION in (pod["metadata"].get("annotations") or {})


@dataclass
class NodeAgent:
    kube: Kube
    pods: dict[str, dict] = field(default_factory=dict)           # uid -> operator pod, as last seen
    started: set[str] = field(default_factory=set)                # driver pods whose driver manager ran
    swapping: dict[str, str] = field(default_factory=dict)        # node -> driver pod waiting for its operands
    driver_written: dict[str, str] = field(default_factory=dict)  # node -> version in its GFD labels
    gpus_shown: dict[str, bool] = field(default_factory=dict)     # node -> allocatable shows its GPUs
    rdma_shown: set[str] = field(default_factory=set)             # nodes given their RDMA devices

    def handle(self, event: WatchEvent) -> None:
        if event.type == "RELISTED":
            self.pods = {p["metadata"]["uid"]: p for p in event.object["items"]}
            nodes = {p["spec"].get("nodeName") for p in self.pods.values()}
        else:
            pod = event.object
            if event.type == "DELETED":
                self.pods.pop(pod["metadata"]["uid"], None)
            else:
                self.pods[pod["metadata"]["uid"]] = pod
            nodes = {pod["spec"].get("nodeName")}
        for node in sorted(n for n in nodes if n):
            try:
                self.step(node)
            except GpucanaryError:
                pass   # the node or pod went away meanwhile; its next event retries

    def step(self, node: str) -> None:
        on_node = [p for p in self.pods.values() if p["spec"].get("nodeName") == node]
        drivers = [p for p in on_node if op.is_driver_pod(_labels(p)) and not _gone(p)]
        for pod in drivers:
            if not _ready(pod) and not _allowed(pod) and pod["metadata"]["uid"] not in self.started:
                self._driver_manager_starts(node, pod)
        swap = self.swapping.get(node)
        if swap is not None and swap not in self.pods:
            del self.swapping[node]      # its pod went away mid-swap: the labels stay paused until the next one
        elif swap is not None and not any(_labels(p).get("app") in op.OPERAND_APPS for p in on_node):
            self._set_deploy_labels(node, restored)
            self._allow(self.pods[swap])
            del self.swapping[node]
        loaded = next((p for p in drivers if _ready(p)), None)
        if loaded is not None and node not in self.swapping:
            self._driver_loaded(node, loaded, on_node)
        if loaded is not None and node not in self.rdma_shown and "nvidia-peermem-ctr" in _container_names(loaded):
            self.kube.patch("v1", "Node", node, {"status": {"capacity": {RDMA_RESOURCE: RDMA_DEVICES},
                                                            "allocatable": {RDMA_RESOURCE: RDMA_DEVICES}}}, status=True)
            self.rdma_shown.add(node)
        plugins = [p for p in on_node if op.is_device_plugin_pod(_labels(p))]
        if plugins or drivers or node in self.gpus_shown:     # a GPU node, not one that only hosts a pod
            self._show_gpus(node, any(_ready(p) and not _gone(p) for p in plugins))

    def _driver_manager_starts(self, node: str, pod: dict) -> None:
        self.started.add(pod["metadata"]["uid"])
        labels = self.kube.get("v1", "Node", node)["metadata"].get("labels") or {}
        if op.DRIVER_VERSION_LABEL in labels:          # a driver is loaded: evict the operands first
            self._set_deploy_labels(node, paused, labels)
            self.swapping[node] = pod["metadata"]["uid"]
        else:                                          # nothing holds a driver: reschedule, go on
            self._set_deploy_labels(node, restored, labels)
            self._allow(pod)

    def _set_deploy_labels(self, node: str, change, labels: dict[str, str] | None = None) -> None:
        if labels is None:
            labels = self.kube.get("v1", "Node", node)["metadata"].get("labels") or {}
        changed = {key: change(labels[key]) for key in op.OPERAND_DEPLOY_LABELS
                   if key in labels and change(labels[key]) != labels[key]}
        if changed:
            self.kube.patch("v1", "Node", node, {"metadata": {"labels": changed}})

    def _driver_loaded(self, node: str, driver: dict, on_node: list[dict]) -> None:
        version = op.driver_version_of(driver)
        if version and self.driver_written.get(node) != version:
            self.kube.patch("v1", "Node", node, {"metadata": {"labels": driver_labels(version)}})
            self.driver_written[node] = version
        waiting = [p for p in on_node if not _allowed(p) and not _gone(p)
                   and (op.is_validator_pod(_labels(p)) or op.is_device_plugin_pod(_labels(p)))]
        if not waiting:
            return
        annotations = self.kube.get("v1", "Node", node)["metadata"].get("annotations") or {}
        for pod in waiting:
            if not (op.is_validator_pod(_labels(pod)) and annotations.get(VALIDATOR_ANNOTATION) == "never-ready"):
                self._allow(pod)

    def _allow(self, pod: dict) -> None:
        meta = pod["metadata"]
        patched = self.kube.patch("v1", "Pod", meta["name"], {"metadata": {"annotations": {ALLOWED_ANNOTATION: "true"}}},
                                  namespace=meta["namespace"])
        self.pods[meta["uid"]] = patched

    def _show_gpus(self, node: str, registered: bool) -> None:
        if self.gpus_shown.get(node) == registered:
            return
        labels = self.kube.get("v1", "Node", node)["metadata"].get("labels") or {}
        count = labels.get(op.GPU_COUNT_LABEL, "0")
        status = {"allocatable": {op.GPU_RESOURCE: count if registered else "0"}}
        if registered:
            status["capacity"] = {op.GPU_RESOURCE: count}
        self.kube.patch("v1", "Node", node, {"status": status}, status=True)
        self.gpus_shown[node] = registered


def run(kube: Kube, namespace: str, stop: threading.Event) -> None:
    agent = NodeAgent(kube)
    for event in kube.watch("v1", "Pod", stop=stop, namespace=namespace):
        agent.handle(event)


def _serve_health(port: int) -> None:
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--health-port", type=int, required=True)
    args = parser.parse_args()
    _serve_health(args.health_port)
    stop = threading.Event()
    while True:
        try:
            run(Kube.connect(args.kubeconfig, user_agent=USER_AGENT), args.namespace, stop)
        except GpucanaryError as err:
            print(f"node agent: {err}; retrying", flush=True)
            stop.wait(2)


if __name__ == "__main__":
    main()
