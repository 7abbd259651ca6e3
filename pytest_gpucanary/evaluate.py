"""Turn a finished run into ladder verdicts and a launch receipt on disk."""

from __future__ import annotations

import os
from pathlib import Path

from pytest_gpucanary import ladder, receipt
from pytest_gpucanary.config import Settings


def thresholds_from(settings: Settings) -> ladder.Thresholds:
    return ladder.Thresholds(upgrade_budget_s=settings.upgrade_budget_s, max_queue_delay_s=settings.max_queue_delay_s,
                             max_start_latency_s=settings.max_start_latency_s,
                             allowed_evictions=settings.allowed_evictions, max_error_ratio=settings.max_error_ratio,
                             max_p99_s=settings.max_p99_s, inconclusive_fails=not settings.allow_inconclusive)


def evidence_of(outcome) -> ladder.RunEvidence:
    return ladder.RunEvidence(
        records=tuple(outcome.records), pool_nodes=outcome.pool.nodes, driver_from=outcome.pool.driver_from,
        driver_to=outcome.driver_to, upgrade_started_wall_ns=outcome.upgrade_started_wall_ns,
        gpu_job=ladder.WorkloadRef(*outcome.gpu_job), service=ladder.WorkloadRef(*outcome.service),
        probes=tuple(ladder.ProbeResult(p.name, p.scope, p.created_wall_ns, p.scheduled_wall_ns, p.running_wall_ns,
                                        p.node) for p in outcome.probes),
        metric_checks=tuple(outcome.metric_checks), service_phases=tuple(outcome.service_phases),
        service_rate=tuple((p.start_wall_ns, p.bucket_s, p.requests, p.errors) for p in outcome.load_rate),
        upgrade_policy=outcome.upgrade_policy)


def evaluate_and_write(outcome, settings: Settings, *, policy_path: Path | None) -> None:
    evidence = evidence_of(outcome)
    outcome.result = ladder.evaluate(evidence, thresholds_from(settings))
    info = receipt.RunInfo(
        run_id=outcome.run_id, pool_nodes=outcome.pool.nodes, driver_from=outcome.pool.driver_from,
        driver_to=outcome.driver_to, policy_path=str(policy_path or ""), gpu_job_name=outcome.gpu_job[1],
        gpu_job_uid=outcome.gpu_job_uid, started_wall_ns=outcome.upgrade_started_wall_ns or 0,
        finished_wall_ns=outcome.finished_wall_ns or 0, ci=receipt.ci_identity(os.environ))
    outcome.receipt = {kind: str(path) for kind, path in
                       receipt.write_receipt(outcome.report_dir, outcome.result, info, evidence).items()}
