"""Application: no evictions beyond the allowed ones, the GPU job completed, the service kept
its SLO in every upgrade phase. Pure: judges a RunEvidence.
"""

from __future__ import annotations

from collections.abc import Mapping

from pytest_gpucanary.config import DEFAULTS, Settings, flag
from pytest_gpucanary.gpu_operator import DRAIN_REQUIRED, POD_DELETION_REQUIRED, TERMINAL_STATES
from pytest_gpucanary.label_selector import parse_selector
from pytest_gpucanary.ladder.evidence import RunEvidence
from pytest_gpucanary.ladder.model import Eviction, Evidence, Outcome, Stage, StageVerdict, UpgradePhase
from pytest_gpucanary.ladder.rules import Finding, metrics_note, stage_metrics, verdict

# workloads.ROLE_LABEL on the canary's instruments: the start probe Jobs and the collective probe's pods
PROBE_ROLES = ("gpucanary.io/role", ("probe", "collective-probe"))


def allows_eviction(settings: Settings, *, gpus: int, labels: Mapping[str, str]) -> bool:
    if settings.allowed_evictions == "gpu":
        return gpus > 0
    return all(req(labels) for req in parse_selector(settings.allowed_evictions))


def allowed_text(rule: str) -> str:
    """How a receipt names the --gpucanary-allowed-evictions rule."""
    return "GPU pods only" if rule == "gpu" else f"pods matching {rule}"


def _is_probe(labels: Mapping[str, str]) -> bool:
    """The canary's own probes are instruments: their figures are judged, not their eviction."""
    return labels.get(PROBE_ROLES[0]) in PROBE_ROLES[1]


def evictions(evidence: RunEvidence, settings: Settings | None = None) -> list[Eviction]:
    """Non-DaemonSet pods removed from pool nodes between upgrade start and the node's terminal state.

    DaemonSet pods are left out: the operator restarts its own operands (driver, validators) by design,
    and neither pod deletion nor drain touches DaemonSet pods. So are the canary's probes."""
    settings = settings or DEFAULTS
    pods = {(p.namespace, p.name): p for p in evidence.index.latest_pods()}
    found = []
    for node in evidence.pool_nodes:
        cycle = evidence.index.upgrade_cycle(node, since_wall_ns=evidence.upgrade_started_wall_ns)
        drain_ns = next((t.received_wall_ns for t in cycle if t.state == DRAIN_REQUIRED), None)
        end_ns = next((t.received_wall_ns for t in cycle if t.state in TERMINAL_STATES), None)
        for gone in evidence.index.pods_gone(node):
            seen = pods.get((gone.namespace, gone.name))
            if gone.received_wall_ns < evidence.upgrade_started_wall_ns or (
                end_ns is not None and gone.received_wall_ns > end_ns
            ):
                continue
            if seen is not None and ("DaemonSet" in seen.owner_kinds or _is_probe(seen.labels)):
                continue
            allowed = allows_eviction(settings, gpus=gone.gpus, labels=seen.labels if seen else {})
            found.append(
                Eviction(
                    node,
                    gone.namespace,
                    gone.name,
                    gone.gpus,
                    gone.disruption_reason,
                    drain_ns is not None and drain_ns <= gone.received_wall_ns,
                    allowed,
                    gone.received_wall_ns,
                    evidence.offset_s(gone.received_wall_ns),
                    allowed_text(settings.allowed_evictions),
                )
            )
    return sorted(found, key=lambda e: e.received_wall_ns)


def _gpu_job(ev: RunEvidence) -> tuple[Finding, list[Evidence]]:
    """The Job's own completion (the Job controller's Complete condition), not a pod's state: a replacement
    pod that is Running has not done the work yet. A timeline without Job records (recorded before the
    canary watched Jobs) falls back to a Succeeded pod, which is what completes a one-pod Job."""
    job = ev.gpu_job
    pods = [p for p in ev.index.pods_in(job.namespace) if p.labels.get("job-name") == job.name]
    items = [
        Evidence(
            p.received_wall_ns,
            ev.offset_s(p.received_wall_ns),
            "Pod",
            f"{p.namespace}/{p.name}",
            f"GPU job pod {p.phase or 'unknown'}" + (" (removed)" if p.removed_wall_ns else ""),
        )
        for p in pods
    ]
    seen = ev.index.latest_job(namespace=job.namespace, name=job.name)
    if seen is not None:
        items.append(
            Evidence(
                seen.received_wall_ns,
                ev.offset_s(seen.received_wall_ns),
                "Job",
                str(job),
                f"succeeded={seen.succeeded} failed={seen.failed} active={seen.active}"
                + (" Complete" if seen.complete_wall_ns else "")
                + (f" Failed ({seen.failed_reason})" if seen.failed_reason else ""),
            )
        )
    if seen is None and not pods:
        return Finding(Outcome.INCONCLUSIVE, f"no pods of GPU job {job} recorded (label job-name={job.name})"), items
    evicted = sum(1 for p in pods if p.disruption_reason)
    if seen is not None and seen.complete_wall_ns:
        return Finding(
            Outcome.PASS,
            f"GPU job {job} completed at +{ev.offset_s(seen.complete_wall_ns):.0f}s "
            f"({len(pods)} pod(s), {evicted} evicted)",
        ), items
    if seen is None and (done := next((p for p in pods if p.phase == "Succeeded"), None)):
        return Finding(Outcome.PASS, f"GPU job {job} succeeded (pod {done.name})"), items
    phases = ", ".join(f"{p.name} {p.phase or 'unknown'}" for p in pods) or "no pods"
    worked_s = ev.index.run_seconds(namespace=job.namespace, job_name=job.name)
    asked = f" of {ev.gpu_job_work_s:.0f} s" if ev.gpu_job_work_s else ""
    deadline = f", deadline +{ev.offset_s(ev.gpu_job_until_wall_ns):.0f}s" if ev.gpu_job_until_wall_ns else ""
    why = (
        f"Job Failed ({seen.failed_reason})" if seen is not None and seen.failed_reason else "expected the Job Complete"
    )
    return Finding(
        Outcome.FAIL,
        f"GPU job {job} did not finish ({phases} at +{ev.offset_s(ev.end_wall_ns()):.0f}s; "
        f"{why}; its pods ran {worked_s:.0f} s{asked}{deadline}, {evicted} evicted)",
    ), items


def _job_met_pod_deletion(ev: RunEvidence) -> Finding | None:
    """The policy's GPU pod deletion (and a drain it falls back to) is tried on the GPU job only if the job
    still runs when its node reaches pod-deletion-required. A job done by then leaves nothing to refuse,
    and a policy that would refuse it (the field note's) would pass unseen: inconclusive, not a pass.
    Not asked when the policy waits for jobs by a pod selector: a job done first is what it asks for."""
    if ((ev.upgrade_policy.get("waitForCompletion") or {}).get("podSelector") or "") or not ev.pool_nodes:
        return None
    node, job = ev.pool_nodes[0], ev.gpu_job
    cycle = ev.index.upgrade_cycle(node, since_wall_ns=ev.upgrade_started_wall_ns)
    at_ns = next((t.received_wall_ns for t in cycle if t.state == POD_DELETION_REQUIRED), None)
    if at_ns is None:
        return None  # a restart in place, or not got there: rollout says which
    pods = [
        p
        for p in ev.index.latest_pods(until_wall_ns=at_ns, ever_on=node)
        if p.namespace == job.namespace and p.labels.get("job-name") == job.name and p.node == node
    ]
    if any(p.phase in ("Pending", "Running") for p in pods):
        return None
    states = ", ".join(f"{p.name} {p.phase or 'unknown'}" for p in pods) or "no pod on the node"
    return Finding(
        Outcome.INCONCLUSIVE,
        f"GPU job {job} was not running when {node} reached {POD_DELETION_REQUIRED} "
        f"at +{ev.offset_s(at_ns):.0f}s ({states}): the policy's GPU pod deletion "
        f"was not tried on it; give it a longer {flag('job_duration_s')}",
    )


def _phases_not_passed(ev: RunEvidence) -> set[UpgradePhase]:
    """Phases the first pool node's whole, ended upgrade cycle never entered; none while it is unknown."""
    node = ev.pool_nodes[0] if ev.pool_nodes else ""
    windows = ev.index.phase_windows(node, since_wall_ns=ev.upgrade_started_wall_ns)
    if not windows or windows[-1].phase is not UpgradePhase.AFTER:
        return set()
    return set(UpgradePhase) - {w.phase for w in windows}


def _service_phases(ev: RunEvidence, settings: Settings) -> tuple[list[Finding], list[Evidence]]:
    findings, items = [], []
    by_phase = {s.phase: s for s in ev.service_phases}
    not_passed = _phases_not_passed(ev)
    for phase in UpgradePhase:
        s = by_phase.get(phase)
        if phase in not_passed:
            items.append(
                Evidence(
                    None,
                    None,
                    "LoadStats",
                    f"{ev.service}@{phase.value}",
                    f"phase {phase.value} not passed: the pool's upgrade went round it (a restart "
                    f"in place has no drain)",
                )
            )
            continue
        if s is None or s.requests < settings.min_phase_requests:
            findings.append(
                Finding(
                    Outcome.INCONCLUSIVE,
                    f"service {ev.service} has too few requests in phase "
                    f"{phase.value} to judge (n={s.requests if s else 0} < "
                    f"min {settings.min_phase_requests})",
                )
            )
            continue
        ratio = s.failures / s.requests
        items.append(
            Evidence(
                None,
                None,
                "LoadStats",
                f"{ev.service}@{phase.value}",
                f"{s.requests} requests, {s.failures} failed (ratio {ratio:.4f}), p50 = {s.p50_s} s, "
                f"p95 = {s.p95_s} s, p99 = {s.p99_s} s (n={s.requests}; load generator clock)",
            )
        )
        if ratio > settings.max_error_ratio:
            findings.append(
                Finding(
                    Outcome.FAIL,
                    f"service {ev.service} error ratio {ratio:.3f} in phase "
                    f"{phase.value} ({s.failures}/{s.requests} requests) > "
                    f"{settings.max_error_ratio:g}",
                )
            )
        if s.p99_s is None:
            findings.append(Finding(Outcome.INCONCLUSIVE, f"service {ev.service} p99 missing in phase {phase.value}"))
        elif s.p99_s > settings.max_p99_s:
            findings.append(
                Finding(
                    Outcome.FAIL,
                    f"service {ev.service} p99 = {s.p99_s:.3f} s in phase {phase.value} "
                    f"(n={s.requests}) > {settings.max_p99_s:g} s",
                )
            )
    return findings, items


def check_application(evidence: RunEvidence, settings: Settings = DEFAULTS) -> StageVerdict:
    """No evictions beyond the allowed ones; the GPU job completed; the service kept its SLO per phase."""
    removed = evictions(evidence, settings)
    findings = [Finding(Outcome.FAIL, e.line()) for e in removed if not e.allowed]
    items = [
        Evidence(
            e.received_wall_ns,
            evidence.offset_s(e.received_wall_ns),
            "Pod",
            f"{e.namespace}/{e.name}",
            f"{e.line()}; DisruptionTarget={e.disruption_reason or 'not seen'}; "
            f"{'allowed' if e.allowed else 'NOT allowed'}",
        )
        for e in removed
    ]
    job_finding, job_items = _gpu_job(evidence)
    findings.append(job_finding)
    if (untried := _job_met_pod_deletion(evidence)) is not None:
        findings.append(untried)
    if evidence.service_phases:
        service_findings, service_items = _service_phases(evidence, settings)
        service_note = f"service {evidence.service} within SLO in all {len(UpgradePhase)} phases"
    else:
        service_findings, service_items = [], []
        service_note = f"service {evidence.service} judged on evictions only (no load stats)"
    metric_findings, metric_items = stage_metrics(evidence, Stage.APPLICATION, settings)
    allowed = sum(e.allowed for e in removed)
    pass_line = (
        f"{allowed} allowed eviction(s), 0 others ({allowed_text(settings.allowed_evictions)}); {job_finding.line}; "
        f"{service_note}{metrics_note(metric_findings)}"
    )
    return verdict(
        Stage.APPLICATION,
        findings + service_findings + metric_findings,
        items + job_items + service_items + metric_items,
        pass_line,
    )
