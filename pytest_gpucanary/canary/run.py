"""One canary run: pool, policy, workloads, recorder, probes, upgrade, ladder, receipt, restore.

`CanaryRun.execute()` touches the cluster only after the policy and options are validated, and it
restores everything it changed on the way out, also on Ctrl-C and SIGTERM (both end as
KeyboardInterrupt here). Objects it creates carry the run id, so `gpucanary cleanup` finds what a
killed run left.

Invariant (crash at any instant): whatever is needed to undo a change is on the cluster before the
change is. Every write is one of
- a create of an object that carries the run id label at birth (the Lease's namespace and Lease, the
  pool's nodes and NVIDIADriver, the workload namespace; everything else lives in that namespace);
- a patch that saves the prior value in an annotation naming the run id, strictly before the patch
  that changes the value (`policy.apply._save_and_patch`), or one patch doing both at once
  (`existing_node._mark`, `policy.apply.hold_back`);
- an undo, each one patch that puts the saved value back and drops its annotation in the same write,
  or a delete of an object found by its label; the Lease's namespace goes last;
- after the restore, the verdict (`publish.record`): a create or a conditional patch of the ConfigMap
  of its key, in the canary's own namespace; nothing to undo.
So a process killed between any two writes (SIGKILL, OOM, a lost machine) leaves only objects that
`gpucanary cleanup` finds by label or annotation and restores exactly, once the run's Lease is no
longer renewed. tests/unit/test_crash_sweep.py kills a run after each of its writes;
tests/e2e/fault_hooks.py is the hook that does it on a real cluster.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Protocol

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.canary import apply as upgrade
from pytest_gpucanary.canary import lease, metrics, neighbours, preflight, publish, workloads
from pytest_gpucanary.canary.blast_radius import BlastRadiusWatch
from pytest_gpucanary.canary.cleanup import leftovers
from pytest_gpucanary.canary.collective import CollectiveProbe, check_peer, choose_pair
from pytest_gpucanary.canary.lease import RunLease
from pytest_gpucanary.canary.load import LoadRun, check_locustfile
from pytest_gpucanary.canary.outcome import RunOutcome, judge
from pytest_gpucanary.canary.pool import Pool, PoolProvider
from pytest_gpucanary.canary.pool.existing_node import SAVED_STATE_ANNOTATION
from pytest_gpucanary.canary.recorder import Recorder, StreamSpec
from pytest_gpucanary.canary.workloads import ProbeLoop
from pytest_gpucanary.cluster import ClusterInfo
from pytest_gpucanary.config import Settings, flag
from pytest_gpucanary.errors import ConfigError, EnvError, GpucanaryError
from pytest_gpucanary.kube import Kube, NotFound, owned_namespace
from pytest_gpucanary.ladder import (
    MetricCheck,
    PhaseStats,
    RatePoint,
    RunEvidence,
    WorkloadRef,
    diagnosis,
    jobs,
    stall,
    timeline,
)
from pytest_gpucanary.ladder.cause import (
    NOT_STARTED,
    OPERAND_BLOCKED,
    READY_DRIVER,
    SANDBOX_NOT_READY,
    UNBOUND_POD,
    Cause,
)
from pytest_gpucanary.ladder.model import CollectiveRun
from pytest_gpucanary.ladder.network import NO_NETWORKING, networking_on
from pytest_gpucanary.ladder.phases import phase_stats, rate_series
from pytest_gpucanary.policy.helm import HelmChart
from pytest_gpucanary.policy.model import UpgradePolicy
from pytest_gpucanary.policy.parse import load_policy
from pytest_gpucanary.progress import STEPS_FILE, ProgressLine, StepClock
from pytest_gpucanary.receipt.ci import ci_identity
from pytest_gpucanary.receipt.verdict import Verdict
from pytest_gpucanary.safe_text import redact_url


class LocalEndpoints(Protocol):
    """What the run asks of a local test bed when it is the target (the fleet's ingress and Prometheus)."""

    prometheus_url: str

    def service_url(self, namespace: str, name: str) -> str: ...

    def helm_chart(self) -> Path: ...


WORKLOAD_READY_TIMEOUT_S = 180
# past the GPU job's deadline: a replacement pod evicted late in the upgrade is scheduled again after the
# uncordon and must start and finish its last round
JOB_COMPLETION_GRACE_S = 120
NAMESPACE_GONE_TIMEOUT_S = 180
LOG_EVERY_S = 20  # how often the log of a container that has not started is read while it lasts
# what the kubelet answers (as the log itself) for a container it is replacing, as a crash loop's restart does;
# a moment later it has the log again
LOG_GONE = "unable to retrieve container logs for"
LOG_READS = 3
WARM_UP_REQUESTS = 20


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4]


@dataclass
class _Measured:
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
    unproven: tuple[str, ...] = ()
    held_nodes: tuple[str, ...] = ()
    operator_release: str = ""
    policy_applied_to: str = ""
    policy_rendering: tuple[str, ...] = ()
    collective_pair: tuple[str, str] | None = None
    collective: list[CollectiveRun] = field(default_factory=list)
    collective_note: str = ""
    blast_radius: BlastRadiusWatch | None = None  # ClusterPolicy mode: the watch beyond the pool
    stalled: Cause | None = None  # what ended the upgrade's wait before its end state


class RestoringStack(contextlib.ExitStack):
    """An ExitStack whose run stops on SIGINT or SIGTERM alike and then restores with both deferred: the first
    signal unwinds the run (as Ctrl-C does), every later one, and any that comes once the restore has begun
    (`begin_restore`), waits until every callback has run and is raised then. The handler itself decides, so
    a signal that lands while the run prints "restoring the cluster" cannot cut the restore short; only SIGKILL
    abandons a restore, and `gpucanary cleanup` finishes it."""

    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__()
        self._say = say
        self.restoring = False
        self._deferred: list[int] = []
        self._stopped_by = 0
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def __enter__(self) -> RestoringStack:
        if _main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        return super().__enter__()

    def begin_restore(self) -> None:
        self.restoring = True

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.restoring:
            self.restoring, self._stopped_by = True, signum
            raise KeyboardInterrupt(f"signal {signum}")
        self._deferred.append(signum)
        with contextlib.suppress(RuntimeError):  # the signal landed inside a write to the same stream
            self._say(
                f"signal {signum} deferred: restoring the cluster first (SIGKILL abandons the restore; "
                "`gpucanary cleanup` then finishes it)"
            )

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self.restoring = True
        if self._stopped_by:  # said here, not in the handler, which may have cut into a write of this stream
            self._say(
                f"signal {self._stopped_by}: stopping the run and restoring the cluster (a second signal "
                "waits for the restore)"
            )
        try:
            suppressed = super().__exit__(exc_type, exc, tb)
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
        if self._deferred and (exc_type is None or suppressed):
            raise KeyboardInterrupt(f"signal {self._deferred[0]}, deferred until the cluster was restored")
        return suppressed


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def refuse_other_runs(kube: Kube, cluster: ClusterInfo, *, allow_shared_policy: bool = False) -> None:
    """Before the first write: exit 6 when another run's saved state or hold is on an object this run would
    write (the ClusterPolicy; in its mode, every node the driver reaches). Never adopt, never overlap. Before
    v26.7 in NVIDIADriver mode, also while another NVIDIADriver's nodes are mid-upgrade (unless allowed): they
    would go on under the policy under test."""
    if cluster.nvidiadriver_mode and not cluster.per_driver_policy and not allow_shared_policy:
        for driver in kube.list(*op.NVIDIADRIVER):
            for node in kube.each("v1", "Node", label_selector=op.driver_node_selector(driver)):
                state = (node["metadata"].get("labels") or {}).get(op.UPGRADE_STATE_LABEL, "")
                if state not in ("", op.UPGRADE_DONE):
                    raise EnvError(
                        f"NVIDIADriver {driver['metadata']['name']}'s node {node['metadata']['name']} is in "
                        f"{state}: before operator v26.7 the upgradePolicy is cluster-wide, so that upgrade "
                        "would go on under the policy under test",
                        hint=f"wait for it to finish, or pass {flag('allow_shared_policy')}",
                    )
    if cluster.writes_cluster_policy:
        upgrade.refuse_foreign(
            {"kind": "ClusterPolicy", **kube.get(*op.CLUSTER_POLICY, cluster.cluster_policy)},
            upgrade.SAVED_SPEC_ANNOTATION,
            run_id="",
        )
    if not cluster.nvidiadriver_mode:
        for node in upgrade.driver_nodes(kube).values():
            for annotation in (upgrade.SKIP_SET_ANNOTATION, SAVED_STATE_ANNOTATION):
                upgrade.refuse_foreign({"kind": "Node", **node}, annotation, run_id="")


def check_inputs(settings: Settings, *, fleet_chart: Callable[[], Path] | None = None) -> UpgradePolicy:
    """Everything the user gave, read and checked before the cluster is touched: the policy (Helm
    values rendered by helm, with `fleet_chart` when the local fleet is the target and no chart is
    given), the workload manifests, the locustfile and the reports directory. Returns the policy."""
    settings.require_gate_inputs()
    assert settings.policy is not None  # require_gate_inputs refuses a run without one
    policy = load_policy(settings.policy, helm=HelmChart.from_settings(settings, fleet_chart=fleet_chart))
    workloads.check(settings)
    check_locustfile(settings.locustfile)
    return policy


class CanaryRun:
    def __init__(
        self,
        settings: Settings,
        kube: Kube,
        provider: PoolProvider,
        *,
        progress: ProgressLine,
        fleet: LocalEndpoints | None = None,
    ) -> None:
        self.settings, self.kube, self.provider, self.progress = settings, kube, provider, progress
        self.fleet = fleet  # the local fleet when it is the target: its ingress and Prometheus

    def execute(self) -> RunOutcome:
        settings, clock = self.settings, StepClock()
        clock.next("preflight")
        policy = check_inputs(settings, fleet_chart=self.fleet.helm_chart if self.fleet else None)  # before any write
        checked = preflight.check(
            self.kube,
            self.provider,
            target=self._driver_to,  # read-only
            prometheus_url=self._prometheus_url(),
            service_url=settings.service_url,
            longest_run_s=settings.longest_run_s(),
            pushgateway_url=settings.pushgateway_url,
        )
        for problem in checked.problems:
            self.progress.line(f"preflight: {problem.line}")
        checked.raise_first()
        check_peer(self.kube, settings)  # read-only
        cluster = checked.cluster
        assert cluster is not None, "a preflight without problems found the operator"
        if settings.holder and self.provider.name == "kwok":
            raise ConfigError(
                "a kwok pool's driver is simulated: nothing there can hold it, so a driver holder would prove nothing",
                hint=f"use the kubelet pool or an existing node with {flag('holder')}",
            )
        run_id = settings.run_id or new_run_id()
        report_dir = settings.reports_dir / run_id
        self.progress.line(
            f"run {run_id}: operator in {cluster.mode} mode, namespace {cluster.operator_namespace}, "
            f"release {cluster.operator_release or 'unknown'}"
        )
        for line in checked.exposure:
            self.progress.line(f"exposure: {line}")
        for line in checked.unproven:
            self.progress.line(f"not proven: {line}")
        try:
            refuse_other_runs(self.kube, cluster, allow_shared_policy=settings.allow_shared_policy)  # read-only
            with RestoringStack(self.progress.line) as cleanup:
                cleanup.callback(self._say_restored, run_id)
                # the first write: every later change has a live owner that `gpucanary cleanup` leaves alone
                cleanup.callback(RunLease(self.kube, run_id, say=self.progress.line).acquire().release)
                if cluster.writes_cluster_policy:
                    lease.take_cluster_lock(self.kube, run_id)
                    cleanup.callback(lease.release_cluster_lock, self.kube, run_id)
                clock.next("pool")
                pool = self.provider.provision(self.kube, cluster, run_id=run_id)
                cleanup.callback(self.provider.release, self.kube, self.progress.line)
                if pool.driver_from == settings.driver_version and not cluster.nvidiadriver_mode:
                    raise ConfigError(
                        f"the pool already runs driver {pool.driver_from}: a same-version run (a change "
                        "that leaves the driver as it is) relabels the pool's own NVIDIADriver, so it "
                        "needs the operator in NVIDIADriver mode",
                        hint=f"give {flag('driver_version')} a version other than {pool.driver_from}",
                    )
                run = _Measured(
                    run_id,
                    pool,
                    upgrade_policy=policy.to_cr(),
                    unproven=checked.unproven,
                    policy_rendering=policy.rendering.lines() if policy.rendering else (),
                )
                self.progress.line(
                    f"pool {', '.join(pool.nodes)} ({self.provider.name}), driver {pool.driver_from} "
                    f"-> {settings.driver_version}"
                )
                if pool.fence:
                    self.progress.line(f"pool {pool.fence}")
                for note in pool.notes:
                    self.progress.line(f"pool {note}")
                clock.next("workloads")
                placement = workloads.Placement(f"gpucanary-{run_id}", run_id, pool.nodes[0])
                placed = workloads.rendered(settings, placement, service_path=pool.service)
                self._create_namespace(placement, placed, cleanup)
                self._pull_images(placement, placed)
                recorder = Recorder(
                    self.kube, report_dir / "timeline.jsonl", self._streams(pool, placement, cluster.operator_namespace)
                )
                cleanup.enter_context(recorder)
                self._place_workloads(placement, run, recorder)
                clock.next("baseline")
                load = self._start_load(run, report_dir, cleanup)
                probes = ProbeLoop(
                    self.kube,
                    placement,
                    manifest=settings.probe,
                    images=settings.images(),
                    interval_s=settings.probe_interval_s,
                    pool_nodes=pool.nodes,
                )
                cleanup.callback(probes.stop)
                probes.start()
                baseline = self._start_collective(run, placement, recorder)
                self._baseline()
                self._finish_collective(run, baseline)
                clock.next("upgrade")
                if recheck := getattr(self.provider, "recheck", None):
                    recheck(self.kube)  # a tenant pod that landed on the pool since
                for node in pool.nodes:
                    if holders := stall.holders(recorder.records, node):
                        self.progress.line(
                            f"warning: pods on {node} hold the driver without a GPU request: "
                            f"{', '.join(holders)}; pod deletion leaves them, as they request no GPU "
                            "(NVIDIA/gpu-operator #2570), so the driver cannot unload while they run"
                        )
                applied = upgrade.AppliedUpgrade()  # its restore is registered before its first write
                cleanup.callback(self._restore, applied, placement)
                upgrade.apply(
                    self.kube,
                    cluster,
                    pool,
                    run.upgrade_policy,
                    driver_to=self._driver_to,
                    run_id=run_id,
                    applied=applied,
                )
                if not cluster.nvidiadriver_mode:  # stopped before the restore releases the holds it watches
                    run.blast_radius = BlastRadiusWatch(self.kube, pool.nodes, self._driver_to).start()
                    cleanup.callback(run.blast_radius.stop)
                run.upgrade_started_wall_ns = time.time_ns()
                run.held_nodes = tuple(applied.skipped_nodes)
                run.policy_applied_to, run.operator_release = applied.describe(), cluster.operator_release or ""
                run.exposure = preflight.exposure(
                    cluster, pool_nodes=pool.nodes, target=self._driver_to, held=run.held_nodes
                )
                if run.held_nodes:
                    self.progress.line(f"exposure: {run.exposure[1]}")
                self.progress.line(f"policy {settings.policy} applied; upgrading the pool")
                breaches = self._watch_upgrade(pool, recorder, cluster.operator_release, run)
                clock.next("settle")
                if breaches:  # the target reached beyond the pool: judge and restore at once
                    for line in breaches:
                        self.progress.line(line)
                else:
                    self._settle(pool, recorder, probes, run)
                    self._collective_after(run, placement, recorder)
                clock.next("evaluate")
                self.progress.line("evaluating the ladder")
                outcome = self._judge(run, recorder, probes, load, report_dir)
                clock.next("restore")
                cleanup.begin_restore()  # from here a signal waits for the restore
                self.progress.line("restoring the cluster")
            self._publish(Verdict.of(outcome.result, outcome.evidence))  # once the cluster is as it was
        finally:
            clock.next(None)
            if report_dir.is_dir():
                clock.write(report_dir / STEPS_FILE)
            self.progress.line(f"steps: {clock.describe()}")
        return outcome

    @property
    def _driver_to(self) -> str:
        """The target driver version: check_inputs, the first step of a run, refuses a run without one."""
        assert self.settings.driver_version
        return self.settings.driver_version

    def _publish(self, verdict: Verdict) -> None:
        """The verdict where a CD pipeline reads it; a verdict that cannot be kept is said, and gates nothing
        (`gpucanary verdict` then finds no pass, so the rollout it gates holds)."""
        where = f"ConfigMap {publish.NAMESPACE}/{verdict.key.name}"
        try:
            if publish.record(self.kube, verdict):
                self.progress.line(f"verdict recorded in {where}: {verdict.line()}")
            else:
                self.progress.line(f"verdict not recorded: {where} holds a run that finished later")
        except NotFound:
            self.progress.line(
                f"warning: verdict not recorded: namespace {publish.NAMESPACE} does not exist "
                "(kubectl apply -f deploy/rbac.yaml creates it)"
            )
        except GpucanaryError as err:
            self.progress.line(f"warning: verdict not recorded in {where}: {err}")
        if self.settings.pushgateway_url:
            try:
                publish.push(self.settings.pushgateway_url, verdict)
                self.progress.line(f"verdict pushed to the Pushgateway at {redact_url(self.settings.pushgateway_url)}")
            except GpucanaryError as err:
                self.progress.line(f"warning: {err}")

    def _judge(
        self, run: _Measured, recorder: Recorder, probes: ProbeLoop, load: LoadRun | None, report_dir: Path
    ) -> RunOutcome:
        """Freeze what was recorded and measured into the run's evidence, judge it, write the receipt."""
        settings, pool = self.settings, run.pool
        if run.blast_radius is not None:
            with contextlib.suppress(GpucanaryError):  # what the watches saw stands when the read fails
                run.blast_radius.sweep()
        records = tuple(recorder.records)
        finished_wall_ns = time.time_ns()
        service_phases, service_rate = self._collect_load(load, run, records)
        evidence = RunEvidence(
            records=records,
            pool_nodes=pool.nodes,
            driver_from=pool.driver_from,
            driver_to=self._driver_to,
            upgrade_started_wall_ns=run.upgrade_started_wall_ns,
            gpu_job=run.gpu_job,
            service=run.service,
            probes=tuple(probes.results(list(records))),
            metric_checks=self._collect_metrics(pool, run.upgrade_started_wall_ns, finished_wall_ns),
            service_phases=service_phases,
            service_rate=service_rate,
            upgrade_policy=run.upgrade_policy,
            run_id=run.run_id,
            policy_path=str(settings.policy),
            finished_wall_ns=finished_wall_ns,
            ci=ci_identity(os.environ),
            gpu_job_work_s=settings.job_duration_s,
            gpu_job_until_wall_ns=run.gpu_job_until_wall_ns,
            exposure=run.exposure,
            held_nodes=run.held_nodes,
            operator_release=run.operator_release,
            policy_applied_to=run.policy_applied_to,
            policy_rendering=run.policy_rendering,
            collective=tuple(run.collective),
            collective_note=run.collective_note,
            blast_radius=tuple(run.blast_radius.breaches) if run.blast_radius else (),
            pool_setup=tuple(line for line in (pool.fence, *pool.notes) if line),
            unproven=run.unproven,
        )
        evidence.write(report_dir)
        return judge(evidence, settings, report_dir)

    def _start_collective(
        self, run: _Measured, placement: workloads.Placement, recorder: Recorder
    ) -> CollectiveProbe | None:
        """The collective probe's baseline, begun beside the load's: only where the pool shows GPU networking."""
        found = networking_on(recorder.records, run.pool.nodes[0])
        if not found:
            run.collective_note = f"{NO_NETWORKING}: no collective probe"
            return None
        run.collective_pair, run.collective_note = choose_pair(self.kube, run.pool, self.settings)
        if run.collective_pair is None:
            self.progress.line(f"collective probe: {run.collective_note}")
            return None
        self.progress.line(
            f"collective probe ({', '.join(found)} on the pool): baseline all-reduce "
            f"{' <-> '.join(run.collective_pair)}"
        )
        return CollectiveProbe(self.kube, placement, run.collective_pair, self.settings).start(
            "baseline", start_timeout_s=self.settings.image_pull_timeout_s
        )

    def _finish_collective(self, run: _Measured, probe: CollectiveProbe | None) -> None:
        if probe is None:
            return
        result = probe.finish(self.progress.line)
        run.collective.append(result)
        self.progress.line(f"collective probe: {result.line()}")

    def _collective_after(self, run: _Measured, placement: workloads.Placement, recorder: Recorder) -> None:
        """The same all-reduce once the pool is back (every pool node upgrade-done and uncordoned)."""
        if run.collective_pair is None or not run.collective:
            return
        if not all(timeline.terminal_state(recorder.records, n) == op.UPGRADE_DONE for n in run.pool.nodes):
            run.collective_note = "the pool did not come back: no collective probe after the upgrade"
            return
        self.progress.line(f"collective probe: after all-reduce {' <-> '.join(run.collective_pair)}")
        probe = CollectiveProbe(self.kube, placement, run.collective_pair, self.settings).start(
            "after", start_timeout_s=self.settings.collective_timeout_s
        )
        self._finish_collective(run, probe)

    def _baseline(self) -> None:
        """Load and probes run unchanged for a while first: the before phase every later one is held against."""
        end = time.monotonic() + self.settings.baseline_s
        while (left_s := end - time.monotonic()) > 0:
            self.progress.status(f"baseline: load and probes before the change, {left_s:.0f} s left")
            time.sleep(min(1.0, left_s))

    def _create_namespace(
        self, placement: workloads.Placement, placed: list[dict], cleanup: contextlib.ExitStack
    ) -> None:
        settings = self.settings
        may_place = [
            *placed,
            workloads.collective_pod(
                settings.collective_probe,
                placement,
                when="check",
                rank=0,
                node=placement.node,
                master_addr="",
                images=settings.images(),
            ),
        ]
        self.kube.create(
            owned_namespace(placement.namespace, placement.run_id, pod_security=workloads.pod_security(may_place))
        )
        cleanup.callback(self._delete_quietly, "v1", "Namespace", placement.namespace)
        self.kube.wait_for(
            "v1", "ServiceAccount", "default", lambda sa: True, namespace=placement.namespace, timeout_s=60
        )

    def _restore(self, applied: upgrade.AppliedUpgrade, placement: workloads.Placement) -> None:
        """Take the canary's workloads off first: the rollback to the original version runs under the
        original policy, which may refuse exactly the pods the canary placed (e.g. the /dev/shm job).
        Whatever happens while they go, the policy is restored."""
        try:
            self._delete_quietly("v1", "Namespace", placement.namespace)
            self.kube.wait_gone("v1", "Namespace", placement.namespace, timeout_s=NAMESPACE_GONE_TIMEOUT_S)
        except (TimeoutError, GpucanaryError) as err:
            self.progress.line(f"the namespace is not gone ({err}); restoring the policy anyway")
        finally:
            upgrade.restore(self.kube, applied, report=self.progress.line)

    def _say_restored(self, run_id: str) -> None:
        """The last word of the unwinding, said only once the cluster is read again and holds nothing of the run."""
        try:
            left = leftovers(self.kube, [], only=run_id).get(run_id)
        except GpucanaryError as err:
            self.progress.line(
                f"could not read back what is left of run {run_id} ({err}); run `gpucanary cleanup --run-id {run_id}`"
            )
            return
        if left is None:
            self.progress.line(f"cleanup done: nothing of run {run_id} is left on the cluster")
        else:
            what = len(left.specs) + len(left.holds) + len(left.carved) + len(left.owned)
            self.progress.line(
                f"restore incomplete: {what} objects still carry run {run_id}; "
                f"run `gpucanary cleanup --run-id {run_id}`"
            )

    def _delete_quietly(self, api_version: str, kind: str, name: str, *, namespace: str | None = None) -> None:
        with contextlib.suppress(NotFound):
            self.kube.delete(api_version, kind, name, namespace=namespace)

    def _pull_images(self, placement: workloads.Placement, placed: list[dict]) -> None:
        """Before the policy is touched: every workload image pulled on the pool node by a short pod of the
        run's own; one that cannot be pulled (a missing tag, an unreachable registry) stops the run."""
        images = workloads.images_of(placed)
        timeout_s = self.settings.image_pull_timeout_s
        self.progress.line(f"pulling {len(images)} image(s) on {placement.node}: {', '.join(images)}")
        pods = [workloads.image_pull_pod(image, placement, index=i) for i, image in enumerate(images)]
        for pod in pods:
            self.kube.create(pod)

        def settled(seen: dict[str, dict]) -> dict[str, tuple[bool | None, str]] | None:
            states = {p["spec"]["containers"][0]["image"]: workloads.pull_state(p) for p in seen.values()}
            if any(ok is False for ok, _ in states.values()) or (
                len(states) == len(images) and all(ok for ok, _ in states.values())
            ):
                return states
            return None

        try:
            states = self.kube.watch_until(
                "v1",
                "Pod",
                settled,
                timeout_s=timeout_s,
                namespace=placement.namespace,
                label_selector=f"{workloads.ROLE_LABEL}={workloads.IMAGE_PULL_ROLE}",
            )
        except TimeoutError as err:
            raise EnvError(
                f"the workload images were not all pulled on {placement.node} within {timeout_s:.0f} s ({err})",
                hint=f"mirror them ({flag('image_registry')}) or raise {flag('image_pull_timeout_s')}",
            ) from None
        for image, (ok, why) in states.items():
            if ok is False:
                raise EnvError(
                    f"image {image} cannot be pulled on {placement.node}: {why}",
                    hint=f"publish or mirror it, then pass {flag('image_registry')} or the image's own "
                    "--gpucanary-*-image option",
                )
        for pod in pods:
            self._delete_quietly("v1", "Pod", pod["metadata"]["name"], namespace=placement.namespace)
        self.progress.line(f"images pulled on {placement.node}")

    def _streams(self, pool: Pool, placement: workloads.Placement, operator_namespace: str) -> list[StreamSpec]:
        streams = [
            StreamSpec("canary-pods", "v1", "Pod", namespace=placement.namespace),
            # an operand the scheduler cannot place on the pool has no node yet (the pools' streams miss it)
            StreamSpec(
                "unbound-operator-pods",
                "v1",
                "Pod",
                namespace=operator_namespace,
                field_selector="spec.nodeName=",
                recorded_as=UNBOUND_POD,
            ),
            StreamSpec("canary-events", "v1", "Event", namespace=placement.namespace),
            StreamSpec(
                "canary-jobs",
                "batch/v1",
                "Job",
                namespace=placement.namespace,
                label_selector=f"{workloads.ROLE_LABEL}=gpu-job",
            ),
            # which budget refuses an eviction on the pool: any namespace's pods can be there
            StreamSpec("budgets", "policy/v1", "PodDisruptionBudget"),
        ]
        if neighbours.node_maintenance_served(self.kube):  # the maintenance operator may cordon and drain the pool
            streams.append(StreamSpec("node-maintenance", *neighbours.NODE_MAINTENANCE))
        for node in pool.nodes:
            streams += [
                StreamSpec(f"node-{node}", "v1", "Node", field_selector=f"metadata.name={node}"),
                StreamSpec(f"pods-{node}", "v1", "Pod", field_selector=f"spec.nodeName={node}"),
                StreamSpec(
                    f"events-{node}",
                    "v1",
                    "Event",
                    namespace="default",
                    field_selector=f"involvedObject.kind=Node,involvedObject.name={node}",
                ),
            ]
        return streams

    def _place_workloads(self, placement: workloads.Placement, run: _Measured, recorder: Recorder) -> None:
        settings = self.settings
        images = settings.images()
        job = workloads.gpu_job(settings.gpu_job, placement, duration_s=settings.job_duration_s, images=images)
        run.gpu_job_until_wall_ns = int((workloads.work_until_wall_s(job) or 0) * 1e9)
        created = self.kube.create(job)
        run.gpu_job = WorkloadRef(placement.namespace, job["metadata"]["name"], created["metadata"]["uid"])
        for manifest in workloads.service(settings.service or run.pool.service, placement, images=images):
            self.kube.create(manifest)
            if manifest["kind"] == "Deployment":
                run.service = WorkloadRef(placement.namespace, manifest["metadata"]["name"])
        holders = workloads.holder(settings.holder, placement, images=images) if settings.holder else []
        for manifest in holders:
            self.kube.create(manifest)
        held = f", driver holder {', '.join(m['metadata']['name'] for m in holders)}" if holders else ""
        self.progress.line(
            f"workloads placed on {placement.node}: job {job['metadata']['name']}, "
            f"service {run.service.name}{held}; waiting for them to run"
        )
        for role in ("gpu-job", "service", *((workloads.HOLDER_ROLE,) if holders else ())):
            recorder.wait_for(
                functools.partial(_running, namespace=placement.namespace, role=role),
                timeout_s=WORKLOAD_READY_TIMEOUT_S,
                what=f"the {role} pod Running on {placement.node}",
            )

    def _start_load(self, run: _Measured, report_dir: Path, cleanup: contextlib.ExitStack) -> LoadRun | None:
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

    def _collect_load(
        self, load: LoadRun | None, run: _Measured, records: tuple
    ) -> tuple[tuple[PhaseStats, ...], tuple[RatePoint, ...]]:
        if load is None:
            return (), ()
        load.stop()
        samples = [sample for sample in load.samples() if sample.t_ns >= run.load_measured_from_ns]
        if error := load.error():
            self.progress.line(f"load: {error}")
        return (
            phase_stats(samples, records, run.pool.nodes[0], since_wall_ns=run.upgrade_started_wall_ns),
            tuple(rate_series(samples)),
        )

    def _prometheus_url(self) -> str | None:
        return self.settings.prometheus_url or (self.fleet.prometheus_url if self.fleet else None)

    def _collect_metrics(self, pool: Pool, start_wall_ns: int, end_wall_ns: int) -> tuple[MetricCheck, ...]:
        url = self._prometheus_url()
        if url is None:
            self.progress.line(f"no Prometheus URL: metric checks not run (give {flag('prometheus_url')})")
            return ()
        return metrics.default_checks(
            url,
            nodes=pool.nodes,
            target_driver=self._driver_to,
            start_wall_ns=start_wall_ns,
            end_wall_ns=end_wall_ns,
        )

    def _watch_upgrade(self, pool: Pool, recorder: Recorder, release: str | None, run: _Measured) -> list[str]:
        """Wait for every pool node's end state within the budget, a cause that will not clear by itself
        (kept in `run.stalled`), or a breach of the blast radius (returned)."""
        blast_radius = run.blast_radius
        started, started_wall_ns = time.monotonic(), time.time_ns()
        budget_s = self.settings.upgrade_budget_s
        said: set[tuple[str, str, bool]] = set()
        read_at: dict[tuple[str, str, str], int] = {}  # wall ns of each not-started container's last log read
        while time.monotonic() - started < budget_s:
            if blast_radius is not None and blast_radius.breaches:
                return list(blast_radius.breaches)
            try:
                recorder.wait_for(
                    lambda rs: True if all(timeline.terminal_state(rs, n) for n in pool.nodes) else None, timeout_s=2.0
                )
                break
            except TimeoutError:
                pass
            found = self._causes(pool, recorder, run, started_wall_ns)
            # a start still printing keeps its time; a sandbox that does not come gets the kubelet's words (both read)
            if self._read_quiet_logs(found, recorder, read_at) | self._read_warnings(found, recorder, read_at):
                found = self._causes(pool, recorder, run, started_wall_ns)
            for cause in found:
                # a change of cause, printed once; an operand's also when its wait starts to count (the driver Ready)
                key = (cause.what, cause.reason, cause.message.endswith(f"({READY_DRIVER})"))
                if key not in said:
                    said.add(key)
                    self.progress.line(f"rollout: {cause.line((cause.since_wall_ns - started_wall_ns) / 1e9)}")
            if stuck := stall.first_terminal(found):
                run.stalled = stuck
                if stuck.reason in ("CrashLoopBackOff", OPERAND_BLOCKED):  # its own words, quoted
                    self._read_log(stuck, recorder, previous=stuck.reason == "CrashLoopBackOff")
                if said_last := diagnosis.last_meaningful(diagnosis.log_tail(recorder.records, stuck)):
                    self.progress.line(f"rollout: {stuck.container} said last: {said_last}")
                self.progress.line(
                    f"rollout: {stuck.node}: that will not clear by itself; stopping the wait "
                    f"after {time.monotonic() - started:.0f} s of the {budget_s:.0f} s budget"
                )
                break
            waits_on = (
                (
                    f"{found[-1].what}: {found[-1].reason} since "  # rather than the last event again
                    f"+{(found[-1].since_wall_ns - started_wall_ns) / 1e9:.0f} s"
                )
                if found
                else None
            )
            self.progress.status(self._status_text(pool, recorder, time.monotonic() - started, release, waits_on))
        for node in pool.nodes:
            state = timeline.terminal_state(recorder.records, node) or "no end state within the budget"
            self.progress.line(f"{node}: {state} after {time.monotonic() - started:.0f} s")
        return list(blast_radius.breaches) if blast_radius is not None else []

    def _causes(self, pool: Pool, recorder: Recorder, run: _Measured, started_wall_ns: int) -> list[Cause]:
        records = recorder.records
        return [
            c
            for n in pool.nodes
            for c in stall.causes(
                records,
                n,
                since_wall_ns=started_wall_ns,
                policy=run.upgrade_policy,
                now_wall_ns=time.time_ns(),
                stuck_s=self.settings.stall_s,
            )
        ]

    def _read_quiet_logs(
        self, found: list[Cause], recorder: Recorder, read_at: dict[tuple[str, str, str], int]
    ) -> bool:
        """Read the log of each container that has not started, every LOG_EVERY_S and once more when its
        time is up; True when one has changed since (a new record, so its quiet time starts again)."""
        changed = False
        for cause in (c for c in found if c.reason == NOT_STARTED):
            key, now = (cause.namespace, cause.pod, cause.container), time.time_ns()
            last = read_at.get(key)
            due = last is None or (
                last < cause.terminal_wall_ns if cause.terminal_wall_ns else now - last >= LOG_EVERY_S * 1e9
            )
            if due:
                read_at[key] = now
                changed |= self._read_log(cause, recorder, previous=False)
        return changed

    def _read_warnings(self, found: list[Cause], recorder: Recorder, read_at: dict[tuple[str, str, str], int]) -> bool:
        """The newest Warning event of each pod whose sandbox does not come (the kubelet's FailedMount or
        FailedCreatePodSandBox), read every LOG_EVERY_S while it lasts; True when one has changed."""
        changed = False
        for cause in (c for c in found if c.reason == SANDBOX_NOT_READY):
            key, now = (cause.namespace, cause.pod, ""), time.time_ns()
            if (last := read_at.get(key)) is not None and now - last < LOG_EVERY_S * 1e9:
                continue
            read_at[key] = now
            try:
                events = self.kube.list(
                    "v1",
                    "Event",
                    namespace=cause.namespace,
                    field_selector=f"involvedObject.kind=Pod,involvedObject.name={cause.pod}",
                )
            except GpucanaryError as err:
                self.progress.line(f"rollout: cannot read the events of {cause.pod}: {err}")
                continue
            warnings = sorted(
                (e for e in events if e.get("type") == "Warning"),  # what keeps the sandbox first
                key=lambda e: (
                    e.get("reason") in diagnosis.SANDBOX_WARNINGS,
                    e.get("lastTimestamp") or e.get("eventTime") or "",
                ),
            )
            if warnings:
                record = diagnosis.warning_record(
                    cause, warnings[-1], mono_ns=time.monotonic_ns(), wall_ns=time.time_ns()
                )
                if record.object["text"] != diagnosis.last_warning(recorder.records, cause):
                    recorder.note(record)
                    changed = True
        return changed

    def _read_log(self, cause: Cause, recorder: Recorder, *, previous: bool) -> bool:
        """A container's own words (a crash loop's last run: `previous`): its log tail, into the timeline when
        it differs from the last read (the rung quotes it). Best effort: a log that cannot be read leaves the
        cause as the kubelet put it. True when a record was added."""
        for read in range(LOG_READS):
            if read:
                time.sleep(2.0)
            try:
                text = self.kube.pod_log(
                    cause.pod,
                    namespace=cause.namespace,
                    container=cause.container,
                    previous=previous,
                    tail_lines=diagnosis.LOG_TAIL_LINES,
                )
            except GpucanaryError as err:
                self.progress.line(f"rollout: cannot read the log of {cause.pod}/{cause.container}: {err}")
                return False
            if not text.startswith(LOG_GONE):
                break
        else:
            self.progress.line(f"rollout: cannot read the log of {cause.pod}/{cause.container}: {text.strip()}")
            return False
        record = diagnosis.log_record(cause, text, mono_ns=time.monotonic_ns(), wall_ns=time.time_ns())
        if record.object["lines"] == diagnosis.log_tail(recorder.records, cause):
            return False
        recorder.note(record)
        return True

    def _status_text(
        self, pool: Pool, recorder: Recorder, elapsed_s: float, release: str | None, waits_on: str | None = None
    ) -> str:
        node = pool.nodes[0]
        states = timeline.upgrade_states(recorder.records, node)
        events = timeline.node_events(recorder.records, node)
        last = events[-1].message.replace("Successfully updated node state label to ", "state -> ") if events else "-"
        state = states[-1] if states else "?"
        if state == "pod-restart-required" and _waits_for_requeue(release):
            since = timeline.label_transitions(recorder.records, node, op.UPGRADE_STATE_LABEL)[-1].received_wall_ns
            if any(
                op.is_driver_pod(p.labels) and p.ready and p.first_seen_wall_ns > since
                for p in timeline.live_pods(recorder.records, node=node)
            ):
                last = "new driver pod Ready; this release moves on at its next 2-minute requeue"
        return f"{node}: {state} | {elapsed_s:.0f}/{self.settings.upgrade_budget_s:.0f} s | {waits_on or last}"

    def _settle(self, pool: Pool, recorder: Recorder, probes: ProbeLoop, run: _Measured) -> None:
        """After the upgrade, give new work the chance to land again and the GPU job the time to complete
        (it works until its deadline, a replacement pod too), then let the probes in flight finish. All
        bounded: what has not happened by then is reported, not waited for."""
        wait_s = 2 * self.settings.probe_interval_s + 60
        job = run.gpu_job
        failed = [n for n in pool.nodes if timeline.terminal_state(recorder.records, n) == op.UPGRADE_FAILED]
        if run.stalled is not None or failed:  # the pool stays cordoned: nothing more will start or finish there
            why = "stalled" if run.stalled is not None else f"failed on {', '.join(failed)}"
            self.progress.line(f"the rollout {why}: not waiting for the GPU job or the probes in flight")
            probes.stop()
            return
        if all(timeline.terminal_state(recorder.records, n) == "upgrade-done" for n in pool.nodes):
            done_ns = time.time_ns()
            self._wait_quietly(
                recorder,
                lambda rs: (
                    True
                    if any(
                        p.scope == "pool" and p.created_wall_ns > done_ns and p.running_wall_ns
                        for p in probes.results(rs)
                    )
                    else None
                ),
                wait_s,
                "a pool probe running after the upgrade",
            )
            # a replacement evicted late is scheduled again after the uncordon and works its last round
            bound_s = max(0.0, (run.gpu_job_until_wall_ns - time.time_ns()) / 1e9) + JOB_COMPLETION_GRACE_S
        else:  # the pool is still cordoned: a replacement cannot start, only a running pod can finish
            bound_s = max(0.0, (run.gpu_job_until_wall_ns - time.time_ns()) / 1e9)
        self.progress.line(f"waiting for GPU job {job} to complete (at most {bound_s:.0f} s)")
        self._wait_quietly(recorder, lambda rs: _job_over(rs, job), bound_s, f"GPU job {job} complete")
        probes.stop()
        # a probe whose pod was evicted before it ran (a Job of backoffLimit 0) is over, not in flight
        self._wait_quietly(
            recorder,
            lambda rs: True if all(p.running_wall_ns or p.ended_wall_ns for p in probes.results(rs)) else None,
            self.settings.max_start_latency_s + 10,
            "every probe in flight running or ended",
        )

    def _wait_quietly(self, recorder: Recorder, predicate, timeout_s: float, what: str) -> None:
        try:
            recorder.wait_for(predicate, timeout_s=timeout_s, what=what)
        except TimeoutError as err:
            self.progress.line(str(err))


def _waits_for_requeue(release: str | None) -> bool:
    """From v26.3 the node watch reacts only to upgrade-state and skip labels: nothing but the controller's
    2-minute requeue ends pod-restart-required once the new driver pod is Ready."""
    series = op.release_series(release) if release else None
    return series is not None and series >= (26, 3)


def _job_over(records: list, job: WorkloadRef) -> bool | None:
    """The Job completed or failed for good, as the Job controller says."""
    seen = jobs.latest_job(records, namespace=job.namespace, name=job.name)
    return True if seen is not None and (seen.complete_wall_ns or seen.failed_reason) else None


def _running(records: list, namespace: str, role: str, *, finished_ok: bool = False) -> bool | None:
    phases = ("Running", "Succeeded") if finished_ok else ("Running",)
    pods = timeline.live_pods(records, namespace=namespace, label=(workloads.ROLE_LABEL, role))
    return True if any(p.phase in phases for p in pods) else None
