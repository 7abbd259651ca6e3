"""The fleet's local ingress: `http://127.0.0.1:<port>/svc/<namespace>/<service>/<path>` routed by the
Service's EndpointSlices.

It simulates the network path only. KWOK pods run no process and their IPs are fake 10.x
addresses, so the ingress never dials them: it answers on behalf of a ready one (200, a tiny JSON
body naming the pod that "served" it, round-robin), or 503 when none is ready. A ready endpoint on a
real kubelet node is a hostNetwork pod serving on 127.0.0.1 (pods there have no route to the host),
so the request is proxied to 127.0.0.1:<the slice's port>, and what the server answers (or 502 when
it refuses or resets the connection) is what the client gets. Readiness comes
from one `Kube.watch` per Service on its EndpointSlices (label kubernetes.io/service-name), started
by the first request for that Service. On a real cluster there is no ingress: the load generator
targets a service URL the user gives. `/metrics` counts what it answered per Service and status code
(`gpucanary_ingress_requests_total`), which the fleet's Prometheus scrapes: a service's error ratio for an
SLO, as a real ingress controller's metrics give one.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import threading
from urllib.parse import urlsplit

from pytest_gpucanary.canary.collective import is_kwok_node
from pytest_gpucanary.errors import GpucanaryError
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.waits import WatchEvent

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SYNC_WAIT_S = 5.0  # a first request waits this long for the initial list, so it is not a false 503
RETRY_S = 1.0
PROXY_TIMEOUT_S = 10.0
USER_AGENT = "gpucanary-fleet-ingress"  # not gpucanary/<version>: the audit log tells the canary apart by it
REQUESTS_METRIC = "gpucanary_ingress_requests_total"


def ready_pods(endpoint_slice: dict) -> tuple[str, ...]:
    """`namespace/name` of every ready endpoint's target pod (the address when it names no pod).

    EndpointSlice semantics: an absent `ready` condition means ready; terminating endpoints are not."""
    found = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        ref = endpoint.get("targetRef") or {}
        if ref.get("name"):
            found.append(f"{ref.get('namespace') or endpoint_slice['metadata'].get('namespace', '')}/{ref['name']}")
        else:
            found.extend(endpoint.get("addresses") or [])
    return tuple(found)


class ServiceEndpoints:
    """Ready endpoints of one Service, kept current by a watch on its EndpointSlices."""

    def __init__(self, kube: Kube, namespace: str, service: str) -> None:
        self.kube, self.namespace, self.service = kube, namespace, service
        self.synced = threading.Event()
        self._slices: dict[str, tuple[str, ...]] = {}
        self._targets: dict[str, tuple[str, int]] = {}  # pod -> (its node, the slice's first port)
        self._lock = threading.Lock()
        self._turn = 0
        self._stop = threading.Event()

    def start(self) -> ServiceEndpoints:
        threading.Thread(target=self._run, name=f"endpoints-{self.namespace}-{self.service}", daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for event in self.kube.watch(
                    "discovery.k8s.io/v1",
                    "EndpointSlice",
                    stop=self._stop,
                    namespace=self.namespace,
                    label_selector=f"{SERVICE_NAME_LABEL}={self.service}",
                ):
                    self.apply(event)
            except GpucanaryError as err:
                print(
                    f"ingress: watch of {self.namespace}/{self.service} endpoints failed: {err}; retrying", flush=True
                )
                self._stop.wait(RETRY_S)

    def apply(self, event: WatchEvent) -> None:
        with self._lock:
            for endpoint_slice in event.object["items"] if event.type == "RELISTED" else [event.object]:
                ports = [p["port"] for p in endpoint_slice.get("ports") or [] if p.get("port")]
                for endpoint in endpoint_slice.get("endpoints") or []:
                    name = (endpoint.get("targetRef") or {}).get("name")
                    if name and endpoint.get("nodeName") and ports:
                        pod = f"{endpoint['targetRef'].get('namespace') or self.namespace}/{name}"
                        self._targets[pod] = (endpoint["nodeName"], ports[0])
            if event.type == "RELISTED":
                self._slices = {s["metadata"]["name"]: ready_pods(s) for s in event.object["items"]}
                self.synced.set()
            elif event.type == "DELETED":
                self._slices.pop(event.object["metadata"]["name"], None)
            else:
                self._slices[event.object["metadata"]["name"]] = ready_pods(event.object)

    def target(self, pod: str) -> tuple[str, int] | None:
        """(node, port) of a picked pod, when its EndpointSlice names them."""
        with self._lock:
            return self._targets.get(pod)

    def pick(self) -> str | None:
        """The next ready pod, round-robin; None when none is ready."""
        with self._lock:
            pods = sorted({pod for pods in self._slices.values() for pod in pods})
            if not pods:
                return None
            self._turn += 1
            return pods[self._turn % len(pods)]


class Router:
    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._services: dict[tuple[str, str], ServiceEndpoints] = {}
        self._kwok: dict[str, bool] = {}  # node -> it is a KWOK node
        self._answered: dict[tuple[str, str, int], int] = {}  # (namespace, service, status) -> requests
        self._lock = threading.Lock()

    def endpoints(self, namespace: str, service: str) -> ServiceEndpoints:
        with self._lock:
            key = (namespace, service)
            if key not in self._services:
                self._services[key] = ServiceEndpoints(self.kube, namespace, service).start()
            return self._services[key]

    def is_kwok(self, node: str) -> bool:
        with self._lock:
            known = self._kwok.get(node)
        if known is None:
            try:
                known = is_kwok_node(self.kube.get("v1", "Node", node))
            except GpucanaryError:
                return True  # not known (yet): answer for it as for a KWOK pod
            with self._lock:
                self._kwok[node] = known
        return known

    def answer(self, path: str) -> tuple[int, bytes]:
        url = urlsplit(path)
        parts = url.path.split("/")
        if len(parts) < 4 or parts[1] != "svc" or not parts[2] or not parts[3]:
            return _json(404, {"error": "expected /svc/<namespace>/<service>/<path>"})
        namespace, service = parts[2], parts[3]
        status, body = self._route(namespace, service, parts, url.query)
        with self._lock:
            key = (namespace, service, status)
            self._answered[key] = self._answered.get(key, 0) + 1
        return status, body

    def metrics(self) -> bytes:
        """The Prometheus text exposition of what `answer` answered."""
        with self._lock:
            answered = sorted(self._answered.items())
        lines = [
            f"# HELP {REQUESTS_METRIC} Requests the fleet's ingress answered, by Service and status code.",
            f"# TYPE {REQUESTS_METRIC} counter",
        ]
        lines += [
            f'{REQUESTS_METRIC}{{namespace="{namespace}",service="{service}",code="{status}"}} {count}'
            for (namespace, service, status), count in answered
        ]
        return ("\n".join(lines) + "\n").encode()

    def _route(self, namespace: str, service: str, parts: list[str], query: str) -> tuple[int, bytes]:
        endpoints = self.endpoints(namespace, service)
        if not endpoints.synced.wait(SYNC_WAIT_S):
            return _json(503, {"error": f"endpoints of {namespace}/{service} not known yet", "service": service})
        pod = endpoints.pick()
        if pod is None:
            return _json(503, {"error": f"no ready endpoint for {namespace}/{service}", "service": service})
        target = endpoints.target(pod)
        if target is not None and not self.is_kwok(target[0]):
            return _proxy(target[1], "/" + "/".join(parts[4:]) + (f"?{query}" if query else ""))
        return _json(200, {"served_by": pod, "service": f"{namespace}/{service}"})


def _json(status: int, body: dict) -> tuple[int, bytes]:
    return status, json.dumps(body).encode()


def _proxy(port: int, path: str) -> tuple[int, bytes]:
    """GET `path` from the server on 127.0.0.1:`port`; 502 when it refuses, resets or times out."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=PROXY_TIMEOUT_S)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException) as err:
        return _json(502, {"error": f"upstream 127.0.0.1:{port}: {err}"})
    finally:
        connection.close()


def _handler(router: Router) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a load generator reuses its connections
        disable_nagle_algorithm = True  # headers and body go out in two writes; Nagle would hold the body ~40 ms

        def _reply(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            kind = "application/json"
            if self.path == "/healthz":
                status, data = _json(200, {"status": "ok"})
            elif self.path == "/metrics":
                status, data, kind = 200, router.metrics(), "text/plain; version=0.0.4"
            else:
                status, data = router.answer(self.path)
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _reply

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def serve(router: Router, port: int, *, host: str = "127.0.0.1") -> http.server.ThreadingHTTPServer:
    """Bind the ingress (not yet serving); call `serve_forever()` on the result."""
    return http.server.ThreadingHTTPServer((host, port), _handler(router))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    try:
        server = serve(Router(Kube.connect(args.kubeconfig, user_agent=USER_AGENT)), args.port)
    except (GpucanaryError, OSError) as err:
        raise SystemExit(f"ingress: cannot start on 127.0.0.1:{args.port}: {err}") from None
    server.serve_forever()


if __name__ == "__main__":
    main()
