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
from typing import Iterator

from pytest_gpucanary import cluster as cluster_info
from pytest_gpucanary import timeline, upgrade, workloads
from pytest_gpucanary.config import Settings
from pytest_gpucanary.kube import Kube, NotFound, owned_labels
from pytest_gpucanary.pool import Pool, PoolProvider
from pytest_gpucanary.probes import ProbeLoop, ProbeSeen
from pytest_gpucanary.progress import ProgressLine
from pytest_gpucanary.recorder import Recorder, StreamSpec

WORKLOAD_READY_TIMEOUT_S = 180


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
    def __init__(self, settings: Settings, kube: Kube, provider: PoolProvider, *, progress: ProgressLine) -> None:
        self.settings, self.kube, self.provider, self.progress = settings, kube, provider, progress

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
            probes = ProbeLoop(self.kube, placement, manifest=settings.probe, interval_s=settings.probe_interval_s,
                               pool_nodes=pool.nodes)
            cleanup.callback(probes.stop)
            probes.start()
            applied = upgrade.apply(self.kube, cluster, pool, policy.to_cr(), driver_to=settings.driver_version,
                                    run_id=run_id)
            cleanup.callback(upgrade.restore, self.kube, applied)
            outcome.upgrade_started_wall_ns = time.time_ns()
            self.progress.line(f"policy {settings.policy} applied; upgrading the pool")
            self._watch_upgrade(pool, recorder, probes)
            self._settle(pool, recorder, probes)
            probes.stop()
            outcome.records, outcome.probes = list(recorder.records), probes.results(recorder.records)
            outcome.finished_wall_ns = time.time_ns()
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

    def _settle(self, pool: Pool, recorder: Recorder, probes: ProbeLoop) -> None:
        """After the upgrade, give new work the chance to land on the pool again (bounded)."""
        if any(timeline.terminal_state(recorder.records, n) != "upgrade-done" for n in pool.nodes):
            return
        done_ns = time.time_ns()
        wait_s = 2 * self.settings.probe_interval_s + 60
        try:
            recorder.wait_for(lambda rs: True if any(p.scope == "pool" and p.created_wall_ns > done_ns and p.running_wall_ns
                                                     for p in probes.results(rs)) else None,
                              timeout_s=wait_s, what="a pool probe running after the upgrade")
        except TimeoutError:
            self.progress.line(f"no pool probe ran within {wait_s:.0f} s after the upgrade")


def _running(records: list, namespace: str, role: str) -> bool | None:
    latest: dict[str, dict] = {}
    for r in records:
        if r.kind == "Pod" and r.namespace == namespace and \
                r.object.get("metadata", {}).get("labels", {}).get(workloads.ROLE_LABEL) == role:
            latest[r.object["metadata"]["uid"]] = {} if r.type == "DELETED" else r.object
    ok = any(p.get("status", {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
             for p in latest.values() if p)
    return True if ok else None

