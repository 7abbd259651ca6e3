"""What a run measures beside the upgrade: the load on the service, the collective probe before and after,
the baseline they are held against and the metric checks; and `Measured`, what the run collects as it goes
(the pool, its workloads, the policy, the times), frozen into the ladder's evidence at the end.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Protocol

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.canary import metrics, workloads
from pytest_gpucanary.canary.blast_radius import BlastRadiusWatch
from pytest_gpucanary.canary.collective import CollectiveProbe, choose_pair
from pytest_gpucanary.canary.load import LoadRun
from pytest_gpucanary.canary.pool import Pool
from pytest_gpucanary.canary.recorder import Recorder
from pytest_gpucanary.config import Settings, flag
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.ladder import RunEvidence, WorkloadRef, timeline
from pytest_gpucanary.ladder.cause import Cause
from pytest_gpucanary.ladder.model import CollectiveRun, MetricAnswer, Sample
from pytest_gpucanary.ladder.network import NO_NETWORKING, networking_on
from pytest_gpucanary.progress import ProgressLine
from pytest_gpucanary.safe_text import redact_url

WARM_UP_REQUESTS = 20


@dataclass
class Measured:
    """What the run collects as it goes, frozen into RunEvidence at the end."""

    run_id: str
    pool: Pool
    gpu_job: WorkloadRef = WorkloadRef("", "")
    service: WorkloadRef = WorkloadRef("", "")
    load_measured_from_ns: int = 0
    upgrade_policy: dict = field(default_factory=dict)
    upgrade_started_wall_ns: int = 0
    gpu_job_until_wall_ns: int = 0
    exposure: tuple[str, ...] = ()
    dra_note: str = ""  # preflight's line on the cluster's DRA nodes; none once the GPU job claims through DRA
    gpu_claims: str = ""  # how the GPU job claims its GPUs through DRA, where the pool offers them so
    held_nodes: tuple[str, ...] = ()
    operator_release: str = ""
    policy_applied_to: str = ""
    policy_rendering: tuple[str, ...] = ()
    collective_pair: tuple[str, str] | None = None
    collective: list[CollectiveRun] = field(default_factory=list)
    collective_note: str = ""
    blast_radius: BlastRadiusWatch | None = None  # ClusterPolicy mode: the watch beyond the pool
    stalled: Cause | None = None  # what ended the upgrade's wait before its end state


class LocalEndpoints(Protocol):
    """What the run asks of a local test bed when it is the target (its ingress, Prometheus and chart); a
    `target.TestBed` is one."""

    @property
    def prometheus_url(self) -> str: ...

    def service_url(self, namespace: str, name: str) -> str: ...

    def helm_chart(self) -> Path: ...


# what goes into the run's evidence as it was measured, under the same name
MEASURED_AS_IS = tuple(
    f.name
    for f in fields(Measured)
    if f.name in {e.name for e in fields(RunEvidence)} and f.name not in ("blast_radius",)
)


class RunMeasures:
    """The measuring steps of `CanaryRun`, on its settings, cluster, progress line and local fleet."""

    settings: Settings
    kube: Kube
    progress: ProgressLine
    fleet: LocalEndpoints | None

    @property
    def _driver_to(self) -> str:
        """The target driver version: check_inputs, the first step of a run, refuses a run without one."""
        assert self.settings.driver_version
        return self.settings.driver_version

    def _start_collective(
        self, run: Measured, placement: workloads.Placement, recorder: Recorder
    ) -> CollectiveProbe | None:
        """The collective probe's baseline, begun beside the load's: only where the pool shows GPU networking."""
        found = networking_on(recorder.records, run.pool.nodes[0])
        if not found:
            run.collective_note = f"{NO_NETWORKING}: no collective probe"
            return None
        run.collective_pair, run.collective_note = choose_pair(
            self.kube, run.pool, self.settings, dra=bool(run.gpu_claims)
        )
        if run.collective_pair is None:
            self.progress.line(f"collective probe: {run.collective_note}")
            return None
        self.progress.line(
            f"collective probe ({', '.join(found)} on the pool): baseline all-reduce "
            f"{' <-> '.join(run.collective_pair)}"
        )
        return CollectiveProbe(
            self.kube, placement, run.collective_pair, self.settings, claim_gpus=bool(run.gpu_claims)
        ).start("baseline", start_timeout_s=self.settings.image_pull_timeout_s)

    def _finish_collective(self, run: Measured, probe: CollectiveProbe | None) -> None:
        if probe is None:
            return
        result = probe.finish(self.progress.line)
        run.collective.append(result)
        self.progress.line(f"collective probe: {result.line()}")

    def _collective_after(self, run: Measured, placement: workloads.Placement, recorder: Recorder) -> None:
        """The same all-reduce once the pool is back (every pool node upgrade-done and uncordoned)."""
        if run.collective_pair is None or not run.collective:
            return
        if not all(timeline.terminal_state(recorder.records, n) == op.UPGRADE_DONE for n in run.pool.nodes):
            run.collective_note = "the pool did not come back: no collective probe after the upgrade"
            return
        self.progress.line(f"collective probe: after all-reduce {' <-> '.join(run.collective_pair)}")
        probe = CollectiveProbe(
            self.kube, placement, run.collective_pair, self.settings, claim_gpus=bool(run.gpu_claims)
        ).start("after", start_timeout_s=self.settings.collective_timeout_s)
        self._finish_collective(run, probe)

    def _baseline(self) -> None:
        """Load and probes run unchanged for a while first: the before phase every later one is held against."""
        end = time.monotonic() + self.settings.baseline_s
        while (left_s := end - time.monotonic()) > 0:
            self.progress.status(f"baseline: load and probes before the change, {left_s:.0f} s left")
            time.sleep(min(1.0, left_s))

    def _start_load(self, run: Measured, report_dir: Path, cleanup: contextlib.ExitStack) -> LoadRun | None:
        """Load the service from its own process, and see it answer before the upgrade starts."""
        settings = self.settings
        url = settings.service_url or (
            self.fleet.service_url(run.service.namespace, run.service.name) if self.fleet else None
        )
        if url is None or settings.load_users == 0:
            self.progress.line(
                f"no service URL: the service is judged on evictions only (give {flag('service_url')} for load)"
            )
            return None
        run_time_s = settings.upgrade_budget_s + 4 * settings.probe_interval_s + 300
        load = LoadRun(
            url,
            users=settings.load_users,
            spawn_rate=settings.load_spawn_rate,
            run_time_s=run_time_s,
            workers=settings.load_workers,
            locustfile=settings.locustfile,
            log_dir=report_dir / "load",
        )
        cleanup.callback(load.stop)
        load.start()
        deadline = time.monotonic() + 30
        while sum(s.ok for s in load.samples()) < WARM_UP_REQUESTS and time.monotonic() < deadline and load.running():
            time.sleep(0.5)  # reads the load generator's own files; the cluster is not polled
        run.load_measured_from_ns = time.time_ns()  # warm-up (connections, the ingress's first list) excluded
        self.progress.line(f"load: {settings.load_users} users on {redact_url(url)}")
        return load

    def _collect_load(self, load: LoadRun | None, run: Measured) -> tuple[Sample, ...]:
        """Every request after the warm-up; the ladder cuts them by upgrade phase."""
        if load is None:
            return ()
        load.stop()
        if error := load.error():
            self.progress.line(f"load: {error}")
        return tuple(sample for sample in load.samples() if sample.t_ns >= run.load_measured_from_ns)

    def _prometheus_url(self) -> str | None:
        return self.settings.prometheus_url or (self.fleet.prometheus_url if self.fleet else None)

    def _collect_metrics(self, pool: Pool, start_wall_ns: int, end_wall_ns: int) -> tuple[MetricAnswer, ...]:
        url = self._prometheus_url()
        if url is None:
            self.progress.line(f"no Prometheus URL: metric checks not run (give {flag('prometheus_url')})")
            return ()
        return metrics.default_answers(url, nodes=pool.nodes, start_wall_ns=start_wall_ns, end_wall_ns=end_wall_ns)
