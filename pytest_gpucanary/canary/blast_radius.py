"""ClusterPolicy mode, watched for real: the target driver must reach no node outside the pool.

In ClusterPolicy mode the target version is the whole cluster's; only the operator's skip label on
every other driver node keeps it on the pool. From the apply to the restore this watches every Node
and every driver pod. A GPU node that appears without the hold (an autoscaler, a repair), or a driver
pod outside the pool that runs the target version (a held node whose driver pod was recreated from
the DaemonSet's current template), is a breach: the run stops waiting, fails at `rollout` naming the
node, and restores at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from pytest_gpucanary.errors import GpucanaryError
from pytest_gpucanary.gpu_operator import (
    DRIVER_COMPONENT_SELECTOR,
    GPU_PRESENT_LABEL,
    SKIP_LABEL,
    driver_version_of,
    image_at_version,
)
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.waits import WatchEvent


@dataclass
class BlastRadiusWatch:
    kube: Kube
    pool_nodes: tuple[str, ...]
    target: str
    breaches: list[str] = field(default_factory=list)  # one line each, in the order seen
    _seen: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _started_mono: float = 0.0

    def start(self) -> BlastRadiusWatch:
        self._started_mono = time.monotonic()
        for target, name in ((self._nodes, "nodes"), (self._driver_pods, "driver-pods")):
            thread = threading.Thread(target=self._guarded, args=(target,), name=f"gpucanary-blast-{name}", daemon=True)
            self._threads.append(thread)
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)

    def _guarded(self, follow) -> None:
        while not self._stop.is_set():
            try:
                follow()
                return
            except GpucanaryError:
                self._stop.wait(2.0)  # the watch relists after an outage: nothing is missed, only late

    def sweep(self) -> None:
        """One read of every node and driver pod, for what the watches have not delivered yet (before a verdict)."""
        for node in self.kube.each("v1", "Node"):
            self._check_node(node)
        for pod in self.kube.each("v1", "Pod", label_selector=DRIVER_COMPONENT_SELECTOR):
            self._check_pod(pod)

    def _nodes(self) -> None:
        for event in self.kube.watch("v1", "Node", stop=self._stop):
            for node in _objects(event):
                self._check_node(node)

    def _driver_pods(self) -> None:
        for event in self.kube.watch("v1", "Pod", stop=self._stop, label_selector=DRIVER_COMPONENT_SELECTOR):
            for pod in _objects(event):
                self._check_pod(pod)

    def _check_node(self, node: dict) -> None:
        meta = node["metadata"]
        labels = meta.get("labels") or {}
        if (
            meta["name"] not in self.pool_nodes
            and labels.get(GPU_PRESENT_LABEL) == "true"
            and labels.get(SKIP_LABEL) != "true"
        ):
            self._breach(
                meta["name"],
                f"GPU node {meta['name']} is not held back from the ClusterPolicy's "
                f"target {self.target} (it joined, or its hold was taken off)",
            )

    def _check_pod(self, pod: dict) -> None:
        node = (pod.get("spec") or {}).get("nodeName")
        if (
            node
            and node not in self.pool_nodes
            and any(image_at_version(c.get("image", ""), self.target) for c in pod["spec"].get("containers", []))
        ):
            self._breach(
                node,
                f"driver pod {pod['metadata'].get('namespace')}/{pod['metadata']['name']} on "
                f"node {node}, outside the pool, runs the target {driver_version_of(pod)}",
            )

    def _breach(self, node: str, line: str) -> None:
        with self._lock:
            if node in self._seen:
                return
            self._seen.add(node)
            self.breaches.append(f"blast radius: {line} at +{time.monotonic() - self._started_mono:.0f}s")


def _objects(event: WatchEvent) -> list[dict]:
    if event.type == "RELISTED":
        return list(event.object["items"])
    return [] if event.type == "DELETED" else [event.object]
