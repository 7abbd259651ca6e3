"""The canary's collective probe on KWOK nodes, which run no process (the node agent's). When both ranks are
Running, it ends them Succeeded with the termination message nccl-tests' summary
would leave: `# Avg bus bandwidth : <GB/s>`, the lower of the two nodes' `gpucanary.io/simulated-busbw-gbps`
(default 24). It never ends them (the all-reduce hangs) when a node is annotated
`gpucanary.io/simulated-collective: never-completes` or its driver pod's nvidia-peermem-ctr is not
ready. Pairs with a real kubelet node are left to the real processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pytest_gpucanary.canary.collective import is_kwok_node
from pytest_gpucanary.canary.workloads import COLLECTIVE_LABEL, COLLECTIVE_ROLE, ROLE_LABEL
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.waits import WatchEvent

COLLECTIVE_ANNOTATION = "gpucanary.io/simulated-collective"  # "never-completes": the all-reduce hangs
BUSBW_ANNOTATION, DEFAULT_BUSBW = "gpucanary.io/simulated-busbw-gbps", "24.0"
COLLECTIVE_SELECTOR = f"{ROLE_LABEL}={COLLECTIVE_ROLE}"


@dataclass
class CollectiveStandIn:
    kube: Kube
    peermem_ok: Callable[[str], bool]  # the node agent's: no GPUDirect RDMA path while peermem is unready
    lock: threading.Lock  # the node agent's: peermem_ok reads the pods it keeps
    probes: dict[str, dict] = field(default_factory=dict)  # uid -> collective probe pod, as last seen

    def handle(self, event: WatchEvent) -> None:
        with self.lock:
            if event.type == "RELISTED":
                self.probes = {p["metadata"]["uid"]: p for p in event.object["items"]}
            elif event.type == "DELETED":
                self.probes.pop(event.object["metadata"]["uid"], None)
            else:
                self.probes[event.object["metadata"]["uid"]] = event.object
            runs: dict[tuple[str, str], list[dict]] = {}
            for pod in self.probes.values():
                key = (pod["metadata"]["namespace"], (pod["metadata"].get("labels") or {}).get(COLLECTIVE_LABEL, ""))
                runs.setdefault(key, []).append(pod)
            for ranks in runs.values():
                if len(ranks) == 2 and all(p.get("status", {}).get("phase") == "Running" for p in ranks):
                    self._all_reduce(ranks)

    def _all_reduce(self, ranks: list[dict]) -> None:
        nodes = [self.kube.get("v1", "Node", p["spec"]["nodeName"]) for p in ranks]
        if not all(is_kwok_node(n) for n in nodes):
            return  # a real kubelet node: its processes do the all-reduce
        annotations = [n["metadata"].get("annotations") or {} for n in nodes]
        if any(a.get(COLLECTIVE_ANNOTATION) == "never-completes" for a in annotations) or any(
            not self.peermem_ok(n["metadata"]["name"]) for n in nodes
        ):
            return  # the all-reduce hangs: the canary's timeout ends it
        busbw = min(float(a.get(BUSBW_ANNOTATION, DEFAULT_BUSBW)) for a in annotations)
        message = f"# Out of bounds values : 0 OK\n# Avg bus bandwidth    : {busbw:.3f}\n"
        now = utc_now()
        for pod in ranks:
            meta = pod["metadata"]
            statuses = [
                {
                    "name": c["name"],
                    "image": c["image"],
                    "imageID": "",
                    "ready": False,
                    "started": False,
                    "restartCount": 0,
                    "state": {
                        "terminated": {
                            "exitCode": 0,
                            "reason": "Completed",
                            "message": message,
                            "finishedAt": now,
                            "startedAt": now,
                        }
                    },
                }
                for c in pod["spec"]["containers"]
            ]
            conditions = [
                {**c, "status": "False", "reason": "PodCompleted", "lastTransitionTime": now}
                if c.get("type") in ("Ready", "ContainersReady")
                else c
                for c in pod["status"].get("conditions") or []
            ]
            self.probes[meta["uid"]] = self.kube.patch(
                "v1",
                "Pod",
                meta["name"],
                {"status": {"phase": "Succeeded", "containerStatuses": statuses, "conditions": conditions}},
                namespace=meta["namespace"],
                status=True,
            )


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
