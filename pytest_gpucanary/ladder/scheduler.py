"""Scheduler: pool probes' queue delay (max) and fleet probes' start latency (p99), every quantile with
its n; too few samples is inconclusive. Pure: judges a RunEvidence.
"""

from __future__ import annotations

from pytest_gpucanary.config import DEFAULTS, Settings
from pytest_gpucanary.ladder.evidence import RunEvidence
from pytest_gpucanary.ladder.model import Evidence, LatencySummary, Outcome, ProbeScope, Stage, StageVerdict, summarize
from pytest_gpucanary.ladder.rules import Finding, metrics_note, stage_metrics, verdict


def _probe_samples(ev: RunEvidence, scope: ProbeScope) -> tuple[list[float], list[Finding], list[Evidence]]:
    """Queue delay (pool: scheduled - created) or start latency (fleet: running - created), in s."""
    samples, findings, items = [], [], []
    what = "scheduled" if scope is ProbeScope.POOL else "running"
    for p in (p for p in ev.probes if p.scope is scope):
        end = p.scheduled_wall_ns if scope is ProbeScope.POOL else p.running_wall_ns
        created = f"created at +{ev.offset_s(p.created_wall_ns):.0f}s"
        if end is None:
            gone = (
                f"its pod ended unstarted at +{ev.offset_s(p.ended_wall_ns):.0f}s"
                if p.ended_wall_ns
                else f"recording ended at +{ev.offset_s(ev.end_wall_ns()):.0f}s"
            )
            findings.append(Finding(Outcome.FAIL, f"{scope.value} probe {p.name} never {what} ({created}; {gone})"))
            items.append(
                Evidence(
                    p.created_wall_ns,
                    ev.offset_s(p.created_wall_ns),
                    "Probe",
                    p.name,
                    f"{scope.value} probe {created}, never {what}",
                )
            )
            continue
        seconds = max(0.0, (end - p.created_wall_ns) / 1e9)  # one clock, but stay sane if it steps back
        samples.append(seconds)
        items.append(
            Evidence(
                end,
                ev.offset_s(end),
                "Probe",
                p.name,
                f"{scope.value} probe {what} {seconds:.1f} s after creation on {p.node or 'no node'}",
            )
        )
    return samples, findings, items


def _probe_finding(
    scope: ProbeScope, stats: LatencySummary | None, settings: Settings
) -> tuple[Finding, Evidence | None]:
    what = "queue delay" if scope is ProbeScope.POOL else "start latency"
    n = stats.n if stats else 0
    if stats is None or n < settings.min_probe_samples:
        return Finding(
            Outcome.INCONCLUSIVE, f"{scope.value} probe {what} n={n} < min {settings.min_probe_samples} samples"
        ), None
    if scope is ProbeScope.POOL:
        line = f"pool probe queue delay p100 = {stats.max_s:.1f} s (n={n}; client receive time)"
        value, limit = stats.max_s, settings.max_queue_delay_s
    else:
        line = f"fleet probe start latency p99 = {stats.p99_s:.1f} s (n={n}; client receive time)"
        value, limit = stats.p99_s, settings.max_start_latency_s
    record = Evidence(None, None, "ProbeStats", scope.value, stats.describe(f"{scope.value} probe {what}"))
    if value > limit:
        return Finding(Outcome.FAIL, f"{line} > {limit:.0f} s"), record
    return Finding(Outcome.PASS, f"{line} <= {limit:.0f} s"), record


def check_scheduler(evidence: RunEvidence, settings: Settings = DEFAULTS) -> StageVerdict:
    """Pool probes' queue delay (max) and fleet probes' start latency (p99), every quantile with its n."""
    findings, items, passes = [], [], []
    for scope in ProbeScope:
        samples, never, probe_items = _probe_samples(evidence, scope)
        finding, stats_item = _probe_finding(scope, summarize(samples), settings)
        findings += never + [finding]
        items += probe_items + ([stats_item] if stats_item else [])
        passes.append(finding.line)
    metric_findings, metric_items = stage_metrics(evidence, Stage.SCHEDULER, settings)
    pass_line = "; ".join(passes) + metrics_note(metric_findings)
    return verdict(Stage.SCHEDULER, findings + metric_findings, items + metric_items, pass_line)
