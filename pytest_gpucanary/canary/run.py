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
  that changes the value (`canary.apply._save_and_patch`), or one patch doing both at once
  (`existing_node._mark`, `canary.apply.hold_back`);
- an undo, each one patch that puts the saved value back and drops its annotation in the same write,
  or a delete of an object found by its label; the Lease's namespace goes last;
- after the restore, the verdict (`publish.record`): a create or a conditional patch of the ConfigMap
  of its key, in the canary's own namespace; nothing to undo.
So a process killed between any two writes (SIGKILL, OOM, a lost machine) leaves only objects that
`gpucanary cleanup` finds by label or annotation and restores exactly, once the run's Lease is no
longer renewed. tests/canary/test_crash_sweep.py kills a run after each of its writes;
tests/fault_hooks.py is the hook that does it on a real cluster.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.canary import apply as upgrade
from pytest_gpucanary.canary import lease, preflight, publish, workloads
from pytest_gpucanary.canary.blast_radius import BlastRadiusWatch
from pytest_gpucanary.canary.claims import ClaimedGpus
from pytest_gpucanary.canary.cleanup import leftovers
from pytest_gpucanary.canary.collective import check_peer
from pytest_gpucanary.canary.lease import RunLease
from pytest_gpucanary.canary.load import LoadRun, check_locustfile
from pytest_gpucanary.canary.measures import MEASURED_AS_IS, LocalEndpoints, Measured, RunMeasures
from pytest_gpucanary.canary.outcome import RunOutcome, judge
from pytest_gpucanary.canary.pool import PoolProvider
from pytest_gpucanary.canary.pool.restore import SAVED_STATE_ANNOTATION
from pytest_gpucanary.canary.probes import ProbeLoop
from pytest_gpucanary.canary.recorder import Recorder
from pytest_gpucanary.canary.stage import RunStage
from pytest_gpucanary.canary.undo import RestoringStack
from pytest_gpucanary.canary.waits import RunWaits
from pytest_gpucanary.cluster import ClusterInfo
from pytest_gpucanary.config import Settings, flag
from pytest_gpucanary.errors import ConfigError, EnvError, GpucanaryError
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import NotFound
from pytest_gpucanary.ladder import (
    RunEvidence,
    stall,
)
from pytest_gpucanary.ladder.index import TimelineIndex
from pytest_gpucanary.policy.helm import HelmChart
from pytest_gpucanary.policy.model import UpgradePolicy
from pytest_gpucanary.policy.parse import load_policy
from pytest_gpucanary.progress import STEPS_FILE, ProgressLine, StepClock
from pytest_gpucanary.receipt.ci import ci_identity
from pytest_gpucanary.receipt.verdict import Verdict
from pytest_gpucanary.safe_text import redact_url

NAMESPACE_GONE_TIMEOUT_S = 180


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4]


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
            {"kind": "ClusterPolicy", **kube.get(*op.CLUSTER_POLICY, cluster.policy_name)},
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


class CanaryRun(RunStage, RunMeasures, RunWaits):
    def __init__(
        self,
        settings: Settings,
        kube: Kube,
        provider: PoolProvider,
        *,
        progress: ProgressLine,
        fleet: LocalEndpoints | None = None,
        policy: UpgradePolicy | None = None,
    ) -> None:
        self.settings, self.kube, self.provider, self.progress = settings, kube, provider, progress
        self.fleet = fleet  # the local fleet when it is the target: its ingress and Prometheus
        self.policy = policy  # the inputs as checked already (by the pytest session), else checked here

    def execute(self) -> RunOutcome:
        settings, clock = self.settings, StepClock()
        clock.next("preflight")
        policy = self.policy or check_inputs(settings, fleet_chart=self.fleet.helm_chart if self.fleet else None)
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
                run = Measured(
                    run_id,
                    pool,
                    upgrade_policy=policy.to_cr(),
                    dra_note=checked.dra_note,
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
                    self.kube,
                    report_dir / "timeline.jsonl",
                    self._streams(pool, placement, cluster.operator_namespace),
                    claimed_gpus=ClaimedGpus(self.kube),
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
                    claim_gpus=bool(run.gpu_claims),
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
        self, run: Measured, recorder: Recorder, probes: ProbeLoop, load: LoadRun | None, report_dir: Path
    ) -> RunOutcome:
        """Freeze what was recorded and measured into the run's evidence, judge it, write the receipt."""
        settings, pool = self.settings, run.pool
        if run.blast_radius is not None:
            with contextlib.suppress(GpucanaryError):  # what the watches saw stands when the read fails
                run.blast_radius.sweep()
        records = tuple(recorder.records)
        finished_wall_ns = time.time_ns()
        load_samples = self._collect_load(load, run)
        kept_as_measured = {name: getattr(run, name) for name in MEASURED_AS_IS}
        evidence = RunEvidence(
            records=records,
            pool_nodes=pool.nodes,
            driver_from=pool.driver_from,
            driver_to=self._driver_to,
            probes=tuple(probes.results(TimelineIndex(records))),
            metric_answers=self._collect_metrics(pool, run.upgrade_started_wall_ns, finished_wall_ns),
            load_samples=load_samples,
            policy_path=str(settings.policy),
            finished_wall_ns=finished_wall_ns,
            ci=ci_identity(os.environ),
            gpu_job_work_s=settings.job_duration_s,
            blast_radius=tuple(run.blast_radius.breaches) if run.blast_radius else (),
            pool_setup=tuple(line for line in (pool.fence, *pool.notes, run.gpu_claims) if line),
            unproven=(run.dra_note,) if run.dra_note else (),
            thresholds=settings.thresholds(),
            **kept_as_measured,
        )
        evidence.write(report_dir)
        return judge(evidence, settings, report_dir)

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
