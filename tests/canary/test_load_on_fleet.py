"""Load through the fleet's ingress, and the Prometheus checks, on the real local fleet.

The service's pod is pinned to the CPU node by a label this test owns; taking the label away before
evicting the pod leaves its replacement Pending, so the 503 window is held open by the scheduler,
not by a sleep. Rates measured here are printed (run with -s) and recorded as JUnit properties.
"""

from __future__ import annotations

import collections
import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest
from harness import eventually

from pytest_gpucanary.canary import metrics
from pytest_gpucanary.ladder.metrics import judge_answer
from pytest_gpucanary.fleet.manifests import CPU_NODE_NAME, gpu_node_name
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.ladder import Outcome, PhaseStats
from pytest_gpucanary.canary.load import LoadRun
from pytest_gpucanary.ladder.model import Sample
from pytest_gpucanary.ladder.phases import phase_stats, rate_series
from pytest_gpucanary.canary.recorder import Recorder, StreamSpec
from pytest_gpucanary.ladder.timeline import UpgradePhase

pytestmark = [pytest.mark.e2e]

FLEET_DRIVER = "580.82.07"
XID_ANNOTATION = "gpucanary.io/simulated-xid"


@dataclass(frozen=True)
class Served:
    namespace: str
    name: str
    url: str
    placement_label: str          # on the CPU node; the pod's nodeSelector needs it


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def until_status(url: str, status: int, *, timeout_s: float) -> tuple[float, dict]:
    """Ask the ingress, as a client would, until it answers `status`; (seconds it took, body)."""
    started = time.monotonic()
    while True:
        code, body = _get(url)
        if code == status:
            return time.monotonic() - started, body
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{url} still answered {code} {body} after {timeout_s:.0f} s, expected {status}")
        time.sleep(0.02)


def _label_cpu_node(kube: Kube, key: str, value: str | None) -> None:
    kube.patch("v1", "Node", CPU_NODE_NAME, {"metadata": {"labels": {key: value}}})


@pytest.fixture
def served(kube: Kube, namespace: str, gpucanary_fleet) -> Iterator[Served]:
    """A one-replica Deployment + Service on the CPU node, answering 200 through the ingress."""
    key = f"gpucanary.io/serve-{namespace}"
    labels = {"app": "web"}
    _label_cpu_node(kube, key, "yes")
    try:
        kube.create({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": namespace},
                     "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
                         "metadata": {"labels": labels},
                         "spec": {"nodeSelector": {key: "yes"}, "terminationGracePeriodSeconds": 1,
                                  "containers": [{"name": "web", "image": "web"}]}}}})
        kube.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": namespace},
                     "spec": {"selector": labels, "ports": [{"port": 80}]}})
        kube.wait_for("apps/v1", "Deployment", "web", lambda d: d.get("status", {}).get("readyReplicas") == 1,
                      namespace=namespace, timeout_s=60)
        url = gpucanary_fleet.fleet.service_url(namespace, "web")
        until_status(url + "/", 200, timeout_s=15)
        yield Served(namespace, "web", url, key)
    finally:
        _label_cpu_node(kube, key, None)


def _web_pod(kube: Kube, served: Served) -> str:
    [pod] = [p["metadata"]["name"] for p in kube.list("v1", "Pod", namespace=served.namespace, label_selector="app=web")
             if not p["metadata"].get("deletionTimestamp")]
    return pod


def _take_away(kube: Kube, served: Served) -> str:
    """Unplaceable replacement, then evict the serving pod; returns the evicted pod's name."""
    pod = _web_pod(kube, served)
    _label_cpu_node(kube, served.placement_label, None)
    kube.evict(pod, namespace=served.namespace)
    return pod


def test_ingress_answers_for_the_ready_pod_then_503_after_eviction(kube: Kube, served: Served) -> None:
    pod = _web_pod(kube, served)
    assert _get(served.url + "/orders?id=7") == (200, {"served_by": f"{served.namespace}/{pod}",
                                                       "service": f"{served.namespace}/web"})
    _take_away(kube, served)
    took_s, body = until_status(served.url + "/", 503, timeout_s=15)
    assert body["error"] == f"no ready endpoint for {served.namespace}/web"
    kube.wait_for("v1", "Pod", _web_pod(kube, served), lambda p: p["status"].get("phase") == "Pending",
                  namespace=served.namespace, timeout_s=15)
    assert _get(served.url + "/")[0] == 503           # the replacement cannot run: still no endpoint
    _label_cpu_node(kube, served.placement_label, "yes")
    _, body = until_status(served.url + "/", 200, timeout_s=60)
    assert body["served_by"] != f"{served.namespace}/{pod}"
    print(f"\ningress: 503 {took_s:.2f} s after the eviction request (client clock, 20 ms polling)")


def _wait_samples(run: LoadRun, predicate: Callable[[list[Sample]], bool], *, timeout_s: float, what: str) -> None:
    eventually(lambda: predicate(run.samples()) or not run.running(), timeout_s=timeout_s, every_s=0.2)
    assert predicate(run.samples()), f"{what} not seen in the load samples: {run.error()}"


def test_locust_run_sees_the_outage_and_the_recovery(kube: Kube, served: Served, tmp_path: Path) -> None:
    with LoadRun(served.url, users=5, spawn_rate=5, run_time_s=25, log_dir=tmp_path) as run:
        _wait_samples(run, lambda s: sum(x.status == 200 for x in s) >= 50, timeout_s=15, what="50 answers")
        evicted_ns = time.time_ns()
        _take_away(kube, served)
        _wait_samples(run, lambda s: any(x.status == 503 for x in s), timeout_s=10, what="a 503")
        time.sleep(2)
        restored_ns = time.time_ns()
        _label_cpu_node(kube, served.placement_label, "yes")
        assert run.wait(timeout_s=60) == 1           # locust exits 1 when any request failed
    samples = run.samples()
    statuses = collections.Counter(s.status for s in samples)
    assert set(statuses) == {200, 503}, statuses
    assert all(s.status == 200 for s in samples if s.t_ns < evicted_ns)
    first_503 = min(s.t_ns for s in samples if s.status == 503)
    assert evicted_ns < first_503 < restored_ns
    assert any(s.status == 200 for s in samples if s.t_ns > restored_ns), "no recovery within the run"
    points = rate_series(samples)
    assert sum(p.errors for p in points) == statuses[503] and len(points) >= 20


@pytest.fixture
def node_records(kube: Kube, tmp_path: Path) -> Iterator[Recorder]:
    with Recorder(kube, tmp_path / "timeline.jsonl", [StreamSpec("nodes", "v1", "Node")]) as recorder:
        recorder.wait_for(lambda rs: True if rs else None, timeout_s=30, what="the first node list")
        yield recorder


def _measure(url: str, log_dir: Path, *, workers: int) -> tuple[list[Sample], float]:
    """A closed-loop run with no think time; the rate after a 2 s warm-up (requests/s, request start times)."""
    run = LoadRun(url, users=20, spawn_rate=100, run_time_s=15, workers=workers, wait_s=0, log_dir=log_dir).start()
    try:
        assert run.wait(timeout_s=90) == 0, run.error() or run.output_path.read_text()[-500:]
    finally:
        run.stop()
    samples = run.samples()
    warm = samples[0].t_ns + 2 * 10**9
    steady = [s for s in samples if s.t_ns >= warm]
    return samples, len(steady) / ((steady[-1].t_ns - warm) / 1e9)


def test_one_process_and_two_workers_give_the_same_phase_results(
        served: Served, node_records: Recorder, tmp_path: Path, record_property) -> None:
    results: dict[int, tuple[PhaseStats, ...]] = {}
    for workers in (0, 2):
        samples, rate = _measure(served.url, tmp_path / f"workers-{workers}", workers=workers)
        assert len(list((tmp_path / f"workers-{workers}").glob("samples.jsonl.*"))) == max(1, workers)
        record_property(f"ingress_rps_{workers or 1}_process" + ("es" if workers else ""), round(rate))
        print(f"\nload: {rate:.0f} requests/s through the ingress with {workers or 'no'} workers "
              f"({len(samples)} requests, 20 users, no wait; load generator wall clock)")
        assert rate > 50
        results[workers] = phase_stats(samples, node_records.records, gpu_node_name(0))
        assert sum(s.requests for s in results[workers]) == len(samples)
    for stats in results.values():                    # no upgrade ran: everything is before
        assert [type(s) for s in stats] == [PhaseStats] * 4
        assert [s.phase for s in stats] == list(UpgradePhase)
        assert stats[0].failures == 0 and stats[0].p50_s <= stats[0].p95_s <= stats[0].p99_s
        assert [s.requests for s in stats[1:]] == [0, 0, 0]


# --- Prometheus -----------------------------------------------------------------------------------

@pytest.fixture
def prometheus(gpucanary_fleet) -> Iterator[metrics.Prometheus]:
    with metrics.Prometheus(gpucanary_fleet.fleet.prometheus_url) as prom:
        yield prom


def judged(answer, *, nodes=(), target: str = FLEET_DRIVER):
    """A query's answer judged as the ladder judges a run's."""
    return judge_answer(answer, nodes=nodes, target=target)


def _last_s(seconds: int) -> dict[str, int]:
    now = time.time_ns()
    return {"start_wall_ns": now - seconds * 10**9, "end_wall_ns": now}


def test_operator_reports_no_failed_upgrade(prometheus: metrics.Prometheus) -> None:
    check = judged(metrics.ask_upgrade_failed(prometheus, **_last_s(30)))
    assert (check.outcome, check.value) == (Outcome.PASS, 0.0), check.detail


def test_dcgm_driver_version_of_a_fleet_node(prometheus: metrics.Prometheus) -> None:
    node = [gpu_node_name(0)]
    right = judged(metrics.ask_driver_version(prometheus, nodes=node), nodes=node)
    assert right.outcome is Outcome.PASS, right.detail
    wrong = judged(metrics.ask_driver_version(prometheus, nodes=node), nodes=node, target="590.48.01")
    assert wrong.outcome is Outcome.FAIL and f"reports {FLEET_DRIVER}" in wrong.detail
    missing = judged(metrics.ask_driver_version(prometheus, nodes=["no-such-node"]), nodes=["no-such-node"])
    assert missing.outcome is Outcome.INCONCLUSIVE


def test_xid_errors_pass_clean_and_fail_once_a_gpu_reports_one(kube: Kube, prometheus: metrics.Prometheus) -> None:
    clean = judged(metrics.ask_xid_errors(prometheus, nodes=[gpu_node_name(0)], **_last_s(30)), nodes=[gpu_node_name(0)])
    assert clean.outcome is Outcome.PASS, clean.detail
    kube.patch("v1", "Node", CPU_NODE_NAME, {"metadata": {"annotations": {XID_ANNOTATION: "79"}}})
    try:  # kwok serves the annotation at the next scrape (5 s); wait for Prometheus, bounded
        def check_now():
            return judged(metrics.ask_xid_errors(prometheus, nodes=[CPU_NODE_NAME], **_last_s(30)), nodes=[CPU_NODE_NAME])

        eventually(lambda: check_now().outcome is Outcome.FAIL, timeout_s=30)
        check = check_now()
    finally:
        kube.patch("v1", "Node", CPU_NODE_NAME, {"metadata": {"annotations": {XID_ANNOTATION: None}}})
    assert check.outcome is Outcome.FAIL and "reported XID 79" in check.detail, check.detail


def test_prometheus_on_a_closed_port_is_inconclusive(gpucanary_fleet) -> None:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    answers = metrics.default_answers(closed, nodes=[gpu_node_name(0)], **_last_s(60))
    checks = [judged(a, nodes=[gpu_node_name(0)]) for a in answers]
    assert [c.outcome for c in checks] == [Outcome.INCONCLUSIVE] * 3
    assert all("unreachable" in c.detail for c in checks)
