"""The fleet ingress' routing on canned EndpointSlice watch events (no cluster): readiness, round-robin,
503 when nothing is ready, and the HTTP surface on a loopback port."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
import urllib.request
from typing import Iterator

import pytest

from pytest_gpucanary.fleet import ingress
from pytest_gpucanary.kube.waits import WatchEvent


def endpoint_slice(name: str, *pods: tuple[str, bool | None]) -> dict:
    endpoints = []
    for pod, ready in pods:
        conditions = {} if ready is None else {"ready": ready}
        endpoints.append({"addresses": [f"10.244.0.{len(endpoints) + 1}"], "conditions": conditions,
                          "targetRef": {"kind": "Pod", "namespace": "shop", "name": pod}})
    return {"metadata": {"name": name, "namespace": "shop"}, "endpoints": endpoints}


def event(kind: str, obj: dict) -> WatchEvent:
    return WatchEvent(kind, obj, 0, 0)


def test_ready_pods_follow_endpointslice_semantics() -> None:
    found = ingress.ready_pods(endpoint_slice("s", ("a", True), ("b", False), ("c", None)))
    assert found == ("shop/a", "shop/c")                 # an absent ready condition means ready
    no_ref = {"metadata": {"name": "s"}, "endpoints": [{"addresses": ["10.0.0.9"], "conditions": {"ready": True}}]}
    assert ingress.ready_pods(no_ref) == ("10.0.0.9",)
    assert ingress.ready_pods({"metadata": {"name": "s"}, "endpoints": None}) == ()


class NoKube:
    """The router only hands this to a watch thread; these tests feed events by hand."""

    def watch(self, *args: object, stop: threading.Event, **kwargs: object) -> Iterator[WatchEvent]:
        stop.wait()
        return iter(())


def test_round_robin_over_ready_pods_across_slices_then_503() -> None:
    endpoints = ingress.ServiceEndpoints(NoKube(), "shop", "api")
    assert endpoints.pick() is None
    endpoints.apply(event("RELISTED", {"items": [endpoint_slice("s1", ("a", True)),
                                                 endpoint_slice("s2", ("b", True), ("x", False))]}))
    assert endpoints.synced.is_set()
    assert sorted(endpoints.pick() for _ in range(4)) == ["shop/a", "shop/a", "shop/b", "shop/b"]
    endpoints.apply(event("MODIFIED", endpoint_slice("s1", ("a", False))))
    assert {endpoints.pick() for _ in range(3)} == {"shop/b"}
    endpoints.apply(event("DELETED", endpoint_slice("s2")))
    assert endpoints.pick() is None


@pytest.fixture
def served() -> Iterator[tuple[str, ingress.Router]]:
    router = ingress.Router(NoKube())
    server = ingress.serve(router, 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", router
    server.shutdown()


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_http_surface(served, monkeypatch: pytest.MonkeyPatch) -> None:
    url, router = served
    monkeypatch.setattr(ingress, "SYNC_WAIT_S", 0.1)
    assert _get(f"{url}/healthz") == (200, {"status": "ok"})
    assert _get(f"{url}/elsewhere")[0] == 404
    status, body = _get(f"{url}/svc/shop/api/orders?id=1")
    assert status == 503 and "not known yet" in body["error"]      # the first list has not arrived
    router.endpoints("shop", "api").apply(event("RELISTED", {"items": [endpoint_slice("s1", ("a", True))]}))
    assert _get(f"{url}/svc/shop/api/orders?id=1") == (200, {"served_by": "shop/a", "service": "shop/api"})
    router.endpoints("shop", "api").apply(event("MODIFIED", endpoint_slice("s1", ("a", False))))
    status, body = _get(f"{url}/svc/shop/api/")
    assert status == 503 and body["error"] == "no ready endpoint for shop/api"
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:    # what it answered, for an SLO
        assert response.headers["Content-Type"].startswith("text/plain")
        exposition = response.read().decode()
    assert [line for line in exposition.splitlines() if not line.startswith("#")] == [
        'gpucanary_ingress_requests_total{namespace="shop",service="api",code="200"} 1',
        'gpucanary_ingress_requests_total{namespace="shop",service="api",code="503"} 2']
    assert "# TYPE gpucanary_ingress_requests_total counter" in exposition


class RealNodeKube(NoKube):
    """Every node is a real kubelet node (no kwok annotation)."""

    def get(self, api_version: str, kind: str, name: str, **kwargs: object) -> dict:
        return {"metadata": {"name": name, "annotations": {}}}


def test_an_endpoint_on_a_real_node_is_proxied_to_its_loopback_server(monkeypatch: pytest.MonkeyPatch) -> None:
    class Upstream(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"upstream_path": self.path}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = upstream.server_address[1]
    router = ingress.Router(RealNodeKube())
    monkeypatch.setattr(ingress, "SYNC_WAIT_S", 0.1)
    router.endpoints("shop", "api").apply(event("RELISTED", {"items": [{
        "metadata": {"name": "s1"}, "ports": [{"name": "http", "port": port}],
        "endpoints": [{"addresses": ["192.0.2.2"], "nodeName": "gpu-kubelet-0", "conditions": {"ready": True},
                       "targetRef": {"kind": "Pod", "namespace": "shop", "name": "a"}}]}]}))
    status, body = router.answer("/svc/shop/api/orders?id=1")
    assert (status, json.loads(body)) == (200, {"upstream_path": "/orders?id=1"})
    upstream.shutdown()
    upstream.server_close()
    status, body = router.answer("/svc/shop/api/orders")          # the server is gone: connection refused
    assert status == 502 and f"127.0.0.1:{port}" in json.loads(body)["error"]
