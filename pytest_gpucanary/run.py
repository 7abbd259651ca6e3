"""One canary run: pool, policy, workloads, recorder, probes, upgrade, ladder, receipt, restore.

`CanaryRun.execute()` touches the cluster only after the policy and options are validated, and it
restores everything it changed on the way out, also on Ctrl-C and SIGTERM (both end as
KeyboardInterrupt here). Objects it creates carry the run id, so `gpucanary cleanup` finds what a
killed run left.
"""

from __future__ import annotations

import contextlib
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from pytest_gpucanary import cluster as cluster_info
from pytest_gpucanary import metrics, phases, timeline, upgrade, workloads
from pytest_gpucanary.config import Settings
from pytest_gpucanary.kube import Kube, NotFound, owned_labels
from pytest_gpucanary.load import LoadRun
from pytest_gpucanary.pool import Pool, PoolProvider
from pytest_gpucanary.probes import ProbeLoop, ProbeSeen
from pytest_gpucanary.progress import ProgressLine
from pytest_gpucanary.recorder import Recorder, StreamSpec

if TYPE_CHECKING:
    from pytest_gpucanary.fleet import Fleet

WORKLOAD_READY_TIMEOUT_S = 180
WARM_UP_REQUESTS = 20


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4]


@dataclass
class RunOutcome:
    """Everything a gate test, the receipt and the CLI need after the run."""

    run_id: str
    report_dir: Path
    pool: Pool
    driver_to: str
    upgrade_started_wall_ns: int | None = None
    finished_wall_ns: int | None = None
    records: list = field(default_factory=list)
    probes: list[ProbeSeen] = field(default_factory=list)
    gpu_job: tuple[str, str] = ("", "")
    gpu_job_uid: str = ""
    service: tuple[str, str] = ("", "")
    allow_inconclusive: bool = False
    metric_checks: list = field(default_factory=list)    # ladder.MetricCheck from Prometheus
    service_phases: list = field(default_factory=list)   # ladder.PhaseStats from the load generator
    load_rate: list = field(default_factory=list)        # phases.RatePoint per second
    load_measured_from_ns: int = 0
    upgrade_policy: dict = field(default_factory=dict)   # the CR upgradePolicy the run applied
    result: object = None          # ladder.LadderResult
    receipt: dict = field(default_factory=dict)

    def verdict(self, stage: str):
        return next(v for v in self.result.verdicts if v.stage.value == stage)

    def evictions(self) -> list[timeline.PodGone]:
        """Pods removed from the pool nodes during the run, in the order first seen."""
        return [gone for node in self.pool.nodes for gone in timeline.pods_gone(self.records, node)]

    def validator_results(self) -> list[dict]:
        """The last state seen of each nvidia-operator-validator pod on the pool."""
        latest: dict[str, dict] = {}
        for r in self.records:
            if r.kind == "Pod" and r.object.get("metadata", {}).get("labels", {}).get("app") == "nvidia-operator-validator":
                latest[r.object["metadata"]["uid"]] = {"name": r.name, "node": r.object["spec"].get("nodeName"),
                                                       "phase": r.object.get("status", {}).get("phase"),
                                                       "deleted": r.type == "DELETED"}
        return list(latest.values())

    def queue_delays_s(self) -> list[float]:
        """Pool probes: created -> scheduled, client receive times (wall clock)."""
        return [(p.scheduled_wall_ns - p.created_wall_ns) / 1e9 for p in self.probes
                if p.scope == "pool" and p.scheduled_wall_ns]

    def start_latencies_s(self) -> list[float]:
        """Fleet probes: created -> Running, client receive times (wall clock)."""
        return [(p.running_wall_ns - p.created_wall_ns) / 1e9 for p in self.probes
                if p.scope == "fleet" and p.running_wall_ns]

    def upgrade_timeline(self) -> list[timeline.Transition]:
        return [t for node in self.pool.nodes
                for t in timeline.label_transitions(self.records, node, timeline.UPGRADE_STATE_LABEL)]


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every cleanup callback runs."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler) if _main_thread() else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class CanaryRun:
    def __init__(self, settings: Settings, kube: Kube, provider: PoolProvider, *, progress: ProgressLine,
                 fleet: Fleet | None = None) -> None:
        self.settings, self.kube, self.provider, self.progress = settings, kube, provider, progress
        self.fleet = fleet    # the local fleet when it is the target: its ingress and Prometheus

    def execute(self) -> RunOutcome:
        from pytest_gpucanary.policy import load_policy

        settings = self.settings
        settings.require_gate_inputs()
        policy = load_policy(settings.policy)           # refuse bad input before touching the cluster
        cluster = cluster_info.discover(self.kube)       # read-only
        run_id = settings.run_id or new_run_id()
        self.progress.line(f"run {run_id}: operator in {cluster.mode} mode, namespace {cluster.operator_namespace}")
        with sigterm_as_interrupt(), contextlib.ExitStack() as cleanup:
            cleanup.callback(self.progress.line, "cleanup done: the cluster is as the run found it")
            pool = self.provider.provision(self.kube, cluster, run_id=run_id)
            cleanup.callback(self.provider.release, self.kube)
            outcome = RunOutcome(run_id, settings.reports_dir / run_id, pool, settings.driver_version,
                                 allow_inconclusive=settings.allow_inconclusive)
            self.progress.line(f"pool {', '.join(pool.nodes)} ({self.provider.name}), driver {pool.driver_from} "
                               f"-> {settings.driver_version}")
            placement = workloads.Placement(f"gpucanary-{run_id}", run_id, pool.nodes[0])
            self._create_namespace(placement, cleanup)
            recorder = Recorder(self.kube, outcome.report_dir / "timeline.jsonl", self._streams(pool, placement))
            cleanup.enter_context(recorder)
            self._place_workloads(placement, outcome, recorder)
            load = self._start_load(outcome, cleanup)
            probes = ProbeLoop(self.kube, placement, manifest=settings.probe, interval_s=settings.probe_interval_s,
                               pool_nodes=pool.nodes)
            cleanup.callback(probes.stop)
            probes.start()
            outcome.upgrade_policy = policy.to_cr()
            applied = upgrade.apply(self.kube, cluster, pool, outcome.upgrade_policy, driver_to=settings.driver_version,
                                    run_id=run_id)
            cleanup.callback(self._restore, applied, placement)
            outcome.upgrade_started_wall_ns = time.time_ns()
            self.progress.line(f"policy {settings.policy} applied; upgrading the pool")
            self._watch_upgrade(pool, recorder, probes)
            self._settle(pool, recorder, probes, placement)
            outcome.records, outcome.probes = list(recorder.records), probes.results(recorder.records)
            outcome.finished_wall_ns = time.time_ns()
            self._collect_load(load, outcome)
            self._collect_metrics(outcome)
            from pytest_gpucanary.evaluate import evaluate_and_write

            evaluate_and_write(outcome, settings, policy_path=settings.policy)
            self.progress.line("restoring the cluster")
        return outcome

    def _create_namespace(self, placement: workloads.Placement, cleanup: contextlib.ExitStack) -> None:
        self.kube.create({"apiVersion": "v1", "kind": "Namespace",
                          "metadata": {"name": placement.namespace, "labels": owned_labels(placement.run_id)}})
        cleanup.callback(self._delete_quietly, "v1", "Namespace", placement.namespace)
        self.kube.wait_for("v1", "ServiceAccount", "default", lambda sa: True, namespace=placement.namespace,
                           timeout_s=60)

    def _restore(self, applied: upgrade.AppliedUpgrade, placement: workloads.Placement) -> None:
        """Take the canary's workloads off first: the rollback to the original version runs under the
        original policy, which may refuse exactly the pods the canary placed (e.g. the /dev/shm job)."""
        self._delete_quietly("v1", "Namespace", placement.namespace)
        try:
            self.kube.wait_gone("v1", "Namespace", placement.namespace, timeout_s=180)
        except TimeoutError as err:
            self.progress.line(f"{err}; restoring anyway")
        upgrade.restore(self.kube, applied)

    def _delete_quietly(self, api_version: str, kind: str, name: str) -> None:
        with contextlib.suppress(NotFound):
            self.kube.delete(api_version, kind, name)

    def _streams(self, pool: Pool, placement: workloads.Placement) -> list[StreamSpec]:
        streams = [StreamSpec("canary-pods", "v1", "Pod", namespace=placement.namespace),
                   StreamSpec("canary-events", "v1", "Event", namespace=placement.namespace)]
        for node in pool.nodes:
            streams += [
                StreamSpec(f"node-{node}", "v1", "Node", field_selector=f"metadata.name={node}"),
                StreamSpec(f"pods-{node}", "v1", "Pod", field_selector=f"spec.nodeName={node}"),
                StreamSpec(f"events-{node}", "v1", "Event", namespace="default",
                           field_selector=f"involvedObject.kind=Node,involvedObject.name={node}"),
            ]
        return streams

    def _place_workloads(self, placement: workloads.Placement, outcome: RunOutcome, recorder: Recorder) -> None:
        settings = self.settings
        job = workloads.gpu_job(settings.gpu_job, placement, duration_s=settings.job_duration_s)
        created = self.kube.create(job)
        outcome.gpu_job = (placement.namespace, job["metadata"]["name"])
        outcome.gpu_job_uid = created["metadata"]["uid"]
        for manifest in workloads.service(settings.service, placement):
            self.kube.create(manifest)
            if manifest["kind"] == "Deployment":
                outcome.service = (placement.namespace, manifest["metadata"]["name"])
        self.progress.line(f"workloads placed on {placement.node}: job {job['metadata']['name']}, "
                           f"service {outcome.service[1]}; waiting for them to run")
        for role in ("gpu-job", "service"):
            recorder.wait_for(lambda rs, role=role: _running(rs, placement.namespace, role),
                              timeout_s=WORKLOAD_READY_TIMEOUT_S, what=f"the {role} pod Running on {placement.node}")

    def _start_load(self, outcome: RunOutcome, cleanup: contextlib.ExitStack) -> LoadRun | None:
        """Load the service from its own process, and see it answer before the upgrade starts."""
        settings = self.settings
        url = settings.service_url or (self.fleet.service_url(*outcome.service) if self.fleet else None)
        if url is None or settings.load_users == 0:
            self.progress.line("no service URL: the service is judged on evictions only "
                               "(give --gpucanary-service-url for load)")
            return None
        run_time_s = settings.upgrade_budget_s + 4 * settings.probe_interval_s + 300
        load = LoadRun(url, users=settings.load_users, spawn_rate=settings.load_spawn_rate, run_time_s=run_time_s,
                       workers=settings.load_workers, locustfile=settings.locustfile,
                       log_dir=outcome.report_dir / "load")
        cleanup.callback(load.stop)
        load.start()
        deadline = time.monotonic() + 30
        while sum(s.ok for s in load.samples()) < WARM_UP_REQUESTS and time.monotonic() < deadline and load.running():
            time.sleep(0.5)  # reads the load generator's own files; the cluster is not polled
        outcome.load_measured_from_ns = time.time_ns()  # warm-up (connections, the ingress's first list) excluded
        self.progress.line(f"load: {settings.load_users} users on {url}")
        return load

    def _collect_load(self, load: LoadRun | None, outcome: RunOutcome) -> None:
        if load is None:
            return
        load.stop()
        samples = [sample for sample in load.samples() if sample.t_ns >= outcome.load_measured_from_ns]
        if error := load.error():
            self.progress.line(f"load: {error}")
        outcome.service_phases = list(phases.phase_stats(samples, outcome.records, outcome.pool.nodes[0],
                                                         since_wall_ns=outcome.upgrade_started_wall_ns or 0))
        outcome.load_rate = phases.rate_series(samples)

    def _collect_metrics(self, outcome: RunOutcome) -> None:
        url = self.settings.prometheus_url or (self.fleet.prometheus_url if self.fleet else None)
        if url is None:
            self.progress.line("no Prometheus URL: metric checks not run (give --gpucanary-prometheus-url)")
            return
        outcome.metric_checks = list(metrics.default_checks(
            url, nodes=outcome.pool.nodes, target_driver=outcome.driver_to,
            start_wall_ns=outcome.upgrade_started_wall_ns or 0, end_wall_ns=outcome.finished_wall_ns or 0))

    def _watch_upgrade(self, pool: Pool, recorder: Recorder, probes: ProbeLoop) -> None:
        started = time.monotonic()
        budget_s = self.settings.upgrade_budget_s
        while time.monotonic() - started < budget_s:
            try:
                recorder.wait_for(lambda rs: True if all(timeline.terminal_state(rs, n) for n in pool.nodes) else None,
                                  timeout_s=2.0)
                break
            except TimeoutError:
                self.progress.status(self._status_text(pool, recorder, time.monotonic() - started))
        for node in pool.nodes:
            state = timeline.terminal_state(recorder.records, node) or "no end state within the budget"
            self.progress.line(f"{node}: {state} after {time.monotonic() - started:.0f} s")

    def _status_text(self, pool: Pool, recorder: Recorder, elapsed_s: float) -> str:
        node = pool.nodes[0]
        states = timeline.upgrade_states(recorder.records, node)
        events = timeline.node_events(recorder.records, node)
        last = events[-1].message.replace("Successfully updated node state label to ", "state -> ") if events else "-"
        return f"{node}: {states[-1] if states else '?'} | {elapsed_s:.0f}/{self.settings.upgrade_budget_s:.0f} s | {last}"

    def _settle(self, pool: Pool, recorder: Recorder, probes: ProbeLoop, placement: workloads.Placement) -> None:
        """After the upgrade, give new work the chance to land again, then let the probes in flight
        finish (all bounded): what has not happened by then is reported, not waited for."""
        wait_s = 2 * self.settings.probe_interval_s + 60
        if all(timeline.terminal_state(recorder.records, n) == "upgrade-done" for n in pool.nodes):
            done_ns = time.time_ns()
            self._wait_quietly(recorder, lambda rs: True if any(
                p.scope == "pool" and p.created_wall_ns > done_ns and p.running_wall_ns
                for p in probes.results(rs)) else None, wait_s, "a pool probe running after the upgrade")
            self._wait_quietly(recorder, lambda rs: _running(rs, placement.namespace, "gpu-job", finished_ok=True),
                               wait_s, "the GPU job running or finished after the upgrade")
        probes.stop()
        self._wait_quietly(recorder, lambda rs: True if all(p.running_wall_ns for p in probes.results(rs)) else None,
                           self.settings.max_start_latency_s + 10, "every probe in flight running")

    def _wait_quietly(self, recorder: Recorder, predicate, timeout_s: float, what: str) -> None:
        try:
            recorder.wait_for(predicate, timeout_s=timeout_s, what=what)
        except TimeoutError as err:
            self.progress.line(str(err))


def _running(records: list, namespace: str, role: str, *, finished_ok: bool = False) -> bool | None:
    latest: dict[str, dict] = {}
    for r in records:
        if r.kind == "Pod" and r.namespace == namespace and \
                r.object.get("metadata", {}).get("labels", {}).get(workloads.ROLE_LABEL) == role:
            latest[r.object["metadata"]["uid"]] = {} if r.type == "DELETED" else r.object
    phases = ("Running", "Succeeded") if finished_ok else ("Running",)
    ok = any(p.get("status", {}).get("phase") in phases and not p["metadata"].get("deletionTimestamp")
             for p in latest.values() if p)
    return True if ok else None
