"""The node agent as a fleet process: its watches (operator pods, nodes, the collective probe's pods)
feeding one NodeAgent, each reconnected on any error, and its port, which answers /healthz and serves the
kubelet pool nodes' DCGM series at KUBELET_DCGM_PATH. What the agent does with what it sees is node_agent.py.
"""

from __future__ import annotations

import argparse
import http.server
import threading
import time
from collections.abc import Callable

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.errors import GpucanaryError
from pytest_gpucanary.fleet.collective_stand_in import COLLECTIVE_SELECTOR, CollectiveStandIn
from pytest_gpucanary.fleet.dra_slices import SlicePublisher
from pytest_gpucanary.fleet.manifests import DCGM_SERIES, KUBELET_DCGM_PATH
from pytest_gpucanary.fleet.node_agent import NodeAgent
from pytest_gpucanary.kube import Kube

USER_AGENT = "gpucanary-fleet-node-agent"  # not gpucanary/<version>: the audit log tells the canary apart by it


def dcgm_text(nodes: list[dict]) -> str:
    """The kubelet pool nodes' DCGM series in Prometheus' text format, as the fleet's kwok Metric
    serves them for KWOK nodes (manifests.dcgm_metric): per GPU, the driver version label from GFD's
    label, the value from the node's annotation."""
    lines = []
    for name, help_text, annotation in DCGM_SERIES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for node in nodes:
            meta = node["metadata"]
            labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
            value = float(annotations.get(annotation, "0") or 0)
            for gpu in range(int(labels.get(op.GPU_COUNT_LABEL, "0") or 0)):
                series = {
                    "gpu": str(gpu),
                    "UUID": f"GPU-{meta['name']}-{gpu}",
                    "Hostname": meta["name"],
                    "modelName": labels.get("nvidia.com/gpu.product", ""),
                    "DCGM_FI_DRIVER_VERSION": labels.get(op.DRIVER_VERSION_LABEL, ""),
                }
                lines.append(name + "{" + ",".join(f'{k}="{v}"' for k, v in series.items()) + "}" + f" {value:g}")
    return "\n".join(lines) + "\n"


def _watch_forever(
    kubeconfig: str,
    kind: str,
    handler,
    stop: threading.Event,
    *,
    namespace: str | None = None,
    label_selector: str | None = None,
) -> None:
    """One watch of the agent's, reconnected on any error (the fleet's apiserver restarts in the fault tests)."""
    while not stop.is_set():
        try:
            kube = Kube.connect(kubeconfig, user_agent=USER_AGENT)
            for event in kube.watch("v1", kind, stop=stop, namespace=namespace, label_selector=label_selector):
                try:
                    handler(event)
                except GpucanaryError:
                    pass  # the object went away meanwhile; its next event retries
        except GpucanaryError as err:
            print(f"node agent: {kind} watch: {err}; retrying", flush=True)
            stop.wait(2)


def run(agent: NodeAgent, kubeconfig: str, namespace: str, stop: threading.Event) -> None:
    watches = [
        threading.Thread(target=_watch_forever, args=(kubeconfig, "Node", agent.handle_node, stop), daemon=True),
        threading.Thread(
            target=_watch_forever,
            args=(kubeconfig, "Pod", CollectiveStandIn(agent.kube, agent.peermem_ok, agent.lock).handle, stop),
            kwargs={"label_selector": COLLECTIVE_SELECTOR},
            daemon=True,
        ),
    ]
    for watch in watches:
        watch.start()
    _watch_forever(kubeconfig, "Pod", agent.handle, stop, namespace=namespace)


def _serve(port: int, pool_nodes: Callable[[], list[dict]]) -> None:
    """/healthz, and the kubelet pool nodes' DCGM series at KUBELET_DCGM_PATH."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == KUBELET_DCGM_PATH:
                body = dcgm_text(pool_nodes()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()


def _agent(kube: Kube, *, dra: bool) -> NodeAgent:
    return NodeAgent(kube, slices=SlicePublisher(kube) if dra else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--health-port", type=int, required=True)
    parser.add_argument(
        "--dra", action="store_true", help="GPUCluster mode: the KWOK GPU nodes offer their GPUs as ResourceSlices"
    )
    args = parser.parse_args()
    agents: list[NodeAgent] = []
    _serve(args.health_port, lambda: agents[0].kubelet_pool_nodes() if agents else [])
    while True:
        try:
            agents[:] = [_agent(Kube.connect(args.kubeconfig, user_agent=USER_AGENT), dra=args.dra)]
            run(agents[0], args.kubeconfig, args.namespace, threading.Event())
        except GpucanaryError as err:  # the first connection
            print(f"node agent: {err}; retrying", flush=True)
            time.sleep(2)


if __name__ == "__main__":
    main()
