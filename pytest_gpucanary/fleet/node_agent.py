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
  validator, device plugin and DRA kubelet plugin pods become Ready, as their init containers wait for the driver. A
  node annotated `gpucanary.io/simulated-validator: never-ready` keeps its validator pods unready.
- **Device plugin.** `nvidia.com/gpu` allocatable is the node's GPU count while a device plugin pod
  is Ready on it and 0 otherwise, as the kubelet shows it when the plugin unregisters and registers.
- **DRA kubelet plugin** (GPUCluster mode, `GPUCANARY_FLEET_DRA`): the node's GPUs as ResourceSlices while the
  operator's DRA kubelet plugin pod is Ready on a loaded driver (`dra_slices`), instead of `nvidia.com/gpu`. The
  driver manager drains the plugin last, after the other operands, as k8s-driver-manager v0.12.0 does
  (`evictKubeletPlugin`: it serves the claims of the pods evicted before it).
- **RDMA devices.** A node whose driver pod runs `nvidia-peermem-ctr` (GPUDirect RDMA) shows the RDMA
  shared device plugin's `rdma/rdma_shared_device_a` in its allocatable.
- **peermem lost.** On a node annotated `gpucanary.io/simulated-peermem: lost`, once the node is back in
  service (upgrade-done), the driver pod that came with the swap loses nvidia_peermem: its
  `nvidia-peermem-ctr` fails its liveness probe (`nvidia-driver probe_nvidia_peermem`), restarts and
  stays unready, as when a MOFED reinstall unloads the module and it does not load again.
- **Collective probe** on KWOK nodes: `collective_stand_in`.

- **Kubelet pool nodes** (real nodes, whose driver manager, driver, validator, device plugin and GFD are
  processes there, GFD's labels written by nfd-master): only what no process there does yet, DCGM series
  (at KUBELET_DCGM_PATH on the agent's port, which the fleet's Prometheus scrapes) as kwok serves them for
  KWOK nodes, from the driver version in GFD's labels (in GPUCluster mode, which has no GFD, from the node's Ready
  driver pod).

This stands in for the node, never for the upgrade controller: it writes no upgrade-state label and
deletes no pod. It writes nothing to a real kubelet node.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.canary.collective import is_kwok_node
from pytest_gpucanary.canary.pool import DRIVER_POOL_LABEL
from pytest_gpucanary.errors import GpucanaryError
from pytest_gpucanary.fleet.collective_stand_in import utc_now
from pytest_gpucanary.fleet.dra_slices import SlicePublisher
from pytest_gpucanary.fleet.images import GPU_PRODUCT
from pytest_gpucanary.fleet.kubelet_node import GPUS_PER_NODE, NODE_KIND_LABEL
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.waits import WatchEvent

DRIVER_VERSION_LABELS = (
    op.DRIVER_VERSION_LABEL,
    "nvidia.com/cuda.driver-version.major",
    "nvidia.com/cuda.driver-version.minor",
    "nvidia.com/cuda.driver-version.revision",
)
ALLOWED_ANNOTATION = "gpucanary.io/simulated-ready"
VALIDATOR_ANNOTATION = "gpucanary.io/simulated-validator"  # "never-ready": validators on the node stay unready
# The Network Operator's RDMA shared device plugin (k8s-rdma-shared-dev-plugin), on a node whose driver
# pod runs nvidia-peermem: its devices do not depend on the GPU driver, so they stay through a swap.
RDMA_RESOURCE, RDMA_DEVICES = "rdma/rdma_shared_device_a", "63"
PEERMEM_ANNOTATION = "gpucanary.io/simulated-peermem"  # "lost": peermem gone once the node is back
PEERMEM = "nvidia-peermem-ctr"
ALL_DEPLOY_LABELS = (*op.OPERAND_DEPLOY_LABELS, op.DRA_DRIVER_DEPLOY_LABEL)  # what the driver manager restores


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
    pods: dict[str, dict] = field(default_factory=dict)  # uid -> operator pod, as last seen
    started: set[str] = field(default_factory=set)  # driver pods whose driver manager ran
    swapping: dict[str, str] = field(default_factory=dict)  # node -> driver pod waiting for its operands
    driver_written: dict[str, str] = field(default_factory=dict)  # node -> version in its GFD labels
    gpus_shown: dict[str, bool] = field(default_factory=dict)  # node -> allocatable shows its GPUs
    rdma_shown: set[str] = field(default_factory=set)  # nodes given their RDMA devices
    swapped: set[str] = field(default_factory=set)  # driver pods that came with a driver swap
    kwok_nodes: dict[str, bool] = field(default_factory=dict)  # node -> it is a KWOK node
    kubelet_pool: dict[str, dict] = field(default_factory=dict)  # kubelet pool node -> Node, as last seen
    slices: SlicePublisher | None = None  # each KWOK GPU node's GPUs as gpu.nvidia.com ResourceSlices too
    lock: threading.Lock = field(default_factory=threading.Lock)  # one watch thread per kind

    def handle(self, event: WatchEvent) -> None:
        with self.lock:
            self._handle(event)

    def _handle(self, event: WatchEvent) -> None:
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
        for node in sorted(n for n in nodes if n and self._kwok(n)):
            try:
                self.step(node)
            except GpucanaryError:
                pass  # the node or pod went away meanwhile; its next event retries

    def _kwok(self, node: str) -> bool:
        """A KWOK node (a real kubelet node's processes do all of this themselves). The Node watch
        records every node; one the Pod watch sees first is read once."""
        if node not in self.kwok_nodes:
            try:
                self.kwok_nodes[node] = is_kwok_node(self.kube.get("v1", "Node", node))
            except GpucanaryError:
                return False
        return self.kwok_nodes[node]

    def step(self, node: str) -> None:
        on_node = [p for p in self.pods.values() if p["spec"].get("nodeName") == node]
        drivers = [p for p in on_node if op.is_driver_pod(_labels(p)) and not _gone(p)]
        for pod in drivers:
            if not _ready(pod) and not _allowed(pod) and pod["metadata"]["uid"] not in self.started:
                self._driver_manager_starts(node, pod)
        swap = self.swapping.get(node)
        if swap is not None and swap not in self.pods:
            del self.swapping[node]  # its pod went away mid-swap: the labels stay paused until the next one
        elif swap is not None and not any(_labels(p).get("app") in op.OPERAND_APPS for p in on_node):
            if any(op.is_dra_kubelet_plugin_pod(_labels(p)) for p in on_node):
                self._set_deploy_labels(node, paused, keys=(op.DRA_DRIVER_DEPLOY_LABEL,))
            else:
                self._set_deploy_labels(node, restored, keys=ALL_DEPLOY_LABELS)
                self._allow(self.pods[swap])
                self.swapped.add(swap)
                del self.swapping[node]
        loaded = next((p for p in drivers if _ready(p)), None)
        if loaded is not None and node not in self.swapping:
            self._driver_loaded(node, loaded, on_node)
        if loaded is not None and node not in self.rdma_shown and "nvidia-peermem-ctr" in _container_names(loaded):
            self.kube.patch(
                "v1",
                "Node",
                node,
                {"status": {"capacity": {RDMA_RESOURCE: RDMA_DEVICES}, "allocatable": {RDMA_RESOURCE: RDMA_DEVICES}}},
                status=True,
            )
            self.rdma_shown.add(node)
        is_plugin = op.is_dra_kubelet_plugin_pod if self.slices else op.is_device_plugin_pod
        plugins = [p for p in on_node if is_plugin(_labels(p))]
        shown = node in (self.slices.shown if self.slices else self.gpus_shown)
        if plugins or drivers or shown:  # a GPU node, not one that only hosts a pod
            registered = any(_ready(p) and not _gone(p) for p in plugins)
            if self.slices:
                self.slices.show(node, op.driver_version_of(loaded) if registered and loaded else None)
            else:
                self._show_gpus(node, registered)

    def _driver_manager_starts(self, node: str, pod: dict) -> None:
        self.started.add(pod["metadata"]["uid"])
        labels = self.kube.get("v1", "Node", node)["metadata"].get("labels") or {}
        if op.DRIVER_VERSION_LABEL in labels:  # a driver is loaded: evict the operands first
            self._set_deploy_labels(node, paused, labels)
            self.swapping[node] = pod["metadata"]["uid"]
        else:  # nothing holds a driver: reschedule, go on
            self._set_deploy_labels(node, restored, labels, keys=ALL_DEPLOY_LABELS)
            self._allow(pod)

    def _set_deploy_labels(
        self,
        node: str,
        change,
        labels: dict[str, str] | None = None,
        keys: tuple[str, ...] = op.OPERAND_DEPLOY_LABELS,
    ) -> None:
        if labels is None:
            labels = self.kube.get("v1", "Node", node)["metadata"].get("labels") or {}
        changed = {key: change(labels[key]) for key in keys if key in labels and change(labels[key]) != labels[key]}
        if changed:
            self.kube.patch("v1", "Node", node, {"metadata": {"labels": changed}})

    def _write_driver_labels(self, node: str, driver: dict) -> None:
        """GFD's driver labels at the version of the node's Ready driver pod."""
        version = op.driver_version_of(driver)
        if version and self.driver_written.get(node) != version:
            self.kube.patch("v1", "Node", node, {"metadata": {"labels": driver_labels(version)}})
            self.driver_written[node] = version

    def _driver_loaded(self, node: str, driver: dict, on_node: list[dict]) -> None:
        self._write_driver_labels(node, driver)
        waiting = [
            p
            for p in on_node
            if not _allowed(p)
            and not _gone(p)
            and (
                op.is_validator_pod(_labels(p))
                or op.is_device_plugin_pod(_labels(p))
                or op.is_dra_kubelet_plugin_pod(_labels(p))
            )
        ]
        if not waiting:
            return
        annotations = self.kube.get("v1", "Node", node)["metadata"].get("annotations") or {}
        for pod in waiting:
            if not (op.is_validator_pod(_labels(pod)) and annotations.get(VALIDATOR_ANNOTATION) == "never-ready"):
                self._allow(pod)

    def _allow(self, pod: dict) -> None:
        meta = pod["metadata"]
        patched = self.kube.patch(
            "v1",
            "Pod",
            meta["name"],
            {"metadata": {"annotations": {ALLOWED_ANNOTATION: "true"}}},
            namespace=meta["namespace"],
        )
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

    def kubelet_pool_nodes(self) -> list[dict]:
        """The kubelet pool nodes, each with the GFD labels its DCGM series read. In GPUCluster mode no GFD labels a
        node: it gets the GPU count and product of the fleet's GPUs and the version of its Ready driver pod, as DCGM
        reads them from the loaded driver (none while no driver is loaded)."""
        with self.lock:
            return [self._with_gfd_labels(node) for node in self.kubelet_pool.values()]

    def _with_gfd_labels(self, node: dict) -> dict:
        labels = node["metadata"].get("labels") or {}
        if self.slices is None or op.GPU_COUNT_LABEL in labels:
            return node
        name = node["metadata"]["name"]
        loaded = next(
            (
                p
                for p in self.pods.values()
                if p["spec"].get("nodeName") == name and op.is_driver_pod(_labels(p)) and _ready(p) and not _gone(p)
            ),
            None,
        )
        version = op.driver_version_of(loaded) if loaded else None
        if not version:
            return node
        gfd = {op.GPU_COUNT_LABEL: str(GPUS_PER_NODE), "nvidia.com/gpu.product": GPU_PRODUCT} | driver_labels(version)
        return {**node, "metadata": {**node["metadata"], "labels": labels | gfd}}

    # --- peermem lost, once the node is back in service --------------------------------------------

    def handle_node(self, event: WatchEvent) -> None:
        nodes = event.object["items"] if event.type == "RELISTED" else [event.object]
        with self.lock:
            if event.type == "RELISTED":
                self.kubelet_pool.clear()
            for node in nodes:
                meta = node["metadata"]
                self.kwok_nodes[meta["name"]] = is_kwok_node(node)
                labels = meta.get("labels") or {}
                if (
                    event.type == "DELETED"
                    or labels.get(NODE_KIND_LABEL) != "kubelet"
                    or DRIVER_POOL_LABEL not in labels
                ):
                    self.kubelet_pool.pop(meta["name"], None)
                else:
                    self.kubelet_pool[meta["name"]] = node
                if (meta.get("annotations") or {}).get(PEERMEM_ANNOTATION) == "lost" and labels.get(
                    op.UPGRADE_STATE_LABEL
                ) == op.UPGRADE_DONE:
                    for pod in [p for p in self.pods.values() if p["spec"].get("nodeName") == meta["name"]]:
                        if pod["metadata"]["uid"] in self.swapped and _containers_ready(pod).get(PEERMEM):
                            self._lose_peermem(pod)

    def _lose_peermem(self, pod: dict) -> None:
        now = utc_now()
        statuses = [
            {
                **c,
                "ready": False,
                "started": False,
                "restartCount": c.get("restartCount", 0) + 1,
                "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": now}},
                "state": {"running": {"startedAt": now}},
            }
            if c.get("name") == PEERMEM
            else c
            for c in pod["status"].get("containerStatuses") or []
        ]
        conditions = [
            {**c, "status": "False", "reason": "ContainersNotReady", "lastTransitionTime": now}
            if c.get("type") in ("Ready", "ContainersReady")
            else c
            for c in pod["status"].get("conditions") or []
        ]
        meta = pod["metadata"]
        self.pods[meta["uid"]] = self.kube.patch(
            "v1",
            "Pod",
            meta["name"],
            {"status": {"containerStatuses": statuses, "conditions": conditions}},
            namespace=meta["namespace"],
            status=True,
        )

    def peermem_ok(self, node: str) -> bool:
        """False while the node's driver pod runs nvidia-peermem-ctr unready: no GPUDirect RDMA path."""
        drivers = [
            p
            for p in self.pods.values()
            if p["spec"].get("nodeName") == node and op.is_driver_pod(_labels(p)) and not _gone(p)
        ]
        return not any(PEERMEM in _containers_ready(p) and not _containers_ready(p)[PEERMEM] for p in drivers)


def _containers_ready(pod: dict) -> dict[str, bool]:
    return {c.get("name", ""): bool(c.get("ready")) for c in pod.get("status", {}).get("containerStatuses") or []}
