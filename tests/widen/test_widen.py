"""`gpucanary widen`: waves from a strategy, the wave rule, the record a resume reads, the receipt, and a whole
sweep over the in-memory apiserver with the operator's part scripted (a node upgrades once released)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from kube_double import FakeKube
from cluster_shapes import ORIGINAL_POLICY, OPERATOR_NS, cluster_policy, driver_daemonset, node   # the same shapes

from pytest_gpucanary.canary import publish
from pytest_gpucanary.canary import apply as upgrade
from pytest_gpucanary.canary.metrics import MetricsError, Series
from pytest_gpucanary.cli import main
from pytest_gpucanary.config import Settings
from pytest_gpucanary.errors import ConfigError, EnvError
from pytest_gpucanary.gpu_operator import CLUSTER_POLICY, SKIP_LABEL, UPGRADE_STATE_LABEL
from pytest_gpucanary.ladder.model import ProbeSeen
from pytest_gpucanary.receipt.verdict import Verdict, VerdictKey
from pytest_gpucanary.shipped import FIXTURES
from pytest_gpucanary.sweep.inventory import load_inventory
from pytest_gpucanary.widen import plan, receipt, state
from pytest_gpucanary.widen.change import release_hold
from pytest_gpucanary.widen.record import read as rollout_read
from pytest_gpucanary.widen.options import WidenOptions
from pytest_gpucanary.widen.rollout import Refused, widen
from pytest_gpucanary.widen.slo import Slo, SloLook
from pytest_gpucanary.widen.state import Disruption, Sweep, Wave
from pytest_gpucanary.widen.watch import NodeSeen, PodWatch, judge

OLD, NEW = "570.172.08", "580.82.07"
POLICY = {"autoUpgrade": True, "maxParallelUpgrades": 0, "maxUnavailable": "100%"}
NODES = [f"gpu-{i}" for i in range(5)]


@pytest.mark.parametrize("text, sizes", [("fixed:2", [2, 2, 1]), ("linear:1", [1, 2, 2]), ("exponential:1", [1, 2, 2]),
                                         ("fixed:9", [5])])
def test_waves_follow_the_strategy_in_node_name_order(text: str, sizes: list[int]) -> None:
    waves = plan.waves(list(reversed(NODES)), plan.Strategy.parse(text))
    assert [len(w) for w in waves] == sizes and [n for w in waves for n in w] == NODES


@pytest.mark.parametrize("text", ["fixed", "fixed:0", "steps:2", "linear:-1", "exponential:x"])
def test_a_strategy_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="is not a wave strategy"):
        plan.Strategy.parse(text)


def seen(state_: str = "upgrade-done", *, ready: bool = True, driver: str = NEW, driver_ready: bool = True) -> NodeSeen:
    return NodeSeen(state_, ready, driver, driver_ready)


def gone(name: str, *, gpus: int = 0, allowed: bool = False, on: str = "gpu-0") -> Disruption:
    return Disruption(on, "default", name, gpus, allowed, 1, "deleted")


def test_a_wave_passes_only_with_every_node_upgraded_ready_and_on_the_target() -> None:
    nodes = ["gpu-0", "gpu-1"]
    assert judge(nodes, {"gpu-0": seen(), "gpu-1": seen()}, [], target=NEW, soaking=False) == (True, "")
    for other in (seen("pod-restart-required"), seen(ready=False), seen(driver=OLD), seen(driver_ready=False)):
        assert judge(nodes, {"gpu-0": seen(), "gpu-1": other}, [], target=NEW, soaking=False) == (False, "")
    assert judge(nodes, {"gpu-0": seen(), "gpu-1": seen("upgrade-failed")}, [], target=NEW, soaking=False)[1] == \
        f"node gpu-1 went upgrade-failed (driver pod at {NEW})"
    assert judge(nodes, {"gpu-0": seen()}, [], target=NEW, soaking=False)[1] == "node gpu-1 was deleted during its wave"


def test_a_pod_the_rule_does_not_allow_fails_the_wave_and_a_gpu_pod_does_not() -> None:
    nodes = ["gpu-0"]
    assert judge(nodes, {"gpu-0": seen()}, [gone("trainer", gpus=1, allowed=True)], target=NEW, soaking=False) == (True, "")
    assert judge(nodes, {"gpu-0": seen()}, [gone("api")], target=NEW, soaking=False)[1] == \
        "pod that uses no GPU default/api deleted on gpu-0, not an allowed eviction"


def test_soaking_a_node_must_stay_upgraded() -> None:
    nodes = ["gpu-0"]
    assert judge(nodes, {"gpu-0": seen()}, [], target=NEW, soaking=True) == (True, "")
    assert judge(nodes, {"gpu-0": seen(ready=False)}, [], target=NEW, soaking=True)[1] == \
        f"node gpu-0 stopped serving on driver {NEW} during the soak: NotReady"
    for other, what in ((NodeSeen("upgrade-done", True, NEW, True, validated=False), "validator not ready"),
                        (NodeSeen("upgrade-done", True, NEW, True, gpus=6, gpus_before=8), "6/8 GPUs allocatable"),
                        (seen(driver=OLD), f"driver {OLD}"), (seen("upgrade-required"), "upgrade-required")):
        assert judge(nodes, {"gpu-0": other}, [], target=NEW, soaking=True)[1] == \
            f"node gpu-0 stopped serving on driver {NEW} during the soak: {what}"


def pod(name: str, node_name: str, *, uid: str, gpus: int = 0, daemonset: bool = False, **meta: object) -> dict:
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    return {"metadata": {"name": name, "namespace": "default", "uid": uid, "labels": {"app": name},
                         **({"ownerReferences": [{"kind": "DaemonSet", "name": "ds"}]} if daemonset else {}), **meta},
            "spec": {"nodeName": node_name, "containers": [{"name": "c", "resources": {"limits": limits}}]}}


def test_the_pod_watch_records_each_pod_that_leaves_a_watched_node_once() -> None:
    watch = PodWatch(FakeKube(), Settings())
    # already going before its node's wave (an earlier drain's grace period): its end is not the wave's doing
    watch._see("ADDED", pod("draining", "gpu-0", uid="0", deletionTimestamp="t"), 9)
    watch.watch_nodes(["gpu-0"])
    watch._see("DELETED", pod("draining", "gpu-0", uid="0"), 10)
    watch._see("RELISTED", {"items": [pod("api", "gpu-0", uid="1"), pod("job", "gpu-0", uid="2", gpus=1),
                                      pod("ds", "gpu-0", uid="3", daemonset=True), pod("x", "gpu-9", uid="4"),
                                      pod("vanishes", "gpu-0", uid="5")]}, 10)
    watch._see("MODIFIED", pod("api", "gpu-0", uid="1", deletionTimestamp="t"), 11)
    watch._see("DELETED", pod("api", "gpu-0", uid="1"), 12)
    watch._see("DELETED", pod("job", "gpu-0", uid="2", gpus=1), 13)
    watch._see("DELETED", pod("ds", "gpu-0", uid="3", daemonset=True), 14)
    watch._see("DELETED", pod("x", "gpu-9", uid="4"), 15)
    watch._see("RELISTED", {"items": []}, 16)            # the watch was down while it went
    evicted = pod("cache", "gpu-0", uid="6")
    evicted["status"] = {"phase": "Failed", "reason": "Evicted"}
    watch._see("MODIFIED", evicted, 17)
    found = [(d.name, d.gpus, d.allowed, d.wall_ns, d.how) for d in watch.take()]
    assert found == [("api", 0, False, 11, "deleted"), ("job", 1, True, 13, "deleted"),
                     ("vanishes", 0, False, 16, "deleted"), ("cache", 0, False, 17, "evicted by the kubelet")]
    assert watch.take() == []


def test_a_pod_that_holds_its_gpus_through_a_dra_claim_counts_as_a_gpu_pod_even_once_its_claim_is_gone() -> None:
    fake = FakeKube()
    fake.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                 "metadata": {"name": "trainer-gpus-x1", "namespace": "default"},
                 "status": {"allocation": {"devices": {"results": [
                     {"request": "gpus", "driver": "gpu.nvidia.com", "pool": "gpu-0", "device": "gpu-3"}]}}}})
    watch = PodWatch(fake, Settings())
    watch.watch_nodes(["gpu-0"])
    trainer = pod("trainer", "gpu-0", uid="7")
    trainer["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": "gpus-1"}]
    trainer["status"] = {"resourceClaimStatuses": [{"name": "gpus", "resourceClaimName": "trainer-gpus-x1"}]}
    watch._see("ADDED", trainer, 20)
    fake.delete("resource.k8s.io/v1", "ResourceClaim", "trainer-gpus-x1", namespace="default")
    watch._see("DELETED", trainer, 21)
    assert [(d.name, d.gpus, d.allowed) for d in watch.take()] == [("trainer", 1, True)]


def sweep_of(*outcomes: str) -> Sweep:
    waves = [Wave(nodes=[n], outcome=o, started_wall_ns=10**18 if o != "pending" else 0,
                  ended_wall_ns=10**18 + 5 * 10**9 if o in ("passed", "failed") else 0,
                  states={n: [(10**18, "upgrade-required"), (10**18 + 10**9, "upgrade-done")]} if o != "pending" else {})
             for n, o in zip(NODES, outcomes)]
    if "failed" in outcomes:
        waves[outcomes.index("failed")].signal = "pod that uses no GPU default/api deleted on gpu-1, not an allowed eviction"
        waves[outcomes.index("failed")].disruptions = [gone("api", on=NODES[outcomes.index("failed")])]
    return Sweep("widen-0a1b2c3d", VerdictKey.of(POLICY, NEW, "v26.7.0"), ("nvidia.com/v1", "ClusterPolicy", "cp"), OLD,
                 "fixed:1", 10.0, waves, "r1", status="halted" if "failed" in outcomes else "done", started_wall_ns=10**18)


def test_the_record_round_trips_through_its_configmap() -> None:
    sweep = sweep_of("passed", "failed", "pending")
    data = sweep.data()
    assert all(isinstance(v, str) for v in data.values()) and data["status"] == "halted"
    assert Sweep.from_data(data) == sweep
    assert sweep.current() == 1 and sweep_of("passed").current() is None
    assert state.configmap_name(sweep.key).startswith("gpucanary-widen-") and len(state.configmap_name(sweep.key)) <= 63


def test_the_receipt_names_the_failed_wave_and_has_a_testcase_per_wave() -> None:
    sweep = sweep_of("passed", "failed", "pending")
    assert receipt.headline(sweep) == ("widen halted: wave 2/3 failed: pod that uses no GPU default/api deleted on "
                                       "gpu-1, not an allowed eviction")
    junit = receipt.render_junit(sweep)
    assert junit.count("<testcase ") == 3 and junit.count("<failure") == 1 and junit.count("<skipped") == 1
    markdown = receipt.render_markdown(sweep)
    assert "| 2 | failed | gpu-1 |" in markdown and "(not allowed)" in markdown
    page = receipt.render_html(sweep)
    assert page.count("<rect ") == 4 and "stroke=\"#d50000\"" in page      # two states on two nodes, one bad removal


# --- a whole sweep over the in-memory apiserver -------------------------------------------------------------

def validator_pod(node_name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"validator-{node_name}", "namespace": OPERATOR_NS,
                         "labels": {"app": "nvidia-operator-validator"},
                         "ownerReferences": [{"kind": "DaemonSet", "name": "nvidia-operator-validator"}]},
            "spec": {"nodeName": node_name, "containers": [{"name": "v", "image": "validator"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def driver_pod(node_name: str, version: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"driver-{node_name}-{version}", "namespace": OPERATOR_NS,
                         "labels": {"app.kubernetes.io/component": "nvidia-driver"},
                         "ownerReferences": [{"kind": "DaemonSet", "name": "nvidia-driver-daemonset"}]},
            "spec": {"nodeName": node_name, "containers": [{"name": "d", "image": f"nvcr.io/nvidia/driver:{version}-ubuntu22.04"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def fleet(fake: FakeKube) -> None:
    fake.create(cluster_policy(nvidiadriver_mode=False))
    for name in NODES[:3]:
        fake.create({**node(name, **{UPGRADE_STATE_LABEL: "upgrade-done"}),
                     "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
        fake.create(driver_pod(name, OLD))
        fake.create(validator_pod(name))
    fake.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": publish.NAMESPACE}})


def join(fake: FakeKube, name: str) -> None:
    """A new GPU node: its first driver pod comes from the DaemonSet's current template, the target."""
    fake.create({**node(name, **{UPGRADE_STATE_LABEL: "upgrade-done"}),
                 "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    fake.create(driver_pod(name, NEW))
    fake.create(validator_pod(name))


def probe_controllers(fake: FakeKube) -> None:
    """The namespace controller's default ServiceAccount in the sweep's namespace, and for each start probe Job
    the Job controller, scheduler and kubelet at once: its pod scheduled and running."""
    for ns in fake.list("v1", "Namespace"):
        name = ns["metadata"]["name"]
        if not name.startswith("gpucanary-widen-"):
            continue
        if not fake.list("v1", "ServiceAccount", namespace=name):
            fake.create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": name}})
        pods = {p["metadata"]["name"] for p in fake.list("v1", "Pod", namespace=name)}
        for job in fake.list("batch/v1", "Job", namespace=name):
            if (pod := f"{job['metadata']['name']}-pod") not in pods:
                fake.create({"apiVersion": "v1", "kind": "Pod",
                             "metadata": {"name": pod, "namespace": name, "labels": {"job-name": job["metadata"]["name"]}},
                             "spec": {"nodeName": "gpu-2", "containers": [{"name": "probe", "image": "busybox"}]},
                             "status": {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}]}})


def operator(fake: FakeKube, stop: threading.Event, released: list[str]) -> None:
    """The operator's part: a node whose driver pod is behind the ClusterPolicy's version goes to
    upgrade-required, and unless the skip label holds it, is upgraded (new driver pod, upgrade-done); the
    order nodes were upgraded in is kept. A GPU node joins once the first one is upgraded."""
    while not stop.wait(0.02):
        probe_controllers(fake)
        if released == ["gpu-0"] and not any(n["metadata"]["name"] == "gpu-3" for n in fake.list("v1", "Node")):
            join(fake, "gpu-3")
        if fake.get(*CLUSTER_POLICY, "cluster-policy")["spec"]["driver"]["version"] != NEW:
            continue
        behind = {p["spec"]["nodeName"] for p in fake.list("v1", "Pod", namespace=OPERATOR_NS) if p["metadata"]["name"].endswith(OLD)}
        for name in sorted(behind):
            if (fake.get("v1", "Node", name)["metadata"].get("labels") or {}).get(SKIP_LABEL) == "true":
                fake.patch("v1", "Node", name, {"metadata": {"labels": {UPGRADE_STATE_LABEL: "upgrade-required"}}})
                continue
            released.append(name)
            fake.delete("v1", "Pod", f"driver-{name}-{OLD}", namespace=OPERATOR_NS)
            fake.create(driver_pod(name, NEW))
            fake.patch("v1", "Node", name, {"metadata": {"labels": {UPGRADE_STATE_LABEL: "upgrade-done"}}})


def record_verdict(fake: FakeKube, *, passed: bool = True) -> None:
    publish.record(fake, Verdict(VerdictKey.of(POLICY, NEW, None), passed, "r1", time.time_ns(), "", {}))


def test_without_a_passing_verdict_nothing_is_written() -> None:
    fake = FakeKube()
    fleet(fake)
    writes = len(fake.writes)
    options = WidenOptions(POLICY, NEW, plan.Strategy.parse("fixed:1"), soak_s=0)
    with pytest.raises(Refused, match="no canary verdict"):
        widen(fake, options, report=lambda line: None)
    record_verdict(fake, passed=False)
    writes = len(fake.writes)
    with pytest.raises(Refused, match="the canary failed"):
        widen(fake, options, report=lambda line: None)
    assert len(fake.writes) == writes


def test_a_sweep_releases_one_wave_at_a_time_and_keeps_the_change() -> None:
    fake = FakeKube()
    fleet(fake)
    record_verdict(fake)
    stop, released = threading.Event(), []
    thread = threading.Thread(target=operator, args=(fake, stop, released), daemon=True)
    thread.start()
    lines: list[str] = []
    try:
        sweep = widen(fake, WidenOptions(POLICY, NEW, plan.Strategy.parse("exponential:1"), soak_s=0.3, wave_budget_s=30,
                                         settings=Settings(probe_interval_s=0.02, min_probe_samples=2)),
                      report=lines.append)
    finally:
        stop.set()
        thread.join()
    assert sweep.status == "done" and [w.nodes for w in sweep.waves] == [["gpu-0"], ["gpu-1", "gpu-2", "gpu-3"]]
    assert released[0] == "gpu-0" and sorted(released[1:]) == ["gpu-1", "gpu-2"]
    assert "widen: gpu-3 joined, on the target driver from its first install: judged in wave 2" in lines
    assert sweep.waves[1].started_wall_ns >= sweep.waves[0].ended_wall_ns
    policy = fake.get(*CLUSTER_POLICY, "cluster-policy")
    assert policy["spec"]["driver"]["version"] == NEW and policy["spec"]["driver"]["upgradePolicy"].items() >= POLICY.items()
    assert upgrade.SAVED_SPEC_ANNOTATION not in policy["metadata"]["annotations"]
    for name in NODES[:4]:
        meta = fake.get("v1", "Node", name)["metadata"]
        assert SKIP_LABEL not in meta["labels"] and upgrade.SKIP_SET_ANNOTATION not in (meta.get("annotations") or {})
    assert not [n for n in fake.list("v1", "Namespace") if n["metadata"]["name"].startswith("gpucanary-widen")]
    assert lines[-1] == f"widen: every wave passed: 4 nodes on driver {NEW}"
    for wave in sweep.waves:      # the start probes that ran while the wave rolled and soaked
        assert int(wave.probes.split(" start probes ran")[0]) >= 2, wave.probes
    assert [line for line in lines if " passed: " in line and "start probes ran: queue delay max " in line], lines


def probe_seen(name: str, created_s: float, scheduled_s: float | None = None, running_s: float | None = None,
               ended_s: float | None = None) -> ProbeSeen:
    def ns(s: float | None) -> int | None:
        return None if s is None else int(s * 1e9)

    return ProbeSeen(name, "fleet", int(created_s * 1e9), ns(scheduled_s), ns(running_s), "gpu-0", ns(ended_s))


def test_a_waves_start_probes_fail_it_on_queue_delay_start_latency_or_too_few_starts() -> None:
    from pytest_gpucanary.widen.probes import judge

    settings = Settings(max_queue_delay_s=30, max_start_latency_s=20, min_probe_samples=2)
    quick = [probe_seen("p0", 0, 1, 3), probe_seen("p1", 10, 11, 12)]
    assert judge(quick, int(40e9), settings, final=True) == (
        "", "2 start probes ran: queue delay max 1.0 s, start latency p99 3.0 s")
    gone = probe_seen("p2", 15, ended_s=16)          # its pod went before it ran: not a start, not a wait
    assert judge([*quick, gone], int(100e9), settings, final=True)[0] == ""
    waiting = probe_seen("p3", 15)
    assert judge([*quick, waiting], int(40e9), settings, final=False)[0] == (
        "start probes' p99 start latency 25 s (n=3), over --gpucanary-max-start-latency-s 20 s")
    assert judge([*quick, waiting], int(50e9), settings, final=False)[0] == (
        "start probe p3 unscheduled for 35 s, over --gpucanary-max-queue-delay-s 30 s")
    assert judge([*quick, probe_seen("p4", 0, 31, 32)], int(40e9), settings, final=False)[0] == (
        "start probe p4 scheduled after 31 s, over --gpucanary-max-queue-delay-s 30 s")
    assert judge(quick[:1], int(40e9), settings, final=False)[0] == ""
    assert judge(quick[:1], int(40e9), settings, final=True)[0] == (
        "only 1 start probe ran during the wave, fewer than --gpucanary-min-probe-samples 2: no customer start was "
        "measured through it")


def test_a_hold_is_released_only_by_its_own_sweep_and_keeps_the_upgrade_state() -> None:
    fake = FakeKube()
    fake.create(node("gpu-0", **{UPGRADE_STATE_LABEL: "upgrade-done"}))
    applied = upgrade.AppliedUpgrade(run_id="widen-1", prior_version=OLD, operator_namespace=OPERATOR_NS)
    upgrade.hold_back(fake, fake.get("v1", "Node", "gpu-0"), applied, "widen-1")
    fake.patch("v1", "Node", "gpu-0", {"metadata": {"labels": {UPGRADE_STATE_LABEL: "upgrade-required"}}})
    assert not release_hold(fake, "gpu-0", "widen-2")
    assert release_hold(fake, "gpu-0", "widen-1")
    meta = fake.get("v1", "Node", "gpu-0")["metadata"]
    assert meta["labels"][UPGRADE_STATE_LABEL] == "upgrade-required" and SKIP_LABEL not in meta["labels"]
    assert not release_hold(fake, "gpu-0", "widen-1")


def test_an_unfinished_sweep_of_the_same_change_is_refused_before_any_write() -> None:
    fake = FakeKube()
    fleet(fake)
    record_verdict(fake)
    applied = upgrade.AppliedUpgrade(run_id="widen-0a1b2c3d", prior_version=OLD, operator_namespace=OPERATOR_NS)
    upgrade.hold_back(fake, fake.get("v1", "Node", "gpu-2"), applied, "widen-0a1b2c3d")
    halted = sweep_of("passed", "failed", "pending")
    halted.key = VerdictKey.of(POLICY, NEW, None)
    from pytest_gpucanary.widen.record import save

    save(fake, halted)
    writes = len(fake.writes)
    with pytest.raises(EnvError, match="sweep widen-0a1b2c3d of this change is halted"):
        widen(fake, WidenOptions(POLICY, NEW, plan.Strategy.parse("fixed:1")), report=lambda line: None)
    assert len(fake.writes) == writes


@pytest.mark.parametrize("args, line", [
    (["--waves=steps:2"], "gpucanary: error: --waves='steps:2' is not a wave strategy; fixed:N, linear:N or "
                          "exponential:N, with N the first wave's size (e.g. fixed:2), or plan:FILE from `gpucanary "
                          "plan-sweep --json`"),
    (["--waves=plan:/nonexistent.json"], "gpucanary: error: --waves=plan:/nonexistent.json: cannot read it (No such "
                                         "file or directory); the file of `gpucanary plan-sweep --json`"),
    (["--soak-s=-1"], "gpucanary: error: --soak-s=-1 is out of range; 0 or more"),
    (["--wave-budget-s=0"], "gpucanary: error: --wave-budget-s=0 is out of range; 1 or more"),
    (["--max-age-h=nan"], "gpucanary: error: --max-age-h=nan is out of range; 0.01 or more"),
    (["--slo=up"], "gpucanary: error: --slo='up' is not a query and a threshold; e.g. --slo='histogram_quantile(0.99, "
                   "sum by (le) (rate(http_request_duration_seconds_bucket[1m]))) < 0.5'"),
])
def test_gpucanary_widen_refuses_bad_input_in_one_line(args: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["widen", "--gpucanary-policy=fixtures/policies/default.yaml", "--gpucanary-driver-version=580.95.05",
                 *args]) == 4
    assert capsys.readouterr().err.splitlines() == [line]


# --- service SLOs --------------------------------------------------------------------------------------------

class Answers:
    """A Prometheus that answers from a script: a list of series, or a MetricsError to raise."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)

    def query(self, promql: str) -> list:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def series(value: float, **labels: str) -> Series:
    return Series(labels, 0.0, value)


def test_an_slo_is_a_query_and_a_threshold_kept_by_every_series() -> None:
    slo = Slo.parse("histogram_quantile(0.99, sum by (le) (rate(x_bucket[1m]))) <= 0.5")
    assert (slo.query, slo.op, slo.threshold) == ("histogram_quantile(0.99, sum by (le) (rate(x_bucket[1m])))", "<=", 0.5)
    assert slo.broken([series(0.5), series(0.1)]) == ""
    assert slo.broken([series(0.2), series(0.7, __name__="x", service="api")]) == "0.7 on {service=api}"
    assert Slo.parse("sum(up{job='sched-api'}) > 0").broken([series(0)]) == "0"
    for bad in ("up", "up < fast", "< 3"):
        with pytest.raises(ConfigError, match="is not a query and a threshold"):
            Slo.parse(bad)


def test_an_slo_broken_fails_the_wave_at_once_and_unanswered_only_three_looks_in_a_row() -> None:
    slo = Slo.parse("error_ratio < 0.01")
    look = SloLook(Answers([series(0.002)], [], MetricsError("Prometheus at http://p is unreachable (ConnectionError)"),
                           [series(0.001)], [], [], []), [slo])
    assert [look.failure() for _ in range(7)] == ["", "", "", "", "", "",
                                                  "SLO `error_ratio < 0.01` unanswered 3 looks in a row (no series)"]
    assert SloLook(Answers([series(0.02, service="api")]), [slo]).failure() == \
        "SLO `error_ratio < 0.01` broken: 0.02 on {service=api}"


def failing_operator(fake: FakeKube, stop: threading.Event, *, replaced: tuple[str, ...] = ()) -> None:
    """An operator whose upgrade fails on every released node, on the `replaced` ones after their driver pod was
    already the new one; its driver DaemonSet follows the ClusterPolicy."""
    while not stop.wait(0.02):
        probe_controllers(fake)
        version = fake.get(*CLUSTER_POLICY, "cluster-policy")["spec"]["driver"]["version"]
        ds = fake.get("apps/v1", "DaemonSet", "nvidia-driver-daemonset", namespace=OPERATOR_NS)
        if version not in ds["spec"]["template"]["spec"]["containers"][0]["image"]:
            fake.patch("apps/v1", "DaemonSet", "nvidia-driver-daemonset", driver_daemonset(version), namespace=OPERATOR_NS)
            ds = fake.get("apps/v1", "DaemonSet", "nvidia-driver-daemonset", namespace=OPERATOR_NS)
            fake.patch("apps/v1", "DaemonSet", "nvidia-driver-daemonset",
                       {"status": {"observedGeneration": ds["metadata"]["generation"]}}, namespace=OPERATOR_NS)
        for name in NODES[:3]:
            labels = fake.get("v1", "Node", name)["metadata"].get("labels") or {}
            if version != NEW or labels.get(UPGRADE_STATE_LABEL) not in ("upgrade-done", "upgrade-required"):
                continue
            if labels.get(SKIP_LABEL) == "true":        # held: it waits in upgrade-required, however early seen
                fake.patch("v1", "Node", name, {"metadata": {"labels": {UPGRADE_STATE_LABEL: "upgrade-required"}}})
                continue
            if name in replaced:
                fake.delete("v1", "Pod", f"driver-{name}-{OLD}", namespace=OPERATOR_NS)
                fake.create(driver_pod(name, NEW))
            fake.patch("v1", "Node", name, {"metadata": {"labels": {UPGRADE_STATE_LABEL: "upgrade-failed"}}})


@pytest.mark.parametrize("replaced", [(), ("gpu-0",)], ids=["failed-before-its-pod-was-replaced", "after"])
def test_a_failed_wave_halts_and_rollback_restores_the_policy_object_and_releases_the_holds(
        replaced: tuple[str, ...]) -> None:
    fake = FakeKube()
    fleet(fake)
    fake.create(driver_daemonset(OLD))
    record_verdict(fake)
    stop = threading.Event()
    thread = threading.Thread(target=failing_operator, args=(fake, stop), kwargs={"replaced": replaced}, daemon=True)
    thread.start()
    lines: list[str] = []
    try:
        sweep = widen(fake, WidenOptions(POLICY, NEW, plan.Strategy.parse("fixed:1"), soak_s=0, wave_budget_s=30, rollback=True),
                      report=lines.append)
    finally:
        stop.set()
        thread.join()
    assert sweep.status == "rolled-back" and [w.outcome for w in sweep.waves] == ["failed", "pending", "pending"]
    at = NEW if replaced else OLD
    assert f"widen: halted: wave 1/3: node gpu-0 went upgrade-failed (driver pod at {at}); 2 nodes stay on driver {OLD}" in lines
    policy = fake.get(*CLUSTER_POLICY, "cluster-policy")
    assert policy["spec"]["driver"]["version"] == OLD and policy["spec"]["driver"]["upgradePolicy"] == ORIGINAL_POLICY
    for name in NODES[1:3]:
        labels = fake.get("v1", "Node", name)["metadata"]["labels"]
        assert SKIP_LABEL not in labels and labels[UPGRADE_STATE_LABEL] == "upgrade-done"
    assert sweep.rollback.startswith(f"ClusterPolicy cluster-policy restored to driver {OLD} and its earlier upgradePolicy")
    stuck = (f"; gpu-0 stays upgrade-failed and cordoned, its driver pod at {NEW}: `kubectl delete pod -n {OPERATOR_NS} "
             f"-l app.kubernetes.io/component=nvidia-driver --field-selector spec.nodeName=gpu-0` lets the DaemonSet make "
             f"one at {OLD}")
    assert sweep.rollback.endswith(stuck) if replaced else "stays upgrade-failed" not in sweep.rollback, sweep.rollback
    assert state.configmap_name(sweep.key) and fake.get("v1", "ConfigMap", state.configmap_name(sweep.key),
                                                        namespace=publish.NAMESPACE)["data"]["status"] == "rolled-back"


def test_a_held_node_whose_driver_pod_comes_back_at_the_target_halts_the_sweep_naming_it() -> None:
    """The skip label holds the operator's upgrade, not the DaemonSet: a held node's driver pod deleted during
    wave 1 comes back from the new template, and the sweep stops there instead of counting the node as held."""
    fake = FakeKube()
    fleet(fake)
    record_verdict(fake)
    stop, released = threading.Event(), []

    def someone_deletes_a_held_driver_pod() -> None:
        while not stop.wait(0.02):
            if released:       # the DaemonSet controller makes its replacement from the current template
                fake.delete("v1", "Pod", f"driver-gpu-2-{OLD}", namespace=OPERATOR_NS)
                fake.create(driver_pod("gpu-2", NEW))
                return

    threads = [threading.Thread(target=operator, args=(fake, stop, released), daemon=True),
               threading.Thread(target=someone_deletes_a_held_driver_pod, daemon=True)]
    for thread in threads:
        thread.start()
    lines: list[str] = []
    try:
        sweep = widen(fake, WidenOptions(POLICY, NEW, plan.Strategy.parse("fixed:1"), soak_s=5, wave_budget_s=30,
                                         settings=Settings(probe_interval_s=0.02, min_probe_samples=1)),
                      report=lines.append)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert sweep.status == "halted" and [w.outcome for w in sweep.waves][:2] == ["failed", "pending"], sweep.waves
    line = (f"wave 1/3: node gpu-2, held for a later wave, runs driver {NEW} outside its wave: its driver pod "
            f"driver-gpu-2-{NEW} came back from the new template (deleted while held?)")
    assert sweep.waves[0].signal == line.split(": ", 1)[1] and f"widen: halted: {line}; " in "\n".join(lines), lines
    assert released == ["gpu-0"]                             # gpu-1 was never released


def test_a_sweep_whose_start_probes_cannot_start_writes_nothing_that_stays() -> None:
    from pytest_gpucanary.canary.lease import LEASE
    from pytest_gpucanary.kube.errors import Forbidden

    fake = FakeKube()
    fleet(fake)
    record_verdict(fake)
    policy = fake.get(*CLUSTER_POLICY, "cluster-policy")
    fake.fail("create", "Namespace", Forbidden("namespaces is forbidden: cannot create namespaces"))
    with pytest.raises(Forbidden, match="cannot create namespaces"):
        widen(fake, WidenOptions(POLICY, NEW, plan.Strategy.parse("fixed:1"), soak_s=0), report=lambda line: None)
    assert fake.get(*CLUSTER_POLICY, "cluster-policy")["spec"] == policy["spec"]
    assert not [n for n in fake.list("v1", "Node") if SKIP_LABEL in n["metadata"]["labels"]]
    assert not [c for c in fake.list("v1", "ConfigMap", namespace=publish.NAMESPACE)
                if c["metadata"]["name"].startswith(state.CONFIGMAP_PREFIX)]      # no record of a sweep
    assert not fake.list(*LEASE)               # its Lease and the cluster lock released: a new sweep may start


def test_the_waves_of_a_sweep_plan_and_the_nodes_it_does_not_name_last(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    inventory = FIXTURES / "sweep" / "inventory.yaml"
    assert main(["plan-sweep", "--inventory", str(inventory), "--change", "driver=580.95.05", "--json"]) == 0
    planned = tmp_path / "plan.json"
    planned.write_text(capsys.readouterr().out)
    in_plan = [w["nodes"] for w in json.loads(planned.read_text())["plan"]["waves"]]
    nodes = [n.name for n in load_inventory(inventory).fleet.nodes]
    strategy = plan.Strategy.parse(f"plan:{planned}")
    assert str(strategy) == f"plan:{planned}"
    waves = plan.waves(nodes, strategy)
    named = {n for wave in in_plan for n in wave}
    assert waves[:len(in_plan)] == in_plan and sorted(n for w in waves for n in w) == sorted(nodes)
    assert waves[len(in_plan):] == ([sorted(set(nodes) - named)] if set(nodes) - named else [])
    with pytest.raises(ConfigError, match="names nodes this change does not reach: "):
        plan.waves(nodes[1:], strategy)
    planned.write_text("{}")
    with pytest.raises(ConfigError, match="is not the JSON of `gpucanary plan-sweep --json`"):
        plan.Strategy.parse(f"plan:{planned}")


def test_holds_on_an_nvidiadrivers_nodes_wait_only_for_its_own_daemonsets() -> None:
    fake = FakeKube()
    for owner, version in (("fleet", OLD), ("canary-pool", NEW)):     # another NVIDIADriver's DaemonSet at another version
        ds = driver_daemonset(version)
        ds["metadata"] |= {"name": f"nvidia-gpu-driver-{owner}",
                           "ownerReferences": [{"kind": "NVIDIADriver", "name": owner, "controller": True}]}
        fake.create(ds)
    fake.create(node("gpu-0", **{UPGRADE_STATE_LABEL: "upgrade-done"}))
    applied = upgrade.AppliedUpgrade(run_id="widen-1", prior_version=OLD, operator_namespace=OPERATOR_NS,
                                     nvidiadriver="fleet")
    upgrade.hold_back(fake, fake.get("v1", "Node", "gpu-0"), applied, "widen-1")
    held = [{"kind": "Node", "metadata": fake.get("v1", "Node", "gpu-0")["metadata"]}]
    from pytest_gpucanary.canary.cleanup import _release_holds

    assert _release_holds(fake, "widen-1", held, lambda line: None) == 1
    assert SKIP_LABEL not in fake.get("v1", "Node", "gpu-0")["metadata"]["labels"]


def test_a_pod_watch_that_cannot_read_fails_the_wave_and_a_watch_that_came_back_does_not() -> None:
    from pytest_gpucanary.kube.errors import Forbidden
    from pytest_gpucanary.widen.watch import wait_and_judge

    fake = FakeKube()
    fleet(fake)
    fake.fail_watch("Pod", Forbidden("pods is forbidden: cannot watch pods at the cluster scope"))
    for _ in range(20):
        fake.fail_watch("Pod", Forbidden("pods is forbidden: cannot watch pods at the cluster scope"))
    watch = PodWatch(fake, Settings()).start()
    try:
        failure = wait_and_judge(fake, watch, SloLook(None, []), ["gpu-0"], OPERATOR_NS, target=OLD, seconds=30,
                                 soaking=True, record=lambda seen, found: None, customers=lambda: "", tick_s=0.05)
    finally:
        watch.stop()
    assert failure.startswith("pods cannot be watched: ") and failure.endswith("(3 looks in a row)"), failure


def test_a_failed_wave_is_never_resumed_and_a_rolled_back_sweep_neither() -> None:
    fake = FakeKube()
    fleet(fake)
    record_verdict(fake)
    halted = sweep_of("passed", "failed", "pending")
    halted.key, halted.status = VerdictKey.of(POLICY, NEW, None), "running"    # killed while it rolled back
    from pytest_gpucanary.widen.record import save

    save(fake, halted)
    resume = WidenOptions(POLICY, NEW, plan.Strategy.parse("fixed:1"), resume=True)
    with pytest.raises(ConfigError, match="no sweep of this change is under way"):
        widen(fake, resume, report=lambda line: None)
    halted.waves[1].outcome = "pending"                   # cleaned up: nothing of it left in the cluster
    save(fake, halted)
    writes = len(fake.writes)
    with pytest.raises(ConfigError, match="change is no longer in the cluster"):
        widen(fake, resume, report=lambda line: None)
    assert len(fake.writes) == writes


def test_a_new_sweep_replaces_the_record_of_a_finished_one_and_never_a_running_ones() -> None:
    from pytest_gpucanary.widen.record import save

    fake = FakeKube()
    fleet(fake)
    first = sweep_of("failed", "pending")
    save(fake, first)
    second = sweep_of("pending", "pending")
    second.run_id = "widen-99999999"
    with pytest.raises(EnvError, match="records sweep widen-0a1b2c3d, not widen-99999999"):
        save(fake, second)
    save(fake, second, replaces=first.run_id)
    assert rollout_read(fake, second.key).run_id == "widen-99999999"


def test_an_nvidiadriver_an_administrator_did_not_mark_for_widen_is_refused_in_one_line() -> None:
    from pytest_gpucanary.cluster import ClusterInfo
    from pytest_gpucanary.gpu_operator import NVIDIADRIVER
    from pytest_gpucanary.widen.scope import WIDEN_ELIGIBLE_LABEL, target

    fake = FakeKube()
    fake.create({"apiVersion": NVIDIADRIVER[0], "kind": NVIDIADRIVER[1], "metadata": {"name": "fleet"},
                 "spec": {"version": OLD}})
    cluster = ClusterInfo("cluster-policy", True, True, OPERATOR_NS, ())
    with pytest.raises(ConfigError) as refused:
        target(fake, cluster, None, print)
    assert str(refused.value) == f"NVIDIADriver fleet is not marked for gpucanary widen (no {WIDEN_ELIGIBLE_LABEL}=true)" \
        f"; an administrator marks the NVIDIADrivers a sweep may roll out: kubectl label nvidiadriver fleet " \
        f"{WIDEN_ELIGIBLE_LABEL}=true"
    fake.patch(*NVIDIADRIVER, "fleet", {"metadata": {"labels": {WIDEN_ELIGIBLE_LABEL: "true"}}})
    assert target(fake, cluster, None, print) == ((*NVIDIADRIVER, "fleet"), OLD, [])


def test_a_resume_before_v26_7_writes_the_nvidiadrivers_version_the_killed_sweep_had_not() -> None:
    """Before v26.7 an NVIDIADriver's change is two writes (the ClusterPolicy's policy, then its version): a sweep
    killed between them is resumed with the second, and the first one's saved copy of the prior policy kept."""
    from cluster_shapes import DRIVER_FROM, content, nvidiadriver_cluster

    from pytest_gpucanary.canary.cleanup import leftovers
    from pytest_gpucanary.gpu_operator import NVIDIADRIVER
    from pytest_gpucanary.widen.change import applied, apply

    fake = FakeKube()
    cluster, _ = nvidiadriver_cluster(fake, per_driver_policy=False)
    before = {key: content(obj) for key, obj in fake.objects().items()}
    sweep = Sweep("widen-0a1b2c3d", VerdictKey.of(POLICY, NEW, None), (*NVIDIADRIVER, "fleet"), DRIVER_FROM, "fixed:1",
                  0.0, [Wave(nodes=["gpu-1"])], "r1")
    killed = applied(cluster, sweep, None)
    upgrade.apply_cluster_policy(fake, cluster, {"upgradePolicy": POLICY}, killed, sweep.run_id)   # then SIGKILL
    saved = fake.get(*CLUSTER_POLICY, "cluster-policy")["metadata"]["annotations"][upgrade.SAVED_SPEC_ANNOTATION]
    resumed = applied(cluster, sweep, leftovers(fake, [], only=sweep.run_id)[sweep.run_id])
    lines: list[str] = []
    apply(fake, cluster, WidenOptions(POLICY, NEW, plan.Strategy.parse("fixed:1")), sweep, resumed, lines.append)
    assert fake.get(*NVIDIADRIVER, "fleet")["spec"]["version"] == NEW
    assert fake.get(*CLUSTER_POLICY, "cluster-policy")["metadata"]["annotations"][upgrade.SAVED_SPEC_ANNOTATION] == saved
    assert lines == [f"widen: 1 nodes held on driver {DRIVER_FROM}; wrote NVIDIADriver fleet: version"]
    apply(fake, cluster, WidenOptions(POLICY, NEW, plan.Strategy.parse("fixed:1")), sweep, resumed, lines.append)
    assert len(lines) == 1                   # resumed again: the change is whole, nothing is written twice
    assert upgrade.saved_json(fake.get(*NVIDIADRIVER, "fleet"), upgrade.SAVED_SPEC_ANNOTATION)["spec"] == {
        "version": DRIVER_FROM}
    for kind, name in resumed.saved:         # what a restore puts back: each object as it was before the sweep
        upgrade.restore_saved_spec(fake, kind, name, sweep.run_id)
        assert content(fake.get(*kind, name)) == before[(*kind, None, name)]


@pytest.mark.parametrize("pool_nodes", [(), ("canary-x-0",)])
def test_a_fleet_probe_keeps_off_canary_pools_with_an_affinity_the_apiserver_accepts(pool_nodes: tuple[str, ...]) -> None:
    """The apiserver refuses an In or NotIn expression without values (422): widen's probes have no pool."""
    from pytest_gpucanary.canary import workloads

    job = workloads.probe(None, workloads.Placement("gpucanary-widen-1", "widen-1", ""), scope="fleet", seq=3,
                          pool_nodes=pool_nodes)
    [term] = job["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all(e["values"] for e in term["matchExpressions"] if e["operator"] in ("In", "NotIn")), term
    hostnames = [e["values"] for e in term["matchExpressions"] if e["key"] == "kubernetes.io/hostname"]
    assert hostnames == ([list(pool_nodes)] if pool_nodes else [])
    assert job["metadata"]["name"] == "probe-fleet-0003"
