"""Prometheus checks: the judges on canned series, and every way a query can go unanswered ->
inconclusive, against local stand-in servers (a closed port, a slow one, 5xx, HTML, an error body)."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from typing import Callable, Iterator

import pytest
from harness import eventually
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_gpucanary.ladder import Outcome, Stage
from pytest_gpucanary.canary import metrics
from pytest_gpucanary.canary.metrics import MetricsError, Prometheus, default_answers, node_regex, query, window
from pytest_gpucanary.ladder.metrics import (
    judge_answer, judge_driver_version, judge_upgrade_failed, judge_xid, latest_versions,
)
from pytest_gpucanary.ladder.model import Series

NODES = ["gpu-node-0", "gpu-node-1"]


def xid(node: str, gpu: str, value: float) -> Series:
    return Series({"Hostname": node, "gpu": gpu}, 100.0, value)


def version(node: str, driver: str, t_s: float) -> Series:
    return Series({"Hostname": node, "DCGM_FI_DRIVER_VERSION": driver}, 100.0, t_s)


def test_window_and_node_regex() -> None:
    assert window(0, 0) == "1s" and window(0, 90_500_000_000) == "91s"
    assert node_regex(["b.x", "a"]) == "a|b\\\\.x"      # PromQL string escaping of the RE2 escape


def test_upgrade_failed_judge() -> None:
    assert judge_upgrade_failed([Series({}, 1, 0.0)], span="60s").outcome is Outcome.PASS
    failed = judge_upgrade_failed([Series({}, 1, 2.0)], span="60s")
    assert (failed.outcome, failed.value, failed.stage) == (Outcome.FAIL, 2.0, Stage.ROLLOUT)
    assert judge_upgrade_failed([], span="60s").outcome is Outcome.INCONCLUSIVE


def test_xid_judge_names_the_gpu_and_needs_every_node() -> None:
    clean = [xid(n, g, 0) for n in NODES for g in "01"]
    assert judge_xid(clean, nodes=NODES, span="60s").outcome is Outcome.PASS
    bad = judge_xid(clean + [xid("gpu-node-1", "3", 79)], nodes=NODES, span="60s")
    assert bad.outcome is Outcome.FAIL and "gpu-node-1 GPU 3 reported XID 79" in bad.detail
    partial = judge_xid(clean[:2], nodes=NODES, span="60s")
    assert partial.outcome is Outcome.INCONCLUSIVE and "gpu-node-1" in partial.detail
    assert judge_xid(clean, nodes=[], span="60s").outcome is Outcome.INCONCLUSIVE


def test_an_allowed_xid_does_not_fail_the_check_and_another_still_does() -> None:
    clean = [xid(n, g, 0) for n in NODES for g in "01"]
    app_fault = judge_xid(clean + [xid("gpu-node-0", "1", 43)], nodes=NODES, span="60s", allowed=frozenset({13, 43}))
    assert app_fault.outcome is Outcome.PASS and "allowed XIDs 13, 43 not counted" in app_fault.detail
    fallen_off = judge_xid(clean + [xid("gpu-node-0", "1", 43), xid("gpu-node-1", "0", 79)], nodes=NODES,
                           span="60s", allowed=frozenset({43}))
    assert fallen_off.outcome is Outcome.FAIL and "XID 79" in fallen_off.detail


def test_driver_version_judge_uses_each_nodes_newest_series() -> None:
    upgraded = [version("gpu-node-0", "580.82.07", 10), version("gpu-node-0", "580.95.05", 20),
                version("gpu-node-1", "580.95.05", 20)]
    assert latest_versions(upgraded) == {"gpu-node-0": "580.95.05", "gpu-node-1": "580.95.05"}
    ok = judge_driver_version(upgraded, nodes=NODES, target="580.95.05")
    assert (ok.outcome, ok.value, ok.stage) == (Outcome.PASS, 2.0, Stage.DEVICE)
    wrong = judge_driver_version(upgraded, nodes=NODES, target="590.1")
    assert wrong.outcome is Outcome.FAIL and "gpu-node-0 reports 580.95.05" in wrong.detail
    unlabelled = judge_driver_version([version("gpu-node-0", "", 30)] + upgraded[2:], nodes=NODES,
                                      target="580.95.05")
    assert unlabelled.outcome is Outcome.INCONCLUSIVE and "gpu-node-0" in unlabelled.detail


series = st.lists(st.builds(Series, st.fixed_dictionaries({"Hostname": st.sampled_from(NODES + ["other"]),
                                                          "gpu": st.sampled_from("01"),
                                                          "DCGM_FI_DRIVER_VERSION": st.sampled_from(["", "1", "2"])}),
                            st.just(1.0), st.sampled_from([0.0, 1.0, 79.0])), max_size=8)


@settings(max_examples=300, deadline=None)
@given(series, st.lists(st.sampled_from(NODES), max_size=2, unique=True))
def test_missing_evidence_is_never_pass(found, nodes) -> None:
    for check in (judge_xid(found, nodes=nodes, span="1s"),
                  judge_driver_version(found, nodes=nodes, target="2")):
        covered = set(nodes) <= {s.labels["Hostname"] for s in found if s.labels["DCGM_FI_DRIVER_VERSION"]
                                 or check.name == "no-xid-errors"}
        if check.outcome is Outcome.PASS:
            assert nodes and covered


# --- unanswered queries -------------------------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def stand_in() -> Iterator[Callable[[Callable], str]]:
    servers = []

    def start(respond: Callable[[http.server.BaseHTTPRequestHandler], None]) -> str:
        handler = type("Handler", (http.server.BaseHTTPRequestHandler,),
                       {"do_GET": respond, "log_message": lambda self, *a: None})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()


def _reply(status: int, body: bytes, delay_s: float = 0.0) -> Callable:
    def respond(self: http.server.BaseHTTPRequestHandler) -> None:
        time.sleep(delay_s)
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    return respond


def _all_inconclusive(url: str, *, read_timeout_s: float = 5.0) -> list[str]:
    now = time.time_ns()
    answers = default_answers(url, nodes=NODES, start_wall_ns=now - 60 * 10**9, end_wall_ns=now,
                              read_timeout_s=read_timeout_s)
    assert [a.name for a in answers] == ["no-upgrade-failed", "no-xid-errors", "dcgm-driver-version"]
    checks = [judge_answer(a, nodes=NODES, target="580.82.07") for a in answers]
    assert [c.outcome for c in checks] == [Outcome.INCONCLUSIVE] * 3
    assert all("\n" not in c.detail and c.value is None for c in checks)
    return [c.detail for c in checks]


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The timeout each query gave the Prometheus client, in order."""
    timeouts: list[object] = []
    custom_query = metrics.PrometheusConnect.custom_query

    def spy(self, *args, **kwargs):
        timeouts.append(kwargs.get("timeout"))
        return custom_query(self, *args, **kwargs)

    monkeypatch.setattr(metrics.PrometheusConnect, "custom_query", spy)
    return timeouts


def test_a_closed_port_is_inconclusive_fast(asked: list[object]) -> None:
    details = _all_inconclusive(f"http://127.0.0.1:{_closed_port()}")
    assert "unreachable" in details[0]
    # every query bounded by the configured timeouts, none left to the client's defaults
    assert asked and all(timeout == (metrics.CONNECT_TIMEOUT_S, 5.0) for timeout in asked), asked


def test_a_slow_prometheus_times_out_inconclusive(stand_in, asked: list[object]) -> None:
    received: list[str] = []
    slow = _reply(200, b"{}", delay_s=2.0)

    def respond(self: http.server.BaseHTTPRequestHandler) -> None:
        received.append(self.path)
        slow(self)

    url = stand_in(respond)
    assert "timed out" in _all_inconclusive(url, read_timeout_s=0.3)[0]
    assert asked and all(timeout == (metrics.CONNECT_TIMEOUT_S, 0.3) for timeout in asked), asked
    eventually(lambda: len(received) >= len(asked), timeout_s=30, every_s=0.05)  # the stand-in may still be reading
    assert len(received) == len(asked), received    # read=0 retries: one request per query, not two


def test_5xx_html_and_error_bodies_are_one_line_inconclusive(stand_in) -> None:
    assert "5xx" in _all_inconclusive(stand_in(_reply(503, b"overloaded")))[0]
    assert "did not answer like Prometheus" in _all_inconclusive(stand_in(_reply(200, b"<html>hi</html>")))[0]
    error = json.dumps({"status": "error", "errorType": "bad_data", "error": 'parse error: "x"'}).encode()
    detail = _all_inconclusive(stand_in(_reply(400, error + b" " * 5000)))[0]
    assert detail.endswith('HTTP 400: parse error: "x"') and len(detail) < 200


def test_no_data_is_inconclusive(stand_in) -> None:
    empty = json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}).encode()
    details = _all_inconclusive(stand_in(_reply(200, empty)))
    assert "no max(gpu_operator_nodes_upgrades_failed) samples" in details[0]


def test_query_returns_series_and_refuses_non_vectors(stand_in) -> None:
    vector = {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"job": "a"}, "value": [12.5, "3"]}, {"metric": {"job": "b"}, "value": [12.5, "NaN"]}]}}
    assert query("up", url=stand_in(_reply(200, json.dumps(vector).encode()))) == [Series({"job": "a"}, 12.5, 3.0)]
    scalar = {"status": "success", "data": {"resultType": "scalar", "result": [12.5, "1"]}}
    with pytest.raises(MetricsError, match="instant vector"):
        Prometheus(stand_in(_reply(200, json.dumps(scalar).encode()))).query("scalar(up)")
