"""What a real GPU node shows about its driver and KWOK does not: GPU Feature Discovery's driver
labels, which follow the driver that is actually loaded.

On a real node GFD restarts after a driver swap and relabels the node with the loaded version. Here
a driver pod that is Running and Ready stands for a loaded driver, so when one becomes Ready the
agent writes its image's version into the same labels. The DCGM metrics (KWOK Metric objects) read
the version from these labels, so `DCGM_FI_DRIVER_VERSION` follows the node's current driver pod.
This simulates the node, never the upgrade controller: it does not touch upgrade labels or pods.
"""

from __future__ import annotations

import argparse
import http.server
import threading

from pytest_gpucanary.gpu_operator import DRIVER_COMPONENT_SELECTOR, driver_version_of
from pytest_gpucanary.errors import GpucanaryError
from pytest_gpucanary.kube import Kube

DRIVER_VERSION_LABELS = ("nvidia.com/cuda.driver-version.full", "nvidia.com/cuda.driver-version.major",
                         "nvidia.com/cuda.driver-version.minor", "nvidia.com/cuda.driver-version.revision")
USER_AGENT = "gpucanary-fleet-node-agent"   # not gpucanary/<version>: the audit log tells the canary apart by it


def driver_labels(version: str) -> dict[str, str]:
    parts = (version.split(".") + ["", "", ""])[:3]
    return dict(zip(DRIVER_VERSION_LABELS, [version, *parts]))


def _ready(pod: dict) -> bool:
    status = pod.get("status", {})
    statuses = status.get("containerStatuses") or []
    return (status.get("phase") == "Running" and bool(statuses) and all(s.get("ready") for s in statuses)
            and not pod["metadata"].get("deletionTimestamp"))


def run(kube: Kube, namespace: str, stop: threading.Event) -> None:
    labelled: dict[str, str] = {}
    for event in kube.watch("v1", "Pod", stop=stop, namespace=namespace, label_selector=DRIVER_COMPONENT_SELECTOR):
        pods = event.object["items"] if event.type == "RELISTED" else [event.object]
        for pod in pods:
            node = pod.get("spec", {}).get("nodeName")
            if event.type == "DELETED" or not node or not _ready(pod):
                continue
            version = driver_version_of(pod)
            if version and labelled.get(node) != version:
                try:
                    kube.patch("v1", "Node", node, {"metadata": {"labels": driver_labels(version)}})
                    labelled[node] = version
                except GpucanaryError:
                    pass  # the node went away; a later event retries


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
